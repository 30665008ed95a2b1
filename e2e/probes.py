"""The kubelet's probe rules, for the pod runner: which probe runs when, and what its results mean.

Pure bookkeeping (ProbeState.due / record), so the rules are testable without processes; the
HTTP GET itself runs on a worker thread (`http_probe`), so a hung process (SIGSTOP) costs the
runner nothing but the probe's own timeout, as with a kubelet.

As a kubelet does: liveness and readiness wait for the startup probe to succeed; a probe fails
after `failureThreshold` consecutive failures and succeeds after `successThreshold` successes;
its first run is `initialDelaySeconds` after the container started, later ones every
`periodSeconds`, and one run fails after `timeoutSeconds`. A failed startup or liveness probe
kills the container (SIGTERM, then SIGKILL after the probe's terminationGracePeriodSeconds, else
the pod's); a failed readiness probe only takes it out of Ready.
"""
from __future__ import annotations

import urllib.error
import urllib.request
from concurrent.futures import Future
from dataclasses import dataclass

KINDS = ("startupProbe", "livenessProbe", "readinessProbe")


@dataclass(slots=True)
class ProbeState:
    kind: str
    spec: dict
    started_at: float  # the container's start (monotonic)
    next_at: float = 0.0
    failures: int = 0
    successes: int = 0
    result: bool | None = None  # the probe's verdict so far (None: not decided yet)
    in_flight: Future | None = None  # the Future of a running GET

    def __post_init__(self):
        self.next_at = self.started_at + self.spec.get("initialDelaySeconds", 0)

    @property
    def period(self) -> float:
        return self.spec.get("periodSeconds", 10)

    @property
    def timeout(self) -> float:
        return self.spec.get("timeoutSeconds", 1)

    def due(self, now: float) -> bool:
        return self.in_flight is None and now >= self.next_at

    def record(self, ok: bool, now: float) -> bool | None:
        """Count one result; the probe's verdict changes when a threshold is crossed (returned)."""
        self.in_flight = None
        self.next_at = now + self.period
        if ok:
            self.successes, self.failures = self.successes + 1, 0
            if self.successes >= self.spec.get("successThreshold", 1):
                self.result = True
        else:
            self.successes, self.failures = 0, self.failures + 1
            if self.failures >= self.spec.get("failureThreshold", 3):
                self.result = False
        return self.result


def probes(container: dict, started_at: float) -> dict[str, ProbeState]:
    return {kind: ProbeState(kind, container[kind], started_at) for kind in KINDS if container.get(kind)}


def http_probe(spec: dict, ip: str, ports: dict[str, int]) -> tuple[bool, str]:
    """One httpGet probe: (success, what a kubelet's Unhealthy event would say on failure)."""
    get = spec.get("httpGet") or {}
    port = get.get("port", 80)
    port = ports.get(port, port) if isinstance(port, str) else port
    url = f"http://{ip}:{port}{get.get('path', '/')}"
    try:
        with urllib.request.urlopen(url, timeout=spec.get("timeoutSeconds", 1)) as resp:
            ok = 200 <= resp.status < 400
            return ok, "" if ok else f"HTTP probe failed with statuscode: {resp.status}"
    except urllib.error.HTTPError as exc:
        body = exc.read(300).decode(errors="replace")
        return False, f"HTTP probe failed with statuscode: {exc.code}: {body}"
    except (OSError, ValueError) as exc:  # refused, reset, or timed out (a hung process)
        return False, f"Get {url!r}: {getattr(exc, 'reason', exc)}"


def parse_quantity(text: str | int | float) -> int:
    """A Kubernetes quantity (`512Mi`, `2G`, `1e9`, `1024`) in bytes."""
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60,
             "k": 10 ** 3, "K": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9, "T": 10 ** 12, "P": 10 ** 15, "E": 10 ** 18,
             "m": 10 ** -3}
    text = str(text).strip()
    for suffix in sorted(units, key=len, reverse=True):
        if text.endswith(suffix) and text[:-len(suffix)]:
            return int(float(text[:-len(suffix)]) * units[suffix])
    return int(float(text))
