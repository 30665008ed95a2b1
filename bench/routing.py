"""Routing strategies on real engines: least-connections vs prefix-affinity (and kv-aware), in the same run.

    python bench/routing.py [--replicas 3] [--repeats 2] [--workloads chat long pressure skewed] [--kv-blocks N]
                            [--strategies least-connections prefix-affinity kv-aware]

Starts --replicas `kaon serve` processes (builtin://smollm2-135m-instruct, --max-num-seqs 4,
prefix caching on) and, for each strategy, kaon's Router in this process on an endpoint
table fed by hand (no Kubernetes). Three workloads, each run under both strategies:

- chat: --conversations conversations, starting --stagger seconds apart, --turns turns each,
  all with one shared system prompt (--system: long, ~100 tokens, or short, one line); every
  turn resends the conversation so far (with the replies the engine gave) plus a new user
  message of --words words, streamed, max_tokens
  --max-tokens, greedy; between turns the user "thinks" for --think seconds (uniform), so
  other conversations' requests arrive in between. (With no think time, least-connections
  sends a closed-loop conversation's next turn back to the pod it just left, the one with a
  slot just freed: an artifact of the load generator, not what users do.)
- long: --long-conversations conversations of --long-turns turns, user messages of
  --long-words words, and replies of --reply-tokens tokens (uniform, ignore_eos) that go back
  into the history, so that the part of the prompt only one conversation has grows turn by
  turn, as in a chat people actually hold (the chat workload's shared system prompt is about
  half of every prompt, which least-connections finds cached on every replica too).
- pressure: long's conversations, --pressure-conversations of them (24), meant to run with
  --kv-blocks: KV pools smaller than the conversations' histories, as in a deployment whose
  caches hold fewer conversations than it serves. The engines' default pool (1 GiB, about
  1450 blocks of 16 tokens for this model) holds every workload here whole on every replica,
  so nothing is ever evicted and a conversation finds its history on any pod it visited
  before. Each phase prints its working set: the tokens of every conversation's history at
  its longest, in blocks.
- skewed: --skewed single-turn chats from --workers closed-loop workers; two in three are the
  same hot request (one system prompt and one question), the rest each unique.

Each phase gets its own system prompt (a phase number in front), so that no phase finds its
prefixes cached by an earlier one (under --kv-blocks an earlier phase's blocks are evicted, least
recently used first, as the phase needs room). Reported per phase: the engines' prefix-cache hit rate
(kaon_prefix_cache_hits_total / queries_total, deltas summed over replicas), TTFT p50/p99
(client side, to the first content chunk), requests/s and output chunks/s over the phase,
the in-flight requests per replica (sampled every 20 ms: each replica's time average, max
over mean, and the peak), the router's affinity hits and overrides, and the 1-minute load
average of the machine at the phase's start and end (the cores may be shared), and the prompt
tokens each replica prefilled (not served from its cache): its prefill work, which equal
in-flight counts can hide.

--repeats N runs every workload N times, the two strategies back to back each time in
alternating order (LC PA, then PA LC, ...), so that a drift of the machine's load hits both
alike; it prints each repeat, then per workload the median and range over the repeats, the
TTFT percentiles of all repeats pooled, and the paired ratios (each repeat's prefix-affinity
against its own least-connections phase).
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "operator"))
sys.path.insert(0, str(ROOT))

from e2e.control_plane import free_port  # noqa: E402
from kaon_operator.labels import service_labels  # noqa: E402
from kaon_operator.router import kv_feed  # noqa: E402
from kaon_operator.router.endpoints import EndpointTable, ServiceKey  # noqa: E402
from kaon_operator.router.kv_index import block_keys  # noqa: E402
from kaon_operator.router.proxy import Router  # noqa: E402

MODEL = "builtin://smollm2-135m-instruct"
BLOCK_TOKENS = 16  # the engine's KV block
SERVED = "smollm2"
WORDS = ("river mill harbor lantern orchard signal ledger meadow furnace compass quarry beacon glacier tavern "
         "canal archive bridge forest engine garden market palace valley tower window winter summer copper").split()
SYSTEM_PROMPTS = {"long": (
          "You are the support assistant of the Northwind river ferry company. Answer in one short sentence. "
          "Timetables: boats leave the north pier every twenty minutes from six in the morning until eleven at "
          "night, and the south pier ten minutes later. Tickets are sold on board and at both piers; bicycles "
          "travel free, dogs on a lead travel free, and cars are not carried. In fog the first boat waits for "
          "the harbor master's signal. Lost property is kept at the north pier office for thirty days. "),
    # A one-line prompt, as many chat deployments use: what every request shares is then little,
    # and a conversation's own history is most of its prompt.
    "short": "You are a helpful assistant. "}


def system_message(args, tag: int) -> dict:
    """The phase's shared system prompt: its own per phase, so no phase finds another's cached."""
    return {"role": "system", "content": f"Phase {tag}. " + SYSTEM_PROMPTS[args.system]}


def question(rng: random.Random, n: int = 24) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)) + "?"


@dataclass
class Phase:
    ttft: list[float] = field(default_factory=list)
    chunks: int = 0
    done: int = 0
    failed: int = 0
    seconds: float = 0.0
    samples: list[dict] = field(default_factory=list)
    working_set: int = 0
    """Tokens of every conversation's history at its longest (its last prompt and reply): what
    the engines would have to keep to serve every turn's history from the cache."""
    requests: dict[str, dict] = field(default_factory=dict)
    """Per request (by the `user` tag the workload gave it): its kind, when it was sent, its
    TTFT, and the pod the router chose with every pod's requests in flight at that moment."""


class Routers:
    """The router replicas' URLs, taken in turn per request (as a Service in front of them spreads
    connections): each replica chooses with only its own in-flight counts and its own index."""

    def __init__(self, urls: list[str]):
        self.urls, self.i = urls, -1

    def next(self) -> str:
        self.i += 1
        return self.urls[self.i % len(self.urls)]


def predicted_tokens(kv, key: ServiceKey, pod: str, path: str, payload: dict) -> int | None:
    """The prompt tokens the kv-aware index said `pod` held when the router chose it (None when it
    could not tell: no tokenizer yet, or no block size heard from the pods)."""
    tokenizer = kv.feed._tokenizers.get(key)
    block_size = kv.index.block_size(pod) or next(
        (b for b in map(kv.index.block_size, kv.index.pods()) if b), None)
    ids = tokenizer.prompt_ids(path, payload) if tokenizer is not None else None
    if ids is None or block_size is None:
        return None
    return kv.index.match(pod, block_keys(ids[:-1], block_size)).blocks * block_size


async def ask(session: aiohttp.ClientSession, url: str | Routers, messages: list[dict], max_tokens: int, phase: Phase,
              ignore_eos: bool = False, tag: str | None = None) -> tuple[str, int]:
    """The reply, and the tokens of prompt and reply together (the conversation's length now).
    `tag` ("kind:id") goes as OpenAI's `user` field, which the engine ignores, so that the
    router's choice can be matched to the request (run_phase)."""
    body = {"model": SERVED, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if tag:
        body["user"] = tag
    if ignore_eos:
        body["ignore_eos"] = True
    if isinstance(url, Routers):
        url = url.next()
    start, first, text, tokens, cached = time.perf_counter(), None, [], 0, None
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            phase.failed += 1
            await resp.read()
            return "", 0
        async for line in resp.content:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["total_tokens"]
                cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
            if not chunk["choices"]:  # the usage chunk
                continue
            piece = (chunk["choices"][0].get("delta") or {}).get("content") or ""
            if piece:
                first = first or time.perf_counter()
                text.append(piece)
                phase.chunks += 1
    if first is None:
        phase.failed += 1
        return "", tokens
    phase.ttft.append(first - start)
    if tag:
        phase.requests.setdefault(tag, {}).update(kind=tag.split(":")[0], sent=start, ttft=first - start,
                                                  cached_tokens=cached)
    phase.done += 1
    return "".join(text), tokens


async def chat_workload(session, url, args, tag: int, phase: Phase) -> None:
    system = system_message(args, tag)

    async def conversation(i: int) -> None:
        rng = random.Random(tag * 1000 + i)
        await asyncio.sleep(i * args.stagger)  # conversations start one after another
        messages = [system]
        for turn in range(args.turns):
            if turn:  # the user reads and types: other conversations' requests come in meanwhile
                await asyncio.sleep(rng.uniform(*args.think))
            messages.append({"role": "user", "content": question(rng, args.words)})
            reply, tokens = await ask(session, url, messages, args.max_tokens, phase, tag=f"turn{turn}:{i}")
            messages.append({"role": "assistant", "content": reply or "(no answer)"})
        phase.working_set += tokens

    await asyncio.gather(*(conversation(i) for i in range(args.conversations)))


async def history_workload(session, url, args, tag: int, phase: Phase, conversations: int) -> None:
    """`conversations` conversations of --long-turns turns whose replies go back into the history."""
    system = system_message(args, tag)

    async def conversation(i: int) -> None:
        rng = random.Random(tag * 1000 + i)
        await asyncio.sleep(i * args.stagger)
        messages = [system]
        for turn in range(args.long_turns):
            if turn:
                await asyncio.sleep(rng.uniform(*args.think))
            messages.append({"role": "user", "content": question(rng, args.long_words)})
            reply, tokens = await ask(session, url, messages, rng.randint(*args.reply_tokens), phase,
                                      ignore_eos=True, tag=f"turn{turn}:{i}")
            messages.append({"role": "assistant", "content": reply or "(no answer)"})
        phase.working_set += tokens

    await asyncio.gather(*(conversation(i) for i in range(conversations)))


async def long_workload(session, url, args, tag: int, phase: Phase) -> None:
    await history_workload(session, url, args, tag, phase, args.long_conversations)


async def pressure_workload(session, url, args, tag: int, phase: Phase) -> None:
    await history_workload(session, url, args, tag, phase, args.pressure_conversations)


async def skewed_workload(session, url, args, tag: int, phase: Phase) -> None:
    rng = random.Random(tag)
    system = system_message(args, tag)
    hot = [system, {"role": "user", "content": "When does the first boat leave the north pier, and in fog?"}]
    queue = [(f"hot:{i}", hot) if rng.random() < 2 / 3 else
             (f"unique:{i}", [system, {"role": "user", "content": question(rng)}]) for i in range(args.skewed)]

    async def worker() -> None:
        while queue:
            request_tag, messages = queue.pop()
            await ask(session, url, messages, args.max_tokens, phase, tag=request_tag)

    await asyncio.gather(*(worker() for _ in range(args.workers)))


async def engine_counters(session, ports: list[int]) -> dict[int, tuple[float, float]]:
    out = {}
    for port in ports:
        async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
            text = await resp.text()
        values = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name in ("kaon_prefix_cache_hits_total", "kaon_prefix_cache_queries_total"):
                values[name] = float(value)
        out[port] = (values["kaon_prefix_cache_hits_total"], values["kaon_prefix_cache_queries_total"])
    return out


def build_table(ports: list[int], strategy: str, load_bound: float, max_num_seqs: int) -> EndpointTable:
    table = EndpointTable(default_namespace="bench")  # clients send the bare name
    table.apply_service("ADDED", {"metadata": {"name": "bench", "namespace": "bench"},
                                  "spec": {"model": {"servedName": SERVED}, "engine": {"maxNumSeqs": max_num_seqs},
                                           "routing": {"strategy": strategy, "loadBound": load_bound}}})
    for i, port in enumerate(ports):
        table.apply_pod("ADDED", {
            "metadata": {"name": f"bench-{i}", "namespace": "bench", "labels": service_labels("bench")},
            "spec": {"containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": port}]}]},
            "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}})
    table.synced = True
    return table


async def run_phase(workload, strategy: str, ports: list[int], args, tag: int) -> dict:
    phase = Phase()
    routers, runners, urls, feeds = [], [], [], []
    for replica in range(args.routers):  # each replica its own table, in-flight counts and KV index
        table = build_table(ports, strategy, args.load_bound, args.max_num_seqs)
        router = Router(table, rng=random.Random(tag * 10 + replica))
        kv = None
        if strategy == "kv-aware":  # the engines share one host: each publishes its KV events on ports of its own
            kv = router.strategies.get("kv-aware").inner
            kv.feed.ports = lambda e: EVENT_PORTS[int(e.url.rsplit(":", 1)[1])]
            feeds.append(kv.feed)
        trace(router, phase, replica, kv)
        runner = web.AppRunner(router.app(), handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        routers.append(router)
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}/v1/chat/completions")
    url = urls[0] if len(urls) == 1 else Routers(urls)
    endpoints = routers[0].table.endpoints(ServiceKey("bench", "bench"))
    stop = asyncio.Event()

    def inflight(e) -> int:  # every replica's requests to the pod
        return sum(r.inflight.get(e, 0) for r in routers)

    async def sample() -> None:
        while not stop.is_set():
            phase.samples.append({e.pod: inflight(e) for e in endpoints})
            await asyncio.sleep(0.02)

    load_start = os.getloadavg()[0]
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
            before = await engine_counters(session, ports)
            sampler = asyncio.create_task(sample())
            start = time.perf_counter()
            await workload(session, url, args, tag, phase)
            phase.seconds = time.perf_counter() - start
            stop.set()
            await sampler
            after = await engine_counters(session, ports)
            router_metrics = ""
            for one in urls:
                async with session.get(one.replace("/v1/chat/completions", "/metrics")) as resp:
                    router_metrics += await resp.text()
    finally:
        for runner in runners:
            await runner.cleanup()
        for feed in feeds:
            await feed.close()
    hits = sum(after[p][0] - before[p][0] for p in ports)
    queries = sum(after[p][1] - before[p][1] for p in ports)
    busy = [s for s in phase.samples if any(s.values())]
    mean_per = {pod: sum(s[pod] for s in busy) / max(1, len(busy)) for pod in (e.pod for e in endpoints)}
    overall = sum(mean_per.values()) / len(mean_per)

    def counter(name: str) -> float:  # summed over the router replicas
        return sum(float(line.rsplit(" ", 1)[1]) for line in router_metrics.splitlines()
                   if line.startswith(name + "{"))

    ttft = sorted(phase.ttft)
    return {"strategy": strategy, "requests": phase.done, "failed": phase.failed, "seconds": phase.seconds,
            "hit_rate": hits / queries if queries else float("nan"), "prompt_tokens": queries,
            "ttft_p50": percentile(ttft, 0.5), "ttft_p99": percentile(ttft, 0.99),
            "req_s": phase.done / phase.seconds, "chunks_s": phase.chunks / phase.seconds,
            "inflight_mean": mean_per, "imbalance": max(mean_per.values()) / overall if overall else float("nan"),
            "peak": max((max(s.values()) for s in busy), default=0),
            "affinity_hits": counter("kaon_router_affinity_hits_total"),
            "affinity_overrides": counter("kaon_router_affinity_overrides_total"),
            "ttft": ttft, "load_start": load_start, "load_end": os.getloadavg()[0],
            "working_set_blocks": -(-phase.working_set // BLOCK_TOKENS),
            # Prompt tokens each replica computed (not served from its cache): the prefill work
            # it got, which equal in-flight counts can hide.
            "prefilled": [round((after[p][1] - before[p][1]) - (after[p][0] - before[p][0])) for p in ports],
            "per_request": phase.requests, "precision": precision(phase.requests)}


def trace(router: Router, phase: Phase, replica: int, kv) -> None:
    """Note the router's choice per request, with the loads it saw and (kv-aware) the prompt tokens
    its index said the chosen pod held (a bench's peek inside)."""
    choose = router._pick

    def traced(key, ready, usable, path, payload):
        target = choose(key, ready, usable, path, payload)
        if isinstance(payload.get("user"), str):
            phase.requests.setdefault(payload["user"], {}).update(
                pod=target.pod, router=replica, loads={e.pod: router.inflight.get(e, 0) for e in ready},
                predicted=predicted_tokens(kv, key, target.pod, path, payload) if kv is not None else None)
        return target

    router._pick = traced


def precision(requests: dict[str, dict]) -> dict:
    """kv-aware's routing precision: of the requests sent to a pod the index said held part of the
    prompt, the share whose engine found at least that much cached (usage.prompt_tokens_details.
    cached_tokens); and how the others fell short."""
    said = [r for r in requests.values() if r.get("predicted") and r.get("cached_tokens") is not None]
    held = [r for r in said if r["cached_tokens"] >= r["predicted"]]
    short = sorted(r["predicted"] - r["cached_tokens"] for r in said if r["cached_tokens"] < r["predicted"])
    return {"said": len(said), "held": len(held), "precision": len(held) / len(said) if said else float("nan"),
            "short_tokens": short,
            "predicted_tokens": sum(r["predicted"] for r in said),
            "cached_tokens": sum(r["cached_tokens"] for r in said)}


def percentile(ordered: list[float], q: float) -> float:
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


EVENT_PORTS: dict[int, tuple[int, int]] = {}  # an engine's HTTP port -> its KV events and replay ports (kv-aware)


def distinct_port(taken: set[int]) -> int:
    """A free port none of the engines was given yet (free_port may hand out a port twice: it is free until bound)."""
    while (port := free_port()) in taken:
        pass
    taken.add(port)
    return port


def start_engines(n: int, args, logs: Path) -> tuple[list[subprocess.Popen], list[int]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "runtime"), "OMP_NUM_THREADS": str(args.threads)}
    procs, ports, taken = [], [], set()
    for i in range(n):
        port = distinct_port(taken)
        cmd = [sys.executable, "-m", "kaon_runtime.cli", "serve", "--model", MODEL, "--served-model-name", SERVED,
               "--port", str(port), "--max-num-seqs", str(args.max_num_seqs), "--enable-prefix-caching"]
        if args.kv_blocks:
            cmd += ["--num-kv-blocks", str(args.kv_blocks)]
        if args.max_queue_wait is not None:
            cmd += ["--max-queue-wait", str(args.max_queue_wait)]
        if "kv-aware" in args.strategies:
            EVENT_PORTS[port] = (distinct_port(taken), distinct_port(taken))
            cmd += ["--kv-events-config", json.dumps({
                "enable_kv_cache_events": True, "publisher": "zmq", "topic": kv_feed.TOPIC,
                "endpoint": f"tcp://127.0.0.1:{EVENT_PORTS[port][0]}",
                "replay_endpoint": f"tcp://127.0.0.1:{EVENT_PORTS[port][1]}"})]
        procs.append(subprocess.Popen(cmd, stdout=(logs / f"routing_engine_{i}.log").open("w"),
                                      stderr=subprocess.STDOUT, env=env))
        ports.append(port)
    return procs, ports


async def wait_ready(procs, ports, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        for proc, port in zip(procs, ports):
            while True:
                if proc.poll() is not None:
                    raise SystemExit(f"engine on {port} exited with {proc.returncode}; see bench/out")
                try:
                    async with session.get(f"http://127.0.0.1:{port}/ready") as resp:
                        if resp.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit(f"engine on {port} not ready after {timeout}s")
                await asyncio.sleep(0.5)
        # Warm each engine up (first-call costs), with a prompt no phase shares.
        warm = Phase()
        for port in ports:
            await ask(session, f"http://127.0.0.1:{port}/v1/chat/completions",
                      [{"role": "user", "content": "Warm up."}], 4, warm)


def show(name: str, r: dict) -> None:
    loads = " ".join(f"{v:.2f}" for v in r["inflight_mean"].values())
    print(f"  {name:6} #{r['repeat']} {r['strategy']:17} load {r['load_start']:4.1f}->{r['load_end']:4.1f} "
          f"{r['seconds']:5.0f}s n={r['requests']:3d} fail={r['failed']} hit {r['hit_rate']:6.1%}  "
          f"TTFT p50 {r['ttft_p50']:6.3f}s p99 {r['ttft_p99']:6.3f}s  {r['req_s']:5.2f} req/s "
          f"{r['chunks_s']:6.1f} tok/s  in-flight per replica [{loads}] max/mean {r['imbalance']:.2f} "
          f"peak {r['peak']}  affinity hits {r['affinity_hits']:.0f} overrides {r['affinity_overrides']:.0f}"
          + f"  prefilled per replica {r['prefilled']}"
          + (f"  working set {r['working_set_blocks']} blocks" if r["working_set_blocks"] else ""))
    p = r["precision"]
    if p["said"]:
        print(f"  {name:6} #{r['repeat']} {r['strategy']:17} routing precision {p['held']}/{p['said']} = "
              f"{p['precision']:.3f} (requests whose chosen pod the index said held part of the prompt, and whose "
              f"engine found at least that much cached); tokens said {p['predicted_tokens']}, found "
              f"{p['cached_tokens']}; short by {p['short_tokens']}")


def spread(values: list[float], fmt: str) -> str:
    """The median, and the range when there are several."""
    mid = format(statistics.median(values), fmt)
    return mid if len(values) == 1 else f"{mid} [{format(min(values), fmt)}..{format(max(values), fmt)}]"


def summarize(rows: list[dict], names: list[str]) -> None:
    print("summary: median [min..max] over repeats; TTFT also pooled over the repeats' requests")
    for name in names:
        by = {s: [r for r in rows if r["workload"] == name and r["strategy"] == s]
              for s in dict.fromkeys(r["strategy"] for r in rows)}
        for strategy, rs in by.items():
            pooled = sorted(t for r in rs for t in r["ttft"])
            print(f"  {name:6} {strategy:17} hit {spread([r['hit_rate'] for r in rs], '.1%')}  "
                  f"TTFT p50 {spread([r['ttft_p50'] for r in rs], '.2f')}s "
                  f"p99 {spread([r['ttft_p99'] for r in rs], '.2f')}s "
                  f"(pooled n={len(pooled)}: p50 {percentile(pooled, 0.5):.2f}s p99 {percentile(pooled, 0.99):.2f}s)  "
                  f"req/s {spread([r['req_s'] for r in rs], '.2f')}  "
                  f"max/mean {spread([r['imbalance'] for r in rs], '.2f')} "
                  f"peak {spread([r['peak'] for r in rs], 'g')}  load {min(r['load_start'] for r in rs):.1f}-"
                  f"{max(max(r['load_start'], r['load_end']) for r in rs):.1f}")
        if "kv-aware" in by:
            said = sum(r["precision"]["said"] for r in by["kv-aware"])
            held = sum(r["precision"]["held"] for r in by["kv-aware"])
            if said:
                print(f"  {name:6} kv-aware routing precision, all repeats: {held}/{said} = {held / said:.3f} "
                      f"({by['kv-aware'][0]['routers']} router replicas)")
            for base in ("prefix-affinity", "least-connections"):
                kv_pairs = list(zip(by.get(base, []), by["kv-aware"]))
                hits = " ".join(f"{kv['hit_rate'] / b['hit_rate']:.2f}x" for b, kv in kv_pairs)
                p50s = " ".join(f"{kv['ttft_p50'] / b['ttft_p50'] - 1:+.0%}" for b, kv in kv_pairs)
                p99s = " ".join(f"{kv['ttft_p99'] / b['ttft_p99'] - 1:+.0%}" for b, kv in kv_pairs)
                print(f"  {name:6} kv-aware vs {base}, per repeat: hit rate {hits}; TTFT p50 {p50s}; p99 {p99s}")
        if "least-connections" not in by or "prefix-affinity" not in by:
            continue
        pairs = list(zip(by["least-connections"], by["prefix-affinity"]))
        hit = [pa["hit_rate"] / lc["hit_rate"] for lc, pa in pairs]
        p50 = [pa["ttft_p50"] / lc["ttft_p50"] - 1 for lc, pa in pairs]
        p99 = [pa["ttft_p99"] / lc["ttft_p99"] - 1 for lc, pa in pairs]
        thr = [pa["req_s"] / lc["req_s"] for lc, pa in pairs]
        print(f"  {name:6} prefix-affinity vs least-connections, per repeat: hit rate "
              f"{' '.join(f'{x:.2f}x' for x in hit)}; TTFT p50 {' '.join(f'{x:+.0%}' for x in p50)}; "
              f"p99 {' '.join(f'{x:+.0%}' for x in p99)} (negative: lower); throughput "
              f"{' '.join(f'{x:.2f}x' for x in thr)}")


async def bench(args) -> list[dict]:
    logs = ROOT / "bench" / "out"
    logs.mkdir(parents=True, exist_ok=True)
    procs, ports = start_engines(args.replicas, args, logs)
    rows = []
    try:
        await wait_ready(procs, ports, args.ready_timeout)
        commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
        print(f"commit {commit}; python {sys.version.split()[0]}, torch {importlib.metadata.version('torch')}, "
              f"aiohttp {importlib.metadata.version('aiohttp')}; {args.repeats} repeats of {' '.join(args.workloads)}")
        print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; {args.replicas} replicas, "
              f"--max-num-seqs {args.max_num_seqs}, max_tokens {args.max_tokens}, loadBound {args.load_bound}, "
              f"KV pool per replica: {f'{args.kv_blocks} blocks' if args.kv_blocks else 'the default (1 GiB)'}")
        tag = 0
        workloads = {"chat": chat_workload, "long": long_workload, "pressure": pressure_workload,
                     "skewed": skewed_workload}
        strategies = tuple(args.strategies)
        for repeat in range(args.repeats):
            for name in args.workloads:
                for strategy in (strategies if repeat % 2 == 0 else strategies[::-1]):
                    tag += 1
                    row = await run_phase(workloads[name], strategy, ports, args, tag)
                    row["workload"], row["repeat"], row["routers"] = name, repeat, args.routers
                    show(name, row)
                    rows.append(row)
                    if args.json:  # after every phase, so that an interrupted run keeps what it measured
                        args.json.write_text(json.dumps(rows, indent=2))
        summarize(rows, args.workloads)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=60)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--routers", type=int, default=1,
                        help="router replicas, each its own in-flight counts and KV index; requests go to them in turn")
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--conversations", type=int, default=18)
    parser.add_argument("--stagger", type=float, default=0.5, help="seconds between conversation starts")
    parser.add_argument("--think", type=float, nargs=2, default=(1.0, 4.0), help="seconds between turns (range)")
    parser.add_argument("--words", type=int, default=48, help="words per user message")
    parser.add_argument("--system", choices=sorted(SYSTEM_PROMPTS), default="long",
                        help="the system prompt every conversation shares: long (~100 tokens of a ferry "
                             "company's facts) or short (one line)")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--long-conversations", type=int, default=12)
    parser.add_argument("--long-turns", type=int, default=5)
    parser.add_argument("--long-words", type=int, default=24, help="words per user message (long workload)")
    parser.add_argument("--reply-tokens", type=int, nargs=2, default=(32, 64),
                        help="reply length range of the long workload (tokens, ignore_eos)")
    parser.add_argument("--pressure-conversations", type=int, default=24,
                        help="conversations of the pressure workload (as long's, more of them)")
    parser.add_argument("--kv-blocks", type=int,
                        help="KV pool per replica in blocks of 16 tokens (kaon serve --num-kv-blocks); default: 1 GiB")
    parser.add_argument("--skewed", type=int, default=72, help="requests in the skewed workload")
    parser.add_argument("--workers", type=int, default=12, help="closed-loop clients of the skewed workload")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--load-bound", type=float, default=1.25)
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per engine")
    parser.add_argument("--max-queue-wait", type=float,
                        help="the engines' admission limit (kaon serve --max-queue-wait; 0: none). Default: the "
                             "engine's (30 s), whose 503s count as failed requests when a loaded machine slows all")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--strategies", nargs="+", default=["least-connections", "prefix-affinity"],
                        choices=["least-connections", "prefix-affinity", "kv-aware"],
                        help="run in this order, reversed every other repeat (kv-aware: the engines publish KV events)")
    parser.add_argument("--workloads", nargs="+", default=["chat", "long", "skewed"],
                        choices=["chat", "long", "pressure", "skewed"])
    parser.add_argument("--ready-timeout", type=float, default=600,
                        help="seconds the engines may take to start (8 of them on a loaded 2-core machine: minutes)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    asyncio.run(bench(args))


if __name__ == "__main__":
    main()
