"""``train.chunk_size`` in a real ``pretrain`` run: 2 DDP ranks, 16 images (32 views) per
rank in chunks of 5 rows, equal to the unchunked run to float32 rounding."""

from __future__ import annotations

import torch

from tests.app.helpers import run_pretrain, train_overrides
from tests.app.test_remote_shards import final_model

SPLIT_INDEPENDENT = {"model.norm": "group", "model.projector_bn_out": "false",
                     "train.max_steps": 3, "objective.learnable_temperature": "true"}


def test_chunked_run_equals_the_unchunked_run(digits_shards, tmp_path):
    weights = {}
    for chunk in (0, 5):
        out = tmp_path / f"chunk{chunk}"
        result = run_pretrain(train_overrides(digits_shards, out, **SPLIT_INDEPENDENT,
                                              **{"train.chunk_size": chunk}), nproc=2)
        assert result.returncode == 0, result.stderr[-3000:]
        assert ("encoded in pieces of at most 5 rows" in result.stderr) == bool(chunk)
        # every metric row reports the encoder's TFLOP/s; no MFU without a known peak (CPU)
        assert "train/tflops=" in result.stderr and "train/mfu=" not in result.stderr
        weights[chunk] = final_model(out / "run")
    (step, plain), (chunked_step, chunked) = weights[0], weights[5]
    assert step == chunked_step
    for key, value in plain.items():
        # float32: the chunks sum the same terms in another order
        torch.testing.assert_close(chunked[key], value, rtol=1e-4, atol=1e-5, msg=key)
