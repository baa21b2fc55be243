"""The defining test of the distributed path, through the real engines: for every
objective, 2 gloo ranks holding different, uneven rows give the loss and the gradient of
every parameter (learnable temperature included) of 1 process on the concatenated batch,
under DDP and DeepSpeed ZeRO-1 and ZeRO-2.

Everything runs in float64, so the comparison does not depend on summation order or
library versions. DDP keeps the gradients in float64: they must agree to 1e-10. DeepSpeed
ZeRO stores gradient partitions in float32 whatever the parameters' dtype: each rank's
float64 gradient is rounded to float32 (relative error 2**-24) and the ranks' float32
partials are averaged (one more rounding), so the result differs from the float64
reference by at most a few float32 ulps of the largest partial. A partial can exceed the
tensor's final gradient where ranks' contributions cancel, so the bound is taken
relative to the tensor's largest entry with a margin: atol = 1e-6 * max |g| (8 ulps).
A 2-rank bug is O(|g|): dropping the gather's all-reduce fails every case
(docs/objectives.md, "Distributed semantics")."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from core.config import ConfigError, load_config
from pretrain.distributed.deepspeed_engine import own_extension_cache
from pretrain.distributed.engine import EngineConfig, engine_spec
from tests.objective_cases import ObjectiveCase, case_ids, objective_cases
from tests.pretrain.distributed import engine_tasks

pytestmark = pytest.mark.long_file  # collected first: tests/conftest.py

CASES = objective_cases()  # every entry of the table, under each of its examples
INFONCE = ObjectiveCase("infonce", {})
# ZeRO-3 with every parameter partitioned (DeepSpeed keeps those under 1e5 elements whole by
# default: all of the test models' would be)
ZERO3 = "tests/pretrain/zero3_every_parameter.json"
ENGINES = {"ddp": ("ddp", ""), "zero1": ("deepspeed", "launch/deepspeed/zero1.json"),
           "zero2": ("deepspeed", "launch/deepspeed/zero2.json"),
           "zero3": ("deepspeed", ZERO3), "fsdp2": ("fsdp2", "")}
FLOAT32_GRADIENTS = 1e-6  # DeepSpeed: tolerance relative to the tensor's largest gradient


def tolerance(engine: str, reference: torch.Tensor) -> float:
    if engine in ("ddp", "fsdp2"):
        return 1e-10
    return FLOAT32_GRADIENTS * float(reference.abs().max())


@pytest.mark.parametrize(("engine", "zero"), list(ENGINES.values()), ids=list(ENGINES))
@pytest.mark.parametrize("case", CASES, ids=case_ids(CASES))
def test_two_ranks_equal_one_process(gloo2, engine, zero, case):
    ranks = gloo2.run(engine_tasks.run_step, engine, zero, case)
    whole = engine_tasks.run_step("ddp", "", case, rows=slice(None))
    loss = sum(r["loss"] for r in ranks) / len(ranks)
    torch.testing.assert_close(loss, whole["loss"], rtol=0, atol=1e-12)
    assert set(whole["grads"]) >= {"log_temperature"}
    if case.example.get("projection") == "learned":  # the class embeddings train with the model
        assert whole["grads"]["loss_parameters.class_embeddings"].abs().max() > 0
    for rank in ranks:  # the engine leaves every rank with the averaged gradient
        assert set(rank["grads"]) == set(whole["grads"])
        for key, grad in whole["grads"].items():
            torch.testing.assert_close(rank["grads"][key], grad, rtol=0,
                                       atol=tolerance(engine, grad), msg=key)


@pytest.mark.parametrize(("engine", "zero"), [ENGINES["ddp"], ENGINES["zero2"]],
                         ids=["ddp", "zero2"])
def test_the_comparison_fails_a_gather_without_the_gradient_sum(gloo2, engine, zero):
    """The mutation check: every case above fails when the gather's backward skips the
    all-reduce, so the tolerances cannot hide a 2-rank bug. ProjNCE's learned projection
    is the exception that proves the rule: each row's loss depends on its own embedding and
    the shared class embeddings only (the other rows enter its no-gradient monitors), so
    no gradient crosses the gather and the broken gather must change nothing."""
    for case in CASES:
        ranks = gloo2.run(engine_tasks.run_step_with_local_gradients, engine, zero, case)
        whole = engine_tasks.run_step("ddp", "", case, rows=slice(None))
        worst = max(float((ranks[0]["grads"][key] - grad).abs().max()) /
                    tolerance(engine, grad) for key, grad in whole["grads"].items()
                    if key != "log_temperature")
        if case.example.get("projection") == "learned":
            assert worst <= 1, f"{case.id}: gradient crossed the gather ({worst:.1f}x)"
            continue
        assert worst > 100, f"{case.id}: the broken gather passes ({worst:.1f}x tol)"


def test_deepspeed_config_must_set_gradient_clipping(tmp_path):
    bad = tmp_path / "zero.json"
    bad.write_text('{"zero_optimization": {"stage": 2}}')
    with pytest.raises(ConfigError, match="gradient_clipping"):
        load_config(EngineConfig, overrides=["name=deepspeed", f"deepspeed_config={bad}"])
    bad.write_text('{"zero_optimization": {"stage": 4}, "gradient_clipping": 1.0}')
    with pytest.raises(ConfigError, match="stage must be 1, 2 or 3, got 4"):
        load_config(EngineConfig, overrides=["name=deepspeed", f"deepspeed_config={bad}"])
    bad.write_text('{"zero_optimization": {"stage": 3}, "gradient_clipping": 1.0, '
                   '"bf16": {"enabled": true}}')
    with pytest.raises(ConfigError, match='"bf16" is enabled; precision is train.precision'):
        load_config(EngineConfig, overrides=["name=deepspeed", f"deepspeed_config={bad}"])


@pytest.mark.parametrize("fp16_kernels", [True, False], ids=["intel-amx", "amd-zen"])
def test_zero3_takes_float64_whether_or_not_the_cpu_has_fp16_kernels(gloo2, fp16_kernels):
    """DeepSpeed's own ZeRO-3 set-up refuses float64 parameters on a CPU with fp16 kernels
    (Intel AVX-512 FP16/AMX) and takes them on one without (AMD Zen); the engine partitions
    the model itself, with the config's dtype on both, so both give the single-process
    gradient in float64 (``zero3.partition``)."""
    ranks = gloo2.run(engine_tasks.run_step_with_cpu_fp16, fp16_kernels, *ENGINES["zero3"],
                      INFONCE)
    whole = engine_tasks.run_step("ddp", "", INFONCE, rows=slice(None))
    for rank in ranks:
        for key, grad in whole["grads"].items():
            assert rank["grads"][key].dtype == torch.float64
            torch.testing.assert_close(rank["grads"][key], grad, rtol=0,
                                       atol=tolerance("zero3", grad), msg=key)


def test_deepspeed_builds_its_cpu_op_beside_this_environment(monkeypatch, tmp_path):
    """Not in the user's shared ~/.cache/torch_extensions, whose build file another
    checkout's environment would rewrite (a 30 s rebuild that every rank waits for); a
    folder the user names stays theirs."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "")  # restored after the test
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert sys.prefix != sys.base_prefix  # the suite runs in launch/setup.sh's .venv
    assert own_extension_cache() == Path(sys.prefix) / "torch_extensions"
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(Path(sys.prefix) / "torch_extensions")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert own_extension_cache() == tmp_path
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.setattr(sys, "prefix", sys.base_prefix)  # a system interpreter: torch's own
    assert own_extension_cache() is None and "TORCH_EXTENSIONS_DIR" not in os.environ


def test_the_zero3_test_config_is_the_shipped_one_with_every_parameter_partitioned():
    shipped = json.loads(Path("launch/deepspeed/zero3.json").read_text())
    tested = json.loads(Path(ZERO3).read_text())
    assert tested["zero_optimization"].pop("stage3_param_persistence_threshold") == 0
    assert tested == shipped


def test_an_unknown_engine_is_refused_naming_the_table():
    with pytest.raises(ConfigError,
                       match="unknown engine 'fsdp'; choose one of ddp, deepspeed or fsdp2"):
        load_config(EngineConfig, overrides=["name=fsdp"])


def test_the_run_reads_what_an_engine_needs_from_its_entry():
    """DeepSpeed builds on a process group even on one rank and optimises flat partitions
    (the run warns for LARS); DDP needs neither."""
    ddp, zero = engine_spec("ddp"), engine_spec("deepspeed")
    assert (ddp.process_group, ddp.flat_partitions) == (False, False)
    assert (zero.process_group, zero.flat_partitions) == (True, True)


def test_zero3_partitions_hold_no_stray_padding_on_three_ranks(gloo3):
    """ZeRO-3 pads each parameter to a multiple of the ranks and DeepSpeed allocates the
    partitions uninitialised; LARS's trust ratio reads a rank's flat partition whole, so a
    stray value in the padding scaled that rank's update (non-finite now and then after a
    2 -> 3 rank resume, ``test_reshard.py``). Built while ``torch.empty`` gives NaN, and
    resumed after the padding was set to NaN, every rank's padding is 0 and its fp32
    master partitions finite; the last ranks hold padding (the test model's parameters do
    not divide by 3)."""
    ranks = gloo3.run(engine_tasks.zero3_padding, ZERO3)
    assert sum(rank["built"]["padding"] for rank in ranks) > 0
    for rank in ranks:
        assert rank["built"]["zero"] and rank["built"]["finite"], ranks
        assert rank["resumed"]["zero"] and rank["resumed"]["finite"], ranks
