"""Training learns. On the cluttered digits an untrained encoder sits near chance, and the
shipped recipes must clear it by the margins of the learning benchmark's claim (a): 15
kNN points for InfoNCE, 30 for SupCon (weighted kNN top-1, k = 20, backbone features),
through the real ``pretrain`` command with 2 DDP processes, on the benchmark's data.
SupCon runs its whole recipe (10 epochs); InfoNCE runs 10 of its recipe's 30 epochs, which
clear the margin at this seed (0.142 -> 0.324 in the benchmark) but not at every seed: the
30 are for those. Smaller budgets fail: with 3,000 canvases and 300 steps InfoNCE went
0.127 -> 0.170, and SupCon at 5 epochs went 0.142 -> 0.401. ``docs/learning.md`` gives the
full benchmark, its spread over seeds, and so how much room each margin has."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from app.run_config import RunConfig
from core.config import load_config
from data_pipeline.config import DataConfig, ShardsConfig
from data_pipeline.make_shards import make_shards
from evaluation.features import extract
from evaluation.knn import build_index, knn_accuracy
from evaluation.load import from_checkpoint
from pretrain.checkpoint import list_checkpoints
from pretrain.model import build_model
from pretrain.registry import EmbeddingModel
from tests.app.helpers import REPO, run_pretrain

TRAIN, TEST = 6000, 1000  # canvases, as in the learning benchmark
CASES = [("infonce", 0.15, 10), ("supcon", 0.30, 10)]  # recipe, margin, epochs


@pytest.fixture(scope="module")
def cluttered(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("cluttered")
    common = {"source": "cluttered_digits", "shard_size": 1000, "workers": 2}
    for split, samples in (("train", TRAIN), ("test", TEST)):
        make_shards(ShardsConfig(**common, split=split, samples=samples,
                                 output=str(root / split)))
    return root / "train", root / "test"


def knn_top1(model: EmbeddingModel, train: Path, test: Path) -> float:
    loader = DataConfig(shards=str(train), batch_size=256, workers=1, resolution=32)
    cpu = torch.device("cpu")
    bank = extract(model, loader, str(train), cpu, progress=False)
    queries = extract(model, loader, str(test), cpu, progress=False)
    accuracy, _ = knn_accuracy(build_index(bank.backbone, "exact"), bank.labels,
                               queries.backbone, queries.labels, [20], 0.07, 10)
    return accuracy["k20"]["top1"]


@pytest.mark.parametrize(("objective", "margin", "epochs"), CASES, ids=[c[0] for c in CASES])
def test_recipe_clears_the_untrained_encoder(cluttered, tmp_path, objective, margin, epochs):
    train, test = cluttered
    recipe = REPO / "launch" / "configs" / "cluttered" / f"{objective}.yaml"
    overrides = [f"output_dir={tmp_path}", "name=run", f"data.shards={train}",
                 f"train.epochs={epochs}", "tracking.enabled=false", "train.progress=false",
                 "checkpoint.every=0"]
    result = run_pretrain(["--config", str(recipe), *overrides], nproc=2, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    trained = from_checkpoint(list_checkpoints(tmp_path / "run")[0])[0]
    config = load_config(RunConfig, recipe, overrides)
    torch.manual_seed(config.seed)  # the encoder the run started from
    untrained = EmbeddingModel(build_model(config.model, config.objective,
                                           torch.device("cpu")).encoder)
    before, after = knn_top1(untrained, train, test), knn_top1(trained, train, test)
    assert after - before >= margin, f"kNN top-1 {before:.3f} -> {after:.3f}"
