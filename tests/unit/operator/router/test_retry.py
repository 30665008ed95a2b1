"""The router's rules for sending a request again (router/retry.py), as pure decisions."""
from __future__ import annotations

from kaon_operator.router import retry
from kaon_operator.router.upstream import ConnectFailed, UpstreamError


def test_only_a_reused_connection_that_got_no_answer_byte_is_resent_on_a_new_one():
    assert retry.resend_on_new_connection(reused=True, answered=False)
    assert not retry.resend_on_new_connection(reused=True, answered=True)
    assert not retry.resend_on_new_connection(reused=False, answered=False)


def test_another_pod_is_tried_up_to_max_attempts_and_at_least_once():
    assert [retry.may_try_another(n, 3) for n in range(4)] == [True, True, True, False]
    assert [retry.may_try_another(n, 0) for n in range(2)] == [True, False]


def test_each_failure_before_the_response_began_names_its_reason_and_answer():
    refused = retry.failed_attempt(ConnectFailed("Connection refused"), True, "ns/svc", "pod-a", 600, 1)
    assert refused.reason == "cannot connect (Connection refused)" and refused.error is None
    assert not refused.timed_out
    slow = retry.failed_attempt(TimeoutError(), False, "ns/svc", "pod-a", 2.5, 2)
    assert slow.timed_out and slow.error is not None and slow.error.status == 504
    assert "within 2.5s (2 replicas tried)" in slow.error.message
    broken = retry.failed_attempt(UpstreamError("the engine closed the connection"), False, "ns/svc", "pod-a", 600, 1)
    assert broken.error is not None and broken.error.status == 502 and not broken.timed_out
    assert broken.reason == "the engine closed the connection"
