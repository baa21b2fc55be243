#!/usr/bin/env bash
# The GPU-only branches of this project were built and dry-run on CPU, never run on a GPU
# (no GPU was lent to its development). A GPU owner runs this on one CUDA GPU to check
# them and prints a table; each line's log stays in the printed directory.
#   bash launch/setup.sh dev && pip install '.[gpu]' && bash launch/gpu_check.sh
# Checks: the CUDA-gated and fake-CUDA tests (nvJPEG decoding, the step's device logic and
# host reads), then the demo pipeline on the GPU with 60 training steps: DDP over NCCL
# with bf16 autocast, channels-last and SyncBatchNorm; the same under DeepSpeed ZeRO-2; with
# DALI (nvJPEG views on the GPU); and evaluation with faiss on the GPU (faiss-gpu).
set -uo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
python="$repo/.venv/bin/python"
[ -x "$python" ] || { echo "gpu_check: run 'bash launch/setup.sh dev' first" >&2; exit 2; }
if ! "$python" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
    echo "gpu_check: torch sees no CUDA device; nothing to check" >&2
    exit 2
fi
work="$(mktemp -d)"
status=0
rows=()

check() {  # check NAME COMMAND...: run it, log it, keep a table row
    local name=$1
    shift
    local start=$SECONDS
    if "$@" >"$work/$name.log" 2>&1; then
        rows+=("$name|pass|$((SECONDS - start)) s")
    else
        rows+=("$name|FAIL|$((SECONDS - start)) s, $work/$name.log")
        status=1
    fi
}

pipeline() {  # pipeline NAME OVERRIDES...: the demo pipeline, 1 process, in its own folder
    local name=$1
    shift
    mkdir -p "$work/$name"
    DEMO_DIR="$work/$name" NPROC=1 bash "$repo/launch/demo_pipeline.sh" \
        train.max_steps=60 shards.samples=2000 "$@"
}

check cuda-tests "$python" -m pytest -q -p no:cacheprovider "$repo/tests/data_pipeline/dali" \
    "$repo/tests/pretrain/loop/test_cuda_dry_run.py" "$repo/tests/pretrain/loop/test_host_reads.py" \
    "$repo/tests/evaluation/test_cuda_dry_run.py"
check ddp-nccl-bf16 pipeline ddp train.precision=bf16
check deepspeed-zero2 pipeline deepspeed engine.name=deepspeed \
    "engine.deepspeed_config=$repo/launch/deepspeed/zero2.json"
check dali pipeline dali data.backend=dali
check faiss-gpu "$python" -c 'import faiss, sys; sys.exit(faiss.get_num_gpus() < 1)'

printf '\n%-18s %-6s %s\n' check result detail
for row in "${rows[@]}"; do
    IFS='|' read -r name result detail <<<"$row"
    printf '%-18s %-6s %s\n' "$name" "$result" "$detail"
done
echo "logs and runs: $work (the ddp run's report: $work/ddp/runs/cluttered-xclr-demo/eval/report.md)"
exit $status
