"""What a real engine and a real router serve on /metrics, rendered by their own metric classes."""
from __future__ import annotations


def engine_metrics_text(waiting: int, running: int, ttfts: list[float], finished: int, *,
                        prompt_tokens: int = 0, generation_tokens: int = 0,
                        output_lengths: tuple[int, ...] = ()) -> str:
    """What a real kaon engine serves on /metrics (its own Metrics class)."""
    from kaon_runtime.engine.llm_engine import EngineStats
    from kaon_runtime.server.metrics import Metrics

    metrics = Metrics(lambda: EngineStats(num_running=running, num_waiting=waiting, kv_cache_usage=0.25,
                                          prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0,
                                          prompt_tokens=prompt_tokens, generation_tokens=generation_tokens))
    for value in ttfts:
        metrics.ttft.observe(value)
    for _ in range(finished):
        metrics.requests.labels(finish_reason="stop").inc()
    for length in output_lengths:
        metrics.output_lengths.observe(length)
    return metrics.render().decode()


def router_metrics_text(namespace: str, name: str, held: int) -> str:
    """What a real kaon router serves on /metrics while it holds requests for a service without pods."""
    from kaon_operator.router.endpoints import EndpointTable, ServiceKey
    from kaon_operator.router.metrics import RouterMetrics

    table = EndpointTable()
    table.apply_service("ADDED", {"metadata": {"namespace": namespace, "name": name, "creationTimestamp":
                                               "2026-01-01T00:00:00Z"}, "spec": {"model": {"uri": "builtin://x"}}})
    return RouterMetrics(table, {}, lambda: {ServiceKey(namespace, name): held}).render().decode()
