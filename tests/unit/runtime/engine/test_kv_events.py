"""KV events in vLLM's wire format (engine/kv_events.py), read by a subscriber written from vLLM's
published types (vllm/distributed/kv_events.py, as its examples/online_serving/kv_events_subscriber.py
declares them), over real ZMQ sockets, from the real block manager: every whole block of every
prompt is announced with its token ids, evictions are announced, and a late subscriber replays
what it missed."""
from __future__ import annotations

import itertools
import json
import socket
import time
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import zmq
from msgspec.msgpack import Decoder

from kaon_runtime.engine.block_hash import BUILTIN, BlockHasher, hasher_from_env
from kaon_runtime.engine.block_manager import BlockManager
from kaon_runtime.engine.kv_events import (
    AllBlocksCleared as AllBlocksClearedEvent,
    EventPublisher,
    parse_kv_events_config,
    publisher_binds,
)
from kaon_runtime.engine.kv_observer import KVObserver
from kaon_runtime.engine.sequence import Sequence
from kaon_runtime.errors import InvalidRequestError
from kaon_runtime.sampling import SamplingParams

# ---- vLLM's published types (ExternalBlockHash = bytes | int) ---------------------------------

ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# ---- vLLM's newest published types (vllm/distributed/kv_events.py at v0.28.0, after #42892): the batch an
# array, each event a map tagged by "type"; BlockStored's lora_name has no default (required on the wire).

class NewEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class NewKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class NewBlockStored(NewKVCacheEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None


class NewBlockRemoved(NewKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None


class NewAllBlocksCleared(NewKVCacheEvent, tag="AllBlocksCleared"):
    pass


class NewKVEventBatch(NewEventBatch):
    events: list[NewBlockStored | NewBlockRemoved | NewAllBlocksCleared]


# ---------------------------------------------------------------------------------------------

BS = 4
_ids = itertools.count()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Subscriber:
    def __init__(self, port: int, replay_port: int, topic: str = "kv-events", batch_type: type = KVEventBatch):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.connect(f"tcp://127.0.0.1:{port}")
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.topic = topic
        self.replay_port = replay_port
        self.decoder = Decoder(type=batch_type)
        self.batches: list[tuple[int, Any]] = []
        self.payloads: list[bytes] = []

    def receive(self, until: Callable[[list], bool], seconds: float = 30.0) -> None:
        """Batches until `until(events)` holds: a condition, not a quiet period, which a busy machine's
        publisher thread can outlast between two batches (a deadline only fails a broken build)."""
        deadline = time.monotonic() + seconds
        while not until(self.events()):
            left_ms = int((deadline - time.monotonic()) * 1000)
            assert left_ms > 0 and self.sub.poll(left_ms), f"no batch within {seconds}s; got {self.batches}"
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == self.topic.encode()  # exactly as configured
            self.payloads.append(payload)
            self.batches.append((int.from_bytes(seq, "big"), self.decoder.decode(payload)))

    def subscribed(self, publisher: EventPublisher, seconds: float = 30.0) -> None:
        """Wait out ZMQ's slow joiner: a subscription reaches the publisher a moment after it binds (longer on a
        busy machine), and what is published before is lost. AllBlocksCleared, the event a starting publisher
        sends anyway, is sent until one arrives; the probes' batches are then left out."""
        deadline = time.monotonic() + seconds
        while not self.sub.poll(50):
            assert time.monotonic() < deadline, f"not subscribed within {seconds}s"
            publisher.emit(AllBlocksClearedEvent())
        self.sub.recv_multipart()

    def replay(self, start: int) -> list[tuple[int, KVEventBatch]]:
        # vLLM's example asks with a REQ socket, which keeps only the first reply of a replay; a DEALER
        # (with REQ's empty delimiter frame, as llm-d's and Dynamo's readers do) receives them all.
        req = self.ctx.socket(zmq.DEALER)
        req.connect(f"tcp://127.0.0.1:{self.replay_port}")
        req.send_multipart((b"", start.to_bytes(8, "big")))
        got = []
        while req.poll(2000):
            _, seq, payload = req.recv_multipart()
            if not payload:
                break
            got.append((int.from_bytes(seq, "big"), self.decoder.decode(payload)))
        req.close(linger=0)
        return got

    def events(self) -> list:
        return [e for _, batch in self.batches for e in batch.events]

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def publish(encoding: str | None, batch_type: type, topic: str = "kv-events", hasher: BlockHasher = BUILTIN):
    port, replay_port = free_port(), free_port()
    chosen = "" if encoding is None else f', "encoding": "{encoding}"'
    config = parse_kv_events_config(
        f'{{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:{port}", '
        f'"replay_endpoint": "tcp://127.0.0.1:{replay_port}", "topic": "{topic}"{chosen}}}')
    subscriber = Subscriber(port, replay_port, topic=topic, batch_type=batch_type)
    publisher = EventPublisher(config)
    subscriber.subscribed(publisher)
    bm = BlockManager(6, BS, hasher=hasher)
    bm.listener = KVObserver(BS, publisher, None, lora_names={3: "sql-lora"}.get, hasher=hasher)
    return bm, publisher, subscriber


@pytest.fixture
def published():
    bm, publisher, subscriber = publish(None, KVEventBatch)  # the default encoding, older vLLM's types
    yield bm, publisher, subscriber
    publisher.close()
    subscriber.close()


@pytest.fixture
def published_as_maps():
    # "encoding": "map", vLLM's newest types; llm-d's topic, kv@<pod>@<model>, which it parses: sent as configured
    bm, publisher, subscriber = publish("map", NewKVEventBatch, topic="kv@10.0.0.7@SmolLM2")
    yield bm, publisher, subscriber
    publisher.close()
    subscriber.close()


@pytest.fixture
def published_sha256_cbor(monkeypatch):
    # --prefix-caching-hash-algo sha256_cbor, seeded as vLLM is, from PYTHONHASHSEED (llm-d's hashSeed)
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    bm, publisher, subscriber = publish(None, KVEventBatch, hasher=hasher_from_env("sha256_cbor"))
    yield bm, publisher, subscriber
    publisher.close()
    subscriber.close()


def run(bm: BlockManager, tokens: list[int], lora_id: int = 0, cache_salt: str | None = None) -> list[int]:
    """Prefill a prompt and free it; returns its whole blocks' chain hashes."""
    seq = Sequence(next(_ids), list(tokens), len(tokens), SamplingParams(cache_salt=cache_salt), lora_id=lora_id)
    seq.num_computed_tokens = bm.allocate_prefix(seq)
    assert bm.ensure_slots(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq)
    hashes = list(seq.block_hashes)
    bm.free(seq)
    return hashes


def announced_hashes(events: list) -> set:
    return {h for e in events if isinstance(e, (BlockStored, NewBlockStored)) for h in e.block_hashes}


def test_every_whole_block_is_announced_with_its_tokens_and_evictions_too(published):
    bm, _, subscriber = published
    first = list(range(100, 111))  # 2 whole blocks and a partial one
    second = list(range(200, 217))  # 4 whole blocks and a partial one: the pool of 6 evicts some of the first
    a, b = run(bm, first), run(bm, second)
    subscriber.receive(until=lambda events: announced_hashes(events) >= {*a, *b})  # the evictions come before b's
    seqs = [seq for seq, _ in subscriber.batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "a batch went missing"
    events = subscriber.events()
    stored = [e for e in events if isinstance(e, BlockStored)]
    announced = {h: e for e in stored for h in e.block_hashes}
    for prompt, hashes in ((first, a), (second, b)):
        whole = len(prompt) // BS
        assert len(hashes) == whole
        tokens = [t for e in stored if set(e.block_hashes) <= set(hashes) for t in e.token_ids]
        assert tokens == prompt[:whole * BS]  # every whole block, with its tokens, in order
        assert all(announced[h].medium == "GPU" and announced[h].block_size == BS for h in hashes)
    assert stored[0].parent_block_hash is None  # a chain's first block has no parent block
    assert stored[1].parent_block_hash is None and stored[1].block_hashes == b  # one event per run of blocks
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed and set(removed) <= set(a)  # the first prompt's blocks were evicted
    assert all(e.medium == "GPU" for e in events if isinstance(e, BlockRemoved))


def test_a_late_subscriber_replays_what_it_missed(published):
    bm, _, subscriber = published
    hashes = run(bm, list(range(300, 309)))
    subscriber.receive(until=lambda events: announced_hashes(events) >= set(hashes))
    live = subscriber.batches
    assert live, "no batch arrived"
    replayed = subscriber.replay(0)
    assert [seq for seq, _ in replayed] == list(range(len(replayed)))
    assert isinstance(replayed[0][1].events[0], AllBlocksCleared)  # a (re)started engine holds nothing
    assert {seq: b.events for seq, b in replayed if seq >= live[0][0]} == {seq: b.events for seq, b in live}


def test_the_map_encoding_is_decoded_by_vllms_newest_types(published_as_maps):
    """`"encoding": "map"`: what vLLM >= 0.24 sends and its newest types decode (the default stream fails them:
    "Expected `object`, got `array`"). Every field they require is on the wire, lora_name with the adapter's."""
    bm, _, subscriber = published_as_maps
    first, second = list(range(100, 111)), list(range(200, 217))
    a, b = run(bm, first), run(bm, second)
    adapter = run(bm, list(range(300, 305)), lora_id=3)
    subscriber.receive(until=lambda events: announced_hashes(events) >= {*a, *b, *adapter})
    events = subscriber.events()
    stored = [e for e in events if isinstance(e, NewBlockStored)]
    tokens = [t for e in stored if set(e.block_hashes) <= set(a) for t in e.token_ids]
    assert tokens == first[:8] and all(e.medium == "GPU" and e.block_size == BS for e in stored)
    assert [e.lora_name for e in stored if set(e.block_hashes) <= set(adapter)] == ["sql-lora"]
    assert [e.lora_id for e in stored if set(e.block_hashes) <= set(adapter)] == [3]
    assert {e.lora_name for e in stored if not set(e.block_hashes) <= set(adapter)} == {None}
    removed = [h for e in events if isinstance(e, NewBlockRemoved) for h in e.block_hashes]
    assert removed and set(removed) <= set(a) | set(b)
    raw = [e for p in subscriber.payloads for e in msgspec.msgpack.decode(p)[1]]
    assert all(isinstance(e, dict) and "type" in e for e in raw)  # maps, tagged as vLLM tags them
    assert all("lora_name" in e for e in raw if e["type"] == "BlockStored")  # required: sent even when None
    with pytest.raises(msgspec.ValidationError, match="array"):
        Decoder(type=KVEventBatch).decode(subscriber.payloads[-1])  # not what the older types decode


def test_the_default_encoding_is_arrays_that_newest_types_refuse(published):
    bm, _, subscriber = published
    hashes = run(bm, list(range(100, 109)))
    adapter = run(bm, list(range(300, 305)), lora_id=3)  # its name trails the array: older types ignore it
    subscriber.receive(until=lambda events: announced_hashes(events) >= {*hashes, *adapter})
    assert [e.lora_id for e in subscriber.events() if isinstance(e, BlockStored) and e.block_hashes == adapter] == [3]
    assert all(isinstance(e, list) for p in subscriber.payloads for e in msgspec.msgpack.decode(p)[1])
    with pytest.raises(msgspec.ValidationError, match="object"):
        Decoder(type=NewKVEventBatch).decode(subscriber.payloads[-1])


@pytest.mark.parametrize("fixture", ["published", "published_as_maps"])
def test_an_adapters_or_a_salted_chain_starts_with_no_parent_as_in_vllm(fixture, request):
    """vLLM announces every chain's first block with a null parent and folds the adapter and the salt into its
    hash (extra_keys): its consumers (Dynamo's radix tree, llm-d's index) skip a chain whose parent they never saw.
    kaon announced the adapter's or the salt's root there."""
    bm, _, subscriber = request.getfixturevalue(fixture)
    prompt = list(range(300, 309))
    base, adapter, salted = run(bm, prompt), run(bm, prompt, lora_id=3), run(bm, prompt, cache_salt="tenant-a")
    subscriber.receive(until=lambda events: announced_hashes(events) >= {*base, *adapter, *salted})
    stored = {tuple(e.block_hashes): e for e in subscriber.events() if isinstance(e, (BlockStored, NewBlockStored))}
    assert {stored[tuple(h)].parent_block_hash for h in (base, adapter, salted)} == {None}
    assert len({base[0], adapter[0], salted[0]}) == 3  # told apart by their hashes, which fold the extra keys in
    raw = {tuple(e["block_hashes"] if isinstance(e, dict) else e[1]): e
           for p in subscriber.payloads for e in msgspec.msgpack.decode(p)[1]
           if (e["type"] if isinstance(e, dict) else e[0]) == "BlockStored"}
    extra = {name: (raw[tuple(h)].get("extra_keys") if isinstance(raw[tuple(h)], dict) else
                    (raw[tuple(h)][8:] or [None])[0])
             for name, h in (("base", base), ("adapter", adapter), ("salted", salted))}
    assert extra["base"] is None  # the base model's chain: as before, nothing more on the wire
    assert extra["adapter"] == [["sql-lora"], None] and extra["salted"][1] is None  # one entry a block
    assert len(extra["salted"][0]) == 1 and "tenant-a" not in str(extra["salted"])  # the salt's key, not the salt
    if fixture == "published_as_maps":
        assert stored[tuple(salted)].extra_keys == [tuple(extra["salted"][0]), None]  # vLLM's newest types read it


# llm-d-kv-cache-manager's own hashes of these tokens (block size 4, hashSeed "42"): its token processor
# (pkg/kvcache/kvblock, ChunkedTokenDatabase.TokensToKVBlockKeys, module v0.3.2, the release that recomputes
# vLLM's sha256_cbor hashes and looks them up as announced), run once by a Go program importing it
# (`go run .` in a scratch module requiring github.com/llm-d/llm-d-kv-cache-manager v0.3.2, Go 1.26).
LLMD_TOKENS = [i * 1000 + i for i in range(1, 13)]
LLMD_KEYS_SEED_42 = [18319865191491643376, 1382793705815487849, 3752897190382243916]


def test_sha256_cbor_hashes_are_the_ones_llm_d_recomputes_from_the_tokens(published_sha256_cbor):
    bm, _, subscriber = published_sha256_cbor
    run(bm, LLMD_TOKENS)
    subscriber.receive(until=lambda events: len(announced_hashes(events)) >= 3)
    stored = [e for e in subscriber.events() if isinstance(e, BlockStored)]
    assert [h for e in stored for h in e.block_hashes] == LLMD_KEYS_SEED_42
    assert stored[0].parent_block_hash is None


def test_the_builtin_hashes_are_not_llm_ds(published):
    """The default stays kaon's own (fast) hash: llm-d's precise scorer finds none of its blocks."""
    bm, _, subscriber = published
    hashes = run(bm, LLMD_TOKENS)
    subscriber.receive(until=lambda events: announced_hashes(events) >= set(hashes))
    assert not announced_hashes(subscriber.events()) & set(LLMD_KEYS_SEED_42)


def test_bad_configs_are_clear_errors():
    assert parse_kv_events_config(None) is None
    assert parse_kv_events_config('{"enable_kv_cache_events": false, "publisher": "zmq"}') is None
    with pytest.raises(InvalidRequestError, match="not JSON"):
        parse_kv_events_config("{enable")
    with pytest.raises(InvalidRequestError, match="publisher"):
        parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "kafka"}')
    with pytest.raises(InvalidRequestError, match=r"encoding must be 'array'.*or 'map'.*got 'tagged'"):
        parse_kv_events_config('{"enable_kv_cache_events": true, "encoding": "tagged"}')
    assert parse_kv_events_config('{"enable_kv_cache_events": true}').encoding == "array"
    assert parse_kv_events_config('{"enable_kv_cache_events": true, "encoding": "map"}').encoding == "map"
    busy = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", busy))
        s.listen()
        with pytest.raises(InvalidRequestError, match="cannot bind"):
            EventPublisher(parse_kv_events_config(
                f'{{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:{busy}"}}'))


@pytest.mark.parametrize("field, value", [("topic", 5), ("endpoint", 5557), ("replay_endpoint", 5558),
                                          ("enable_kv_cache_events", "maybe"), ("buffer_steps", "many")])
def test_a_field_of_the_wrong_type_is_a_clear_error(field, value):
    """`"topic": 5` started an engine whose publisher thread died on its first batch (a traceback in the log, no
    events ever); `"endpoint": 5557` raised a TypeError's traceback at start; "maybe" (any string) enabled events.
    What vLLM's own config (pydantic) takes is taken: "true", "100"."""
    config = {"enable_kv_cache_events": True, field: value}
    with pytest.raises(InvalidRequestError, match=f"--kv-events-config: {field}: .*got {value!r}"):
        parse_kv_events_config(json.dumps(config))
    assert parse_kv_events_config('{"enable_kv_cache_events": "false"}') is None  # was enabled: a non-empty string
    assert parse_kv_events_config('{"enable_kv_cache_events": "true", "buffer_steps": "100"}').buffer_steps == 100


def test_enabling_events_alone_publishes_over_zmq_as_in_vllm():
    # vLLM's KVEventsConfig: publisher unset means "zmq" when events are enabled (its __post_init__), so the
    # config many vLLM deployments pass, '{"enable_kv_cache_events": true, "topic": ...}', publishes.
    config = parse_kv_events_config('{"enable_kv_cache_events": true, "topic": "kv-events"}')
    assert config is not None and config.publisher == "zmq" and config.topic == "kv-events"
    assert parse_kv_events_config('{"enable_kv_cache_events": false}') is None
    assert parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}') is None
    assert parse_kv_events_config('{"enable_kv_cache_events": true, "max_queue_size": 5}') is not None  # vLLM's key


def test_the_endpoint_is_bound_or_connected_to_as_vllm_does():
    assert publisher_binds("tcp://*:5557") and publisher_binds("tcp://[::]:5557") and publisher_binds("ipc:///x")
    assert publisher_binds("inproc://kv") is True
    assert publisher_binds("tcp://epp.llm-d.svc.cluster.local:5556") is False  # a host name: connect
    assert publisher_binds("tcp://localhost:5556") is False
    assert publisher_binds("tcp://10.1.2.3:5557") is None  # an IP: bound when it is this machine's
    assert publisher_binds("tcp://[fd00::1]:5557") is True  # "::" in it: vLLM binds


def test_an_engine_connects_to_a_subscriber_that_binds():
    """llm-d's central mode: the scheduler binds a SUB socket and every engine's endpoint names it."""
    port = free_port()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.bind(f"tcp://127.0.0.1:{port}")
    sub.setsockopt_string(zmq.SUBSCRIBE, "kv@pod-a")
    publisher = EventPublisher(parse_kv_events_config(
        f'{{"enable_kv_cache_events": true, "endpoint": "tcp://localhost:{port}", "topic": "kv@pod-a"}}'))
    try:
        deadline = time.monotonic() + 30
        while not sub.poll(50):
            assert time.monotonic() < deadline, "no batch within 30 s"
            publisher.emit(AllBlocksClearedEvent())
        topic, _, payload = sub.recv_multipart()
        assert topic == b"kv@pod-a"
        assert isinstance(Decoder(type=KVEventBatch).decode(payload).events[0], AllBlocksCleared)
        # An IP address that is not this machine's is connected to, too (vLLM connects to every non-wildcard).
        EventPublisher(parse_kv_events_config(
            '{"enable_kv_cache_events": true, "endpoint": "tcp://192.0.2.1:5557"}')).close()
    finally:
        publisher.close()
        ctx.destroy(linger=0)


def test_the_engine_names_an_adapter_by_its_id_for_the_events():
    """LLMEngine's lookup behind BlockStored's lora_name: the adapter's name, also once it is unloaded while its
    requests still run (LoraPool keeps it in `adapters`); None for an id it does not know or without adapters."""
    from types import SimpleNamespace

    from kaon_runtime.engine.llm_engine import LLMEngine

    class Engine:
        runner = SimpleNamespace(lora=SimpleNamespace(adapters={3: SimpleNamespace(name="sql-lora")}))

    engine = Engine()
    name = LLMEngine._lora_namer(engine)
    assert name(3) == "sql-lora" and name(4) is None
    engine.runner = SimpleNamespace(lora=None)
    assert name(3) is None


def test_the_hash_algo_flag_reaches_the_engine_config_and_others_are_refused(monkeypatch):
    from kaon_runtime.cli import build_parser, engine_config
    from kaon_runtime.engine.block_hash import make_hasher

    def algo(*flags: str) -> str:
        return engine_config(build_parser().parse_args(["serve", *flags])).prefix_caching_hash_algo

    assert algo() == "builtin" and algo("--prefix-caching-hash-algo", "sha256_cbor") == "sha256_cbor"
    with pytest.raises(InvalidRequestError, match="--prefix-caching-hash-algo must be one of builtin, sha256_cbor"):
        make_hasher("sha256", "0")  # vLLM's pickle-based sha256: not offered (no other process computes it)
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)  # no seed: random, as in vLLM, so two engines differ
    assert hasher_from_env("sha256_cbor").chain(None, (1, 2)) != hasher_from_env("sha256_cbor").chain(None, (1, 2))
