"""The kubelet's probe rules, for the pod runner: which probe runs when, and what its results mean.

Pure bookkeeping (ProbeState.due / record), so the rules are testable without processes; the
HTTP GET itself runs on a worker thread (`http_probe`), so a hung process (SIGSTOP) costs the
runner nothing but the probe's own timeout, as with a kubelet.

As a kubelet does: liveness and readiness wait for the startup probe to succeed; a probe fails
after `failureThreshold` consecutive failures and succeeds after `successThreshold` successes;
its first run is `initialDelaySeconds` after the container started, later ones every
`periodSeconds`, and one run fails after `timeoutSeconds`.

Unlike a kubelet, the pod runner may also take a quick look (`look` seconds apart) between the
declared runs while a probe has not yet succeeded: an engine that loads in 8 s then starts
serving at once instead of at the next 10 s run, which on a shared test cluster is most of the
wait for each new replica. A look that succeeds counts as the next declared run would; one that
fails counts for nothing (no kubelet made it), so failures, thresholds and the startup budget
stay exactly as declared. Tests of the probes themselves run without looks. A failed startup or liveness probe
kills the container (SIGTERM, then SIGKILL after the probe's terminationGracePeriodSeconds, else
the pod's); a failed readiness probe only takes it out of Ready.
"""
from __future__ import annotations

import http.client
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
    look: float | None = None  # seconds between quick looks until the first success (None: none)
    look_at: float = 0.0
    declared: bool = True  # the GET in flight is a declared run, not a quick look

    def __post_init__(self):
        self.next_at = self.look_at = self.started_at + self.spec.get("initialDelaySeconds", 0)

    @property
    def period(self) -> float:
        return self.spec.get("periodSeconds", 10)

    @property
    def timeout(self) -> float:
        return self.spec.get("timeoutSeconds", 1)

    def _looking(self, now: float) -> bool:
        return self.look is not None and self.result is not True and now >= self.look_at

    def due(self, now: float) -> bool:
        return self.in_flight is None and (now >= self.next_at or self._looking(now))

    def begin(self, get: Future, now: float) -> None:
        """A GET started (when due): a declared run, or a quick look between two."""
        self.in_flight, self.declared = get, now >= self.next_at

    def record(self, ok: bool, now: float) -> bool | None:
        """Count one result; the probe's verdict changes when a threshold is crossed (returned)."""
        self.in_flight = None
        self.look_at = now + (self.look or 0.0)
        if not ok and not self.declared:
            return self.result  # a failed quick look: a kubelet never made it
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


def probes(container: dict, started_at: float, look: float | None = None) -> dict[str, ProbeState]:
    return {kind: ProbeState(kind, container[kind], started_at, look=look) for kind in KINDS if container.get(kind)}


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
        try:
            body = exc.read(300).decode(errors="replace")
        except (OSError, http.client.HTTPException):  # the engine died while sending it
            body = ""
        return False, f"HTTP probe failed with statuscode: {exc.code}: {body}"
    except (OSError, ValueError, http.client.HTTPException) as exc:
        # refused, reset, timed out (a hung process), or cut off mid-answer (killed while answering: a bad
        # status line or a short body are HTTPExceptions, not OSErrors). A probe that raised would stay in
        # flight with its exception, and the runner would never probe this pod again.
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
