"""The operator under test on the real control plane: an InferenceService manifest, polling, kubectl."""
from __future__ import annotations

import json
import time

import pytest

from kaon_operator import api

MODEL = {"uri": "builtin://smollm2-135m-instruct"}
STAND_IN = "kwok-ready/kaon:1"  # KWOK marks these engine pods Ready without running anything


def isvc(name: str, **spec) -> str:
    """An InferenceService; its engine image is the KWOK stand-in unless the spec names one."""
    engine = {"image": STAND_IN, **spec.pop("engine", {})}
    return json.dumps({"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": name},
                       "spec": {"model": MODEL, "engine": engine, **spec}})


def wait_for(what: str, check, timeout: float = 30.0, interval: float = 0.3):
    """Poll `check` until it returns something truthy; fail with `what` and the last value."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout}s waiting for {what}; last seen: {last!r}")


class Cluster:
    """kubectl as admin in one namespace, with the reads these tests repeat."""

    def __init__(self, cp, namespace: str):
        self.cp, self.ns = cp, namespace

    def kubectl(self, *args: str, **kw):
        return self.cp.kubectl("-n", self.ns, *args, **kw)

    def get(self, kind: str, name: str | None = None, selector: str | None = None) -> dict | list | None:
        args = ["get", kind] + ([name] if name else []) + (["-l", selector] if selector else [])
        res = self.kubectl(*args, "-o", "json", check=False)
        if res.returncode != 0:
            return None
        data = json.loads(res.stdout)
        return data.get("items", data)

    def condition_if(self, name: str, type_: str, status: str) -> dict | None:
        """The condition when it has this status (one read, so the answer is consistent)."""
        cond = self.condition(name, type_)
        return cond if cond.get("status") == status else None

    def status(self, name: str) -> dict:
        """The InferenceService's status; empty until the operator first writes one (a poll that
        starts right after `kubectl apply` can read the object before that)."""
        return (self.get("infsvc", name) or {}).get("status") or {}

    def condition(self, name: str, type_: str) -> dict:
        return next((c for c in self.status(name).get("conditions", []) if c["type"] == type_), {})

    def ready(self, name: str) -> bool:
        return self.condition(name, "Ready").get("status") == "True"

    def events(self, name: str) -> list[tuple[str, str, str]]:
        items = self.get("events") or []
        return [(e["type"], e["reason"], e["message"]) for e in items
                if e["involvedObject"]["kind"] == api.KIND and e["involvedObject"]["name"] == name]

    def event_posted(self, name: str, reason: str, type_: str | None = None, contains: str = "",
                     timeout: float = 30.0) -> list[tuple[str, str, str]]:
        """The InferenceService's Events once one with `reason` (of `type_`, with `contains` in its message) is
        among them. An Event trails the status it reports: kopf posts Events from a queue of its own task, the
        autoscale and standby loops after their writes, so a test that waited for a condition, a replica count
        or a pod must wait again for the Event (reading it at once fails on a busy machine)."""
        def posted() -> list[tuple[str, str, str]] | None:
            events = self.events(name)
            found = any(r == reason and (type_ is None or t == type_) and contains in m for t, r, m in events)
            return events if found else None
        return wait_for(f"the {type_ or ''} {reason} Event of {name} ({contains!r})", posted, timeout=timeout)

    def pods(self, name: str) -> list[dict]:
        return self.get("pods", selector=f"kaon.dev/inferenceservice={name}") or []

    def running_pods(self, name: str) -> list[dict]:
        return [p for p in self.pods(name)
                if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")]
