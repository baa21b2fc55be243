"""Training learns. On the cluttered digits an untrained encoder sits near chance (10
classes: 0.1); a shipped recipe trained through the real ``pretrain`` command (2 DDP
processes under torchrun, forked from a pre-imported interpreter as ``tests/prewarmed.py``
describes; the learning benchmark's 6,000 training canvases) must move its backbone
features above the untrained encoder it started from, on 1,000 test canvases.

Each run lands where its seed and the CPU's kernels take it, so each threshold sits 3
standard deviations below the mean gain over seeds 0-4 (``docs/learning.md``, "What CI
asserts", with the command that measured them); the run here is seed 0.

- SupCon trains 2 of its recipe's 10 epochs and must gain in class structure: the linear
  probe's top-1 (its weighted kNN gain at 2 epochs leaves no threshold 3 standard
  deviations below its mean and above zero). What this still proves: the labels'
  positives, through the real command and the gathering boundary, teach the encoder the
  classes of canvases it never saw. The whole recipe's margins are the learning
  benchmark's claims.
- InfoNCE trains 2 of its recipe's 30 epochs (its whole recipe took 11-15 minutes here).
  What this still proves: InfoNCE's gradient, through the real command and the gathering
  boundary, teaches the encoder features whose class structure rises on canvases it never
  saw (the linear probe's top-1) and whose views of one canvas find each other (view
  retrieval). That the whole recipe reaches the benchmark's class-level margins is claim
  (a) of the learning benchmark, judged over its seeds, not here.
- X-CLR from captions trains 2 of its recipe's 30 epochs on the alt-text captions (web-like:
  the digit named among uninformative words, or nothing named), its soft targets from the
  training canvases' caption store, which the check builds with ``graph-precompute``. What
  this still proves: image-caption pairs, through the caption store, the real command and
  the gathering boundary, train an encoder that gains on canvases it never saw (the
  linear probe); that the captions rather than the views carry the gain is the
  benchmark's 30-epoch comparison, not this check's.
- CLIP trains 1 of its recipe's 30 epochs on the attribute captions (colours, position and
  size besides the digit) against the frozen sentence model. What this proves: the
  captions themselves, through the shards, the text tower and the gathering boundary, teach
  the image projection to find each unseen canvas's own caption among the test set's
  distinct captions (caption retrieval R@1; the untrained encoder sits at chance). With
  every training canvas given another canvas's caption (planted in the shards) the same
  run stays at chance, so this check fails: the captions, not the views, carry it. On the
  alt-text captions CLIP and SigLIP leave their plateau only after 500-700 steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench import records
from bench.learning import ci_record
from bench.learning.ci_check import (
    MEASURES,
    Canvases,
    canvases,
    class_structure,
    cluttered,
    overrides,
    pretrain_args,
    scores,
    trained,
    untrained,
    views_of_test,
)
from evaluation.identity import model_digest
from tests.app.helpers import run_pretrain
from tests.scratch import scratch_dir

pytestmark = pytest.mark.long_file  # collected first: tests/conftest.py


@dataclass(frozen=True)
class Check:
    """A recipe, the epochs it trains, and the least gain (trained minus untrained top-1)
    it must show; None: not asserted."""

    recipe: str  # launch/configs/cluttered/<recipe>.yaml
    epochs: int
    knn_gain: float | None  # weighted kNN top-1, k = 20, backbone
    probe_gain: float | None  # linear probe top-1, backbone
    views_gain: float | None  # view retrieval top-1 among the test canvases, backbone
    captions: str = "attributes"  # the training canvases' caption set (shards.captions)
    captions_gain: float | None = None  # caption retrieval R@1 (projector, text tower)


# at most mean - 3 sd of the gain over seeds 0-4 in the record learning/ci_check
# (docs/learning.md, "What CI asserts"; the test below holds them to it); a kNN gain at these
# epochs leaves no such threshold above zero
CHECKS = [Check("infonce", 2, knn_gain=None, probe_gain=0.004, views_gain=0.005),
          Check("supcon", 2, knn_gain=None, probe_gain=0.062, views_gain=0.057),
          Check("xclr_captions", 2, knn_gain=None, probe_gain=0.010, views_gain=None,
                captions="alt_text"),
          Check("clip", 1, knn_gain=None, probe_gain=None, views_gain=None,
                captions_gain=0.021)]


def test_each_threshold_sits_at_least_3_sd_below_the_recorded_mean_gain():
    """The record of the spread is of the checks run here, over 5 seeds or more, and no
    threshold asks more than its recorded mean - 3 sd."""
    checks = records.read_record(ci_record.NAME)["figures"]["checks"]
    spread = {(c["recipe"], c["captions"], c["epochs"]): c["measures"] for c in checks}
    assert set(spread) == {(c.recipe, c.captions, c.epochs) for c in CHECKS}
    assert set(ci_record.CHECKS) == set(spread)
    for check in CHECKS:
        measures = spread[check.recipe, check.captions, check.epochs]
        for measure in MEASURES:
            threshold = getattr(check, f"{measure}_gain")
            if threshold is not None:
                got = measures[measure]
                assert len(got["gains"]) >= 5, (check.recipe, measure)
                assert threshold <= got["mean_minus_3sd"], (check.recipe, measure, got)


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Path]]:
    with scratch_dir(tmp_path_factory, "cluttered") as root:
        yield cluttered(root)


@pytest.fixture(scope="module")
def training_shards(tmp_path_factory: pytest.TempPathFactory,
                    shards) -> Iterator[Callable[[str], Path]]:
    """The training shards with a caption set's captions, made once a set. Both sets hold
    the same canvases under the same keys (``tests/data_pipeline/test_cluttered.py``), so
    every check is scored on the attribute shards' canvases."""
    made = {"attributes": shards[0]}
    with contextlib.ExitStack() as made_dirs:
        def with_captions(captions: str) -> Path:
            if captions not in made:
                root = made_dirs.enter_context(scratch_dir(tmp_path_factory, captions))
                made[captions] = cluttered(root, captions, splits=("train",))[0]
            return made[captions]
        yield with_captions


@pytest.fixture(scope="module")
def decoded(shards) -> tuple[Canvases, Canvases]:
    """The training and test canvases, decoded once for every encoder scored."""
    return canvases(shards[0]), canvases(shards[1])


@pytest.fixture(scope="module")
def untrained_class_structure() -> dict[str, tuple[float, float]]:
    """kNN and probe top-1 of an untrained encoder, by its parameters: the recipes build
    the same encoder from seed 0, so later ones reuse the first's (their view retrieval
    differs: each recipe draws its own augmentation)."""
    return {}


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("check", CHECKS, ids=[c.recipe for c in CHECKS])
def test_recipe_learns_beyond_the_untrained_encoder(shards, training_shards, decoded,
                                                    untrained_class_structure, tmp_path, check):
    test = shards[1]
    keys = overrides(check.recipe, tmp_path / "run", training_shards(check.captions),
                     check.epochs, seed=0)
    result = run_pretrain(pretrain_args(check.recipe, keys), nproc=2, timeout=1500)
    assert result.returncode == 0, result.stderr[-3000:]
    asserted = [m for m in MEASURES if getattr(check, f"{m}_gain") is not None]
    views = views_of_test(check.recipe, keys, test) if "views" in asserted else None
    start = untrained(check.recipe, keys)
    fingerprint, classes = model_digest(start), {"knn", "probe"} & set(asserted)
    if classes and fingerprint not in untrained_class_structure:
        untrained_class_structure[fingerprint] = class_structure(start, *decoded)
    before = scores(start, *decoded, views, set(asserted) - classes)
    if classes:
        knn, probe = untrained_class_structure[fingerprint]
        before = dataclasses.replace(before, knn=knn, probe=probe)
    after = scores(trained(tmp_path / "run"), *decoded, views, asserted)
    report = ", ".join(f"{m} {getattr(before, m):.3f} -> {getattr(after, m):.3f}"
                       for m in asserted) + f"; asserted gains {check}"
    print(report)
    for measure in asserted:
        assert getattr(after, measure) - getattr(before, measure) >= getattr(
            check, f"{measure}_gain"), report
