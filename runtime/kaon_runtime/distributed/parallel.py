"""One rank's place in its tensor-parallel group and the collectives the model needs.

With a group of one every collective is the identity, so the model code is the same
whether or not it is sharded, and a single-process engine never touches torch.distributed.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

# A collective waits this long for a peer before failing; steps themselves arrive by pipe,
# so an idle engine never waits in one.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass(slots=True, frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's partial result (row-parallel outputs, masked embedding lookups)."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's shard of the last dimension, concatenated in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


def join_group(rank: int, size: int, port: int, device: torch.device) -> TensorParallel:
    """Rendezvous with the other ranks on this host: NCCL between GPUs, gloo on CPU."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=COLLECTIVE_TIMEOUT)
    return TensorParallel(rank, size)


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
