"""Pure decisions about change: what a spec edit means for the children, and whether a
child was edited by someone other than the operator."""
from __future__ import annotations

from kaon_operator import api
from kaon_operator.children import resources
from kaon_operator.children.ownership import FIELD_MANAGER
from kaon_operator.status.conditions import EventSpec

_OWNER = resources.Owner(name="x", namespace="x", uid="x")  # only the pod template is compared


def _template(spec: api.InferenceServiceSpec) -> dict:
    return resources.deployment(_OWNER, spec)["spec"]["template"]


def _changed_fields(old: dict, new: dict, prefix: str = "") -> list[str]:
    fields = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            fields += _changed_fields(a, b, f"{prefix}{key}.")
        elif a != b:
            fields.append(f"{prefix}{key}")
    return fields


def describe_spec_change(old: api.InferenceServiceSpec, new: api.InferenceServiceSpec,
                         autoscaled: bool = False) -> list[EventSpec]:
    """The Events for an applied spec change: a rollout when the pod template changed,
    a scale when the replica count did (unless the autoscaler did it: it posts its own Event,
    with its reason), an update for anything else (autoscaling, routing)."""
    events = []
    if _template(old) != _template(new):
        fields = _changed_fields(old.model_dump(by_alias=True), new.model_dump(by_alias=True))
        fields = [f for f in fields if f != "replicas"]
        events.append(EventSpec("Normal", "RollingOut",
                                f"spec changed ({', '.join(fields)}): rolling out new engine pods"))
    if old.replicas != new.replicas and not autoscaled:
        events.append(EventSpec("Normal", "Scaled", f"Scaled {old.replicas} → {new.replicas} (spec.replicas)"))
    if not events and old.model_copy(update={"replicas": new.replicas}) != new:
        fields = _changed_fields(old.model_dump(by_alias=True), new.model_dump(by_alias=True))
        events.append(EventSpec("Normal", "Updated", f"spec changed ({', '.join(fields)}); pods unchanged"))
    return events


def foreign_spec_managers(managed_fields: list[dict] | None) -> list[str]:
    """Field managers other than the operator that own part of a child's spec.

    Controllers write status through the status subresource and the Deployment
    controller only annotates metadata, so an entry here means a person or tool
    edited what the operator renders (kubectl edit, kubectl scale, a CI job...)."""
    return sorted({entry.get("manager", "?") for entry in managed_fields or []
                   if entry.get("manager") != FIELD_MANAGER and entry.get("subresource", "") != "status"
                   and "f:spec" in (entry.get("fieldsV1") or {})})


def ignored_settings(spec: api.InferenceServiceSpec) -> list[EventSpec]:
    """Warnings for settings the spec holds that have no effect, each saying what to change. Accepted rather
    than refused (a service that has them kept working before, and turning autoscaling off must stay one
    edit), but never silently: an admin reading `kubectl describe` sees why nothing happens."""
    events = []
    if spec.autoscaling.standby and not spec.autoscaling.enabled:
        events.append(EventSpec("Warning", "StandbyIgnored", (
            f"autoscaling.standby {spec.autoscaling.standby} has no effect while autoscaling.enabled is false "
            "(the autoscaler wakes the standbys; no standby pod runs): set autoscaling.enabled true, or "
            "standby 0 to silence this")))
    return events


def newly_ignored(old: api.InferenceServiceSpec | None, new: api.InferenceServiceSpec) -> list[EventSpec]:
    """The warnings of `ignored_settings` that a spec change brought (each said once, not on every edit)."""
    before = ignored_settings(old) if old is not None else []
    return [e for e in ignored_settings(new) if e not in before]
