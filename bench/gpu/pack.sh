#!/usr/bin/env bash
# Run here before a GPU lease: the wheels the GPU machine lacks (requirements.txt), for its
# Python 3.12, into .whl/ (git-ignored, a few MB). Carry `.whl` with the call; run.sh installs them.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
rm -rf .whl
platforms=()
for tag in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_27_x86_64 manylinux_2_28_x86_64 \
    manylinux_2_34_x86_64 manylinux_2_35_x86_64; do
    platforms+=(--platform "$tag")
done
grep -v '^#' bench/gpu/requirements.txt | xargs $PY -m pip download --quiet --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp "${platforms[@]}" -d .whl
du -sh .whl
