"""How many prefill replicas (spec.prefill.autoscaling, docs/disaggregation.md): a pure decision.

The prefill pool scales on its own signals, not the decode pool's: the prompt tokens waiting on the
prefill engines (the work queued for them) and the decode engines' P99 time to first token (what a
user waits for: the transfer included). With the engine's performance model (spec.autoscaling.profile)
the prompt-token arrival rate sizes the pool too: each replica computes at most
`max_num_batched_tokens / step_seconds(0, max_num_batched_tokens)` prompt tokens a second.

The decode pool (spec.replicas) keeps spec.autoscaling's policy, on concurrency and inter-token latency
(autoscale_loop.py passes `itl` as its latency metric when spec.prefill is set).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kaon_operator.api import PrefillAutoscalingSpec
from kaon_operator.autoscaling.perf_model import PerfModel

UTILIZATION = 0.7
"""Share of a prefill replica's measured capacity the rate-based size plans for (headroom for bursts)."""


@dataclass(frozen=True, slots=True)
class PrefillLoad:
    queued_prompt_tokens: float
    """Prompt tokens not computed yet on the prefill engines now (`kaon_num_prompt_tokens_waiting`, summed)."""
    ttft_p99: float | None
    """The decode engines' P99 time to first token since the last tick (None: no request finished)."""
    prompt_tokens_per_second: float
    """Prompt tokens the prefill engines accepted per second since the last tick."""
    ready_replicas: int
    """Prefill pods Ready now. Fewer than the pool's replicas: the rest are starting (or not created yet),
    capacity already on its way that a missed TTFT must not ask for again."""


def replica_capacity(model: PerfModel) -> float:
    """Prompt tokens a second one prefill replica computes flat out (full prefill chunks, no decoding)."""
    chunk = model.max_num_batched_tokens
    return chunk / model.step_seconds(0.0, chunk)


def decide(load: PrefillLoad, spec: PrefillAutoscalingSpec, current: int, now: float,
           last_change: float | None, model: PerfModel | None = None) -> tuple[int, str]:
    """(replicas, why). Up at once when the queue or TTFT says so; down only after the stabilization
    window since the last change, and only while TTFT (if targeted) is under its target.

    A missed TTFT adds one replica relative to `current`, so it waits while replicas are starting: the TTFT
    of the requests finished meanwhile still shows the shortage that those replicas answer (without this, a
    pool whose replicas take a minute to start grew by one every tick: 1 -> 10 in 45 s in the simulator).
    The queue and the rate size the pool absolutely, so they count every replica, starting or not."""
    wanted = math.ceil(load.queued_prompt_tokens / spec.target_queued_prompt_tokens_per_replica)
    per_replica = spec.target_queued_prompt_tokens_per_replica
    why = f"{load.queued_prompt_tokens:.0f} prompt tokens queued (target {per_replica:g}/replica)"
    if model is not None:
        by_rate = math.ceil(load.prompt_tokens_per_second / (UTILIZATION * replica_capacity(model)))
        if by_rate > wanted:
            wanted = by_rate
            why = (f"{load.prompt_tokens_per_second:.0f} prompt tokens/s, {replica_capacity(model):.0f}/s per replica "
                   f"at {UTILIZATION:g} utilization (the profile)")
    goal = spec.target_p99_ttft_seconds
    ttft_over = goal is not None and load.ttft_p99 is not None and load.ttft_p99 > goal
    starting = max(0, current - load.ready_replicas)
    if ttft_over and wanted <= current:
        if starting:
            wanted, why = current, f"P99 TTFT {load.ttft_p99:.2f}s > target {goal:g}s, {starting} replica(s) starting"
        else:
            wanted, why = current + 1, f"P99 TTFT {load.ttft_p99:.2f}s > target {goal:g}s"
    if wanted < current:
        stable = last_change is None or now - last_change >= spec.scale_down_stabilization_seconds
        if ttft_over or not stable:
            held = "TTFT over target" if ttft_over else "within the stabilization window"
            wanted, why = current, f"holding: {held}"
    step = max(-spec.max_step, min(spec.max_step, wanted - current))
    return max(spec.min_replicas, min(spec.max_replicas, current + step)), why
