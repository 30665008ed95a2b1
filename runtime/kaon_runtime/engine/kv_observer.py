"""The block manager's listener: turns the pool's cached blocks coming and going into KV events
(engine/kv_events.py) and moves them through the tiers below it (engine/kv_tiers.py).

Built by the engine only when `--kv-events-config` enables events or a tier is configured; without
either the block manager has no listener and runs exactly as before.

A LoRA adapter's blocks are announced but never tiered: an adapter's id in the engine is the
order it was loaded in, so the same chain hash could name another adapter's K/V after a restart.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kaon_runtime.config import EngineConfig
from kaon_runtime.engine.block_hash import BUILTIN, BlockHasher
from kaon_runtime.engine.block_manager import Block, BlockManager, cache_salt_key, root_hash
from kaon_runtime.engine.kv_events import (
    MEDIUM_POOL,
    EventPublisher,
    block_removed,
    block_stored,
    parse_kv_events_config,
)
from kaon_runtime.engine.kv_tiers import KVLayout, KVTiers, TierStats, weights_fingerprint
from kaon_runtime.engine.sequence import Sequence
from kaon_runtime.errors import InvalidRequestError


def first_block_keys(seq: Sequence, lora_name: str | None) -> tuple[Any, ...]:
    """What root_hash folds into a sequence's first block, as vLLM's extra_keys name it: the adapter (by name, as
    vLLM, else by id) and the cache salt's key (a digest: the tenant's salt itself is not broadcast)."""
    keys: list[Any] = []
    if seq.lora_id:
        keys.append(lora_name or seq.lora_id)
    if seq.params.cache_salt is not None:
        keys.append(cache_salt_key(seq.params.cache_salt))
    return tuple(keys)


def chained_runs(blocks: list[Block]) -> list[list[Block]]:
    """Split blocks into runs where each block's parent is the block before it (one BlockStored each)."""
    runs: list[list[Block]] = []
    for block in blocks:
        if runs and block.parent_hash == runs[-1][-1].hash:
            runs[-1].append(block)
        else:
            runs.append([block])
    return runs


class KVObserver:
    def __init__(self, block_size: int, publisher: EventPublisher | None, tiers: KVTiers | None,
                 lora_names: Callable[[int], str | None] | None = None, hasher: BlockHasher = BUILTIN):
        """`lora_names`: an adapter's name by its id (the events carry both: vLLM's newer subscribers key by name)."""
        self.block_size = block_size
        self.lora_names = lora_names or (lambda lora_id: None)
        self.publisher = publisher
        self.tiers = tiers
        self.hasher = hasher  # the block manager's: what its chains' first parents are
        self._lora_blocks: set[int] = set()  # hashes of LoRA blocks in the pool: never tiered

    def stored(self, blocks: list[Block], seq: Sequence) -> None:
        if seq.lora_id:
            self._lora_blocks.update(b.hash for b in blocks if b.hash is not None)
        if self.publisher is not None:
            lora_name = self.lora_names(seq.lora_id) if seq.lora_id else None
            root = root_hash(seq, self.hasher)
            for run in chained_runs(blocks):
                tokens = [t for b in run for t in b.token_ids]
                parent, extra = run[0].parent_hash, None
                if root is not None and parent == root:
                    # The first block of an adapter's or a salted chain: announced as vLLM does, with no parent
                    # (vLLM's consumers follow a chain only from null or a block they know) and with what its hash
                    # folds in as extra_keys, which set it apart from the base model's chain of the same tokens.
                    parent, extra = None, [first_block_keys(seq, lora_name)] + [None] * (len(run) - 1)
                self.publisher.emit(block_stored([b.hash for b in run if b.hash is not None], parent, tokens,
                                                 self.block_size, MEDIUM_POOL, seq.lora_id, lora_name, extra))

    def evictable(self, block: Block) -> None:
        if self.tiers is not None and block.hash is not None and block.hash not in self._lora_blocks:
            self.tiers.offload(block.block_id, block.hash, block.parent_hash, block.token_ids)

    def removed(self, block: Block) -> None:
        if self.tiers is not None:
            self.tiers.pool_reuses(block.block_id)
        if block.hash is not None:
            self._lora_blocks.discard(block.hash)
            if self.publisher is not None:
                self.publisher.emit(block_removed([block.hash], MEDIUM_POOL))

    def holds(self, block_hash: int) -> bool:
        return self.tiers is not None and self.tiers.holds(block_hash)

    def restore(self, block_hash: int, parent: int | None, tokens: tuple[int, ...], block_id: int) -> bool:
        return self.tiers is not None and self.tiers.restore(block_hash, parent, tokens, block_id)

    def prefetch(self, block_hashes: list[int]) -> None:
        if self.tiers is not None and block_hashes:
            self.tiers.prefetch(block_hashes)

    def tier_stats(self) -> TierStats | None:
        return None if self.tiers is None else self.tiers.snapshot()

    def close(self) -> None:
        if self.tiers is not None:
            self.tiers.close()
        if self.publisher is not None:
            self.publisher.close()


def check_tier_config(config: EngineConfig) -> None:
    """The tier flags' own checks (EngineConfig calls none of this: it stays a plain record)."""
    tiered = config.kv_offload_bytes > 0 or config.kv_offload_dir is not None
    if config.kv_offload_bytes < 0 or config.kv_offload_dir_bytes < 0:
        raise InvalidRequestError("--kv-offload-bytes and --kv-offload-dir-bytes must be >= 0")
    if config.kv_offload_dir is not None and config.kv_offload_dir_bytes == 0:
        raise InvalidRequestError("--kv-offload-dir needs --kv-offload-dir-bytes (the disk tier's size)")
    if tiered and not config.enable_prefix_caching:
        raise InvalidRequestError("the KV offload tiers hold cached prefixes: they need prefix caching")
    if tiered and (config.tensor_parallel_size > 1 or config.pipeline_parallel_size > 1):
        raise InvalidRequestError("the KV offload tiers hold one process's pool: not supported with tensor or "
                                  "pipeline parallelism yet")


def check_tier_sizes(config: EngineConfig, block_bytes: int) -> None:
    """A tier that cannot hold one of this model's blocks would keep nothing and say nothing (a size taken for
    megabytes): refused, naming the block's size."""
    for flag, size in (("--kv-offload-bytes", config.kv_offload_bytes),
                       ("--kv-offload-dir-bytes", config.kv_offload_dir_bytes if config.kv_offload_dir else 0)):
        if 0 < size < block_bytes:
            raise InvalidRequestError(f"{flag} {size} holds no KV block: one takes {block_bytes} bytes with this "
                                      "model (give the tier at least that, or 0 for none)")


def attach_kv_observer(config: EngineConfig, block_manager: BlockManager, pool: Callable[[], torch.Tensor | None],
                       model_id: str, checkpoint: Path | None = None,
                       lora_names: Callable[[int], str | None] | None = None) -> KVObserver | None:
    """Start what the config asks for (the events publisher, the tiers) and hang it on the block
    manager; None when it asks for neither. `pool` returns the engine's pool now (None: asleep)."""
    check_tier_config(config)
    events = parse_kv_events_config(config.kv_events_config)
    tiered = config.kv_offload_bytes > 0 or config.kv_offload_dir is not None
    if events is None and not tiered:
        return None
    publisher = EventPublisher(events) if events is not None else None
    tiers = None
    if tiered:
        kv_cache = pool()
        assert kv_cache is not None, "the tiers need this process's pool"
        check_tier_sizes(config, kv_cache[:, :, :, 0].numel() * kv_cache.element_size())
        layout = KVLayout(model_id, str(kv_cache.dtype).removeprefix("torch."), config.block_size,
                          tuple(kv_cache[:, :, :, 0].shape),
                          weights_fingerprint(checkpoint, {"quantization": config.quantization, "dtype": config.dtype}),
                          block_manager.hasher.tier_id())
        try:
            tiers = KVTiers(pool, layout, config.kv_offload_bytes, config.kv_offload_dir,
                            config.kv_offload_dir_bytes, emit=publisher.emit if publisher else None)
        except BaseException:
            if publisher is not None:
                publisher.close()
            raise
    observer = KVObserver(config.block_size, publisher, tiers, lora_names, block_manager.hasher)
    block_manager.listener = observer
    return observer
