"""Where the predictive policy's performance model comes from, each autoscale tick: the I/O of
`spec.autoscaling.profile` (the decisions are profiling.py's).

- `<configmap>`: read it (until it holds a readable model, every tick; then kept).
- `auto`: read the ConfigMap of the spec's key; without one, look at the profiling Job of
  that key: none, create it (Normal `Profiling`); running, wait; succeeded, write its pod's
  termination message to the ConfigMap (Normal `Profiled`); failed, say so once (Warning
  `ProfilingFailed`). A changed key is a new name, so the same steps start again.
- `none` or unset: no model.

Clean-up (profiling.stale): once auto reads the current key's model, or with any other setting,
the profiling Jobs (with their pods) and ConfigMaps this service made that the setting no longer reads are deleted
(Normal `ProfileCleaned`), once per setting and operator run; a failure is logged, not retried
until the setting changes or the operator restarts (the service's deletion removes them anyway).

auto trusts its ConfigMap and Job only when this service controls them, and the Job's pods only
when the Job controls them (profiling.controlled_by): a ConfigMap or Job of that name that is not
the service's leaves the setting without a model (the condition says why), and every such object
is named once in a Warning `ProfileNotOwned` Event.

Every outcome is the `Profiled` condition; without a model the autoscaler scales by the
reactive policy and says so in every decision's reason. An API error (RBAC, a name taken by
an object kaon does not control) is reported the same way and tried again next tick.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kubernetes.client.rest import ApiException

from kaon_operator import api
from kaon_operator.autoscaling import profiling
from kaon_operator.autoscaling.perf_model import PerfModel
from kaon_operator.autoscaling.profiling import Step
from kaon_operator.children import resources
from kaon_operator.kube import NotOwned
from kaon_operator.records import ProfileMemory
from kaon_operator.status import conditions
from kaon_operator.status.conditions import EventSpec

logger = logging.getLogger("kaon.autoscaler")


@dataclass(frozen=True, slots=True)
class Resolved:
    model: PerfModel | None
    name: str | None
    condition: dict | None
    """Profiled (None without a profile)."""


def resolve(kube, body: Mapping, spec: api.InferenceServiceSpec, memory: ProfileMemory,
            post: Callable[[Mapping, list[EventSpec]], None]) -> Resolved:
    """The model for this tick (blocking I/O: run it in a thread)."""
    meta = body["metadata"]
    setting = spec.autoscaling.profile
    name = profiling.config_map_name(meta["name"], setting, spec)
    if name is None:
        _clean(kube, body, None, None, memory, post)
        return Resolved(None, None, None)
    auto = setting == profiling.AUTO
    if memory.name == name and memory.model is not None:
        found = (conditions.profiled_condition(Step.USE, name) if auto
                 else conditions.named_profile_condition(name, memory.model))
        resolved = Resolved(memory.model, name, found)
    else:
        resolved = _read(kube, body, spec, name, memory, post)
    if not auto:
        _clean(kube, body, None, name, memory, post)
    elif resolved.model is not None:  # auto settled on the current key's model
        _clean(kube, body, profiling.key_digest(profiling.profile_key(spec)), None, memory, post)
    return resolved


def _read(kube, body: Mapping, spec: api.InferenceServiceSpec, name: str, memory: ProfileMemory,
          post: Callable[[Mapping, list[EventSpec]], None]) -> Resolved:
    meta = body["metadata"]
    memory.name, memory.model = name, None
    try:
        if spec.autoscaling.profile != profiling.AUTO:  # the user's own ConfigMap, by the name it gave
            saved = profiling.read_model((kube.config_map_data(meta["namespace"], name) or {}).get(api.PROFILE_KEY))
            memory.model = saved
            return Resolved(saved, name, conditions.named_profile_condition(name, saved))
        found = kube.get_config_map(meta["namespace"], name)
        if found is not None and not profiling.controlled_by(found, meta.get("uid")):
            _report_strangers(body, [{**found, "kind": "ConfigMap"}], memory, post)
            raise NotOwned("ConfigMap", meta["namespace"], name, "not this InferenceService")
        saved = profiling.read_model(((found or {}).get("data") or {}).get(api.PROFILE_KEY))
        memory.model, condition = _auto(kube, body, spec, name, saved, memory, post)
    except (ApiException, NotOwned) as exc:
        why = str(exc) if isinstance(exc, NotOwned) else f"{exc.status} {exc.reason}"
        return Resolved(None, name, conditions.profiled_condition(Step.FAILED, name, why))
    return Resolved(memory.model, name, condition)


def _clean(kube, body: Mapping, keep_digest: str | None, keep_name: str | None, memory: ProfileMemory,
           post: Callable[[Mapping, list[EventSpec]], None]) -> None:
    """Delete this service's profiling Jobs (pods too) and ConfigMaps that the setting no longer reads
    (profiling.stale), once per setting: two label-selected lists, then nothing until it changes."""
    done = f"{keep_digest}/{keep_name}"
    if memory.cleaned == done:
        return
    memory.cleaned = done
    meta = body["metadata"]
    if not meta.get("uid"):  # no uid to check the objects' controller against: touch nothing
        return
    owner = resources.Owner(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])
    removed: list[dict] = []
    try:
        found = [obj for api_version, kind in profiling.PROFILE_KINDS
                 for obj in kube.list_objects(api_version, kind, owner.namespace,
                                              profiling.profile_selector(owner.name))]
        for obj in profiling.stale(found, owner, keep_digest, keep_name):
            kube.delete(obj, propagation="Background")
            removed.append(obj)
    except ApiException as exc:  # RBAC without list or delete: the objects stay until the service goes
        logger.warning("%s/%s: cleaning up old profiling objects failed: %s %s", owner.namespace, owner.name,
                       exc.status, exc.reason)
    if removed:
        post(body, [EventSpec("Normal", "ProfileCleaned", profiling.cleaned_message(removed))])


def _report_strangers(body: Mapping, objects: list[dict], memory: ProfileMemory,
                      post: Callable[[Mapping, list[EventSpec]], None]) -> None:
    """A Warning Event naming the objects posing as this service's profile, once per object."""
    named = profiling.strangers(objects, None)
    new = [n for n in named if n not in memory.strangers]
    if new:
        memory.strangers |= frozenset(new)
        post(body, [EventSpec("Warning", "ProfileNotOwned", f"ignored {', '.join(new)}: carries the name or labels "
                                                            "of this InferenceService's profile (spec.autoscaling."
                                                            "profile: auto) but is not controlled by it")])


def _auto(kube, body: Mapping, spec: api.InferenceServiceSpec, name: str, saved: PerfModel | None,
          memory: ProfileMemory, post: Callable[[Mapping, list[EventSpec]], None]) -> tuple[PerfModel | None, dict]:
    meta = body["metadata"]
    owner = resources.Owner(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])
    job = None if saved is not None else kube.get_job(owner.namespace, name)
    state = None
    if job is not None:
        if not profiling.controlled_by(job, owner.uid):
            _report_strangers(body, [{**job, "kind": "Job"}], memory, post)
            raise NotOwned("Job", owner.namespace, name, "not this InferenceService")
        digest = profiling.key_digest(profiling.profile_key(spec))
        pods = kube.list_pods(owner.namespace, profiling.pod_selector(owner.name, digest))
        _report_strangers(body, [p for p in pods if not profiling.controlled_by(p, job["metadata"].get("uid"))],
                          memory, post)
        state = profiling.job_state(job, pods)
    step = profiling.next_step(saved, state)
    if step is Step.RUN:
        kube.create_once(profiling.job(owner, spec))
        post(body, [EventSpec("Normal", "Profiling", f"created Job {name} to measure the engine's performance "
                                                     "model (spec.autoscaling.profile: auto)")])
    elif step is Step.SAVE:
        assert state is not None
        saved = profiling.read_model(state.message)
        kube.create_once(profiling.config_map(owner, spec, state.message))
        assert saved is not None
        post(body, [EventSpec("Normal", "Profiled", f"performance model measured by Job {name} in ConfigMap {name}: "
                                                    f"step {saved.a * 1e3:.2f} ms + {saved.b * 1e3:.3f} ms a sequence "
                                                    f"+ {saved.c * 1e6:.2f} us a prompt token; cold start "
                                                    f"{saved.cold_start_seconds:.0f} s")])
    elif step is Step.FAILED and state is not None and memory.warned != state.uid:
        memory.warned = state.uid
        post(body, [EventSpec("Warning", "ProfilingFailed", f"profiling Job {name} failed: "
                                                            f"{profiling.failure(state)}")])
    return saved, conditions.profiled_condition(step, name, profiling.failure(state) if state is not None else "")
