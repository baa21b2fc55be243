#!/usr/bin/env bash
# One node, N processes, CPU or GPU:
#   launch/torchrun.sh CONFIG.yaml [key=value ...]
#   NPROC=8 launch/torchrun.sh launch/configs/imagenet_xclr.yaml
# NPROC defaults to the GPU count (2 processes on a CPU-only machine). A failed worker makes
# torchrun restart the group (MAX_RESTARTS times); the restarted run resumes from its newest
# readable checkpoint (checkpoint.resume=auto).
#
# Elastic, on every node of the job (docs/training.md, "Elastic membership"):
#   NNODES=1:4 RDZV_ENDPOINT=head-node:29500 launch/torchrun.sh CONFIG.yaml [key=value ...]
# joins a c10d rendezvous of between MIN and MAX nodes (RDZV_ID names the job: the same on
# every node). A lost node stops the others' workers, which restart at the smaller world
# and resume from the newest checkpoint; a node that starts (again) makes the group grow.
# RDZV_CONF passes torchrun's --rdzv-conf, e.g. last_call_timeout=5,keep_alive_interval=2:
# how long a round that has MIN nodes waits for more (torch: 30 s), and the heartbeat period
# (torch: 5 s; a node is lost after 3 missed). LOCAL_ADDR is the address the node's peers
# reach it at (torchrun's --local-addr; default: its hostname), and GLOO_SOCKET_IFNAME the
# interface gloo binds on, where the hostname does not resolve to that address.
set -euo pipefail
cd "$(dirname "$0")/.."
config="$1"; shift
nproc="${NPROC:-}"
if [ -z "$nproc" ] || [ -z "${OMP_NUM_THREADS:-}" ]; then  # the GPU count decides them
    gpus=$(.venv/bin/python -c 'import torch; print(torch.cuda.device_count())')
    [ -n "$nproc" ] || nproc=$([ "$gpus" -gt 0 ] && echo "$gpus" || echo 2)
    [ "$gpus" -gt 0 ] || export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
fi
if [ -n "${NNODES:-}" ]; then
    # each rendezvous round publishes its own store address: the agents' shared store
    # (torch's default) is not published again to a node that joins a later round
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    nodes=(--nnodes "$NNODES" --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT"
           --rdzv-id "${RDZV_ID:-contrastive-pretrain}" ${RDZV_CONF:+--rdzv-conf "$RDZV_CONF"}
           ${LOCAL_ADDR:+--local-addr "$LOCAL_ADDR"})
else
    nodes=(--standalone)
fi
# with the node's step-timer server beside the agent (pretrain/run/hang.py)
exec bash launch/with_step_timer.sh .venv/bin/torchrun "${nodes[@]}" --nproc_per_node "$nproc" \
    --max-restarts "${MAX_RESTARTS:-3}" -m app.pretrain --config "$config" "$@"
