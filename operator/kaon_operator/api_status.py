"""The InferenceService's status (kaon.dev/v1alpha1): pydantic models of what the operator writes.

The CRD's status schema is generated from these (crd.py); status/conditions.py builds the conditions.
"""
from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import Field

from kaon_operator.api import _Model


class Condition(_Model):
    """One of Ready, Progressing, Degraded (and MetricsAvailable when autoscaling, NameConflict while an older InferenceService of the namespace answers this one's served name, ResourceConflict while a child's name is taken by an object it does not control, DisruptionAllowed once its PodDisruptionBudget has a status: whether node drains may evict its pods, AdaptersReady with spec.adapters: whether every adapter is loaded on every ready pod, Profiled with spec.autoscaling.profile: whether the engine's performance model is there to read, PrefillReady with spec.prefill: whether the prefill pool's replicas are ready); `reason` is a CamelCase word such as Unschedulable."""  # noqa: E501 - one line: the CRD's description

    type: Literal["Ready", "Progressing", "Degraded", "MetricsAvailable", "NameConflict", "DisruptionAllowed",
                  "ResourceConflict", "AdaptersReady", "Profiled", "PrefillReady"]
    """Which condition."""
    status: Literal["True", "False", "Unknown"]
    """Whether it holds."""
    reason: str = ""
    """Why, in one CamelCase word (docs/operator.md lists them)."""
    message: str = ""
    """Why, for people."""
    last_transition_time: datetime | None = None
    """When `status` last changed."""
    observed_generation: int | None = None
    """The metadata.generation this condition was computed for."""


class ScaleDecision(_Model):
    """The autoscaler's latest change of spec.replicas."""

    time: datetime
    """When the autoscaler decided."""
    from_: int = Field(alias="from")
    """Replicas before."""
    to: int
    """Replicas after."""
    reason: str
    """The metric and target that decided, e.g. `concurrency 90 > target 44.8 x 1`."""


class ObservedMetrics(_Model):
    """What the autoscaler last read from the engine pods' /metrics."""

    queue_depth: float | None = None
    """Waiting requests, summed over replicas."""
    running_requests: float | None = None
    """Requests being prefilled or decoded, summed over replicas."""
    concurrency_per_replica: float | None = None
    """Running + waiting requests (+ held at the router) per ready replica: the main autoscaling signal."""
    target_concurrency_per_replica: float | None = None
    """The concurrency target in force (from the spec, or targetUtilization x maxNumSeqs)."""
    p99_latency_seconds: float | None = None
    """P99 of `autoscaling.latencyMetric` over the scale-up window (unset with too few requests)."""
    kv_cache_usage_ratio: float | None = None
    """Share of KV cache blocks in use on the fullest replica (0..1)."""
    time: datetime | None = None
    """When these were read."""


class AuthStatus(_Model):
    """The API keys the router accepts, as digests: the operator reads spec.auth's Secret so the router reads no Secret."""  # noqa: E501 - one line: the CRD's description

    api_key_secret: str
    """The Secret these digests were computed from (the router uses them only while it is still spec.auth.apiKeySecret)."""  # noqa: E501 - one line: the CRD's description
    key_digests: list[str] = Field(default_factory=list)
    """SHA-256 (hex) of each key in it, never a key; empty while the Secret is missing or holds none (every request refused)."""  # noqa: E501 - one line: the CRD's description


class AdapterStatus(_Model):
    """One of spec.adapters, and the ready engine pods that have it loaded."""

    name: str
    """The adapter's name."""
    pods: list[str] = Field(default_factory=list)
    """The ready engine pods that have it loaded (the router prefers them for its requests)."""
    failure: str | None = None
    """Why its last load failed (a download, or an adapter that does not fit the model), if it did."""


class InferenceServiceStatus(_Model):
    """Written by the operator only (status subresource)."""

    conditions: list[Condition] = Field(default_factory=list, json_schema_extra={
        "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]})
    """Ready, Progressing and Degraded, one each; MetricsAvailable too when autoscaling is enabled."""
    replicas: int = 0
    """Engine pods that are not terminating (the scale subresource's status replicas)."""
    ready_replicas: int = 0
    """Of those, the ready ones."""
    standby_replicas: int | None = None
    """Replicas loaded and asleep (spec.autoscaling.standby), which a scale-up wakes."""
    prefill_replicas: int | None = None
    """With spec.prefill: prefill pods of any template (docs/disaggregation.md)."""
    prefill_ready_replicas: int | None = None
    """Of those, the ready ones."""
    selector: str | None = None
    """Label selector of the engine pods (for the scale subresource and HPA)."""
    last_scale_decision: ScaleDecision | None = None
    observed_metrics: ObservedMetrics | None = None
    observed_generation: int | None = None
    """The metadata.generation the operator last acted on."""
    url: str | None = None
    """In-cluster URL of the engine Service."""
    auth: AuthStatus | None = None
    """With spec.auth: the digests of the accepted API keys (published by the operator for the router)."""
    adapters: list[AdapterStatus] | None = None
    """With spec.adapters: which ready pods hold each adapter (kept by the operator's adapter loop)."""
