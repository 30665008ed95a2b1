"""Abuse: what careless or hostile clients cost the router and the engine (issue 38).

    .venv/bin/python bench/abuse.py [--stalled 10000] [--uploads 60] [--seconds 12] [--slow-readers 100]

Router: a real router process (its real listening edge, the default limits) in front of a
stand-in engine, hit by `--stalled` connections that send half a request head and stop, and
`--uploads` requests that announce a 4 MiB body and send none of it; then, against a stand-in
engine that streams without end, `--slow-readers` clients that ask for a stream and never read
it (the router's --write-timeout set to 5 s): the router's memory before, at the peak and
after, and whether every one was dropped and its engine stream cancelled in time. Engine: a real
`kaon serve` (SmolLM2-135M, CPU) hit by 8 prompts of 3.8 MB, 4 requests with 200,000 stop
strings and n=4, and 4 with n=4 x top_logprobs=20 x max_tokens=4096, all at once. Both
record /health's slowest answer while under abuse, the resident memory before and at the
peak, the answers by status, and whether an ordinary request is still answered.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "runtime"), str(ROOT / "operator"), str(ROOT)])}
MODEL = "builtin://smollm2-135m-instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def wait_ready(url: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(url)


class Watch:
    """/health's slowest answer and the process's peak memory while the abuse runs."""

    def __init__(self, health_url: str, pid: int):
        self.url, self.pid = health_url, pid
        self.worst, self.peak, self.failures, self.done = 0.0, 0.0, 0, False

    async def run(self) -> None:
        async with httpx.AsyncClient(timeout=30) as http:
            while not self.done:
                start = time.monotonic()
                try:
                    ok = (await http.get(self.url)).status_code == 200
                except httpx.TransportError:
                    ok = False
                self.failures += not ok
                self.worst = max(self.worst, time.monotonic() - start)
                self.peak = max(self.peak, rss_mib(self.pid))
                await asyncio.sleep(0.05)


# ---- router ---------------------------------------------------------------------------------------------------

ROUTER_CHILD = """
import asyncio, random, sys
from aiohttp import web
from kaon_operator.router import edge
from kaon_operator.router.config import RouterConfig
from kaon_operator.router.endpoints import EndpointTable
from kaon_operator.router.proxy import Router
from tests.support.router import isvc, pod

port, admin, engine_port = map(int, sys.argv[1:4])
write_timeout = float(sys.argv[4]) if len(sys.argv) > 4 else RouterConfig().write_timeout
streaming = 0

async def engine():
    async def answer(request):
        global streaming
        body = await request.json()
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": "ok"}]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        streaming += 1
        try:
            while True:  # a generation with ignore_eos and a large max_tokens, 800 KB/s
                await response.write(b"data: " + b"x" * 8192 + b"\\n\\n")
                await asyncio.sleep(0.01)
        except ConnectionError:  # the router cancelled it
            return response
        finally:
            streaming -= 1
    async def count(request):
        return web.json_response({"streaming": streaming})
    app = web.Application()
    app.router.add_post("/v1/{tail:.+}", answer)
    app.router.add_get("/streaming", count)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", engine_port).start()

async def main():
    await engine()
    table = EndpointTable(default_namespace="ns")
    table.apply_service("ADDED", isvc("svc", "m"))
    table.apply_pod("ADDED", pod("e", "svc", port=engine_port))
    table.synced = True
    router = Router(table, RouterConfig(write_timeout=write_timeout), rng=random.Random(0))
    c = router.config
    async with edge.serving(router.app(), "127.0.0.1", port, max_connections=c.max_connections,
                            header_timeout=c.header_timeout, refused=router.metrics.overloaded.inc):
        async with edge.serving(router.admin_app(), "127.0.0.1", admin, max_connections=64,
                                header_timeout=c.header_timeout):
            await asyncio.Event().wait()

asyncio.run(main())
"""


async def stall(port: int, data: bytes, out: Counter, outcomes: list) -> asyncio.StreamWriter | None:
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(data)
        await writer.drain()
    except OSError:
        out["connect failed"] += 1
        return None

    async def outcome():
        try:
            first = await reader.read(12)
            out[first.decode(errors="replace").strip() or "closed"] += 1
        except OSError:
            out["reset"] += 1
    outcomes.append(asyncio.create_task(outcome()))
    return writer


def router_abuse(args) -> dict:
    port, admin, engine_port = free_port(), free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-c", ROUTER_CHILD, str(port), str(admin), str(engine_port)],
                            env=ENV, cwd=ROOT)
    try:
        wait_ready(f"http://127.0.0.1:{admin}/health", 30)
        return asyncio.run(_router_abuse(args, port, admin, proc.pid))
    finally:
        proc.terminate()
        proc.wait(10)


async def _router_abuse(args, port: int, admin: int, pid: int) -> dict:
    before = rss_mib(pid)
    watch = Watch(f"http://127.0.0.1:{admin}/health", pid)
    watcher = asyncio.create_task(watch.run())
    out: Counter = Counter()
    outcomes: list[asyncio.Task] = []
    head = b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
    upload = head + f"Content-Length: {4 << 20}\r\n\r\n".encode()
    writers = [await stall(port, upload, out, outcomes) for _ in range(args.uploads)]
    writers += [await stall(port, head, out, outcomes) for _ in range(args.stalled)]
    started = time.monotonic()
    ordinary = None
    async with httpx.AsyncClient(timeout=5) as http:
        while time.monotonic() - started < args.seconds + 5:
            try:
                r = await http.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": "m", "prompt": "x"})
                out[f"ordinary {r.status_code}"] += 1
                if r.status_code == 200:
                    ordinary = time.monotonic() - started
                    break
            except httpx.TransportError as exc:
                out[f"ordinary {type(exc).__name__}"] += 1
            await asyncio.sleep(0.5)
    await asyncio.sleep(max(0.0, args.seconds - (time.monotonic() - started)))
    watch.done = True
    await watcher
    for w in writers:
        if w is not None:
            w.close()
    await asyncio.gather(*outcomes)
    return {"stalled": args.stalled, "uploads": args.uploads, "rss_before_mib": round(before, 1),
            "rss_peak_mib": round(watch.peak, 1), "health_worst_ms": round(watch.worst * 1000, 1),
            "health_failures": watch.failures, "answers": dict(out),
            "ordinary_request_answered_after_s": None if ordinary is None else round(ordinary, 2)}


def slow_reader_abuse(args) -> dict:
    port, admin, engine_port = free_port(), free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-c", ROUTER_CHILD, str(port), str(admin), str(engine_port),
                             str(SLOW_READER_DEADLINE_S)], env=ENV, cwd=ROOT)
    try:
        wait_ready(f"http://127.0.0.1:{admin}/health", 30)
        return asyncio.run(_slow_readers(args.slow_readers, port, engine_port, proc.pid))
    finally:
        proc.terminate()
        proc.wait(10)


SLOW_READER_DEADLINE_S = 5.0


async def _slow_readers(count: int, port: int, engine_port: int, pid: int) -> dict:
    loop = asyncio.get_running_loop()
    body = b'{"model": "m", "prompt": "x", "stream": true, "ignore_eos": true, "max_tokens": 1000000}'
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    before = rss_mib(pid)
    readers, peak = [], before
    for _ in range(count):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await loop.sock_connect(sock, ("127.0.0.1", port))
        await loop.sock_sendall(sock, request)
        readers.append(sock)
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=30) as http:
        async def streaming() -> int:
            return (await http.get(f"http://127.0.0.1:{engine_port}/streaming")).json()["streaming"]
        most = 0
        while time.monotonic() - started < 120:  # each stream first fills the kernel's buffers (MBs)
            most = max(most, await streaming())
            peak = max(peak, rss_mib(pid))
            if most and not await streaming():
                break
            await asyncio.sleep(0.1)
        cancelled_after = time.monotonic() - started
        left = await streaming()
        ordinary = (await http.post(f"http://127.0.0.1:{port}/v1/completions",
                                    json={"model": "m", "prompt": "x"})).status_code
    await asyncio.sleep(1)
    after = rss_mib(pid)
    dropped = 0
    for sock in readers:  # the router reset them: what they had received is gone with them
        sock.setblocking(True)
        sock.settimeout(0.5)
        until = time.monotonic() + 1
        try:
            while sock.recv(1 << 20):
                if time.monotonic() > until:
                    break  # still streaming: not dropped
            else:
                dropped += 1
        except ConnectionResetError:
            dropped += 1
        except TimeoutError:
            pass
        sock.close()
    return {"slow_readers": count, "write_timeout_s": SLOW_READER_DEADLINE_S, "engine_streams_at_most": most,
            "engine_streams_left": left, "all_cancelled_after_s": round(cancelled_after, 1),
            "clients_dropped": dropped, "rss_before_mib": round(before, 1), "rss_peak_mib": round(peak, 1),
            "rss_after_mib": round(after, 1), "ordinary_request": ordinary}


# ---- engine ---------------------------------------------------------------------------------------------------


def engine_abuse() -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(ROOT / "bench" / "out" / "abuse-serve.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kaon_runtime.cli", "serve", "--model", MODEL, "--port",
                                 str(port), "--device", "cpu", "--dtype", "float32", "--log-level", "warning"],
                                env=ENV, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_ready(f"{url}/ready")
            return asyncio.run(_engine_abuse(url, proc.pid))
        finally:
            proc.terminate()
            proc.wait(30)


async def _engine_abuse(url: str, pid: int) -> dict:
    before = rss_mib(pid)
    watch = Watch(f"{url}/health", pid)
    watcher = asyncio.create_task(watch.run())
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}]}
    bodies = ([{"model": MODEL, "prompt": "word " * 760_000, "max_tokens": 1}] * 8
              + [{"model": MODEL, "prompt": "Once", "stop": [f"s{i}" for i in range(200_000)], "n": 4}] * 4
              + [{**chat, "n": 4, "logprobs": True, "top_logprobs": 20, "max_tokens": 4096}] * 4)
    paths = ["/v1/completions"] * 12 + ["/v1/chat/completions"] * 4
    async with httpx.AsyncClient(timeout=120) as http:
        start = time.monotonic()

        async def send(path, body):
            r = await http.post(url + path, content=json.dumps(body), headers={"Content-Type": "application/json"})
            return r.status_code, time.monotonic() - start
        answers = await asyncio.gather(*(send(p, b) for p, b in zip(paths, bodies, strict=True)))
        ordinary = await http.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 8})
    watch.done = True
    await watcher
    return {"rss_before_mib": round(before, 1), "rss_peak_mib": round(watch.peak, 1),
            "health_worst_ms": round(watch.worst * 1000, 1), "health_failures": watch.failures,
            "answers": dict(Counter(status for status, _ in answers)),
            "slowest_answer_s": round(max(t for _, t in answers), 2),
            "ordinary_request": ordinary.status_code}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stalled", type=int, default=10_000)
    parser.add_argument("--uploads", type=int, default=60)
    parser.add_argument("--seconds", type=float, default=12.0, help="how long the router abuse is held")
    parser.add_argument("--slow-readers", type=int, default=100,
                        help="clients that ask for a stream and never read it")
    parser.add_argument("--skip-engine", action="store_true")
    args = parser.parse_args()
    (ROOT / "bench" / "out").mkdir(exist_ok=True)
    results = {"router": router_abuse(args), "router_slow_readers": slow_reader_abuse(args)}
    if not args.skip_engine:
        results["engine"] = engine_abuse()
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
