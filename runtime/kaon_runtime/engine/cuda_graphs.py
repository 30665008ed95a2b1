"""Decode steps replayed from CUDA graphs captured once per batch size of a ladder.

A decode step of a small batch launches hundreds of small kernels whose launch cost, not
their work, sets the step time. A CUDA graph records the whole forward pass once and
replays it with one launch. Graphs fix every tensor's address and shape, so the inputs
live in static buffers sized for the largest batch; a batch of n runs the graph of the
smallest captured size >= n, its extra rows padded: slot -1 (nothing written to the
cache) and a context of one key (a harmless read of a valid block). Prefill chunks vary too
much in shape to capture and stay eager.

Without capture (`capture=False`) the same static-buffer path runs eagerly: CPU tests use
it to check the padding and buffer handling the graphs depend on.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from kaon_runtime.engine.step_plan import StepPlan
from kaon_runtime.engine.step_tensors import long_tensor
from kaon_runtime.layers.attention import AttentionMetadata

log = logging.getLogger(__name__)


def ladder(max_batch: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, then every 8 up to max_batch (which is always included).

    Steps of 8 waste at most 7 padded rows, a small share of a step once batches are that big."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch, 8)) + [max_batch]
    return sorted(set(sizes))


def graph_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds num_seqs rows; None when the batch is too big for any."""
    return next((s for s in sizes if s >= num_seqs), None)


def is_decode_only(plan: StepPlan) -> bool:
    return bool(plan.decode_tables) and not plan.prefills


class DecodeGraphs:
    """Static input buffers and one replayable forward pass (model + logits) per ladder size."""

    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
                 device: torch.device, max_blocks_per_seq: int, sizes: list[int], capture: bool):
        self.forward, self.device = forward, device
        self.sizes, self.capture = sizes, capture
        largest = sizes[-1]
        # Token ids, positions, cache slots and context lengths side by side: one copy per step fills them.
        self.rows = torch.tensor([[0], [0], [-1], [1]], device=device).repeat(1, largest)
        self.input_ids, self.positions, self.slots, self.context_lens = self.rows
        self.block_tables = torch.zeros(largest, max_blocks_per_seq, dtype=torch.long, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]] = {}
        self.replays = 0  # decode steps served from a graph (or, without capture, from the static path)

    def fits(self, plan: StepPlan) -> bool:
        return (is_decode_only(plan) and graph_size(len(plan.decode_tables), self.sizes) is not None
                and max(map(len, plan.decode_tables)) <= self.block_tables.shape[1])

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every size, largest first so the smaller graphs reuse its memory pool."""
        if not self.capture:
            return
        pool = None
        for size in reversed(self.sizes):
            self._run_static(size)  # warm-up: Triton compiles, caches fill, nothing new happens while recording
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._run_static(size)
            pool = graph.pool()
            self._graphs[size] = (graph, logits)
        log.info("captured CUDA graphs for decode batches of %s", ", ".join(map(str, self.sizes)))

    @torch.inference_mode()
    def run(self, plan: StepPlan, tables: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the plan's sample rows (a decode-only plan that `fits`); `tables`: its decode tables padded,
        on the CPU, if the caller has them (engine.step_tensors), else built here."""
        size = graph_size(len(plan.decode_tables), self.sizes)
        assert size is not None, "a plan that does not fit the graphs"
        if tables is None:
            tables = long_tensor(plan.padded_decode_tables(), torch.device("cpu"))
        self._load(plan, size, tables)
        graph, logits = self._graphs.get(size, (None, None))
        if graph is None or logits is None:
            logits = self._run_static(size)
        else:
            graph.replay()
        self.replays += 1
        # A copy: the graphs share one memory pool, so the next replay of another size may write over this
        # graph's output. A decode-only plan samples every row in order (one token each, no drafts): its
        # first n rows, a slice, with no index tensor to send to the device.
        n = len(plan.sample_rows)
        if plan.sample_rows == list(range(n)):
            return logits[:n].clone()
        return logits[long_tensor(plan.sample_rows, self.device)]

    def _load(self, plan: StepPlan, size: int, tables: torch.Tensor) -> None:
        """Copy the plan into the static buffers; rows n..size become padding."""
        n = len(plan.decode_tables)
        rows = np.array([[0], [0], [-1], [1]], dtype=np.int64).repeat(size, axis=1)
        rows[0, :n], rows[1, :n], rows[2, :n], rows[3, :n] = (plan.input_ids, plan.positions, plan.slots,
                                                              plan.decode_lens)
        self.rows[:, :size].copy_(torch.from_numpy(rows))
        # Columns past the widest table, and padded rows, keep earlier steps' block ids: valid blocks,
        # masked by the context length (a padded row reads one key of whatever block its first column names).
        self.block_tables[:n, :tables.shape[1]].copy_(tables)

    def _run_static(self, size: int) -> torch.Tensor:
        """The forward pass over the first `size` rows of the static buffers; what a graph records."""
        meta = AttentionMetadata(slot_mapping=self.slots[:size], num_decode_tokens=size,
                                 decode_block_tables=self.block_tables[:size],
                                 decode_context_lens=self.context_lens[:size])
        return self.forward(self.input_ids[:size], self.positions[:size], meta)
