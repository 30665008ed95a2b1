#!/usr/bin/env bash
# Build a real Kubernetes control plane from Go modules, without Docker and
# without release tarballs: everything comes through the Go module proxy.
#
#   etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, kwok,
#   and helm (for the chart's tests)
#
# etcd, the four Kubernetes binaries and kwok are built by one `go build` in one
# wrapper module (their shared modules -- k8s.io/*, grpc, OpenTelemetry, etcd's
# client -- resolved to one version each and compiled once); helm, which needs
# newer k8s.io/* modules, is built apart.
#
# The binaries are cached outside the repository, keyed by the Kubernetes
# version:  ${KAON_CACHE:-$HOME/.cache/kaon}/k8s/<K8S_VERSION>/bin/
# A second run finds them there and returns at once. The last line of stdout
# is that bin directory (all progress goes to stderr), so callers can do
#   BIN=$(e2e/build-control-plane.sh | tail -n1)
#
# Environment (all optional):
#   K8S_VERSION   Kubernetes release        (default below; needs a Go new enough)
#   ETCD_VERSION  go.etcd.io/etcd/server/v3 (3.5.x or 3.6.x)
#   KWOK_VERSION  sigs.k8s.io/kwok
#   HELM_VERSION  helm.sh/helm/v3           (a v3 release; its go.mod must not need a newer Go)
#   KAON_CACHE    cache root                (default $HOME/.cache/kaon)
#   GO            go binary                 (default: go on PATH, else /usr/local/go/bin/go)
#   GOFLAGS       passed through, e.g. GOFLAGS=-p=1 to use a single core
#
# Background and pitfalls: /work/shared/CONTROL_PLANE.md.
set -euo pipefail

# Kubernetes 1.36 is the newest release whose go.mod ("go 1.26.0") builds with
# Go 1.26 and GOTOOLCHAIN=local; 1.36 itself pins etcd 3.6.x.
K8S_VERSION="${K8S_VERSION:-v1.36.3}"
ETCD_VERSION="${ETCD_VERSION:-v3.6.16}"
KWOK_VERSION="${KWOK_VERSION:-v0.8.0}"
# Helm v3.22 is the newest v3 release; its go.mod says "go 1.26.0" like Kubernetes 1.36's.
HELM_VERSION="${HELM_VERSION:-v3.22.0}"

CACHE_ROOT="${KAON_CACHE:-$HOME/.cache/kaon}"
VERSION_DIR="$CACHE_ROOT/k8s/$K8S_VERSION"
BIN_DIR="$VERSION_DIR/bin"
WORK_DIR="$VERSION_DIR/work"   # wrapper modules, kept for inspection/rebuilds

K8S_BINARIES=(kube-apiserver kube-controller-manager kube-scheduler kubectl)
# What the one wrapper module builds: the Kubernetes binaries, etcd and kwok.
CLUSTER_BINARIES=("${K8S_BINARIES[@]}" etcd kwok)
# The stamp of that build: a change of any version, or of how they are built
# together (RECIPE), rebuilds all of them once. Recipe 2: one module (before:
# etcd and kwok each in their own module, with their own versions of the shared ones).
CLUSTER_RECIPE=2
CLUSTER_STAMP="$K8S_VERSION etcd=$ETCD_VERSION kwok=$KWOK_VERSION recipe=$CLUSTER_RECIPE"

log() { printf '[build-control-plane %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

find_go() {
  if [[ -n "${GO:-}" ]]; then
    :
  elif command -v go >/dev/null 2>&1; then
    GO="$(command -v go)"
  else
    GO=/usr/local/go/bin/go
  fi
  [[ -x "$GO" ]] || die "no Go toolchain found (set GO=/path/to/go)"
}

# Every go invocation goes through here:
# - nice -n 19: a cold build takes a long time; it must only use idle CPU so it
#   does not disturb whatever else runs on the machine (timing-sensitive tests).
# - GOTOOLCHAIN=local: never download another toolchain behind our back; a
#   version that needs a newer Go should fail loudly instead.
# - CGO_ENABLED=0: static binaries, no C toolchain needed (what Kubernetes'
#   own release builds do for these components).
# - Go's stdout is sent to stderr so our stdout carries only the bin dir.
# -gcflags=all=-dwarf=false: the compiler writes no debug information that the links' -ldflags "-s -w"
# would drop anyway (less compile work and smaller objects; the binaries run the same, so caches made
# before it stay valid).
run_go() {
  GOTOOLCHAIN=local CGO_ENABLED=0 nice -n 19 "$GO" "$@" >&2
}
NO_DWARF=-gcflags=all=-dwarf=false

# A component counts as built when its binaries exist and its stamp file
# records the version they were built from (so bumping ETCD_VERSION or
# KWOK_VERSION rebuilds just that component).
stamp_file() { echo "$BIN_DIR/.$1.version"; }

is_built() {  # is_built <component> <version> <binary>...
  local component=$1 version=$2 bin
  shift 2
  [[ "$(cat "$(stamp_file "$component")" 2>/dev/null)" == "$version" ]] || return 1
  for bin in "$@"; do [[ -x "$BIN_DIR/$bin" ]] || return 1; done
}

all_built() {
  is_built cluster "$CLUSTER_STAMP" "${CLUSTER_BINARIES[@]}" &&
    is_built helm "$HELM_VERSION" helm
}

# Move freshly built binaries from a scratch dir into BIN_DIR (rename on the
# same filesystem, so a reader never sees half a binary), then write the stamp.
install_binaries() {  # install_binaries <component> <version> <scratch dir> <binary>...
  local component=$1 version=$2 scratch=$3 bin
  shift 3
  for bin in "$@"; do
    [[ -x "$scratch/$bin" ]] || die "$component: $bin was not produced"
    mv -f "$scratch/$bin" "$BIN_DIR/$bin"
  done
  echo "$version" >"$(stamp_file "$component")"
  rm -rf "$scratch"
}

# Path of a module's go.mod in the module cache (downloads it if needed).
module_gomod() {  # module_gomod <module@version>
  local json
  json="$(GOTOOLCHAIN=local "$GO" mod download -json "$1")" || die "cannot download $1"
  sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p' <<<"$json"
}

# Kubernetes ------------------------------------------------------------------
#
# `go install k8s.io/kubernetes/cmd/...@v1.Y.Z` does not work: k8s.io/kubernetes
# requires its staging modules (k8s.io/api, k8s.io/client-go, ...) at v0.0.0
# and replaces them with ./staging/... paths, which a dependency cannot do.
# So we build from a wrapper module that requires k8s.io/kubernetes and
# replaces each staging module with its published v0.Y.Z release. The replace
# list is generated from the real go.mod of that release, so new staging
# modules (1.36 added cri-streaming and streaming) are picked up by themselves.

write_kubernetes_wrapper() {  # write_kubernetes_wrapper <dir>
  local dir=$1 k8s_gomod staging_version="v0.${K8S_VERSION#v1.}"
  k8s_gomod="$(module_gomod "k8s.io/kubernetes@$K8S_VERSION")"
  [[ -f "$k8s_gomod" ]] || die "no go.mod for k8s.io/kubernetes@$K8S_VERSION"

  mkdir -p "$dir"
  {
    echo "// Generated by e2e/build-control-plane.sh from k8s.io/kubernetes@$K8S_VERSION."
    echo "module kaon.local/k8s-control-plane"
    echo
    # The go and godebug lines of the *main* module decide language semantics
    # and runtime GODEBUG defaults; a dependency's godebug is ignored. Copy
    # Kubernetes' own so the binaries behave like its release builds.
    awk '/^go [0-9]/ {print; print ""}
         /^godebug \(/ {block=1}
         block {print; if ($0 ~ /^\)/) {block=0; print ""}; next}
         /^godebug [^(]/ {print; print ""}' "$k8s_gomod"
    echo "require ("
    echo "	k8s.io/kubernetes $K8S_VERSION"
    echo "	go.etcd.io/etcd/server/v3 $ETCD_VERSION"
    echo "	sigs.k8s.io/kwok $KWOK_VERSION"
    echo ")"
    echo
    echo "replace ("
    # Lines look like "k8s.io/api => ./staging/src/k8s.io/api", inside a
    # replace block or as a one-line "replace ..." directive.
    awk -v v="$staging_version" '
      { sub(/^replace[[:space:]]+/, "") }
      $2 == "=>" && $3 ~ /^\.\/staging\// { printf "\t%s => %s %s\n", $1, $1, v }
    ' "$k8s_gomod"
    echo ")"
    echo
    echo "tool ("
    printf '\tk8s.io/kubernetes/cmd/%s\n' "${K8S_BINARIES[@]}"
    printf '\t%s\n' go.etcd.io/etcd/server/v3 sigs.k8s.io/kwok/cmd/kwok
    echo ")"
  } >"$dir/go.mod"

  local n
  n="$(grep -c "=> k8s.io/.* $staging_version\$" "$dir/go.mod")"
  ((n > 0)) || die "found no staging replaces in $k8s_gomod"
  log "kubernetes: wrapper module with $n staging replaces at $staging_version"
}

# -X flags so /version reports v1.Y.Z instead of v0.0.0-master (the same keys
# hack/lib/version.sh sets, for both component-base and client-go).
kubernetes_ldflags() {
  local minor build_date info key val flags="-s -w"
  minor="${K8S_VERSION#v1.}"
  minor="${minor%%.*}"
  # Use the release's publication time, so rebuilding gives identical output.
  info="$(dirname "$(module_gomod "k8s.io/kubernetes@$K8S_VERSION")")/$K8S_VERSION.info"
  build_date="$(sed -n 's/.*"Time":"\([^"]*\)".*/\1/p' "$info" 2>/dev/null || true)"
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    for kv in "gitVersion=$K8S_VERSION" "gitMajor=1" "gitMinor=$minor" \
      ${build_date:+"buildDate=$build_date"}; do
      key="${kv%%=*}" val="${kv#*=}"
      flags+=" -X $pkg.$key=$val"
    done
  done
  echo "$flags"
}

build_cluster() {
  if is_built cluster "$CLUSTER_STAMP" "${CLUSTER_BINARIES[@]}"; then
    log "kubernetes $K8S_VERSION, etcd $ETCD_VERSION, kwok $KWOK_VERSION: cached"
    return
  fi
  local dir="$WORK_DIR/kubernetes" scratch="$VERSION_DIR/.scratch-cluster" pkgs=()
  write_kubernetes_wrapper "$dir"
  local bin
  for bin in "${K8S_BINARIES[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$bin"); done
  # etcd: go.etcd.io/etcd/server/v3 is itself etcd's main package, but `go install
  # ...@v3.x` refuses it because its go.mod has replace directives; required from
  # the wrapper, those replaces are ignored and the build works. kwok: it asks for
  # k8s.io/* v0.36.1, and the wrapper's replaces pin every k8s.io/* staging module
  # to Kubernetes' own release, so kwok shares them (and Go's version selection
  # gives all binaries the newest grpc/OpenTelemetry/etcd client any of them asks
  # for: the local cluster's e2e tests are what checks that they still serve).
  pkgs+=(go.etcd.io/etcd/server/v3 sigs.k8s.io/kwok/cmd/kwok)

  log "kubernetes $K8S_VERSION + etcd $ETCD_VERSION + kwok $KWOK_VERSION: resolving modules (go mod tidy)"
  (cd "$dir" && run_go mod tidy)

  log "building ${CLUSTER_BINARIES[*]} in one go build (empty build cache: ~10 min on 2 cores)"
  rm -rf "$scratch" && mkdir -p "$scratch"
  (cd "$dir" && run_go build -trimpath "$NO_DWARF" -tags selinux,notest \
    -ldflags "$(kubernetes_ldflags)" -o "$scratch/" "${pkgs[@]}")
  # go build names a binary after its package path less a major-version suffix:
  # go.etcd.io/etcd/server/v3 comes out as "server".
  [[ -x "$scratch/server" ]] && mv -f "$scratch/server" "$scratch/etcd"
  install_binaries cluster "$CLUSTER_STAMP" "$scratch" "${CLUSTER_BINARIES[@]}"
}

# `go install package@version` into a scratch dir, then into the bin cache with its stamp.
go_install_cached() {
  local name="$1" version="$2" package="$3" ldflags="$4"
  local scratch="$VERSION_DIR/.scratch-$name"
  log "$name $version: building"
  rm -rf "$scratch" && mkdir -p "$scratch"
  # cd somewhere neutral: `go install pkg@version` ignores the current module,
  # but a stray go.work/go.mod in the caller's directory would still be read.
  (cd "$scratch" && GOBIN="$scratch" run_go install -trimpath "$NO_DWARF" -ldflags "$ldflags" "$package@$version")
  install_binaries "$name" "$version" "$scratch" "$name"
}

# Helm ------------------------------------------------------------------------
#
# helm.sh/helm/v3 has no replace directives either, so `go install` works. Its
# Makefile sets version variables with -X; without them `helm version` says
# "v3.22" and, worse, helm assumes Kubernetes 1.20 for `.Capabilities.KubeVersion`
# and for lint's deprecation checks. The Kubernetes version is the one of the
# client-go it is built with, read from helm's own go.mod. No git commit is
# known to the module proxy, so gitCommit stays empty.

helm_ldflags() {
  local client_go major minor flags="-s -w"
  client_go="$(awk '$1 == "k8s.io/client-go" {print $2}' "$(module_gomod "helm.sh/helm/v3@$HELM_VERSION")")"
  [[ "$client_go" =~ ^v0\.([0-9]+)\. ]] || die "helm $HELM_VERSION: no k8s.io/client-go version in its go.mod"
  major=1 minor="${BASH_REMATCH[1]}"
  flags+=" -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
  flags+=" -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
  for pkg in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
    flags+=" -X $pkg.k8sVersionMajor=$major -X $pkg.k8sVersionMinor=$minor"
  done
  echo "$flags"
}

build_helm() {
  if is_built helm "$HELM_VERSION" helm; then
    log "helm $HELM_VERSION: cached"
    return
  fi
  local ldflags
  ldflags="$(helm_ldflags)"  # its own line, so that set -e stops on a failure
  go_install_cached helm "$HELM_VERSION" helm.sh/helm/v3/cmd/helm "$ldflags"
}

main() {
  # Fast path: everything cached, no Go needed, no lock taken.
  if all_built; then
    echo "$BIN_DIR"
    return
  fi

  find_go
  mkdir -p "$BIN_DIR" "$WORK_DIR"
  # Serialise concurrent callers (e.g. two test sessions) so they do not both
  # spend half an hour building the same thing; the second one then finds the
  # cache filled by the first.
  exec 9>"$VERSION_DIR/.lock"
  if ! flock -n 9; then
    log "another build of $K8S_VERSION is running; waiting for it"
    local asked=$SECONDS
    flock 9
    # A test that waited on the build beside it (`make test`): .ci/run takes this out of the suite's time.
    [[ -z "${KAON_BUILD_WAIT_LOG:-}" ]] || echo "control-plane $((SECONDS - asked))" >> "$KAON_BUILD_WAIT_LOG"
  fi

  log "Kubernetes $K8S_VERSION, etcd $ETCD_VERSION, kwok $KWOK_VERSION, helm $HELM_VERSION; $("$GO" version)"
  log "cache: $BIN_DIR"
  local start=$SECONDS helm
  # helm and the cluster's wrapper module share nothing (helm needs newer k8s.io/*): built side by side,
  # one's module downloads and single-threaded links overlap the other's compiles (on 2 cores, a cold
  # build's idle CPU otherwise).
  build_helm & helm=$!
  build_cluster
  wait "$helm" || die "helm $HELM_VERSION: build failed"
  all_built || die "build finished but the cache is incomplete"
  log "done in $((SECONDS - start))s"
  echo "$BIN_DIR"
}

main "$@"
