"""Preemption: SIGTERM (or the warning signal) stops a run at an agreed step boundary with a
checkpoint, the MLflow run KILLED and tagged, exit status 143; the same command resumes it
to exactly the weights of an uninterrupted run, for one process and for torchrun's agent
of two."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from pretrain.run.preemption import MARKER, PREEMPTED_EXIT_STATUS, PreemptionConfig, PreemptionWatch
from tests.app.helpers import REPO, pretrain_command, run_pretrain, train_overrides

pytestmark = pytest.mark.long_file  # collected first: tests/conftest.py

STEPS = 30


def final_state(run_dir: Path) -> dict:
    last = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    return torch.load(last / "shared.pt", weights_only=True)


def assert_same_training(a: dict, b: dict) -> None:
    assert a["step"] == b["step"] == STEPS
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    for key, value in a["optimizer"]["state"].items():
        assert torch.equal(value["velocity"], b["optimizer"]["state"][key]["velocity"]), key


def signalled_run(command: list[str], log: Path, after_step: int, signum: signal.Signals,
                  extra_env: dict[str, str] | None = None) -> tuple[int, str]:
    """Start ``command``, send ``signum`` to it once its log reports ``after_step``;
    (exit status, log text)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **(extra_env or {})}
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while f"INFO: step {after_step} " not in log.read_text() and proc.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before the signal:\n" + log.read_text()[-3000:]
        proc.send_signal(signum)
        status = proc.wait(timeout=300)
    return status, log.read_text()


def checkpoint_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in (run_dir / "checkpoints").glob("step_*"))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_checkpoints_marks_the_run_killed_and_resume_equals_uninterrupted(
        digits_shards, uninterrupted, tmp_path, signum):
    common = {"checkpoint.every": 0, "preemption.check_every": 2,
              "train.max_steps": STEPS, "data.workers": 1}
    reference = uninterrupted(1, **common)

    overrides = train_overrides(digits_shards, tmp_path / "b", **common,
                                **{"tracking.enabled": True, "tracking.log_model": False})
    status, text = signalled_run(pretrain_command(overrides), tmp_path / "b.log", 6, signum)
    run_dir = tmp_path / "b" / "run"
    assert status == PREEMPTED_EXIT_STATUS, text[-3000:]
    stopped = checkpoint_steps(run_dir)
    assert len(stopped) == 1 and 6 <= stopped[0] < STEPS and stopped[0] % 2 == 0
    last_line = text.strip().splitlines()[-1]
    assert last_line == (f"pretrain: preempted by {signum.name} at step {stopped[0]}; "
                         f"checkpoint {run_dir / 'checkpoints' / f'step_{stopped[0]:08d}'}; "
                         "the same command resumes it")
    assert json.loads((run_dir / MARKER).read_text())["step"] == stopped[0]
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    run = client.get_run((run_dir / "mlflow_run_id").read_text().strip())
    assert run.info.status == "KILLED" and run.data.tags["preempted"] == signum.name

    resumed = run_pretrain(overrides)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"at step {stopped[0]}" in resumed.stderr
    assert not (run_dir / MARKER).exists()
    assert client.get_run(run.info.run_id).info.status == "FINISHED"
    assert_same_training(final_state(reference), final_state(run_dir))


def test_sigterm_to_the_torchrun_agent_checkpoints_both_ranks_and_resumes(digits_shards,
                                                                         uninterrupted,
                                                                         tmp_path):
    common = {"checkpoint.every": 0, "preemption.check_every": 2, "data.workers": 1,
              "train.max_steps": STEPS}
    reference = uninterrupted(2, **common)

    overrides = train_overrides(digits_shards, tmp_path / "b", **common)
    status, text = signalled_run(pretrain_command(overrides, nproc=2), tmp_path / "b.log", 6,
                                 signal.SIGTERM)
    run_dir = tmp_path / "b" / "run"
    assert status != 0  # torchrun reports the signal it was stopped by
    stopped = checkpoint_steps(run_dir)
    assert len(stopped) == 1 and 6 <= stopped[0] < STEPS, text[-3000:]
    assert sorted(p.name for p in (run_dir / "checkpoints" / f"step_{stopped[0]:08d}").iterdir()
                  ) == ["rank_000.pt", "rank_001.pt", "shared.pt"]
    assert text.count(f"preempted by SIGTERM at step {stopped[0]}") >= 2  # both ranks

    resumed = run_pretrain(overrides, nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_training(final_state(reference), final_state(run_dir))


def test_the_watch_records_its_signals_and_restores_the_handlers():
    before = signal.getsignal(signal.SIGUSR1)
    watch = PreemptionWatch(PreemptionConfig(warning_signal="SIGUSR1"), torch.device("cpu"))
    with watch:
        assert not watch.agreed()
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.01)
        assert watch.received == "SIGUSR1" and watch.agreed()
    assert signal.getsignal(signal.SIGUSR1) is before


def test_an_unknown_warning_signal_is_a_configuration_error():
    from core.config import InvalidValue

    with pytest.raises(InvalidValue, match="SIGNOPE"):
        PreemptionConfig(warning_signal="SIGNOPE").validate()


def fake_slurm(bin_dir: Path) -> Path:
    """``srun`` (runs its command in place, so signals reach it) and ``scontrol`` (the
    head node's name; ``requeue`` is recorded in ``requeued``)."""
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/usr/bin/env bash\nwhile [[ "$1" == -* ]]; do shift; done\n'
                                  'exec "$@"\n')
    (bin_dir / "scontrol").write_text(
        '#!/usr/bin/env bash\ncase "$1" in\n  show) echo 127.0.0.1 ;;\n'
        f'  requeue) echo "$2" >> {bin_dir / "requeued"} ;;\nesac\n')
    for name in ("srun", "scontrol"):
        (bin_dir / name).chmod(0o755)
    return bin_dir


def test_slurm_warning_signal_requeues_and_the_requeued_job_resumes(digits_shards,
                                                                   uninterrupted, tmp_path):
    """``launch/slurm.sbatch`` as slurm runs it (``srun`` and ``scontrol`` stand-ins on
    PATH): SIGUSR1 to the batch script stops both ranks with a checkpoint, the script
    requeues the job, and the requeued script resumes to the uninterrupted weights."""
    from tests.ports import free_port

    common = {"checkpoint.every": 0, "preemption.check_every": 2, "data.workers": 1,
              "train.max_steps": STEPS}
    reference = uninterrupted(2, **common)

    bin_dir = fake_slurm(tmp_path / "bin")
    config = tmp_path / "job.yaml"
    config.write_text("name: run\n")
    command = ["bash", str(REPO / "launch" / "slurm.sbatch"), str(config),
               *train_overrides(digits_shards, tmp_path / "b", **common)]
    job = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(REPO),
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node1", "SLURM_NNODES": "1",
           "SLURM_GPUS_ON_NODE": "2", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    status, text = signalled_run(command, tmp_path / "job1.log", 6, signal.SIGUSR1,
                                 job | {"RDZV_PORT": str(free_port())})
    run_dir = tmp_path / "b" / "run"
    assert status == 0, text[-3000:]
    assert (bin_dir / "requeued").read_text().split() == ["4242"], text[-3000:]
    assert "preempted by SIGUSR1" in text
    assert "hang watch: step timer served at" in text  # each node's, beside its agent
    stopped = checkpoint_steps(run_dir)
    assert len(stopped) == 1 and 6 <= stopped[0] < STEPS

    again = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300,
                           env={**os.environ, **job, "RDZV_PORT": str(free_port())})
    assert again.returncode == 0, again.stderr[-3000:]
    assert (bin_dir / "requeued").read_text().split() == ["4242"]  # not requeued again
    assert_same_training(final_state(reference), final_state(run_dir))
