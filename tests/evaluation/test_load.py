"""Loading a registered encoder never runs artifact code: every file of a version is checked
against the digests registered with it, against a real SQLite registry and file store."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import mlflow
import pytest
import torch

from evaluation.load import load_model
from registry.package import RegistryError
from tests import prewarmed
from tests.app.helpers import run_pretrain, train_overrides
from tests.scratch import scratch_dir

MODEL = "digits-safety"


class Payload:
    """Unpickling this creates ``marker``: the proof that a loader executed artifact code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.fixture(scope="module")
def registered(digits_shards, tmp_path_factory):
    with scratch_dir(tmp_path_factory, "registry") as root:
        overrides = train_overrides(digits_shards, root, **{
            "tracking.enabled": True, "tracking.system_metrics": False, "train.max_steps": 2,
            "tracking.registered_model": MODEL})
        result = run_pretrain(overrides)
        assert result.returncode == 0, result.stderr[-3000:]
        run_dir = root / "run"
        uri = f"sqlite:///{run_dir / 'mlflow.db'}"
        client = mlflow.MlflowClient(uri, registry_uri=uri)
        version = client.get_model_version(MODEL, "1")
        store = run_dir / "mlartifacts" / "models" / version.source.split("/")[-1] / "artifacts"
        assert (store / "MLmodel").is_file()
        files = sorted(p.relative_to(store).as_posix() for p in store.rglob("*") if p.is_file())
        yield root, overrides + [f"eval.train_shards={digits_shards}",
                                  f"eval.test_shards={digits_shards}"], uri, store, files


def test_every_file_of_a_version_is_verified_and_a_payload_never_runs(registered, tmp_path):
    root, _, uri, store, files = registered
    marker = tmp_path / "payload-ran"
    payload = pickle.dumps(Payload(marker))
    pickle.loads(payload)  # the payload is live: unpickling it runs it
    assert marker.exists()
    marker.unlink()
    assert {"MLmodel", "pyfunc.py", "artifacts/encoder.safetensors",
            "artifacts/config.yaml", "artifacts/model_card.md"} <= set(files)
    clean, _ = load_model(f"models:/{MODEL}/1", root / "run", uri)
    for name in files:
        original = (store / name).read_bytes()
        (store / name).write_bytes(payload)
        try:
            with pytest.raises(RegistryError, match=f"file {name} does not match"):
                load_model(f"models:/{MODEL}/1", root / "run", uri)
        finally:
            (store / name).write_bytes(original)
        assert not marker.exists(), name
    (store / "extra.pkl").write_bytes(payload)  # an added file is refused too
    with pytest.raises(RegistryError, match="file extra.pkl was not registered"):
        load_model(f"models:/{MODEL}/1", root / "run", uri)
    (store / "extra.pkl").unlink()
    again, _ = load_model(f"models:/{MODEL}/1", root / "run", uri)
    image = torch.rand(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(again(image), clean(image))
    assert not marker.exists()


def test_evaluate_and_promotion_refuse_a_tampered_version(registered, tmp_path):
    root, overrides, uri, store, _ = registered
    marker = tmp_path / "payload-ran"
    weights = store / "artifacts" / "encoder.safetensors"
    original = weights.read_bytes()
    weights.write_bytes(pickle.dumps(Payload(marker)))
    try:
        result = prewarmed.run_module(
            "app.evaluate", [*overrides, f"eval.model=models:/{MODEL}/1",
                             f"eval.output={tmp_path / 'eval'}", "--promote", "champion"],
            dict(os.environ), timeout=300)
    finally:
        weights.write_bytes(original)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("evaluate: error: models:/digits-safety/1: file "
                           "artifacts/encoder.safetensors does not match"), result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert not marker.exists()
    assert not (tmp_path / "eval" / "results.json").exists()
    client = mlflow.MlflowClient(uri, registry_uri=uri)
    assert "champion" not in client.get_registered_model(MODEL).aliases


def test_versions_without_digests_and_unknown_references_are_refused(registered, tmp_path):
    root, _, uri, store, _ = registered
    client = mlflow.MlflowClient(uri, registry_uri=uri)
    copy = tmp_path / "copy"
    shutil.copytree(store, copy)
    client.create_registered_model("foreign")
    client.create_model_version("foreign", source=copy.as_uri())  # e.g. a pickle-format model
    with pytest.raises(RegistryError, match="no artifact digests registered"):
        load_model("models:/foreign/1", root / "run", uri)
    for source, why in ((f"models:/{MODEL}/7", "not found"), ("models:/nobody/1", "not found"),
                        (f"models:/{MODEL}@gone", "not found"),
                        ("runs:/0123456789abcdef/encoder", "not found")):
        with pytest.raises(RegistryError, match=why):
            load_model(source, root / "run", uri)
    run_id = (root / "run" / "mlflow_run_id").read_text()
    record = json.loads(client.get_run(run_id).data.tags["encoder.artifact_sha256"])
    assert "artifacts/encoder.safetensors" in record
    by_run, _ = load_model(f"runs:/{run_id}/encoder", root / "run", uri)
    assert isinstance(by_run, torch.nn.Module)
