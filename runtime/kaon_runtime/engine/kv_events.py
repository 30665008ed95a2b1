"""KV cache events in vLLM's wire format (`--kv-events-config`), so that KV-aware routers written
for vLLM (llm-d's precise prefix-cache scorer, Dynamo's KV router, kaon's own `kv-aware` strategy)
read a kaon engine unchanged.

The wire format is vLLM's (vllm/distributed/kv_events.py and its example subscriber): each ZMQ
PUB message is three frames, (topic, sequence number as 8 big-endian bytes, msgpack payload), the
payload an `EventBatch` (an array: time, events) of `BlockStored`, `BlockRemoved` and
`AllBlocksCleared`. vLLM has encoded its events two ways: as arrays tagged by the class name first
(before vLLM #42892, ~0.24; kaon's default, `"encoding": "array"`) and as maps tagged by a "type" key
with BlockStored's newer fields (`"encoding": "map"`, what vLLM's newest subscribers decode; its
`lora_name` has no default there, so it is always sent). Events are built as the array structs and
turned into the map ones as a batch is encoded. A ROUTER socket at `replay_endpoint`
answers a request carrying a start sequence number with every buffered batch from there on, then an
end marker (sequence -1, empty payload). The structs are our own definitions with vLLM's field order
and options; a test decodes them with types written from vLLM's published ones.

Media: "GPU" for the engine's pool (vLLM's name for the device tier, on any device), "CPU" for the
host-memory tier and "DISK" for the disk tier (engine/kv_tiers.py).

Events are queued from the engine thread (and the tier's mover thread) and sent by one publisher
thread, which batches whatever has arrived: the engine loop never waits on a socket.

Why one module just past 300 lines: the structs of both encodings, the config and the publisher are one
wire contract, read together against vLLM's.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import json
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgspec
import pydantic

from kaon_runtime.engine.block_hash import event_hash
from kaon_runtime.errors import InvalidRequestError

log = logging.getLogger(__name__)

MEDIUM_POOL, MEDIUM_HOST, MEDIUM_DISK = "GPU", "CPU", "DISK"
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """One change to what a medium holds."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    # The adapter's name: the array encoding sends it only for an adapter's blocks (a trailing field older
    # subscribers ignore), the map encoding always (vLLM's newest struct requires it).
    lora_name: str | None = None
    # vLLM's extra_keys: one entry per block, what its hash folds in besides its parent and tokens (an adapter's
    # name, a cache salt's key), None where nothing. Sent only for a chain that starts with such a block: its first
    # block has no parent (as in vLLM), and a subscriber tells it from the base model's chain by these.
    extra_keys: list[tuple[Any, ...] | None] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def block_stored(block_hashes: list[int], parent: int | None, tokens: tuple[int, ...] | list[int], block_size: int,
                 medium: str, lora_id: int = 0, lora_name: str | None = None,
                 extra_keys: list[tuple[Any, ...] | None] | None = None) -> BlockStored:
    """A run of chained blocks (each the parent of the next) newly held by `medium`; lora_id 0: the base model."""
    return BlockStored(block_hashes=[event_hash(h) for h in block_hashes],
                       parent_block_hash=None if parent is None else event_hash(parent), token_ids=list(tokens),
                       block_size=block_size, lora_id=lora_id or None, medium=medium,
                       lora_name=lora_name if lora_id else None, extra_keys=extra_keys)


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# ---- the map encoding (vLLM >= 0.24): the same events as maps tagged by "type" -------------------------------

class MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class MapBlockStored(MapEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None  # no default: always on the wire, as vLLM's newest decoder requires
    extra_keys: list[tuple[Any, ...] | None] | None = None


class MapBlockRemoved(MapEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class MapAllBlocksCleared(MapEvent, tag="AllBlocksCleared"):
    pass


def as_map(event: KVEvent) -> MapEvent:
    if isinstance(event, BlockStored):
        return MapBlockStored(event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size,
                              event.lora_id, event.medium, event.lora_name, event.extra_keys)
    if isinstance(event, BlockRemoved):
        return MapBlockRemoved(event.block_hashes, event.medium)
    return MapAllBlocksCleared()


def block_removed(block_hashes: list[int], medium: str) -> BlockRemoved:
    """Blocks `medium` no longer holds, their hashes as block_stored announced them."""
    return BlockRemoved(block_hashes=[event_hash(h) for h in block_hashes], medium=medium)


ENCODINGS = ("array", "map")


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig, the fields kaon reads (others are accepted and ignored, as vLLM's are optional)."""

    enable_kv_cache_events: bool = False
    # "zmq" or "null"; None, as in vLLM: "zmq" when events are enabled, else "null" (vLLM's __post_init__), so
    # '{"enable_kv_cache_events": true}' alone publishes, as it does on vLLM.
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark
    topic: str = ""
    # kaon's one key of its own: how each event is encoded (ENCODINGS). "array" is what the and older
    # vLLM's subscribers (and llm-d, Dynamo: they read both) decode; "map" what vLLM >= 0.24's types decode.
    encoding: str = "array"

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


_CONFIG = pydantic.TypeAdapter(KVEventsConfig)


def parse_kv_events_config(text: str | dict | None) -> KVEventsConfig | None:
    """`--kv-events-config`'s JSON as a config; None when absent or not enabled. Raises InvalidRequestError."""
    if text is None:
        return None
    try:
        raw = json.loads(text) if isinstance(text, str) else dict(text)
    except json.JSONDecodeError as e:
        raise InvalidRequestError(f"--kv-events-config is not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise InvalidRequestError("--kv-events-config must be a JSON object")
    known = {f: raw[f] for f in KVEventsConfig.__dataclass_fields__ if f in raw}
    # Checked as vLLM's own config (a pydantic dataclass) checks it: what vLLM takes ("true" for true, "100" for
    # 100) kaon takes; a wrong type is a clear error (it failed later: a traceback at start, or no events at all).
    try:
        config = _CONFIG.validate_python(known)
    except pydantic.ValidationError as e:
        error = e.errors()[0]
        raise InvalidRequestError(f"--kv-events-config: {'.'.join(map(str, error['loc']))}: {error['msg']}, "
                                  f"got {error['input']!r}") from None
    if config.publisher is None:
        config = dataclasses.replace(config, publisher="zmq" if config.enable_kv_cache_events else "null")
    if config.publisher not in ("zmq", "null"):
        raise InvalidRequestError(f"--kv-events-config: publisher must be 'zmq' or 'null', got {config.publisher!r}")
    if config.encoding not in ENCODINGS:
        raise InvalidRequestError(f"--kv-events-config: encoding must be 'array' (vLLM before 0.24, the default) or "
                                  f"'map' (vLLM 0.24 and later), got {config.encoding!r}")
    for name in ("buffer_steps", "hwm"):
        if getattr(config, name) < 1:
            raise InvalidRequestError(f"--kv-events-config: {name} must be a positive integer")
    return config if config.enabled else None


def publisher_binds(endpoint: str) -> bool | None:
    """Whether the PUB socket binds `endpoint` (True), connects to it (False), or binds it if it is one of this
    machine's addresses (None: an IP address). vLLM's rule first: bind "*", "::", ipc:// and inproc://."""
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        return True
    host = endpoint.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False  # a host name: a subscriber's address, connected to as vLLM does
    return None


class EventPublisher:
    """One ZMQ PUB socket (and the replay ROUTER socket), driven by its own thread."""

    def __init__(self, config: KVEventsConfig):
        import zmq  # only an engine that publishes needs it loaded

        self.config = config
        self._queue: queue.Queue[KVEvent | None] = queue.Queue()
        self._encoder = msgspec.msgpack.Encoder()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._attach(self._pub, config.endpoint)
        self._replay = None
        if config.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._bind(self._replay, config.replay_endpoint)
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        # A restarted engine holds nothing: subscribers that knew its previous life drop what they had.
        self.emit(AllBlocksCleared())

    def _attach(self, socket, endpoint: str) -> None:
        """Bind or connect the PUB socket as vLLM does, so that a config written for vLLM works unchanged: bind a
        wildcard (`tcp://*:5557`, `::`), ipc:// or inproc://; connect to a host name (llm-d's central mode has every
        engine connect to its scheduler's bound SUB socket, `tcp://<scheduler service>:5556`). One addition: an IP
        address of this machine is bound (several engines on one host, each on its own address: e2e/pod_runner.py),
        any other IP address is connected to, as vLLM would."""
        import zmq

        binds = publisher_binds(endpoint)
        try:
            if binds is not False:
                try:
                    socket.bind(endpoint)
                    return
                except zmq.ZMQError as e:
                    if binds or e.errno != zmq.EADDRNOTAVAIL:
                        raise
            socket.connect(endpoint)  # a subscriber's address (not one of this machine's), as in vLLM
        except zmq.ZMQError as e:
            self._ctx.destroy(linger=0)
            how = "connect to" if binds is False else "bind"
            raise InvalidRequestError(f"--kv-events-config: cannot {how} {endpoint}: {e}") from None

    def _bind(self, socket, endpoint: str) -> None:
        import zmq

        try:
            socket.bind(endpoint)
        except zmq.ZMQError as e:
            self._ctx.destroy(linger=0)
            raise InvalidRequestError(f"--kv-events-config: cannot bind {endpoint}: {e}") from None

    def emit(self, event: KVEvent) -> None:
        self._queue.put(event)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
        self._ctx.destroy(linger=0)

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        topic = self.config.topic.encode()
        running = True
        while running:
            events: list[KVEvent] = []
            try:
                first = self._queue.get(timeout=0.01)
                if first is None:
                    running = False
                else:
                    events.append(first)
                while running:  # everything that has arrived goes in one batch
                    more = self._queue.get_nowait()
                    if more is None:
                        running = False
                    else:
                        events.append(more)
            except queue.Empty:
                pass
            if events:
                batch: list[Any] = [as_map(e) for e in events] if self.config.encoding == "map" else events
                payload = self._encoder.encode(EventBatch(ts=time.time(), events=batch))
                seq = self._seq
                self._seq += 1
                self._buffer.append((seq, payload))
                try:
                    self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
                except zmq.Again:  # no subscriber keeps up: it can replay from the buffer
                    log.warning("KV events: batch %d dropped at the high-water mark", seq)
            if self._replay is not None:
                while poller.poll(0):
                    self._serve_replay(self._replay)

    def _serve_replay(self, replay) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3:
            log.warning("KV events: a replay request of %d frames ignored (want client, empty, sequence)",
                        len(frames))
            return
        client, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", END_OF_REPLAY, b""))
