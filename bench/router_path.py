"""The router's own CPU per request without sockets: its Python path alone, measured in one process.

    python bench/router_path.py [--requests 20000] [--clients 64] [--loop uvloop] [--stream] [--profile]

bench/router.py measures the router beside nginx, with the fake engines and the load generator on the same
cores, so that its CPU figure moves with whatever else runs. This one feeds the router's own server (front.py)
a client's request bytes and its engine client (upstream.py) the engine's answer bytes through stand-in
transports, with no socket, no kernel and no other process in the path: what is left is the router's Python
(parsers' callbacks, the handler, the pool, the relay, the metrics) and its event loop's scheduling. The bytes
are those aiohttp's client and server send in bench/router.py. --clients connections take turns, each with one
request in flight (bench/router.py's closed loop); the engine answers on the next turn of the loop, as a socket
would. The figure is CPU seconds of this process per request (time.process_time), the loop's overhead and the
stand-ins' included (the same in every tree): compare trees with `--tree`, in one run. --profile prints
cProfile's top functions (its own overhead inflates small calls).
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

REQUEST_BODY = json.dumps({"model": "bench", "prompt": "Once upon a time", "max_tokens": 6, "stream": False}).encode()
STREAM_BODY = json.dumps({"model": "bench", "prompt": "Once upon a time", "max_tokens": 6, "stream": True}).encode()


def client_request(body: bytes) -> bytes:
    """A request as aiohttp's client (bench/router.py's load) sends it."""
    return (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nAccept: */*\r\n"
            b"Accept-Encoding: gzip, deflate\r\nUser-Agent: Python/3.11 aiohttp/3.14.5\r\nContent-Length: %d\r\n"
            b"Content-Type: application/json\r\n\r\n"
            % len(body)) + body


def engine_answer(stream: bool) -> bytes:
    """An answer as aiohttp's server (bench/router.py's fake engines) sends it."""
    if not stream:
        body = json.dumps({"id": "cmpl-bench", "object": "text_completion", "created": 0, "model": "bench",
                           "choices": [{"index": 0, "text": " a fixed, small completion", "finish_reason": "stop",
                                        "logprobs": None}],
                           "usage": {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}}).encode()
        return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json; charset=utf-8\r\nContent-Length: %d\r\n"
                b"Date: Sun, 29 Nov 2026 22:01:00 GMT\r\nServer: Python/3.11 aiohttp/3.14.5\r\n\r\n" % len(body)) + body
    events = [b"data: " + json.dumps({"id": "cmpl-bench", "object": "text_completion", "model": "bench",
                                      "choices": [{"index": 0, "text": f" token{i}", "finish_reason": None}]}).encode()
              + b"\n\n" for i in range(3)] + [b"data: [DONE]\n\n"]
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events)
    return (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nDate: Sun, 29 Nov 2026 22:01:00 GMT\r\n"
            b"Server: Python/3.11 aiohttp/3.14.5\r\nTransfer-Encoding: chunked\r\n\r\n") + chunks + b"0\r\n\r\n"


class ClientSide:
    """The router's transport to one client: counts the answers it is written (one whole answer ends with its body's
    last byte: the Content-Length's, or the last chunk)."""

    def __init__(self, done, stream: bool):
        self.done, self.stream = done, stream
        self.closing = False

    def write(self, data: bytes) -> None:
        if data.endswith(b"0\r\n\r\n" if self.stream else b'"total_tokens": 10}}'):
            self.done()

    def writelines(self, lines) -> None:
        self.write(b"".join(lines))

    def get_extra_info(self, name, default=None):
        return ("127.0.0.1", 40000) if name == "peername" else default

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def can_write_eof(self) -> bool:
        return False

    def abort(self) -> None:
        self.closing = True


class EngineSide:
    """The router's transport to one engine connection: each request written is answered on the loop's next turn."""

    def __init__(self, loop, answer: bytes):
        self.loop, self.answer = loop, answer
        self.protocol = None

    def write(self, data: bytes) -> None:
        self.loop.call_soon(self.protocol.data_received, self.answer)

    def writelines(self, lines) -> None:
        self.write(b"".join(lines))

    def get_extra_info(self, name, default=None):
        return default

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def run(tree: Path, requests: int, clients: int, loop_kind: str, stream: bool, profile: bool,
        compiled: bool = False) -> float:
    sys.path.insert(0, str(tree / "operator"))
    if compiled:  # the build of the tree's data path (kaon_operator/router/compiled.py), as kaon-router runs it
        from kaon_operator.router import compiled as build

        build.activate("require")
    from kaon_operator.labels import service_labels
    from kaon_operator.router.endpoints import EndpointTable
    from kaon_operator.router.main import quiet_gc
    from kaon_operator.router.proxy import Router
    from kaon_operator.router.upstream import Pool, _Connection

    if loop_kind == "uvloop":
        import uvloop
        loop = uvloop.new_event_loop()
    else:
        loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    table = EndpointTable(default_namespace="bench")
    table.apply_service("ADDED", {"metadata": {"name": "bench", "namespace": "bench"}, "spec": {"model": {}}})
    for i in range(2):
        table.apply_pod("ADDED", {
            "metadata": {"name": f"bench-{i}", "namespace": "bench", "labels": service_labels("bench")},
            "spec": {"containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": 9000 + i}]}]},
            "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}})
    table.synced = True
    router = Router(table)
    request = client_request(STREAM_BODY if stream else REQUEST_BODY)
    answer = engine_answer(stream)

    async def main() -> float:
        router.upstream = pool = Pool(router.config.connect_timeout, keepalive=1e9)
        for endpoint in table.endpoints(next(iter(s.key for s in table.services()))):
            for _ in range(clients):  # kept-alive engine connections, as after bench/router.py's warm-up
                conn = _Connection(pool, endpoint.url)
                conn.connection_made(EngineSide(loop, answer))
                conn.transport.protocol = conn
                pool._open.add(conn)
                pool.put(conn)
        front = router.front(60.0)
        counts = {"issued": 0, "answered": 0}
        finished = loop.create_future()

        def issue(proto) -> None:
            counts["issued"] += 1
            loop.call_soon(proto.data_received, request)

        def answered(proto) -> None:
            counts["answered"] += 1
            if counts["answered"] >= requests:
                if not finished.done():
                    finished.set_result(None)
            elif counts["issued"] < requests:
                issue(proto)  # the client's next request on its kept-alive connection (a closed loop)

        protocols = []
        for _ in range(clients):
            proto = front()
            side = ClientSide(None, stream)
            side.done = lambda p=proto: answered(p)
            proto.connection_made(side)
            protocols.append(proto)
        quiet_gc()  # as kaon-router does once it listens (router/main.py)
        started = time.process_time()
        for proto in protocols:
            issue(proto)
        await finished
        return (time.process_time() - started) / requests

    profiler = cProfile.Profile() if profile else None
    if profiler:
        profiler.enable()
    try:
        cost = loop.run_until_complete(main())
    finally:
        if profiler:
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(35)
    return cost


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    parser.add_argument("--stream", action="store_true", help="SSE streams of 4 events instead of whole answers")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--tree", type=Path, default=HERE.parent, help="the tree whose operator/ is measured")
    parser.add_argument("--compiled", action="store_true", help="its data path compiled (the build compiled.py "
                        "finds for its sources: `python -m kaon_operator.router.compiled build` first)")
    args = parser.parse_args()
    cost = run(args.tree, args.requests, args.clients, args.loop, args.stream, args.profile, args.compiled)
    label = f"{args.tree}{' compiled' if args.compiled else ''}"
    print(f"{label}: {cost * 1e6:.1f} us CPU/request ({args.requests} requests, {args.clients} clients, "
          f"{args.loop}{', streams' if args.stream else ''})")


if __name__ == "__main__":
    main()
