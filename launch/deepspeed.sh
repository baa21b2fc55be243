#!/usr/bin/env bash
# The DeepSpeed variant of launch/torchrun.sh: ZeRO stage ZERO (1, 2 or 3, default 2) from
# launch/deepspeed/zero$ZERO.json, which sets gradient_clipping explicitly.
#   ZERO=1 NPROC=8 launch/deepspeed.sh launch/configs/imagenet_xclr.yaml
set -euo pipefail
here="$(dirname "$0")"
config="$1"; shift
exec bash "$here/torchrun.sh" "$config" engine.name=deepspeed \
    "engine.deepspeed_config=launch/deepspeed/zero${ZERO:-2}.json" "$@"
