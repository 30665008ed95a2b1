"""The router's cost: the same load sent straight to fake engines, through nginx and
through the router, in the same run.

    python bench/router.py [--duration 10] [--concurrency 64] [--streams 1000] [--no-nginx] [--compiled]
                           [--base DIR [--base-compiled]] [--rounds 6] [--round-seconds 4]

Four processes: fake engines (one aiohttp process listening on --engines ports: a fixed
small completion, or a short SSE stream), the router (kaon's Router on a table that lists
those ports as the pods of one InferenceService), nginx as the router's peer (one worker
process, as the router is one process: `upstream { least_conn; keepalive }` over the same
ports, buffering off so that streams pass through as they come), and this load generator.
With --compiled, one more router process runs this tree's data path compiled with mypyc, as kaon-router does
when built (kaon_operator/router/compiled.py: `make install` builds it), beside the source.
With --base, one more runs another tree's operator/
(a checkout from before a change: label routed-base), so that a change is measured with its sockets in one run;
with --base-compiled as well, that tree's compiled build (compiled against compiled).
nginx is the Debian package: found on PATH or in /usr/sbin, else installed with apt-get when
this runs as root (it says so), else left out. Phases, each direct, then nginx, then routed:

1. latency: one request at a time; p50/p99 of the round trip. Added = routed - direct.
2. throughput: --concurrency clients in a closed loop for --duration; requests/s.
   2b. the same load alternated: --rounds rounds of --round-seconds each through nginx and each router, the
   order turned every round (nginx, routed; routed, nginx; ...), so that a drift of the machine (another
   process, a frequency change) falls on both alike. Each round gives router/nginx requests/s, side by side
   in time; the median of the rounds is the figure, their spread (min-max) printed beside it, with the
   median CPU per request of each. One run's single ratio of phase 2 moved by +-0.04 from run to run.
3. streams: --streams clients, each opening one stream after another (--events events,
   --gap-ms apart) for --duration, so that many streams are open at once; time to first
   byte p50/p99, and every error.

The router's own histogram (kaon_router_added_latency_seconds: handler start to the
upstream request, plus passing the headers back) is printed too. It leaves out time spent
queued in either event loop before a handler runs, so under saturation it is far below the
round-trip difference, which counts that queueing (the load generator's included: all three
processes share the machine). The issue's goal: under 2 ms added at P99 with 1,000
concurrent streams and no errors.

One file past 300 lines on purpose: every process above is this script started with its --role,
so that one command runs them all side by side with the same code and arguments.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web

ROOT = Path(__file__).resolve().parents[1]
OPERATOR_ENV = "KAON_BENCH_ROUTER_OPERATOR"
"""Set for the --base router's process: the operator/ it imports."""
COMPILED_ENV = "KAON_BENCH_ROUTER_COMPILED"
"""Set for the --compiled router's process: it runs the build of its sources (compiled.py), or fails."""
sys.path.insert(0, os.environ.get(OPERATOR_ENV) or str(ROOT / "operator"))
sys.path.insert(0, str(ROOT))  # e2e
if os.environ.get(COMPILED_ENV):  # before the data path is imported below, as kaon-router's start does
    from kaon_operator.router import compiled

    compiled.activate("require")

from e2e.control_plane import free_port  # noqa: E402
from kaon_operator.labels import service_labels  # noqa: E402
from kaon_operator.router import edge  # noqa: E402
from kaon_operator.router.endpoints import EndpointTable  # noqa: E402
from kaon_operator.router.main import quiet_gc  # noqa: E402
from kaon_operator.router.proxy import Router  # noqa: E402

MODEL = "bench"
COMPLETION = json.dumps({
    "id": "cmpl-bench", "object": "text_completion", "created": 0, "model": MODEL,
    "choices": [{"index": 0, "text": " a fixed, small completion", "finish_reason": "stop", "logprobs": None}],
    "usage": {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}}).encode()
REQUEST = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6}


def event(i: int) -> bytes:
    chunk = {"id": "cmpl-bench", "object": "text_completion", "model": MODEL,
             "choices": [{"index": 0, "text": f" token{i}", "finish_reason": None}]}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def raise_open_file_limit() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# the two servers (run as child processes of this script) --------------------------------


def run_engines(ports: list[int], events: int, gap: float) -> None:
    stream = [event(i) for i in range(events)] + [b"data: [DONE]\n\n"]

    async def completions(request: web.Request) -> web.StreamResponse:
        if not json.loads(await request.read()).get("stream"):
            return web.Response(body=COMPLETION, content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i, chunk in enumerate(stream):
            if i:
                await asyncio.sleep(gap)
            await response.write(chunk)
        await response.write_eof()
        return response

    async def main() -> None:
        runners = []
        for port in ports:
            app = web.Application()
            app.router.add_post("/v1/completions", completions)
            runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port, backlog=4096).start()
            runners.append(runner)
        await asyncio.Event().wait()

    asyncio.run(main())


NGINX_CONF = """\
worker_processes 1;
worker_rlimit_nofile 65536;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 16384; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    upstream engines {{
        least_conn;
{servers}
        keepalive 512;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        client_max_body_size 4m;
        location / {{
            proxy_pass http://engines;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 300s;
        }}
    }}
}}
"""


def find_nginx() -> str | None:
    """nginx on PATH or in /usr/sbin; else installed from Debian's package when root."""
    found = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin")
    if found or os.geteuid() != 0 or not shutil.which("apt-get"):
        return found
    print("nginx not found: installing the Debian package with apt-get (apt-get update first)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", "nginx"], check=True, env=env, stdout=subprocess.DEVNULL)
    return shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin")


def start_nginx(nginx: str, port: int, engine_ports: list[int], workdir: Path) -> subprocess.Popen:
    workdir.mkdir(parents=True, exist_ok=True)
    workdir.chmod(0o777)  # workers drop root; they write their temp files here
    servers = "\n".join(f"        server 127.0.0.1:{p};" for p in engine_ports)
    conf = workdir / "nginx.conf"
    conf.write_text(NGINX_CONF.format(dir=workdir, port=port, servers=servers))
    return subprocess.Popen([nginx, "-p", str(workdir), "-c", str(conf)])


def nginx_version(nginx: str) -> str:
    return subprocess.run([nginx, "-v"], capture_output=True, text=True).stderr.strip().removeprefix("nginx version: ")


def new_loop(kind: str) -> asyncio.AbstractEventLoop:
    """asyncio's event loop, or uvloop's (libuv, in C): kaon-router's own when installed (router/event_loop.py)."""
    if kind == "uvloop":
        import uvloop
        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def run_router(port: int, engine_ports: list[int], loop: str) -> None:
    table = EndpointTable(default_namespace="bench")  # clients send the bare name
    table.apply_service("ADDED", {"metadata": {"name": MODEL, "namespace": "bench"}, "spec": {"model": {}}})
    for i, engine_port in enumerate(engine_ports):
        table.apply_pod("ADDED", {
            "metadata": {"name": f"{MODEL}-{i}", "namespace": "bench", "labels": service_labels(MODEL)},
            "spec": {"containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": engine_port}]}]},
            "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}})
    table.synced = True
    router = Router(table)

    async def serve() -> None:  # behind the listening edge kaon-router uses (its own server: router/front.py)
        config = router.config
        async with edge.serving(router.app(), "127.0.0.1", port, max_connections=config.max_connections,
                                header_timeout=config.header_timeout):
            quiet_gc()  # as kaon-router does once it listens (router/main.py)
            await asyncio.Event().wait()

    new_loop(loop).run_until_complete(serve())


# the load generator -------------------------------------------------------------------


@dataclass
class Result:
    latencies: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    done: int = 0
    seconds: float = 0.0
    cpu: float = 0.0
    """CPU seconds the proxy (nginx or the router) used over the phase."""

    def error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


class Targets:
    """Round-robin over the URLs (the engines when direct, the router when routed)."""

    def __init__(self, urls: list[str]):
        self.urls, self.i = urls, 0

    def next(self) -> str:
        self.i += 1
        return self.urls[self.i % len(self.urls)] + "/v1/completions"


async def one(session: aiohttp.ClientSession, url: str, result: Result, stream: bool) -> None:
    start = time.perf_counter()
    try:
        async with session.post(url, json={**REQUEST, "stream": stream}) as resp:
            if resp.status != 200:
                result.error(f"HTTP {resp.status}")
                await resp.read()
                return
            if stream:
                first = await resp.content.readany()
                result.latencies.append(time.perf_counter() - start)
                body = first + await resp.content.read()
                if not body.endswith(b"data: [DONE]\n\n"):
                    result.error("stream cut short")
                    return
            else:
                await resp.read()
                result.latencies.append(time.perf_counter() - start)
            result.done += 1
    except (TimeoutError, aiohttp.ClientError) as exc:
        result.error(type(exc).__name__)


async def closed_loop(urls: list[str], clients: int, seconds: float, stream: bool) -> Result:
    result, targets = Result(), Targets(urls)
    deadline = time.perf_counter() + seconds
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
        async def client(delay: float) -> None:
            await asyncio.sleep(delay)  # ramp up: a thousand connects at once are a SYN flood, not load
            while time.perf_counter() < deadline:
                await one(session, targets.next(), result, stream)

        start = time.perf_counter()
        await asyncio.gather(*(client(i * 0.5 / clients if stream else 0) for i in range(clients)))
        result.seconds = time.perf_counter() - start
    return result


async def sequential(urls: list[str], count: int) -> Result:
    result, targets = Result(), Targets(urls)
    async with aiohttp.ClientSession() as session:
        for _ in range(count // 10):  # warm the connection pools
            await one(session, targets.next(), Result(), False)
        for _ in range(count):
            await one(session, targets.next(), result, False)
    return result


async def router_added_latency(router_url: str) -> tuple[float, float, int]:
    """P50 and P99 from the router's own histogram (upper bucket bounds), and its count."""
    async with aiohttp.ClientSession() as session, session.get(router_url + "/metrics") as resp:
        text = await resp.text()
    buckets = []
    for line in text.splitlines():
        if line.startswith("kaon_router_added_latency_seconds_bucket"):
            le = line.split('le="')[1].split('"')[0]
            buckets.append((float(le), float(line.rsplit(" ", 1)[1])))
    total = buckets[-1][1]

    def quantile(q: float) -> float:
        return next(le for le, count in buckets if count >= q * total)

    return quantile(0.5), quantile(0.99), int(total)


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f}"


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time the processes have used (and, for nginx's master, its workers')."""
    total, tick = 0.0, os.sysconf("SC_CLK_TCK")
    for pid in pids:
        children = Path(f"/proc/{pid}/task/{pid}/children")
        kin = [int(c) for c in children.read_text().split()] if children.exists() else []
        for one in (pid, *kin):
            try:
                fields = Path(f"/proc/{one}/stat").read_text().rsplit(")", 1)[1].split()
            except FileNotFoundError:
                continue
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


async def measured(pids: list[int], load) -> Result:
    """Run the load; note the CPU the proxy in front of the engines spent on it (none: direct)."""
    before = cpu_seconds(pids)
    result = await load
    result.cpu = cpu_seconds(pids) - before
    return result


def rate(r: Result) -> float:
    return r.done / r.seconds if r.seconds else float("nan")


def report(name: str, results: dict[str, Result]) -> None:
    """One line per way of sending; then what nginx and the router add over direct."""
    for label, r in results.items():
        throughput = f"{rate(r):8.0f} req/s" if r.seconds else ""
        cpu = f"  proxy CPU {r.cpu / r.done * 1e6:5.0f} us/request" if r.cpu and r.done else ""
        print(f"  {name:10} {label:6}: n={r.done:6d} p50 {ms(percentile(r.latencies, 0.5))} ms  "
              f"p99 {ms(percentile(r.latencies, 0.99))} ms {throughput}  errors {r.errors or 0}{cpu}")
    direct = results["direct"]
    for label, r in results.items():
        if label == "direct":
            continue
        print(f"  {name:10} {label} added: p50 {ms(percentile(r.latencies, 0.5) - percentile(direct.latencies, 0.5))} "
              f"ms  p99 {ms(percentile(r.latencies, 0.99) - percentile(direct.latencies, 0.99))} ms"
              + (f"  throughput {rate(r) / rate(direct):.2f}x direct" if direct.seconds and direct.done else ""))
    if "nginx" in results and results["nginx"].seconds and results["nginx"].done:
        for label in (label for label in results if label.startswith("routed")):
            print(f"  {name:10} {label}/nginx throughput {rate(results[label]) / rate(results['nginx']):.2f}x")


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def rounds_order(proxied: list[str], round_index: int) -> list[str]:
    """The ways measured in this round, turned by one each round: nginx first, then second, ..."""
    turn = round_index % len(proxied)
    return proxied[turn:] + proxied[:turn]


async def alternating(ways: dict[str, list[str]], pids: dict[str, list[int]], args) -> None:
    """Phase 2b: nginx and each router in turn, --rounds times; the median of each round's router/nginx ratio."""
    proxied = [way for way in ways if way != "direct"]
    print(f"2b. throughput alternated, {args.concurrency} clients, {args.rounds} rounds of {args.round_seconds:g}s "
          f"per way (order turned each round: {', '.join(proxied)})")
    rates: dict[str, list[float]] = {way: [] for way in proxied}
    cpus: dict[str, list[float]] = {way: [] for way in proxied}
    for i in range(args.rounds):
        line = []
        for way in rounds_order(proxied, i):
            r = await measured(pids[way], closed_loop(ways[way], args.concurrency, args.round_seconds, False))
            if r.errors:
                print(f"  round {i + 1} {way}: errors {r.errors}")
            rates[way].append(rate(r))
            cpus[way].append(r.cpu / r.done * 1e6 if r.done else float("nan"))
            line.append(f"{way} {rate(r):.0f} req/s ({cpus[way][-1]:.0f} us)")
        print(f"  round {i + 1}: " + ", ".join(line))
    for way in proxied:
        print(f"  alternated {way:15}: median {median(rates[way]):8.0f} req/s (min {min(rates[way]):.0f}, max "
              f"{max(rates[way]):.0f})  proxy CPU median {median(cpus[way]):5.0f} us/request "
              f"(min {min(cpus[way]):.0f}, max {max(cpus[way]):.0f})")
    for way in (way for way in proxied if way.startswith("routed")):
        ratios = [a / b for a, b in zip(rates[way], rates["nginx"])]
        print(f"  alternated {way}/nginx throughput median {median(ratios):.2f}x (rounds: "
              f"{' '.join(f'{x:.2f}' for x in ratios)}; spread {min(ratios):.2f}-{max(ratios):.2f}); CPU "
              f"{median(cpus[way]) / median(cpus['nginx']):.2f}x nginx's")


async def wait_listening(port: int) -> None:
    for _ in range(1200):  # a minute: a loaded machine starts a Python process slowly
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            await asyncio.sleep(0.05)
    raise SystemExit(f"nothing listens on {port}")


async def bench(args) -> None:
    engine_ports = [free_port() for _ in range(args.engines)]
    router_ports, nginx_port = {loop: free_port() for loop in args.loops}, free_port()
    nginx = None if args.no_nginx else find_nginx()
    me = [sys.executable, __file__]
    children = [
        subprocess.Popen(me + ["--role", "engines", "--ports", ",".join(map(str, engine_ports)),
                               "--events", str(args.events), "--gap-ms", str(args.gap_ms)]),
        *(subprocess.Popen(me + ["--role", "router", "--loops", loop,
                                 "--ports", ",".join(map(str, [router_port, *engine_ports]))])
          for loop, router_port in router_ports.items()),
    ]
    routers = {loop: child for loop, child in zip(args.loops, children[1:])}
    others = {label: tree for label, tree in (("routed-compiled", ROOT if args.compiled else None),
                                              ("routed-base", args.base)) if tree}
    other_ports = {label: free_port() for label in others}
    other_processes = {}
    for label, tree in others.items():  # another tree's router (compiled, or before a change), on the first --loops
        other_processes[label] = subprocess.Popen(
            me + ["--role", "router", "--loops", args.loops[0],
                  "--ports", ",".join(map(str, [other_ports[label], *engine_ports]))],
            env={**os.environ, OPERATOR_ENV: str(tree.resolve() / "operator"),
                 **({COMPILED_ENV: "1"} if label == "routed-compiled" or (label == "routed-base" and args.base_compiled)
                    else {})})
        children.append(other_processes[label])
    workdir = Path(tempfile.mkdtemp(prefix="kaon-bench-nginx-"))
    if nginx:
        children.append(nginx_process := start_nginx(nginx, nginx_port, engine_ports, workdir))
    elif args.no_nginx:
        print("nginx: left out (--no-nginx)")
    else:
        print("nginx: not found and not installable here (not root, or no apt-get): left out")
    try:
        for port in (*engine_ports, *router_ports.values(), *([nginx_port] if nginx else []),
                     *other_ports.values()):
            await wait_listening(port)
        ways = {"direct": [f"http://127.0.0.1:{p}" for p in engine_ports]}
        pids: dict[str, list[int]] = {"direct": []}
        if nginx:
            ways["nginx"] = [f"http://127.0.0.1:{nginx_port}"]
            pids["nginx"] = [nginx_process.pid]
        for loop, router_port in router_ports.items():  # "routed": the first --loops, the router's default
            way = "routed" if loop == args.loops[0] else f"routed-{loop}"
            ways[way] = [f"http://127.0.0.1:{router_port}"]
            pids[way] = [routers[loop].pid]
        for label, port in other_ports.items():
            ways[label], pids[label] = [f"http://127.0.0.1:{port}"], [other_processes[label].pid]
        print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; {args.engines} fake engines; "
              f"Python {sys.version.split()[0]}, aiohttp {aiohttp.__version__}"
              + (f", nginx {nginx_version(nginx)} ({nginx})" if nginx else ""))
        print(f"1. latency, one request at a time ({args.requests} requests)")
        report("latency", {way: await measured(pids[way], sequential(urls, args.requests))
                           for way, urls in ways.items()})
        print(f"2. throughput, {args.concurrency} clients, {args.duration:g}s")
        report("throughput", {
            way: await measured(pids[way], closed_loop(urls, args.concurrency, args.duration, False))
            for way, urls in ways.items()})
        if "nginx" in ways and args.rounds > 0:
            await alternating(ways, pids, args)
        print(f"3. {args.streams} concurrent streams of {args.events} events {args.gap_ms:g} ms apart, "
              f"{args.duration:g}s; latency = time to first byte")
        report("streams", {way: await measured(pids[way], closed_loop(urls, args.streams, args.duration, True))
                           for way, urls in ways.items()})
        p50, p99, count = await router_added_latency(ways["routed"][0])  # the first --loops
        print(f"router's own added-latency histogram over {count} requests: p50 <= {ms(p50)} ms, p99 <= {ms(p99)} ms")
    finally:
        for child in children:
            child.terminate()  # nginx: a fast shutdown
            child.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per throughput and streams phase")
    parser.add_argument("--requests", type=int, default=2000, help="requests in the latency phase")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--events", type=int, default=20, help="events per stream")
    parser.add_argument("--gap-ms", type=float, default=50.0, help="time between a stream's events")
    parser.add_argument("--engines", type=int, default=2, help="fake engine pods (ports of one process)")
    parser.add_argument("--no-nginx", action="store_true", help="leave nginx, the router's peer, out")
    parser.add_argument("--loops", nargs="+", choices=["asyncio", "uvloop"], default=["asyncio"],
                        help="the router's event loop (uvloop: kaon-router's default, a dependency); several: one "
                             "router process each, all measured in this run")
    parser.add_argument("--compiled", action="store_true", help="also a router process running this tree's data "
                        "path compiled (kaon_operator/router/compiled.py's build; label routed-compiled)")
    parser.add_argument("--base", type=Path, help="also a router process importing DIR/operator: another tree, e.g. "
                        "before a change (measured beside the others, label routed-base)")
    parser.add_argument("--base-compiled", action="store_true", help="the --base tree's router runs its compiled "
                        "build (made there by `make install`, found by its sources' key), to compare compiled with "
                        "compiled")
    parser.add_argument("--rounds", type=int, default=6, help="phase 2b: rounds of nginx and the routers in turn "
                        "(0: none)")
    parser.add_argument("--round-seconds", type=float, default=4.0, help="phase 2b: seconds per way and round")
    parser.add_argument("--role", choices=["bench", "engines", "router"], default="bench", help=argparse.SUPPRESS)
    parser.add_argument("--ports", help=argparse.SUPPRESS)
    args = parser.parse_args()
    raise_open_file_limit()
    ports = [int(p) for p in args.ports.split(",")] if args.ports else []
    if args.role == "engines":
        run_engines(ports, args.events, args.gap_ms / 1000)
    elif args.role == "router":
        run_router(ports[0], ports[1:], args.loops[0])
    else:
        asyncio.run(bench(args))


if __name__ == "__main__":
    main()
