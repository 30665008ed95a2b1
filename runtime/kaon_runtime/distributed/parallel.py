"""One rank's place in its tensor-parallel group and the collectives the model needs.

With a group of one every collective is the identity, so the model code is the same
whether or not it is sharded, and a single-process engine never touches torch.distributed.

Every engine builds its own process groups (`Group`) over its own TCP store, and never
torch.distributed's default group: a process has one default group, so a second engine with
workers (a notebook's next `LLM(..., pipeline_parallel_size=3)` while the last one is still
bound) would fail with "trying to initialize the default process group twice!". Closing the
engine releases its groups, and with them the store's port and the groups' sockets.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from kaon_runtime.distributed.stages import PipelineStage, Placement, stage_of

# A collective waits this long for a peer before failing; steps themselves arrive by pipe,
# so an idle engine never waits in one.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
JOIN_TIMEOUT = datetime.timedelta(minutes=5)  # the ranks reach the store within the start's own deadline


class Group:
    """One engine's process group (gloo on CPU, NCCL between GPUs): a handle the model's layers keep,
    bound once the ranks have met (rank 0 loads its shard before they do) and emptied by `release`,
    so a closed engine's layers no longer hold the store's port or the group's sockets.

    The group is torch's backend object itself (ProcessGroupGloo / ProcessGroupNCCL), called directly:
    torch.distributed's functions would look it up among the default group's. Its ranks are the group's.
    """

    def __init__(self) -> None:
        self._pg: Any = None  # torch's type stubs lack the backends' collectives
        self._store: dist.Store | None = None

    def bind(self, pg: dist.ProcessGroupGloo | dist.ProcessGroupNCCL, store: dist.Store) -> Group:
        self._pg, self._store = pg, store
        return self

    def _backend(self) -> Any:
        if self._pg is None:
            raise RuntimeError("no process group: the ranks have not met yet, or the engine was closed")
        return self._pg

    def all_reduce(self, x: torch.Tensor) -> None:
        """Sum over the ranks, in place."""
        self._backend().allreduce([x]).wait()

    def all_gather(self, parts: list[torch.Tensor], x: torch.Tensor) -> None:
        self._backend().allgather([parts], [x]).wait()

    def isend(self, x: torch.Tensor, dst: int) -> dist.Work:
        return self._backend().send([x], dst, 0)

    def irecv(self, x: torch.Tensor, src: int) -> dist.Work:
        return self._backend().recv([x], src, 0)

    def release(self) -> None:
        pg, self._pg, self._store = self._pg, None, None
        if pg is not None:
            try:
                pg.shutdown()
            except RuntimeError:
                pass  # a backend without shutdown: dropping the last reference closes its sockets


@dataclass(slots=True, frozen=True)
class TensorParallel:
    """This rank in its tensor-parallel group; under pipeline parallelism, also its stage (the
    layers it holds), and `world`, the group of every rank (the stages' point-to-point traffic)."""

    rank: int = 0
    size: int = 1
    stage: PipelineStage = field(default_factory=PipelineStage)
    group: Group | None = field(default=None, compare=False)
    world: Group | None = field(default=None, compare=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's partial result (row-parallel outputs, masked embedding lookups)."""
        if self.size > 1:
            assert self.group is not None, "a group of several ranks has its process group"
            self.group.all_reduce(x)
        return x

    def sum_in_rank_order(self, x: torch.Tensor) -> torch.Tensor:
        """all_reduce's sum, in place, each element added up in rank order ((x0 + x1) + x2 ...) whatever
        x's size: the fused CPU step's row-parallel outputs (batch invariance, models/cpu_decode_step.py).
        gloo's ring all-reduce sums an element in an order set by the chunk of x it falls in, so by x's size:
        at 3 and 4 ranks a row's sum changed with the rows beside it (torch 2.15, every row of 2-300-row
        steps; at 2 ranks a + b = b + a, and none did). So the partials are gathered and added here."""
        if self.size == 1:
            return x
        assert self.group is not None, "a group of several ranks has its process group"
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.group.all_gather(parts, x.contiguous())
        x.copy_(parts[0])
        for part in parts[1:]:
            x.add_(part)  # elementwise: one rounding per element and rank, the same on every rank
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's shard of the last dimension, concatenated in rank order."""
        if self.size == 1:
            return x
        assert self.group is not None, "a group of several ranks has its process group"
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.group.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def release(self) -> None:
        """Close this rank's process groups (the engine's end)."""
        for group in (self.group, self.world):
            if group is not None:
                group.release()


def _new_group(store: dist.Store, prefix: str, rank: int, size: int, device: torch.device,
               into: Group | None = None) -> Group:
    scoped = dist.PrefixStore(prefix, store)
    pg: dist.ProcessGroupGloo | dist.ProcessGroupNCCL
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = COLLECTIVE_TIMEOUT
        pg = dist.ProcessGroupNCCL(scoped, rank, size, options)
    else:
        pg = dist.ProcessGroupGloo(scoped, rank, size, COLLECTIVE_TIMEOUT)
    return (into or Group()).bind(pg, store)


def _store(host: str, port: int, rank: int, size: int) -> dist.Store:
    """The group's rendezvous: rank 0 listens on host:port, the others connect (retrying until it does)."""
    return dist.TCPStore(host, port, size, rank == 0, timeout=JOIN_TIMEOUT)


def join_group(rank: int, size: int, port: int, device: torch.device, group: Group | None = None) -> TensorParallel:
    """Rendezvous with the other ranks on this host: NCCL between GPUs, gloo on CPU. `group`: the
    handle to bind (the one rank 0's model already holds), else a new one."""
    group = _new_group(_store("127.0.0.1", port, rank, size), "tp", rank, size, device, into=group)
    return TensorParallel(rank, size, group=group, world=group)


def join_world(placement: Placement, host: str, port: int, num_layers: int, device: torch.device) -> TensorParallel:
    """Rendezvous with every rank of a PP x TP world (across hosts); this rank's view of it, whose
    collectives run within its stage's group, its point-to-point traffic within the world's."""
    store = _store(host, port, placement.rank, placement.world_size)
    world = _new_group(store, "world", placement.rank, placement.world_size, device)
    # Only this rank's own stage's group: a group built from a store needs no other rank to build the rest.
    own = _new_group(store, f"stage{placement.stage}", placement.tp_rank, placement.tp_size, device)
    return TensorParallel(placement.tp_rank, placement.tp_size,
                          stage_of(num_layers, placement.pp_size, placement.stage), own, world)
