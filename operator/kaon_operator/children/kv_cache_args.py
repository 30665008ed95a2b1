"""What the KV tiers and the kv-aware strategy add to an engine pod (pure): the `kaon serve` flags
of spec.engine.kvOffload, the disk tier's volume, and, with spec.routing.strategy kv-aware, the KV
events publisher (vLLM's --kv-events-config) with its ports, which the NetworkPolicy opens to the
router (docs/kv_cache.md)."""
from __future__ import annotations

import json

from kaon_operator import api

KV_EVENTS_PORT = 5557  # the router's kv_feed.EVENTS_PORT
KV_REPLAY_PORT = 5558  # and REPLAY_PORT
KV_EVENTS_TOPIC = "kv-events"
DISK_VOLUME = "kv-offload"


def publishes_events(spec: api.InferenceServiceSpec) -> bool:
    return spec.routing.strategy == "kv-aware"


def engine_args(spec: api.InferenceServiceSpec) -> list[str]:
    args: list[str] = []
    tiers = spec.engine.kv_offload
    if tiers is not None and tiers.host_bytes:
        args += ["--kv-offload-bytes", str(tiers.host_bytes)]
    if tiers is not None and tiers.disk_bytes:
        args += ["--kv-offload-dir", tiers.disk_path, "--kv-offload-dir-bytes", str(tiers.disk_bytes)]
    if publishes_events(spec):
        args += ["--kv-events-config", json.dumps({
            "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{KV_EVENTS_PORT}",
            "replay_endpoint": f"tcp://*:{KV_REPLAY_PORT}", "topic": KV_EVENTS_TOPIC}, separators=(",", ":"))]
    return args


def container_ports(spec: api.InferenceServiceSpec) -> list[dict]:
    if not publishes_events(spec):
        return []
    return [{"name": "kv-events", "containerPort": KV_EVENTS_PORT, "protocol": "TCP"},
            {"name": "kv-replay", "containerPort": KV_REPLAY_PORT, "protocol": "TCP"}]


def policy_ports(spec: api.InferenceServiceSpec | None) -> list[dict]:
    """The NetworkPolicy's extra ports: the events' to the router (and the operator: the same peers)."""
    if spec is None or not publishes_events(spec):
        return []
    return [{"protocol": "TCP", "port": KV_EVENTS_PORT}, {"protocol": "TCP", "port": KV_REPLAY_PORT}]


def volumes(spec: api.InferenceServiceSpec) -> tuple[list[dict], list[dict]]:
    """The disk tier's emptyDir (sized to it, plus its manifest), unless the user mounts a volume at its path."""
    tiers = spec.engine.kv_offload
    if tiers is None or not tiers.disk_bytes:
        return [], []
    if any(m.mount_path == tiers.disk_path for m in spec.engine.volume_mounts or []):
        return [], []
    size = tiers.disk_bytes + (64 << 20)
    return ([{"name": DISK_VOLUME, "emptyDir": {"sizeLimit": str(size)}}],
            [{"name": DISK_VOLUME, "mountPath": tiers.disk_path}])
