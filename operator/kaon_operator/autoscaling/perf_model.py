"""A measured performance model of one engine replica, and what it predicts for a load.

The engine works in steps: every step decodes one token for each running sequence and
prefills prompt chunks, and costs

    step seconds = a + b x batch + c x prefill tokens + d x context tokens

where `batch` is the sequences decoding, `prefill tokens` the prompt tokens prefilled in the
step and `context tokens` the tokens those sequences attend to (their KV cache). `fit` finds
a, b, c, d by least squares from a measured grid (bench/autoscale_calibrate.py measures one
on a real `kaon serve`); the model travels as JSON (a ConfigMap the operator reads).

From it, `predict` sizes one replica's steady state under Poisson arrivals of `rate`
requests a second with mean prompt P and output O tokens: every request adds work
w = b O + c P + d O (P + O/2) seconds to the steps it shares, so the replica is busy a share
rho = rate x w of its time beyond the per-step cost a, the mean step is a / (1 - rho), and
the batch is rate x O x step (Little's law). TTFT's P99 is the step that prefills a long
prompt (PROMPT_TAIL x P), plus the step in flight, plus the wait for the prefills queued
ahead: QUEUE_FACTOR x x rho / (1 - rho), x being one prefill step (c P + step). An M/M/1
tail (x ln(100 rho) / (1 - rho)) overstates it several times, since prefills are short
and regular next to decode work; QUEUE_FACTOR was set against bench/autoscale_sim.py's
engine between rho 0.15 and 0.6. The shape is what matters: the autoscaler corrects the
scale online from the P99 it observes (predictive.py).

Pure functions, no I/O.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

PROMPT_TAIL = 1.8  # the P99 prompt over the mean one (1.77 for lengths uniform from 0.2x to 1.8x the mean)
OUTPUT_TAIL = 1.8
QUEUE_FACTOR = 1.2
TERMS = ("a", "b", "c", "d")


@dataclass(frozen=True, slots=True)
class GridPoint:
    """One measured step: its decoding batch, prompt tokens prefilled, context tokens attended, seconds."""

    batch: float
    prefill_tokens: float
    context_tokens: float
    seconds: float


@dataclass(frozen=True, slots=True)
class Prediction:
    utilization: float
    """rho: the share of the replica's time its requests' work takes (>= 1: the queue grows without end)."""
    step_seconds: float
    batch: float
    ttft_p99: float
    itl: float
    """Mean time between output tokens: one step."""
    kv_tokens: float
    """Tokens the running sequences hold in the KV cache."""


@dataclass(frozen=True, slots=True)
class PerfModel:
    a: float
    """Seconds every step costs (the engine loop, the weights read once per step)."""
    b: float
    """Seconds per decoding sequence in a step."""
    c: float
    """Seconds per prompt token prefilled in a step."""
    d: float = 0.0
    """Seconds per context token attended in a step."""
    cold_start_seconds: float = 0.0
    """Measured: from process start to ready (a new replica's lead time)."""
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    kv_cache_tokens: int | None = None
    """The KV cache's size in tokens (None: not measured, not checked)."""
    key: dict = field(default_factory=dict)
    """What it was measured on (device, model, quantization): a changed spec invalidates it."""
    grid: tuple[GridPoint, ...] = ()

    def step_seconds(self, batch: float, prefill_tokens: float, context_tokens: float = 0.0) -> float:
        return self.a + self.b * batch + self.c * prefill_tokens + self.d * context_tokens

    def work_per_request(self, prompt: float, output: float) -> float:
        """Seconds of step time one request adds, over its life, beyond the per-step cost a."""
        return self.b * output + self.c * prompt + self.d * output * (prompt + output / 2)

    def predict(self, rate: float, prompt: float, output: float) -> Prediction:
        """One replica's steady state at `rate` requests/s (see the module's docstring)."""
        work = self.work_per_request(prompt, output)
        rho = rate * work
        long_prompt = PROMPT_TAIL * prompt
        chunks = max(1, math.ceil(long_prompt / self.max_num_batched_tokens))
        if rho >= 1.0:
            return Prediction(rho, math.inf, math.inf, math.inf, math.inf, math.inf)
        step = self.a / (1 - rho)
        batch = rate * output * step
        context = batch * (prompt + output / 2)
        own = chunks * self.step_seconds(batch, 0.0, context) + self.c * long_prompt
        wait = QUEUE_FACTOR * (self.c * prompt + step) * rho / (1 - rho)
        return Prediction(rho, step, batch, own + step + wait, step, batch * (prompt + output))

    def to_json(self) -> str:
        body = asdict(self)
        body["grid"] = [asdict(p) for p in self.grid]
        return json.dumps(body, indent=2)

    @classmethod
    def from_json(cls, text: str) -> PerfModel:
        """Raises ValueError (or KeyError, TypeError) for text that is not a model."""
        body = json.loads(text)
        grid = tuple(GridPoint(**p) for p in body.pop("grid", ()))
        model = cls(**body, grid=grid)
        if not all(isinstance(getattr(model, t), (int, float)) and getattr(model, t) >= 0 for t in TERMS) \
                or model.a <= 0:
            raise ValueError("a performance model needs a > 0 and b, c, d >= 0")
        return model


def _solve(matrix: list[list[float]], vector: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting; a column without information solves to 0."""
    n = len(vector)
    rows = [row[:] + [v] for row, v in zip(matrix, vector)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(rows[r][col]))
        rows[col], rows[pivot] = rows[pivot], rows[col]
        if abs(rows[col][col]) < 1e-12:
            rows[col] = [0.0] * (n + 1)
            continue
        for r in range(n):
            if r != col and rows[r][col]:
                factor = rows[r][col] / rows[col][col]
                rows[r] = [x - factor * y for x, y in zip(rows[r], rows[col])]
    return [rows[i][n] / rows[i][i] if rows[i][i] else 0.0 for i in range(n)]


def fit(grid: list[GridPoint]) -> tuple[float, float, float, float]:
    """(a, b, c, d) by least squares over the grid, negative terms clamped to 0 (a step never
    gets faster with more work; a negative slope is measurement noise)."""
    if len(grid) < 2:
        raise ValueError("fitting a step-time model needs at least two measured points")
    features = [(1.0, p.batch, p.prefill_tokens, p.context_tokens) for p in grid]
    normal = [[sum(f[i] * f[j] for f in features) for j in range(4)] for i in range(4)]
    rhs = [sum(f[i] * p.seconds for f, p in zip(features, grid)) for i in range(4)]
    a, b, c, d = _solve(normal, rhs)
    if min(b, c, d) < 0:  # refit without the terms that came out negative
        keep = [i for i, x in enumerate((a, b, c, d)) if i == 0 or x >= 0]
        sub = [[normal[i][j] for j in keep] for i in keep]
        solved = dict(zip(keep, _solve(sub, [rhs[i] for i in keep])))
        a, b, c, d = (max(0.0, solved.get(i, 0.0)) if i else solved[0] for i in range(4))
    return a, b, c, d
