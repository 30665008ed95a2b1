"""kopf's indexes (in-memory watch caches, kept current in place by kopf), read by name.

The handlers, the status writer and the autoscale loop read the cluster from here, so a
status update costs one PATCH and no GETs.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kaon_operator.api import Key
from kaon_operator.status.summaries import DeploymentSummary, PodSummary, ServedName


def _one(index: Mapping[Any, Collection], key):
    return next(iter(index.get(key, ())), None)


@dataclass(frozen=True)
class Caches:
    """One field per kopf index; the names are the index handlers' (handlers.py)."""

    inference_services: Mapping[Key, Collection[Mapping]] = field(default_factory=dict)
    engine_pods: Mapping[Key, Collection[PodSummary]] = field(default_factory=dict)
    engine_deployments: Mapping[Key, Collection[DeploymentSummary]] = field(default_factory=dict)
    prefill_pods: Mapping[Key, Collection[PodSummary]] = field(default_factory=dict)
    prefill_deployments: Mapping[Key, Collection[DeploymentSummary]] = field(default_factory=dict)
    served_names: Mapping[str, Collection[ServedName]] = field(default_factory=dict)
    inference_routes: Mapping[Key, Collection[Mapping]] = field(default_factory=dict)

    @classmethod
    def from_kopf(cls, kwargs: Mapping[str, Any]) -> Caches:
        """From a handler's keyword arguments, where kopf passes each index under its name."""
        return cls(**{f.name: kwargs[f.name] for f in fields(cls)})

    def inference_service(self, key: Key) -> Mapping | None:
        return _one(self.inference_services, key)

    def all_inference_services(self) -> list[tuple[Key, Mapping]]:
        return [(key, body) for key, bodies in list(self.inference_services.items())
                if (body := next(iter(bodies), None)) is not None]

    def all_inference_routes(self) -> list[tuple[Key, Mapping]]:
        return [(key, body) for key, bodies in list(self.inference_routes.items())
                if (body := next(iter(bodies), None)) is not None]

    def pods(self, key: Key) -> list[PodSummary]:
        return list(self.engine_pods.get(key, ()))

    def adapter_pods(self, key: Key) -> list[PodSummary]:
        """The pods that serve spec.adapters: the engine pods and spec.prefill's (a LoRA prompt's K/V is computed
        there with its adapter, docs/disaggregation.md)."""
        return [*self.engine_pods.get(key, ()), *self.prefill_pods.get(key, ())]

    def pods_by_service(self) -> list[tuple[Key, list[PodSummary]]]:
        return [(key, list(pods)) for key, pods in list(self.engine_pods.items())]

    def deployment(self, key: Key) -> DeploymentSummary | None:
        return _one(self.engine_deployments, key)

    def prefill_deployment(self, key: Key) -> DeploymentSummary | None:
        """spec.prefill's Deployment (docs/disaggregation.md)."""
        return _one(self.prefill_deployments, key)

    def served_names_in(self, namespace: str) -> list[ServedName]:
        return sorted(self.served_names.get(namespace, ()))
