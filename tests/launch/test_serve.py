"""``launch/serve.sh``: a registered encoder served over HTTP by MLflow's scoring server
from the project's venv, without activating it, answers JPEG files with the trained
encoder's L2-normalised embeddings, and a bad file with HTTP 400 naming the row."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from core.runtime import free_port
from data_pipeline.transforms import decode, eval_view
from pretrain.model import ModelConfig, encoder_from_state
from tests.app.helpers import REPO, run_pretrain, train_overrides
from tests.data_pipeline.helpers import digit_sample


def send(port: int, payload: dict) -> tuple[int, dict]:
    """(HTTP status, JSON body) of POST /invocations."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations",
                                     data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def post(port: int, payload: dict) -> dict:
    status, body = send(port, payload)
    assert status == 200, body
    return body


@contextlib.contextmanager
def serving(store: Path, model: str, cwd: Path) -> Iterator[int]:
    """``launch/serve.sh`` with the venv not activated; yields the port once it answers."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env["PATH"] = "/usr/bin:/bin"
    log = cwd / "serve.log"
    server = subprocess.Popen(["bash", str(REPO / "launch" / "serve.sh"), str(store), model,
                               str(port)], cwd=cwd, env=env, stdout=open(log, "w"),
                              stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None, log.read_text()[-3000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=5)
                break
            except (urllib.error.URLError, ConnectionError):
                if time.monotonic() > deadline:
                    pytest.fail(log.read_text()[-3000:])
                time.sleep(0.5)
        yield port
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)


def test_serve_answers_jpeg_files_with_normalised_embeddings(digits_shards, tmp_path):
    """JPEG bytes (base64 in JSON) and a file path, in both spaces, against the trained
    encoder applied to the evaluation view of the same files."""
    result = run_pretrain(train_overrides(digits_shards, tmp_path, **{
        "tracking.enabled": True, "tracking.system_metrics": False, "train.max_steps": 2,
        "tracking.registered_model": "served"}))
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "run"
    jpegs = [digit_sample(i).image for i in range(3)]
    (tmp_path / "third.jpg").write_bytes(jpegs[2])
    records = [{"image": base64.b64encode(data).decode(), "path": ""} for data in jpegs[:2]]
    records.append({"image": "", "path": str(tmp_path / "third.jpg")})  # "" is absent
    with serving(run_dir / "mlflow.db", "models:/served/1", tmp_path) as port:
        answers = {space: post(port, {"dataframe_records": records,
                                      "params": {"space": space}})["predictions"]
                   for space in ("projector", "backbone")}
        code, body = send(port, {"dataframe_records": [{"image": "bm90IGFuIGltYWdl"}]})
    # MLflow's server puts the request's table in front; the last line is ours
    assert code == 400, body
    assert body["message"].splitlines()[-1].startswith(
        "Error: row 0: image: cannot identify image file"), body

    final = sorted((run_dir / "checkpoints").glob("step_*"))[-1] / "shared.pt"
    encoder = encoder_from_state(ModelConfig(projector_hidden=64, projector_dim=32),
                                 torch.load(final, weights_only=True)["model"]).eval()
    views = torch.stack([eval_view(16)(decode(data, "test")) for data in jpegs])
    with torch.no_grad():
        features, projections = encoder(views)
    for space, want in (("projector", projections), ("backbone", features)):
        got = torch.tensor(answers[space])
        assert got.shape == want.shape
        torch.testing.assert_close(got, F.normalize(want, dim=1), rtol=1e-4, atol=1e-5)
