"""The routers' fast signal (issue 53): the pure decision (router_pressure.py), the router's report
(router/pressure.py), and the operator's pressure loop acting on a real router that holds a request."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import aiohttp

from kaon_operator.api import AutoscalingSpec, Key
from kaon_operator.autoscaling import router_pressure
from kaon_operator.autoscaling.pressure_sync import PressureLoop, merge
from kaon_operator.caches import Caches
from kaon_operator.config import OperatorConfig
from kaon_operator.context import Context
from kaon_operator.router import edge
from kaon_operator.router.endpoints import Endpoint, ServiceKey
from kaon_operator.router.pressure import report
from support.router import NS, FakeEngine, routed, run, serving, until

Pressure = router_pressure.Pressure
SPEC = AutoscalingSpec(enabled=True, min_replicas=0, max_replicas=8, scale_to_zero_idle_seconds=120, standby=3,
                       target_concurrency_per_replica=8, max_step=4)


def decide(pressure: Pressure, current: int, asleep: int = 3, spec: AutoscalingSpec = SPEC):
    return router_pressure.decide(pressure, spec, current, asleep, max_num_seqs=64)


def test_held_requests_at_zero_wake_every_loaded_standby_at_once():
    decision = decide(Pressure(held=2, in_flight=0, ready=0), current=0)
    assert decision is not None and decision.replicas == 3
    assert "holds 2 requests with no ready replica" in decision.reason
    assert decide(Pressure(held=2, in_flight=0, ready=0), current=0, asleep=1).replicas == 1  # one loaded so far
    # Replicas already wanted (starting or waking): the held requests wait for them, nothing more is woken.
    assert decide(Pressure(held=2, in_flight=0, ready=0), current=1) is None


def test_a_queue_past_the_bound_wakes_the_standbys_and_one_under_it_does_nothing():
    bound = router_pressure.SHORT_FACTOR * 8 * 2  # two ready replicas at a target of 8
    assert decide(Pressure(held=0, in_flight=bound - 1, ready=2), current=2) is None
    decision = decide(Pressure(held=0, in_flight=bound, ready=2), current=2)
    assert decision is not None and decision.replicas == 5 and "3 standby(s) woken" in decision.reason
    assert decide(Pressure(held=0, in_flight=bound, ready=2), current=2, asleep=1).replicas == 3
    capped = SPEC.model_copy(update={"max_step": 2, "max_replicas": 3})
    assert decide(Pressure(held=0, in_flight=bound, ready=2), current=2, spec=capped).replicas == 3


def test_no_standby_loaded_or_none_configured_leaves_it_to_the_regular_policy():
    short = Pressure(held=0, in_flight=100, ready=2)
    assert decide(short, current=2, asleep=0) is None  # a cold start stays the regular policy's to prove
    assert decide(short, current=2, spec=SPEC.model_copy(update={"standby": 0})) is None
    assert decide(Pressure(held=0, in_flight=0, ready=0), current=0) is None  # idle at zero: nothing held


def test_the_routers_reports_add_up_and_a_malformed_entry_is_skipped():
    a = {"services": [{"namespace": "ns", "name": "s", "held": 1, "inFlight": 10, "ready": 2},
                      {"namespace": "ns", "name": "bad", "held": "x", "inFlight": 0, "ready": 0}]}
    b = {"services": [{"namespace": "ns", "name": "s", "held": 0, "inFlight": 7, "ready": 3}, {"name": "s"}]}
    assert merge([a, b, {"services": None}, []]) == {Key("ns", "s"): Pressure(held=1, in_flight=17, ready=3)}


def test_the_router_reports_only_services_with_requests_held_or_in_flight():
    router = routed()
    e = Endpoint(NS, "p0", "svc", "http://127.0.0.1:1")
    assert report(router.table, {}, {}) == {"services": []}
    assert report(router.table, {e: 0}, {}) == {"services": []}
    assert report(router.table, {e: 4}, {ServiceKey(NS, "other"): 2}) == {"services": [
        {"namespace": NS, "name": "other", "held": 2, "inFlight": 0, "ready": 0},
        {"namespace": NS, "name": "svc", "held": 0, "inFlight": 4, "ready": 0}]}


class Kube:
    """The apiserver calls the pressure loop makes: the router pods listed, the status and spec.replicas written."""

    def __init__(self, admin_port: int):
        self.admin_port, self.replicas, self.status = admin_port, None, None

    def list_pods(self, namespace, selector):
        return [{"metadata": {"name": "router-0", "namespace": namespace},
                 "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 1},
                                                    {"name": "admin", "containerPort": self.admin_port}]}]},
                 "status": {"phase": "Running", "podIP": "127.0.0.1",
                            "conditions": [{"type": "Ready", "status": "True"}]}}]

    def patch_status(self, namespace, name, patch, resource_version=None):
        self.status = patch
        return {"metadata": {"resourceVersion": "2"}}

    def patch_replicas(self, namespace, name, replicas, resource_version=None):
        self.replicas = replicas


class Standbys:
    """The standby loop's round, as the pressure loop calls it to wake at once."""

    def __init__(self):
        self.rounds: list[int] = []

    async def tick(self, session, key, body, spec):
        self.rounds.append(spec.replicas)


def test_the_operator_wakes_the_standbys_when_a_real_router_holds_a_request_at_zero():
    body = {"apiVersion": "kaon.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "svc", "namespace": NS, "uid": "u", "resourceVersion": "1", "generation": 1},
            "spec": {"model": {"uri": "builtin://smollm2-135m-instruct"}, "replicas": 0,
                     "autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 4,
                                     "scaleToZeroIdleSeconds": 120, "standby": 2}}}
    asleep = [SimpleNamespace(name=f"s{i}", asleep=True, terminating=False) for i in range(2)]

    async def scenario():
        engine = await FakeEngine("e0").start()
        router = routed(queue_timeout=10)  # the service exists with no ready pod
        async with edge.serving(router.admin_app(), "127.0.0.1", 0, max_connections=8, header_timeout=5) as admin:
            kube, standbys, events = Kube(admin), Standbys(), []
            ctx = Context(OperatorConfig(), kube, Caches())
            ctx.caches = SimpleNamespace(all_inference_services=lambda: [(Key(NS, "svc"), body)],
                                         pods=lambda key: asleep)
            ctx.post = lambda _, posted: events.extend(posted)
            loop = PressureLoop(ctx, standbys)
            async with aiohttp.ClientSession() as session, serving(router) as client:
                await loop.round(session)  # nothing held: nothing done
                assert (await client.get("/pressure")).status == 404  # the admin port's only, as its /metrics
                assert (kube.replicas, events, standbys.rounds) == (None, [], [])
                request = asyncio.create_task(client.post("/v1/completions", json={"model": "m", "prompt": "x"}))
                await until("the request to be held", lambda: router.held() == {ServiceKey(NS, "svc"): 1})
                await loop.round(session)
                router.table.apply_pod("ADDED", _ready_pod(engine.port))  # as the woken standby turns Ready
                async with await request as response:
                    assert response.status == 200
        await engine.stop()
        return kube, events, standbys

    kube, events, standbys = run(scenario())
    assert kube.replicas == 2 and kube.status["lastScaleDecision"]["to"] == 2
    assert [(e.type, e.reason) for e in events] == [("Normal", "RouterPressure")]
    assert events[0].message.startswith("Scaled up 0 → 2: the router holds 1 requests with no ready replica")
    assert standbys.rounds == [2]  # the wake itself at once, not at the standby loop's next round


def _ready_pod(port: int) -> dict:
    from support.router import pod
    return pod("e0", port=port)
