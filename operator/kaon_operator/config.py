"""The operator's configuration, from its command line (main.py) to the handlers through
kopf's memo (`kopf.run(memo=...)`): no module-level settings to set before kopf starts."""
from __future__ import annotations

from dataclasses import dataclass, field

from kaon_operator.children.resources import NetworkPolicyConfig
from kaon_operator.spec_policy import SpecPolicy


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
