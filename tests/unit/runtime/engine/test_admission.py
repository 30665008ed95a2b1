"""Admission past capacity (engine/admission.py): the pure decisions, and the engine's expiry of queued
requests that waited past the admission limit (issue 49 §6)."""
from __future__ import annotations

import pytest

from kaon_runtime.engine.admission import (
    CPU_MAX_NUM_SEQS,
    GPU_MAX_NUM_SEQS,
    FinishRate,
    StepTimes,
    admission,
    device_type,
    expected_wait_s,
    queue_expired,
    retry_after_s,
    serving_max_num_seqs,
    start_deadline_s,
)


def test_a_queued_request_expires_only_past_the_limit():
    assert not queue_expired(9.9, 10.0)
    assert queue_expired(10.1, 10.0)
    assert not queue_expired(1e6, None)  # no limit: it waits as long as it takes


def test_expected_wait_counts_the_requests_ahead_past_the_free_slots():
    assert expected_wait_s(ahead=3, free_slots=4, finishes_per_s=None) == 0.0  # a slot is free: no wait
    assert expected_wait_s(ahead=4, free_slots=4, finishes_per_s=2.0) == pytest.approx(0.5)  # its own turn
    assert expected_wait_s(ahead=10, free_slots=0, finishes_per_s=2.0) == pytest.approx(5.5)
    assert expected_wait_s(ahead=10, free_slots=0, finishes_per_s=None) is None  # no rate yet: unknown


def test_expected_wait_adds_the_step_that_computes_the_prompt_only_behind_a_queue():
    # a free slot: it starts in the next step, whatever that step costs (never refused for it)
    assert expected_wait_s(ahead=0, free_slots=1, finishes_per_s=2.0, step_s=5.0) == 0.0
    assert expected_wait_s(ahead=10, free_slots=0, finishes_per_s=2.0, step_s=1.5) == pytest.approx(7.0)
    late = admission(num_waiting=10, max_queue=256, wait_s=expected_wait_s(10, 0, 2.0, step_s=1.5),
                     max_queue_wait_s=6.0)
    assert late is not None and late.status == 503  # 5.5 s of queue fits 6 s; with the step it does not


def test_a_queued_request_expires_early_enough_for_its_first_token_to_come_within_the_limit():
    assert start_deadline_s(30.0, 1.2) == pytest.approx(28.8)
    assert start_deadline_s(30.0, 0.0) == 30.0  # no step seen yet
    assert start_deadline_s(1.0, 5.0) == 0.5  # a step past the limit leaves half of it to wait


def test_the_slowest_recent_step_stands_for_a_prompts_step():
    steps = StepTimes(window=3)
    assert steps.slowest() == 0.0
    for duration in (0.1, 0.9, 0.2):
        steps.record(duration)
    assert steps.slowest() == 0.9
    steps.record(0.3)
    steps.record(0.1)
    assert steps.slowest() == 0.3  # the 0.9 s step left the window


def test_the_running_batch_defaults_to_the_measured_cpu_size_and_a_flag_wins():
    assert serving_max_num_seqs(None, "cpu") == CPU_MAX_NUM_SEQS == 8
    assert serving_max_num_seqs(None, "cuda:1") == serving_max_num_seqs(None, "cuda") == GPU_MAX_NUM_SEQS == 64
    assert serving_max_num_seqs(3, "cpu") == 3 and serving_max_num_seqs(64, "cpu") == 64
    assert device_type("cuda:0") == "cuda" and device_type("auto") in ("cpu", "cuda")


def test_a_full_queue_is_a_429_and_a_wait_past_the_limit_a_503_with_when_to_come_back():
    full = admission(num_waiting=256, max_queue=256, wait_s=3.0, max_queue_wait_s=10.0)
    assert full is not None and full.status == 429 and "--max-queue" in full.reason
    late = admission(num_waiting=40, max_queue=256, wait_s=25.2, max_queue_wait_s=10.0)
    assert late is not None and late.status == 503 and "--max-queue-wait" in late.reason
    assert late.retry_after_s == 16  # the queue is within the limit again in about 15.2 s


def test_a_request_that_fits_the_limit_or_an_unknown_wait_is_queued():
    assert admission(num_waiting=5, max_queue=256, wait_s=9.0, max_queue_wait_s=10.0) is None
    assert admission(num_waiting=50, max_queue=256, wait_s=None, max_queue_wait_s=10.0) is None
    assert admission(num_waiting=50, max_queue=256, wait_s=500.0, max_queue_wait_s=None) is None


def test_retry_after_is_at_least_a_second():
    assert retry_after_s(None, 10.0) == 1
    assert retry_after_s(10.5, 10.0) == 1
    assert retry_after_s(13.2, 10.0) == 4


def test_the_finish_rate_is_measured_over_a_trailing_window():
    rate = FinishRate(window_s=10.0)
    rate.record(0.0, 2)
    assert rate.rate(1.0) is None  # too few finishes to trust
    rate.record(2.0, 2)
    rate.record(4.0, 2)
    assert rate.rate(4.0) == pytest.approx(6 / 4.0)
    assert rate.rate(11.0) == pytest.approx(4 / 9.0)  # the first two left the window
    assert rate.rate(30.0) is None


def test_a_batch_is_admitted_or_refused_whole_and_its_prompts_never_expire_alone():
    """A /v1/completions batch of prompts used to be admitted prompt by prompt: 300 one-token prompts got a 503
    at the 49th and the 48 queued were cancelled. Now the batch is judged once (room for all of it in the queue,
    its first prompt's turn within the limit) and its prompts are queued without their own check or expiry."""
    import asyncio
    import time

    from kaon_runtime.engine.async_engine import AsyncEngine
    from kaon_runtime.errors import OverloadedError, QueueFullError
    from kaon_runtime.sampling import SamplingParams
    from tests.unit.runtime.server.test_pipeline import StubEngine

    class Expiring(StubEngine):
        def __init__(self):
            super().__init__()
            self.kept: set[str] = set()

        def expire_waiting(self, max_wait_s, now=None, keep=frozenset()):
            self.kept |= keep
            return []

    stub = Expiring()
    front = AsyncEngine(stub, max_queue=8, max_queue_wait_s=30.0, max_running=2)

    async def run():
        front.start()
        try:
            front.admit_batch(8)  # the whole queue: let in
            with pytest.raises(QueueFullError, match="batch of 9 prompts"):
                front.admit_batch(9)
            front._finishes.record(time.monotonic() - 29, 4)  # a slow drain: 4 finishes in 29 s
            front._num_queued = 6  # six waiting before the batch: its first prompt's turn is ~36 s away
            with pytest.raises(OverloadedError, match="admission limit"):
                front.admit_batch(2)
            # Prompt by prompt, each behind the others, a batch was cut off partway like this:
            with pytest.raises(OverloadedError):
                await front.add_request("alone", "hi", SamplingParams(max_tokens=1))
            front._num_queued, front._finishes = 0, type(front._finishes)()  # no rate known: all queued
            streams = [await front.add_request(f"b{i}", "hi", SamplingParams(max_tokens=20), admitted=True)
                       for i in range(2)]
            streams.append(await front.add_request("plain", "hi", SamplingParams(max_tokens=20)))
            return [[o async for o in s][-1].finished for s in streams]
        finally:
            await front.stop()

    assert asyncio.run(run()) == [True, True, True]
    assert stub.kept == {"b0", "b1"}  # the batch's prompts were never offered for expiry; the plain one was
