"""The kv-aware strategy's I/O: one ZMQ subscription to each ready pod's KV events (vLLM's wire
format in either of its event encodings, decoded with vLLM's published types), applied to the index
(kv_index.py), and each service's tokenizer, fetched once from one of its pods (kv_tokens.py).

Every router replica subscribes to every pod itself, so each builds the same index from the same
events. A batch missed (a sequence number skipped) is asked again from the pod's replay socket, and
so is a pod's history from batch 0 when the first batch heard of it is a later one (a replica
started after the engines, or a restart seen late); a pod that restarted (its connection dropped,
its sequence numbers start over, or it says AllBlocksCleared) or left the ready set loses its
entries.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import msgspec
import zmq
import zmq.asyncio

from kaon_operator.router import unawaited
from kaon_operator.router.endpoints import Endpoint, ServiceKey
from kaon_operator.router.kv_index import KvIndex
from kaon_operator.router.kv_tokens import PromptTokenizer

log = logging.getLogger(__name__)

EVENTS_PORT = 5557
REPLAY_PORT = 5558
TOPIC = "kv-events"


# ---- vLLM's two event encodings ---------------------------------------------------------------
# The batch is an array (ts, events, [data_parallel_rank]) in every vLLM release; one line of releases
# sent it as a map, which is read too. Each event is either an array tagged by its first element
# (vLLM before #42892, kaon's default) or a map tagged by its "type" key (vLLM >= 0.24, kaon's "map"). The
# two cannot share one msgspec union, so each event's first byte says which decoder reads it: a batch
# may mix them. Fields not declared here (vLLM adds some most releases) are ignored by both decoders;
# fields a release left out are defaulted.


class _ArrayBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]


class _MapBatch(msgspec.Struct, gc=False):
    ts: float
    events: list[msgspec.Raw]


class _ArrayEvent(msgspec.Struct, array_like=True, gc=False, tag=True):
    pass


class _MapEvent(msgspec.Struct, gc=False):
    pass


class BlockStored(_ArrayEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None


class BlockRemoved(_ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None = None


class AllBlocksCleared(_ArrayEvent, tag="AllBlocksCleared"):
    pass


class MapBlockStored(_MapEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None


class MapBlockRemoved(_MapEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None = None


class MapAllBlocksCleared(_MapEvent, tag="AllBlocksCleared"):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared | MapBlockStored | MapBlockRemoved | MapAllBlocksCleared


class _AllArrays(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class _AllMaps(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[MapBlockStored | MapBlockRemoved | MapAllBlocksCleared]


_ARRAY_EVENT = msgspec.msgpack.Decoder(BlockStored | BlockRemoved | AllBlocksCleared)
_MAP_EVENT = msgspec.msgpack.Decoder(MapBlockStored | MapBlockRemoved | MapAllBlocksCleared)
_ARRAY_BATCH = msgspec.msgpack.Decoder(_ArrayBatch)
_MAP_BATCH = msgspec.msgpack.Decoder(_MapBatch)
# A pod sends one encoding: its batch is decoded whole, in one call, as before (the per-event path alone cost
# 2.2x the CPU: 47 against 21 us for a batch of 32 events); event by event only when that fails.
_WHOLE = (msgspec.msgpack.Decoder(_AllArrays), msgspec.msgpack.Decoder(_AllMaps))


def _is_map(raw: bytes | memoryview) -> bool:
    """msgpack's map markers: fixmap (0x80-0x8f), map 16, map 32."""
    first = raw[0]
    return 0x80 <= first <= 0x8F or first in (0xDE, 0xDF)


def decode(payload: bytes) -> list[Event]:
    """A batch's events, in order, each in whichever encoding it came. An event of a type this router does not
    know (a later vLLM's) is skipped, not the batch: raises msgspec.DecodeError only for a batch it cannot read."""
    if payload and not _is_map(payload):
        for whole in _WHOLE:
            try:
                return list(whole.decode(payload).events)
            except msgspec.ValidationError:
                pass  # a mixed batch, an unknown event type, a map batch: event by event
    batch = (_MAP_BATCH if payload and _is_map(payload) else _ARRAY_BATCH).decode(payload)
    events: list[Event] = []
    for raw in batch.events:
        data = memoryview(raw)
        try:
            events.append((_MAP_EVENT if data and _is_map(data) else _ARRAY_EVENT).decode(data))
        except msgspec.ValidationError as e:
            log.debug("kv-aware: an event skipped (%s)", e)
    return events


def _name(h: bytes | int) -> int:
    """vLLM's hashes are ints or bytes (sha256); the index keys engine hashes by int."""
    return h if isinstance(h, int) else int.from_bytes(h, "big")


def apply(index: KvIndex, pod: str, events: list[Event]) -> None:
    for event in events:
        if isinstance(event, (BlockStored, MapBlockStored)):
            if event.lora_name and not event.lora_id:
                continue  # an adapter's blocks named only by the adapter's name (newer vLLM): not followed either
            parent = None if event.parent_block_hash is None else _name(event.parent_block_hash)
            index.stored(pod, [_name(h) for h in event.block_hashes], parent, event.token_ids, event.block_size,
                         event.lora_id, event.medium, event.extra_keys)
        elif isinstance(event, (BlockRemoved, MapBlockRemoved)):
            index.removed(pod, [_name(h) for h in event.block_hashes], event.medium)
        else:
            index.cleared(pod)


def _host(endpoint: Endpoint) -> str:
    host = urlsplit(endpoint.url).hostname or ""
    return f"[{host}]" if ":" in host else host


class KvFeed:
    def __init__(self, index: KvIndex, events_port: int = EVENTS_PORT, replay_port: int = REPLAY_PORT,
                 ports: Callable[[Endpoint], tuple[int, int]] | None = None):
        """`ports`: a pod's events and replay ports, where they are not the same on every pod (several
        engines on one host: bench/routing.py); by default `events_port` and `replay_port`."""
        self.index = index
        self.ports = ports or (lambda endpoint: (events_port, replay_port))
        self._ctx: zmq.asyncio.Context | None = None
        self._tasks: dict[str, asyncio.Task] = {}
        self._tokenizers: dict[ServiceKey, PromptTokenizer | None] = {}
        self._fetching: dict[ServiceKey, asyncio.Task] = {}

    def follow(self, pods: Iterable[Endpoint]) -> None:
        """Subscribe to the pods not followed yet; stop following (and forget) pods gone. Called in the loop."""
        wanted = {e.pod: e for e in pods}
        for pod in set(self._tasks) - set(wanted):
            self._tasks.pop(pod).cancel()
            self.index.clear(pod)
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        for pod, endpoint in wanted.items():
            if pod not in self._tasks:
                self._tasks[pod] = task = asyncio.get_running_loop().create_task(self._follow(endpoint))
                # A follower that fails stays failed until its pod leaves (the index keeps what it had): said
                # once, now, and not as asyncio's "exception was never retrieved" at some later collection.
                task.add_done_callback(unawaited.log_failure(log, f"kv-aware: following {pod}'s KV events"))

    def tokenizer(self, key: ServiceKey, pods: Iterable[Endpoint]) -> PromptTokenizer | None:
        """The service's tokenizer, or None while it is being fetched (the request goes by prefix-affinity)."""
        found = self._tokenizers.get(key)
        if found is None and key not in self._fetching:
            first = next(iter(pods), None)
            if first is not None:
                self._fetching[key] = task = asyncio.get_running_loop().create_task(self._fetch_tokenizer(key, first))
                task.add_done_callback(unawaited.log_failure(log, f"kv-aware: the tokenizer fetch from {first.pod}"))
        return found

    def forget(self, key: ServiceKey) -> None:
        self._tokenizers.pop(key, None)
        task = self._fetching.pop(key, None)
        if task is not None:
            task.cancel()

    async def _fetch_tokenizer(self, key: ServiceKey, endpoint: Endpoint) -> None:
        try:
            async with aiohttp.ClientSession() as session, session.get(
                    f"{endpoint.url}/kaon/tokenizer", timeout=aiohttp.ClientTimeout(total=30)) as response:
                response.raise_for_status()
                info = await response.json()
            self._tokenizers[key] = await asyncio.to_thread(PromptTokenizer, info)
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as e:
            log.warning("kv-aware: no tokenizer from %s (%s); prefix-affinity until it answers", endpoint.pod, e)
            await asyncio.sleep(5)
        finally:
            self._fetching.pop(key, None)

    async def _follow(self, endpoint: Endpoint) -> None:
        assert self._ctx is not None
        host = _host(endpoint)
        events_port, replay_port = self.ports(endpoint)
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(f"tcp://{host}:{events_port}")
        sub.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
        # The connection to the pod dropping is the one sign of a restart that never misses: a new engine is a new
        # process, so a new connection. Its sequence numbers alone do not tell: a router that hears the new engine
        # first past the old one's last number (the restart took a while, the first batches were lost) took it for
        # a gap, and the replay from there left out the new engine's batch 0 (AllBlocksCleared), so the old life's
        # entries stayed. On a drop the pod is forgotten: its next batch is replayed from 0, whichever life it is.
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        poller = zmq.asyncio.Poller()
        poller.register(monitor, zmq.POLLIN)
        poller.register(sub, zmq.POLLIN)
        try:
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:  # before the batches beside it: they came over the new connection
                    await monitor.recv_multipart()
                    self.index.clear(endpoint.pod)
                    continue
                _, seq_bytes, payload = await sub.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big")
                missed = self.index.sequence(endpoint.pod, seq)
                if missed is not None:
                    await self._replay(f"tcp://{host}:{replay_port}", endpoint.pod, missed, seq)
                try:
                    apply(self.index, endpoint.pod, decode(payload))
                except msgspec.DecodeError as e:
                    log.warning("kv-aware: undecodable KV events from %s (%s)", endpoint.pod, e)
        except asyncio.CancelledError:
            raise
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def _replay(self, address: str, pod: str, missed: int, upto: int) -> None:
        """Ask the pod's replay socket for the batches from `missed` up to (not with) `upto`."""
        assert self._ctx is not None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(address)
        try:
            await dealer.send_multipart((b"", missed.to_bytes(8, "big")))
            while await dealer.poll(500):
                _, seq_bytes, payload = await dealer.recv_multipart()
                if not payload:
                    break
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if missed <= seq < upto:
                    apply(self.index, pod, decode(payload))
        finally:
            dealer.close(linger=0)

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        for task in list(self._tasks.values()) + list(self._fetching.values()):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
