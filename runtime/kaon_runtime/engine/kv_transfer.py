"""Prefill/decode disaggregation, the engine's side: a prompt's K/V read out of one pool and written into another.

A prefill engine (`kaon serve --role prefill`) computes a prompt's K/V as usual (chunked prefill, its own
prefix cache) and, after every step, `KvExports` copies the tokens each watched sequence computed in that
step out of its pool and hands them to the sequence's sink: blocks leave as they are computed, chunk by
chunk, not after the whole prompt. A decode engine receives them (engine/kv_wire.py) into an `ImportedKv`
and `place_imported` writes them into its own blocks, so the sequence joins the scheduler with every
prompt token but the last in the cache: its first step is a one-token step that samples its first token,
with its own sampling, grammar and adapter, exactly as a local prefill would have.

The transfer is token-granular ([start, end) of the prompt), so the two pools need not share a block
size; they share the model's K/V layout (`KvLayout`), which every transfer states and checks.
"""
from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kaon_runtime.engine.block_manager import BlockManager, root_hash
from kaon_runtime.engine.scheduler import ScheduledBatch
from kaon_runtime.engine.sequence import Sequence
from kaon_runtime.sampling import SamplingParams

log = logging.getLogger(__name__)

# Why a decode engine prefilled a prompt itself, after asking: the labels of kaon_kv_transfer_fallbacks_total.
# `busy`: every prefill engine already had its --disagg-max-in-flight transfers (the ask would only queue there).
FALLBACK_REASONS = ("unreachable", "timeout", "garbage", "refused", "evicted", "busy")


@dataclass(frozen=True, slots=True)
class KvLayout:
    """What one token's K/V is, in a pool of shape [layers, 2, kv heads, blocks, block size, head dim]."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch's name without the prefix: "float32", "bfloat16", ...

    @classmethod
    def of_cache(cls, cache: torch.Tensor) -> KvLayout:
        layers, _, heads, _, _, head_dim = cache.shape
        return cls(layers, heads, head_dim, str(cache.dtype).removeprefix("torch."))

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def token_bytes(self) -> int:
        itemsize = torch.empty((), dtype=self.torch_dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    def empty(self, num_tokens: int) -> torch.Tensor:
        """Room for `num_tokens` tokens' K/V: [layers, 2, kv heads, tokens, head dim]."""
        return torch.empty((self.num_layers, 2, self.num_kv_heads, num_tokens, self.head_dim), dtype=self.torch_dtype)


def token_slots(block_table: list[int], block_size: int, start: int, end: int) -> torch.Tensor:
    """The pool slots (block x block size + offset) of a sequence's tokens [start, end)."""
    positions = torch.arange(start, end)
    table = torch.tensor(block_table, dtype=torch.long)
    return table[positions // block_size] * block_size + positions % block_size


def gather_tokens(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """A copy of those slots' K/V, [layers, 2, kv heads, tokens, head dim], on the host.

    One pass, token-major underneath: the result is a view of a contiguous [tokens, layers, 2, kv heads,
    head dim] tensor, which is what the wire carries (kv_wire.token_rows), so sending it copies nothing more."""
    layers, two, heads, blocks, block_size, head_dim = cache.shape
    by_slot = cache.view(layers, two, heads, blocks * block_size, head_dim).permute(3, 0, 1, 2, 4)
    return by_slot[slots.to(cache.device)].to("cpu").permute(1, 2, 3, 0, 4)


def scatter_tokens(cache: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor) -> None:
    """Write tokens' K/V (as gather_tokens returns it) into those slots."""
    layers, two, heads, blocks, block_size, head_dim = cache.shape
    flat = cache.view(layers, two, heads, blocks * block_size, head_dim)
    flat[:, :, :, slots.to(cache.device), :] = kv.to(cache.device)


# ---- the prefill engine's side ---------------------------------------------------------------


@dataclass(slots=True)
class _Watch:
    start: int  # the first token the decode engine asked for (what it lacks)
    end: int  # one past the last: the prompt less its final token, which the decode engine computes
    sink: Callable[[int, torch.Tensor | None], None]  # (first token, K/V) per chunk; (end, None) when done
    sent: int = -1  # tokens handed over so far, from `start`; -1 before the first step


class KvExports:
    """The sequences whose K/V leaves this engine, by request id; `after_step` hands on what each step computed.

    Runs on the engine thread (the pool is only read between steps); a sink must return quickly (it
    queues the chunk for the network)."""

    def __init__(self, cache: Callable[[], torch.Tensor], block_size: int):
        self.cache = cache  # the runner's pool as it is now (a sleeping engine gives it up and makes a new one)
        self.block_size = block_size
        self._watches: dict[str, _Watch] = {}
        self._lock = threading.Lock()  # add() comes from the event loop's thread
        self.sent_tokens = 0

    def __bool__(self) -> bool:
        return bool(self._watches)

    @property
    def layout(self) -> KvLayout:
        return KvLayout.of_cache(self.cache())

    def watch(self, request_id: str, start: int, end: int, sink: Callable[[int, torch.Tensor | None], None]) -> None:
        with self._lock:
            self._watches[request_id] = _Watch(start, end, sink, start)

    def drop(self, request_id: str) -> None:
        """Stop exporting (the request was aborted: the decode engine is gone)."""
        with self._lock:
            self._watches.pop(request_id, None)

    def after_step(self, batch: ScheduledBatch) -> None:
        """Hand each watched sequence's newly computed tokens [sent, computed) to its sink; after the
        scheduler recorded the step (so the counts are the step's) and before the tokens are accepted
        (which may finish the sequence and give its blocks back)."""
        for seq in batch.seqs:
            watch = self._watches.get(seq.request_id)
            if watch is None or seq.index != 0:
                continue
            upto = min(seq.num_computed_tokens, watch.end)
            if upto > watch.sent:
                slots = token_slots(seq.block_table, self.block_size, watch.sent, upto)
                watch.sink(watch.sent, gather_tokens(self.cache(), slots))
                self.sent_tokens += upto - watch.sent
                watch.sent = upto
            if watch.sent >= watch.end:
                watch.sink(watch.end, None)
                self.drop(seq.request_id)


def prefill_params(cache_salt: str | None = None) -> SamplingParams:
    """What a prefill engine runs a transferred prompt with: one greedy token, never kept (the decode
    engine samples the first token itself, with the request's own parameters); the request's cache salt,
    so tenants share cached blocks on the prefill engine no more than on the decode engine."""
    return SamplingParams(max_tokens=1, temperature=0.0, cache_salt=cache_salt)


# ---- the decode engine's side ----------------------------------------------------------------


@dataclass(slots=True)
class KvReservation:
    """Blocks a decode engine holds for a prompt whose K/V is on its way, so each chunk goes into them as it
    arrives (`place`, on the event loop's thread) and no copy of the whole prompt is left for the engine
    thread once the last one is in. Taken and given back on the engine thread (the block manager is its);
    the blocks past the cached prefix are this reservation's alone, so writing them beside a running step,
    which reads and writes only its own sequences' blocks, is safe."""

    holder: Sequence  # owns the blocks until a sequence adopts them (adopt_reserved)
    # The pool they are in, weakly: an engine put to sleep mid-transfer frees it (engine/sleep.py checks that
    # nothing else holds it) and wakes with a new one; adopt_reserved then refuses the blocks.
    cache: weakref.ref[torch.Tensor]
    start: int  # the prompt tokens the prefix cache covered: the transfer starts there
    end: int
    slots: torch.Tensor  # the pool slots of tokens [start, end)
    placed: int  # tokens [start, placed) are in the pool

    def place(self, first: int, kv: torch.Tensor) -> None:
        """Write one received chunk (tokens [first, first + T), as gather_tokens returns it) into its blocks."""
        assert first == self.placed, f"chunk at {first} where {self.placed} was due"
        tokens = kv.shape[3]
        cache = self.cache()
        if cache is not None:  # None: the pool went with a sleep; adoption will refuse these blocks
            scatter_tokens(cache, self.slots[first - self.start:first - self.start + tokens], kv)
        self.placed += tokens


@dataclass(slots=True)
class ImportedKv:
    """A prompt's K/V received from a prefill engine: tokens [start, end) of the prompt, end = its length - 1."""

    start: int
    end: int
    kv: torch.Tensor  # [layers, 2, kv heads, end - start, head dim]
    reservation: KvReservation | None = None  # set: the K/V is in these blocks already


@dataclass(slots=True)
class TransferStats:
    """A decode engine's transfers (on the event loop), read by /metrics; the engine counts `evicted` itself."""

    received_tokens: int = 0
    requests: int = 0
    fallbacks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FALLBACK_REASONS, 0))


def cached_prefix_tokens(bm: BlockManager, token_ids: list[int], lora_id: int, cache_salt: str | None) -> int:
    """Tokens of a prompt this engine's prefix cache holds now (what a decode engine need not ask for).

    Read-only and taken off the engine thread, so only an estimate: `place_imported` checks again when
    the K/V arrives."""
    if not bm.enable_prefix_caching:
        return 0
    probe = Sequence(-1, token_ids, len(token_ids), SamplingParams(cache_salt=cache_salt), lora_id=lora_id)
    parent, bs, covered = root_hash(probe, bm.hasher), bm.block_size, 0
    for i in range((len(token_ids) - 1) // bs):
        tokens = tuple(token_ids[i * bs:(i + 1) * bs])
        h = bm.hasher.chain(parent, tokens)
        block_id = bm._cached.get(h)
        if block_id is None or bm.blocks[block_id].token_ids != tokens:
            break
        covered, parent = covered + bs, h
    return covered


def place_imported(bm: BlockManager, cache: torch.Tensor, seq: Sequence, kv: ImportedKv) -> bool:
    """Give a new sequence its cached prefix and blocks for the whole prompt, and write the received
    K/V past that prefix, so every prompt token but the last is computed; False (nothing held) when
    its cache no longer holds the prefix the transfer starts after, or the pool has no room: it
    prefills itself then."""
    assert not seq.block_table and kv.end == seq.num_tokens - 1
    cached = bm.allocate_prefix(seq)
    if cached < kv.start or not bm.ensure_slots(seq, seq.num_tokens):
        bm.free(seq)
        return False
    slots = token_slots(seq.block_table, bm.block_size, cached, kv.end)
    scatter_tokens(cache, slots, kv.kv[:, :, :, cached - kv.start:])
    seq.num_cached_tokens = cached
    seq.num_computed_tokens = kv.end
    bm.commit(seq)  # its full blocks are in this engine's prefix cache now, as if computed here
    return True


def reserve_blocks(bm: BlockManager, cache: torch.Tensor, token_ids: list[int], params: SamplingParams,
                   lora_id: int) -> KvReservation | None:
    """Blocks for a whole prompt, its cached prefix shared (on the engine thread, before the ask): the transfer
    asks for the tokens past that prefix and `place`s them as they arrive. None: the pool has no room now."""
    holder = Sequence(-1, list(token_ids), len(token_ids), params, lora_id=lora_id)
    cached = bm.allocate_prefix(holder)
    if not bm.ensure_slots(holder, holder.num_tokens):
        bm.free(holder)
        return None
    end = len(token_ids) - 1
    return KvReservation(holder, weakref.ref(cache), cached, end,
                         token_slots(holder.block_table, bm.block_size, cached, end), cached)


def release_reserved(bm: BlockManager, reservation: KvReservation) -> None:
    """Give a reservation's blocks back (the transfer failed, or its request never joined the engine)."""
    bm.free(reservation.holder)
    reservation.holder.block_table, reservation.holder.block_hashes = [], []


def adopt_reserved(bm: BlockManager, cache: torch.Tensor, seq: Sequence, reservation: KvReservation) -> bool:
    """Hand a complete reservation's blocks to the new sequence, so every prompt token but the last is computed
    (as place_imported does at once); False (blocks given back) when it is not complete or the pool changed
    under it: the sequence prefills itself then."""
    assert not seq.block_table and reservation.end == seq.num_tokens - 1
    if reservation.placed != reservation.end or reservation.cache() is not cache:
        release_reserved(bm, reservation)
        return False
    holder = reservation.holder
    seq.block_table, seq.block_hashes = holder.block_table, holder.block_hashes
    holder.block_table, holder.block_hashes = [], []
    seq.num_cached_tokens = reservation.start
    seq.num_computed_tokens = reservation.end
    bm.commit(seq)  # its full blocks are in this engine's prefix cache now, as if computed here
    return True
