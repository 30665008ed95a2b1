"""The KV tiers and events on the real engine and model: a working set four times its pool comes back
from host memory and disk with greedy answers equal to an engine without tiers (the session's `llm`);
every whole block of every prompt is announced over ZMQ, evictions too. (A restart's reuse of the
disk tier is checked in test_kv_tiers.py on a small pool, and by bench/kv_tiers.py on this model:
a second engine load here would cost CI another 15 s.)"""
from __future__ import annotations

import json
import time

import pytest
import zmq
from msgspec.msgpack import Decoder
from test_kv_events import BlockRemoved, BlockStored, KVEventBatch, free_port

from kaon_runtime import LLM, SamplingParams
from kaon_runtime.engine.kv_events import AllBlocksCleared
from support import MODEL

POOL_BLOCKS = 6
DOCS = [f"Document {i}: " + " ".join(f"item{i}-{j}" for j in range(12)) for i in range(4)]
GREEDY = SamplingParams(temperature=0, max_tokens=2)


def tiered(disk, port: int | None = None) -> LLM:
    events = None if port is None else json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                   "endpoint": f"tcp://127.0.0.1:{port}", "topic": "kv-events"})
    return LLM(MODEL, show_progress=False, device="cpu", dtype="float32", num_kv_blocks=POOL_BLOCKS,
               kv_offload_bytes=6 * (1 << 20), kv_offload_dir=str(disk), kv_offload_dir_bytes=256 << 20,
               kv_events_config=events)


def answers(llm: LLM) -> list[list[int]]:
    outs = []
    for doc in DOCS:  # one at a time: each conversation returns after the others pushed it out of the pool
        outs.append(llm.generate([doc], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)
        llm.engine.kv_observer.tiers.drain()
    return outs


@pytest.mark.slow
def test_tiers_serve_a_working_set_larger_than_the_pool(llm, tmp_path):
    port = free_port()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt_string(zmq.SUBSCRIBE, "kv-events")
    engine = tiered(tmp_path, port)
    try:
        # ZMQ's slow joiner (longer on a busy machine): the event a starting engine sends, until one arrives.
        deadline = time.monotonic() + 30
        while not sub.poll(50):
            assert time.monotonic() < deadline, "not subscribed within 30 s"
            engine.engine.kv_observer.publisher.emit(AllBlocksCleared())
        first = answers(engine)
        second = answers(engine)
        stats = engine.engine.stats()
    finally:
        engine.close()
    expected = [o.outputs[0].token_ids for o in llm.generate(DOCS, GREEDY, use_tqdm=False)]
    assert first == expected and second == expected  # greedy answers equal with and without tiers
    tiers = stats.kv_tiers
    prompt_blocks = sum(len(llm.tokenizer.encode(d)) // 16 for d in DOCS)
    assert prompt_blocks >= 2 * POOL_BLOCKS  # the working set does not fit the pool
    assert tiers.hits["host"] + tiers.hits["disk"] >= prompt_blocks - POOL_BLOCKS
    assert tiers.hits["disk"] > 0 and tiers.moved["host_to_disk"] > 0

    decoder = Decoder(type=KVEventBatch)
    events = []
    while sub.poll(500):
        _, _, payload = sub.recv_multipart()
        events += decoder.decode(payload).events
    ctx.destroy(linger=0)
    pool_tokens = [t for e in events if isinstance(e, BlockStored) and e.medium == "GPU" for t in e.token_ids]
    for doc in DOCS:  # every whole block of every prompt announced with its token ids, in the pool
        ids = llm.tokenizer.encode(doc)
        whole = ids[:len(ids) // 16 * 16]
        assert any(pool_tokens[i:i + len(whole)] == whole for i in range(len(pool_tokens))), doc[:12]
    media = {(type(e).__name__, e.medium) for e in events if isinstance(e, BlockStored | BlockRemoved)}
    assert {("BlockRemoved", "GPU"), ("BlockStored", "CPU"), ("BlockStored", "DISK")} <= media
