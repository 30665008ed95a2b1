"""The router: its pure decisions, then the real HTTP path against fake engines.

The fake engines are small aiohttp servers on 127.0.0.1 ports that answer as the request
body tells them (a quick completion, a stream held open until the test lets it go, a
given status and body), so every case is deterministic. The endpoint table is fed by hand
here; tests/integration/test_router_k8s.py feeds it from a real apiserver.
"""
from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time
import typing
from collections import Counter
from itertools import cycle

import pytest

from kaon_operator import api, clock
from kaon_operator.children import resources
from kaon_operator.router import endpoints, strategies
from kaon_operator.router.backoff import Backoff, candidates
from kaon_operator.router.config import RouterConfig
from kaon_operator.router.endpoints import (
    ENGINE_POD_SELECTOR,
    Endpoint,
    EndpointTable,
    ServiceKey,
    endpoint,
    service,
)
from kaon_operator.router.errors import RouterError
from kaon_operator.router.event_loop import LoopUnavailable, loop_factory
from kaon_operator.router.proxy import Router
from kaon_operator.router.request import parse_request
from kaon_operator.router.strategies import prefix_affinity, prefixes
from kaon_operator.router.strategies.least_connections import LeastConnections, least, pick
from kaon_operator.router.strategies.prefix_affinity import PrefixAffinity
from kaon_operator.router.strategies.records import KnownPrefixes
from kaon_operator.router.strategies.ring import Ring
from support.router import (
    NS,
    FakeEngine,
    closed_port,
    isvc,
    metric,
    pod,
    routed,
    run,
    serving,
    until,
)


def ep(name: str) -> Endpoint:
    return Endpoint(NS, name, "svc", f"http://{name}:8000")


# pure decisions ---------------------------------------------------------------------


def test_pick_takes_the_least_loaded_and_breaks_ties_at_random():
    a, b, c = ep("a"), ep("b"), ep("c")
    rng = random.Random(0)
    assert pick([a, b, c], {a: 3, b: 1, c: 2}, rng) == b
    picks = Counter(pick([a, b, c], {a: 1}, rng).pod for _ in range(600))
    assert set(picks) == {"b", "c"} and min(picks.values()) > 200, picks


def test_pick_chooses_as_least_does_with_the_same_random_draws():
    """pick is least() over the in-flight counts written out in one pass: same pod, same ties, same use of rng."""
    pods = [ep(name) for name in "abcdef"]
    shapes = random.Random(7)
    for _ in range(2000):
        usable = shapes.sample(pods, shapes.randint(1, len(pods)))
        inflight = {p: shapes.randint(0, 2) for p in pods if shapes.random() < 0.7}
        seed = shapes.random()
        expected = least(usable, lambda p, counts=inflight: counts.get(p, 0), random.Random(seed))
        assert pick(usable, inflight, random.Random(seed)) == expected, (usable, inflight)


def test_candidates_skip_tried_and_backing_off_pods_unless_none_is_left():
    a, b, c = ep("a"), ep("b"), ep("c")
    backoff = Backoff(5.0)
    backoff.fail(a, now=100.0)
    assert candidates([a, b, c], set(), backoff.until, now=101.0) == [b, c]
    assert candidates([a, b, c], {b, c}, backoff.until, now=101.0) == [a]  # backing off, but the only one left
    assert candidates([a, b, c], set(), backoff.until, now=105.0) == [a, b, c]  # back-off over
    assert candidates([a, b], {a, b}, backoff.until, now=101.0) == []
    backoff.fail(b, now=200.0)
    assert set(backoff.until) == {b}  # expired entries are forgotten


def test_a_pod_is_an_endpoint_only_when_ready_with_an_ip_and_not_terminating():
    assert endpoint(pod("p", port=9000)) == Endpoint(NS, "p", "svc", "http://127.0.0.1:9000")
    assert endpoint(pod("p", ready=False)) is None
    assert endpoint(pod("p", ip=None)) is None
    assert endpoint(pod("p", deleting=True)) is None
    assert endpoint(pod("p", ip="fd00::7")).url == "http://[fd00::7]:8000"
    unnamed_port = pod("p")
    unnamed_port["spec"]["containers"][0]["ports"] = []
    assert endpoint(unnamed_port).url == f"http://127.0.0.1:{resources.HTTP_PORT}"


def test_rendered_engine_pods_are_what_the_router_selects_and_addresses():
    deployment = resources.deployment(resources.Owner("llama", NS, "uid"),
                                      api.InferenceServiceSpec.model_validate({"model": {"uri": "/m"}}))
    template = deployment["spec"]["template"]
    labels = template["metadata"]["labels"]
    for term in ENGINE_POD_SELECTOR.split(","):
        key, _, value = term.partition("=")
        assert key in labels and (not value or labels[key] == value), (term, labels)
    rendered = {"metadata": {"name": "llama-0", "namespace": NS, "labels": labels}, "spec": template["spec"],
                "status": {"podIP": "10.0.0.9", "conditions": [{"type": "Ready", "status": "True"}]}}
    assert endpoint(rendered) == Endpoint(NS, "llama-0", "llama", f"http://10.0.0.9:{resources.HTTP_PORT}")


def test_table_follows_pod_events_and_relists():
    changed: list[ServiceKey] = []
    table = EndpointTable(on_change=changed.append)
    key = ServiceKey(NS, "svc")
    table.apply_pod("ADDED", pod("b", ready=False))
    assert table.endpoints(key) == () and changed == []  # nothing routable changed
    table.apply_pod("MODIFIED", pod("b"))
    table.apply_pod("ADDED", pod("a"))
    assert [e.pod for e in table.endpoints(key)] == ["a", "b"] and changed == [key, key]
    table.apply_pod("MODIFIED", pod("a", deleting=True))
    assert [e.pod for e in table.endpoints(key)] == ["b"]
    table.apply_pod("DELETED", pod("a", deleting=True))
    table.apply_pod("ADDED", pod("x", namespace="other"))
    # A relist of one namespace: what it lacks is gone there, other namespaces are untouched.
    table.replace_pods(NS, [pod("c"), pod("d", ready=False)])
    assert [e.pod for e in table.endpoints(key)] == ["c"]
    assert [e.pod for e in table.endpoints(ServiceKey("other", "svc"))] == ["x"]
    table.replace_pods(None, [])
    assert table.endpoints(key) == () and table.endpoints(ServiceKey("other", "svc")) == ()
    # A pod relabelled to another InferenceService moves there.
    table.apply_pod("ADDED", pod("m", "one"))
    table.apply_pod("MODIFIED", pod("m", "two"))
    assert table.endpoints(ServiceKey(NS, "one")) == () and len(table.endpoints(ServiceKey(NS, "two"))) == 1


def test_served_names_default_to_the_name_and_the_oldest_service_keeps_a_contested_one():
    table = EndpointTable(cluster_wide_names=True)  # bare names across namespaces (test_tenancy.py: without)
    table.apply_service("ADDED", isvc("smollm2"))
    table.apply_service("ADDED", isvc("llama", "llama-3", created="2026-01-02T00:00:00Z"))
    table.apply_service("ADDED", isvc("llama", "llama-3", namespace="a", created="2026-01-03T00:00:00Z"))
    assert table.resolve("smollm2") == ServiceKey(NS, "smollm2")
    assert table.resolve("llama-3") == ServiceKey(NS, "llama")  # the older one
    assert table.resolve("llama") is None
    table.apply_service("DELETED", isvc("llama", "llama-3"))
    assert table.resolve("llama-3") == ServiceKey("a", "llama")  # (resolved before: kept, then dropped)
    assert table.resolve("new") is None
    table.replace_services(None, [isvc("new")])
    assert [s.served_name for s in table.services()] == ["new"]
    assert table.resolve("new") == ServiceKey(NS, "new") and table.resolve("llama-3") is None


def test_the_names_a_table_keeps_resolved_are_few_and_short():
    """resolve() keeps its answers (every request resolves its `model`), but a client may send any name: past
    MOST_RESOLVED names, and for names longer than MOST_RESOLVED_LENGTH, it answers without keeping."""
    table = EndpointTable(default_namespace=NS)
    table.apply_service("ADDED", isvc("svc"))
    long = "x" * (endpoints.MOST_RESOLVED_LENGTH + 1)
    assert table.resolve(long) is None and long not in table._resolved
    for i in range(endpoints.MOST_RESOLVED + 10):
        assert table.resolve(f"name-{i}") is None
    assert len(table._resolved) == endpoints.MOST_RESOLVED
    assert table.resolve("svc") == ServiceKey(NS, "svc")  # answered, though no longer kept


def test_a_service_is_read_through_the_api_models_and_a_section_that_does_not_validate_stops_nothing():
    spec = isvc("svc", "m")
    spec["spec"]["routing"] = {"strategy": "prefix-affinity", "loadBound": 2}
    read = service(spec)
    assert (read.served_name, read.strategy, read.load_bound, read.hold_seconds, read.key_digests,
            read.created) == ("m", "prefix-affinity", 2.0, None, None, 1767225600)
    # Defaults are api.py's: the same ones the apiserver writes into every InferenceService.
    defaults = api.InferenceServiceSpec.model_validate({"model": {"uri": "/m"}})
    plain = service(isvc("svc"))
    assert (plain.strategy, plain.load_bound, plain.max_num_seqs) == (
        defaults.routing.strategy, defaults.routing.load_bound, defaults.engine.batch_slots())
    # A section the apiserver would refuse (an object written by hand) reads as its defaults...
    spec["spec"]["routing"] = {"strategy": "round-robin", "loadBound": "far"}
    spec["spec"]["autoscaling"] = {"enabled": True, "minReplicas": 0}  # no scaleToZeroIdleSeconds
    table = EndpointTable(default_namespace=NS)
    table.apply_service("ADDED", spec)
    read = table.service(ServiceKey(NS, "svc"))
    assert (read.strategy, read.load_bound, read.hold_seconds) == ("least-connections", 1.25, None)
    # ...but an auth section that does not validate refuses every request, never opens the service.
    spec["spec"]["auth"] = {"apiKeySecret": ""}
    table.apply_service("MODIFIED", spec)
    assert table.api_keys(ServiceKey(NS, "svc")) == ()


def test_strategies_are_found_by_the_names_the_crd_allows():
    allowed = typing.get_args(api.RoutingSpec.model_fields["strategy"].annotation)
    assert set(strategies.STRATEGIES) == set(allowed)
    assert strategies.named("least-connections") is LeastConnections
    assert strategies.named("prefix-affinity") is PrefixAffinity
    with pytest.raises(strategies.UnknownStrategy, match=r"'round-robin'.*least-connections, prefix-affinity"):
        strategies.named("round-robin")
    made = strategies.Strategies()
    assert made.get("prefix-affinity") is made.get("prefix-affinity")  # one per router: its records last
    with pytest.raises(strategies.UnknownStrategy):
        made.get("")


def test_requested_model_refuses_what_is_not_an_openai_request():
    assert parse_request(b'{"model": "m", "prompt": "x"}') == ("m", {"model": "m", "prompt": "x"})
    for body, fragment in [(b"{not json", "not valid JSON"), (b"[1]", "JSON object"), (b"\xff", "not valid JSON"),
                           (b'{"prompt": "x"}', "`model` is required"), (b'{"model": 3}', "`model` is required")]:
        with pytest.raises(RouterError) as err:
            parse_request(body)
        assert err.value.status == 400 and fragment in err.value.message, body


def test_requested_model_reads_every_body_as_json_loads_does():
    """parse_request reads with msgspec first and json.loads after it refuses: the payload is json's either way
    (huge ints stay ints, NaN and a lone surrogate are read), and a refusal keeps json's message."""
    reference = json.loads
    for body in [b'{"model": "m", "seed": 123456789012345678901234567890, "x": -9223372036854775809}',
                 b'{"model": "m", "t": NaN, "u": Infinity, "v": -Infinity, "w": 1e400}',
                 b'{"model": "m", "s": "\\ud800", "e": "\xed\xa0\x80", "d": 1, "d": 2, "f": 1.0000000000000001}',
                 b'{"model": "m\\u00e9", "messages": [{"role": "user", "content": "h\xc3\xa9 \\n"}], "n": -0}']:
        model, payload = parse_request(body)
        expected = reference(body.decode("utf-8", "surrogatepass"))
        assert repr(payload) == repr(expected) and model == expected["model"], body  # repr: NaN != NaN
        assert [type(v) for v in payload.values()] == [type(v) for v in expected.values()], body
    with pytest.raises(RouterError) as err:
        parse_request(b'{"model": "m", "x": [1,]}')
    assert err.value.message.startswith("the request body is not valid JSON: Expecting value: line 1 column 24")
    with pytest.raises(RouterError) as err:
        parse_request(b'{"model": "m"' + b', "x": ' + b"[" * 5000 + b"]" * 5000 + b"}")
    assert "too deeply" in err.value.message


def test_the_router_runs_on_uvloop_when_it_is_installed():
    uvloop = pytest.importorskip("uvloop")
    assert loop_factory() is uvloop.new_event_loop and loop_factory("uvloop") is uvloop.new_event_loop
    assert loop_factory("asyncio") is asyncio.new_event_loop
    with pytest.raises(ValueError):
        loop_factory("trio")


def test_without_uvloop_auto_is_asyncios_loop_and_asking_for_uvloop_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop raises ImportError
    assert loop_factory("auto") is asyncio.new_event_loop
    with pytest.raises(LoopUnavailable, match="uvloop is not installed"):
        loop_factory("uvloop")


# prefix affinity: pure decisions ------------------------------------------------------


def conversation(i: int, turns: int, system: str = "You are a helpful assistant. " * 20) -> list[list[dict]]:
    """The `messages` of each turn of one chat: every turn repeats the earlier ones."""
    messages, requests = [{"role": "system", "content": system}], []
    for t in range(turns):
        messages = [*messages, {"role": "user", "content": f"conversation {i}, question {t}: " + "why? " * 30}]
        requests.append(messages)
        messages = [*messages, {"role": "assistant", "content": f"answer {t} " * 20}]
    return requests


def test_prompt_chunks_chain_so_a_shared_prefix_shares_its_hashes():
    base = "x" * 600
    a, b = prefixes.chain(base + "tail one", "ns/svc"), prefixes.chain(base + "other tail", "ns/svc")
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]  # two full chunks of 256 in common, tails differ
    assert prefixes.chain("y" + base[1:], "ns/svc")[1] != a[1]  # chained: a change in chunk 0 changes chunk 1
    assert prefixes.chain(base, "ns/other")[0] != a[0]  # services apart
    assert prefixes.chain("short", "s") and prefixes.chain("", "s") == []


def test_a_chat_prefix_runs_to_the_last_user_turn_and_its_anchor_to_the_first():
    turns = conversation(0, 3)
    texts = [prefixes.prompt_prefix("/v1/chat/completions", {"messages": m}) for m in turns]
    # Each turn's text starts with the previous turn's: the engine's cache of a turn serves the next.
    assert all(texts[i + 1][0].startswith(texts[i][0]) for i in range(2))
    assert len({anchor for _, anchor in texts}) == 1  # the anchor stays put over the conversation
    assert texts[0][1] != prefixes.prompt_prefix("/v1/chat/completions", {"messages": conversation(1, 1)[0]})[1]
    # What follows the last user turn (a prefilled assistant reply) is not part of it.
    extra = prefixes.prompt_prefix("/v1/chat/completions",
                                   {"messages": [*turns[0], {"role": "assistant", "content": "Sure"}]})
    assert extra == texts[0]
    assert prefixes.prompt_prefix("/v1/completions", {"prompt": "Once"}) == ("Once", "Once")
    assert prefixes.prompt_prefix("/v1/completions", {"prompt": [1, 2, 3]}) == ("1,2,3", "1,2,3")
    assert prefixes.prompt_prefix("/v1/completions", {"prompt": ["a", "b"]}) is None  # a batch: no one prefix
    assert prefixes.prompt_prefix("/v1/embeddings", {"input": "x"}) is None
    assert prefixes.prompt_prefix("/v1/chat/completions", {"messages": "x"}) is None


def _owners(ring: Ring, keys: list[int]) -> list:
    return [ring.walk(k)[0] for k in keys]


def test_the_ring_keeps_a_key_on_one_pod_spreads_keys_and_a_leaving_pod_moves_only_its_own():
    pods = [ep(f"p{i}") for i in range(5)]
    ring = Ring(pods, name=lambda e: e.pod)
    keys = [prefixes.chain(f"conversation {i}", "s")[-1] for i in range(5000)]
    owners = _owners(ring, keys)
    assert owners == _owners(Ring(list(reversed(pods)), name=lambda e: e.pod), keys)  # order-free
    assert sorted(ring.walk(keys[0]), key=lambda e: e.pod) == pods  # the walk visits every pod once
    spread = Counter(e.pod for e in owners)
    assert len(spread) == 5 and max(spread.values()) < 1.3 * 1000 and min(spread.values()) > 0.7 * 1000, spread
    gone = pods[2]
    after = _owners(Ring([p for p in pods if p != gone], name=lambda e: e.pod), keys)
    moved = [k for k, (b, a) in enumerate(zip(owners, after)) if b != a]
    assert all(owners[k] == gone for k in moved)  # only the leaving pod's keys move ...
    assert len(moved) < len(keys) * (1 / 5 + 0.06), len(moved)  # ... about 1/N of them
    # A pod joining takes keys from the others, and no key moves between two old pods.
    joined = _owners(Ring([*pods, ep("p5")], name=lambda e: e.pod), keys)
    assert all(a == b or a.pod == "p5" for b, a in zip(owners, joined))
    assert sum(a.pod == "p5" for a in joined) < len(keys) * (1 / 6 + 0.06)


RNG = random.Random(0)
"""Breaks prefix-affinity's ties; a test whose outcome depends on one accepts every outcome."""


def test_choose_keeps_the_first_choice_until_it_is_over_the_load_bound():
    a, b, c = ep("a"), ep("b"), ep("c")
    order = [b, c, a]
    assert prefix_affinity.choose(order, [a, b, c], {}, 1.25, rng=RNG) == (b, True)
    # b carries 2 of 3 in flight: capacity ceil(1.25 x 4 / 3) = 2, so b is skipped for c.
    assert prefix_affinity.choose(order, [a, b, c], {b: 2, a: 1}, 1.25, rng=RNG) == (c, False)
    assert prefix_affinity.choose(order, [a, b, c], {b: 1, a: 1}, 1.25, rng=RNG) == (b, True)
    # The holder of the known prefix comes before the ring, and is skipped the same way.
    assert prefix_affinity.choose(order, [a, b, c], {}, 1.25, first=a, rng=RNG) == (a, True)
    assert prefix_affinity.choose(order, [a, b, c], {a: 3}, 1.25, first=a, rng=RNG) in {(b, False), (c, False)}
    # Only usable pods (not tried, not backing off) count; a generous bound keeps a holder.
    assert prefix_affinity.choose(order, [a, c], {}, 1.25, rng=RNG) == (c, True)
    assert prefix_affinity.choose(order, [a, b, c], {b: 2, a: 1}, 3.0, first=b, rng=RNG) == (b, True)
    # A tight bound: capacity ceil(1.01 x 10 / 2) = 6.
    assert prefix_affinity.choose(order, [b, c], {b: 5, c: 4}, 1.01, rng=RNG) == (b, True)
    assert prefix_affinity.choose(order, [b, c], {b: 6, c: 3}, 1.01, rng=RNG) == (c, False)


def test_bounded_loads_keep_every_pod_near_the_mean_even_when_one_key_is_hot():
    pods = [ep(f"p{i}") for i in range(4)]
    ring = Ring(pods, name=lambda e: e.pod)
    inflight: dict = {}
    for _ in range(100):  # one hot prefix, requests that never finish
        target, _ = prefix_affinity.choose(ring.walk(42), pods, inflight, 1.25, rng=RNG)
        inflight[target] = inflight.get(target, 0) + 1
    assert max(inflight.values()) <= 1.25 * 100 / 4 + 1, inflight


def test_the_longest_known_prefix_wins_and_of_several_holders_the_least_loaded():
    a, b, c = ep("a"), ep("b"), ep("c")
    preferred, chain = prefix_affinity.preferred, prefixes.chain
    known = KnownPrefixes(capacity=10)
    turn1 = chain("s" * 512 + "u" * 300, "k")
    known.record(turn1, a)
    assert preferred(turn1, known, [b, c, a], {a: 3}, rng=RNG) == a  # however loaded: the bound is choose's
    assert preferred(chain("s" * 512 + "u" * 300 + "more", "k"), known, [a, b], {}, rng=RNG) == a
    assert preferred(turn1, known, [b, c], {}, rng=RNG) is None  # a is not usable now
    assert preferred(chain("other", "k"), known, [a, b], {}, rng=RNG) is None
    known.record(turn1, b)  # passed over for load once: now cached on a and b
    assert preferred(turn1, known, [c, b, a], {a: 2, b: 1}, rng=RNG) == b
    assert {preferred(turn1, known, [c, a, b], {}, rng=RNG) for _ in range(20)} == {a, b}  # ties at random
    # A longer prefix whose holder left gives way to a shorter one that another pod holds.
    known.record(chain("s" * 512 + "u" * 300 + "w" * 300, "k"), c)
    assert preferred(chain("s" * 512 + "u" * 300 + "w" * 300, "k"), known, [a], {}, rng=RNG) == a
    known.record(chain("z" * 2600, "k"), b)  # 11 chunks: the oldest are forgotten
    assert len(known) == 10 and preferred(turn1, known, [a, b], {}, rng=RNG) is None


# the HTTP path against fake engines ----------------------------------------------------


def round_robin(sequence: list[str], backends: int) -> list[int]:
    """Where taking turns would put the long requests of `sequence`."""
    counts = [0] * backends
    for kind, backend in zip(sequence, cycle(range(backends))):
        counts[backend] += kind == "long"
    return counts


def test_least_connections_spreads_long_requests_where_round_robin_piles_them_up():
    # Each long request is followed by two quick ones: taking turns over three pods sends
    # every long one to the same pod. Least connections counts what is in flight instead.
    sequence = ["long", "quick", "quick"] * 6

    async def scenario():
        engines = [await FakeEngine(f"e{i}").start() for i in range(3)]
        router = routed(*engines)
        async with serving(router) as client:
            streams = []
            for kind in sequence:
                if kind == "long":
                    before = sum(e.longs for e in engines)
                    streams.append(asyncio.create_task(
                        client.post("/v1/completions", json={"model": "m", "prompt": "long", "stream": True})))
                    await until("the long request to arrive",
                                lambda before=before: sum(e.longs for e in engines) > before)
                else:
                    async with client.post("/v1/completions", json={"model": "m", "prompt": "x"}) as resp:
                        assert resp.status == 200
                    await until("the quick request to finish", lambda: sum(router.inflight.values()) == len(streams))
            spread = [e.longs for e in engines]
            for e in engines:
                e.release.set()
            for task in streams:
                async with await task as resp:
                    assert await resp.read() == b"data: started\n\ndata: [DONE]\n\n"
        for e in engines:
            await e.stop()
        return spread

    spread = run(scenario())
    piled = round_robin(sequence, 3)
    assert sorted(spread) == [2, 2, 2], (
        f"least connections put the 6 long requests as {spread}; round-robin would have put them as {piled}")
    assert sorted(piled) == [0, 0, 6]


def test_streams_pass_through_chunk_by_chunk_unchanged():
    events = [b'data: {"choices":[{"text":"' + word.encode() + b'"}]}\n\n' for word in ("Once", " upon", " a", " time")]
    events.append(b"data: [DONE]\n\n")

    async def scenario():
        engine = await FakeEngine("e0", events).start()
        router = routed(engine)
        async with serving(router) as client:
            async with client.post("/v1/completions", json={"model": "m", "prompt": "gated", "stream": True}) as resp:
                assert resp.status == 200 and resp.headers["Content-Type"] == "text/event-stream"
                assert resp.headers["Cache-Control"] == "no-cache"
                received = b""
                for i, event in enumerate(events):
                    engine.gates[i].set()  # the engine writes this one chunk and waits for the next gate
                    chunk = await resp.content.readexactly(len(event))
                    assert chunk == event, i
                    assert i == len(events) - 1 or not engine.finished, "arrived only after the engine finished"
                    received += chunk
                assert await resp.content.read() == b""
        await engine.stop()
        return received

    assert run(scenario()) == b"".join(events)


def test_status_codes_headers_and_error_bodies_pass_through_unchanged():
    cases = [
        (400, '{"error": {"message": "max_tokens is too large", "type": "invalid_request_error", '
              '"param": "max_tokens", "code": null}}', {"Content-Type": "application/json"}),
        (429, '{"error": {"message": "queue full", "type": "rate_limit_error", "param": null, "code": "queue_full"}}',
         {"Content-Type": "application/json", "Retry-After": "1"}),
        (503, '{"error": {"message": "draining", "type": "service_unavailable", "param": null, "code": "draining"}}',
         {"Content-Type": "application/json", "Retry-After": "1"}),
        (500, "Internal Server Error", {"Content-Type": "text/plain; charset=utf-8"}),
        (201, '{"ok": true}', {"Content-Type": "application/json", "X-Request-Id": "abc"}),
    ]

    async def scenario():
        engine = await FakeEngine("e0").start()
        router = routed(engine)
        async with serving(router) as client:
            for status, body, headers in cases:
                request = {"model": "m", "fake": {"status": status, "body": body, "headers": headers}}
                async with client.post("/v1/chat/completions", json=request) as resp:
                    assert resp.status == status
                    assert await resp.read() == body.encode()
                    for name, value in headers.items():
                        assert resp.headers[name] == value, (status, name)
            text = await (await client.get("/metrics")).text()
        await engine.stop()
        return text

    text = run(scenario())
    for status, *_ in cases:
        assert metric(text, "kaon_router_requests_total", namespace=NS, inferenceservice="svc", code=status) == 1


class FirstOfTies(random.Random):
    """Breaks ties towards the first pod by name, so the dead one is tried first."""

    def choice(self, seq):
        return seq[0]


def test_a_dead_pod_is_skipped_the_request_succeeds_elsewhere_and_the_pod_backs_off(monkeypatch):
    # The router's clock is moved past the back-off rather than waited out: five requests fit in a 30 s
    # back-off on any machine (they did not always fit in 0.3 s on a busy one, and the dead pod got a second try).
    skipped = [0.0]
    real = clock.monotonic
    monkeypatch.setattr(clock, "monotonic", lambda: real() + skipped[0])

    async def scenario():
        engine = await FakeEngine("b-live").start()
        router = routed(engine, backoff=30.0)
        router.rng = FirstOfTies()
        router.table.apply_pod("ADDED", pod("a-dead", port=closed_port()))
        async with serving(router) as client:
            async def ask() -> dict:
                async with client.post("/v1/completions", json={"model": "m", "prompt": "x"}) as resp:
                    assert resp.status == 200
                    return await resp.json()

            answers = [await ask() for _ in range(5)]
            retries_during_backoff = metric(await (await client.get("/metrics")).text(), "kaon_router_retries_total",
                                            namespace=NS, inferenceservice="svc")
            skipped[0] = 30.5  # the back-off is over: the dead pod is tried again, once
            answers.append(await ask())
            retries_after = metric(await (await client.get("/metrics")).text(), "kaon_router_retries_total",
                                   namespace=NS, inferenceservice="svc")
        await engine.stop()
        return answers, retries_during_backoff, retries_after

    answers, during, after = run(scenario())
    assert all(a["backend"] == "b-live" for a in answers)
    assert (during, after) == (1, 2)


def test_a_sleeping_pod_still_marked_ready_passes_its_requests_on_and_only_sleepers_is_a_clear_503():
    """A standby the operator just put to sleep stays Ready until its readiness probe fails: the
    router tries another pod rather than answer the client with the engine's refusal."""
    async def scenario():
        asleep, live = FakeEngine("a-asleep"), FakeEngine("b-live")
        asleep.asleep = True
        await asleep.start()
        await live.start()
        router = routed(asleep, live, backoff=30)
        router.rng = FirstOfTies()
        async with serving(router) as client:
            answers = []
            for _ in range(3):
                async with client.post("/v1/completions", json={"model": "m", "prompt": "x"}) as resp:
                    answers.append((resp.status, await resp.json()))
            live.asleep = True
            async with client.post("/v1/completions", json={"model": "m", "prompt": "x"}) as resp:
                last = resp.status, resp.headers.get("Retry-After"), await resp.json()
        await asleep.stop()
        await live.stop()
        return answers, last

    answers, last = run(scenario())
    assert [(status, body.get("backend")) for status, body in answers] == [(200, "b-live")] * 3
    assert last[0] == 503 and last[1] and last[2]["error"]["code"] == "engine_asleep", last
    assert "2 tried" in last[2]["error"]["message"]


def test_only_dead_pods_is_a_502_not_a_hang():
    async def scenario():
        table = EndpointTable(default_namespace=NS)
        table.apply_service("ADDED", isvc("svc", "m"))
        table.apply_pod("ADDED", pod("a", port=closed_port()))
        table.apply_pod("ADDED", pod("b", port=closed_port()))
        table.synced = True
        async with serving(Router(table)) as client:
            async with client.post("/v1/completions", json={"model": "m"}) as resp:
                return resp.status, await resp.json()

    status, body = run(scenario())
    assert status == 502 and body["error"]["code"] == "upstream_unreachable", body
    assert "2 tried" in body["error"]["message"]


def test_a_request_for_a_service_without_ready_pods_is_held_until_one_appears():
    async def scenario():
        engine = await FakeEngine("e0").start()
        router = routed(queue_timeout=10)  # the InferenceService exists, scaled to zero
        key = ServiceKey(NS, "svc")
        async with serving(router) as client:
            request = asyncio.create_task(client.post("/v1/completions", json={"model": "m", "prompt": "x"}))
            await until("the request to be held", lambda: router.held() == {key: 1})
            text = await (await client.get("/metrics")).text()
            assert metric(text, "kaon_router_held_requests", namespace=NS, inferenceservice="svc") == 1
            assert metric(text, "kaon_router_ready_endpoints", namespace=NS, inferenceservice="svc") == 0
            await asyncio.sleep(0.1)
            assert not request.done()
            router.table.apply_pod("ADDED", pod("e0", port=engine.port, ready=False))
            await asyncio.sleep(0.05)
            assert not request.done()  # not ready yet
            router.table.apply_pod("MODIFIED", pod("e0", port=engine.port))
            async with await request as resp:
                status, body = resp.status, await resp.json()
            held_after = router.held()
            text = await (await client.get("/metrics")).text()
        await engine.stop()
        return status, body, held_after, text

    status, body, held_after, text = run(scenario())
    assert status == 200 and body["backend"] == "e0"
    assert held_after == {}
    assert metric(text, "kaon_router_held_requests", namespace=NS, inferenceservice="svc") == 0
    assert metric(text, "kaon_router_held_seconds_count", namespace=NS, inferenceservice="svc") == 1


def test_held_requests_time_out_with_a_clear_503_and_the_hold_is_bounded():
    async def scenario():
        # The hold (1 s) is what the first request tests; the second, refused on a count, must answer
        # while the first is still held, whatever a busy machine does to the time in between.
        router = routed(queue_timeout=1.0, max_queued=1)
        async with serving(router) as client:
            started = time.monotonic()
            first = asyncio.create_task(client.post("/v1/completions", json={"model": "m"}))
            await until("the first request to be held", lambda: router.held() == {ServiceKey(NS, "svc"): 1})
            async with client.post("/v1/completions", json={"model": "m"}) as resp:
                second = resp.status, await resp.json(), resp.headers.get("Retry-After"), first.done()
            async with await first as resp:
                first = resp.status, await resp.json(), resp.headers.get("Retry-After"), time.monotonic() - started
        return first, second

    first, second = run(scenario())
    status, body, retry_after, elapsed = first
    assert status == 503 and retry_after == "1" and elapsed >= 1.0
    assert body["error"]["type"] == "service_unavailable" and body["error"]["code"] == "no_ready_replica"
    assert "no ready replica of InferenceService ns/svc (model `m`) within 1s" in body["error"]["message"]
    assert set(body["error"]) == {"message", "type", "param", "code"}
    status, body, retry_after, first_done = second
    assert status == 503 and body["error"]["code"] == "queue_full" and not first_done, body
    assert "1 requests already wait" in body["error"]["message"]


def test_a_client_that_hangs_up_aborts_the_engine_request():
    async def scenario():
        engine = await FakeEngine("e0").start()
        router = routed(engine)
        async with serving(router) as client:
            resp = await client.post("/v1/completions", json={"model": "m", "prompt": "long", "stream": True})
            assert await resp.content.readexactly(len(b"data: started\n\n")) == b"data: started\n\n"
            resp.close()  # drops the connection mid-stream
            await until("the engine to see the hang-up", lambda: engine.aborted)
            await until("the in-flight count to drop", lambda: not router.inflight)
            text = await (await client.get("/metrics")).text()
        await engine.stop()
        return text

    text = run(scenario())
    assert metric(text, "kaon_router_pod_inflight_requests", namespace=NS, inferenceservice="svc", pod="e0") == 0


def test_an_engine_dying_mid_stream_ends_the_stream_with_an_openai_error_event_and_ejects_the_pod():
    async def scenario():
        engine = await FakeEngine("e0").start()
        router = routed(engine)
        async with serving(router) as client:
            async with client.post("/v1/completions", json={"model": "m", "prompt": "broken"}) as resp:
                assert resp.status == 200
                body = await resp.read()  # a clean end: no ClientPayloadError
            await until("the in-flight count to drop", lambda: not router.inflight)
            text = await (await client.get("/metrics")).text()
        await engine.stop()
        return body, router.backoff.until, text

    body, backing_off, text = run(scenario())
    events = body.split(b"\n\n")
    assert events[0] == b"data: partial" and events[2:] == [b""], body
    error = json.loads(events[1].removeprefix(b"data: "))["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "upstream_failed", error
    assert "replica e0 of InferenceService ns/svc broke off the response" in error["message"]
    assert [e.pod for e in backing_off] == ["e0"]
    assert metric(text, "kaon_router_broken_streams_total", namespace=NS, inferenceservice="svc") == 1
    assert metric(text, "kaon_router_ejected_endpoints", namespace=NS, inferenceservice="svc") == 1


def test_unknown_model_bad_json_models_health_and_metrics():
    async def scenario():
        engine = await FakeEngine("e0").start()
        router = routed(engine, service="smollm2", served_name=None)
        router.table.apply_service("ADDED", isvc("llama", "llama-3"))
        out = {}
        async with serving(router) as client:
            for name, body in [("unknown", b'{"model": "gpt-4"}'), ("bad_json", b"{"),
                               ("no_model", b'{"prompt": "x"}'), ("ok", b'{"model": "smollm2"}')]:
                async with client.post("/v1/chat/completions", data=body,
                                       headers={"Content-Type": "application/json"}) as resp:
                    out[name] = resp.status, await resp.json()
            for path in ("/v1/models", "/health", "/ready"):
                async with client.get(path) as resp:
                    out[path] = resp.status, await resp.json()
            out["metrics"] = await (await client.get("/metrics")).text()
            router.table.synced = False
            async with client.post("/v1/completions", json={"model": "not-yet-known"}) as resp:
                out["starting"] = resp.status, await resp.json()
        await engine.stop()
        return out

    out = run(scenario())
    status, body = out["unknown"]
    assert status == 404 and body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model"
    assert "`gpt-4`" in body["error"]["message"]
    assert out["bad_json"][0] == 400 and "not valid JSON" in out["bad_json"][1]["error"]["message"]
    assert out["no_model"][0] == 400 and out["no_model"][1]["error"]["param"] == "model"
    assert out["ok"][0] == 200 and out["ok"][1]["backend"] == "e0"
    status, models = out["/v1/models"]
    assert status == 200 and [m["id"] for m in models["data"]] == ["llama-3", "smollm2"]
    assert models["object"] == "list" and models["data"][0]["object"] == "model"
    assert out["/health"][0] == 200 and out["/ready"][0] == 200
    assert out["starting"][0] == 503 and out["starting"][1]["error"]["code"] == "router_starting"
    text = out["metrics"]
    assert metric(text, "kaon_router_requests_total", namespace="", inferenceservice="", code=404) == 1
    assert metric(text, "kaon_router_requests_total", namespace="", inferenceservice="", code=400) == 2
    assert metric(text, "kaon_router_requests_total", namespace=NS, inferenceservice="smollm2", code=200) == 1
    assert metric(text, "kaon_router_added_latency_seconds_count") == 1
    assert metric(text, "kaon_router_ready_endpoints", namespace=NS, inferenceservice="smollm2") == 1
    assert metric(text, "kaon_router_inflight_requests", namespace=NS, inferenceservice="smollm2") == 0
    assert metric(text, "kaon_router_pod_inflight_requests", namespace=NS, inferenceservice="smollm2", pod="e0") == 0


def test_kaon_router_needs_neither_torch_nor_the_engine_runtime():
    # The router runs from the operator image, which has no torch.
    code = ("import sys; sys.modules['torch'] = None; "
            "import kaon_operator.router.main, kaon_operator.router.watch; "
            "assert not [m for m in sys.modules if m.startswith('kaon_runtime')]; "
            "from kaon_operator.router.main import main; sys.exit(main(['--help']))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "--queue-timeout" in result.stdout and "--max-queued" in result.stdout and "--backoff" in result.stdout


def test_an_autoscaled_service_holds_requests_for_its_cold_start_not_the_routers_timeout():
    async def scenario():
        table = EndpointTable(default_namespace=NS)
        autoscaled = isvc("svc", "m")
        autoscaled["spec"]["autoscaling"] = {"enabled": True, "minReplicas": 0, "scaleToZeroIdleSeconds": 60,
                                             "scaleFromZeroTimeoutSeconds": 1}
        table.apply_service("ADDED", autoscaled)
        table.synced = True
        router = Router(table, RouterConfig(queue_timeout=0.2))
        async with serving(router) as client:
            started = time.monotonic()
            async with client.post("/v1/completions", json={"model": "m"}) as resp:
                return resp.status, await resp.json(), time.monotonic() - started

    status, body, elapsed = run(scenario())
    # Held for the service's 1 s (a GPU cold start is minutes), not the router's default 0.2 s.
    assert status == 503 and elapsed >= 1.0, (status, elapsed)
    assert "within 1s" in body["error"]["message"]


async def affinity_service(engine_spec: dict | None = None):
    """Three fake engines behind a router whose one InferenceService routes by prefix-affinity."""
    engines = [await FakeEngine(f"e{i}").start() for i in range(3)]
    table = EndpointTable(default_namespace=NS)
    service = isvc("svc", "m")
    service["spec"]["routing"] = {"strategy": "prefix-affinity", "loadBound": 1.25}
    if engine_spec:
        service["spec"]["engine"] = engine_spec
    table.apply_service("ADDED", service)
    for engine in engines:
        table.apply_pod("ADDED", pod(engine.name, port=engine.port))
    table.synced = True
    return engines, table, Router(table, RouterConfig(), rng=random.Random(0))


def test_prefix_affinity_keeps_a_conversation_on_one_pod_and_passes_a_hot_pod_over():
    async def scenario():
        engines, table, router = await affinity_service()
        async with serving(router) as client:
            async def ask(messages) -> str:
                async with client.post("/v1/chat/completions", json={"model": "m", "messages": messages}) as resp:
                    assert resp.status == 200
                    return (await resp.json())["backend"]

            homes = []
            for i in range(12):
                backends = {await ask(messages) for messages in conversation(i, 4)}
                assert len(backends) == 1, f"conversation {i} went to {backends}"
                homes.append(backends.pop())
            assert len(set(homes)) == 3, homes  # different conversations spread
            hits = metric(await (await client.get("/metrics")).text(), "kaon_router_affinity_hits_total",
                          namespace=NS, inferenceservice="svc")
            assert hits == 48
            # Hold two streams open on conversation 0's pod: it is over the bound, so its next turn goes elsewhere.
            home = next(e for e in engines if e.name == homes[0])
            target = next(e for e in router.inflight.keys() | set(table.endpoints(ServiceKey(NS, "svc")))
                          if e.pod == home.name)
            router.inflight[target] = 2  # as if two long requests were in flight there
            assert await ask(conversation(0, 5)[4]) != home.name
            text = await (await client.get("/metrics")).text()
            assert metric(text, "kaon_router_affinity_overrides_total", namespace=NS, inferenceservice="svc") == 1
            del router.inflight[target]
        for e in engines:
            await e.stop()

    run(scenario())


def test_prefix_affinity_passes_a_full_pod_over_when_the_service_says_its_slots():
    async def scenario(max_num_seqs):
        engines, table, router = await affinity_service({"maxNumSeqs": max_num_seqs} if max_num_seqs else None)
        async with serving(router) as client:
            async def ask(messages) -> str:
                async with client.post("/v1/chat/completions", json={"model": "m", "messages": messages}) as resp:
                    return (await resp.json())["backend"]

            turns = conversation(0, 2)
            home = await ask(turns[0])
            # Two in flight at home, one on each other pod: within the load bound (3), but with
            # 2 slots per pod home is full while the others have one free.
            for e in table.endpoints(ServiceKey(NS, "svc")):
                router.inflight[e] = 2 if e.pod == home else 1
            went = await ask(turns[1])
        for e in engines:
            await e.stop()
        return home, went

    home, went = run(scenario(2))
    assert went != home
    home, went = run(scenario(None))  # the default 64 slots, far from full: the load bound alone keeps it home
    assert went == home


def test_least_connections_stays_the_default_and_ignores_prefixes():
    async def scenario():
        engines = [await FakeEngine(f"e{i}").start() for i in range(3)]
        router = routed(*engines)
        assert router.table.service(ServiceKey(NS, "svc")).strategy == "least-connections"
        async with serving(router) as client:
            backends = set()
            for _ in range(30):
                async with client.post("/v1/chat/completions",
                                       json={"model": "m", "messages": conversation(0, 1)[0]}) as resp:
                    backends.add((await resp.json())["backend"])
            assert len(backends) == 3  # ties at random: the same prompt goes everywhere
            assert "kaon_router_affinity_hits_total{" not in await (await client.get("/metrics")).text()
        for e in engines:
            await e.stop()

    run(scenario())


def test_an_endpoint_is_the_same_map_key_however_it_was_built():
    """Endpoint keeps its hash (reckoned once): equal endpoints built apart find each other's entries
    (in flight, back-off), and one differing in any field does not."""
    fields = ("ns", "pod-0", "svc", "http://10.0.0.1:8000")
    inflight = {Endpoint(*fields): 3}
    assert inflight[Endpoint(*fields)] == 3
    for i in range(4):
        other = list(fields)
        other[i] += "x"
        assert Endpoint(*other) not in inflight and Endpoint(*other) != Endpoint(*fields)


def test_the_cheap_request_counter_is_exposed_as_prometheus_counter_exposes_the_same_counts():
    """kaon_router_requests is counted in plain ints (metrics.CheapCounter): its exposition is prometheus_client's
    Counter's for the same counts, series for series (`_total` and `_created`), in the order they were first counted."""
    import re

    from prometheus_client import CollectorRegistry, Counter as PrometheusCounter, generate_latest

    from kaon_operator.router.metrics import CheapCounter

    theirs, ours = CollectorRegistry(), CollectorRegistry()
    counter = PrometheusCounter("kaon_router_requests", "Requests answered", ["namespace", "inferenceservice", "code"],
                                registry=theirs)
    cheap = CheapCounter("kaon_router_requests", "Requests answered", ["namespace", "inferenceservice", "code"])
    ours.register(cheap)
    for labels in [("ns", "svc", "200"), ("", "", "404"), ("ns", "svc", "200"), ("ns", "other", "502")]:
        counter.labels(*labels).inc()
        cheap.of(labels)[0] += 1

    def stamps_out(text: bytes) -> str:  # the _created values are each series' own time
        return re.sub(r"(_created\{[^}]*\}) \S+", r"\1 T", text.decode())

    assert "kaon_router_requests_created" in generate_latest(ours).decode()
    assert stamps_out(generate_latest(ours)) == stamps_out(generate_latest(theirs))
