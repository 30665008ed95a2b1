"""The pod runner's stand-in for cluster DNS and kube-proxy (e2e/service_proxy.py): which URLs name a Service,
which pods are its endpoints, and a forwarder that reaches a ready pod, or refuses with none."""
from __future__ import annotations

import socket
import threading

from e2e.service_proxy import ServiceProxies, ready_endpoints, service_of

SERVICE = {"spec": {"selector": {"app": "x"}, "ports": [{"port": 80, "targetPort": "http"}]}}


def _pod(ip: str, ready: bool = True, deleting: bool = False) -> dict:
    return {"metadata": {"name": ip, **({"deletionTimestamp": "now"} if deleting else {})},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
            "spec": {"containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": 8000}]}]}}


def test_a_service_url_is_read_in_the_pods_namespace_unless_it_names_one():
    assert service_of("http://llama-prefill:80", "ns") == ("ns", "llama-prefill", 80, "http", "")
    assert service_of("http://llama-prefill.other.svc.cluster.local:8080/v1", "ns") == (
        "other", "llama-prefill", 8080, "http", "/v1")
    assert service_of("https://p", "ns") == ("ns", "p", 443, "https", "")
    assert service_of("http://127.1.0.2:8000", "ns") is None  # an IP: left as written
    assert service_of("tcp://x:1", "ns") is None


def test_the_endpoints_are_the_ready_pods_on_the_target_port():
    pods = [_pod("127.1.0.2"), _pod("127.1.0.3", ready=False), _pod("127.1.0.4", deleting=True)]
    assert ready_endpoints(SERVICE, pods, 80) == [("127.1.0.2", 8000)]
    assert ready_endpoints(SERVICE, pods, 81) == []  # a port the Service does not have
    numbered = {"spec": {"ports": [{"port": 80, "targetPort": 9000}]}}
    assert ready_endpoints(numbered, pods, 80) == [("127.1.0.2", 9000)]


def test_a_forwarder_reaches_an_endpoint_picked_at_connect_time_and_refuses_without_one():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)

    def echo_once():
        conn, _ = server.accept()
        with conn:
            conn.sendall(conn.recv(100).upper())
    threading.Thread(target=echo_once, daemon=True).start()
    endpoints: list[tuple[str, int]] = []
    proxies = ServiceProxies(lambda ns, name, port: list(endpoints))
    try:
        args = proxies.rewrite(["serve", "--prefill-url", "http://p:80", "--port", "8000"], "ns")
        assert args[:2] == ["serve", "--prefill-url"] and args[3:] == ["--port", "8000"]
        host, port = args[2].removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as none_ready:  # closed at once
            none_ready.settimeout(10)
            assert none_ready.recv(10) == b""
        endpoints.append(server.getsockname())
        with socket.create_connection((host, int(port)), timeout=10) as client:
            client.settimeout(10)
            client.sendall(b"hello")
            assert client.recv(10) == b"HELLO"
        assert proxies.url("http://p:80", "ns") == args[2]  # one forwarder per Service
    finally:
        proxies.close()
        server.close()
