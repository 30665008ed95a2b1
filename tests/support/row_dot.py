"""Triton's interpreter with a tl.dot that computes every row alike, as a GPU's matrix units do.

The batch-invariance tests of the Triton kernels (issue 49 §2) run in Triton's interpreter on a CPU.
Its tl.dot is one numpy matmul (OpenBLAS), whose microkernel sums a row's products in an order set by
the row's place in the tile: measured on this repository's CPU (OpenBLAS 0.3.31, Haswell kernels),
of a 64-row float32 tile, a row moved to row 0 changed its bits at 40 of 64 places (rows 6-11, 18-23, ...
of each 12), while its bits never moved with the other rows' values. A GPU's MMA instructions compute
every row of a tile with the same adder tree, so a kernel that is invariant there would fail here for
the interpreter's own reason. `row_dot` makes each row one matmul of its own, the same call whatever
its place: what the tests then prove is that the kernels' tiles, loop bounds, masks and reduction
orders give a row the same bits whatever the step, given a dot whose rows do not depend on each other.
That last assumption is the GPU's, and only a GPU lease checks it (bench/gpu/engine_check.py check 5).
"""
from __future__ import annotations

import numpy as np
import pytest


def _rowwise_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle, _convert_float
    a_data, b_data = a.data, b.data
    if (a.dtype.primitive_bitwidth == 8 and a.dtype.is_floating()) or \
       (b.dtype.primitive_bitwidth == 8 and b.dtype.is_floating()):
        a_data = _convert_float(a_data, a.dtype, tl.float16, None).view(np.float16)
        b_data = _convert_float(b_data, b.dtype, tl.float16, None).view(np.float16)
    rows = [np.matmul(a_data[..., r:r + 1, :], b_data, dtype=d.data.dtype) for r in range(a_data.shape[-2])]
    return TensorHandle(np.concatenate(rows, axis=-2) + d.data, d.dtype.scalar)


@pytest.fixture
def row_dot(monkeypatch):
    """Triton's interpreter with _rowwise_dot (nothing to do on a GPU: the compiled dot is the hardware's)."""
    import torch
    if torch.cuda.is_available():
        return False
    from triton.runtime.interpreter import InterpreterBuilder
    monkeypatch.setattr(InterpreterBuilder, "create_dot", _rowwise_dot)
    return True
