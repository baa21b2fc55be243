#!/usr/bin/env bash
# Runs a torchrun agent with its node's step-timer server beside it (pretrain/run/hang.py):
#   bash launch/with_step_timer.sh .venv/bin/torchrun ...
# The server kills a training process whose steps stopped, with its loader workers, so that
# torchrun restarts the group as for a crash; it ends after the agent. launch/torchrun.sh
# and launch/slurm.sbatch start every agent through it. Without a server (it did not start
# within 60 s), the agent runs without one, and says so.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
export TORCHELASTIC_TIMER_FILE="${TMPDIR:-/tmp}/step-timer-$$"
rm -f "$TORCHELASTIC_TIMER_FILE"
(cd "$repo" && exec .venv/bin/python -m pretrain.run.step_timer "$TORCHELASTIC_TIMER_FILE") &
server=$!
for _ in $(seq 600); do
    [ -p "$TORCHELASTIC_TIMER_FILE" ] && break
    kill -0 "$server" 2>/dev/null || break
    sleep 0.1
done
if [ ! -p "$TORCHELASTIC_TIMER_FILE" ]; then
    echo "with_step_timer: the step-timer server did not start; running without it" >&2
    unset TORCHELASTIC_TIMER_FILE
fi
exec "$@"
