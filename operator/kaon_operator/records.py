"""What the operator remembers of each InferenceService between events: one record per
service, forgotten at once when the service goes."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from kaon_operator.status.summaries import DeploymentSummary, PdbSummary

Key = tuple[str, str]  # (namespace, InferenceService name)


@dataclass(slots=True)
class ServiceRecord:
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Serialises the status writes of this service (handlers run in a thread pool)."""
    written: dict | None = None
    """The status last written."""
    apply_failure: str | None = None
    """Why applying the children failed, until an apply succeeds again."""
    conflict: str | None = None
    """A child's name taken by an object this service does not control (kube.NotOwned), until an apply succeeds."""
    applied: tuple[str, int] | None = None
    """(uid, generation) whose children are applied."""
    metrics_condition: dict | None = None
    """MetricsAvailable, kept by the autoscale loop."""
    adapters_condition: dict | None = None
    profile_condition: dict | None = None
    """Profiled, kept by the autoscale loop (spec.autoscaling.profile: profile_sync.py)."""
    """AdaptersReady, kept by the adapter loop (adapter_sync.py)."""
    pdb: PdbSummary | None = None
    """The PodDisruptionBudget's status (DisruptionAllowed)."""
    missing_api: str | None = None
    """A multi-node spec in a cluster without the LeaderWorkerSet API: what to install, until it is there."""
    groups: DeploymentSummary | None = None
    """The LeaderWorkerSet's status, in groups (multi-node replicas: leaderworkerset.py)."""


class Records:
    def __init__(self) -> None:
        self._records: dict[Key, ServiceRecord] = {}

    def get(self, key: Key) -> ServiceRecord:
        """The service's record, made on first use."""
        record = self._records.get(key)
        return record if record is not None else self._records.setdefault(key, ServiceRecord())

    def find(self, key: Key) -> ServiceRecord | None:
        """The record if there is one (for events that must not bring a forgotten service back)."""
        return self._records.get(key)

    def forget(self, key: Key) -> None:
        self._records.pop(key, None)
