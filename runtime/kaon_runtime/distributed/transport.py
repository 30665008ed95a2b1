"""What travels between pipeline stages, behind one small interface over torch.distributed's
point-to-point send and recv: gloo on CPU, NCCL between GPUs, by the same code.

Every rank of a stage holds the whole (hidden, residual) pair after its all-reduces, so rank t of
stage s sends it to rank t of stage s + 1 (the pairs run side by side). The last stage's TP rank 0
sends the logits of the step's sample rows back to the leader (rank 0), which samples. Shapes are
never sent: every rank has the step's plan, so it knows how many tokens and rows to expect.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from kaon_runtime.distributed.stages import Placement


class StageTransport:
    def __init__(self, placement: Placement, hidden_size: int, vocab_size: int, dtype: torch.dtype,
                 device: torch.device):
        self.placement = placement
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.dtype, self.device = dtype, device

    @property
    def is_leader(self) -> bool:
        return self.placement.rank == 0

    def send_activations(self, pair: tuple[torch.Tensor, torch.Tensor]) -> None:
        """This stage's (hidden, residual), one tensor, to the next stage's peer."""
        dist.send(torch.stack(pair).contiguous(), dst=self.placement.peer(self.placement.stage + 1))

    def recv_activations(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        pair = torch.empty((2, num_tokens, self.hidden_size), dtype=self.dtype, device=self.device)
        dist.recv(pair, src=self.placement.peer(self.placement.stage - 1))
        return pair[0], pair[1]

    def send_logits(self, logits: torch.Tensor) -> None:
        """From the last stage's TP rank 0 to the leader; the other ranks of that stage send nothing."""
        if self.placement.tp_rank == 0:
            dist.send(logits.contiguous(), dst=0)

    def recv_logits(self, num_rows: int) -> torch.Tensor:
        logits = torch.empty((num_rows, self.vocab_size), dtype=torch.float32, device=self.device)
        dist.recv(logits, src=(self.placement.pp_size - 1) * self.placement.tp_size)
        return logits
