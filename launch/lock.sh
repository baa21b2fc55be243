#!/usr/bin/env bash
# Refresh launch/constraints.txt, the pinned versions every install uses: resolve the
# newest releases the package index serves for the project and all its extras in a
# throw-away venv, and freeze every package (transitive ones included).
#   bash launch/lock.sh          then run the tests, and commit the new constraints.txt
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3
venv="$(mktemp -d)/venv"
trap 'rm -rf "$(dirname "$venv")"' EXIT
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install --quiet --upgrade pip setuptools wheel 2>>"$venv.log"
"${pip[@]}" install --quiet torch torchvision
"${pip[@]}" install --quiet --no-build-isolation --editable ".[dev,bench]"
{
    echo "# Pinned versions of every runtime, test and benchmark dependency (transitive ones"
    echo "# included), used by launch/setup.sh. Refresh: bash launch/lock.sh"
    echo "# Resolved $(date -u +%Y-%m-%d) for Python $("$venv/bin/python" -c 'import sys; print(sys.version.split()[0])')."
    "${pip[@]}" freeze --all | grep -v -i '^contrastive-pretrain' | LC_ALL=C sort -f
} > launch/constraints.txt
echo "lock: $(grep -vc '^#' launch/constraints.txt) packages pinned in launch/constraints.txt"
