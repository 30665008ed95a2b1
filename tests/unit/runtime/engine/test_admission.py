"""Admission past capacity (engine/admission.py): the pure decisions, and the engine's expiry of queued
requests that waited past the admission limit (issue 49 §6)."""
from __future__ import annotations

import pytest

from kaon_runtime.engine.admission import (
    FinishRate,
    admission,
    expected_wait_s,
    queue_expired,
    retry_after_s,
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
