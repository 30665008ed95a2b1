#!/usr/bin/env bash
# Build kaon's container images for the local cluster's real node, without Docker and without
# a registry: buildah builds the project's own Dockerfiles on base images bootstrapped here
# from Debian's packages (debootstrap), and every image is saved as an OCI archive that
# e2e/real_node.py imports into the node's containerd.
#
#   kaon.local/debian:bookworm      debootstrap --variant=minbase bookworm (+ ca-certificates)
#   kaon.local/python:3.11-slim     that + Debian's python3 (3.11) in a venv on PATH, standing in
#                                   for python:3.11-slim (operator/Dockerfile's PYTHON_IMAGE)
#   kaon.local/pause:1              e2e/pause (a static Go binary, alone): the pods' sandbox
#   kaon.local/kaon-operator:dev    operator/Dockerfile (operator and router)
#   kaon.local/kaon:dev             runtime/Dockerfile on the Debian base (CUDA_IMAGE), torch from
#                                   PyPI (download.pytorch.org is not reachable here)
#
# Each image is cached under ${KAON_CACHE:-$HOME/.cache/kaon}/images/, keyed on a hash of
# its inputs (Dockerfile, sources, base), so a second run returns at once; buildah's layer
# cache keeps torch's layer when only kaon's sources change. The last line of stdout is a
# file listing "<image name> <archive>" per line.
#
#   e2e/build-images.sh [IMAGE...]   # pause, operator, runtime (default: all three)
#
# Needs root, debootstrap and buildah (e2e/setup-node.sh installs them).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
CACHE="${KAON_CACHE:-$HOME/.cache/kaon}/images"
DEBIAN_SUITE="${DEBIAN_SUITE:-bookworm}"
DEBIAN_MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
TORCH_INDEX_URL="${TORCH_INDEX_URL:-https://pypi.org/simple}"
LIST="$CACHE/images.list"

log() { printf '[build-images %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# buildah keeps its storage in the cache too, not in /var/lib/containers.
bah() { nice -n 19 buildah --root "$CACHE/storage" --runroot "$CACHE/run" --storage-driver overlay "$@"; }

hash_of() {  # hash_of <text> <path>...: one hash over a text and the contents of files/directories
  local text=$1
  shift
  {
    echo "$text"
    find "$@" -type f -not -name '*.pyc' -not -path '*/__pycache__/*' -print0 | sort -z | xargs -0 sha256sum
  } | sha256sum | cut -c1-16
}

have() { [[ -f "$CACHE/archives/$1.tar" && -f "$CACHE/archives/$1.done" ]]; }

save() {  # save <image name> <key>: the image as an OCI archive, uncompressed (ctr imports it)
  local name=$1 key=$2 tmp="$CACHE/archives/.$2.tar"
  rm -f "$tmp"
  log "$name: saving $key.tar"
  bah push --disable-compression --quiet "$name" "oci-archive:$tmp:$name" >/dev/null
  mv -f "$tmp" "$CACHE/archives/$key.tar"
  touch "$CACHE/archives/$key.done"
  # Older archives of the same image go (a runtime archive is a few GB), and so do the layers
  # no image uses any more.
  local old
  for old in "$CACHE/archives/${key%-*}"-*.tar; do
    [[ "$old" == "$CACHE/archives/$key.tar" || ! -e "$old" ]] && continue
    rm -f "$old" "${old%.tar}.done" "${old%.tar}.loaded"
  done
  bah rmi --prune >/dev/null 2>&1 || true
}

record() {  # record <image name> <key>: the image's line in the list
  local name=$1 key=$2
  grep -v "^$name " "$LIST" 2>/dev/null >"$LIST.tmp" || true
  echo "$name $CACHE/archives/$key.tar" >>"$LIST.tmp"
  mv -f "$LIST.tmp" "$LIST"
}

ensure_local() {  # ensure_local <image name> <key>: in buildah's storage (loaded from the archive)
  local name=$1 key=$2
  if [[ "$(bah images --noheading --format '{{.Name}}:{{.Tag}} {{.ID}}' 2>/dev/null | awk -v n="$name" '$1 == n')" == "" ]] ||
     [[ "$(cat "$CACHE/archives/$key.loaded" 2>/dev/null)" != "$key" ]]; then
    log "$name: loading $key.tar into buildah's storage"
    bah pull --quiet "oci-archive:$CACHE/archives/$key.tar" >/dev/null
    bah tag "$(bah images --noheading --format '{{.ID}}' --filter "reference=$name" | head -n1)" "$name" 2>/dev/null || true
    echo "$key" >"$CACHE/archives/$key.loaded"
  fi
}

# Bases ---------------------------------------------------------------------------------------

BASE=kaon.local/debian:$DEBIAN_SUITE
PYBASE=kaon.local/python:3.11-slim

base_key() { hash_of "debian $DEBIAN_SUITE $DEBIAN_MIRROR minbase ca-certificates v1" /dev/null; }

build_base() {
  local key="debian-$(base_key)"
  if have "$key"; then ensure_local "$BASE" "$key"; echo "$key"; return; fi
  local rootfs="$CACHE/.rootfs-$DEBIAN_SUITE" start=$SECONDS
  log "$BASE: debootstrap --variant=minbase $DEBIAN_SUITE from $DEBIAN_MIRROR"
  rm -rf "$rootfs"
  nice -n 19 debootstrap --variant=minbase --include=ca-certificates "$DEBIAN_SUITE" "$rootfs" "$DEBIAN_MIRROR" >&2
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  local ctr
  ctr="$(bah from scratch)"
  tar -C "$rootfs" -c . | bah add "$ctr" - / >/dev/null 2>&1 || {
    # older buildah cannot read a tar from stdin: go through a file
    tar -C "$rootfs" -cf "$CACHE/.rootfs.tar" . && bah add "$ctr" "$CACHE/.rootfs.tar" / >/dev/null
    rm -f "$CACHE/.rootfs.tar"
  }
  bah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env LANG=C.UTF-8 --cmd /bin/bash --os linux --arch amd64 "$ctr"
  bah commit --quiet --rm "$ctr" "$BASE" >/dev/null
  rm -rf "$rootfs"
  save "$BASE" "$key"
  echo "$key" >"$CACHE/archives/$key.loaded"
  log "$BASE: built in $((SECONDS - start))s"
  echo "$key"
}

build_pybase() {  # build_pybase <base key>
  local key="python-$(hash_of "python3 venv /opt/python v1 $1" /dev/null)"
  if have "$key"; then ensure_local "$PYBASE" "$key"; echo "$key"; return; fi
  local start=$SECONDS ctr
  log "$PYBASE: Debian's python3 in a venv on PATH"
  ctr="$(bah from --pull=false "$BASE")"
  bah run --isolation chroot --network host "$ctr" -- sh -c \
    'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3 python3-venv >/dev/null \
     && rm -rf /var/lib/apt/lists/* && python3 -m venv /opt/python && /opt/python/bin/python --version' >&2
  bah config --env PATH=/opt/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --cmd python3 "$ctr"
  bah commit --quiet --rm "$ctr" "$PYBASE" >/dev/null
  save "$PYBASE" "$key"
  echo "$key" >"$CACHE/archives/$key.loaded"
  log "$PYBASE: built in $((SECONDS - start))s"
  echo "$key"
}

# Images --------------------------------------------------------------------------------------

# pip inside the build trusts what the host's pip trusts (a TLS-inspecting proxy's CA, say):
# the host's CA bundle and a pip.conf pointing at it are mounted for RUN steps only.
build_mounts() {
  local bundle=/etc/ssl/certs/ca-certificates.crt
  [[ -f "$bundle" ]] || return 0
  mkdir -p "$CACHE/build-etc"
  printf '[global]\ncert = /run/kaon-build/ca.crt\n' >"$CACHE/build-etc/pip.conf"
  echo "-v $bundle:/run/kaon-build/ca.crt:ro -v $CACHE/build-etc/pip.conf:/etc/pip.conf:ro"
}

bud() {  # bud <image name> <key> <context> <Dockerfile> [--build-arg ...]
  local name=$1 key=$2 context=$3 dockerfile=$4 start=$SECONDS
  shift 4
  log "$name: buildah bud -f ${dockerfile#"$ROOT"/} $*"
  # buildah's own output (every pip line) goes to build.log; its tail is shown when it fails.
  # shellcheck disable=SC2046
  if ! bah bud --layers --pull=false --isolation chroot --network host $(build_mounts) \
    -f "$dockerfile" -t "$name" "$@" "$context" >"$CACHE/build.log" 2>&1; then
    tail -n 40 "$CACHE/build.log" >&2
    die "$name: buildah bud failed (all of it: $CACHE/build.log)"
  fi
  save "$name" "$key"
  log "$name: built in $((SECONDS - start))s"
}

build_pause() {
  local name=kaon.local/pause:1 key
  key="pause-$(hash_of "v1" "$HERE/pause")"
  if ! have "$key"; then
    local start=$SECONDS scratch="$CACHE/.pause" ctr
    mkdir -p "$scratch"
    (cd "$HERE/pause" && GOTOOLCHAIN=local CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$scratch/pause" .)
    ctr="$(bah from scratch)"
    bah copy "$ctr" "$scratch/pause" /pause >/dev/null
    bah config --entrypoint '["/pause"]' --os linux --arch amd64 "$ctr"
    bah commit --quiet --rm "$ctr" "$name" >/dev/null
    rm -rf "$scratch"
    save "$name" "$key"
    log "$name: built in $((SECONDS - start))s"
  fi
  record "$name" "$key"
}

build_operator() {
  local name=kaon.local/kaon-operator:dev base key
  base="$(build_base)"
  base="$(build_pybase "$base")"
  key="operator-$(hash_of "$base" "$ROOT/operator/Dockerfile" "$ROOT/operator/pyproject.toml" "$ROOT/operator/kaon_operator" \
    "$ROOT/operator/kaon_wire")"
  have "$key" || bud "$name" "$key" "$ROOT/operator" "$ROOT/operator/Dockerfile" --build-arg "PYTHON_IMAGE=$PYBASE"
  record "$name" "$key"
}

build_runtime() {
  local name=kaon.local/kaon:dev base key
  base="$(build_base)"
  key="runtime-$(hash_of "$base $TORCH_INDEX_URL" "$ROOT/runtime/Dockerfile" "$ROOT/pyproject.toml" \
    "$ROOT/runtime/kaon_runtime" "$ROOT/operator/kaon_operator" "$ROOT/operator/kaon_wire")"
  have "$key" || bud "$name" "$key" "$ROOT" "$ROOT/runtime/Dockerfile" \
    --build-arg "CUDA_IMAGE=$BASE" --build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL"
  record "$name" "$key"
}

main() {
  [[ $(id -u) == 0 ]] || die "needs root (buildah, debootstrap)"
  command -v buildah >/dev/null && command -v debootstrap >/dev/null || die "needs buildah and debootstrap: e2e/setup-node.sh"
  mkdir -p "$CACHE/archives"
  exec 9>"$CACHE/.lock"
  if ! flock -n 9; then log "another image build is running; waiting for it"; flock 9; fi
  local images=("$@") start=$SECONDS
  ((${#images[@]})) || images=(pause operator runtime)
  for image in "${images[@]}"; do
    case "$image" in
      pause) build_pause ;;
      operator) build_operator ;;
      runtime) build_runtime ;;
      *) die "unknown image $image (pause, operator, runtime)" ;;
    esac
  done
  log "done in $((SECONDS - start))s"
  echo "$LIST"
}

main "$@"
