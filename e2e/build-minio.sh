#!/usr/bin/env bash
# Build a real MinIO server (the S3-compatible object store the s3:// tests use) from Go
# modules, like build-control-plane.sh builds the control plane: no Docker, no release
# binaries, everything through the Go module proxy.
#
# Cached outside the repository: ${KAON_CACHE:-$HOME/.cache/kaon}/minio/<version>/bin/minio
# A second run finds it there and returns at once. The last line of stdout is the path of
# the binary (progress goes to stderr):   MINIO=$(e2e/build-minio.sh | tail -n1)
#
# Environment (all optional):
#   MINIO_VERSION  github.com/minio/minio module version (default below)
#   KAON_CACHE     cache root (default $HOME/.cache/kaon)
#   GO             go binary (default: go on PATH, else /usr/local/go/bin/go)
#   GOFLAGS        passed through, e.g. GOFLAGS=-p=1 to use a single core
#
# MinIO tags its releases RELEASE.<date>, which are not semantic versions, and the module
# proxy serves no version for them: the pseudo-version below is the newest commit the proxy
# lists (`go list -m github.com/minio/minio@latest`); its go.mod says go 1.24 and has no
# replace directives, so a plain `go install` works with Go 1.26 and GOTOOLCHAIN=local.
set -euo pipefail

MINIO_VERSION="${MINIO_VERSION:-v0.0.0-20260212201848-7aac2a2c5b7c}"
CACHE_ROOT="${KAON_CACHE:-$HOME/.cache/kaon}"
DIR="$CACHE_ROOT/minio/$MINIO_VERSION"
BIN="$DIR/bin/minio"

log() { printf '[build-minio %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

if [[ -x "$BIN" && "$(cat "$DIR/bin/.version" 2>/dev/null)" == "$MINIO_VERSION" ]]; then
  echo "$BIN"
  exit 0
fi

if [[ -z "${GO:-}" ]]; then
  GO="$(command -v go || echo /usr/local/go/bin/go)"
fi
[[ -x "$GO" ]] || die "no Go toolchain found (set GO=/path/to/go)"

mkdir -p "$DIR/bin"
exec 9>"$DIR/.lock"
if ! flock -n 9; then
  log "another build of minio $MINIO_VERSION is running; waiting for it"
  asked=$SECONDS
  flock 9
  # A test that waited on the build beside it (`make test`): .ci/run takes this out of the suite's time.
  [[ -z "${KAON_BUILD_WAIT_LOG:-}" ]] || echo "minio $((SECONDS - asked))" >> "$KAON_BUILD_WAIT_LOG"
  [[ -x "$BIN" ]] && { echo "$BIN"; exit 0; }
fi

scratch="$DIR/.scratch"
rm -rf "$scratch" && mkdir -p "$scratch"
log "minio $MINIO_VERSION: building with $("$GO" version) (empty Go caches: tens of minutes on 2 cores)"
start=$SECONDS
# nice -n 19: only idle CPU; GOTOOLCHAIN=local: never fetch another Go; CGO_ENABLED=0: static;
# no DWARF compiled that -ldflags "-s -w" would drop (build-control-plane.sh).
(cd "$scratch" && GOBIN="$scratch" GOTOOLCHAIN=local CGO_ENABLED=0 nice -n 19 \
  "$GO" install -trimpath -gcflags=all=-dwarf=false -ldflags "-s -w" "github.com/minio/minio@$MINIO_VERSION" >&2)
[[ -x "$scratch/minio" ]] || die "minio was not produced"
mv -f "$scratch/minio" "$BIN"
echo "$MINIO_VERSION" >"$DIR/bin/.version"
rm -rf "$scratch"
log "done in $((SECONDS - start))s"
echo "$BIN"
