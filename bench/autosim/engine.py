"""The engine model: one replica's step time, its scheduler, its queue and its counters.

Engine (one object per replica): at most maxNumSeqs sequences run; every step decodes one
token for each running sequence and prefills prompt chunks first-come-first-served within
maxNumBatchedTokens (decodes count against that budget, as in kaon's scheduler); the step
takes a + b * decode_batch + c * prefill_tokens seconds (fitted by --calibrate from a real
`kaon serve`); waiting requests queue FIFO at the replica; a request's first token comes at
the end of the step that finishes its prompt (TTFT = queueing + prefill).
"""
from __future__ import annotations

import ast
import bisect
import heapq
import math
from collections import deque
from dataclasses import dataclass

from kaon_operator.autoscaling import perf_model

from . import ROOT


def _engine_buckets() -> tuple[float, ...]:
    """The engine's TTFT histogram bounds, read from its source (importing it pulls in torch)."""
    tree = ast.parse((ROOT / "runtime" / "kaon_runtime" / "server" / "metrics.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "LATENCY_BUCKETS" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise RuntimeError("LATENCY_BUCKETS not found in metrics.py")


BUCKETS = _engine_buckets()
BOUNDS = (*BUCKETS, math.inf)  # Prometheus adds the +Inf bucket


# --------------------------------------------------------------------------- the engine model

@dataclass(frozen=True)
class EngineModel:
    a: float
    """Seconds every step costs (the engine loop, the weights read once per step)."""
    b: float
    """Seconds per decoding sequence in the step."""
    c: float
    """Seconds per prompt token prefilled in the step."""
    cold_start_s: float
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    d: float = 0.0
    """Seconds per context token (prompt and generated so far) of the decoding sequences."""

    def step_seconds(self, batch: int, prefill_tokens: int, context_tokens: float = 0.0) -> float:
        return self.a + self.b * batch + self.c * prefill_tokens + self.d * context_tokens

    def perf_model(self) -> perf_model.PerfModel:
        """What a profile of this engine measures: the predictive policy's model."""
        return perf_model.PerfModel(self.a, self.b, self.c, self.d, cold_start_seconds=self.cold_start_s,
                                    max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens)


@dataclass(frozen=True)
class Workload:
    """Prompt and output lengths, uniform in these inclusive ranges."""
    prompt: tuple[int, int] = (32, 256)
    output: tuple[int, int] = (16, 128)

    def mean(self) -> tuple[float, float]:
        return sum(self.prompt) / 2, sum(self.output) / 2


class Request:
    __slots__ = ("arrival", "prompt", "output", "todo", "first_token", "done", "cut", "failed")

    def __init__(self, arrival: float, prompt: int, output: int):
        self.arrival, self.prompt, self.output = arrival, prompt, output
        self.todo = prompt  # prompt tokens not prefilled yet
        self.first_token: float | None = None
        self.done: float | None = None
        self.cut = False
        self.failed = False  # held at the router past the hold timeout

    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival


class Replica:
    """One engine: a FIFO queue, sequences in prefill, sequences in decode, its counters."""

    def __init__(self, rid: int, ready_at: float):
        self.id, self.ready_at = rid, ready_at
        self.waiting: deque[Request] = deque()
        self.prefilling: deque[Request] = deque()
        self.decoding: list[tuple[int, int, Request]] = []  # heap of (step it finishes at, tie, request)
        self.steps = 0
        self.stepping = False
        self.chunks: list[tuple[Request, int]] = []  # the prefill chunks of the step in flight
        self.draining_since: float | None = None
        self.gone = False
        self.finished = 0  # requests finished: the engine's kaon_requests_total
        self.prompt_tokens = 0  # kaon_prompt_tokens_total: counted when a request is accepted
        self.generated = 0  # kaon_generation_tokens_total
        self.finished_output = 0  # kaon_request_generation_tokens_sum: the output lengths of finished requests
        self.context_base = 0  # sum over decoding sequences of prompt + output - the step they finish at
        self.ttft_counts = [0] * len(BOUNDS)  # per bucket (not cumulative)

    @property
    def running(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    @property
    def in_flight(self) -> int:
        return len(self.waiting) + self.running

    def histogram(self) -> tuple[tuple[float, float], ...]:
        """The cumulative (le, count) pairs a scrape of kaon_time_to_first_token_seconds reads."""
        total, out = 0, []
        for le, count in zip(BOUNDS, self.ttft_counts):
            total += count
            out.append((le, float(total)))
        return tuple(out)

    def plan_step(self, model: EngineModel) -> float:
        """Choose this step's work as kaon's scheduler does; return its duration."""
        budget = model.max_num_batched_tokens - len(self.decoding)
        chunks = []
        for req in self.prefilling:
            if budget <= 0:
                break
            n = min(req.todo, budget)
            chunks.append((req, n))
            budget -= n
        while self.waiting and budget > 0 and self.running < model.max_num_seqs:
            req = self.waiting.popleft()
            self.prefilling.append(req)
            n = min(req.todo, budget)
            chunks.append((req, n))
            budget -= n
        self.chunks = chunks
        context = self.context_base + len(self.decoding) * self.steps if model.d else 0.0
        return model.step_seconds(len(self.decoding), sum(n for _, n in chunks), context)

    def finish_step(self, now: float) -> list[Request]:
        """Apply the step that ends now; return the requests it finished."""
        self.generated += len(self.decoding)
        self.steps += 1
        done = []
        while self.decoding and self.decoding[0][0] <= self.steps:
            end, _, req = heapq.heappop(self.decoding)
            self.context_base -= req.prompt + req.output - end
            done.append(req)
        for req, n in self.chunks:
            req.todo -= n
            if req.todo == 0:
                self.prefilling.remove(req)
                req.first_token = now
                self.generated += 1
                self.ttft_counts[bisect.bisect_left(BOUNDS, now - req.arrival)] += 1
                if req.output <= 1:
                    done.append(req)
                else:
                    end = self.steps + req.output - 1
                    heapq.heappush(self.decoding, (end, id(req), req))
                    self.context_base += req.prompt + req.output - end
        self.chunks = []
        for req in done:
            req.done = now
            self.finished_output += req.output
        self.finished += len(done)
        return done
