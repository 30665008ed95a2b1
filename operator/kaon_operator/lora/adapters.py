"""LoRA adapters on running engine pods, as pure decisions: what each pod must load or unload
(`plan`, idempotent: a pod that holds what the spec asks gets no action) and what status.adapters
says (the AdaptersReady condition, from the same facts, is status/conditions.py's). adapter_sync.py
does the I/O.

A pod's held adapters are read from its /v1/models (the entries with a `parent`: the engine's
registered adapters, with their `root` = the path they were loaded from).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Literal, NamedTuple

from kaon_operator import api
from kaon_operator.lora import adapter_pods

Held = Mapping[str, str]
"""adapter name -> the path (or URI) it was loaded from, on one pod."""


class Action(NamedTuple):
    pod: str
    op: Literal["load", "unload"]
    name: str
    path: str = ""


def desired(spec: api.InferenceServiceSpec) -> dict[str, str]:
    """adapter name -> the `lora_path` every ready pod must hold it from."""
    return {a.name: adapter_pods.lora_path(spec, a) for a in spec.adapters}


def held(models: Mapping) -> dict[str, str]:
    """The adapters in a /v1/models reply (OpenAI's list; kaon and vLLM give adapters a `parent`)."""
    data = models.get("data") if isinstance(models, Mapping) else None
    return {str(m["id"]): str(m.get("root") or "") for m in data or () if isinstance(m, Mapping)
            and m.get("parent") and m.get("id")}


def plan(want: Mapping[str, str], pods: Mapping[str, Held], skip: Iterable[tuple[str, str]] = ()) -> list[Action]:
    """The loads and unloads that bring every pod to `want`: unload what is not wanted (or wanted from
    another path: unload, then load again), load what is missing, except the (pod, name) pairs in
    `skip` (a load that failed lately: retried later, not every round). Unloads come first: they free
    slots. Planning again after the actions gives nothing."""
    skipped = set(skip)
    unloads = [Action(pod, "unload", name) for pod, have in sorted(pods.items()) for name, path in sorted(have.items())
               if want.get(name) != path]
    loads = [Action(pod, "load", name, path) for pod, have in sorted(pods.items())
             for name, path in sorted(want.items()) if have.get(name) != path and (pod, name) not in skipped]
    return unloads + loads


def settled(want: Mapping[str, str], have: Held, failed: Iterable[str]) -> bool:
    """Whether a pod may take requests: each wanted adapter is held from its path, or its load on this
    pod failed (reported; the base serves). The adapter readiness gate waits for this."""
    failures = set(failed)
    return all(have.get(name) == path or name in failures for name, path in want.items())


def status(want: Mapping[str, str], pods: Mapping[str, Held], failures: Mapping[str, str]) -> list[dict]:
    """status.adapters: each wanted adapter, the pods holding it from its path, the last failure."""
    out = []
    for name, path in sorted(want.items()):
        entry: dict = {"name": name, "pods": sorted(p for p, have in pods.items() if have.get(name) == path)}
        if name in failures:
            entry["failure"] = failures[name]
        out.append(entry)
    return out
