"""Issue 53: standby replicas (spec.autoscaling.standby): what the Deployment and the pods get, which
pods the loop wakes or puts to sleep, and how a sleeping pod reads in the status."""
from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from pydantic import ValidationError

from kaon_operator import api
from kaon_operator.autoscaling import standby
from kaon_operator.autoscaling.autoscaler import Decision
from kaon_operator.autoscaling.standby import Loaded, Plan, plan
from kaon_operator.children import resources as r
from kaon_operator.status import conditions, summaries

OWNER = r.Owner(name="llama", namespace="serving", uid="0b7c5b4e-1111-4a2b-9c3d-000000000001")


def spec(replicas: int = 2, standby_replicas: int = 1, enabled: bool = True) -> api.InferenceServiceSpec:
    return api.InferenceServiceSpec.model_validate({
        "model": {"uri": "builtin://smollm2-135m-instruct"}, "replicas": replicas,
        "autoscaling": {"enabled": enabled, "standby": standby_replicas}})


def test_the_deployment_runs_the_standbys_beside_the_replicas_with_sleep_mode_and_the_admin_key():
    deployment = r.deployment(OWNER, spec(replicas=2, standby_replicas=1))
    assert deployment["spec"]["replicas"] == 3
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert "--enable-sleep-mode" in container["args"]
    assert any(e["name"] == "KAON_ADMIN_KEY" for e in container["env"])
    plain = r.deployment(OWNER, spec(replicas=2, standby_replicas=0))
    assert plain["spec"]["replicas"] == 2 and "--enable-sleep-mode" not in plain["spec"]["template"]["spec"][
        "containers"][0]["args"]
    assert r.deployment(OWNER, spec(replicas=2, standby_replicas=1, enabled=False))["spec"]["replicas"] == 2


def test_standby_pods_are_probed_for_readiness_every_second_so_a_wake_serves_at_once():
    def period(s: api.InferenceServiceSpec) -> int:
        return r.deployment(OWNER, s)["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["periodSeconds"]
    assert period(spec(standby_replicas=1)) == 1
    assert period(spec(standby_replicas=0)) == period(spec(standby_replicas=1, enabled=False)) == 5


def test_standby_is_bounded():
    with pytest.raises(ValidationError):
        spec(standby_replicas=-1)
    with pytest.raises(ValidationError):
        spec(standby_replicas=17)


def test_a_scale_up_wakes_standbys_and_extra_awake_pods_go_to_sleep():
    pods = [Loaded("a", False), Loaded("b", True), Loaded("c", True)]
    assert plan(pods, 1) == Plan()
    assert plan(pods, 2) == Plan(wake=["b"])
    assert plan(pods, 5) == Plan(wake=["b", "c"])  # no more to wake: the Deployment starts the rest cold
    # A pod that just loaded comes up awake: one too many, it becomes the new standby.
    assert plan([Loaded("a", False), Loaded("b", False), Loaded("c", True)], 1) == Plan(sleep=["b"])
    # A scale-down: the surplus awake pods sleep, the newest first.
    assert plan([Loaded("a", False, "1"), Loaded("b", False, "3"), Loaded("c", False, "2")], 1) == \
        Plan(sleep=["b", "c"])
    assert plan([], 3) == Plan()  # nothing loaded yet: nothing to do


def test_events_say_what_was_done():
    woke = standby.summary(Plan(wake=["b"]), awake_before=1, serving=2)
    assert [reason for reason, _ in woke] == ["StandbyWoken"] and "(b)" in woke[0][1]
    slept = standby.summary(Plan(sleep=["c"]), awake_before=3, serving=2)
    assert [reason for reason, _ in slept] == ["StandbyAsleep"] and "(c)" in slept[0][1]
    assert standby.summary(Plan(), 2, 2) == []


def _pod(name: str, asleep: bool | None, ready: bool) -> dict:
    started = datetime(2026, 11, 29, tzinfo=UTC)
    conds = [{"type": "Ready", "status": "True" if ready else "False",
              "lastTransitionTime": (started + timedelta(seconds=60)).isoformat()}]
    if asleep is not None:
        conds.append(standby.asleep_condition(asleep))
    return {"metadata": {"name": name}, "status": {"phase": "Running", "startTime": started.isoformat(),
                                                    "conditions": conds, "podIP": "10.0.0.1"}}


def test_a_sleeping_pod_is_counted_as_standby_not_as_overdue_or_starting():
    asleep = summaries.summarize_pod(_pod("b", True, ready=False))
    awake = summaries.summarize_pod(_pod("a", False, ready=True))
    assert asleep.asleep and not awake.asleep
    assert not summaries.summarize_pod(_pod("c", None, ready=False)).asleep
    assert conditions.replica_counts([awake, asleep]) == {"replicas": 2, "readyReplicas": 1, "standbyReplicas": 1}
    since = datetime(2026, 11, 29, tzinfo=UTC)
    late = since + timedelta(days=1)  # far past the probes' budget
    loading = summaries.PodSummary("c", not_ready_since=since, startup_budget_s=600.0)
    assert conditions._overdue(loading, late) is not None
    assert conditions._overdue(replace(loading, asleep=True), late) is None  # a standby is not ready on purpose


def test_from_zero_every_standby_wakes_at_once():
    auto = spec(replicas=0, standby_replicas=3).autoscaling.model_copy(update={"min_replicas": 0,
                                                                              "scale_to_zero_idle_seconds": 60})
    one = Decision(1, "requests held at the router")
    assert standby.from_zero(one, auto, current=0).replicas == 3
    assert "all 3 standbys" in standby.from_zero(one, auto, current=0).reason
    assert standby.from_zero(one, auto, current=1) == one  # not from zero: the policy's own step
    assert standby.from_zero(Decision(0, "idle"), auto, current=0).replicas == 0  # staying at zero stays
    assert standby.from_zero(Decision(5, "a burst"), auto, current=0).replicas == 5  # more than the standbys
    capped = auto.model_copy(update={"max_replicas": 2})
    assert standby.from_zero(one, capped, current=0).replicas == 2


def test_the_node_cache_is_the_namespaces_folder_on_the_node_and_needs_the_admins_hostpath():
    """Issue 53 part 4: spec.model.cache.node; kaon fetch's completion marker (fetch/store.py) is what lets a
    second pod on the node skip the download (tests/integration/test_fetch.py: two fetches of one cache download
    each file once)."""
    from kaon_operator import spec_policy
    from kaon_operator.children import pod_template
    from kaon_operator.config import SpecPolicy

    node = api.InferenceServiceSpec.model_validate({"model": {"uri": "hf://org/model", "cache": {"node": True}}})
    pod = r.deployment(OWNER, node)["spec"]["template"]["spec"]
    assert {"name": "cache", "hostPath": {"path": pod_template.NODE_CACHE_ROOT, "type": "DirectoryOrCreate"}} \
        in pod["volumes"]
    for container in [*pod.get("initContainers", []), *pod["containers"]]:
        cache = next(m for m in container["volumeMounts"] if m["name"] == "cache")
        assert cache["subPathExpr"] == "$(KAON_POD_NAMESPACE)", container["name"]
        assert {"name": "KAON_POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}} \
            in container["env"], container["name"]
    plain = r.deployment(OWNER, spec())["spec"]["template"]["spec"]
    assert not any("hostPath" in v for v in plain["volumes"])
    assert "model.cache.node" in spec_policy.refusal(node, SpecPolicy())
    assert spec_policy.refusal(node, SpecPolicy(allow_host_path=True)) is None
    with pytest.raises(ValidationError, match="name one"):
        api.ModelCacheSpec.model_validate({"node": True, "persistentVolumeClaim": "models"})


TP_REFUSAL = "sleep is not supported with tensor or pipeline parallelism (the other ranks keep their memory)"


def test_a_standby_the_engine_cannot_put_to_sleep_says_why_in_its_warning_event():
    """The CRD says standbys of an engine that cannot sleep (tensor parallelism, a draft model) stay awake and a
    Warning Event says so: the round's StandbyFailed Event carries the engine's own reason (its 400's message),
    which `kubectl describe` shows, not only a pointer to the operator's log. The real loop against an engine on a
    port that answers /is_sleeping and refuses /sleep as kaon serve does with --tensor-parallel-size 2."""
    import asyncio
    import base64
    from types import SimpleNamespace

    import aiohttp
    from aiohttp import web

    from kaon_operator.autoscaling.standby_sync import StandbyLoop
    from kaon_operator.status.summaries import PodSummary

    async def scenario():
        async def is_sleeping(_request):
            return web.json_response({"is_sleeping": False})

        async def refuse(_request):
            return web.json_response({"error": {"message": TP_REFUSAL, "type": "invalid_request_error",
                                                "param": "level", "code": "sleep_unsupported"}}, status=400)

        app = web.Application()
        app.router.add_get("/is_sleeping", is_sleeping)
        app.router.add_post("/sleep", refuse)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        events: list = []
        pods = [PodSummary(f"llama-{i}", ip="127.0.0.1", ready=True, containers_ready=True, created=f"2026-01-0{i + 1}")
                for i in range(2)]
        ctx = SimpleNamespace(
            kube=SimpleNamespace(secret_data=lambda *_: {"key": base64.b64encode(b"admin").decode()},
                                 set_pod_condition=lambda *_: None),
            caches=SimpleNamespace(pods=lambda _key: pods), post=lambda _body, posted: events.extend(posted))
        loop = StandbyLoop(ctx, url_of=lambda _pod: f"http://127.0.0.1:{port}")  # type: ignore[arg-type]
        try:
            async with aiohttp.ClientSession() as session:
                await loop.tick(session, ("serving", "llama"), {"metadata": {"uid": "u"}}, spec(replicas=1))
        finally:
            await runner.cleanup()
        return events

    events = asyncio.run(scenario())
    assert [(e.type, e.reason) for e in events] == [("Warning", "StandbyFailed")]
    assert events[0].message == f"could not wake or put to sleep llama-1: 400: {TP_REFUSAL}; the next round tries again"


def test_an_engines_refusal_reads_as_its_message_or_its_body():
    assert standby.engine_refusal(400, '{"error": {"message": "no"}}') == "400: no"
    assert standby.engine_refusal(404, "Not Found") == "404: Not Found"
    assert standby.engine_refusal(502, "") == "502: no body"
    assert standby.engine_refusal(400, '{"error": "' + "x" * 1000 + '"}').startswith("400: {")
    assert len(standby.engine_refusal(400, "y" * 5000)) == len("400: ") + standby.MAX_REASON_CHARS
