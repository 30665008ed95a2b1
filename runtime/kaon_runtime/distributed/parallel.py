"""One rank's place in its tensor-parallel group and the collectives the model needs.

With a group of one every collective is the identity, so the model code is the same
whether or not it is sharded, and a single-process engine never touches torch.distributed.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from kaon_runtime.distributed.stages import PipelineStage, Placement, stage_of

# A collective waits this long for a peer before failing; steps themselves arrive by pipe,
# so an idle engine never waits in one.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass(slots=True, frozen=True)
class TensorParallel:
    """This rank in its tensor-parallel group; under pipeline parallelism, also its stage (the
    layers it holds) and the stage's own process group (None: the whole world is the group)."""

    rank: int = 0
    size: int = 1
    stage: PipelineStage = field(default_factory=PipelineStage)
    group: dist.ProcessGroup | None = field(default=None, compare=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's partial result (row-parallel outputs, masked embedding lookups)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's shard of the last dimension, concatenated in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


def join_group(rank: int, size: int, port: int, device: torch.device) -> TensorParallel:
    """Rendezvous with the other ranks on this host: NCCL between GPUs, gloo on CPU."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=COLLECTIVE_TIMEOUT)
    return TensorParallel(rank, size)


def join_world(placement: Placement, init_method: str, num_layers: int, device: torch.device) -> TensorParallel:
    """Rendezvous with every rank of a PP x TP world (across hosts); this rank's view of it, whose
    collectives run within its stage's group."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=placement.rank,
                            world_size=placement.world_size, timeout=COLLECTIVE_TIMEOUT)
    # Every rank creates every stage's group, in the same order (torch.distributed requires it).
    groups = [dist.new_group(placement.stage_ranks(s)) for s in range(placement.pp_size)]
    own = groups[placement.stage]
    assert isinstance(own, dist.ProcessGroup), "a rank is a member of its own stage's group"
    return TensorParallel(placement.tp_rank, placement.tp_size,
                          stage_of(num_layers, placement.pp_size, placement.stage), own)


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
