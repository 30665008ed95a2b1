"""What the operator remembers of each InferenceService between events and ticks: one record per
service, whoever keeps it (the reconciler, the status writer, the autoscale loop, the adapter loop,
the key digests' publisher), forgotten at once when the service goes."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from kaon_operator.api import Key
from kaon_operator.autoscaling.autoscaler import Sample
from kaon_operator.autoscaling.histogram import Buckets
from kaon_operator.autoscaling.perf_model import PerfModel
from kaon_operator.status.summaries import DeploymentSummary, PdbSummary


@dataclass(frozen=True, slots=True)
class Baseline:
    """One engine pod's cumulative counts at its last answered scrape."""

    finished: float
    latency: Buckets = ()
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    finished_output_tokens: float | None = None


@dataclass(slots=True)
class ProfileMemory:
    """Where the predictive policy's performance model comes from (profile_sync.py)."""

    name: str | None = None
    """The ConfigMap the model was (or is to be) read from."""
    model: PerfModel | None = None
    warned: str | None = None
    """The uid of the failed Job already reported."""
    strangers: frozenset[str] = frozenset()
    """The objects posing as this service's profile (profiling.strangers) already reported."""
    cleaned: str | None = None
    """The setting whose stale profiling objects were looked for (profile_sync._clean)."""


@dataclass(slots=True)
class AutoscaleMemory:
    """The autoscale loop's, between ticks, while the service is autoscaled."""

    uid: str | None = None
    """The InferenceService's: one deleted and made again under its name starts afresh."""
    history: list[Sample] = field(default_factory=list)
    baselines: dict[str, Baseline] = field(default_factory=dict)
    capped: bool = False
    """A ScaleCapped Event was posted and the cap still holds."""
    profile: ProfileMemory = field(default_factory=ProfileMemory)
    model: PerfModel | None = None
    """The performance model the decode pool's predictive policy last resolved: it sizes the prefill pool too."""
    prefill_baselines: dict[str, Baseline] = field(default_factory=dict)
    """The prefill pods' counters at the last scrape (spec.prefill.autoscaling)."""
    ttft_baselines: dict[str, Baseline] = field(default_factory=dict)
    """The decode pods' TTFT histograms at the last scrape: the prefill pool's latency signal."""
    prefill_scraped_at: float | None = None
    prefill_last_change: float | None = None
    """When this operator last changed spec.prefill.replicas (None after a restart: no stabilization wait)."""


@dataclass(slots=True)
class AdapterMemory:
    """The adapter loop's, between rounds, while the service has (or just had) adapters."""

    failures: dict[str, str] = field(default_factory=dict)
    """adapter -> why its last load failed."""
    failed_at: dict[tuple[str, str], float] = field(default_factory=dict)
    """(pod, adapter) -> when its load last failed (retried after adapter_sync.RETRY_SECONDS)."""
    reported: set[tuple[str, str]] = field(default_factory=set)
    """(adapter, reason) pairs already posted as an Event."""
    written: list | None = None
    """status.adapters as last written."""


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
    conditions: dict[str, dict] = field(default_factory=dict)
    """The loops' conditions by type, written with the others: MetricsAvailable and Profiled (the
    autoscale loop), AdaptersReady (the adapter loop). Each is built in status/conditions.py."""
    pdb: PdbSummary | None = None
    """The PodDisruptionBudget's status (DisruptionAllowed)."""
    missing_api: str | None = None
    """A multi-node spec in a cluster without the LeaderWorkerSet API: what to install, until it is there."""
    groups: DeploymentSummary | None = None
    """The LeaderWorkerSet's status, in groups (multi-node replicas: leaderworkerset.py)."""
    scaled_to: int | None = None
    """The spec.replicas the autoscaler is writing, until the update it makes is reconciled: that
    change is the autoscaler's, which posts its own Event."""
    autoscale: AutoscaleMemory | None = None
    adapters: AdapterMemory | None = None
    auth: dict | None = None
    """status.auth (the API keys' digests) as last published (key_digests.py), once `auth_known`."""
    auth_known: bool = False


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

    def items(self) -> list[tuple[Key, ServiceRecord]]:
        """Every record, as a list (the loops walk it while handlers add and forget)."""
        return list(self._records.items())

    def forget(self, key: Key) -> None:
        self._records.pop(key, None)
