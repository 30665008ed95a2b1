"""A route's running figures (pure): requests per tier, cache hits, engine tokens and their cost
against sending every request to the top tier. The status writer and `kubectl get` read these."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Figures:
    requests: dict[str, int] = field(default_factory=dict)
    """Answered by a model, per tier (cache hits are not)."""
    hits: int = 0
    misses: int = 0
    cost: float = 0.0
    top_cost: float = 0.0
    """What the same tokens would have cost on the top tier, cache hits included (they cost 0 here)."""

    def answered(self, tier: str, tokens: int, cost_per_million: float, top_cost_per_million: float) -> None:
        self.requests[tier] = self.requests.get(tier, 0) + 1
        self.misses += 1
        self.cost += tokens * cost_per_million / 1e6
        self.top_cost += tokens * top_cost_per_million / 1e6

    def hit(self, tokens: int, top_cost_per_million: float) -> None:
        self.hits += 1
        self.top_cost += tokens * top_cost_per_million / 1e6

    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def cost_vs_top(self) -> float:
        return self.cost / self.top_cost if self.top_cost else 1.0

    def shares(self, services: list[str]) -> dict[str, float]:
        total = sum(self.requests.get(s, 0) for s in services)
        return {s: (self.requests.get(s, 0) / total if total else 0.0) for s in services}

    def status(self, services: list[str]) -> dict:
        shares = self.shares(services)
        return {
            "tiers": [{"service": s, "share": round(shares[s], 4), "requests": self.requests.get(s, 0)}
                      for s in services],
            "shares": " / ".join(f"{s} {shares[s]:.0%}" for s in services),
            "requests": self.hits + self.misses,
            "cacheHitRate": round(self.hit_rate(), 4),
            "costVsTopTier": round(self.cost_vs_top(), 4),
        }
