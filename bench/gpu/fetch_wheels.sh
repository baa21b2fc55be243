#!/usr/bin/env bash
# On a machine with the package index: the wheels the GPU kit installs on an offline node,
# into bench/gpu/wheels/ (git-ignored), for Python 3.12 on x86-64 Linux, at the versions
# launch/constraints.txt pins. Fails if the folder would exceed 60 MiB.
#   bash bench/gpu/fetch_wheels.sh [PYTHON_VERSION]     (default 3.12)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
version="${1:-3.12}"
out="$here/wheels"
limit_mib=60
pins=()
while read -r name; do
    [[ -z "$name" || "$name" == \#* ]] && continue
    pin=$(grep -i "^${name}==" "$repo/launch/constraints.txt" || true)
    [ -n "$pin" ] || { echo "fetch_wheels: $name is not pinned in launch/constraints.txt" >&2; exit 1; }
    pins+=("$pin")
done < "$here/wheels.txt"
rm -rf "$out" && mkdir -p "$out"
python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version "$version" --implementation cp --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --dest "$out" "${pins[@]}"
size_kib=$(du -sk "$out" | cut -f1)
if (( size_kib > limit_mib * 1024 )); then
    echo "fetch_wheels: $out holds $((size_kib / 1024)) MiB, over the ${limit_mib} MiB a node takes" >&2
    exit 1
fi
echo "fetch_wheels: $(ls "$out" | wc -l) wheels, $((size_kib / 1024)) MiB in $out: copy the repository with it to the node"
