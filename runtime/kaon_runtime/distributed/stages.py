"""Pipeline parallelism's pure decisions: which layers each stage holds and where every rank sits.

The world is PP x TP ranks, numbered stage-major: stage s holds ranks s*TP .. s*TP+TP-1, and the
ranks of one stage shard its layers by tensor parallelism exactly as a single-stage engine does.
Rank 0 (stage 0, TP rank 0) is the leader: it keeps the scheduler and samples. Layers are split into
contiguous stages; when PP does not divide them the first stages take one more each (the last stage
also carries the final norm and the head, so it should not be the widest).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class PipelineStage:
    """One stage of the pipeline: its index among `size`, its layers [start, end) of `num_layers`.
    The default is the whole model (no pipeline)."""

    index: int = 0
    size: int = 1
    start: int = 0
    end: int | None = None  # None: to the last layer

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.size - 1

    def layers(self, num_layers: int) -> range:
        return range(self.start, num_layers if self.end is None else self.end)


def split_layers(num_layers: int, pp_size: int) -> list[range]:
    """Contiguous layer ranges, one per stage, sizes differing by at most one (earlier stages larger)."""
    if pp_size < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1, got {pp_size}")
    if num_layers < pp_size:
        raise ValueError(f"pipeline_parallel_size {pp_size} exceeds the model's {num_layers} layers")
    base, extra = divmod(num_layers, pp_size)
    bounds = [0]
    for s in range(pp_size):
        bounds.append(bounds[-1] + base + (s < extra))
    return [range(bounds[s], bounds[s + 1]) for s in range(pp_size)]


def stage_of(num_layers: int, pp_size: int, index: int) -> PipelineStage:
    if pp_size == 1:
        return PipelineStage()
    span = split_layers(num_layers, pp_size)[index]
    return PipelineStage(index, pp_size, span.start, span.stop)


@dataclass(slots=True, frozen=True)
class Placement:
    """Where global rank `rank` sits in a PP x TP world."""

    rank: int
    tp_size: int
    pp_size: int

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def stage(self) -> int:
        return self.rank // self.tp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    def peer(self, stage: int) -> int:
        """The rank with this rank's TP position in `stage`: activations go between such pairs."""
        return stage * self.tp_size + self.tp_rank

    def stage_ranks(self, stage: int) -> list[int]:
        return list(range(stage * self.tp_size, (stage + 1) * self.tp_size))


def ranks_of_host(world_size: int, num_hosts: int, host: int) -> range:
    """The global ranks host `host` (LWS's worker index; 0: the leader) runs: an equal contiguous share."""
    if world_size % num_hosts:
        raise ValueError(f"a group of {num_hosts} hosts cannot share {world_size} ranks (PP x TP) equally")
    per_host = world_size // num_hosts
    return range(host * per_host, (host + 1) * per_host)
