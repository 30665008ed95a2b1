"""Where a pod answers HTTP: its base URL from its IP and a port, with an IPv6 address in brackets
(`http://[fd00::1]:8000`, as RFC 3986 writes it: unbracketed, the port would read as part of the
address), and the port a container names. The autoscale loop, the adapter loop and the router build
every pod URL here, so that an IPv6-only cluster works for all of them."""
from __future__ import annotations

from collections.abc import Mapping

from kaon_operator.children.pod_template import HTTP_PORT
from kaon_operator.status.summaries import PodSummary


def base_url(ip: str, port: int) -> str:
    """http://ip:port (no trailing slash), an IPv6 address bracketed."""
    return f"http://[{ip}]:{port}" if ":" in ip else f"http://{ip}:{port}"


def named_port(pod: Mapping, *names: str, default: int) -> int:
    """The containerPort of the first of `names` one of the pod's containers declares, else `default`."""
    ports = {p.get("name"): p.get("containerPort") for c in (pod.get("spec") or {}).get("containers") or ()
             for p in c.get("ports") or ()}
    return next((ports[name] for name in names if ports.get(name)), default)


def engine_url(pod: PodSummary, port: int = HTTP_PORT) -> str:
    """An engine pod's base URL: the engine listens on the pod template's HTTP_PORT."""
    return base_url(pod.ip or "", port)
