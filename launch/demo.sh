#!/usr/bin/env bash
# Set up and run the main job on the embedded defaults (local CPU, gloo, SQLite MLflow,
# bundled data): see launch/demo_pipeline.sh. A few minutes on 2 cores. Installs the
# runtime dependencies only (no test tools, object-store emulators or DALI).
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
bash launch/demo_pipeline.sh "$@"
