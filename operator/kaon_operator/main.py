"""`kaon-operator` (or `python -m kaon_operator`): run the InferenceService operator (kopf) against the
current cluster."""
from __future__ import annotations

import argparse
import json
import logging
import os
import secrets

import kopf
from prometheus_client import start_http_server

from kaon_operator.config import AutoscaleSettings, NetworkPolicyConfig, OperatorConfig, SpecPolicy


def priority(value: str) -> int:
    """An integer, or `random`. kopf pauses *every* replica when the highest priority is
    shared, and the replicas of one Deployment cannot be given distinct numbers, so the Helm
    chart passes `random`: each process draws its own (a clash is a 1 in 2**31 chance)."""
    if value == "random":
        return 1 + secrets.randbelow(2**31 - 1)
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer or 'random': {value!r}") from None


def network_peer(value: str) -> dict:
    """A NetworkPolicyPeer as JSON, e.g. {"namespaceSelector": {"matchLabels": {...}}}."""
    try:
        peer = json.loads(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not JSON: {value!r}") from None
    if not isinstance(peer, dict) or not peer or not set(peer) <= {"namespaceSelector", "podSelector", "ipBlock"}:
        raise argparse.ArgumentTypeError(
            f"not a NetworkPolicyPeer (namespaceSelector, podSelector and/or ipBlock): {value!r}")
    return peer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kaon-operator", description="run the kaon InferenceService operator")
    parser.add_argument("--namespace", action="append", default=[],
                        help="watch only this namespace (repeatable; default: all namespaces)")
    parser.add_argument("--peering", metavar="NAME",
                        help="coordinate with other replicas through this ClusterKopfPeering "
                             "(default: standalone, for a single replica)")
    parser.add_argument("--priority", type=priority, default=0,
                        help="peering priority: the highest one runs; `random` draws one per process")
    parser.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus /metrics here (0: off)")
    parser.add_argument("--liveness-port", type=int, default=0, help="serve kopf's /healthz here (0: off)")
    parser.add_argument("--autoscale-interval", type=float, default=5.0,
                        help="seconds between scrapes of the autoscaled InferenceServices' pods")
    parser.add_argument("--adapter-interval", type=float, default=10.0,
                        help="seconds between the adapter loop's rounds, which load and unload spec.adapters "
                             "on the running pods")
    parser.add_argument("--release-namespace", default=os.environ.get("POD_NAMESPACE") or "kaon-system",
                        help="the namespace of kaon's router pods (and of the autoscaler's Lease with "
                             "--peering); default: $POD_NAMESPACE, else kaon-system")
    parser.add_argument("--network-policy", action=argparse.BooleanOptionalAction, default=True,
                        help="give every InferenceService a NetworkPolicy that admits traffic to its engine pods "
                             "only from kaon's router and operator pods in --release-namespace (default: on; "
                             "--no-network-policy deletes the ones it made)")
    parser.add_argument("--network-policy-from", type=network_peer, action="append", default=[], metavar="JSON",
                        help="one more NetworkPolicyPeer the engine port admits (repeatable), e.g. the namespace "
                             "of the Prometheus that scrapes the engines")
    parser.add_argument("--allow-host-path", action="store_true",
                        help="let spec.engine.volumes use hostPath (off: configMap, secret, emptyDir, "
                        "persistentVolumeClaim and projected only)")
    parser.add_argument("--allow-secret-env", action="store_true",
                        help="let spec.engine.env/envFrom read Secrets of the namespace")
    parser.add_argument("--allow-secret-volumes", action="store_true",
                        help="let spec.engine.volumes mount Secrets of the namespace (secret, projected secret or "
                             "serviceAccountToken sources)")
    parser.add_argument("--allowed-image", action="append", default=[], metavar="IMAGE",
                        help="an engine image a spec may name (repeatable): a repository (any tag or digest), an "
                             "image, or a prefix ending in '/'; none given: any image")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)

    kopf.configure(verbose=args.verbose, log_prefix=True)
    if not args.verbose:  # a line per handled event and per health check drowns what matters
        for name in ("kopf.objects", "aiohttp.access", "kubernetes"):
            logging.getLogger(name).setLevel(logging.WARNING)
    from kaon_operator import handlers  # noqa: F401 - importing registers the handlers

    config = OperatorConfig(
        network_policy=NetworkPolicyConfig(args.release_namespace, tuple(args.network_policy_from))
        if args.network_policy else None,
        autoscale=AutoscaleSettings(interval=args.autoscale_interval, release_namespace=args.release_namespace,
                                    use_lease=args.peering is not None),
        spec_policy=SpecPolicy(allow_host_path=args.allow_host_path, allow_secret_env=args.allow_secret_env,
                               allow_secret_volumes=args.allow_secret_volumes,
                               allowed_images=tuple(args.allowed_image)),
        adapter_interval=args.adapter_interval)

    if args.metrics_port:
        start_http_server(args.metrics_port)
    kopf.run(clusterwide=not args.namespace, namespaces=args.namespace,
             standalone=args.peering is None, peering_name=args.peering, priority=args.priority,
             liveness_endpoint=f"http://0.0.0.0:{args.liveness_port}/healthz" if args.liveness_port else None,
             memo=kopf.Memo(config=config))
    return 0
