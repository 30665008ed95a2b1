"""Past capacity: which new requests are turned away, which queued ones give up, and what each is told.

The running batch is bounded (the scheduler's max_num_seqs and max_num_batched_tokens), so past the
server's capacity requests wait in arrival order and the oldest is admitted first: the batch keeps
finishing work at the machine's pace instead of every request slowing together in one ever-growing
batch. What bounds the wait is the admission limit, `max_queue_wait_s` (`kaon serve --max-queue-wait`):
the longest a request waits for its turn, so the time to its first token is at most that plus a step.

- A queued request not started within the limit is answered 503 with a Retry-After (`queue_expired`).
- A new request is answered at once rather than after that wait: 429 when the queue is full
  (`--max-queue`), 503 when the requests ahead of it, at the rate requests have been finishing, would
  keep it waiting past the limit (`admission`). Retry-After says when the queue should have room.

The limit bounds the time to the first token, not only the wait: a queued request is expired once its
wait plus the slowest recent step (the step that would compute its prompt) would pass the limit
(`start_deadline_s`, `StepTimes`), and a new one is refused when the wait ahead of it plus that step would.

The running batch's size is what sets the throughput past capacity. On a CPU a batch past 8 sequences
adds no throughput (2-vCPU Xeon, 128+32-token requests offline: 4.3 / 6.7 / 6.4 / 5.7 req/s at 4 / 8 / 16 /
64 sequences) while every sequence in it slows, so `kaon serve` runs at most CPU_MAX_NUM_SEQS on a CPU
unless --max-num-seqs says otherwise (`serving_max_num_seqs`); the rest wait, oldest first.

vLLM bounds the batch (max_num_seqs, max_num_batched_tokens) and lets its waiting queue grow without
limit; SGLang bounds the batch (--max-running-requests) and the queue (--max-queued-requests, 503 past
it). Neither bounds the wait itself, which is what a client's timeout sees.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

MIN_FINISHES_FOR_RATE = 4  # finishes seen before the rate estimate is trusted for an early refusal
RATE_WINDOW_S = 30.0  # the finish rate is measured over this trailing window
# The slowest of this many recent steps stands for the step that computes a prompt: enough to hold the last few
# prefill steps when the backlog's prompts go in as groups (a group every tens of decode steps; with 32, the
# window missed them, and completed requests' first tokens came up to 2 s past a 30 s limit at load 13)
STEP_WINDOW = 256
CPU_MAX_NUM_SEQS = 8  # the running batch that maximises throughput on a CPU (measured: see the docstring)
GPU_MAX_NUM_SEQS = 64


def serving_max_num_seqs(requested: int | None, device: str) -> int:
    """The running batch's bound: what --max-num-seqs asked for, else the measured default for the device
    (`device` as --device names it: "auto", "cpu", "cuda", "cuda:1")."""
    if requested is not None:
        return requested
    return CPU_MAX_NUM_SEQS if device_type(device) == "cpu" else GPU_MAX_NUM_SEQS


def serving_prefill_group(requested: int | None, max_num_seqs: int, device: str) -> int:
    """How many free slots a backlog's prompts wait for, to share one prefill step (scheduler.gather_prefills):
    what --prefill-group asked for, else on a CPU half the running batch (a step there costs about the same
    for one prompt as for several), on a GPU 1 (each goes in at once). Never more than the batch."""
    if requested is None:
        requested = max(max_num_seqs // 2, 1) if device_type(device) == "cpu" else 1
    return max(min(requested, max_num_seqs), 1)


def device_type(device: str) -> str:
    """"cpu" or "cuda" for a --device value; "auto" is the engine's choice (a GPU when one is visible)."""
    if device != "auto":
        return device.split(":")[0]
    import torch  # only here: the decisions above need no torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def start_deadline_s(max_queue_wait_s: float, slowest_step_s: float) -> float:
    """How long a request may wait for its turn and still get its first token within the admission limit:
    the limit less the step that computes its prompt, but at least half the limit (a step longer than the
    limit would otherwise expire every queued request before its turn could come)."""
    return max(max_queue_wait_s - slowest_step_s, max_queue_wait_s / 2)


@dataclass(frozen=True, slots=True)
class Refusal:
    status: int  # 429: the queue is full; 503: the wait would pass the admission limit
    reason: str
    retry_after_s: int


def queue_expired(waited_s: float, max_queue_wait_s: float | None) -> bool:
    """Whether a request still waiting for its turn (nothing computed for it yet) has waited too long."""
    return max_queue_wait_s is not None and waited_s > max_queue_wait_s


def expected_wait_s(ahead: int, free_slots: int, finishes_per_s: float | None, step_s: float = 0.0) -> float | None:
    """How long a new request would wait for its first token: nothing while a slot is free (it starts in the
    next step whatever that costs); else one finish for each request ahead of it past the free slots, plus
    its own, plus the step that computes its prompt (`step_s`). None: no rate known yet."""
    if ahead < free_slots:
        return 0.0
    if not finishes_per_s:
        return None
    return (ahead - free_slots + 1) / finishes_per_s + step_s


def admission(num_waiting: int, max_queue: int, wait_s: float | None, max_queue_wait_s: float | None) -> Refusal | None:
    """None: queue the request. Else the refusal to answer it with, at once."""
    if num_waiting >= max_queue:
        return Refusal(429, f"{num_waiting} requests are already waiting (limit {max_queue}, --max-queue)",
                       retry_after_s=retry_after_s(wait_s, 0.0))
    if wait_s is not None and max_queue_wait_s is not None and wait_s > max_queue_wait_s:
        return Refusal(503, f"the server is past its capacity: {num_waiting} requests are waiting, about "
                       f"{wait_s:.0f} s at the rate they finish, longer than the admission limit of "
                       f"{max_queue_wait_s:g} s (--max-queue-wait)",
                       retry_after_s=retry_after_s(wait_s, max_queue_wait_s))
    return None


def retry_after_s(wait_s: float | None, max_queue_wait_s: float) -> int:
    """Seconds until the queue should have drained to within the limit (at least 1; 1 when unknown)."""
    if wait_s is None:
        return 1
    return max(1, math.ceil(wait_s - max_queue_wait_s))


class FinishRate:
    """Requests finished per second over a trailing window (the queue's drain rate)."""

    def __init__(self, window_s: float = RATE_WINDOW_S):
        self.window_s = window_s
        self._times: deque[float] = deque()

    def record(self, now: float, count: int = 1) -> None:
        self._times.extend([now] * count)
        self._trim(now)

    def rate(self, now: float) -> float | None:
        self._trim(now)
        if len(self._times) < MIN_FINISHES_FOR_RATE:
            return None
        span = max(now - self._times[0], 1.0)
        return len(self._times) / min(span, self.window_s)

    def _trim(self, now: float) -> None:
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()


class StepTimes:
    """The engine's recent step durations; the slowest stands for the step that computes a new prompt."""

    def __init__(self, window: int = STEP_WINDOW):
        self._durations: deque[float] = deque(maxlen=window)

    def record(self, duration_s: float) -> None:
        self._durations.append(duration_s)

    def slowest(self) -> float:
        return max(self._durations, default=0.0)
