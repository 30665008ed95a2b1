"""Plays kube-proxy and cluster DNS for the pod runner (e2e/pod_runner.py): a Service URL in an engine's
arguments reaches a ready pod behind the Service.

The local cluster has no DNS and no kube-proxy, so `http://llama-prefill:80`, the URL the operator gives a
decode engine (`--prefill-url`, spec.prefill), resolves to nothing. The pod runner rewrites such a URL to a
forwarder of its own on 127.0.0.1, one per Service: each connection it accepts goes to a ready pod the
Service selects (its `targetPort`, a number or a container port's name), picked at connect time as
kube-proxy's rules would, so a pod that starts, restarts or goes away later is followed; with no ready pod
the connection is closed at once, as kube-proxy rejects one to a Service without endpoints.
"""
from __future__ import annotations

import random
import re
import socket
import threading
from collections.abc import Callable
from contextlib import suppress

# http://name[.namespace[.svc[.cluster.local]]][:port][/path]
_SERVICE_URL = re.compile(r"^(https?)://([a-z0-9]([-a-z0-9]*[a-z0-9])?)(\.([a-z0-9-]+))?(\.svc(\.cluster\.local)?)?"
                          r"(:(\d+))?(/.*)?$")
URL_FLAGS = ("--prefill-url",)
"""The arguments whose values are Service URLs (the rest are left as written)."""

Endpoints = Callable[[str, str, int], list[tuple[str, int]]]
"""(namespace, service, service port) -> the (ip, port) of each ready pod behind it."""


def service_of(url: str, namespace: str) -> tuple[str, str, int, str, str] | None:
    """(namespace, service, port, scheme, path) a Service URL names, or None for anything else (an IP)."""
    match = _SERVICE_URL.match(url)
    if match is None or re.fullmatch(r"[\d.]+", match.group(2) + (match.group(4) or "")):
        return None
    scheme, name, ns, port, path = match.group(1), match.group(2), match.group(5), match.group(9), match.group(10)
    return ns or namespace, name, int(port or (443 if scheme == "https" else 80)), scheme, path or ""


def ready_endpoints(service: dict, pods: list[dict], port: int) -> list[tuple[str, int]]:
    """The (pod IP, target port) of each ready pod among `pods` (those the Service's selector matched) for the
    Service's `port`, as the EndpointSlice controller would list them."""
    spec_port = next((p for p in service["spec"].get("ports") or [] if p.get("port") == port), None)
    if spec_port is None:
        return []
    target = spec_port.get("targetPort", port)
    found = []
    for pod in pods:
        status = pod.get("status") or {}
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
        if not ready or not status.get("podIP") or pod["metadata"].get("deletionTimestamp"):
            continue
        if isinstance(target, int):
            found.append((status["podIP"], target))
            continue
        for container in pod["spec"]["containers"]:
            named = [p["containerPort"] for p in container.get("ports") or [] if p.get("name") == target]
            if named:
                found.append((status["podIP"], named[0]))
                break
    return found


class _Forwarder:
    """A listening socket on 127.0.0.1 whose connections are piped to one of the Service's ready pods."""

    def __init__(self, pick: Callable[[], list[tuple[str, int]]]):
        self.pick = pick
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return  # closed: the runner stopped
            threading.Thread(target=self._connect, args=(client,), daemon=True).start()

    def _connect(self, client: socket.socket) -> None:
        try:
            targets = self.pick()
            if not targets:
                raise OSError("no ready endpoint")
            upstream = socket.create_connection(random.choice(targets), timeout=10)
            upstream.settimeout(None)
        except OSError:
            client.close()
            return
        threading.Thread(target=_pipe, args=(upstream, client), daemon=True).start()
        _pipe(client, upstream)

    def close(self) -> None:
        with suppress(OSError):
            self.sock.close()


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    """Bytes from source to sink until source's end closes; then sink's write side closes (a half close, as
    TCP through kube-proxy's NAT keeps it)."""
    try:
        while chunk := source.recv(65536):
            sink.sendall(chunk)
    except OSError:
        pass
    finally:
        with suppress(OSError):
            sink.shutdown(socket.SHUT_WR)
        with suppress(OSError):
            source.close()


class ServiceProxies:
    """One forwarder per Service named in an engine's arguments, for as long as the runner runs."""

    def __init__(self, endpoints: Endpoints):
        self.endpoints = endpoints
        self._forwarders: dict[tuple[str, str, int], _Forwarder] = {}
        self._lock = threading.Lock()

    def rewrite(self, args: list[str], namespace: str) -> list[str]:
        """`args` with each Service URL of URL_FLAGS pointed at its forwarder."""
        out = list(args)
        for i, arg in enumerate(out[:-1]):
            if arg in URL_FLAGS:
                out[i + 1] = self.url(out[i + 1], namespace)
        return out

    def url(self, url: str, namespace: str) -> str:
        found = service_of(url, namespace)
        if found is None:
            return url
        ns, name, port, scheme, path = found
        with self._lock:
            forwarder = self._forwarders.get((ns, name, port))
            if forwarder is None:
                forwarder = self._forwarders[(ns, name, port)] = _Forwarder(lambda: self.endpoints(ns, name, port))
        return f"{scheme}://127.0.0.1:{forwarder.port}{path}"

    def close(self) -> None:
        with self._lock:
            for forwarder in self._forwarders.values():
                forwarder.close()
            self._forwarders.clear()
