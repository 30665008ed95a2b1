#!/usr/bin/env bash
# Install llama-cpp-python into the venv from a wheel built once and cached outside the repository.
#
# Why: tests/unit/runtime/loader/test_gguf_families.py checks kaon's GGUF decoding against llama.cpp
# on the same file, and the benches use it as the peer. PyPI serves it as source only, so pip
# compiles llama.cpp with cmake each time (minutes on 2 cores): this builds the wheel once,
#   ${KAON_CACHE:-$HOME/.cache/kaon}/wheels/llama-cpp-python/<version>-<python>-<arch>-portable-<flags>/
# (<flags>: a digest of the CMake flags below and of llama-cpp-python-lean.cmake, so a change of flags
# builds a new wheel instead of installing one built otherwise)
# and later calls install that wheel (seconds), or return at once when it is already installed.
# `make test` runs it in the background beside tests/unit (nice 19, with the Go builds), not in
# `make install`: a cold build no longer holds up install and lint. The GGUF test that needs it runs
# it too, which waits on the build's lock (the wait goes to $KAON_BUILD_WAIT_LOG, as the Go builds').
#
# Built portable (GGML_NATIVE=OFF: AVX2, FMA and F16C, no AVX-512 or AMX), so the wheel is the same on
# every x86-64 machine of this kind, Intel or AMD: the native build on an Intel Xeon with AMX crashed
# (SIGSEGV) in its first decode of every model (2026-11-29). The tests need llama.cpp's results, not
# its top speed.
#
# Environment (all optional):
#   LLAMA_CPP_PYTHON_VERSION  the pinned release (default below)
#   PY                        the venv's python (default .venv/bin/python)
#   KAON_CACHE                cache root (default $HOME/.cache/kaon)
#   CMAKE_BUILD_PARALLEL_LEVEL  compile jobs (default: the machine's cores)
set -euo pipefail

# 0.3.36: the release the benches were measured with (bench/RESULTS.md) and pyproject's floor.
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
PY="${PY:-.venv/bin/python}"
CACHE_ROOT="${KAON_CACHE:-$HOME/.cache/kaon}"

log() { printf '[build-llama-cpp %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }

# Only what llama-cpp-python's Python loads: libllama and ggml's CPU backend, one portable variant.
# - No mtmd (LLAVA_BUILD=OFF: images and audio, imported only for those; no test or bench uses it).
# - No tests, tools, examples, server or app: llama.cpp leaves them off as a subproject; said here so
#   that a release changing that default cannot bring them back unnoticed.
# - No "common" library and no cpp-httplib: llama-cpp-python forces common on, and only the project
#   include below can turn it off (measured 2026-11-29: see docs/testing.md, "A cold CI").
# - One CPU backend linked in (no GGML_BACKEND_DL, so no per-CPU variants).
CMAKE_FLAGS="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF \
-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DGGML_BACKEND_DL=OFF"
LEAN="$(cd "$(dirname "$0")" && pwd)/llama-cpp-python-lean.cmake"
# The cache key: the flags and the include's content (not its path, which differs from clone to clone).
flags_key=$(cat <(echo "$CMAKE_FLAGS") "$LEAN" | sha256sum | cut -c1-12)
python_tag=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
WHEELS="$CACHE_ROOT/wheels/llama-cpp-python/$VERSION-$python_tag-$(uname -m)-portable-$flags_key"

# One build at a time (the background build of `make test`, the test that waits for it): the second
# waits on the lock, then finds the wheel installed (the check is under the lock: a half-done
# install is never taken for a whole one).
mkdir -p "$CACHE_ROOT/wheels"
exec 9>"$CACHE_ROOT/wheels/.llama-cpp-python.lock"
if ! flock -n 9; then
  log "another build of llama-cpp-python is running; waiting for it"
  asked=$SECONDS
  flock 9
  # A test that waited on the build beside it (`make test`): .ci/run takes this out of the suite's time.
  [[ -z "${KAON_BUILD_WAIT_LOG:-}" ]] || echo "llama-cpp $((SECONDS - asked))" >> "$KAON_BUILD_WAIT_LOG"
fi
# (imported, not only listed: a wheel installed without its dependencies is not installed)
installed=$("$PY" -c 'import importlib.metadata as m, llama_cpp; print(m.version("llama-cpp-python"))' 2>/dev/null || true)
# Which wheel the venv has: a venv holding this version built with other flags gets this build instead.
marker="$("$PY" -c 'import sys; print(sys.prefix)')/.llama-cpp-python-flags"
if [[ "$installed" == "$VERSION" && "$(cat "$marker" 2>/dev/null)" == "$flags_key" ]]; then
  exit 0
fi

if ! compgen -G "$WHEELS/llama_cpp_python-*.whl" >/dev/null; then
  log "building llama-cpp-python $VERSION from source (a few minutes per core; cached in $WHEELS)"
  start=$SECONDS
  mkdir -p "$WHEELS"
  tmp=$(mktemp -d "$WHEELS.tmp.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  # Three tries, a minute apart: in the cold CI of 2026-11-30 the package index reset every connection
  # for a few seconds (pip's own five retries came within them) and the wheel was missing for the tests.
  for try in 1 2 3; do
    CMAKE_ARGS="$CMAKE_FLAGS -DCMAKE_PROJECT_llama.cpp_INCLUDE=$LEAN" \
    CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
      "$PY" -m pip wheel --quiet --no-deps --no-cache-dir --no-binary llama-cpp-python \
        "llama-cpp-python==$VERSION" -w "$tmp" && break
    ((try < 3)) || exit 1
    log "pip wheel failed (try $try of 3); again in 60 s"
    sleep 60
  done
  # --no-cache-dir: pip's own wheel cache ignores CMAKE_ARGS and would hand back a build made with
  # other flags. Moved into place whole: an interrupted build leaves no half wheel for the next call.
  mv "$tmp"/llama_cpp_python-*.whl "$WHEELS/"
  log "done in $((SECONDS - start))s"
fi

# --force-reinstall: the same version built with other flags counts as installed to pip (--no-deps: not
# numpy and the rest again); then a plain install adds the dependencies a fresh venv lacks (diskcache, ...).
"$PY" -m pip install --quiet --no-deps --force-reinstall "$WHEELS"/llama_cpp_python-*.whl
"$PY" -m pip install --quiet "$WHEELS"/llama_cpp_python-*.whl
echo "$flags_key" > "$marker"
log "llama-cpp-python $VERSION installed"
