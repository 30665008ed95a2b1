"""The prefill pool's own autoscaling decision (prefill_scaling.py) and the signals it is fed."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from kaon_operator import api
from kaon_operator.autoscaling import demand, prefill_scaling, scraper
from kaon_operator.autoscaling.perf_model import PerfModel, Prediction
from kaon_operator.autoscaling.prefill_scaling import PrefillLoad, decide

SPEC = api.PrefillAutoscalingSpec(enabled=True, min_replicas=1, max_replicas=6,
                                  target_queued_prompt_tokens_per_replica=1000, target_p99_ttft_seconds=2.0,
                                  scale_down_stabilization_seconds=300, max_step=2)
# 1,024-token chunks at 0.02 + 0.0004 x 1024 = 0.4296 s a step: ~2,384 prompt tokens/s per replica.
MODEL = PerfModel(a=0.02, b=0.0015, c=0.0004, max_num_batched_tokens=1024)


def load(queued=0.0, ttft=None, rate=0.0, ready=SPEC.max_replicas) -> PrefillLoad:
    """`ready`: prefill pods Ready now (default: every replica asked for, none starting)."""
    return PrefillLoad(queued_prompt_tokens=queued, ttft_p99=ttft, prompt_tokens_per_second=rate,
                       ready_replicas=ready)


def test_queued_prompt_tokens_size_the_pool():
    assert decide(load(queued=2500), SPEC, current=1, now=1000, last_change=None)[0] == 3
    replicas, why = decide(load(queued=900), SPEC, current=1, now=1000, last_change=None)
    assert replicas == 1 and "900 prompt tokens queued" in why


def test_a_missed_ttft_target_adds_a_replica_even_with_an_empty_queue():
    assert decide(load(queued=0, ttft=3.5), SPEC, current=2, now=1000, last_change=None) == \
        (3, "P99 TTFT 3.50s > target 2s")
    assert decide(load(queued=0, ttft=1.0), SPEC, current=2, now=1000, last_change=None)[0] == 1


def test_a_missed_ttft_target_waits_for_the_replicas_already_starting():
    """The overshoot the simulator found (1 -> 10 in 45 s): TTFT stays over target until a started replica
    serves, and each tick asked for one more. Ticks every 5 s, a replica ready 60 s after it is asked for."""
    current, asked_at, now = 1, {}, 0.0
    for _ in range(12):  # TTFT over target the whole minute
        ready = 1 + sum(now - t >= 60 for t in asked_at.values())
        replicas, why = decide(load(ttft=3.5, ready=ready), SPEC, current=current, now=now, last_change=None)
        for n in range(current, replicas):
            asked_at[n] = now
        current, now = replicas, now + 5
    assert current == 2, "one replica asked for, then held while it starts"
    assert "1 replica(s) starting" in why
    assert decide(load(ttft=3.5, ready=2), SPEC, current=2, now=now, last_change=None)[0] == 3  # it serves: next
    # The queue sizes the pool absolutely: starting replicas count, and a longer queue still asks for more at once.
    assert decide(load(queued=2500, ready=1), SPEC, current=3, now=now, last_change=None)[0] == 3
    assert decide(load(queued=4500, ttft=3.5, ready=1), SPEC, current=3, now=now, last_change=None)[0] == 5


def test_the_profile_sizes_the_pool_from_the_prompt_token_rate():
    capacity = prefill_scaling.replica_capacity(MODEL)
    assert capacity == pytest.approx(1024 / 0.4296)
    # 5,000 tokens/s at 70% of ~2,384/s each: 3 replicas, with nothing queued yet.
    assert decide(load(rate=5000), SPEC, current=1, now=1000, last_change=None, model=MODEL)[0] == 3
    assert decide(load(rate=5000), SPEC, current=1, now=1000, last_change=None)[0] == 1  # no profile: queue only


def test_scale_down_waits_for_stabilization_and_a_met_ttft():
    assert decide(load(), SPEC, current=4, now=1000, last_change=900)[0] == 4  # 100 s < 300 s since the last change
    assert decide(load(), SPEC, current=4, now=1300, last_change=900)[0] == 2  # max_step 2
    assert decide(load(ttft=2.5), SPEC, current=4, now=1300, last_change=900)[0] == 5  # over target: up, not down


def test_bounds_and_step():
    assert decide(load(queued=50_000), SPEC, current=1, now=0, last_change=None)[0] == 3  # +max_step
    assert decide(load(queued=50_000), SPEC, current=5, now=0, last_change=None)[0] == 6  # maxReplicas
    zero_ok = SPEC.model_copy(update={"min_replicas": 0})
    assert decide(load(), zero_ok, current=1, now=1000, last_change=None)[0] == 0
    assert decide(load(), SPEC, current=1, now=1000, last_change=None)[0] == 1


def test_the_spec_refuses_min_above_max_and_renders_its_defaults():
    with pytest.raises(ValidationError, match="minReplicas must be <= maxReplicas"):
        api.PrefillAutoscalingSpec(min_replicas=3, max_replicas=2)
    spec = api.PrefillSpec.model_validate({"replicas": 2, "autoscaling": {"enabled": True, "maxReplicas": 8,
                                                                         "targetP99TtftSeconds": 1.5}})
    assert spec.autoscaling.max_replicas == 8 and spec.autoscaling.target_p99_ttft_seconds == 1.5
    assert api.PrefillSpec().autoscaling.enabled is False


def test_the_engine_reports_its_queued_prompt_tokens_and_time_per_output_token():
    text = ("# TYPE kaon_num_prompt_tokens_waiting gauge\nkaon_num_prompt_tokens_waiting 1234.0\n"
            "# TYPE kaon_time_per_output_token_seconds histogram\n"
            'kaon_time_per_output_token_seconds_bucket{le="0.05"} 3.0\n'
            'kaon_time_per_output_token_seconds_bucket{le="+Inf"} 4.0\n'
            "kaon_time_per_output_token_seconds_count 4.0\nkaon_time_per_output_token_seconds_sum 0.3\n")
    parsed = scraper.parse(text)
    assert parsed.prompt_tokens_waiting == 1234.0
    assert parsed.latency_buckets["itl"] == ((0.05, 3.0), (float("inf"), 4.0))


def test_the_decode_pools_predicted_latency_is_the_inter_token_latency():
    prediction = Prediction(utilization=0.5, step_seconds=0.03, batch=4, ttft_p99=2.0, itl=0.03, kv_tokens=100)
    itl = api.AutoscalingSpec(latency_metric="itl")
    assert demand.latency(MODEL, itl, prediction, output=100) == 0.03
    assert demand.latency(MODEL, api.AutoscalingSpec(), prediction, output=100) == 2.0


class PrefillKube:
    """The API client the loop needs for a service with spec.prefill: no routers, its prefill pod, writes."""

    def __init__(self):
        self.prefill_replicas, self.decode_replicas, self.selectors = [], [], []

    def list_pods(self, namespace, selector):
        self.selectors.append(selector)
        if "component=router" in selector:
            return []
        return [{"metadata": {"name": "a-prefill-0"}, "spec": {"containers": [{}]},
                 "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}]

    def patch_prefill_replicas(self, namespace, name, replicas):
        self.prefill_replicas.append((name, replicas))

    def patch_replicas(self, namespace, name, replicas, resource_version=None):
        self.decode_replicas.append((name, replicas))

    def patch_status(self, namespace, name, patch, resource_version=None):
        return {"metadata": {"resourceVersion": "2"}}


def test_the_loop_scales_the_prefill_pool_on_its_queue_and_says_so(monkeypatch):
    """One tick against a real engine exposition (the runtime's Metrics) served over HTTP: 5,000 prompt
    tokens queued on the prefill pod at a target of 1,000 per replica -> 1 + maxStep 2 = 3 replicas, an
    Event; the decode pool (spec.autoscaling off) is left alone."""
    import asyncio

    from kaon_operator.caches import Caches
    from kaon_runtime.engine.llm_engine import EngineStats
    from kaon_runtime.server.metrics import Metrics
    from unit.operator.autoscaling.test_autoscaler import one_tick, serve_metrics

    text = Metrics(lambda: EngineStats(1, 2, 0.5, 0, 0, 0, 0, 0, prompt_tokens_waiting=5000)).render().decode()
    service = {"metadata": {"namespace": "ns", "name": "a"}, "spec": {
        "model": {"uri": "builtin://x"}, "replicas": 1,
        "prefill": {"replicas": 1, "autoscaling": {"enabled": True, "maxReplicas": 4,
                                                   "targetQueuedPromptTokensPerReplica": 1000}}}}
    kube = PrefillKube()

    async def run():
        runners, (port,), _ = await serve_metrics("127.0.0.1", text)
        try:
            return await one_tick(kube, Caches(inference_services={("ns", "a"): [service]}), port, monkeypatch)
        finally:
            for runner in runners:
                await runner.cleanup()

    _, events = asyncio.run(run())
    assert "app.kubernetes.io/component=prefill" in kube.selectors[-1]
    assert kube.prefill_replicas == [("a", 3)] and kube.decode_replicas == []
    assert [(e.reason, e.message) for e in events] == [
        ("PrefillScaled", "Scaled the prefill pool up 1 → 3: 5000 prompt tokens queued (target 1000/replica)")]


def test_the_decode_pool_scales_on_inter_token_latency_when_prompts_are_prefilled_elsewhere():
    from kaon_operator.autoscaling.autoscale_loop import decode_pool_spec

    plain = api.InferenceServiceSpec.model_validate({"model": {"uri": "builtin://x"}})
    assert decode_pool_spec(plain).autoscaling.latency_metric == "ttft"
    disaggregated = plain.model_copy(update={"prefill": api.PrefillSpec()})
    assert decode_pool_spec(disaggregated).autoscaling.latency_metric == "itl"
