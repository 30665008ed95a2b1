"""InferenceRoute (issue 52): the classifier, the cost against sending everything to the top tier, the
quality monitor's agreement and the response cache, through the real router to real engines, in one run.

    .venv/bin/python bench/routing_tiers.py [--max-tokens 16] [--threshold 0.92] [--classifier-only]

The labelled sets were written for this benchmark: bench/data/routing_tiers.jsonl (24 short factual
questions labelled simple, 16 multi-step analyses labelled complex) and bench/data/routing_cache_pairs.jsonl
(20 questions, each with a paraphrase that should share its answer and a near miss that must not). They
were written by the author of the rule set, knowing its rules: the classifier's accuracy here is an
upper bound, not a held-out figure.

The learned classifier (`kaon route train`: softmax regression on all-MiniLM-L6-v2 embeddings, the
encoder run in this process, the same vectors the embedder serves) is measured beside the rules two
ways: 5-fold stratified cross-validation on routing_tiers.jsonl (each prompt scored by a model fitted on
the other 32; the rules score the same prompts), and fitted on all 40 then scored on
bench/data/routing_tiers_unseen.jsonl (12 simple, 12 complex, written afterwards by the learned mode's
author, who knew the rules and phrased the complex ones mostly without their reasoning keywords: a stress
test of the rules, not a neutral sample). Scoring is the router's own path (routes/learned.py).
`--classifier-only` prints these and stops (no engines).

Three `kaon serve` processes: tiers `small` and `large` both of the bundled SmolLM2-135M (the same model:
the quality gap between tiers is then nil, and the figures measure the mechanism), and the embedder,
all-MiniLM-L6-v2 (`--model builtin://all-minilm-l6-v2 --task embed`, kaon's BERT encoder: mean pooling
and normalization as its sentence-transformers config says). The router runs in this process on a free
port, fed by hand (no cluster).

Printed: the classifier's accuracy and time per request; the route's engine-token cost against the same
requests sent to the top tier alone (a route of one tier, the comparison, in the same run) and the
ratio; the monitor's agreement (verify.fraction 1: every small-tier answer re-asked of `large`); the
cache's exact hit rate on repeats, the semantic hit rate on paraphrases and false-hit rate on near
misses at --threshold, and the threshold sweep that shows where those two cross.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from kaon_operator.router.config import RouterConfig  # noqa: E402
from kaon_operator.router.endpoints import EndpointTable  # noqa: E402
from kaon_operator.router.proxy import Router  # noqa: E402
from kaon_operator.router.route_gateway import RouteGateway  # noqa: E402
from kaon_operator.routes import classifier  # noqa: E402
from kaon_operator.routes.table import RouteTable  # noqa: E402
from support.router import isvc, pod, serving_in_thread  # noqa: E402
from support.server import Server  # noqa: E402

NS = "bench"
SERVED = {"small": "smollm2-small", "large": "smollm2-large", "embed": "all-minilm-l6-v2"}
EMBEDDER = "builtin://all-minilm-l6-v2"
COSTS = {"small": 0.10, "large": 1.00}


def load(name: str) -> list[dict]:
    return [json.loads(line) for line in (ROOT / "bench" / "data" / name).read_text().splitlines() if line.strip()]


def classifier_figures(rows: list[dict]) -> tuple[float, float, float]:
    right = sum(classifier.classify(r["prompt"], [1.5], 2).tier == (r["label"] == "complex") for r in rows)
    times = []
    for _ in range(20):
        for r in rows:
            start = time.perf_counter()
            classifier.classify(r["prompt"], [1.5], 2)
            times.append(time.perf_counter() - start)
    times.sort()
    return right / len(rows), statistics.mean(times) * 1e6, times[int(0.99 * len(times))] * 1e6


def learned_figures(rows: list[dict], unseen: list[dict], folds: int = 5) -> None:
    from kaon_operator.routes import learned
    from kaon_operator.routes.api import LearnedModel
    from kaon_runtime.server import route_train

    started = time.perf_counter()
    embed = route_train.encoder_embed(EMBEDDER)
    load_s = time.perf_counter() - started
    texts = [r["prompt"] for r in rows + unseen]
    vectors = dict(zip(texts, embed(texts), strict=True))
    services = ["small", "large"]

    def examples(rs: list[dict]) -> list:
        return [route_train.Example(r["prompt"], "1" if r["label"] == "complex" else "0") for r in rs]

    def fitted(train: list) -> LearnedModel:
        model, _, _ = route_train.train(train, lambda batch: [vectors[t] for t in batch], "all-minilm-l6-v2")
        return LearnedModel.model_validate(model)

    def right(model: LearnedModel, test: list) -> int:
        return sum(learned.decide(model, vectors[e.text], services).tier == int(e.label) for e in test)

    def rules_right(rs: list[dict]) -> int:
        return sum(classifier.classify(r["prompt"], [1.5], 2).tier == (r["label"] == "complex") for r in rs)

    labelled = examples(rows)
    # stratified folds: each class's prompts dealt round-robin
    fold_of, seen = [], {"0": 0, "1": 0}
    for e in labelled:
        fold_of.append(seen[e.label] % folds)
        seen[e.label] += 1
    cv_right = sum(right(fitted([e for e, f in zip(labelled, fold_of) if f != k]),
                         [e for e, f in zip(labelled, fold_of) if f == k]) for k in range(folds))
    print(f"classifier (learned, {folds}-fold cross-validation on the {len(rows)} labelled prompts): accuracy "
          f"{cv_right / len(rows):.1%} ({cv_right}/{len(rows)}); rules on the same prompts "
          f"{rules_right(rows) / len(rows):.1%} (the set was written knowing the rules)")
    model = fitted(labelled)
    held = examples(unseen)
    print(f"classifier on {len(unseen)} unseen prompts (fitted on all {len(rows)}): learned "
          f"{right(model, held) / len(held):.1%} ({right(model, held)}/{len(held)}), rules "
          f"{rules_right(unseen) / len(unseen):.1%} ({rules_right(unseen)}/{len(unseen)})")
    times, embed_times = [], []
    for text in texts:
        start = time.perf_counter()
        vector = embed([text])[0]
        embed_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        learned.decide(model, vector, services)
        times.append(time.perf_counter() - start)
    print(f"learned: scoring {statistics.mean(times) * 1e6:.0f} us mean per request (pure Python, 384 x 2); the "
          f"embedding {statistics.mean(embed_times) * 1e3:.1f} ms mean per prompt in process (the router adds an "
          f"HTTP call to the embedder service); encoder load {load_s:.1f} s")


class SlowStartServer(Server):
    """The tests' `kaon serve` launcher, with room for a machine shared with other work."""

    def _wait_ready(self, last_attempt: bool, timeout_s: float = 900) -> bool:
        return super()._wait_ready(last_attempt, timeout_s)


def start_servers(tmp: Path) -> dict[str, Server]:
    servers: dict[str, Server] = {}

    def start(name: str, *extra: str) -> None:
        (tmp / name).mkdir(parents=True, exist_ok=True)
        servers[name] = SlowStartServer(tmp / name, "--served-model-name", SERVED[name], *extra)

    threads = [threading.Thread(target=start, args=("small",)), threading.Thread(target=start, args=("large",)),
               threading.Thread(target=start, args=("embed", "--model", EMBEDDER, "--task", "embed"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return servers


def make_router(servers: dict[str, Server], routes: list[dict]) -> Router:
    table = EndpointTable(default_namespace=NS)
    for name, server in servers.items():
        table.apply_service("ADDED", isvc(name, SERVED[name], namespace=NS))
        table.apply_pod("ADDED", pod(f"{name}-0", name, namespace=NS, port=int(server.url.rsplit(":", 1)[1])))
    table.synced = True
    router = Router(table, RouterConfig(first_byte_timeout=300, idle_timeout=300), rng=random.Random(0))
    table_of_routes = RouteTable(default_namespace=NS)
    for obj in routes:
        table_of_routes.apply_route("ADDED", obj)
    router.routes = RouteGateway(router, table_of_routes, rng=random.Random(0))
    return router


def route(name: str, tiers: list[str], **spec) -> dict:
    return {"metadata": {"name": name, "namespace": NS},
            "spec": {"tiers": [{"service": t, "costPerMillionTokens": COSTS[t]} for t in tiers], **spec}}


def chat(url: str, model: str, prompt: str, max_tokens: int, key: str = "bench") -> httpx.Response:
    response = httpx.post(f"{url}/v1/chat/completions", timeout=600, headers={"Authorization": f"Bearer {key}"},
                          json={"model": model, "messages": [{"role": "user", "content": prompt}],
                                "max_tokens": max_tokens, "temperature": 0})
    response.raise_for_status()
    return response


def embed(server: Server, texts: list[str]) -> list[list[float]]:
    response = httpx.post(f"{server.url}/v1/embeddings", timeout=600,
                          json={"model": SERVED["embed"], "input": texts})
    response.raise_for_status()
    return [d["embedding"] for d in response.json()["data"]]


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--threshold", type=float, default=0.92, help="the semantic cache's cosine threshold")
    parser.add_argument("--work", type=Path, default=Path("/tmp/kaon-bench-routing"))
    parser.add_argument("--classifier-only", action="store_true", help="the classifiers' figures only (no engines)")
    args = parser.parse_args()
    rows, pairs = load("routing_tiers.jsonl"), load("routing_cache_pairs.jsonl")

    accuracy, mean_us, p99_us = classifier_figures(rows)
    print(f"classifier (rules): accuracy {accuracy:.1%} on {len(rows)} labelled prompts; "
          f"{mean_us:.0f} us mean, {p99_us:.0f} us p99 per request")
    learned_figures(rows, load("routing_tiers_unseen.jsonl"))
    if args.classifier_only:
        return

    started = time.monotonic()
    servers = start_servers(args.work)
    print(f"engines ready in {time.monotonic() - started:.0f} s (kaon serve: 2 x SmolLM2-135M + all-MiniLM-L6-v2, "
          "float32, CPU)")
    tiered = route("assistant", ["small", "large"], verify={"fraction": 1.0, "minSamples": 1000},
                   cache={"exact": {"enabled": False}})
    top_only = route("top", ["large"], cache={"exact": {"enabled": False}})
    cached = route("faq", ["small", "large"],
                   cache={"semantic": {"enabled": True, "embedder": "embed", "threshold": args.threshold}})
    router = make_router(servers, [tiered, top_only, cached])
    try:
        with serving_in_thread(router) as url:
            shares = {"small": 0, "large": 0}
            for r in rows:
                shares[chat(url, "assistant", r["prompt"], args.max_tokens).headers["x-kaon-route-tier"]] += 1
            for r in rows:
                chat(url, "top", r["prompt"], args.max_tokens)
            deadline = time.monotonic() + 600  # the second opinions run on the router's loop, in its thread
            while router.routes._background and time.monotonic() < deadline:
                time.sleep(0.2)
            figures = router.routes.figures
            routed_cost = figures[(NS, "assistant")].cost
            top_cost = figures[(NS, "top")].cost
            agreement = router.routes.agreement[(NS, "assistant")]
            print(f"tiers: small {shares['small']}, large {shares['large']} of {len(rows)}")
            print(f"cost: routed {routed_cost * 1e3:.4f} vs all-to-top {top_cost * 1e3:.4f} (milli-units, engine "
                  f"tokens x costPerMillionTokens): ratio {routed_cost / top_cost:.3f}")
            for (tier, cls), results in sorted(agreement.results.items()):
                print(f"monitor: tier {tier}, class {cls}: agreement with the top tier "
                      f"{sum(results) / len(results):.0%} of {len(results)}")

            # the cache: exact repeats, paraphrases, near misses (each question stored first)
            for p in pairs:
                chat(url, "faq", p["prompt"], args.max_tokens)
            repeats = sum(chat(url, "faq", p["prompt"], args.max_tokens).headers["x-kaon-cache"] == "hit"
                          for p in pairs)
            para = sum(chat(url, "faq", p["paraphrase"], args.max_tokens).headers["x-kaon-cache"] == "hit"
                       for p in pairs)
            near = sum(chat(url, "faq", p["near_miss"], args.max_tokens).headers["x-kaon-cache"] == "hit"
                       for p in pairs)
            print(f"cache at threshold {args.threshold}: exact repeats {repeats}/{len(pairs)} hit; paraphrases "
                  f"{para}/{len(pairs)} hit ({para / len(pairs):.0%}); near misses {near}/{len(pairs)} hit "
                  f"(false-hit rate {near / len(pairs):.0%}, goal <= 1%)")
        # the threshold sweep, from the embedder's own vectors
        vectors = embed(servers["embed"], [p[k] for p in pairs for k in ("prompt", "paraphrase", "near_miss")])
        sims_para = [cosine(vectors[3 * i], vectors[3 * i + 1]) for i in range(len(pairs))]
        sims_near = [cosine(vectors[3 * i], vectors[3 * i + 2]) for i in range(len(pairs))]
        print(f"embedder cosine: paraphrases mean {statistics.mean(sims_para):.4f} (min {min(sims_para):.4f}); "
              f"near misses mean {statistics.mean(sims_near):.4f} (max {max(sims_near):.4f})")
        for t in (0.85, 0.88, 0.90, 0.91, 0.92, 0.93, 0.95, 0.97):
            hit = sum(s >= t for s in sims_para) / len(pairs)
            false = sum(s >= t for s in sims_near) / len(pairs)
            print(f"  threshold {t:.2f}: paraphrase hit rate {hit:.0%}, near-miss false-hit rate {false:.0%}")
    finally:
        asyncio.run(router.routes.close())
        for server in servers.values():
            server.stop()


if __name__ == "__main__":
    main()
