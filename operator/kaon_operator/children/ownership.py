"""Whose an object is: the operator applies a child only where nothing stands, or where the
InferenceService it renders it for already controls it. An object of the same name that
someone else made (a Service of another app, a Deployment by hand) is never taken over: a
server-side apply with force would rewrite it and hang it under the InferenceService, whose
deletion would then delete it. Pure functions of the objects as dicts."""
from __future__ import annotations

from collections.abc import Mapping

FIELD_MANAGER = "kaon-operator"
"""The operator's name as the field manager of what it applies (and its Events' source): an edit
by any other manager is someone else's (changes.py)."""


def controller(obj: Mapping) -> Mapping | None:
    """The ownerReference with controller: true, if any."""
    refs = (obj.get("metadata") or {}).get("ownerReferences") or ()
    return next((ref for ref in refs if ref.get("controller")), None)


def foreign_holder(existing: Mapping | None, manifest: Mapping) -> str | None:
    """None when `manifest` may be applied: nothing stands under its name, or what stands is
    controlled by the manifest's own controller (same uid). Otherwise who holds it, in words."""
    if existing is None:
        return None
    ours, theirs = controller(manifest), controller(existing)
    if ours is not None and theirs is not None and theirs.get("uid") == ours.get("uid"):
        return None
    if theirs is None:
        return "no controller (made by someone else)"
    return f"{theirs.get('kind')} {theirs.get('name')} (uid {theirs.get('uid')})"
