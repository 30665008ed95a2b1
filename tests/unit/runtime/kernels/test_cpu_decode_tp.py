"""The fused CPU step's tensor-parallel hook, in one process: a collective that fails inside the C step
(a rank gone) stops the step at that sum and is raised by the caller, not lost in ctypes (whose callbacks
cannot raise) nor followed by the rest of the layers' collectives. Whole ranks:
tests/integration/test_tensor_parallel_step.py."""
from __future__ import annotations

import pytest
import torch
from test_cpu_decode import LENS, TABLES, decode_step, random_model, tiny_config

from kaon_runtime.kernels import cpu_decode

pytestmark = pytest.mark.skipif(cpu_decode.compiler() is None, reason=cpu_decode.NO_COMPILER)


class GoneRanks:
    """A group of two whose collective fails, as gloo's does when a peer has died."""

    size = 2

    def __init__(self) -> None:
        self.calls = 0

    def sum_in_rank_order(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        raise RuntimeError("connection closed by peer")


def test_a_collective_that_fails_inside_the_step_stops_it_and_is_raised():
    config = tiny_config()
    model, cache = random_model(config, blocks=16)
    before = cache.clone()
    step = model.model.cpu_decode
    x, positions, meta = decode_step(config, TABLES, LENS)
    ranks = GoneRanks()
    step.tp, step._built = ranks, None  # (as a rank's step is built: with its group)
    with torch.inference_mode():
        with pytest.raises(RuntimeError, match="connection closed by peer"):
            model.model(x.clone(), positions, meta)
        assert ranks.calls == 1
        assert torch.equal(cache[1], before[1]), "the step stopped at its first sum: the second layer never ran"
        step.tp, step._built = None, None
        model.model(x.clone(), positions, meta)  # the error was raised once, not again by the next step
