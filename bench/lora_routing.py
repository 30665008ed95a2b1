"""Adapter affinity in the router, simulated: the share of LoRA requests that land on a pod already
holding their adapter in a slot, with adapter affinity (kaon's router) and with least connections
alone (what a router without it does), in one run, and the ratio.

    .venv/bin/python bench/lora_routing.py [--pods 4] [--slots 4] [--requests 20000] [--in-flight 12]

The router's real strategy objects pick every request (router/strategies); the engines are modelled
by their slot pools (LRU of --slots adapters per pod, as the engine's pool evicts). Requests arrive
one at a time with an adapter drawn with popularity 1/rank; each request in flight finishes with
probability 1/--in-flight per arrival. Also counted: picks that broke prefix affinity's load bound.
"""
from __future__ import annotations

import argparse
import random
from collections import OrderedDict

from kaon_operator.router.endpoints import Endpoint, service
from kaon_operator.router.strategies import Attempt, Strategies
from kaon_operator.router.strategies.prefix_affinity import BOUND_SLACK, capacity


def run(affinity: bool, pods: int, slots: int, adapters: int, requests: int, in_flight: float,
        seed: int) -> tuple[float, int]:
    rng = random.Random(seed)
    names = [f"a{i}" for i in range(adapters)]
    svc = service({"metadata": {"name": "base", "namespace": "bench"},
                   "spec": {"model": {"uri": "hf://org/base"}, "engine": {"maxLoras": slots},
                            "adapters": [{"name": n, "uri": f"hf://org/{n}"} for n in names]}})
    fleet = tuple(Endpoint("bench", f"pod-{i}", "base", f"http://10.0.0.{i}:8000") for i in range(pods))
    held = {e: OrderedDict[str, None]() for e in fleet}
    strategy = Strategies().get(svc.strategy)
    inflight = dict.fromkeys(fleet, 0)
    running: list[Endpoint] = []
    weights = [1 / (rank + 1) for rank in range(adapters)]
    hits = over = 0
    for _ in range(requests):
        for e in list(running):
            if rng.random() < 1 / in_flight:
                running.remove(e)
                inflight[e] -= 1
        adapter = rng.choices(names, weights)[0]
        payload = {"model": adapter if affinity else "base"}
        target = strategy.pick(Attempt(svc, fleet, fleet, inflight, "/v1/completions", payload, 0.0, rng)).target
        over += inflight[target] >= max(capacity(inflight, fleet, svc.load_bound),
                                        min(inflight.values()) + BOUND_SLACK + 1)
        slots_of = held[target]
        hits += adapter in slots_of
        slots_of.pop(adapter, None)
        slots_of[adapter] = None
        while len(slots_of) > slots:
            slots_of.popitem(last=False)
        inflight[target] += 1
        running.append(target)
    return hits / requests, over


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=4)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--in-flight", type=float, default=12.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"{args.pods} pods x {args.slots} slots, {args.requests} requests, ~{args.in_flight:g} in flight")
    print("adapters  affinity  over-bound  least-connections  ratio")
    for adapters in (1, 8, 12, 16, 32):
        kaon, over = run(True, args.pods, args.slots, adapters, args.requests, args.in_flight, args.seed)
        peer, _ = run(False, args.pods, args.slots, adapters, args.requests, args.in_flight, args.seed)
        print(f"{adapters:8d}  {kaon:8.1%}  {over:10d}  {peer:17.1%}  {kaon / peer:5.2f}x")


if __name__ == "__main__":
    main()
