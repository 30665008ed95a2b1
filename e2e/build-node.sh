#!/usr/bin/env bash
# Build the real node's Kubernetes binaries from Go modules, the way
# build-control-plane.sh builds the control plane (same wrapper module, same
# version, same flags): kubelet and kube-proxy.
#
# The binaries are cached next to the control plane's:
#   ${KAON_CACHE:-$HOME/.cache/kaon}/k8s/<K8S_VERSION>/bin/{kubelet,kube-proxy}
# A second run finds them there and returns at once. The last line of stdout is
# that bin directory (progress goes to stderr):
#   BIN=$(e2e/build-node.sh | tail -n1)
#
# It runs build-control-plane.sh first (cached: instant) and reuses the wrapper
# module that script generated, so every k8s.io/* module is the one the
# control plane was built with. The container runtime (containerd, runc) and
# the CNI plugins are Debian packages: e2e/setup-node.sh installs them.
#
# Environment: K8S_VERSION, KAON_CACHE, GO, GOFLAGS as in build-control-plane.sh.
set -euo pipefail

K8S_VERSION="${K8S_VERSION:-v1.36.3}"
CACHE_ROOT="${KAON_CACHE:-$HOME/.cache/kaon}"
VERSION_DIR="$CACHE_ROOT/k8s/$K8S_VERSION"
BIN_DIR="$VERSION_DIR/bin"
WORK_DIR="$VERSION_DIR/work"
NODE_BINARIES=(kubelet kube-proxy)
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

log() { printf '[build-node %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

stamp_file() { echo "$BIN_DIR/.node.version"; }
is_built() {
  [[ "$(cat "$(stamp_file)" 2>/dev/null)" == "$K8S_VERSION" ]] || return 1
  local bin
  for bin in "${NODE_BINARIES[@]}"; do [[ -x "$BIN_DIR/$bin" ]] || return 1; done
}

find_go() {
  if [[ -n "${GO:-}" ]]; then :
  elif command -v go >/dev/null 2>&1; then GO="$(command -v go)"
  else GO=/usr/local/go/bin/go; fi
  [[ -x "$GO" ]] || die "no Go toolchain found (set GO=/path/to/go)"
}

# As in build-control-plane.sh: idle CPU only, no toolchain downloads, static binaries.
run_go() { GOTOOLCHAIN=local CGO_ENABLED=0 nice -n 19 "$GO" "$@" >&2; }

# The same -X flags as the control plane's, so `kubelet --version` says v1.Y.Z.
ldflags() {
  local minor="${K8S_VERSION#v1.}" flags="-s -w" pkg kv
  minor="${minor%%.*}"
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    for kv in "gitVersion=$K8S_VERSION" "gitMajor=1" "gitMinor=$minor"; do
      flags+=" -X $pkg.${kv%%=*}=${kv#*=}"
    done
  done
  echo "$flags"
}

main() {
  if is_built; then echo "$BIN_DIR"; return; fi
  # The control plane's wrapper module (and its go.sum) is the starting point.
  bash "$HERE/build-control-plane.sh" >/dev/null
  find_go
  local cp_dir="$WORK_DIR/kubernetes" dir="$WORK_DIR/node" scratch="$VERSION_DIR/.scratch-node"
  [[ -f "$cp_dir/go.mod" ]] || die "no wrapper module in $cp_dir (build-control-plane.sh makes it)"
  exec 9>"$VERSION_DIR/.node.lock"
  if ! flock -n 9; then log "another node build is running; waiting for it"; flock 9; fi
  if is_built; then echo "$BIN_DIR"; return; fi

  local start=$SECONDS
  mkdir -p "$dir"
  # Same requires and replaces; another module name and tool list.
  awk '/^module / {print "module kaon.local/k8s-node"; next}
       /^tool \(/ {skip=1; next}
       skip { if ($0 ~ /^\)/) skip=0; next }
       {print}' "$cp_dir/go.mod" >"$dir/go.mod"
  printf 'tool (\n' >>"$dir/go.mod"
  printf '\tk8s.io/kubernetes/cmd/%s\n' "${NODE_BINARIES[@]}" >>"$dir/go.mod"
  printf ')\n' >>"$dir/go.mod"
  cp "$cp_dir/go.sum" "$dir/go.sum" 2>/dev/null || true
  log "kubernetes $K8S_VERSION: resolving the node's modules (go mod tidy)"
  (cd "$dir" && run_go mod tidy)
  log "kubernetes $K8S_VERSION: building ${NODE_BINARIES[*]}"
  rm -rf "$scratch" && mkdir -p "$scratch"
  local pkgs=() bin
  for bin in "${NODE_BINARIES[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$bin"); done
  (cd "$dir" && run_go build -trimpath -tags selinux,notest -ldflags "$(ldflags)" -o "$scratch/" "${pkgs[@]}")
  for bin in "${NODE_BINARIES[@]}"; do
    [[ -x "$scratch/$bin" ]] || die "$bin was not produced"
    mv -f "$scratch/$bin" "$BIN_DIR/$bin"
  done
  echo "$K8S_VERSION" >"$(stamp_file)"
  rm -rf "$scratch"
  log "done in $((SECONDS - start))s"
  echo "$BIN_DIR"
}

main "$@"
