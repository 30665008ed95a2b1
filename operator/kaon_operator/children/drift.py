"""Drift of the children: one deleted, or edited by someone other than the operator, is applied
again (with a Warning Event saying so). With NetworkPolicies switched off, the ones made while
they were on are deleted."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kaon_operator import api
from kaon_operator.children import changes
from kaon_operator.context import Context
from kaon_operator.kube import NamespaceTerminating, NotOwned
from kaon_operator.reconciler import apply_children
from kaon_operator.status import conditions


def _repair(ctx: Context, namespace: str, owner_name: str, child, why: str) -> None:
    body = ctx.kube.get_inference_service(namespace, owner_name)  # authoritative: is the owner going away?
    if body is None or body["metadata"].get("deletionTimestamp"):
        return
    if not any(ref.get("uid") == body["metadata"]["uid"] for ref in child["metadata"].get("ownerReferences", [])):
        return  # labelled like ours but not owned by this InferenceService: not ours to touch
    spec = api.parse_spec(body["spec"])
    if isinstance(spec, str):
        return
    before = child["metadata"].get("resourceVersion")
    try:
        applied = apply_children(ctx, body, spec)
    except (NamespaceTerminating, NotOwned):
        return  # a name taken by an object not ours is reconcile's to report (ResourceConflict)
    after = next((c["metadata"]["resourceVersion"] for c in applied
                  if c["kind"] == child["kind"] and c["metadata"]["name"] == child["metadata"]["name"]), before)
    if after != before:
        what = f"{child['kind']} {child['metadata']['name']} {why}"
        ctx.post(body, [conditions.EventSpec("Warning", "Repaired", what)])


def _owned_by_an_inference_service(child) -> bool:
    return any(ref.get("apiVersion", "").startswith(f"{api.GROUP}/") and ref.get("kind") == api.KIND
               and ref.get("controller") for ref in child["metadata"].get("ownerReferences", []))


def child_changed(ctx: Context, event: Mapping[str, Any], child, namespace: str, owner_name: str) -> None:
    if child.get("kind") == "NetworkPolicy" and ctx.config.network_policy is None:
        # Switched off (--no-network-policy): the policies made while it was on go, so that the switch
        # means what it says; kopf lists them all at start-up, so this runs once for each.
        if event.get("type") != "DELETED" and _owned_by_an_inference_service(child):
            ctx.kube.delete({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                             "metadata": {"name": child["metadata"]["name"], "namespace": namespace,
                                          "uid": child["metadata"].get("uid")}})
        return
    if event.get("type") == "DELETED":
        _repair(ctx, namespace, owner_name, child, "was deleted; recreated it")
        return
    editors = changes.foreign_spec_managers(child["metadata"].get("managedFields"))
    if editors and not child["metadata"].get("deletionTimestamp"):
        _repair(ctx, namespace, owner_name, child, f"was edited by {', '.join(editors)}; put it back")
