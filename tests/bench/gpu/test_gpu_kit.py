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
import time
import warnings

import psutil
import pytest
import torch

from bench.gpu import kit_tables, pipeline, record, steps
from bench.gpu.part import PARTS
from pretrain.objectives import OBJECTIVES
from tests.app.helpers import REPO

pytestmark = pytest.mark.long_file  # collected first: tests/conftest.py


def ended(pid: int, within_s: float = 20.0) -> bool:
    """``pid`` is gone or a zombie within ``within_s``: a process sent SIGKILL is woken to
    run its exit (state R) and its pipes close before it is a zombie, so on a loaded
    machine it may still read as running just after the kill."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def test_the_dry_run_measures_every_part(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    result = subprocess.run(["bash", "bench/gpu/run.sh", "--dry-run", str(tmp_path / "out"),
                             "--jobs=2"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=800)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    report = json.loads((tmp_path / "out" / "gpu.json").read_text())
    assert report["dry_run"] and list(report["parts"]) == list(PARTS)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout.strip()
    assert report["provenance"]["commit"] == head  # what gpu.md names as the commit
    parts = report["parts"]
    for name, part in parts.items():
        assert part["status"] == "ok" and part["rows"], (name, part["log_tail"][-2000:])
    assert parts["tests"]["rows"][0]["tests"] >= 4 and parts["tests"]["rows"][0]["failed"] == 0
    assert len(parts["sync"]["rows"]) == 3 * len(steps.OBJECTIVE_CASES)
    losses = {row["loss"] for row in parts["objectives"]["rows"]}
    assert {loss.split("[")[0] for loss in losses} == {*OBJECTIVES, "open_clip SigLipLoss",
                                                        "open_clip ClipLoss"}
    assert all("fwd_bwd_ms" in row for row in parts["objectives"]["rows"])
    assert [(row["compiled"], row["backend"]) for row in parts["compile"]["rows"]] == [
        (False, "eager"), (True, "aot_eager")]  # inductor on CPU: tests/pretrain/loop
    fed = {(row["source"], row.get("workers"), row.get("decoder")): row
           for row in parts["feed"]["rows"]}
    assert {("cpu", 1, ""), ("nvjpeg", 1, "torchcodec"), ("nvjpeg", 1, "torchvision")
            } <= set(fed) and all(row["images_s"] > 0 for row in fed.values())
    assert fed[("nvjpeg", 1, "torchvision")]["target"] in ("met", "not met")
    compared = {row["decoder"]: row for row in parts["views"]["rows"]}
    assert set(compared) == {"torchcodec", "torchvision"}
    assert all(row["ok"] and row["batches"] == 3 and row["images"] == 12
               and row["pressure_steps"] > 0 for row in compared.values()), compared
    trained = parts["e2e"]["rows"]
    assert [row["jpeg"] for row in trained] == ["80x60 both ways"]  # the GPU kit: two sizes
    assert all(row["images_s"] > 0 and row["vs_synthetic"] > 0 and row["tflops"] > 0
               and row["nonfinite_steps"] == 0 and row["first_loss"] > 0 for row in trained)
    demo = parts["demo"]["rows"][0]
    assert demo["backend"] == "gloo" and demo["steps"] > 0 and 0 <= demo["knn_top1"] <= 1
    sharded = parts["fsdp2"]["rows"]
    assert [row["model"] for row in sharded] == ["small_cnn"]  # the ViT on the GPU only
    assert all(row["resumed"] and row["backend"] == "gloo" for row in sharded)
    table = (tmp_path / "out" / "gpu.md").read_text()
    assert table.count("\n### ") + table.startswith("### ") == len(PARTS)
    assert f"commit {head}" in table.splitlines()[0]
    refused = subprocess.run([sys.executable, "-m", "bench.gpu.record", str(tmp_path / "out")],
                             cwd=REPO, capture_output=True, text=True)
    assert refused.returncode == 2 and "a dry run measures nothing" in refused.stderr
    kit_record = {**report["provenance"], "figures": record.figures(report)}
    for name, part in parts.items():  # every part renders from the record as gpu.md shows it
        shown = "\n".join(kit_tables.VIEWS[name](kit_record)[2:])
        assert shown in table and len(shown.splitlines()) == 4 + len(part["rows"]), name
    compiled = kit_tables.VIEWS["compile"](kit_record)
    assert compiled[0].startswith(f"`python -m bench.gpu {tmp_path / 'out'} --dry-run --jobs=2`")
    assert compiled[2].startswith("### train.compile: ok, ")
    assert compiled[4:6] == ["| backbone | compiled | backend | first_step_s | step_s | vs_eager |",
                             "|---|---|---|---|---|---|"]
    assert compiled[6].startswith("| small_cnn | False | eager | ")


def test_a_part_out_of_time_is_killed_with_its_processes_and_the_others_are_kept(tmp_path):
    """A part past its share of the budget (planted: it measures a row, starts a child
    process, then never ends) is killed with everything it started, recorded as out of time
    with what it printed and the row it measured, and the kit goes on: the next part's rows
    are in ``gpu.json`` and ``gpu.md``, which are written after each part, and the kit
    exits 1."""
    code = ("import sys\n"
            "import bench.gpu.__main__ as kit\n"
            "kit.FORKS.set_forkserver_preload(['bench.gpu.part', 'tests.bench.gpu.planted_part'])\n"
            "import tests.bench.gpu.planted_part\n"
            "kit.main()\n")
    kit = subprocess.Popen([sys.executable, "-c", code, str(tmp_path), "--dry-run",
                            "--parts", "planted,objectives", "--budget", "130"],
                           cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    report, seen_early = tmp_path / "gpu.json", None
    while kit.poll() is None and seen_early is None:  # the report, before the kit ends
        if report.is_file():
            seen_early = list(json.loads(report.read_text())["parts"])
        time.sleep(0.1)
    output, _ = kit.communicate(timeout=300)
    assert kit.returncode == 1, output[-4000:]
    assert seen_early == ["planted"], seen_early
    parts = json.loads(report.read_text())["parts"]
    assert list(parts) == ["planted", "objectives"]
    assert parts["planted"]["status"] == "out of time (5 s)", parts["planted"]
    assert "planted: a child started" in parts["planted"]["log_tail"]
    assert parts["planted"]["rows"] == [{"never": "measured before the overrun"}]
    assert parts["planted"]["partial"] is True
    child = int((tmp_path / "parts" / "planted" / "child.pid").read_text())
    assert ended(child)
    kept = parts["objectives"]
    assert kept["status"] == "ok" and kept["rows"], kept
    table = (tmp_path / "gpu.md").read_text()
    assert "### Planted overrun: out of time" in table
    assert "| measured before the overrun |" in table  # its partial table
    assert "### Objectives: forward + backward: ok" in table


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
    assert len(found) == 1 and found[0].startswith("tests/bench/gpu/test_gpu_kit.py:")


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


def test_a_command_past_its_deadline_is_killed_with_what_left_its_session(tmp_path):
    """``run_until``: a command whose child starts a session of its own (as a torchrun
    agent's ranks do) is killed with that child at the deadline, and the part hears of it."""
    pid_file = tmp_path / "child.pid"
    command = ["bash", "-c", f"setsid sleep 300 & echo $! > {pid_file}; wait"]
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="past the part's deadline"):
        pipeline.run_until(command, time.monotonic() + 2)
    assert time.monotonic() - start < 30
    child = int(pid_file.read_text())
    assert ended(child)
