#!/usr/bin/env bash
# Runs a torchrun agent with its node's step-timer server beside it (pretrain/run/hang.py):
#   bash launch/with_step_timer.sh .venv/bin/torchrun ...
# The server kills a training process whose steps stopped, with its loader workers, so that
# torchrun restarts the group as for a crash; it ends after the agent. launch/torchrun.sh
# and launch/slurm.sbatch start every agent through it.
set -euo pipefail
cd "$(dirname "$0")/.."
export TORCHELASTIC_TIMER_FILE="${TMPDIR:-/tmp}/step-timer-$$"
.venv/bin/python -m pretrain.run.step_timer "$TORCHELASTIC_TIMER_FILE" &
for _ in $(seq 600); do [ -p "$TORCHELASTIC_TIMER_FILE" ] && break; sleep 0.1; done
exec "$@"
