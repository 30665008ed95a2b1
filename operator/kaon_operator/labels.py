"""Label and annotation names shared by the operator, the router and the local cluster.

One place for each name: the operator stamps them on what it renders, the router and the
autoscaler select pods by them, and e2e/ finds them with the same constants.
"""
from __future__ import annotations

PART_OF = "app.kubernetes.io/name"
INSTANCE = "app.kubernetes.io/instance"
COMPONENT = "app.kubernetes.io/component"
# The InferenceService a pod or child object belongs to: the selector the router and the
# autoscaler use, immutable in a Deployment's selector.
SERVICE = "kaon.dev/inferenceservice"
APP = "kaon"

ENGINE = "engine"
# The non-leader pods of a multi-node replica (a LeaderWorkerSet group): no HTTP server, so neither
# the router, the autoscaler nor the Service select them (they select ENGINE, the group's leaders).
ENGINE_WORKER = "engine-worker"
# The prefill pods of a disaggregated InferenceService (spec.prefill): neither the router, the autoscaler nor
# the engine Service select them; the decode pods (ENGINE) reach them through their own Service.
PREFILL = "prefill"
ROUTER = "router"
OPERATOR = "operator"


def component_labels(component: str) -> dict[str, str]:
    """kaon's own pods (router, operator), which belong to no InferenceService."""
    return {PART_OF: APP, COMPONENT: component}


def service_labels(name: str, component: str = ENGINE) -> dict[str, str]:
    """Every object rendered for the InferenceService `name`."""
    return {PART_OF: APP, INSTANCE: name, COMPONENT: component, SERVICE: name}


def engine_selector(name: str) -> dict[str, str]:
    """Engine pods of one InferenceService (a Deployment's selector is immutable: keep it small)."""
    return {SERVICE: name, COMPONENT: ENGINE}
