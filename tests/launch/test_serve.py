"""``launch/serve.sh``: a registered encoder served over HTTP by MLflow's scoring server
from the project's venv, without activating it, answers with the registered version's
embeddings."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request

import mlflow
import numpy as np
import pytest

from core.runtime import free_port
from tests.app.helpers import REPO, run_pretrain, train_overrides


def post(port: int, payload: dict) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations",
                                     data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_serve_answers_with_the_registered_embeddings(digits_shards, tmp_path):
    result = run_pretrain(train_overrides(digits_shards, tmp_path, **{
        "tracking.enabled": True, "tracking.system_metrics": False, "train.max_steps": 2,
        "tracking.registered_model": "served"}))
    assert result.returncode == 0, result.stderr[-3000:]
    store = tmp_path / "run" / "mlflow.db"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env["PATH"] = "/usr/bin:/bin"  # the venv is not activated
    server = subprocess.Popen(["bash", str(REPO / "launch" / "serve.sh"), str(store),
                               "models:/served/1", str(port)], cwd=tmp_path, env=env,
                              stdout=open(tmp_path / "serve.log", "w"),
                              stderr=subprocess.STDOUT, start_new_session=True)
    images = np.random.default_rng(0).random((2, 3, 16, 16), dtype=np.float32)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                answer = post(port, {"inputs": images.tolist()})
                break
            except (urllib.error.URLError, ConnectionError):
                if time.monotonic() > deadline:
                    pytest.fail((tmp_path / "serve.log").read_text()[-3000:])
                time.sleep(0.5)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    mlflow.set_registry_uri(f"sqlite:///{store}")
    expected = mlflow.pyfunc.load_model("models:/served/1").predict(images)
    np.testing.assert_allclose(np.asarray(answer["predictions"], dtype=np.float32), expected,
                               rtol=1e-5, atol=1e-6)
