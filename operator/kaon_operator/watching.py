"""What the operator watches and how kopf is set up to watch it.

Pods and the children are listed and watched with a label selector (server-side), so the
apiserver sends kaon's engine objects only, never the cluster's other pods.
"""
from __future__ import annotations

import os
import socket
from typing import Any

import kopf

from kaon_operator import api, labels
from kaon_operator.children import leaderworkerset

ISVC = (api.GROUP, api.VERSION, api.PLURAL)
ROUTES = (api.GROUP, api.VERSION, "inferenceroutes")  # InferenceRoute: the operator publishes its keys' digests
PODS = ("", "v1", "pods")
DEPLOYMENTS = ("apps", "v1", "deployments")
PDBS = ("policy", "v1", "poddisruptionbudgets")
NETWORK_POLICIES = ("networking.k8s.io", "v1", "networkpolicies")
# Multi-node replicas. Without the LeaderWorkerSet CRD kopf serves its handlers once the CRD appears
# (it watches CustomResourceDefinitions for that: the RBAC grants it).
LEADER_WORKER_SETS = (leaderworkerset.GROUP, leaderworkerset.VERSION, leaderworkerset.PLURAL)
CHILD_KINDS = (DEPLOYMENTS, ("", "v1", "services"), PDBS, NETWORK_POLICIES, LEADER_WORKER_SETS)
# kopf's labels= filter of the handlers (applied by kopf after receiving), and the same filter
# as the server-side labelSelector of the watches.
ENGINE_CHILD: dict[str, Any] = {labels.SERVICE: kopf.PRESENT, labels.COMPONENT: labels.ENGINE}
# The server-side selector takes the prefill pool's children too (spec.prefill); the handlers tell them apart.
ENGINE_CHILD_SELECTOR = f"{labels.SERVICE},{labels.COMPONENT} in ({labels.ENGINE},{labels.PREFILL})"
PREFILL_CHILD: dict[str, Any] = {labels.SERVICE: kopf.PRESENT, labels.COMPONENT: labels.PREFILL}
WATCHED_BY_LABEL = (PODS, *CHILD_KINDS)
# How long kopf waits to see its own annotation patch come back on the watch before it handles the
# InferenceService's next event anyway. kopf's default (5 s) is too short on a busy control plane: the
# event of the operator's own status patch, which carries no last-handled-configuration yet, would be
# taken for a new object and reconciled a second time.
CONSISTENCY_SECONDS = 60
HANDLER_THREADS = 16


def reporting_instance() -> str:
    """Which operator replica posted an Event: the pod name (hostname) and the process."""
    return f"{socket.gethostname()}-{os.getpid()}"


def configure(settings: kopf.OperatorSettings) -> None:
    # Progress lives in annotations: the CRD's status schema has no room for kopf's own fields.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=api.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=api.GROUP, key="last-handled-configuration")
    settings.persistence.consistency_timeout = CONSISTENCY_SECONDS
    for kind in WATCHED_BY_LABEL:
        settings.watching.label_selectors[kind] = ENGINE_CHILD_SELECTOR
    settings.posting.reporting_component = "kaon-operator"
    settings.posting.reporting_instance = reporting_instance()
    settings.execution.max_workers = HANDLER_THREADS
