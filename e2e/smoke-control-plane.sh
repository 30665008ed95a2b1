#!/usr/bin/env bash
# Smoke test for the binaries from e2e/build-control-plane.sh: print their
# versions, start etcd + kube-apiserver on loopback ports (TLS, RBAC on),
# check /readyz and /version through kubectl, create and delete a namespace,
# then stop both processes by PID and remove everything they wrote.
#
# Usage: e2e/smoke-control-plane.sh [BIN_DIR]
#   BIN_DIR defaults to the last line printed by build-control-plane.sh
#   (which builds first if the cache is empty).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
STARTUP_TIMEOUT="${STARTUP_TIMEOUT:-120}"   # seconds; a loaded 2-core box is slow

log() { printf '[smoke] %s\n' "$*" >&2; }
die() { log "FAIL: $*"; exit 1; }

BIN="${1:-$("$HERE/build-control-plane.sh" | tail -n1)}"
K8S_VERSION="$(basename "$(dirname "$BIN")")"   # cache layout: k8s/<version>/bin
TMP="$(mktemp -d -t kaon-smoke.XXXXXX)"
ETCD_PID="" APISERVER_PID=""

# Stop exactly the processes we started (by PID), then drop the temp dir.
cleanup() {
  local pid
  for pid in $APISERVER_PID $ETCD_PID; do
    if kill -0 "$pid" 2>/dev/null; then
      kill "$pid" 2>/dev/null || true
      wait "$pid" 2>/dev/null || true
    fi
  done
  rm -rf "$TMP"
}
trap cleanup EXIT

# The kernel hands out a free port for bind(port 0); there is a small race
# until etcd/apiserver bind it, acceptable for a smoke test.
free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

check_versions() {
  local out
  out="$("$BIN/kube-apiserver" --version)"; log "$out"
  [[ "$out" == "Kubernetes $K8S_VERSION" ]] || die "kube-apiserver reports '$out'"
  out="$("$BIN/kube-controller-manager" --version)"; log "$out"
  [[ "$out" == "Kubernetes $K8S_VERSION" ]] || die "kube-controller-manager reports '$out'"
  out="$("$BIN/kube-scheduler" --version)"; log "$out"
  [[ "$out" == "Kubernetes $K8S_VERSION" ]] || die "kube-scheduler reports '$out'"
  out="$("$BIN/kubectl" version --client)"; log "${out//$'\n'/; }"
  grep -q "Client Version: $K8S_VERSION" <<<"$out" || die "kubectl reports '$out'"
  out="$("$BIN/etcd" --version)"; log "${out//$'\n'/; }"
  grep -q '^etcd Version: 3\.[56]\.' <<<"$out" || die "etcd reports '$out'"
  out="$("$BIN/kwok" --version)"; log "${out//$'\n'/; }"
  [[ -n "$out" ]] || die "kwok printed no version"
}

# CA, apiserver serving cert (127.0.0.1/localhost), admin client cert in
# system:masters, service-account signing key pair.
make_certs() {
  local d="$TMP/pki"
  mkdir -p "$d"
  openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj "/CN=kaon-smoke-ca" \
    -keyout "$d/ca.key" -out "$d/ca.crt" 2>/dev/null

  openssl req -newkey rsa:2048 -nodes -subj "/CN=kube-apiserver" \
    -keyout "$d/apiserver.key" -out "$d/apiserver.csr" 2>/dev/null
  printf 'subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc\nextendedKeyUsage=serverAuth\n' >"$d/apiserver.ext"
  openssl x509 -req -in "$d/apiserver.csr" -CA "$d/ca.crt" -CAkey "$d/ca.key" \
    -CAcreateserial -days 1 -extfile "$d/apiserver.ext" -out "$d/apiserver.crt" 2>/dev/null

  openssl req -newkey rsa:2048 -nodes -subj "/O=system:masters/CN=kaon-smoke-admin" \
    -keyout "$d/admin.key" -out "$d/admin.csr" 2>/dev/null
  printf 'extendedKeyUsage=clientAuth\n' >"$d/admin.ext"
  openssl x509 -req -in "$d/admin.csr" -CA "$d/ca.crt" -CAkey "$d/ca.key" \
    -CAcreateserial -days 1 -extfile "$d/admin.ext" -out "$d/admin.crt" 2>/dev/null

  openssl genrsa -out "$d/sa.key" 2048 2>/dev/null
  openssl rsa -in "$d/sa.key" -pubout -out "$d/sa.pub" 2>/dev/null
}

start_etcd() {
  ETCD_PORT="$(free_port)"
  local peer_port
  peer_port="$(free_port)"
  "$BIN/etcd" --name smoke --data-dir "$TMP/etcd" --unsafe-no-fsync \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$peer_port" \
    --initial-advertise-peer-urls "http://127.0.0.1:$peer_port" \
    --initial-cluster "smoke=http://127.0.0.1:$peer_port" \
    >"$TMP/etcd.log" 2>&1 &
  ETCD_PID=$!
  log "etcd pid $ETCD_PID on 127.0.0.1:$ETCD_PORT"
}

start_apiserver() {
  API_PORT="$(free_port)"
  local d="$TMP/pki"
  # --advertise-address: there is no default route here, so the apiserver
  # cannot pick an address itself. --endpoint-reconciler-type=none: the
  # reconciler rejects a loopback address for the kubernetes Service.
  "$BIN/kube-apiserver" \
    --etcd-servers "http://127.0.0.1:$ETCD_PORT" \
    --bind-address 127.0.0.1 --advertise-address 127.0.0.1 \
    --secure-port "$API_PORT" --cert-dir "$TMP/apiserver-certs" \
    --tls-cert-file "$d/apiserver.crt" --tls-private-key-file "$d/apiserver.key" \
    --client-ca-file "$d/ca.crt" \
    --authorization-mode RBAC \
    --endpoint-reconciler-type none \
    --service-account-issuer https://kubernetes.default.svc \
    --service-account-key-file "$d/sa.pub" \
    --service-account-signing-key-file "$d/sa.key" \
    --service-cluster-ip-range 10.0.0.0/24 \
    >"$TMP/apiserver.log" 2>&1 &
  APISERVER_PID=$!
  log "kube-apiserver pid $APISERVER_PID on https://127.0.0.1:$API_PORT"

  export KUBECONFIG="$TMP/admin.kubeconfig"
  "$BIN/kubectl" config set-cluster smoke --server "https://127.0.0.1:$API_PORT" \
    --certificate-authority "$d/ca.crt" --embed-certs >/dev/null
  "$BIN/kubectl" config set-credentials admin --client-certificate "$d/admin.crt" \
    --client-key "$d/admin.key" --embed-certs >/dev/null
  "$BIN/kubectl" config set-context smoke --cluster smoke --user admin >/dev/null
  "$BIN/kubectl" config use-context smoke >/dev/null
}

wait_ready() {
  local deadline=$((SECONDS + STARTUP_TIMEOUT)) out=""
  while ((SECONDS < deadline)); do
    kill -0 "$ETCD_PID" 2>/dev/null || { tail -n 20 "$TMP/etcd.log" >&2; die "etcd exited"; }
    kill -0 "$APISERVER_PID" 2>/dev/null || { tail -n 30 "$TMP/apiserver.log" >&2; die "kube-apiserver exited"; }
    out="$("$BIN/kubectl" get --raw /readyz 2>/dev/null || true)"
    if [[ "$out" == "ok" ]]; then
      log "/readyz: ok after ${SECONDS}s"
      return
    fi
    sleep 1
  done
  tail -n 30 "$TMP/apiserver.log" >&2
  die "/readyz not ok after ${STARTUP_TIMEOUT}s (last: '$out')"
}

check_api() {
  local out
  out="$("$BIN/kubectl" get --raw /version)"
  log "/version: $(tr -d ' \n' <<<"$out")"
  grep -q "\"gitVersion\": \"$K8S_VERSION\"" <<<"$out" || die "/version does not report $K8S_VERSION"
  # A write and a delete through RBAC (admin is in system:masters) into etcd.
  "$BIN/kubectl" create namespace kaon-smoke >/dev/null
  "$BIN/kubectl" get namespace kaon-smoke -o name >/dev/null
  "$BIN/kubectl" delete namespace kaon-smoke --wait=false >/dev/null
  log "namespace create/get/delete: ok"
}

main() {
  log "binaries: $BIN (expecting $K8S_VERSION)"
  check_versions
  make_certs
  SECONDS=0
  start_etcd
  start_apiserver
  wait_ready
  check_api
  log "PASS"
}

main "$@"
