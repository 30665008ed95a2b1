"""The router's client to the engines (router/upstream.py): parsing a response however the bytes
are cut, bodies with a length or chunked, an engine that breaks off or goes quiet, and the pool.

The parsing cases feed the connection's protocol by hand (every split point of a response); the
rest run against small raw asyncio servers on 127.0.0.1 that answer with canned bytes.
"""
from __future__ import annotations

import asyncio
import itertools

import pytest
from multidict import CIMultiDict

from kaon_operator.router.request import response_headers, response_lines, upstream_fields, upstream_headers
from kaon_operator.router.upstream import ConnectFailed, Pool, Response, UpstreamError, _Connection
from support.router import FakeEngine, closed_port, routed, run, serving, until

CONTENT_LENGTH = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n"
                  b"X-Engine: a\r\n\r\n{\"a\": true}")
CHUNKED = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"8\r\ndata: 1\n\r\n9\r\n\ndata: 2\n\r\n1\r\n\n\r\n0\r\n\r\n")


class FakeTransport(asyncio.Transport):
    def __init__(self):
        super().__init__()
        self.written, self.closed, self.paused = [], False, False

    def write(self, data):
        self.written.append(data)

    def close(self):
        self.closed = True

    def pause_reading(self):
        self.paused = True

    def resume_reading(self):
        self.paused = False


def fed(raw: bytes, cuts: list[int]) -> tuple[Response, bytes]:
    """A connection fed `raw` in the pieces `cuts` make; the response and its body."""
    async def go():
        loop = asyncio.get_running_loop()
        conn = _Connection(Pool(1.0), "http://127.0.0.1:1")
        conn.connection_made(FakeTransport())
        head = loop.create_future()
        conn.send(b"POST / HTTP/1.1\r\n\r\n", head)
        bounds = [0, *cuts, len(raw)]
        for start, end in itertools.pairwise(bounds):
            conn.data_received(raw[start:end])
        response = await head
        return response, await response.read()
    return run(go())


@pytest.mark.parametrize("raw, body, content_type", [
    (CONTENT_LENGTH, b'{"a": true}', "application/json"),
    (CHUNKED, b"data: 1\n\ndata: 2\n\n", "text/event-stream"),
], ids=["content-length", "chunked"])
def test_a_response_split_at_every_byte_parses_the_same(raw, body, content_type):
    for cut in range(1, len(raw)):
        response, got = fed(raw, [cut])
        assert (response.status, response.reason, response.content_type) == (200, "OK", content_type), cut
        assert got == body, cut
        assert response.complete and response.keep_alive, cut
    assert fed(raw, list(range(1, len(raw))))[1] == body


def test_the_request_head_carries_host_length_and_the_given_fields_then_the_body():
    async def go():
        pool = Pool(1.0)
        conn = _Connection(pool, "http://10.0.0.7:8000")
        conn.connection_made(transport := FakeTransport())
        pool.put(conn)  # the kept connection the request takes (no method patched: compiled, they are read-only)
        task = asyncio.ensure_future(pool.request("http://10.0.0.7:8000", "POST", "/v1/completions?x=1",
                                                  [b"Content-Type: application/json\r\n"], b'{"m": 1}', 5))
        await asyncio.sleep(0)
        conn.data_received(CONTENT_LENGTH)
        await task
        return b"".join(transport.written)
    assert run(go()) == (b"POST /v1/completions?x=1 HTTP/1.1\r\nHost: 10.0.0.7:8000\r\nContent-Length: 8\r\n"
                         b"Content-Type: application/json\r\n\r\n{\"m\": 1}")


def test_raw_fields_follow_the_same_rules_as_the_header_maps():
    fields = [(b"Authorization", b"Bearer k"), (b"COOKIE", b"c"), (b"X-Forwarded-For", b"1.2.3.4"),
              (b"Connection", b"keep-alive, X-Hop"), (b"X-Hop", b"1"), (b"Host", b"router"),
              (b"Content-Length", b"9"), (b"Expect", b"100-continue"), (b"Content-Type", b"application/json"),
              (b"X-Request-Id", b"r1"), (b"Transfer-Encoding", b"chunked")]
    mapping = CIMultiDict((k.decode(), v.decode()) for k, v in fields)
    for authorization in (None, "Bearer k"):
        expected = [f"{k}: {v}\r\n".encode() for k, v in upstream_headers(mapping, authorization).items()]
        assert upstream_fields(fields, authorization) == expected
    assert upstream_fields(fields, None) == [b"Content-Type: application/json\r\n", b"X-Request-Id: r1\r\n"]
    back = response_headers([(b"Content-Type", b"text/plain"), (b"Connection", b"close, X-Hop"), (b"X-Hop", b"1"),
                             (b"Content-Length", b"3"), (b"Keep-Alive", b"timeout=5"), (b"X-Id", b"9")])
    assert list(back.items()) == [("Content-Type", "text/plain"), ("Content-Length", "3"), ("X-Id", "9")]
    assert "Content-Length" not in response_headers([(b"Content-Length", b"3")], drop_length=True)


def test_an_answers_head_lines_keep_what_its_headers_keep():
    """response_lines (the router's own server's whole answers: front.Whole) drops what response_headers does when
    the body is sent whole, byte for byte, and says whether a Date is kept."""
    cases = [[(b"Content-Type", b"text/plain"), (b"Connection", b"close, X-Hop"), (b"X-Hop", b"1"), (b"date", b"D"),
              (b"Content-Length", b"3"), (b"Keep-Alive", b"timeout=5"), (b"X-Id", b"9"), (b"X-Id", b"10")],
             [(b"content-type", b"application/json"), (b"transfer-encoding", b"chunked"), (b"TE", b"x")],
             [(b"Server", b"uvicorn"), (b"Date", b"Sun, 29 Nov 2026 17:00:00 GMT"), (b"X-Raw", b"\xe9")]]
    for fields in cases:
        lines, dated = response_lines(fields)
        expected = b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in response_headers(fields, True).items())
        assert lines == expected
        assert dated == any(k.lower() == b"date" for k, _ in fields)
    assert response_lines(cases[0])[0] == b"Content-Type: text/plain\r\ndate: D\r\nX-Id: 9\r\nX-Id: 10\r\n"


def test_a_large_body_pauses_reading_until_it_is_read():
    async def go():
        loop = asyncio.get_running_loop()
        conn = _Connection(Pool(1.0), "http://127.0.0.1:1")
        conn.connection_made(transport := FakeTransport())
        head = loop.create_future()
        conn.send(b"x", head)
        conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 400000\r\n\r\n")
        response = await head
        conn.data_received(b"a" * 300000)
        assert transport.paused
        assert len(await response.readany()) == 300000
        assert not transport.paused
        conn.data_received(b"b" * 100000)
        assert len(await response.read()) == 100000
    run(go())


# against real sockets ------------------------------------------------------------------


class Canned:
    """A raw server: each connection gets `answers` in turn, one per request it receives (a
    request is taken as read when its body's last byte, `}`, came); None: close instead;
    b"": say nothing. `close`: close once the answers are out."""

    def __init__(self, *answers: bytes | None, close: bool = False):
        self.answers, self.close = list(answers), close
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while self.answers:
                data = b""
                while not data.endswith(b"}"):
                    chunk = await reader.read(65536)
                    if not chunk:
                        return
                    data += chunk
                self.requests.append(data)
                answer = self.answers.pop(0)
                if answer is None:
                    return
                writer.write(answer)
                await writer.drain()
            if not self.close:
                await reader.read()  # until the router closes
        finally:
            writer.close()
            self.closed.set()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        self.server.close()


async def post(pool: Pool, url: str, timeout: float = 5.0) -> Response:
    return await pool.request(url, "POST", "/v1/completions", [], b'{"model": "m"}', timeout)


def test_the_pool_reuses_a_connection_after_a_whole_response_and_not_after_a_partly_read_one():
    async def go():
        partial = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nxx"  # the rest never comes
        canned = Canned(CONTENT_LENGTH, CHUNKED, partial, CONTENT_LENGTH)
        async with canned as url:
            pool = Pool(1.0)
            async with await post(pool, url) as first:
                assert await first.read() == b'{"a": true}'
            assert pool.idle(url) == 1
            async with await post(pool, url) as second:
                assert await second.read() == b"data: 1\n\ndata: 2\n\n"
            assert (canned.connections, pool.connects) == (1, 1)
            third = await post(pool, url)
            third.release()  # before its end: the connection cannot carry another request
            assert pool.idle(url) == 0
            await asyncio.wait_for(canned.closed.wait(), 2)  # the engine sees the close: it aborts
            async with await post(pool, url):
                pass
            assert pool.connects == 2
            pool.close()
    run(go())


def test_an_engine_that_closes_mid_body_fails_the_read_and_its_connection_is_not_kept():
    async def go():
        cut = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 10
        chunked_cut = CHUNKED[:CHUNKED.index(b"9\r\n")]
        for raw in (cut, chunked_cut):
            canned = Canned(raw, close=True)
            async with canned as url:
                pool = Pool(1.0)
                response = await post(pool, url)
                with pytest.raises(UpstreamError, match="broke off"):
                    await response.read()
                response.release()
                assert pool.idle(url) == 0
    run(go())


def test_a_body_without_length_ends_with_the_connection():
    async def go():
        async with Canned(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it", close=True) as url:
            pool = Pool(1.0)
            response = await post(pool, url)
            assert await response.read() == b"all of it"
            response.release()
            assert pool.idle(url) == 0
    run(go())


def test_a_half_dead_connection_times_out_and_is_closed():
    async def go():
        canned = Canned(b"")  # reads the request, answers nothing, keeps the connection open
        async with canned as url:
            pool = Pool(1.0)
            with pytest.raises(TimeoutError):
                await post(pool, url, timeout=0.3)
            await asyncio.wait_for(canned.closed.wait(), 2)  # the engine sees the close: it aborts
            assert pool.idle(url) == 0
    run(go())


def test_a_kept_connection_the_engine_closed_is_retried_once_on_a_new_one_and_a_refused_one_fails():
    async def go():
        # The first connection answers once then drops the next request unanswered (as an engine closing an
        # idle connection while the request went out); the request goes again, on a new connection.
        canned = Canned(CONTENT_LENGTH, None, CONTENT_LENGTH)
        async with canned as url:
            pool = Pool(1.0)
            async with await post(pool, url) as first:
                await first.read()
            async with await post(pool, url) as second:
                assert await second.read() == b'{"a": true}'
            assert (pool.connects, len(canned.requests)) == (2, 3)
        with pytest.raises(ConnectFailed):
            await post(Pool(1.0), f"http://127.0.0.1:{closed_port()}")
        garbage = Canned(b"SPDY/9 nonsense\r\n\r\n")
        async with garbage as url:
            with pytest.raises(UpstreamError, match="not valid HTTP"):
                await post(Pool(1.0), url)
    run(go())


def test_a_new_connection_that_fails_unanswered_is_not_sent_again():
    async def go():
        # A kept connection dropped unanswered goes once more on a new one; that one dropped too, the request fails
        # (retry.py rule 1: only a reused connection's failure is resent).
        canned = Canned(CONTENT_LENGTH, None, None)
        async with canned as url:
            pool = Pool(1.0)
            async with await post(pool, url) as first:
                await first.read()
            with pytest.raises(UpstreamError):
                await post(pool, url)
            assert (pool.connects, len(canned.requests)) == (2, 3)
    run(go())


def test_each_request_on_a_kept_connection_gets_its_own_whole_first_byte_deadline():
    """The connection's one head timer (expect_head_by) is armed by the first request: a later request on it
    waits its own whole `timeout` for a head, then fails with TimeoutError, and the connection is closed."""
    async def go():
        loop = asyncio.get_running_loop()
        pool = Pool(1.0)
        conn = _Connection(pool, "http://10.0.0.7:8000")
        conn.connection_made(transport := FakeTransport())
        pool.put(conn)  # the kept connection the request takes (no method patched: compiled, they are read-only)
        first = asyncio.ensure_future(pool.request("http://10.0.0.7:8000", "POST", "/", [], b"", 0.4))
        await asyncio.sleep(0)
        conn.data_received(CONTENT_LENGTH)
        async with await first as response:
            await response.read()
        await asyncio.sleep(0.25)  # the first request's deadline passes while the second waits
        started = loop.time()
        with pytest.raises(TimeoutError):
            await pool.request("http://10.0.0.7:8000", "POST", "/", [], b"", 0.4)
        return loop.time() - started, transport.closed
    waited, closed = run(go())
    assert 0.38 <= waited < 3 and closed


def test_an_idle_connection_past_the_keepalive_is_not_used():
    async def go():
        canned = Canned(CONTENT_LENGTH, CONTENT_LENGTH)
        async with canned as url:
            pool = Pool(1.0, keepalive=0.05)
            async with await post(pool, url) as first:
                await first.read()
            await asyncio.sleep(0.1)
            async with await post(pool, url) as second:
                await second.read()
            assert pool.connects == 2
    run(go())


def test_the_router_keeps_one_engine_connection_for_requests_in_turn_and_none_for_a_stream_cut_short():
    async def go():
        engine = await FakeEngine("e0").start()
        router = routed(engine)
        async with serving(router) as client:
            for stream in (False, True) * 5:  # whole bodies and streams (chunked) alike
                body = {"model": "m", "prompt": "hi", "stream": stream}
                async with client.post("/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    await resp.read()
            assert router.upstream.connects == 1
            resp = await client.post("/v1/completions", json={"model": "m", "prompt": "long", "stream": True})
            await resp.content.readexactly(len(b"data: started\n\n"))
            resp.close()  # the client goes: the engine's connection is closed, not kept
            await until("the engine to see the hang-up", lambda: engine.aborted)
            url = f"http://127.0.0.1:{engine.port}"
            await until("the connection to leave the pool", lambda: router.upstream.idle(url) == 0)
            async with client.post("/v1/completions", json={"model": "m", "prompt": "hi"}) as resp:
                assert resp.status == 200
            assert router.upstream.connects == 2
        await engine.stop()
    run(go())


def test_a_kept_connection_the_engine_closes_leaves_the_pool_and_no_entry_behind():
    async def go():
        async with Canned(CONTENT_LENGTH, close=True) as url:  # answers, then closes the idle connection
            pool = Pool(1.0)
            async with await post(pool, url) as response:
                await response.read()
            await until("the closed connection to leave the pool", lambda: url not in pool._idle)
            assert pool.idle(url) == 0 and not pool._open
    run(go())


def test_kept_verdicts_and_headers_answer_as_the_first_time():
    """upstream_fields keeps a verdict per field name and response_headers its result per engine fields:
    a later request with other fields (a Connection naming one, another spelling) is not answered
    from the first one's."""
    fields = [(b"X-Forwarded-For", b"1.2.3.4"), (b"x-request-id", b"r"), (b"COOKIE", b"c"), (b"Accept", b"*/*")]
    first = upstream_fields(fields, None)
    assert first == [b"x-request-id: r\r\n", b"Accept: */*\r\n"]
    assert upstream_fields([*fields, (b"connection", b"X-Request-Id")], None) == [b"Accept: */*\r\n"]
    assert upstream_fields(fields, "Bearer k") == [*first, b"Authorization: Bearer k\r\n"]
    assert upstream_fields([(b"x-forwarded-host", b"h"), (b"X-REQUEST-ID", b"s")], None) == [b"X-REQUEST-ID: s\r\n"]
    engine = [(b"Content-Type", b"application/json"), (b"Content-Length", b"2")]
    assert list(response_headers(engine, drop_length=True).items()) == [("Content-Type", "application/json")]
    assert list(response_headers(engine).items()) == [("Content-Type", "application/json"), ("Content-Length", "2")]
    assert list(response_headers([*engine, (b"Connection", b"content-type")]).items()) == [("Content-Length", "2")]


def test_the_media_type_and_length_read_as_the_engine_spelled_them_and_the_kept_types_stay_bounded(monkeypatch):
    """Response.content_type keeps what it read per field value (an engine sends a few): the same answer kept or not,
    and no more values kept than MAX_MEDIA_TYPES however many an engine invents."""
    from kaon_operator.router import upstream
    monkeypatch.setattr(upstream, "_MEDIA_TYPES", {})
    response = Response(_Connection(Pool(1.0), "http://10.0.0.7:8000"))
    for value, expected in [(b"Text/Event-Stream; charset=utf-8", "text/event-stream"),
                            (b" application/json ", "application/json"), (b"", "application/octet-stream")]:
        for _ in range(2):  # read, then kept
            response._type = value
            assert response.content_type == expected, value
    for i in range(upstream.MAX_MEDIA_TYPES + 50):
        response._type = b"application/x-%d" % i
        assert response.content_type == f"application/x-{i}"
    assert len(upstream._MEDIA_TYPES) == upstream.MAX_MEDIA_TYPES
    for value, expected in [(b"12", 12), (b" 12 ", 12), (b"1x", None), (b"-1", None), (None, None)]:
        response._length = value
        assert response.content_length == expected, value


def test_length_lines_and_reason_phrases_are_kept_bounded(monkeypatch):
    """The Content-Length lines and the engines' reason phrases kept per value: the same bytes as made afresh, and no
    more kept than their bounds however many sizes and phrases come."""
    from kaon_operator.router import upstream
    monkeypatch.setattr(upstream, "_LENGTH_LINES", {})
    monkeypatch.setattr(upstream, "_REASONS", {})
    for size in range(upstream.MAX_LENGTH_LINES + 30):
        assert upstream.content_length_line(size) == b"Content-Length: %d\r\n" % size
    assert len(upstream._LENGTH_LINES) == upstream.MAX_LENGTH_LINES
    for i in range(upstream.MAX_REASONS + 30):
        raw = b"HTTP/1.1 200 Fine %d\r\nContent-Length: 2\r\n\r\nok" % i
        response, body = fed(raw, [len(raw)])
        assert (response.reason, body) == (f"Fine {i}", b"ok")
    assert len(upstream._REASONS) == upstream.MAX_REASONS
