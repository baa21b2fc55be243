"""The GPU kit (``bench/gpu``) in its dry run: the same parts and code on CPU with tiny
sizes, so that the command a GPU node runs cannot rot; and its synchronisation check
names the project line behind a synchronising call.

The dry run here runs two parts at a time (``--jobs=2``: it times nothing; each part's torch
threads its share of the cores), and its compile part compiles with dynamo's ``aot_eager``
backend: the part's code, dynamo's capture of the encoder and AOT autograd run, inductor's
C++ code generation (30 s here, cold) does not; inductor on this CPU is
``tests/pretrain/loop/test_compile.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import torch

from bench.gpu import steps
from bench.gpu.part import PARTS
from tests.app.helpers import REPO


def test_the_dry_run_measures_every_part(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    result = subprocess.run(["bash", "bench/gpu/run.sh", "--dry-run", str(tmp_path / "out"),
                             "--jobs=2"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=800)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    report = json.loads((tmp_path / "out" / "gpu.json").read_text())
    assert report["dry_run"] and list(report["parts"]) == list(PARTS)
    parts = report["parts"]
    for name, part in parts.items():
        assert part["status"] == "ok" and part["rows"], (name, part["log_tail"][-2000:])
    assert parts["tests"]["rows"][0]["tests"] >= 4 and parts["tests"]["rows"][0]["failed"] == 0
    assert len(parts["sync"]["rows"]) == 3 * len(steps.OBJECTIVE_CASES)
    losses = {row["loss"] for row in parts["objectives"]["rows"]}
    assert {"infonce", "xclr[captions]", "projnce[kernel]", "siglip",
            "open_clip SigLipLoss"} <= losses
    assert all("fwd_bwd_ms" in row for row in parts["objectives"]["rows"])
    assert [(row["compiled"], row["backend"]) for row in parts["compile"]["rows"]] == [
        (False, "eager"), (True, "aot_eager")]  # inductor on CPU: tests/pretrain/loop
    fed = {(row["source"], row.get("workers")): row for row in parts["feed"]["rows"]}
    assert {("cpu", 1), ("nvjpeg", 1)} <= set(fed) and all(
        row["images_s"] > 0 for row in fed.values())
    assert fed[("nvjpeg", 1)]["target"] in ("met", "not met")
    trained = parts["e2e"]["rows"]
    assert [row["jpeg"] for row in trained] == ["80x60"]  # the GPU kit trains two sizes
    assert all(row["images_s"] > 0 and row["vs_synthetic"] > 0 and row["tflops"] > 0
               for row in trained)
    demo = parts["demo"]["rows"][0]
    assert demo["backend"] == "gloo" and demo["steps"] > 0 and 0 <= demo["knn_top1"] <= 1
    sharded = parts["fsdp2"]["rows"]
    assert [row["model"] for row in sharded] == ["small_cnn"]  # the ViT on the GPU only
    assert all(row["resumed"] and row["backend"] == "gloo" for row in sharded)
    table = (tmp_path / "out" / "gpu.md").read_text()
    assert table.count("\n### ") + table.startswith("### ") == len(PARTS)


def test_a_part_out_of_time_is_stopped_and_recorded(tmp_path):
    """A part past its share of the budget is killed, recorded as out of time with what it
    printed, and the kit exits 1."""
    result = subprocess.run([sys.executable, "-m", "bench.gpu", str(tmp_path), "--dry-run",
                             "--parts", "sync", "--budget", "1"],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    part = json.loads((tmp_path / "gpu.json").read_text())["parts"]["sync"]
    assert part["status"] == "out of time (1 s)" and part["seconds"] < 30, part
    assert "### Host synchronisations per training step: out of time" in result.stdout


def test_a_synchronising_call_is_named_by_the_project_line_that_made_it(monkeypatch):
    """On a GPU torch warns for each synchronising call (sync debug mode "warn"); here the
    warning is raised by hand from project code, the mode switch stubbed."""
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)
    import pretrain.loop.collapse as collapse

    def synchronising(features, ids):  # stands in for a read of a device value
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
        return {}

    monkeypatch.setattr(collapse, "backbone_measures", synchronising)
    with steps.synchronisations(torch.device("cuda")) as found:
        collapse.backbone_measures(None, None)
        warnings.warn("an unrelated warning", UserWarning, stacklevel=1)
    assert len(found) == 1 and found[0].startswith("tests/bench/test_gpu_kit.py:")


def test_the_stages_import_without_what_a_gpu_node_lacks():
    """A GPU node has no faiss, MLflow or DeepSpeed (the kit carries none): the stages
    the kit runs import them only where a configuration asks for them."""
    code = ("import sys\n"
            "for name in ('faiss', 'mlflow', 'deepspeed'):\n"
            "    sys.modules[name] = None  # import fails as if not installed\n"
            "import app.make_shards, app.pretrain, app.evaluate\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
