"""Disaggregation's pieces without a model: the pool's token slots, placing received K/V, the wire's frames and
the checks that turn a bad transfer into a local prefill (engine/kv_transfer.py, kv_wire.py, remote_prefill.py).

Two real engines exchanging K/V over HTTP: tests/integration/test_disagg.py."""
from __future__ import annotations

import asyncio
import threading
from dataclasses import asdict

import pytest
import torch
from aiohttp import web

from kaon_runtime.engine.block_manager import BlockManager
from kaon_runtime.engine.kv_transfer import (
    ImportedKv,
    KvExports,
    KvLayout,
    adopt_reserved,
    cached_prefix_tokens,
    gather_tokens,
    place_imported,
    reserve_blocks,
    scatter_tokens,
    token_slots,
)
from kaon_runtime.engine.kv_wire import (
    PREFILL_PATH,
    FrameReader,
    KvAssembler,
    NixlTransport,
    NixlWriter,
    TcpTransport,
    TokenRanges,
    TransferError,
    all_finite,
    chunk_frame,
    chunk_frame_parts,
    done_frame,
    error_frame,
    frame,
    meta_frame,
    pick_transport,
    token_rows,
)
from kaon_runtime.engine.remote_prefill import (
    DECODE_STEP_TOKENS,
    DEFAULT_STEP_TOKENS,
    PREFILL_CHUNK_TOKENS,
    RemotePrefill,
    step_token_budget,
    wants_remote,
)
from kaon_runtime.engine.scheduler import ScheduledBatch
from kaon_runtime.engine.sequence import Sequence
from kaon_runtime.sampling import SamplingParams

BS = 4  # block size
LAYERS, HEADS, DIM, BLOCKS = 2, 1, 3, 16


def pool() -> torch.Tensor:
    return torch.zeros((LAYERS, 2, HEADS, BLOCKS, BS, DIM))


def tokens_kv(start: int, end: int) -> torch.Tensor:
    """Distinct K/V per token position, so a misplaced token shows."""
    kv = torch.arange(start, end, dtype=torch.float32).view(1, 1, 1, -1, 1)
    return kv.expand(LAYERS, 2, HEADS, end - start, DIM).clone()


LAYOUT = KvLayout(LAYERS, HEADS, DIM, "float32")


def seq(token_ids: list[int], seq_id: int = 0) -> Sequence:
    return Sequence(seq_id, token_ids, len(token_ids), SamplingParams(), request_id=f"r{seq_id}")


def test_token_slots_follow_the_block_table():
    assert token_slots([5, 2], BS, 2, 6).tolist() == [22, 23, 8, 9]


def test_gather_returns_what_scatter_wrote():
    cache, slots = pool(), token_slots([7, 3, 9], BS, 1, 10)
    scatter_tokens(cache, slots, tokens_kv(1, 10))
    assert torch.equal(gather_tokens(cache, slots), tokens_kv(1, 10))
    assert cache[:, :, :, 7, 0].sum() == 0  # the slot before the range was not touched


def test_place_imported_writes_past_the_cached_prefix_and_leaves_the_last_token():
    bm, cache = BlockManager(BLOCKS, BS), pool()
    prompt = list(range(100, 111))  # 11 tokens: [0, 10) arrive, the last is computed here
    first = seq(prompt)
    assert place_imported(bm, cache, first, ImportedKv(0, 10, tokens_kv(0, 10)))
    assert first.num_computed_tokens == 10 and first.num_cached_tokens == 0 and first.is_decoding
    slots = token_slots(first.block_table, BS, 0, 10)
    assert torch.equal(gather_tokens(cache, slots), tokens_kv(0, 10))
    assert len(first.block_table) == 3  # room for the eleventh token too
    # A second prompt sharing the first two blocks finds them cached: only what follows is written.
    assert cached_prefix_tokens(bm, prompt[:9] + [7, 7], 0, None) == 8
    second = seq(prompt[:9] + [7, 7], 1)
    assert place_imported(bm, cache, second, ImportedKv(8, 10, tokens_kv(50, 52)))
    assert second.num_cached_tokens == 8 and second.block_table[:2] == first.block_table[:2]
    assert gather_tokens(cache, token_slots(second.block_table, BS, 8, 10)).flatten()[::DIM].unique().tolist() == [
        50.0, 51.0]


def test_place_imported_refuses_when_the_prefix_it_was_sent_for_is_gone():
    bm, cache = BlockManager(BLOCKS, BS), pool()
    s = seq(list(range(11)))
    assert not place_imported(bm, cache, s, ImportedKv(8, 10, tokens_kv(8, 10)))  # nothing cached here
    assert s.block_table == [] and bm.num_free_blocks == BLOCKS and s.num_computed_tokens == 0


def test_exports_hand_on_each_steps_tokens_then_done():
    cache = pool()
    scatter_tokens(cache, token_slots([2, 5, 6], BS, 0, 12), tokens_kv(0, 12))
    s = seq(list(range(11)))
    s.request_id, s.block_table = "x", [2, 5, 6]
    exports, got = KvExports(lambda: cache, BS), []
    exports.watch("x", 3, 10, lambda first, kv: got.append((first, kv)))
    for computed in (6, 11):  # two chunked-prefill steps; the second runs past `end` (the sampled token)
        s.num_computed_tokens = computed
        exports.after_step(ScheduledBatch([s], [0]))
    assert [f for f, _ in got] == [3, 6, 10] and got[-1][1] is None
    assert torch.equal(torch.cat([got[0][1], got[1][1]], dim=3), tokens_kv(3, 10))
    assert exports.sent_tokens == 7 and not exports  # done: no longer watched


def test_short_prompts_and_scored_prompts_stay_local():
    params = SamplingParams()
    assert wants_remote(101, 0, params, 100) and not wants_remote(100, 0, params, 100)
    assert not wants_remote(301, 250, params, 100)  # most of it is cached here
    assert not wants_remote(301, 0, SamplingParams(prompt_logprobs=1), 100)


# ---- the wire ------------------------------------------------------------------------------


def transfer(start: int, end: int, step: int = 3) -> bytes:
    data = meta_frame(LAYOUT, start, end)
    for first in range(start, end, step):
        data += chunk_frame(first, tokens_kv(first, min(first + step, end)))
    return data + done_frame()


def assemble(data: bytes, start: int = 2, end: int = 10, cut: int = 5, in_place: bool = True) -> ImportedKv:
    """Feed the bytes in pieces of `cut`, as a socket would; `in_place`: payloads straight into the assembler's
    rows, as TcpTransport reads them."""
    assembler = KvAssembler(LAYOUT, start, end)
    reader = FrameReader(assembler.destination if in_place else None)
    for i in range(0, len(data), cut):
        for header, payload in reader.feed(data[i:i + cut]):
            handed.append((header["type"], payload is None))
            assembler.add(header, payload)
    assert assembler.done and reader.pending == 0
    return assembler.result()


handed: list[tuple[str, bool]] = []  # (frame type, whether its payload was placed rather than handed over)


@pytest.mark.parametrize("in_place", [True, False])
def test_frames_reassemble_the_transfer_from_any_split(in_place):
    for cut in (1, 7, 1000):
        handed.clear()
        kv = assemble(transfer(2, 10), cut=cut, in_place=in_place)
        assert (kv.start, kv.end) == (2, 10) and torch.equal(kv.kv, tokens_kv(2, 10))
        assert handed == [("meta", False)] + [("chunk", in_place)] * 3 + [("done", False)]


def test_the_wire_carries_the_gathered_kv_without_another_copy():
    """gather_tokens copies the pool's slots once, token-major; the frame's payload is that memory (the old path
    copied a 1,000-token chunk's 46 MB four more times on the way out)."""
    cache = pool()
    scatter_tokens(cache, token_slots([2, 5, 6], BS, 0, 12), tokens_kv(0, 12))
    kv = gather_tokens(cache, token_slots([2, 5, 6], BS, 3, 10))
    head, payload = chunk_frame_parts(3, kv)
    assert token_rows(kv).data_ptr() == kv.data_ptr()  # already token-major: no copy to send it
    assert torch.frombuffer(payload, dtype=torch.uint8).data_ptr() == kv.data_ptr()
    assert head + payload.tobytes() == chunk_frame(3, kv)
    rows = torch.frombuffer(bytearray(payload), dtype=torch.float32).view(7, LAYERS, 2, HEADS, DIM)
    assert torch.equal(rows.permute(1, 2, 3, 0, 4), tokens_kv(3, 10))  # token by token on the wire


def test_finite_check_finds_one_bad_value_among_many():
    kv = tokens_kv(0, 50)
    assert all_finite(kv)
    for bad in (float("nan"), float("inf"), -float("inf")):
        spoiled = kv.clone()
        spoiled[1, 0, 0, 37, 2] = bad
        assert not all_finite(spoiled)


@pytest.mark.parametrize("data, why", [
    (meta_frame(KvLayout(LAYERS, HEADS, DIM, "bfloat16"), 2, 10), "bfloat16"),  # another model or dtype
    (meta_frame(LAYOUT, 2, 10) + chunk_frame(5, tokens_kv(5, 8)), "chunk"),  # a gap
    (meta_frame(LAYOUT, 2, 10) + chunk_frame(2, tokens_kv(2, 5)) + done_frame(), "done after 3"),  # cut short
    (meta_frame(LAYOUT, 2, 10) + chunk_frame(2, tokens_kv(2, 5) * float("nan")), "finite"),
    (meta_frame(LAYOUT, 2, 10) + chunk_frame(2, tokens_kv(2, 5)) + chunk_frame(5, tokens_kv(5, 8) / 0), "finite"),
    (meta_frame(LAYOUT, 2, 10) + chunk_frame(2, tokens_kv(2, 5)) + chunk_frame(4, tokens_kv(4, 7)), "chunk"),
    (meta_frame(LAYOUT, 2, 10) + frame({"type": "chunk", "first": 2, "tokens": 3}, b"\0" * 8), "bytes"),
    (b"\0\0\0\x05{oops", "JSON"),
    (b"\xff\xff\xff\xff", "header"),
    (error_frame("out of blocks"), "out of blocks"),
])
def test_a_bad_transfer_is_refused_with_the_reason(data, why):
    with pytest.raises(TransferError, match=why) as caught:
        assemble(data)
    assert caught.value.reason == ("refused" if why == "out of blocks" else "garbage")


# ---- the client against a real socket: what it does when the prefill engine misbehaves -------


async def serve_prefill(behaviour: str):
    async def handler(request: web.Request) -> web.StreamResponse:
        ask = await request.json()
        start, end = ask["start"], len(ask["token_ids"]) - 1
        if behaviour == "busy":
            return web.json_response({"error": {"message": "queue full"}}, status=429)
        response = web.StreamResponse()
        await response.prepare(request)
        body = transfer(start, end) if behaviour != "garbage" else meta_frame(LAYOUT, start, end) + b"\0\0\0\x03abc"
        await response.write(body[:len(body) // 2])
        if behaviour == "slow":
            await asyncio.sleep(1.5)
        await response.write(body[len(body) // 2:])
        return response

    app = web.Application()
    app.router.add_post(PREFILL_PATH, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


class _EngineThread:
    """What AsyncEngine.call gives RemotePrefill: fn(engine) run between steps (here at once)."""

    def __init__(self) -> None:
        self.block_manager, self.runner = BlockManager(BLOCKS, BS), type("Runner", (), {"kv_cache": pool()})()

    async def call(self, fn):
        return fn(self)


@pytest.mark.parametrize("reserved", [False, True], ids=["assembled", "into-reserved-blocks"])
@pytest.mark.parametrize("behaviour, reason", [
    ("good", None), ("garbage", "garbage"), ("slow", "timeout"), ("busy", "refused"), ("down", "unreachable")])
def test_a_failed_transfer_is_counted_and_prefilled_here(behaviour, reason, reserved):
    engine = _EngineThread()

    async def main():
        runner, url = await serve_prefill(behaviour)
        if behaviour == "down":
            await runner.cleanup()
        transport = TcpTransport()
        # The 0.3 s deadline is the slow case's subject; every other case must not race it (a busy machine can
        # stall this process that long between two writes of the good one).
        timeout_s = 0.3 if behaviour == "slow" else 30.0
        remote = RemotePrefill([url], transport, LAYOUT, engine.block_manager, min_prompt_tokens=4, timeout_s=timeout_s)
        if reserved:
            remote.engine_call = engine.call
        try:
            return remote, await remote.fetch(list(range(11)), SamplingParams(), None, 0)
        finally:
            await asyncio.sleep(0)  # a failed transfer's release runs as its own task
            await transport.close()
            await runner.cleanup()

    remote, kv = asyncio.run(main())
    bm = engine.block_manager
    if reason is None:
        assert kv is not None and torch.equal(kv.kv, tokens_kv(0, 10))
        assert remote.stats.received_tokens == 10 and not any(remote.stats.fallbacks.values())
        if reserved:  # the K/V is in the decode engine's blocks already, held for the sequence that adopts them
            assert kv.reservation is not None and kv.reservation.placed == 10
            held = kv.reservation.holder.block_table
            assert len(held) == 3 and bm.num_free_blocks == BLOCKS - 3
            assert torch.equal(gather_tokens(engine.runner.kv_cache, token_slots(held, BS, 0, 10)), tokens_kv(0, 10))
        else:
            assert kv.reservation is None and bm.num_free_blocks == BLOCKS
    else:
        assert kv is None and remote.stats.received_tokens == 0
        assert remote.stats.fallbacks == {r: int(r == reason) for r in remote.stats.fallbacks}
        assert bm.num_free_blocks == BLOCKS  # a failed transfer's reserved blocks went back


def test_chunks_go_into_the_reserved_blocks_as_they_arrive():
    """The decode engine writes each chunk into its blocks when the chunk arrives, not the whole prompt after the
    last one; a sequence adopts the blocks (its cached prefix shared) only once every token is in."""
    bm, cache = BlockManager(BLOCKS, BS), pool()
    prompt = list(range(100, 111))
    first = seq(prompt)
    assert place_imported(bm, cache, first, ImportedKv(0, 10, tokens_kv(0, 10)))  # caches blocks [0, 8)
    later = prompt[:9] + [7, 7, 7, 7, 7]  # 14 tokens: 8 cached, [8, 13) to move
    reservation = reserve_blocks(bm, cache, later, SamplingParams(), 0)
    assert reservation is not None and (reservation.start, reservation.end) == (8, 13)
    assembler = KvAssembler(LAYOUT, 8, 13, on_chunk=reservation.place)
    reader = FrameReader(assembler.destination)
    slots = token_slots(reservation.holder.block_table, BS, 8, 13)
    frames = transfer(8, 13, step=3)
    placed_after_each = []
    for i in range(0, len(frames), 7):
        for header, payload in reader.feed(frames[i:i + 7]):
            assembler.add(header, payload)
            if header["type"] == "chunk":
                placed_after_each.append(reservation.placed)
                got = gather_tokens(cache, slots[:reservation.placed - 8])
                assert torch.equal(got, tokens_kv(8, reservation.placed))  # in the pool before the next arrives
    assert placed_after_each == [11, 13] and assembler.done
    later_seq = seq(later, 1)
    assert not adopt_reserved(bm, pool(), seq(later, 2), reserve_blocks(bm, cache, later, SamplingParams(), 0))
    assert adopt_reserved(bm, cache, later_seq, reservation)
    assert later_seq.num_cached_tokens == 8 and later_seq.num_computed_tokens == 13 and later_seq.is_decoding
    assert later_seq.block_table[:2] == first.block_table[:2] and reservation.holder.block_table == []
    bm.free(later_seq)
    bm.free(first)
    assert bm.num_free_blocks == BLOCKS


def test_an_incomplete_reservation_is_not_adopted():
    bm, cache = BlockManager(BLOCKS, BS), pool()
    prompt = list(range(11))
    reservation = reserve_blocks(bm, cache, prompt, SamplingParams(), 0)
    assert reservation is not None
    reservation.place(0, tokens_kv(0, 6))
    s = seq(prompt)
    assert not adopt_reserved(bm, cache, s, reservation)
    assert s.block_table == [] and s.num_computed_tokens == 0 and bm.num_free_blocks == BLOCKS


def test_an_ask_past_the_in_flight_limit_is_prefilled_here_at_once():
    """Every prefill engine holds --disagg-max-in-flight transfers: the next prompt is not queued behind them (to
    wait there and time out), it is counted `busy` and prefilled here without any connection."""
    async def main():
        runner, url = await serve_prefill("good")
        transport = TcpTransport()
        remote = RemotePrefill([url], transport, LAYOUT, BlockManager(BLOCKS, BS), min_prompt_tokens=4,
                               timeout_s=5, max_in_flight=1)
        try:
            remote.peers[0].in_flight = 1  # one transfer already there
            busy = await remote.fetch(list(range(11)), SamplingParams(), None, 0)
            remote.peers[0].in_flight = 0
            fetched = await remote.fetch(list(range(11)), SamplingParams(), None, 0)
        finally:
            await transport.close()
            await runner.cleanup()
        return remote, busy, fetched

    remote, busy, fetched = asyncio.run(main())
    assert busy is None and fetched is not None and torch.equal(fetched.kv, tokens_kv(0, 10))
    assert remote.stats.fallbacks == {r: int(r == "busy") for r in remote.stats.fallbacks}
    assert remote.stats.requests == 1 and remote.peers[0].in_flight == 0


def test_a_decode_engine_prefills_what_it_keeps_in_short_chunks():
    """A decode engine's own prefills (short prompts, fallbacks) go in steps of DECODE_STEP_TOKENS, so a failed
    transfer's 1,000-token prompt does not stall its streams for one long step; set by hand, the flag wins."""
    assert step_token_budget(None, "decode") == DECODE_STEP_TOKENS < DEFAULT_STEP_TOKENS
    assert step_token_budget(None, "both") == DEFAULT_STEP_TOKENS
    assert step_token_budget(2048, "decode") == 2048
    from kaon_runtime.cli import build_parser, engine_config

    args = build_parser().parse_args(["serve", "--role", "decode", "--prefill-url", "http://p:80"])
    assert engine_config(args).max_num_batched_tokens == DECODE_STEP_TOKENS
    assert engine_config(build_parser().parse_args(["serve"])).max_num_batched_tokens == DEFAULT_STEP_TOKENS


def test_a_prefill_engine_steps_in_transfer_chunks():
    """A prefill engine's step is its transfers' chunk (each step's K/V leaves once the step is done, so a chunk's
    move overlaps the next chunk's prefill): --disagg-chunk-tokens sets it, --max-num-batched-tokens set by hand
    wins."""
    from kaon_runtime.cli import build_parser, engine_config

    assert step_token_budget(None, "prefill") == PREFILL_CHUNK_TOKENS
    assert step_token_budget(None, "prefill", 300) == 300
    assert engine_config(build_parser().parse_args(["serve", "--role", "prefill"])).max_num_batched_tokens \
        == PREFILL_CHUNK_TOKENS
    args = build_parser().parse_args(["serve", "--role", "prefill", "--disagg-chunk-tokens", "128"])
    assert engine_config(args).max_num_batched_tokens == 128
    args = build_parser().parse_args(["serve", "--role", "prefill", "--disagg-chunk-tokens", "128",
                                      "--max-num-batched-tokens", "512"])
    assert engine_config(args).max_num_batched_tokens == 512
    # the chunk flag is a prefill engine's: an aggregated engine keeps its steps
    args = build_parser().parse_args(["serve", "--disagg-chunk-tokens", "128"])
    assert engine_config(args).max_num_batched_tokens == DEFAULT_STEP_TOKENS


@pytest.mark.parametrize("flags, refusal", [
    (["--disagg-timeout", "0"], "argument --disagg-timeout: must be a finite number > 0, got 0"),
    (["--prefill-url", "notaurl"], "argument --prefill-url: expected http://host[:port], got 'notaurl'"),
    (["--prefill-url", "127.0.0.1:8001"], "argument --prefill-url: expected http://host[:port]"),
    (["--prefill-url", "http://:8001"], "argument --prefill-url: expected http://host[:port]"),
    (["--prefill-url", "http://p:port"], "argument --prefill-url: not a URL"),
])
def test_a_decode_engines_bad_transfer_flags_are_refused_at_start(flags, refusal, capsys):
    """A 0 s --disagg-timeout would be no deadline at all (aiohttp reads a 0 s total as none: a hung prefill engine
    would hold the request forever), and a --prefill-url that is no URL would fail, and fall back, on every
    request: both are refused before the model loads."""
    from kaon_runtime.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--role", "decode", "--prefill-url", "http://p:80", *flags])
    assert refusal in capsys.readouterr().err
    args = build_parser().parse_args(["serve", "--role", "decode", "--prefill-url", "https://p.ns.svc:8443/",
                                      "--disagg-timeout", "0.5"])
    assert args.prefill_url == ["https://p.ns.svc:8443/"] and args.disagg_timeout == 0.5


def test_token_ranges_first_fit():
    ranges = TokenRanges(10)
    assert ranges.take(4) == 0 and ranges.take(4) == 4 and ranges.take(4) is None
    ranges.give(0, 4)
    assert ranges.take(3) == 0 and ranges.take(2) == 8 and ranges.take(1) == 3


def test_nixl_moves_the_bytes_into_the_offered_staging_range():
    """Two real NIXL agents (UCX, host memory) in this process: the "prefill engine" WRITEs each chunk into the
    decode side's staging buffer and sends only the headers, as server/disagg.py does."""
    pytest.importorskip("nixl._api")

    async def main():
        writer = NixlWriter()

        async def handler(request: web.Request) -> web.StreamResponse:
            ask = await request.json()
            start, end, peer = ask["start"], len(ask["token_ids"]) - 1, ask["nixl"]
            response = web.StreamResponse()
            await response.prepare(request)
            await response.write(meta_frame(LAYOUT, start, end))
            for first in range(start, end, 3):
                kv = tokens_kv(first, min(first + 3, end))
                await asyncio.to_thread(writer.write, peer, (first - start) * LAYOUT.token_bytes, kv)
                await response.write(frame({"type": "chunk", "first": first, "tokens": kv.shape[3], "placed": True}))
            await response.write(done_frame())
            return response

        app = web.Application()
        app.router.add_post(PREFILL_PATH, handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        transport, why = pick_transport(lambda: None, LAYOUT, "auto", staging_tokens=64)
        assert isinstance(transport, NixlTransport) and why == ""
        try:
            first = await transport.fetch(url, {"token_ids": list(range(11)), "start": 2}, LAYOUT, 10)
            second = await transport.fetch(url, {"token_ids": list(range(21)), "start": 0}, LAYOUT, 10)
        finally:
            await transport.close()
            await runner.cleanup()
        return first, second, transport

    first, second, transport = asyncio.run(main())
    assert torch.equal(first.kv, tokens_kv(2, 10)) and torch.equal(second.kv, tokens_kv(0, 20))
    assert transport.ranges.held == {}  # each transfer gave its staging range back


def test_layout_states_the_model_and_dtype():
    assert asdict(KvLayout.of_cache(pool())) == {"num_layers": LAYERS, "num_kv_heads": HEADS, "head_dim": DIM,
                                                 "dtype": "float32"}
    assert LAYOUT.token_bytes == 2 * LAYERS * HEADS * DIM * 4


def test_a_reservation_does_not_keep_a_slept_engines_pool():
    """An engine put to sleep mid-transfer frees its pool (engine/sleep.py warns if anything still holds it): the
    reservation holds it only weakly, its chunks then go nowhere, and the woken engine's new pool refuses them."""
    bm, cache = BlockManager(BLOCKS, BS), pool()
    prompt = list(range(11))
    reservation = reserve_blocks(bm, cache, prompt, SamplingParams(), 0)
    assert reservation is not None
    del cache  # put_to_sleep drops the pool
    assert reservation.cache() is None
    reservation.place(0, tokens_kv(0, 10))  # arrives after: no error, nothing written
    s = seq(prompt)
    assert not adopt_reserved(bm, pool(), s, reservation)
    assert s.block_table == [] and bm.num_free_blocks == BLOCKS


def test_a_request_cancelled_while_its_blocks_are_reserved_gives_them_back():
    """The client goes away while the engine thread has the reservation queued: the engine thread's call still runs
    to its end (a cancelled call's future would make it fail as AsyncEngine's _run_call sets the result), and the
    blocks it took go back once it is done, not held for ever."""
    from concurrent.futures import Future

    engine, errors, ran = _EngineThread(), [], threading.Event()
    queued: asyncio.Event | None = None

    async def engine_call(fn):  # as AsyncEngine.call: a future the engine thread completes between steps, later
        done: Future = Future()

        def between_steps():
            try:
                done.set_result(fn(engine))
            except Exception as exc:  # noqa: BLE001 -- what would kill the engine thread
                errors.append(exc)
            finally:
                ran.set()

        threading.Timer(0.05, between_steps).start()
        assert queued is not None
        queued.set()
        return await asyncio.wrap_future(done)

    async def main():
        nonlocal queued
        queued = asyncio.Event()
        remote = RemotePrefill(["http://127.0.0.1:9"], TcpTransport(), LAYOUT, engine.block_manager,
                               min_prompt_tokens=4)
        remote.engine_call = engine_call
        task = asyncio.create_task(remote.fetch(list(range(11)), SamplingParams(), None, 0))
        # Cancelled while the reservation waits for the engine thread, and checked after that thread ran it:
        # events, not sleeps (on a busy machine a sleep's guess passed without testing anything).
        await asyncio.wait_for(queued.wait(), 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await asyncio.to_thread(ran.wait, 30), "the engine thread never ran the reservation"
        for _ in range(1500):  # 30 s at most: the release runs as its own task after the call
            if engine.block_manager.num_free_blocks == BLOCKS:
                break
            await asyncio.sleep(0.02)
        return remote

    remote = asyncio.run(main())
    assert errors == [] and engine.block_manager.num_free_blocks == BLOCKS and remote.peers[0].in_flight == 0
