#!/usr/bin/env bash
# Install what the local cluster's real node (e2e/real_node.py) and the image builds
# (e2e/build-images.sh) need from Debian's packages: containerd, runc, the CNI plugins,
# nftables (kube-proxy's nftables mode), iptables (the kubelet adds a few chains), socat (the
# apiserver forwarder), conntrack, buildah and debootstrap. Debian bookworm; needs root.
# Idempotent: returns at once when everything is installed.
set -euo pipefail
PACKAGES=(containerd runc containernetworking-plugins nftables iptables socat conntrack iproute2
          buildah debootstrap fuse-overlayfs uidmap)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]} == 0)); then exit 0; fi
[[ $(id -u) == 0 ]] || { echo "setup-node: needs root to install ${missing[*]}" >&2; exit 1; }
echo "setup-node: installing ${missing[*]}" >&2
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
