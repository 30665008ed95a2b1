"""The operator's configuration, from its command line (main.py) to the handlers through
kopf's memo (`kopf.run(memo=...)`): no module-level settings to set before kopf starts.
Plain values at the bottom of the operator's layers: the code they configure imports them,
never the other way round."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class NetworkPolicyConfig:
    """Who may reach the engine port when the operator renders a NetworkPolicy per InferenceService:
    kaon's router pods (the requests) and operator pods (the autoscaler's scrapes) in the release
    namespace, and `extra_from` (NetworkPolicyPeer objects, e.g. the Prometheus that scrapes /metrics)."""

    release_namespace: str
    extra_from: tuple[dict, ...] = field(default_factory=tuple)


@dataclass(frozen=True, slots=True)
class SpecPolicy:
    """The admin's opt-ins for the spec's pass-through fields (spec_policy.py checks them)."""

    allow_host_path: bool = False
    allow_secret_env: bool = False
    allow_secret_volumes: bool = False
    """Let engine.volumes mount Secrets (`secret`, `projected` secret or token sources)."""
    allowed_images: tuple[str, ...] = ()
    """The engine images a spec may name (spec_policy.image_allowed); empty: any image."""


@dataclass(frozen=True)
class AutoscaleSettings:
    interval: float = 5.0
    """Seconds between scrapes of the autoscaled InferenceServices' pods."""
    release_namespace: str = "kaon-system"
    """Where the routers run (their /metrics say which services hold requests) and the Lease lives."""
    use_lease: bool = False
    """Several operator replicas (peering): only the Lease holder autoscales."""


@dataclass(frozen=True)
class OperatorConfig:
    network_policy: NetworkPolicyConfig | None = None
    """Render a NetworkPolicy per InferenceService with these peers; None: none (and delete the ones made)."""
    autoscale: AutoscaleSettings = field(default_factory=AutoscaleSettings)
    spec_policy: SpecPolicy = field(default_factory=SpecPolicy)
    """What the spec's pass-through fields may ask for (spec_policy.py): the admin's opt-ins."""
    adapter_interval: float = 10.0
    """Seconds between the adapter loop's rounds (lora/adapter_sync.py): how soon an adapter added to
    or removed from spec.adapters is loaded or unloaded on the running pods."""
