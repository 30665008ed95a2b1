"""The token embedding and the vocabulary head, split by vocabulary range across tensor-parallel ranks.

A rank holds the rows of its contiguous range of token ids. A lookup zeroes the ids
outside it and the ranks' results are summed; the head computes the logits of its range
and the ranges are gathered. With one rank both are the plain operations.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from kaon_runtime.distributed.parallel import TensorParallel
from kaon_runtime.distributed.sharding import vocab_range
from kaon_runtime.kernels import cpu_decode, cpu_f64
from kaon_runtime.layers import rows_alone


def _masked_ids(input_ids: torch.Tensor, start: int, shard: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids relative to this rank's range (clamped into it) and whether each falls inside."""
    local = input_ids - start
    inside = (local >= 0) & (local < shard)
    return local.clamp(0, shard - 1), inside


class VocabEmbedding(nn.Module):
    """nn.Embedding over this rank's vocabulary range, weight [shard, hidden]."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = TensorParallel()):
        super().__init__()
        self.tp = tp
        self.start, shard = vocab_range(vocab_size, tp.rank, tp.size)
        self.weight = nn.Parameter(torch.empty(shard, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local, inside = _masked_ids(input_ids, self.start, self.weight.shape[0])
        return self.tp.all_reduce(F.embedding(local, self.weight) * inside[:, None])


class VocabHead(nn.Module):
    """The output projection, stored [hidden, vocab shard].

    x @ W in this layout streams W row by row, which CPU BLAS runs about 1.5x faster than
    x @ W.T for the one-row products of batch-1 decode, and GPUs do not mind. With tied
    embeddings the token lookup reads the same tensor column-wise, so nothing is duplicated.

    `quantized` (set by quant.surgery under --quantization) is a narrow-weight linear [vocab
    shard, hidden] that computes the logits in place of weight_t; the token lookup keeps
    reading weight_t in full precision, unless drop_float_table() points it at `quantized`.

    With `cpu_logits_rows` (the fused CPU decode step is on), every row goes through the step's C
    kernel (kernels.cpu_decode), that many at a time: torch's own threads would contend with the
    step's between one token and the next, and its GEMM's sums change with the row count.

    With `invariant` (the GPU's batch-invariant kernels, layers/kernel_backend.py) the float table's logits
    come from kernels/invariant_gemm.py, whose sums do not change with the row count either; a quantized
    head is marked by quant/invariant.py.

    With `rows_alone` (a float64 model on CPU, layers/rows_alone.py) the float table's logits come from the float64
    GEMM that sums each output of a row in one order (kernels/cpu_f64.py), for the same reason.
    """

    def __init__(self, hidden_size: int, vocab_size: int, tp: TensorParallel = TensorParallel(),
                 cpu_logits_rows: int = 0, invariant: bool = False, rows_alone: bool = False):
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        self.start, self.shard = vocab_range(vocab_size, tp.rank, tp.size)
        self.weight_t = nn.Parameter(torch.empty(hidden_size, self.shard))
        self.lookup_dtype = torch.float32  # the token lookup's, once drop_float_table has run
        self.quantized: nn.Module | None = None
        self.cpu_logits_rows = cpu_logits_rows
        self.invariant = invariant
        self.rows_alone = rows_alone
        self._cpu_weights: tuple[object, cpu_decode.LinearWeights] | None = None  # (the weight it reads, its struct)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.cpu_logits_rows and hidden.shape[0] and hidden.device.type == "cpu":
            # Every row through the C kernel, in pieces: a row's logits do not depend on how many
            # rows share the call (batch invariance, models/cpu_decode_step.py), as torch's GEMM's would.
            weights, step = self.cpu_weights(), self.cpu_logits_rows
            logits = torch.cat([cpu_decode.linear(weights, hidden[i:i + step])
                                for i in range(0, hidden.shape[0], step)])
        elif self.quantized is not None:
            logits = self.quantized(hidden)
        elif self.rows_alone and self.weight_t.dtype == torch.float64 and rows_alone.applies(hidden):
            logits = cpu_f64.linear(hidden, self.weight_t, transposed=True)
        elif self.invariant:
            from kaon_runtime.kernels import invariant_gemm  # on use: CPU-only torch builds lack Triton
            logits = invariant_gemm.linear(hidden, self.weight_t.t())
        else:
            logits = hidden @ self.weight_t
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather_last(logits)[:, :self.vocab_size]  # padding rows dropped

    def cpu_weights(self) -> cpu_decode.LinearWeights:
        """The head as the C kernel reads it: its int8 copy under quantization, else the float one
        in its [hidden, vocab] layout. Made on first use, after loading and quantization."""
        source = self.quantized if self.quantized is not None else self.weight_t
        if self._cpu_weights is None or self._cpu_weights[0] is not source or self._cpu_weights[1].stale():
            if self.quantized is None:
                weights = cpu_decode.LinearWeights.f32_t(self.weight_t)
            else:  # quant.surgery gives the head an int8 copy under every method
                head: Any = self.quantized
                # already in the kernel's layout (tied tables; an int8 head once hold_kernel_layout has run),
                # re-pointed at its buffers as they are now (sleep level 2 swaps their storage)
                held = getattr(head, "kernel_weights", None)
                weights = held.rebound() if held is not None else cpu_decode.LinearWeights.int8(head.qweight,
                                                                                                 head.scales)
            self._cpu_weights = source, weights
        return self._cpu_weights[1]

    def forget_cpu_weights(self) -> None:
        """Drop the C kernel's struct of the head (a sleep frees the weights: its copy, or the storage it shares
        with weight_t, would otherwise stay alive); cpu_weights makes it again on next use."""
        self._cpu_weights = None

    def hold_kernel_layout(self) -> bool:
        """Whether the quantized head now holds only the C kernel's layout (quant/kernel_layout.py: an int8 head
        gives up its own [vocab, hidden] table for the interleaved copy its logits read; a tied lookup reads that
        too). Only where every row goes through the C kernel (cpu_logits_rows)."""
        hold = getattr(self.quantized, "hold_kernel_layout", None)
        if not self.cpu_logits_rows or hold is None or hold() is None:
            return False
        self._cpu_weights = None
        return True

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            rows = self._rows(input_ids)
        else:
            local, inside = _masked_ids(input_ids, self.start, self.shard)
            rows = self.tp.all_reduce(self._rows(local) * inside[:, None])
        # rows_alone: row-major, as an untied embedding's rows are. The lookup's [T, hidden] view of the [hidden, vocab]
        # table has its hidden dim strided by T, and torch's norm then sums each row vectorized across the rows, in an
        # order that moved with the step's row count (a float64 row's bits did; layers/rows_alone.py)
        return rows.contiguous() if self.rows_alone else rows

    def drop_float_table(self) -> None:
        """From now on the token lookup reads the rows of `quantized` (tied embeddings under
        quantization: the float table would be the model's largest tensor, kept for lookups only)."""
        assert self.quantized is not None and hasattr(self.quantized, "rows")
        self.lookup_dtype = self.weight_t.dtype
        self.register_parameter("weight_t", None)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.weight_t is None:
            quantized: Any = self.quantized
            return quantized.rows(ids).to(self.lookup_dtype)
        return self.weight_t.index_select(1, ids).t()
