"""The autoscale loop: one task for the whole operator, not a kopf timer per object.

Every `interval` seconds it scrapes the routers once (requests held for services without a
ready pod), then, for every InferenceService with autoscaling enabled, scrapes its engine
pods, turns the scrape into a `Sample` (autoscaler.py), asks the policy and acts: patch
status.observedMetrics and spec.replicas, post Events, keep the MetricsAvailable condition.

Why not a kopf timer: kopf gives every object with a timer a finalizer, so deleting an
autoscaled InferenceService would hang while the operator is down. With one loop no
object carries a finalizer. With several operator replicas (kopf peering), only the holder
of a coordination.k8s.io Lease runs the loop.

Counters and histograms are cumulative over an engine's life, so each pod keeps a baseline:
a pod's first scrape is a baseline only, a pod that misses a scrape keeps its baseline (the
next answer covers both intervals), and a restarted engine (counts went down) counts from zero.

Over 300 lines for a stated reason: the loop's I/O (scrapes, the profile ConfigMap, status,
Events) with the small pure helpers that turn scrapes into samples beside it.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

import aiohttp

from kaon_operator import api, clock, kubetime, labels, spec_policy, urls
from kaon_operator.api import Key
from kaon_operator.autoscaling import autoscaler, histogram, predictive, prefill_scaling, scraper, standby
from kaon_operator.autoscaling.perf_model import PerfModel
from kaon_operator.autoscaling.profile_sync import resolve
from kaon_operator.autoscaling.profiling import read_model
from kaon_operator.children import prefill_pool
from kaon_operator.context import Context
from kaon_operator.kube import Conflict
from kaon_operator.records import AutoscaleMemory, Baseline
from kaon_operator.status import conditions, status_sync, summaries
from kaon_operator.status.conditions import EventSpec
from kaon_operator.status.summaries import PodSummary
from kaon_operator.watching import reporting_instance

logger = logging.getLogger("kaon.autoscaler")

SCRAPE_TIMEOUT_SECONDS = 2.0
ROUTER_PODS = ",".join(f"{k}={v}" for k, v in labels.component_labels(labels.ROUTER).items())
ROUTER_METRICS_PORT = 8080  # `kaon router --port` default; a container port named admin, else http, wins
LEASE_NAME = "kaon-autoscaler"
LEASE_SECONDS = 15
CONFLICT_RETRIES = 3  # writes by others that left the spec alone (status updates, kopf's annotations)


def token_deltas(baselines: dict[str, Baseline], answers: dict[str, scraper.PodMetrics]
                 ) -> tuple[float, float, float | None]:
    """(prompt tokens, generated tokens, the output lengths of the requests finished) since the
    last scrape, over the pods that answered and have a baseline (a first scrape is only a
    baseline; a restarted engine counts from zero). The third is None when a pod does not
    report output lengths (an older engine)."""
    prompt = generated = 0.0
    finished_output: float | None = 0.0
    for pod, metrics in answers.items():
        before = baselines.get(pod)
        if before is None:
            continue
        restarted = metrics.requests_total < before.finished or metrics.prompt_tokens_total < before.prompt_tokens
        prompt += metrics.prompt_tokens_total - (0.0 if restarted else before.prompt_tokens)
        generated += metrics.generation_tokens_total - (0.0 if restarted else before.generation_tokens)
        lengths, earlier = metrics.finished_output_tokens_total, before.finished_output_tokens
        if finished_output is None or lengths is None or (earlier is None and not restarted):
            finished_output = None
        else:
            finished_output += lengths - (0.0 if restarted or earlier is None else earlier)
    return prompt, generated, finished_output


def read_profile(text: str | None) -> PerfModel | None:
    return read_model(text)


def slots_measured(model: PerfModel | None) -> int | None:
    """The engine's own --max-num-seqs as its profile recorded it (`kaon profile` resolves the device's default),
    for a spec that leaves engine.maxNumSeqs to the engine."""
    return model.max_num_seqs if model is not None else None


def advance(baselines: dict[str, Baseline], live: set[str], answers: dict[str, scraper.PodMetrics],
            latency_metric: str) -> tuple[dict[str, Baseline], float, histogram.Buckets]:
    """(new baselines, requests finished since the last scrape, their latency histogram).

    `live` are the pods that still exist; `answers` the metrics of those that answered."""
    kept = {pod: b for pod, b in baselines.items() if pod in live}
    finished, deltas = 0.0, []
    for pod, metrics in answers.items():
        now = Baseline(metrics.requests_total, metrics.latency_buckets.get(latency_metric, ()),
                       metrics.prompt_tokens_total, metrics.generation_tokens_total,
                       metrics.finished_output_tokens_total)
        before = kept.get(pod)
        if before is not None:  # a first scrape is only a baseline: its counts span the pod's whole life
            restarted = now.finished < before.finished
            finished += now.finished if restarted else now.finished - before.finished
            deltas.append(now.latency if restarted else histogram.bucket_delta(now.latency, before.latency))
        kept[pod] = now
    return kept, finished, histogram.add_buckets(*deltas)


def answers_http(pod: PodSummary) -> bool:
    return pod.ready and not pod.terminating and bool(pod.ip)


def prefill_autoscaled(spec: Mapping) -> bool:
    return bool((((spec.get("prefill") or {}).get("autoscaling")) or {}).get("enabled"))


def decode_pool_spec(spec: api.InferenceServiceSpec) -> api.InferenceServiceSpec:
    """With spec.prefill the decode pool (spec.replicas) scales on concurrency and inter-token latency: its
    prompts' time to first token is the prefill pool's signal."""
    if spec.prefill is None:
        return spec
    return spec.model_copy(update={"autoscaling": spec.autoscaling.model_copy(update={"latency_metric": "itl"})})


def router_url(pod: dict) -> str | None:
    summary = summaries.summarize_pod(pod)
    if not answers_http(summary):
        return None
    # The admin port (`kaon-router --admin-port`) shows every service's held requests; the main
    # port's /metrics leaves out those with spec.auth.
    port = urls.named_port(pod, "admin", "http", default=ROUTER_METRICS_PORT)
    return f"{urls.base_url(summary.ip or '', port)}/metrics"


def observed(sample: autoscaler.Sample, kv_usage: list[float], target: float, spec: api.AutoscalingSpec,
             history: list[autoscaler.Sample]) -> dict:
    up_window = [s for s in history if s.time >= sample.time - spec.scale_up_window_seconds and s.complete]
    p99, _ = autoscaler.window_p99(up_window)
    return {"queueDepth": sample.waiting, "runningRequests": sample.running,
            "concurrencyPerReplica": round(sample.concurrency / max(sample.ready, 1), 2),
            "targetConcurrencyPerReplica": target, "p99LatencySeconds": p99,
            "kvCacheUsageRatio": max(kv_usage) if kv_usage else None, "time": kubetime.stamp(sample.time)}


class AutoscaleLoop:
    """Runs in kopf's event loop; reads the caches, writes through the API client in threads, and
    keeps what it remembers of a service in the service's record (records.AutoscaleMemory). Its
    conditions go to the status writer whenever they change: MetricsAvailable (dropped once the
    service is no longer autoscaled) and Profiled (spec.autoscaling.profile: profile_sync.py)."""

    def __init__(self, ctx: Context, url_of: Callable[[PodSummary], str] = urls.engine_url):
        self.ctx, self.kube, self.caches, self.url_of = ctx, ctx.kube, ctx.caches, url_of
        settings = ctx.config.autoscale
        self.interval, self.release_namespace = settings.interval, settings.release_namespace
        self.use_lease, self.identity = settings.use_lease, reporting_instance()
        self.leading = not self.use_lease
        """Whether this operator held the Lease at its last tick (the pressure loop acts only then)."""
        self.http: aiohttp.ClientSession | None = None

    async def run(self) -> None:
        self.http = aiohttp.ClientSession()
        try:
            while True:
                started = clock.monotonic()
                try:
                    self.leading = not self.use_lease or await asyncio.to_thread(
                        self.kube.hold_lease, self.release_namespace, LEASE_NAME, self.identity, LEASE_SECONDS)
                    if self.leading:
                        await self.tick_all()
                except Exception:  # one bad tick (an apiserver hiccup) must not end autoscaling
                    logger.exception("autoscale tick failed")
                await asyncio.sleep(max(0.0, self.interval - (clock.monotonic() - started)))
        finally:
            await self.http.close()

    def _client(self) -> aiohttp.ClientSession:
        if self.http is None:
            raise RuntimeError("the HTTP session opens in run()")
        return self.http

    async def _autoscaled(self) -> list[tuple[Key, Mapping, api.InferenceServiceSpec]]:
        out = []
        for key, body in self.caches.all_inference_services():
            if body["metadata"].get("deletionTimestamp"):
                continue
            if not (((body.get("spec") or {}).get("autoscaling") or {}).get("enabled")
                    or prefill_autoscaled(body.get("spec") or {})):
                continue
            # A spec the admin's policy refuses gets no profiling Job either (its image, its Secrets).
            spec = spec_policy.checked(body["spec"], self.ctx.config.spec_policy)
            if isinstance(spec, api.InferenceServiceSpec):  # the reconcile handler reports an invalid spec
                out.append((key, body, spec))
        autoscaled = {key for key, _, _ in out}
        for key, record in self.ctx.records.items():
            if key in autoscaled or record.autoscale is None:
                continue
            record.autoscale = None
            if conditions.METRICS in record.conditions:
                await asyncio.to_thread(status_sync.metrics_changed, self.ctx, key, None)
            if conditions.PROFILED in record.conditions:
                await asyncio.to_thread(status_sync.profile_changed, self.ctx, key, None)
        return out

    async def tick_all(self) -> None:
        services = await self._autoscaled()
        if not services:
            return
        held = await self._router_held()
        await asyncio.gather(*(self.tick(key, body, spec, held) for key, body, spec in services))

    async def _router_held(self) -> dict[Key, float] | None:
        """Requests the routers hold per (namespace, InferenceService); None when there are
        routers and none answered (then nobody knows what they hold)."""
        pods = await asyncio.to_thread(self.kube.list_pods, self.release_namespace, ROUTER_PODS)
        urls = [url for url in map(router_url, pods) if url]
        if not urls:
            return {}
        texts = await asyncio.gather(*(scraper.fetch(self._client(), url, SCRAPE_TIMEOUT_SECONDS) for url in urls))
        held: dict[Key, float] = {}
        answered = False
        for text in filter(None, texts):
            try:
                counts = scraper.parse_router_held(text)
            except scraper.BadExposition:
                continue
            answered = True
            for key, count in counts.items():
                held[key] = held.get(key, 0.0) + count
        return held if answered else None

    async def _scrape_engines(self, pods: list[PodSummary]) -> dict[str, scraper.PodMetrics]:
        ready = [p for p in pods if answers_http(p)]
        texts = await asyncio.gather(*(scraper.fetch(self._client(), f"{self.url_of(p)}/metrics",
                                                     SCRAPE_TIMEOUT_SECONDS) for p in ready))
        out = {}
        for pod, text in zip(ready, texts):
            try:
                if text is not None:
                    out[pod.name] = scraper.parse(text)
            except scraper.BadExposition:
                pass  # counted as not answering
        return out

    async def tick(self, key: Key, body: Mapping, spec: api.InferenceServiceSpec,
                   held: dict[Key, float] | None) -> None:
        uid = body["metadata"].get("uid")
        record = self.ctx.records.get(key)
        memory = record.autoscale
        if memory is None or memory.uid != uid:
            memory = record.autoscale = AutoscaleMemory(uid=uid)
        spec = decode_pool_spec(spec)
        auto, now = spec.autoscaling, clock.seconds()
        pods = [p for p in self.caches.pods(key) if not p.terminating]
        answers = await self._scrape_engines(pods)
        if spec.prefill is not None and spec.prefill.autoscaling.enabled:
            await self._tick_prefill(key, body, spec.prefill, memory, pods, answers, now)
        if not auto.enabled:
            return
        prompt_tokens, output_tokens, finished_output_tokens = token_deltas(memory.baselines, answers)
        memory.baselines, finished, latency = advance(memory.baselines, {p.name for p in pods}, answers,
                                                      auto.latency_metric)
        ready = sum(answers_http(p) for p in pods)
        sample = autoscaler.Sample(
            time=now, ready=ready, answered=len(answers), starting=sum(not p.ready and not p.asleep for p in pods),
            waiting=sum(m.waiting for m in answers.values()), running=sum(m.running for m in answers.values()),
            finished=finished, latency=latency, held_by_router=None if held is None else held.get(key, 0.0),
            prompt_tokens=prompt_tokens, output_tokens=output_tokens, finished_output_tokens=finished_output_tokens)
        memory.history.append(sample)
        del memory.history[:sum(s.time < now - autoscaler.history_seconds(auto) for s in memory.history)]

        last = (body.get("status") or {}).get("lastScaleDecision") or {}
        decision = await self._decide(key, body, spec, memory, now, kubetime.epoch(last.get("time")))
        decision = standby.from_zero(decision, spec.autoscaling, spec.replicas)
        await self._act(key, body, spec, sample, answers, memory, decision)

    async def _decide(self, key: Key, body: Mapping, spec: api.InferenceServiceSpec,
                      memory: AutoscaleMemory, now: float, last_change: float | None) -> autoscaler.Decision:
        """The spec's policy; predictive without a readable profile decides as the reactive one, and says so.
        A profile is resolved whatever the policy (profile: auto measures the engine before a switch to predictive)."""
        auto = spec.autoscaling
        profile = await asyncio.to_thread(resolve, self.kube, body, spec, memory.profile, self.ctx.post)
        if self.ctx.records.get(key).conditions.get(conditions.PROFILED) != profile.condition:
            await asyncio.to_thread(status_sync.profile_changed, self.ctx, key, profile.condition)
        memory.model = profile.model  # the prefill pool's tick sizes from it too
        if auto.policy == "predictive" and profile.model is not None:
            return predictive.decide(memory.history, auto, spec.replicas, now, last_change, model=profile.model,
                                     max_num_seqs=spec.engine.batch_slots(slots_measured(profile.model)))
        decision = autoscaler.decide(memory.history, auto, spec.replicas, now, last_change,
                                     max_num_seqs=spec.engine.batch_slots(slots_measured(profile.model)))
        if auto.policy == "predictive":
            why = f"no performance model in ConfigMap {profile.name} key {api.PROFILE_KEY} yet: reactive"
            return autoscaler.Decision(decision.replicas, f"{decision.reason} ({why})", decision.metrics_missing,
                                       decision.capped_from)
        return decision

    async def _tick_prefill(self, key: Key, body: Mapping, prefill: api.PrefillSpec, memory: AutoscaleMemory,
                            decode_pods: list[PodSummary], decode_answers: dict[str, scraper.PodMetrics],
                            now: float) -> None:
        """The prefill pool's own tick: its queued prompt tokens and prompt-token rate, the decode pods' TTFT
        (prefill_scaling.py decides); writes spec.prefill.replicas and posts a PrefillScaled Event."""
        namespace, name = key
        selector = ",".join(f"{k}={v}" for k, v in prefill_pool.selector(name).items())
        listed = await asyncio.to_thread(self.kube.list_pods, namespace, selector)
        pods = [p for p in map(summaries.summarize_pod, listed) if not p.terminating]
        answers = await self._scrape_engines(pods)
        prompt_tokens, _, _ = token_deltas(memory.prefill_baselines, answers)
        memory.prefill_baselines, _, _ = advance(memory.prefill_baselines, {p.name for p in pods}, answers, "ttft")
        memory.ttft_baselines, _, ttft = advance(memory.ttft_baselines, {p.name for p in decode_pods},
                                                 decode_answers, "ttft")
        elapsed = None if memory.prefill_scraped_at is None else now - memory.prefill_scraped_at
        memory.prefill_scraped_at = now
        load = prefill_scaling.PrefillLoad(
            queued_prompt_tokens=sum(m.prompt_tokens_waiting for m in answers.values()),
            ttft_p99=histogram.quantile(ttft, 0.99) if ttft else None,
            prompt_tokens_per_second=prompt_tokens / elapsed if elapsed else 0.0,
            ready_replicas=sum(p.ready for p in pods))
        replicas, why = prefill_scaling.decide(load, prefill.autoscaling, prefill.replicas, now,
                                               memory.prefill_last_change, memory.model)
        if replicas == prefill.replicas:
            return
        await asyncio.to_thread(self.kube.patch_prefill_replicas, namespace, name, replicas)
        memory.prefill_last_change = now
        direction = "up" if replicas > prefill.replicas else "down"
        await asyncio.to_thread(self.ctx.post, body, [EventSpec(
            "Normal", "PrefillScaled", f"Scaled the prefill pool {direction} {prefill.replicas} → {replicas}: {why}")])

    async def _act(self, key, body, spec: api.InferenceServiceSpec, sample: autoscaler.Sample,
                   answers: dict[str, scraper.PodMetrics], memory: AutoscaleMemory,
                   decision: autoscaler.Decision) -> None:
        namespace, name = key
        slots = spec.engine.batch_slots(slots_measured(memory.model))
        target = autoscaler.concurrency_target(spec.autoscaling, slots)
        patch = {"observedMetrics": observed(sample, [m.kv_cache_usage for m in answers.values()], target,
                                             spec.autoscaling, memory.history)}
        changed = decision.replicas != spec.replicas
        if changed:
            patch["lastScaleDecision"] = {"time": kubetime.stamp(sample.time), "from": spec.replicas,
                                          "to": decision.replicas, "reason": decision.reason}
            if not await asyncio.to_thread(self.scale, body, patch, decision.replicas):
                logger.info("%s/%s changed while deciding to scale to %d; deciding again next tick",
                            namespace, name, decision.replicas)
                return
        else:
            await asyncio.to_thread(self.kube.patch_status, namespace, name, patch)
        events = []
        if changed:
            direction = "up" if decision.replicas > spec.replicas else "down"
            events.append(EventSpec("Normal", "Scaled",
                                    f"Scaled {direction} {spec.replicas} → {decision.replicas}: {decision.reason}"))
        if decision.capped_from is not None and not memory.capped:
            events.append(EventSpec("Warning", "ScaleCapped",
                                    f"the load asks for {decision.capped_from} replicas; capped at maxReplicas "
                                    f"{spec.autoscaling.max_replicas}: {decision.reason}"))
        memory.capped = decision.capped_from is not None
        if events:
            await asyncio.to_thread(self.ctx.post, body, events)
        condition = conditions.metrics_condition(decision.metrics_missing, sample.answered or 0, sample.ready)
        if self.ctx.records.get(key).conditions.get(conditions.METRICS) != condition:
            await asyncio.to_thread(status_sync.metrics_changed, self.ctx, key, condition)

    def scale(self, body: Mapping, status_patch: dict, replicas: int) -> bool:
        return write_scale(self.ctx, body, status_patch, replicas)


def write_scale(ctx: Context, body: Mapping, status_patch: dict, replicas: int) -> bool:
    """Write the decision (status, with lastScaleDecision) then spec.replicas, both only while the
    InferenceService is still the one the decision was made on (resourceVersion preconditions).

    The service's record says `scaled_to` before spec.replicas is written, so the update handler
    knows the change is the autoscaler's (which posts its own Event). A 409 from a write that left
    the spec alone (metadata.generation unchanged: the operator's own status updates, kopf's
    annotations) is retried at the new resourceVersion; a changed spec (a human's `kubectl scale`,
    a new maxReplicas) drops the decision, puts lastScaleDecision back, and the next tick decides
    on the new spec. False when dropped (or the object is gone)."""
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    version, generation = meta.get("resourceVersion"), meta.get("generation")
    record = ctx.records.get(Key(namespace, name))
    status_written = False
    for _ in range(CONFLICT_RETRIES):
        try:
            if not status_written:
                written = ctx.kube.patch_status(namespace, name, status_patch, resource_version=version)
                if written is None:
                    return False
                status_written, version = True, written["metadata"]["resourceVersion"]
            record.scaled_to = replicas  # before the write: its update event may be handled before it returns
            try:
                ctx.kube.patch_replicas(namespace, name, replicas, resource_version=version)
            except BaseException:
                record.scaled_to = None
                raise
            return True
        except Conflict:
            current = ctx.kube.get_inference_service(namespace, name)
            if current is None:
                return False
            if current["metadata"].get("generation") != generation:
                break
            version = current["metadata"]["resourceVersion"]
    if status_written:  # the change did not happen: the status must not say it did
        previous = (body.get("status") or {}).get("lastScaleDecision")
        ctx.kube.patch_status(namespace, name, {"lastScaleDecision": previous})
    return False
