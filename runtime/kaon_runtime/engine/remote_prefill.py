"""A decode engine's prefill engines: which prompts go to one, which one, and what happens when it fails.

Per request (as llm-d's and Dynamo's routers decide): a prompt with fewer than `min_prompt_tokens`
tokens that this engine's prefix cache lacks is prefilled here; so are prompts whose every position
is needed here (prompt logprobs, embeddings). Any other goes to the prefill engine with the fewest
transfers in flight, asking only for what this engine's cache lacks. A prefill engine that is down,
slower than `timeout_s`, or answers garbage costs no request: `fetch` returns None, the fallback is
counted by its reason, and the engine prefills the prompt itself.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kaon_runtime.engine.block_manager import BlockManager
from kaon_runtime.engine.kv_transfer import (
    ImportedKv,
    KvLayout,
    KvReservation,
    TransferStats,
    cached_prefix_tokens,
    release_reserved,
    reserve_blocks,
)
from kaon_runtime.engine.kv_wire import TransferError, Transport
from kaon_runtime.sampling import SamplingParams

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0
# Transfers a decode engine keeps in flight to one prefill engine (one computing, one queued behind it).
DEFAULT_MAX_IN_FLIGHT = 2
DEFAULT_STEP_TOKENS = 1024  # the engine's step budget (EngineConfig.max_num_batched_tokens)
# A decode engine's: the prompts it prefills itself (short ones, and any whose transfer failed) go in chunks
# of this many tokens, so a fallback's 1,000-token prefill is four short steps between its streams' decode
# steps, not one long one (measured on one core: ~2 s for 1,000 tokens in one step; bench/disagg.py).
DECODE_STEP_TOKENS = 256
# A prefill engine's: each step's K/V leaves as soon as the step is done (KvExports), so the step is the transfer's
# chunk, and a chunk's move overlaps the next chunk's prefill: only the last chunk's move is left after it.
# `--disagg-chunk-tokens`. Measured (bench/disagg_chunks.py, one core, 1,001 tokens, arms alternating): smaller
# chunks do hide the move (tail 798 -> 120 ms per 1,000 tokens at 256 under load 12), but on this CPU engine a
# step costs a fixed part on top of its tokens (in-process: 256 tokens ~2.0 s, 1,024 ~5.2 s at load 13), so four
# 256-token steps took 1.4-2.1x one 1,024-token step in all: more than the whole move. Hence the engine's usual
# step: a 1,000-token prompt goes in one chunk, a 4,000-token one in four whose moves overlap the prefill.
PREFILL_CHUNK_TOKENS = DEFAULT_STEP_TOKENS


def step_token_budget(explicit: int | None, role: str, prefill_chunk: int = PREFILL_CHUNK_TOKENS) -> int:
    """Tokens one step computes at most: what the user set, else the role's default (a decode engine's steps
    are what its streams wait on, so its local prefills are chunked smaller; a prefill engine's steps are its
    transfers' chunks)."""
    if explicit is not None:
        return explicit
    return {"decode": DECODE_STEP_TOKENS, "prefill": prefill_chunk}.get(role, DEFAULT_STEP_TOKENS)


def wants_remote(num_prompt: int, num_cached: int, params: SamplingParams, min_prompt_tokens: int) -> bool:
    """Whether a prompt is worth a transfer: enough of it is missing here, and nothing needs its positions here."""
    if params.prompt_logprobs is not None or params.pooling is not None:
        return False
    return num_prompt - 1 - num_cached >= max(min_prompt_tokens, 1)


@dataclass(slots=True)
class _Peer:
    url: str
    in_flight: int = 0


def pick_peer(peers: list[_Peer], max_in_flight: int) -> _Peer | None:
    """The prefill engine with the fewest transfers in flight; None when each has `max_in_flight` already.

    A prefill engine runs the prompts it is asked for one after another; an ask beyond the first few only
    queues there, its prompt's first token waiting for every prompt ahead of it and then the deadline
    giving it back to this engine after all (measured: 3 of 7 asks timed out after 30 s each while the queue
    grew). Prefilled here at once instead, in chunks (DECODE_STEP_TOKENS), it costs its own time only."""
    peer = min(peers, key=lambda p: p.in_flight)
    return peer if peer.in_flight < max_in_flight else None


class RemotePrefill:
    def __init__(self, urls: list[str], transport: Transport, layout: KvLayout, block_manager: BlockManager,
                 min_prompt_tokens: int, timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_in_flight: int = DEFAULT_MAX_IN_FLIGHT):
        if not urls:
            raise ValueError("a decode engine needs at least one prefill URL")
        self.peers = [_Peer(u) for u in urls]
        self.transport = transport
        self.layout = layout
        self.block_manager = block_manager
        self.min_prompt_tokens = min_prompt_tokens
        self.timeout_s = timeout_s
        self.max_in_flight = max_in_flight
        self.stats = TransferStats()
        self.observe: Callable[[float], None] = lambda seconds: None  # the server's histogram, once it has one
        self.why_not_nixl = ""  # logged beside the transport's name
        # Runs fn(LLMEngine) on the engine thread (AsyncEngine.call), set by the server: with it the K/V goes into
        # blocks reserved before the ask, chunk by chunk as it arrives; without it (tests of this class alone)
        # into one buffer that place_imported copies into the blocks once the whole prompt is in.
        self.engine_call: Callable[[Callable[[Any], Any]], Awaitable[Any]] | None = None
        self._releases: set[asyncio.Task] = set()

    async def fetch(self, token_ids: list[int], params: SamplingParams, adapter: str | None,
                    lora_id: int) -> ImportedKv | None:
        """The prompt's K/V past this engine's cached prefix, from a prefill engine; None: prefill it here."""
        cached = cached_prefix_tokens(self.block_manager, token_ids, lora_id, params.cache_salt)
        if not wants_remote(len(token_ids), cached, params, self.min_prompt_tokens):
            return None
        peer = pick_peer(self.peers, self.max_in_flight)
        if peer is None:
            self.stats.fallbacks["busy"] += 1
            return None
        peer.in_flight += 1
        began = time.perf_counter()
        reservation: KvReservation | None = None
        try:
            if self.engine_call is not None:
                reservation = await self._reserve(token_ids, params, lora_id)
                if reservation is None:  # no room for its blocks now: the scheduler will find it when there is
                    self.stats.fallbacks["evicted"] += 1
                    return None
                cached = reservation.start  # exact now: the prefix these blocks share
                if not wants_remote(len(token_ids), cached, params, self.min_prompt_tokens):
                    self._release(reservation)
                    return None
            ask = {"token_ids": token_ids, "start": cached, "adapter": adapter, "cache_salt": params.cache_salt}
            placing = {} if reservation is None else {"on_chunk": reservation.place}
            kv = await self.transport.fetch(peer.url, ask, self.layout, self.timeout_s, **placing)
        except TransferError as exc:
            self._release(reservation)
            self.stats.fallbacks[exc.reason] += 1
            log.warning("KV transfer from %s failed (%s: %s); prefilling %d tokens here", peer.url, exc.reason, exc,
                        len(token_ids))
            return None
        except BaseException:  # cancelled (the client went away), or a bug: its blocks go back all the same
            self._release(reservation)
            raise
        finally:
            peer.in_flight -= 1
        kv.reservation = reservation
        seconds = time.perf_counter() - began
        self.stats.requests += 1
        self.stats.received_tokens += kv.end - kv.start
        self.observe(seconds)
        return kv

    async def _reserve(self, token_ids: list[int], params: SamplingParams, lora_id: int) -> KvReservation | None:
        """Blocks for the prompt, taken on the engine thread. Shielded: a request cancelled meanwhile (its client
        went away) must not cancel the engine thread's call half-way; its blocks go back once it is done."""
        assert self.engine_call is not None
        call = asyncio.ensure_future(self.engine_call(
            lambda engine: reserve_blocks(engine.block_manager, engine.runner.kv_cache, token_ids, params, lora_id)))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            call.add_done_callback(lambda done: None if done.cancelled() or done.exception() is not None
                                   else self._release(done.result()))
            raise

    def _release(self, reservation: KvReservation | None) -> None:
        """Give a failed transfer's blocks back on the engine thread, without waiting (a cancelled task cannot)."""
        if reservation is None or self.engine_call is None:
            return
        task = asyncio.ensure_future(self.engine_call(
            lambda engine: release_reserved(engine.block_manager, reservation)))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)
        task.add_done_callback(_log_failed_release)  # nobody awaits it: else "exception was never retrieved"


def _log_failed_release(task: asyncio.Future) -> None:
    """A release nobody awaits (the engine stopped, or the blocks' release raised): its error retrieved and
    logged as a warning, not left for asyncio to report at error level when the task is collected."""
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.warning("a failed K/V transfer's blocks were not given back: %r", exc)
