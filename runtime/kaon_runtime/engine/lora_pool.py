"""The adapters a server knows and the fixed pool of slots they run from.

Registering an adapter reads and checks it once (loader.lora_adapter) and keeps its tensors in
host memory; it takes a slot only when a running sequence needs it. Before each step the engine
hands over the adapters of every running sequence (the scheduler keeps them within the slots):
those already in a slot stay, the others take an empty slot or the least recently used one
whose adapter no running sequence needs (SlotTable, the pure policy).

Each registration gets a fresh id, never reused: sequences and the prefix cache key on it, so
an adapter unloaded and loaded again under the same name never meets the K/V of the old one.
An unloaded adapter's weights stay until no request uses them (drop_retired). The server
registers and unloads from its event loop while the engine thread steps: one lock guards the maps.

Under tensor parallelism only rank 0's pool registers adapters and picks slots; the adapters a step
puts in slots travel with its plan (loads_for_plan), and every rank copies its own shard of them
(distributed.lora_sharding) into the same slots.
"""
from __future__ import annotations

import itertools
import threading
from dataclasses import replace

import torch

from kaon_runtime.config import ModelConfig
from kaon_runtime.distributed.lora_sharding import cut_lora
from kaon_runtime.distributed.parallel import TensorParallel
from kaon_runtime.errors import InvalidRequestError, ModelNotFoundError
from kaon_runtime.layers.lora import LoraBatch, LoraLinear
from kaon_runtime.loader.lora_adapter import LoraAdapter, load_adapter


class SlotTable:
    """Which adapter id holds which slot, and when each slot was last used (the LRU policy)."""

    def __init__(self, num_slots: int):
        self.owner: list[int | None] = [None] * num_slots
        self.last_used = [0] * num_slots
        self._clock = itertools.count(1)

    def assign(self, wanted: set[int]) -> tuple[dict[int, int], list[tuple[int, int]]]:
        """Slots for the `wanted` adapter ids: the map id -> slot, and the (slot, id) loads it takes."""
        if len(wanted) > len(self.owner):
            raise ValueError(f"{len(wanted)} adapters wanted at once, {len(self.owner)} slots")
        now = next(self._clock)
        slots = {owner: slot for slot, owner in enumerate(self.owner) if owner in wanted}
        loads = []
        for adapter_id in sorted(wanted - slots.keys()):
            free = [s for s, owner in enumerate(self.owner) if owner is None]
            evictable = [s for s, owner in enumerate(self.owner) if owner is not None and owner not in wanted]
            slot = free[0] if free else min(evictable, key=lambda s: self.last_used[s])
            self.owner[slot] = adapter_id
            slots[adapter_id] = slot
            loads.append((slot, adapter_id))
        for slot in slots.values():
            self.last_used[slot] = now
        return slots, loads

    def forget(self, adapter_id: int) -> None:
        """An unloaded adapter's slot becomes free."""
        self.owner = [None if owner == adapter_id else owner for owner in self.owner]


class LoraPool:
    def __init__(self, model_config: ModelConfig, batch: LoraBatch,
                 targets: dict[tuple[int, str], tuple[LoraLinear, int]], max_loras: int, max_rank: int,
                 tp: TensorParallel = TensorParallel()):
        self.model_config, self.batch, self.targets, self.tp = model_config, batch, targets, tp
        self.max_loras, self.max_rank = max_loras, max_rank
        self.table = SlotTable(max_loras)
        self.by_name: dict[str, int] = {}
        self.adapters: dict[int, LoraAdapter] = {}  # registered, plus unloaded ones running sequences still use
        self.retired: set[int] = set()  # unloaded, perhaps still used by requests
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.num_loads = 0  # adapters copied into a slot (a reload after eviction counts again)
        self._to_share: list[tuple[int, LoraAdapter]] = []  # (slot, adapter) loaded since loads_for_plan

    def add(self, name: str, path: str, source: str | None = None) -> LoraAdapter:
        """Register an adapter read from the directory `path`, listed as coming from `source` (the URI it was
        downloaded from; the operator compares it with spec.adapters) or else `path`; raises AdapterError
        (the reason it does not fit) or InvalidRequestError."""
        if name in self.by_name:
            raise InvalidRequestError(f"the LoRA adapter {name!r} is already loaded")
        adapter = load_adapter(name, path, self.model_config, self.max_rank)
        if source is not None:
            adapter = replace(adapter, path=source)
        with self._lock:
            if name in self.by_name:
                raise InvalidRequestError(f"the LoRA adapter {name!r} is already loaded")
            adapter_id = next(self._ids)
            self.by_name[name] = adapter_id
            self.adapters[adapter_id] = adapter
        return adapter

    def remove(self, name: str) -> None:
        """Unregister an adapter: new requests cannot name it; running ones finish with it."""
        with self._lock:
            if name not in self.by_name:
                raise ModelNotFoundError(f"the LoRA adapter {name!r} is not loaded")
            self.retired.add(self.by_name.pop(name))

    def id_of(self, name: str) -> int:
        with self._lock:
            if name not in self.by_name:
                raise ModelNotFoundError(f"the model {name!r} does not exist")
            return self.by_name[name]

    def listing(self) -> list[tuple[str, str]]:
        """(name, path or source) of every registered adapter."""
        with self._lock:
            return [(name, self.adapters[i].path) for name, i in self.by_name.items()]

    def drop_retired(self, in_use: set[int]) -> None:
        """Free the weights and slots of unloaded adapters no request uses any more."""
        with self._lock:
            for adapter_id in self.retired - in_use:
                del self.adapters[adapter_id]
                self.table.forget(adapter_id)
            self.retired &= in_use

    def prepare(self, running: set[int]) -> dict[int, int]:
        """Put the running sequences' adapters in slots (loading those that are not); return id -> slot."""
        slots, loads = self.table.assign(running)
        for slot, adapter_id in loads:
            with self._lock:
                adapter = self.adapters[adapter_id]
            self.load_weights(slot, adapter.weights)
            if self.tp.size > 1:
                self._to_share.append((slot, adapter))
        return slots

    def loads_for_plan(self) -> list[tuple[int, dict]]:
        """The loads since the last call, as the other ranks receive them: (slot, whole weights as numpy
        arrays, which pickle by value through the workers' pipes, not through shared memory)."""
        loads, self._to_share = self._to_share, []
        return [(slot, {key: (a.numpy(), b.numpy()) for key, (a, b) in adapter.weights.items()})
                for slot, adapter in loads]

    def load_from_plan(self, loads: list[tuple[int, dict]]) -> None:
        """A worker rank's side of loads_for_plan: the same adapters into the same slots."""
        for slot, weights in loads:
            self.load_weights(slot, {key: (torch.from_numpy(a), torch.from_numpy(b))
                                     for key, (a, b) in weights.items()})

    def load_weights(self, slot: int, weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy an adapter's (layer, projection) -> (A, B) into a slot, this rank's shard of each."""
        for (layer, proj), (module, part) in self.targets.items():
            ab = weights.get((layer, proj))
            if ab is not None:
                ab = cut_lora(proj, *ab, self.model_config, self.tp.rank, self.tp.size)
            module.load_slot(slot, part, *(ab if ab is not None else (None, None)))
        self.num_loads += 1

