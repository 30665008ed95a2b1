"""The kv-aware strategy: its index (which pod holds which prefix, in which tier, from the engines'
KV events), its choice (the longest prefix within the load bound), both pure; and the feed, which
subscribes to a real publisher (the engine's own, over ZMQ) and builds the index from it."""
from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import random
import socket
import time
from typing import Any

import msgspec
import pytest

from kaon_operator.router.endpoints import Endpoint
from kaon_operator.router.kv_feed import KvFeed
from kaon_operator.router.kv_index import KvIndex, Match, block_keys
from kaon_operator.router.strategies.kv_aware import choose

BS = 4
PROMPT = list(range(100, 117))  # 4 whole blocks (the engine leaves the last token to compute)
H = [11, 12, 13, 14]  # an engine's own hashes of those blocks


def stored(index: KvIndex, pod: str, hashes=H, parent=None, tokens=PROMPT[:16], medium="GPU", lora=None):
    index.stored(pod, hashes, parent, tokens, BS, lora, medium)


def keys(tokens=PROMPT) -> list[int]:
    return block_keys(tokens[:-1], BS)


# ---- the index -------------------------------------------------------------------------

def test_a_pod_matches_the_blocks_its_engine_announced():
    index = KvIndex()
    stored(index, "a", hashes=H[:2], tokens=PROMPT[:8])  # two blocks, then two more chained to them
    stored(index, "a", hashes=H[2:], parent=H[1], tokens=PROMPT[8:16])
    stored(index, "b", hashes=H[:1], tokens=PROMPT[:4])
    assert index.match("a", keys()).blocks == 4
    assert index.match("b", keys()).blocks == 1
    assert index.match("c", keys()).blocks == 0
    other = PROMPT[:4] + [9, 9, 9, 9] + PROMPT[8:]
    assert index.match("a", keys(other)).blocks == 1  # a prefix, never a block past a difference


def test_evictions_and_tiers():
    index = KvIndex()
    stored(index, "a")
    stored(index, "a", hashes=H[3:], parent=H[2], tokens=PROMPT[12:16], medium="CPU")  # copied to host memory
    index.removed("a", H[2:], "GPU")  # the pool let blocks 3 and 4 go; the host copy of 4 stays
    assert index.match("a", keys()).blocks == 2  # block 3 is nowhere: the prefix stops there
    index.removed("a", H[:2], "GPU")
    assert index.match("a", keys()).blocks == 0
    stored(index, "b", tokens=PROMPT[:16], medium="DISK")
    stored(index, "c")
    assert index.match("c", keys()).score > index.match("b", keys()).score > 0  # the pool beats the disk


def test_chains_the_router_cannot_follow_are_left_out():
    index = KvIndex()
    stored(index, "a", parent=999)  # a salted root, or a parent never seen
    stored(index, "b", lora=3)  # an adapter's blocks
    assert index.match("a", keys()).blocks == 0 and index.match("b", keys()).blocks == 0


def test_a_restart_clears_a_pods_entries():
    index = KvIndex()
    assert index.sequence("a", 0) is None
    stored(index, "a")
    assert index.sequence("a", 1) is None
    assert index.sequence("a", 4) == 2  # batches 2 and 3 missed: replay from 2
    assert index.match("a", keys()).blocks == 4
    index.sequence("a", 0)  # numbers start over: a new engine
    assert index.match("a", keys()).blocks == 0
    assert index.sequence("a", 1) is None
    stored(index, "a")
    assert index.sequence("a", 1) == 0  # went back, heard past its batch 0: a restart seen late, replayed from 0
    assert index.match("a", keys()).blocks == 0
    assert KvIndex().sequence("b", 7) == 0  # a pod first heard of mid-life: its history from 0
    stored(index, "a")
    index.cleared("a")  # AllBlocksCleared
    assert index.match("a", keys()).blocks == 0


def test_router_replicas_fed_the_same_events_agree():
    first, second = KvIndex(), KvIndex()
    for index in (first, second):
        stored(index, "a", hashes=[7, 8], tokens=PROMPT[:8])
        stored(index, "b")
        index.removed("b", [14], "GPU")
    assert [first.match(p, keys()) for p in "ab"] == [second.match(p, keys()) for p in "ab"]
    assert block_keys(PROMPT, BS) == block_keys(list(PROMPT), BS)


# ---- the choice ------------------------------------------------------------------------

def test_the_longest_prefix_wins_within_the_load_bound():
    rng = random.Random(0)
    matches = {"a": Match(1, 1.0), "b": Match(4, 4.0), "c": Match(0, 0.0)}
    assert choose(matches, ["a", "b", "c"], {}, 1.25, None, rng) == ("b", True)
    # b is far above the mean: the next longest prefix, a, within the bound
    assert choose(matches, ["a", "b", "c"], {"b": 9}, 1.25, None, rng) == ("a", False)
    # no free sequence slot at b while a has one
    assert choose(matches, ["a", "b", "c"], {"b": 2}, 10, 2, rng) == ("a", False)


def test_ties_go_to_the_least_loaded():
    matches = {"a": Match(2, 2.0), "b": Match(2, 2.0)}
    assert choose(matches, ["a", "b"], {"a": 1}, 1.25, None, random.Random(0)) == ("b", True)


def test_everyone_over_the_bound_goes_by_least_connections():
    matches = {"a": Match(4, 4.0), "b": Match(0, 0.0)}
    target, hit = choose(matches, ["a", "b"], {"a": 5, "b": 3}, 1.01, 3, random.Random(0))
    assert (target, hit) == ("b", False)


def test_new_conversations_sharing_a_system_prompt_spread_over_all_pods():
    """Bench run KV8c: ranked by match first, every new conversation went to the 2 pods (of 8)
    holding the shared system prompt, its only match; 3 pods got no request at all."""
    rng = random.Random(0)
    pods = [f"p{i}" for i in range(8)]
    system = {"p0": Match(3, 3.0), "p1": Match(3, 3.0)}  # 3 blocks of system prompt, at 2 pods
    went = collections.Counter()
    for _ in range(40):  # light load: each first turn finishes before the next arrives
        target, _ = choose(system, pods, {}, 1.25, 2, rng)
        went[target] += 1
    assert set(went) == set(pods) and max(went.values()) <= 10
    # between turns conversations have nothing in flight: ties go to the pod home to the fewest
    homes = {p: 1 for p in pods[:7]}
    assert choose(system, pods, {}, 1.25, 2, rng, homes=homes)[0] == "p7"
    # busy holders are no magnet either: the least loaded pods get the next first turns
    assert choose(system, pods, {"p0": 1, "p1": 1}, 1.25, 2, rng)[0] not in ("p0", "p1")


def test_a_system_prompt_at_one_pod_draws_no_new_conversation():
    """The chat's preamble (its system prompt) never picks a pod, even where one pod alone holds
    it; a returning conversation's own blocks past it still do."""
    rng = random.Random(0)
    pods = [f"p{i}" for i in range(8)]
    went = {choose({"p0": Match(3, 3.0)}, pods, {}, 1.25, 2, rng, preamble=3)[0] for _ in range(40)}
    assert went == set(pods)
    returning = {"p0": Match(3, 3.0), "p1": Match(3, 3.0), "p5": Match(7, 7.0)}  # its turns at p5
    assert choose(returning, pods, {"p5": 1}, 1.25, 2, rng, preamble=3) == ("p5", True)
    assert choose({"p5": Match(7, 7.0)}, pods, {}, 1.25, 2, rng, preamble=3) == ("p5", True)
    # over the bound, its pod is passed over as before
    target, hit = choose(returning, pods, {"p5": 3}, 1.25, 2, rng, preamble=3)
    assert target != "p5" and not hit


# ---- the feed, from the engine's own publisher -----------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def until(condition, timeout: float = 30.0) -> bool:
    """Poll a condition the feed's task makes true (it has no event to wait on: the index is plain data)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


@pytest.mark.parametrize("encoding, algo", [("array", "builtin"), ("map", "builtin"), ("array", "sha256_cbor")])
def test_the_feed_builds_the_index_from_an_engines_events(encoding, algo):
    """From a kaon engine's publisher in either encoding (`"encoding"` in --kv-events-config), with either
    --prefix-caching-hash-algo (sha256_cbor's hashes are unsigned 64-bit, vLLM's: the index keys by tokens)."""
    from kaon_runtime.engine.block_hash import make_hasher
    from kaon_runtime.engine.block_manager import BlockManager
    from kaon_runtime.engine.kv_events import BlockRemoved, EventPublisher, parse_kv_events_config
    from kaon_runtime.engine.kv_observer import KVObserver
    from kaon_runtime.engine.sequence import Sequence
    from kaon_runtime.sampling import SamplingParams

    port, replay = free_port(), free_port()
    publisher = EventPublisher(parse_kv_events_config(json.dumps({
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay}", "topic": "kv-events", "encoding": encoding})))
    hasher = make_hasher(algo, "0")
    bm = BlockManager(8, BS, hasher=hasher)
    bm.listener = KVObserver(BS, publisher, None, hasher=hasher)
    ids = itertools.count()

    def run(tokens):
        seq = Sequence(next(ids), list(tokens), len(tokens), SamplingParams())
        seq.num_computed_tokens = bm.allocate_prefix(seq)
        assert bm.ensure_slots(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens
        bm.commit(seq)
        bm.free(seq)

    async def main():
        index = KvIndex()
        feed = KvFeed(index, events_port=port, replay_port=replay)
        feed.follow([Endpoint("ns", "pod-a", "svc", "http://127.0.0.1:8000")])
        # ZMQ's slow joiner: what is published before the feed's subscription reaches the publisher is lost
        # (longer on a busy machine). An event that changes nothing (no block removed) until the feed has
        # seen a batch of the pod's.
        deadline = time.monotonic() + 30
        while "pod-a" not in index.pods():
            assert time.monotonic() < deadline, "the feed never subscribed"
            publisher.emit(BlockRemoved(block_hashes=[], medium="GPU"))
            await asyncio.sleep(0.05)
        run(PROMPT)
        held = await until(lambda: index.match("pod-a", keys()).blocks == 4)
        run(list(range(500, 532)))  # 8 whole blocks through a pool of 8: the first prompt's go
        gone = await until(lambda: index.match("pod-a", keys()).blocks == 0)
        await feed.close()
        return held, gone

    try:
        held, gone = asyncio.run(main())
    finally:
        publisher.close()
    assert held and gone


def test_a_router_replica_started_after_the_engine_builds_the_same_index():
    """The blocks an engine stored before a router replica subscribed are in no later batch: the replica asks
    the replay socket for them (found by hand: a late replica's index held none of them)."""
    from kaon_runtime.engine.block_manager import BlockManager
    from kaon_runtime.engine.kv_events import BlockRemoved, EventPublisher, parse_kv_events_config
    from kaon_runtime.engine.kv_observer import KVObserver
    from kaon_runtime.engine.sequence import Sequence
    from kaon_runtime.sampling import SamplingParams

    port, replay = free_port(), free_port()
    publisher = EventPublisher(parse_kv_events_config(json.dumps({
        "enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay}", "topic": "kv-events"})))
    bm = BlockManager(8, BS)
    bm.listener = KVObserver(BS, publisher, None)
    seq = Sequence(0, list(PROMPT), len(PROMPT), SamplingParams())
    seq.num_computed_tokens = bm.allocate_prefix(seq)
    assert bm.ensure_slots(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq)  # announced while no router listens
    bm.free(seq)

    async def main():
        index = KvIndex()
        feed = KvFeed(index, events_port=port, replay_port=replay)
        feed.follow([Endpoint("ns", "pod-a", "svc", "http://127.0.0.1:8000")])
        deadline = time.monotonic() + 30
        while "pod-a" not in index.pods():  # the slow joiner, as above
            assert time.monotonic() < deadline, "the feed never subscribed"
            publisher.emit(BlockRemoved(block_hashes=[], medium="GPU"))
            await asyncio.sleep(0.05)
        held = await until(lambda: index.match("pod-a", keys()).blocks == 4, timeout=10)
        await feed.close()
        return held

    try:
        assert asyncio.run(main())
    finally:
        publisher.close()


def test_a_restart_the_router_missed_clears_the_old_engines_entries():
    """A router that hears a restarted engine first past the old engine's last sequence number (its first batches
    lost: the restart took a while) took it for a gap: the replay from there left out the new engine's batch 0
    (AllBlocksCleared), and the old engine's blocks stayed in the index, drawing requests to a pod without them.
    Here the network between the new engine and the router is a relay that drops the new engine's first batches;
    the engines are real publishers on the pod's ports."""
    import zmq
    import zmq.asyncio

    from kaon_runtime.engine.block_manager import BlockManager
    from kaon_runtime.engine.kv_events import BlockRemoved, EventPublisher, parse_kv_events_config
    from kaon_runtime.engine.kv_observer import KVObserver
    from kaon_runtime.engine.sequence import Sequence
    from kaon_runtime.sampling import SamplingParams

    port, replay, relayed = free_port(), free_port(), free_port()
    old_tokens, new_tokens = PROMPT, list(range(700, 717))

    def engine(endpoint: str):
        publisher = EventPublisher(parse_kv_events_config(json.dumps({
            "enable_kv_cache_events": True, "endpoint": endpoint, "replay_endpoint": f"tcp://127.0.0.1:{replay}",
            "topic": "kv-events"})))
        bm = BlockManager(8, BS)
        bm.listener = KVObserver(BS, publisher, None)
        return publisher, bm

    def run(bm, tokens):
        seq = Sequence(0, list(tokens), len(tokens), SamplingParams())
        seq.num_computed_tokens = bm.allocate_prefix(seq)
        assert bm.ensure_slots(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens
        bm.commit(seq)

    async def main():
        index = KvIndex()
        feed = KvFeed(index, events_port=port, replay_port=replay)
        feed.follow([Endpoint("ns", "pod-a", "svc", "http://127.0.0.1:8000")])
        old, old_bm = engine(f"tcp://127.0.0.1:{port}")
        probes = 0
        while "pod-a" not in index.pods():  # the slow joiner, as above
            assert probes < 600, "the feed never subscribed"
            old.emit(BlockRemoved(block_hashes=[], medium="GPU"))
            probes += 1
            await asyncio.sleep(0.05)
        run(old_bm, old_tokens)
        assert await until(lambda: index.match("pod-a", keys(old_tokens)).blocks == 4)
        old.close()  # the engine dies; the new one publishes where the relay reads it
        new, new_bm = engine(f"tcp://127.0.0.1:{relayed}")
        ctx = zmq.asyncio.Context()
        upstream, pod_port = ctx.socket(zmq.SUB), ctx.socket(zmq.XPUB)
        try:
            upstream.connect(f"tcp://127.0.0.1:{relayed}")
            upstream.setsockopt_string(zmq.SUBSCRIBE, "")
            pod_port.bind(f"tcp://127.0.0.1:{port}")
            assert await asyncio.wait_for(pod_port.recv(), 30) == b"\x01kv-events"  # the router is back
            past = probes + 2  # the old engine's batches: AllBlocksCleared, the probes, its prompt's
            passed = asyncio.Event()

            async def relay():  # drops the new engine's batches up to `past`: the router never hears them
                while True:
                    frames = await upstream.recv_multipart()
                    if int.from_bytes(frames[1], "big") > past:
                        passed.set()
                        await pod_port.send_multipart(frames)

            relaying = asyncio.get_running_loop().create_task(relay())
            while not passed.is_set():
                new.emit(BlockRemoved(block_hashes=[], medium="GPU"))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(passed.wait(), 0.05)
            run(new_bm, new_tokens)
            held = await until(lambda: index.match("pod-a", keys(new_tokens)).blocks == 4)
            relaying.cancel()
            return held, index.match("pod-a", keys(old_tokens)).blocks
        finally:
            await feed.close()
            ctx.destroy(linger=0)
            new.close()

    held, old_blocks = asyncio.run(main())
    assert held and old_blocks == 0  # the old engine's blocks were kept: 4


# ---- the strategy ----------------------------------------------------------------------

class StubTokenizer:
    def prompt_ids(self, path, payload):
        return list(PROMPT)

    def preamble_length(self, path, payload, ids):
        return 0


class StubFeed:
    """The feed's I/O stands aside: the index is filled by hand, the tokenizer known or not."""

    def __init__(self, tokenizer):
        self._tokenizer, self.followed = tokenizer, []

    def follow(self, pods):
        self.followed = [e.pod for e in pods]

    def tokenizer(self, key, pods):
        return self._tokenizer

    def forget(self, key):
        pass


def attempt(inflight=None):
    from kaon_operator.router.endpoints import service
    from kaon_operator.router.strategies import Attempt

    svc = service({"metadata": {"namespace": "ns", "name": "llama"},
                   "spec": {"model": {"uri": "builtin://smollm2-135m-instruct"}, "routing": {"strategy": "kv-aware"}}})
    fleet = tuple(Endpoint("ns", f"pod-{i}", "llama", f"http://10.0.0.{i}:8000") for i in range(3))
    payload = {"model": "llama", "prompt": "text"}
    return fleet, Attempt(svc, fleet, fleet, inflight or {}, "/v1/completions", payload, 0.0, random.Random(0))


def test_the_strategy_sends_a_request_where_its_prefix_is():
    from kaon_operator.router.strategies.kv_aware import KvAware

    index = KvIndex()
    stored(index, "pod-2")
    stored(index, "pod-1", hashes=H[:1], tokens=PROMPT[:4])
    strategy = KvAware(index, StubFeed(StubTokenizer()))
    fleet, a = attempt()
    assert strategy.pick(a) == (fleet[2], True)
    assert strategy.feed.followed == ["pod-0", "pod-1", "pod-2"]  # every ready pod's events
    fleet, busy = attempt({fleet[2]: 6})
    assert strategy.pick(busy) == (fleet[1], False)  # over the bound: the next longest prefix


def test_the_strategy_passes_the_chats_preamble_over():
    """pod-0 alone holds the prompt's first two blocks, all of them the preamble (a system prompt):
    no reason to send every request there."""
    from kaon_operator.router.strategies.kv_aware import KvAware

    class WithPreamble(StubTokenizer):
        def preamble_length(self, path, payload, ids):
            return 2 * BS + 1  # two whole blocks and a token of the third

    index = KvIndex()
    stored(index, "pod-0", hashes=H[:2], tokens=PROMPT[:8])
    strategy = KvAware(index, StubFeed(WithPreamble()))
    went = set()
    for seed in range(12):
        _, a = attempt()
        went.add(strategy.pick(a._replace(rng=random.Random(seed))).target.pod)
    assert went == {"pod-0", "pod-1", "pod-2"}


def test_without_a_tokenizer_or_a_held_prefix_it_goes_by_prefix_affinity():
    from kaon_operator.router.strategies.kv_aware import KvAware

    index = KvIndex()
    strategy = KvAware(index, StubFeed(None))
    picked = []
    strategy.fallback.pick = lambda a: picked.append(a) or ("fallback", None)
    assert strategy.pick(attempt()[1]) == ("fallback", None)
    stored(index, "pod-0", hashes=[1], tokens=[7, 7, 7, 7])  # a block size is known, but not this prompt
    strategy.feed = StubFeed(StubTokenizer())
    assert strategy.pick(attempt()[1]) == ("fallback", None) and len(picked) == 2


def test_the_router_tokenizes_as_the_engine(llm):
    """The same ids from the router's tokenizer (built from the engine's GET /kaon/tokenizer) as the engine's."""
    from kaon_operator.router.kv_tokens import PromptTokenizer
    from kaon_runtime.server.tokenizer_info import _info

    router = PromptTokenizer(json.loads(_info(llm.tokenizer)))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a KV cache?"},
                {"role": "assistant", "content": "Memory of past tokens."}, {"role": "user", "content": "Why tiers?"}]
    engine = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(messages))
    assert router.prompt_ids("/v1/chat/completions", {"messages": messages}) == engine
    # the preamble: the system prompt as the template writes it, which every such conversation shares
    preamble = router.preamble_length("/v1/chat/completions", {"messages": messages}, engine)
    other = [messages[0], {"role": "user", "content": "Hello there"}]
    other_ids = router.prompt_ids("/v1/chat/completions", {"messages": other})
    assert 0 < preamble < len(engine) and engine[:preamble] == other_ids[:preamble]
    assert "Be brief." in llm.tokenizer.decode(engine[:preamble]) and "KV" not in llm.tokenizer.decode(
        engine[:preamble])
    assert router.preamble_length("/v1/completions", {"prompt": "Once"}, [1, 2]) == 0
    assert router.prompt_ids("/v1/completions", {"prompt": "Once upon a time"}) == llm.tokenizer.encode(
        "Once upon a time")
    assert router.prompt_ids("/v1/completions", {"prompt": [1, 2, 3]}) == [1, 2, 3]
    assert router.prompt_ids("/v1/embeddings", {"input": "x"}) is None


@pytest.mark.parametrize("bad", [-1, 1 << 32, 10 ** 30])
def test_a_prompt_of_token_ids_out_of_range_goes_by_prefix_affinity(bad):
    """A client's `prompt` of token ids is taken as the prompt's tokens; one negative or past 32 bits raised
    OverflowError out of the strategy's pick (keys pack each id in 4 bytes), where the engine answers such a
    request with its own 400 (found by hand)."""
    from kaon_operator.router.kv_tokens import PromptTokenizer
    from kaon_operator.router.strategies.kv_aware import KvAware

    class ClientIds(StubTokenizer):
        prompt_ids = PromptTokenizer.prompt_ids  # a list of ints passes through as the real one does it

    index = KvIndex()
    stored(index, "pod-2")
    strategy = KvAware(index, StubFeed(ClientIds()))
    picked = []
    strategy.fallback.pick = lambda a: picked.append(a) or ("fallback", None)
    fleet, a = attempt()
    prompt = [*PROMPT[:8], bad, *PROMPT[9:]]
    assert strategy.pick(a._replace(payload={"model": "llama", "prompt": prompt})) == ("fallback", None)
    assert strategy.pick(a._replace(payload={"model": "llama", "prompt": list(PROMPT)})) == (fleet[2], True)


def test_a_batch_applies_in_order_and_all_blocks_cleared_empties_the_pod():
    from kaon_operator.router.kv_feed import AllBlocksCleared, BlockStored, apply

    index = KvIndex()
    store = BlockStored([b"\x0b", b"\x0c", b"\x0d", b"\x0e"], None, PROMPT[:16], BS, None, "GPU")  # vLLM's bytes
    apply(index, "a", [store])
    assert index.match("a", keys()).blocks == 4
    apply(index, "a", [AllBlocksCleared()])
    assert index.match("a", keys()).blocks == 0
    apply(index, "a", [AllBlocksCleared(), store])
    assert index.match("a", keys()).blocks == 4


def test_all_blocks_cleared_keeps_the_pods_sequence():
    """Every engine's batch 0 is AllBlocksCleared. It emptied the pod's entries and its sequence number too, so
    each later batch looked like a pod heard of mid-life and was answered by a replay of the engine's whole
    buffer (up to 10,000 batches) from 0, batch after batch (found by hand)."""
    from kaon_operator.router.kv_feed import AllBlocksCleared, apply

    index = KvIndex()
    assert index.sequence("a", 0) is None
    apply(index, "a", [AllBlocksCleared()])
    assert index.sequence("a", 1) is None  # the next batch: no gap, nothing to replay
    stored(index, "a")
    assert index.sequence("a", 2) is None
    apply(index, "a", [AllBlocksCleared()])  # a vLLM pod's reset_prefix_cache: the blocks go, the count stays
    assert index.match("a", keys()).blocks == 0
    assert index.sequence("a", 4) == 3


# ---- vLLM's two event encodings, as its releases declare them --------------------------------
# Older vLLM (and kaon's default "array"): events are arrays tagged by their first element
# (examples/online_serving/kv_events_subscriber.py before vLLM #42892). vLLM >= 0.24: each event is a
# map tagged by "type", BlockStored with more fields (vllm/distributed/kv_events.py at v0.28.0: lora_name
# required, then extra_keys, group_idx, kv_cache_spec_kind, ..., locality with defaults); the batch stays
# an array with data_parallel_rank. Written from those declarations, not from kaon's code.

class OldBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class OldEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class OldStored(OldEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class OldRemoved(OldEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None


class NewBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class NewEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class NewStored(NewEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
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


class NewRemoved(NewEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None


class NewCleared(NewEvent, tag="AllBlocksCleared"):
    pass


class FutureEvent(NewEvent, tag="BlockPinned"):  # an event type a later vLLM might add
    block_hashes: list[int]


def _applied(payload: bytes) -> KvIndex:
    from kaon_operator.router.kv_feed import apply, decode

    index = KvIndex()
    apply(index, "a", decode(payload))
    return index


def test_the_feed_reads_older_vllms_array_events():
    encode = msgspec.msgpack.encode
    index = _applied(encode(OldBatch(1.0, [OldStored(H[:2], None, PROMPT[:8], BS, None, "GPU"),
                                           OldStored(H[2:], H[1], PROMPT[8:16], BS, None, "GPU")])))
    assert index.match("a", keys()).blocks == 4
    # the oldest releases had no medium: a pool block
    index = _applied(encode([1.0, [["BlockStored", [b"\x0b"], None, PROMPT[:4], BS, None]]]))
    assert index.match("a", keys()).blocks == 1


def test_the_feed_reads_newer_vllms_map_events_and_ignores_fields_it_does_not_know():
    encode = msgspec.msgpack.encode
    stored = NewStored([b"\xab" * 32, b"\xcd" * 32], None, PROMPT[:8], BS, None, "GPU", None, extra_keys=[None, None],
                       group_idx=0, kv_cache_spec_kind="full_attention", locality="LOCAL")
    payload = encode(NewBatch(1.0, [NewCleared(), stored, FutureEvent([1])], data_parallel_rank=0))
    assert isinstance(msgspec.msgpack.decode(payload)[1][1], dict)  # events as maps, as vLLM >= 0.24 sends them
    index = _applied(payload)
    assert index.match("a", keys()).blocks == 2  # the unknown event type skipped, not the batch
    index_after = _applied(encode(NewBatch(2.0, [stored, NewRemoved([b"\xcd" * 32], "GPU", group_idx=0)])))
    assert index_after.match("a", keys()).blocks == 1
    adapter = NewStored([5], None, PROMPT[:4], BS, None, "GPU", "sql-lora")  # an adapter named, not numbered
    assert _applied(encode(NewBatch(1.0, [adapter]))).match("a", keys()).blocks == 0


def test_the_feed_reads_a_batch_mixing_both_encodings():
    encode = msgspec.msgpack.encode
    payload = encode(NewBatch(1.0, [OldStored(H[:2], None, PROMPT[:8], BS, None, "GPU"),
                                    NewStored(H[2:], H[1], PROMPT[8:16], BS, None, "CPU", None),
                                    OldRemoved(H[:1], "GPU"), NewRemoved(H[3:], "CPU")]))
    index = _applied(payload)
    assert index.match("a", keys()).blocks == 0  # block 1 left the pool: nothing from the start
    index = _applied(encode(NewBatch(1.0, [OldStored(H[:2], None, PROMPT[:8], BS, None, "GPU"),
                                           NewStored(H[2:], H[1], PROMPT[8:16], BS, None, "CPU", None),
                                           NewRemoved(H[3:], "CPU")])))
    assert index.match("a", keys()).blocks == 3
    # one line of releases sent the batch itself as a map
    assert _applied(encode({"ts": 1.0, "events": [NewStored(H[:1], None, PROMPT[:4], BS, None, "GPU", None)],
                            "data_parallel_rank": 0})).match("a", keys()).blocks == 1


def test_a_chain_whose_hashes_fold_in_more_than_tokens_is_not_its_tokens_chain():
    """vLLM announces a salted or an adapter's chain, and an image's blocks, with a null first parent like any
    other; what sets them apart is extra_keys (the salt, the adapter, the image's hash). The router indexed them as
    the plain tokens' chain: a request of the same tokens was sent to the pod holding only another tenant's blocks."""
    encode = msgspec.msgpack.encode
    salted = NewStored(H, None, PROMPT[:16], BS, None, "GPU", None, extra_keys=[("tenant-a",), None, None, None])
    assert _applied(encode(NewBatch(1.0, [salted]))).match("a", keys()).blocks == 0
    image = NewStored(H, None, PROMPT[:16], BS, None, "GPU", None, extra_keys=[None, None, ("img-sha",), None])
    assert _applied(encode(NewBatch(1.0, [image]))).match("a", keys()).blocks == 2  # up to the image's block
    plain = NewStored(H, None, PROMPT[:16], BS, None, "GPU", None, extra_keys=[None] * 4)
    assert _applied(encode(NewBatch(1.0, [plain]))).match("a", keys()).blocks == 4


@pytest.mark.parametrize("encoding", ["array", "map"])
def test_a_kaon_engines_salted_and_adapter_chains_stay_apart_from_the_base_models(encoding):
    """A kaon engine announces them as vLLM does (null parent, extra_keys); the router still leaves them out."""
    from kaon_runtime.engine.block_manager import BlockManager
    from kaon_runtime.engine.kv_events import EventBatch, as_map
    from kaon_runtime.engine.kv_observer import KVObserver
    from kaon_runtime.engine.sequence import Sequence
    from kaon_runtime.sampling import SamplingParams

    class Collected:  # the publisher's queue, without its socket: the batch is encoded as its thread encodes it
        def __init__(self):
            self.events: list = []

        def emit(self, event):
            self.events.append(event)

    def index_of(lora_id=0, cache_salt=None) -> KvIndex:
        bm, collected = BlockManager(8, BS), Collected()
        bm.listener = KVObserver(BS, collected, None, lora_names={3: "sql-lora"}.get)
        seq = Sequence(0, list(PROMPT), len(PROMPT), SamplingParams(cache_salt=cache_salt), lora_id=lora_id)
        seq.num_computed_tokens = bm.allocate_prefix(seq)
        assert bm.ensure_slots(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens
        bm.commit(seq)
        events = [as_map(e) for e in collected.events] if encoding == "map" else collected.events
        return _applied(msgspec.msgpack.encode(EventBatch(ts=1.0, events=events)))

    assert index_of().match("a", keys()).blocks == 4
    assert index_of(cache_salt="tenant-a").match("a", keys()).blocks == 0
    assert index_of(lora_id=3).match("a", keys()).blocks == 0
