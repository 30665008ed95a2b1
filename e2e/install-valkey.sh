#!/usr/bin/env bash
# The shared response cache's server for InferenceRoute's tests: Debian's valkey-server when the
# release has it, else its redis-server (the same protocol; bookworm has only redis-server). Installed
# once with apt-get (root), then found on PATH; the tests start their own on a free port
# (tests/support/valkey.py). Prints the server binary's path last.
set -euo pipefail
for bin in valkey-server redis-server; do
  if command -v "$bin" >/dev/null; then command -v "$bin"; exit 0; fi
done
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >&2
if apt-cache show valkey-server >/dev/null 2>&1; then
  apt-get install -y -qq valkey-server >&2
else
  apt-get install -y -qq redis-server >&2
fi
# The package enables a system service; the tests run their own server and want none on 6379.
(service valkey-server stop || service redis-server stop || true) >/dev/null 2>&1
command -v valkey-server || command -v redis-server
