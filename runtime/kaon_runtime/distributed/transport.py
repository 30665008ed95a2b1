"""What travels between pipeline stages, behind one small interface over torch.distributed's
point-to-point send and recv: gloo on CPU, NCCL between GPUs, by the same code.

Every rank of a stage holds the whole (hidden, residual) pair after its all-reduces, so rank t of
stage s sends it to rank t of stage s + 1 (the pairs run side by side). The last stage's TP rank 0
sends the logits of the step's sample rows back to the leader (rank 0), which samples. Shapes are
never sent: every rank has the step's plan, so it knows how many tokens and rows to expect. On CPU the pairs
travel in float32 at least (stage_dtype), as the fused C step computes them.

Several micro-batches may be in the pipeline at once, so nothing here blocks a stage on its
neighbour: activations leave by `isend` (the buffer kept until it is delivered) and the leader posts
the receive of a micro-batch's logits as soon as its own stage is done, collecting them later
(`PendingLogits`). Every pair of ranks delivers in the order it posted, which is the micro-batches' order.
"""
from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from kaon_runtime.distributed.parallel import Group
from kaon_runtime.distributed.stages import Placement


class PendingLogits:
    """Logits on their way back from the last stage; `wait` blocks until they are here."""

    def __init__(self, work: dist.Work, logits: torch.Tensor):
        self._work, self._logits = work, logits

    def wait(self) -> torch.Tensor:
        self._work.wait()
        return self._logits


def stage_dtype(model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """What the (hidden, residual) pairs travel in: on CPU at least float32, for the fused C step keeps a stage's
    residual stream in float32 and the next stage reads it on exactly (models/decoder.py, DecoderModel._fused),
    so a stage boundary rounds nothing (torch's float16/bfloat16 path widens and narrows its pair exactly); on
    GPUs the model's dtype (no C step there, and the bytes matter more)."""
    return torch.promote_types(model_dtype, torch.float32) if device.type == "cpu" else model_dtype


# Sends not yet known delivered, kept (with their buffers) until they are: enough for a pipeline's depth.
MAX_UNCONFIRMED_SENDS = 4


class StageTransport:
    def __init__(self, placement: Placement, world: Group, hidden_size: int, vocab_size: int, dtype: torch.dtype,
                 device: torch.device):
        """`world`: the engine's group of every rank (point-to-point ranks are world ranks)."""
        self.placement, self.world = placement, world
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.dtype, self.device = dtype, device
        self._sending: deque[tuple[dist.Work, torch.Tensor]] = deque()

    @property
    def is_leader(self) -> bool:
        return self.placement.rank == 0

    def send_activations(self, pair: tuple[torch.Tensor, torch.Tensor]) -> None:
        """This stage's (hidden, residual), one tensor, to the next stage's peer, without waiting for it
        to be received (the next stage may still be busy with the micro-batch before)."""
        stacked = torch.stack([part.to(self.dtype) for part in pair]).contiguous()
        work = self.world.isend(stacked, self.placement.peer(self.placement.stage + 1))
        self._sending.append((work, stacked))
        while len(self._sending) > MAX_UNCONFIRMED_SENDS:
            self._sending.popleft()[0].wait()

    def recv_activations(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        pair = torch.empty((2, num_tokens, self.hidden_size), dtype=self.dtype, device=self.device)
        self.world.irecv(pair, self.placement.peer(self.placement.stage - 1)).wait()
        return pair[0], pair[1]

    def send_logits(self, logits: torch.Tensor) -> None:
        """From the last stage's TP rank 0 to the leader; the other ranks of that stage send nothing."""
        if self.placement.tp_rank == 0:
            self.world.isend(logits.contiguous(), 0).wait()

    def recv_logits(self, num_rows: int) -> PendingLogits:
        """Post the receive of a micro-batch's logits now; they are collected by `wait`."""
        logits = torch.empty((num_rows, self.vocab_size), dtype=torch.float32, device=self.device)
        work = self.world.irecv(logits, (self.placement.pp_size - 1) * self.placement.tp_size)
        return PendingLogits(work, logits)
