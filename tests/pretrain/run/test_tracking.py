"""MLflow tracking against real stores: the embedded SQLite store of a training run, and a
real ``mlflow server`` that is down for part of the run."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import mlflow
import pytest
import torch

from pretrain.model.encoder import ModelConfig, encoder_from_state
from pretrain.run.tracking import Tracker, TrackingConfig
from tests.app.helpers import run_pretrain, train_overrides
from tests.ports import free_port
from tests.serving.test_inputs import array_rows


def test_sqlite_store_holds_params_metrics_artifacts_and_a_loadable_model(digits_shards,
                                                                          tmp_path):
    overrides = train_overrides(digits_shards, tmp_path, **{
        "tracking.enabled": True, "tracking.system_metrics": False, "train.max_steps": 6,
        "tracking.registered_model": "digits-test-encoder"})
    result = run_pretrain(overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "run"
    uri = f"sqlite:///{run_dir / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri, registry_uri=uri)
    run = client.get_run((run_dir / "mlflow_run_id").read_text())
    assert run.data.params["objective.name"] == "infonce"
    assert run.data.params["data.batch_size"] == "16"
    assert run.info.status == "FINISHED"
    for key in ("loss", "infonce", "mi_bound", "ess", "pos_sim", "neg_sim", "temperature",
                "lr", "images_per_s", "memory_mib", "skipped_samples"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, key)] == [2, 4, 6]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "checkpoint"} <= artifacts
    assert not (run_dir / "mlflow_pending.jsonl").exists()  # everything was sent

    version = client.get_model_version("digits-test-encoder", "1")
    assert version.run_id == run.info.run_id
    assert version.description.startswith("# digits-test-encoder\n")  # the card, in the UI
    assert "| name | infonce |" in version.description
    final = sorted((run_dir / "checkpoints").glob("step_*"))[-1] / "shared.pt"
    reference = encoder_from_state(ModelConfig(projector_hidden=64, projector_dim=32),
                                   torch.load(final, weights_only=True)["model"])
    image = torch.rand(3, 3, 16, 16)
    with torch.no_grad():
        expected = torch.nn.functional.normalize(reference.eval()(image)[1], dim=1)

    # served through MLflow: a model from code, predict gives the projector embeddings
    mlflow.set_registry_uri(uri)
    served = mlflow.pyfunc.load_model("models:/digits-test-encoder/1")
    embedding = served.predict(array_rows(image))
    assert embedding.shape == (3, 32)
    torch.testing.assert_close(torch.from_numpy(embedding), expected)

    # what the version holds: no pickled object, a card naming objective and data
    files = mlflow.artifacts.download_artifacts("models:/digits-test-encoder/1",
                                                dst_path=str(tmp_path / "version"))
    names = {p.relative_to(files).as_posix() for p in Path(files).rglob("*") if p.is_file()}
    assert {"MLmodel", "pyfunc.py", "artifacts/encoder.safetensors", "artifacts/config.yaml",
            "artifacts/model_card.md"} <= names
    assert not any(name.endswith((".pkl", ".pth", ".pt")) for name in names)
    assert "python_model" not in (Path(files) / "MLmodel").read_text().replace(
        "python_model_code", "")  # the pickled-object key of code-less pyfunc models
    card = (Path(files) / "artifacts" / "model_card.md").read_text()
    assert "| name | infonce |" in card and f"| shards | {digits_shards} |" in card
    assert json.loads(version.tags["artifact_sha256"])["artifacts/encoder.safetensors"]


def wait_healthy(port: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"mlflow server on port {port} did not come up")


@pytest.fixture
def server_port(tmp_path):
    port = free_port()
    procs = []

    def start() -> None:
        cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port",
               str(port), "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
               "--default-artifact-root", str(tmp_path / "server-artifacts"), "--workers", "1"]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_healthy(port)

    yield port, start
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=30)


def test_unreachable_server_loses_no_metric(server_port, tmp_path):
    port, start_server = server_port
    cfg = TrackingConfig(uri=f"http://127.0.0.1:{port}", system_metrics=False,
                         retry_every_s=0, request_timeout_s=2)
    tracker = Tracker(cfg, tmp_path, "offline-run")
    tracker.start({"objective.name": "xclr"})
    for step in range(5):  # the server is down: kept in the journal
        tracker.log_metrics(step, {"loss": 10.0 - step})
    assert tracker.reachable is False
    assert len((tmp_path / "mlflow_pending.jsonl").read_text().splitlines()) == 5
    start_server()
    for step in range(5, 10):
        tracker.log_metrics(step, {"loss": 10.0 - step})
    tracker.finish()
    client = mlflow.MlflowClient(f"http://127.0.0.1:{port}")
    run = client.get_run((tmp_path / "mlflow_run_id").read_text())
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(s, 10.0 - s) for s in range(10)]
    assert run.data.params == {"objective.name": "xclr"}
    assert not (tmp_path / "mlflow_pending.jsonl").exists()


def test_training_goes_on_when_the_server_is_down(digits_shards, tmp_path):
    overrides = train_overrides(digits_shards, tmp_path, **{
        "tracking.enabled": True, "tracking.uri": f"http://127.0.0.1:{free_port()}",
        "tracking.request_timeout_s": 2, "train.max_steps": 6})
    result = run_pretrain(overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "unreachable" in result.stderr
    rows = [json.loads(line) for line in
            (tmp_path / "run" / "mlflow_pending.jsonl").read_text().splitlines()]
    training = [row for row in rows if "loss" in row["metrics"]]
    assert [row["step"] for row in training] == [2, 4, 6]
    skips = [row for row in rows if "loss" not in row["metrics"]]  # the end-of-run totals
    assert [row["step"] for row in skips] == [6]
    assert skips[0]["metrics"]["skipped.truncated_shard"] == 0


def test_a_row_cut_in_the_journal_blocks_nothing_and_a_failed_run_is_marked(tmp_path):
    """A journal row cut by a crash or Ctrl-C while it was written: the rows around it are
    sent, the cut one passed over, and the run ends FAILED (it stayed RUNNING: the cut row
    made every send fail, so the run was never marked)."""
    cfg = TrackingConfig(system_metrics=False)
    tracker = Tracker(cfg, tmp_path, "cut-journal")
    tracker.start({"objective.name": "infonce"})
    journal = tmp_path / "mlflow_pending.jsonl"
    rows = [json.dumps({"step": s, "t": 1, "metrics": {"loss": float(s)}}) for s in (1, 2)]
    journal.write_text(rows[0] + "\n" + rows[1][:17] + "\n" + rows[1] + "\n")
    tracker.finish("FAILED")
    client = mlflow.MlflowClient(tracker.uri)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FAILED"
    history = client.get_metric_history(tracker.run_id, "loss")
    assert sorted(m.step for m in history) == [1, 2]
    assert not journal.exists()


def test_ctrl_c_inside_a_store_transaction_waits_for_it_and_the_run_is_marked(tmp_path,
                                                                           ctrl_c_raises):
    """A Ctrl-C that lands inside a store call (raised here from the store's own metric
    statement, as a signal there would be): the call completes, the journal is sent and
    emptied, and only then does the interrupt reach the run, which ends FAILED at once."""
    import sqlalchemy

    tracker = Tracker(TrackingConfig(system_metrics=False), tmp_path, "ctrl-c")
    tracker.start({"objective.name": "infonce"})
    engine = tracker.client._tracking_client.store.engine

    interrupted = []

    def interrupt_once(conn, cursor, statement, *args):
        if not interrupted and statement.lstrip().upper().startswith("INSERT INTO METRICS"):
            interrupted.append(statement)
            signal.raise_signal(signal.SIGINT)

    sqlalchemy.event.listen(engine, "after_cursor_execute", interrupt_once)
    with pytest.raises(KeyboardInterrupt):
        tracker.log_metrics(1, {"loss": 1.0})
    assert interrupted and not (tmp_path / "mlflow_pending.jsonl").exists()  # sent whole
    started = time.monotonic()
    tracker.finish("FAILED")
    client = mlflow.MlflowClient(tracker.uri)
    assert client.get_run(tracker.run_id).info.status == "FAILED"
    assert time.monotonic() - started < 5  # no wait on a lock
    assert [m.step for m in client.get_metric_history(tracker.run_id, "loss")] == [1]
