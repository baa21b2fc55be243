#!/usr/bin/env bash
# One node, N processes, CPU or GPU:
#   launch/torchrun.sh CONFIG.yaml [key=value ...]
#   NPROC=8 launch/torchrun.sh launch/configs/imagenet_xclr.yaml
# NPROC defaults to the GPU count (2 processes on a CPU-only machine). A failed worker makes
# torchrun restart the group (MAX_RESTARTS times); the restarted run resumes from its newest
# readable checkpoint (checkpoint.resume=auto).
set -euo pipefail
cd "$(dirname "$0")/.."
config="$1"; shift
gpus=$(.venv/bin/python -c 'import torch; print(torch.cuda.device_count())')
nproc="${NPROC:-$([ "$gpus" -gt 0 ] && echo "$gpus" || echo 2)}"
[ "$gpus" -eq 0 ] && export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec .venv/bin/torchrun --standalone --nproc_per_node "$nproc" \
    --max-restarts "${MAX_RESTARTS:-3}" -m app.pretrain --config "$config" "$@"
