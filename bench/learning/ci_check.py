"""The measures of the CI learning test (``tests/app/test_learning.py``) and the spread
behind its thresholds: a shipped recipe trained with the real ``pretrain`` command (2 DDP
processes) on 6,000 cluttered-digit canvases for a given number of epochs, then its
backbone features beside those of the untrained encoder it started from, on 1,000 test
canvases:

- weighted kNN top-1 (k = 20) and linear-probe top-1 (50 epochs): class structure;
- view retrieval top-1: each test canvas's first augmented view (the recipe's own
  augmentation) finds its second view among all 1,000 second views by cosine similarity,
  the instance discrimination InfoNCE trains for;
- caption retrieval R@1, for a recipe with a text tower (CLIP): each test canvas's
  projection finds its own caption among the test canvases' distinct captions, embedded
  by the run's text tower; what only the captions can teach.

    python -m bench.learning.ci_check --recipe infonce --epochs 2 --seeds 0 1 2 3 4
    python -m bench.learning.ci_check --recipe xclr_captions --captions alt_text --epochs 2
    python -m bench.learning.ci_check --recipe clip --epochs 1

A recipe that reads a caption store (X-CLR from captions) gets the training shards' own,
built once beside them with ``graph-precompute``'s code.

Prints per seed untrained -> trained (gain) and, per measure, the gain's mean, standard
deviation and mean - 3 sd (the highest threshold the test may assert); writes
``ci_check-<recipe>-<captions>-e<epochs>[-<key=value>...].json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from app.run_config import RunConfig
from bench.common import write_json
from core.config import load_config
from data_pipeline.config import DataConfig, ShardsConfig
from data_pipeline.graph.config import GraphConfig
from data_pipeline.graph.job import run_captions
from data_pipeline.loader import eval_batches
from data_pipeline.loader.epochs import train_batches
from data_pipeline.make_shards import make_shards
from data_pipeline.shards import ShardSet
from evaluation.knn import build_index, knn_accuracy
from evaluation.load import from_checkpoint
from evaluation.probe import linear_probe
from evaluation.retrieval import caption_recall
from pretrain.model.encoder import build_model
from pretrain.run.checkpoint import list_checkpoints
from registry.package import EmbeddingModel

REPO = Path(__file__).resolve().parents[2]
TRAIN, TEST = 6000, 1000  # canvases, as in the learning benchmark
PROBE_EPOCHS, PROBE_LR = 50, 0.1  # the learning benchmark's probe
MEASURES = ("knn", "probe", "views", "captions")


@dataclass(frozen=True)
class Canvases:
    """Every canvas of a shard set as the evaluation loader decodes it, kept in the
    loader's batches: a forward over them is the one
    :func:`evaluation.features.extract` runs, and its rows are put in key order as
    ``extract`` puts them. Decoded once, embedded by each encoder scored."""

    batches: list[torch.Tensor]  # [b, 3, R, R] each, in the loader's order
    order: torch.Tensor  # [n] the rows in key order
    labels: torch.Tensor  # [n] in key order
    classes: int
    captions: list[str]  # [n] in key order


@dataclass(frozen=True)
class Scores:
    """An encoder's measures; None: not measured (or, for captions, no text tower)."""

    knn: float | None  # weighted kNN top-1, k = 20, backbone
    probe: float | None  # linear probe top-1, backbone
    views: float | None  # view retrieval top-1 among the test canvases, backbone
    captions: float | None = None  # caption retrieval R@1 (projector, text tower)


def cluttered(root: Path, captions: str = "attributes",
              splits: tuple[str, ...] = ("train", "test")) -> list[Path]:
    """The ``splits`` shards (train, test) of the cluttered digits with ``captions``
    captions (``shards.captions``) under ``root`` (made once)."""
    common = {"source": "cluttered_digits", "shard_size": 1000, "workers": 2,
              "captions": captions}
    out = []
    for split, samples in (("train", TRAIN), ("test", TEST)):
        if split not in splits:
            continue
        path = root / captions / split
        if not (path / "manifest.json").is_file():
            make_shards(ShardsConfig(**common, split=split, samples=samples,
                                     output=str(path)))
        out.append(path)
    return out


def caption_store(train: Path, center: bool = False) -> Path:
    """The caption store of the ``train`` shards (``graph-precompute``, task ``captions``,
    the bundled sentence model, ``graph.center`` as given), beside them; made once."""
    store = train.parent / ("captions-centred" if center else "captions")
    if not (store / "meta.json").is_file():
        run_captions(GraphConfig(shards=str(train), output=str(store), center=center))
    return store


def recipe_path(recipe: str) -> Path:
    return REPO / "launch" / "configs" / "cluttered" / f"{recipe}.yaml"


def overrides(recipe: str, run_dir: Path, train: Path, epochs: int, seed: int) -> list[str]:
    """The check's keys for ``recipe``: its shards (and their caption store where the recipe
    reads one), epochs and seed, no tracking, one checkpoint at the end."""
    keys = [f"output_dir={run_dir.parent}", f"name={run_dir.name}", f"data.shards={train}",
            f"train.epochs={epochs}", f"seed={seed}", f"data.seed={seed}",
            "tracking.enabled=false", "train.progress=false", "checkpoint.every=0"]
    config = load_config(RunConfig, recipe_path(recipe))
    if config.data.caption_store:  # made as the recipe's graph section says
        keys.append(f"data.caption_store={caption_store(train, config.graph.center)}")
    return keys


def pretrain_args(recipe: str, keys: list[str]) -> list[str]:
    """The ``pretrain`` command's arguments for ``recipe`` with ``keys``."""
    return ["--config", str(recipe_path(recipe)), *keys]


def pretrain(recipe: str, keys: list[str], timeout: float) -> subprocess.CompletedProcess:
    """The real ``pretrain`` command on 2 processes."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "2", "-m", "app.pretrain", *pretrain_args(recipe, keys)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def untrained(recipe: str, keys: list[str]) -> EmbeddingModel:
    """The encoder the run started from: the same seed, the same construction."""
    config = load_config(RunConfig, recipe_path(recipe), keys)
    torch.manual_seed(config.seed)
    model = build_model(config.model, config.objective, torch.device("cpu"))
    return EmbeddingModel(model.encoder, model.text)


def trained(run_dir: Path) -> EmbeddingModel:
    return from_checkpoint(list_checkpoints(run_dir)[0])[0]


def canvases(shards: Path) -> Canvases:
    batches, keys, labels, captions = [], [], [], []
    for batch in eval_batches(DataConfig(shards=str(shards), batch_size=256, workers=1,
                                         resolution=32)):
        batches.append(batch["images"])
        keys += batch["keys"]
        labels.append(batch["labels"])
        captions += batch["captions"]
    order = torch.tensor(sorted(range(len(keys)), key=keys.__getitem__), dtype=torch.long)
    return Canvases(batches, order, torch.cat(labels)[order],
                    len(ShardSet.open(str(shards)).class_names),
                    [captions[i] for i in order.tolist()])


@torch.no_grad()
def backbone(model: EmbeddingModel, canvases: Canvases) -> torch.Tensor:
    """``model``'s backbone features [n, F] of ``canvases``, in key order."""
    model = model.eval()
    rows = [model.encoder(images)[0].float() for images in canvases.batches]
    return torch.cat(rows)[canvases.order]


def class_structure(model: EmbeddingModel, train: Canvases,
                    test: Canvases) -> tuple[float, float]:
    """Weighted kNN top-1 (k = 20) and linear-probe top-1 of ``model``'s backbone features
    of the test canvases, the training canvases as the bank."""
    bank, queries = backbone(model, train), backbone(model, test)
    accuracy, _ = knn_accuracy(build_index(bank, "exact"), train.labels, queries,
                               test.labels, [20], 0.07, train.classes)
    probe = linear_probe(bank, train.labels, queries, test.labels, train.classes,
                         PROBE_EPOCHS, PROBE_LR)
    return accuracy["k20"]["top1"], probe["top1"]


@torch.no_grad()
def view_retrieval(model: EmbeddingModel, views: list[torch.Tensor]) -> float:
    """Top-1 of each first view's cosine nearest neighbour among all second views being
    its own second view (``views``: :func:`views_of_test`)."""
    model = model.eval()
    first, second = [], []
    for images in views:
        features = F.normalize(model.encoder(images)[0].float(), dim=1)
        half = features.shape[0] // 2  # [2B, F]: the B first views, then the B second
        first.append(features[:half])
        second.append(features[half:])
    similarity = torch.cat(first) @ torch.cat(second).T  # [N, N]
    return (similarity.argmax(1) == torch.arange(similarity.shape[0])).float().mean().item()


@torch.no_grad()
def caption_retrieval(model: EmbeddingModel, test: Canvases) -> float | None:
    """Image-to-text R@1 of the test canvases' projections among their distinct captions
    embedded by ``model``'s text tower (``evaluation.retrieval``); None without a tower."""
    if model.text is None:
        return None
    model = model.eval()
    images = F.normalize(torch.cat([model(batch).float() for batch in test.batches]),
                         dim=1)[test.order]
    recall, _ = caption_recall(model, images, test.captions, torch.device("cpu"), 256, [1])
    return recall["image_to_text"]["R@1"]


def scores(model: EmbeddingModel, train: Canvases, test: Canvases,
           views: list[torch.Tensor] | None, measures: Collection[str] = MEASURES) -> Scores:
    """``measures`` of ``model`` (:data:`MEASURES`: its backbone features' three, and
    caption retrieval), the others None; ``views`` (:func:`views_of_test`) for "views"."""
    knn = probe = None
    if {"knn", "probe"} & set(measures):
        knn, probe = class_structure(model, train, test)
    return Scores(knn, probe, view_retrieval(model, views) if "views" in measures else None,
                  caption_retrieval(model, test) if "captions" in measures else None)


def views_of_test(recipe: str, keys: list[str], test: Path) -> list[torch.Tensor]:
    """The recipe's augmentation over the test shards, every canvas once, in one worker and
    a fixed order of draws: batches [2B, 3, R, R] of the B first views, then the B second.
    Drawn once, embedded by each encoder scored; the test canvases' captions are not read."""
    data = load_config(RunConfig, recipe_path(recipe), keys).data
    views = dataclasses.replace(data, shards=str(test), caption_store="", workers=1,
                                batch_size=250)
    return [batch["images"] for batch in train_batches(views)]


def run_name(recipe: str, captions: str, epochs: int, extra: list[str]) -> str:
    """``<recipe>-<captions>-e<epochs>``, then each extra override as ``key=value``."""
    return "-".join([recipe, captions, f"e{epochs}", *extra])


def measure(recipe: str, epochs: int, seed: int, root: Path, captions: str = "attributes",
            extra: tuple[str, ...] = ()) -> dict[str, dict[str, float]]:
    """Untrained and trained scores of one seed (kept in the run's ``result.json``);
    ``extra``: ``key=value`` overrides after the check's own."""
    train, test = cluttered(root / "shards", captions)
    run_dir = root / "runs" / f"{run_name(recipe, captions, epochs, list(extra))}-s{seed}"
    if (run_dir / "result.json").is_file():
        return json.loads((run_dir / "result.json").read_text())
    keys = [*overrides(recipe, run_dir, train, epochs, seed), *extra]
    result = pretrain(recipe, keys, timeout=3600)
    if result.returncode != 0:
        raise SystemExit(f"{run_dir}: pretrain failed\n{result.stderr[-3000:]}")
    views = views_of_test(recipe, keys, test)
    decoded = canvases(train), canvases(test)
    result = {"untrained": scores(untrained(recipe, keys), *decoded, views),
              "trained": scores(trained(run_dir), *decoded, views)}
    result = {name: dataclasses.asdict(value) for name, value in result.items()}
    write_json(run_dir / "result.json", result)
    return result


def summary(gains: list[float]) -> dict[str, float]:
    mean = statistics.fmean(gains)
    sd = statistics.stdev(gains) if len(gains) > 1 else math.nan
    least = mean - 3 * sd
    return {"mean": mean, "sd": sd, "mean_minus_3sd": least,
            "threshold": math.floor(1000 * least) / 1000 if math.isfinite(least) else least}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="infonce")
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--captions", choices=["attributes", "alt_text"], default="attributes",
                        help="the cluttered digits' caption set (shards.captions)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="overrides of the recipe after the check's own")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "ci_check")
    args = parser.parse_args()
    per_seed = {}
    for seed in args.seeds:
        per_seed[seed] = measure(args.recipe, args.epochs, seed, args.out, args.captions,
                                 tuple(args.set))
        print(seed, json.dumps(per_seed[seed]), flush=True)
    report = {"recipe": args.recipe, "captions": args.captions, "epochs": args.epochs,
              "set": args.set, "per_seed": per_seed,
              "cpu_capability": torch.backends.cpu.get_cpu_capability(), "summary": {}}
    print("| measure | per seed: untrained -> trained (gain) | gain mean ± sd | mean - 3 sd |")
    print("| --- | --- | --- | --- |")
    for name in MEASURES:
        rows = [(r["untrained"][name], r["trained"][name]) for r in per_seed.values()
                if r["trained"].get(name) is not None]
        if not rows:
            continue
        stats = report["summary"][name] = summary([after - before for before, after in rows])
        cells = ", ".join(f"{b:.3f} -> {a:.3f} ({a - b:+.3f})" for b, a in rows)
        print(f"| {name} | {cells} | {stats['mean']:.3f} ± {stats['sd']:.3f} "
              f"| {stats['mean_minus_3sd']:.3f} |")
    path = args.out / f"ci_check-{run_name(args.recipe, args.captions, args.epochs, args.set)}.json"
    write_json(path, report)


if __name__ == "__main__":
    main()
