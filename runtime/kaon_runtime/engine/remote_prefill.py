"""A decode engine's prefill engines: which prompts go to one, which one, and what happens when it fails.

Per request (as llm-d's and Dynamo's routers decide): a prompt with fewer than `min_prompt_tokens`
tokens that this engine's prefix cache lacks is prefilled here; so are prompts whose every position
is needed here (prompt logprobs, embeddings). Any other goes to the prefill engine with the fewest
transfers in flight, asking only for what this engine's cache lacks. A prefill engine that is down,
slower than `timeout_s`, or answers garbage costs no request: `fetch` returns None, the fallback is
counted by its reason, and the engine prefills the prompt itself.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from kaon_runtime.engine.block_manager import BlockManager
from kaon_runtime.engine.kv_transfer import ImportedKv, KvLayout, TransferStats, cached_prefix_tokens
from kaon_runtime.engine.kv_wire import TransferError, Transport
from kaon_runtime.sampling import SamplingParams

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0


def wants_remote(num_prompt: int, num_cached: int, params: SamplingParams, min_prompt_tokens: int) -> bool:
    """Whether a prompt is worth a transfer: enough of it is missing here, and nothing needs its positions here."""
    if params.prompt_logprobs is not None or params.pooling is not None:
        return False
    return num_prompt - 1 - num_cached >= max(min_prompt_tokens, 1)


@dataclass(slots=True)
class _Peer:
    url: str
    in_flight: int = 0


class RemotePrefill:
    def __init__(self, urls: list[str], transport: Transport, layout: KvLayout, block_manager: BlockManager,
                 min_prompt_tokens: int, timeout_s: float = DEFAULT_TIMEOUT_S):
        if not urls:
            raise ValueError("a decode engine needs at least one prefill URL")
        self.peers = [_Peer(u) for u in urls]
        self.transport = transport
        self.layout = layout
        self.block_manager = block_manager
        self.min_prompt_tokens = min_prompt_tokens
        self.timeout_s = timeout_s
        self.stats = TransferStats()
        self.observe: Callable[[float], None] = lambda seconds: None  # the server's histogram, once it has one
        self.why_not_nixl = ""  # logged beside the transport's name

    async def fetch(self, token_ids: list[int], params: SamplingParams, adapter: str | None,
                    lora_id: int) -> ImportedKv | None:
        """The prompt's K/V past this engine's cached prefix, from a prefill engine; None: prefill it here."""
        cached = cached_prefix_tokens(self.block_manager, token_ids, lora_id, params.cache_salt)
        if not wants_remote(len(token_ids), cached, params, self.min_prompt_tokens):
            return None
        peer = min(self.peers, key=lambda p: p.in_flight)
        ask = {"token_ids": token_ids, "start": cached, "adapter": adapter, "cache_salt": params.cache_salt}
        peer.in_flight += 1
        began = time.perf_counter()
        try:
            kv = await self.transport.fetch(peer.url, ask, self.layout, self.timeout_s)
        except TransferError as exc:
            self.stats.fallbacks[exc.reason] += 1
            log.warning("KV transfer from %s failed (%s: %s); prefilling %d tokens here", peer.url, exc.reason, exc,
                        len(token_ids))
            return None
        finally:
            peer.in_flight -= 1
        seconds = time.perf_counter() - began
        self.stats.requests += 1
        self.stats.received_tokens += kv.end - kv.start
        self.observe(seconds)
        return kv
