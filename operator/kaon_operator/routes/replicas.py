"""Several router replicas, one InferenceRoute status. Pure.

Each router replica holds the figures of the requests it answered. Each writes its own entry of
`status.replicas` (keyed by its pod name, server-side apply with a field manager of its own, so no
replica's write removes another's) and the route's totals, which it computes from every replica's
entry it read from the apiserver plus its own fresh one. So `kubectl get inferenceroute` shows the
sum over the replicas whatever the order of their writes (at most one status round behind), not the
figures of whichever replica wrote last.

An entry not renewed for STALE_SECONDS (its replica is gone or cut off) is left out of the totals; it
stays listed with its `updated` stamp for PRUNE_SECONDS, so that an admin sees which replica stopped
reporting, and is then removed by whichever live replica reads it first (`prune_patch`: a JSON patch
whose `test` operations make the apiserver refuse it when the entry moved, was renewed or was already
removed, so several replicas pruning at once remove it once and nothing else). A restarted replica is a
new pod with a new name: the totals are the figures of the replicas that run now, each since its start
(the kaon_route_* counters behave the same). A replica cut off for longer than PRUNE_SECONDS that comes
back writes its entry again at its next heartbeat.
"""
from __future__ import annotations

from collections.abc import Iterable

from kaon_operator import kubetime
from kaon_operator.routes.figures import Figures
from kaon_operator.routes.monitor import Agreement

HEARTBEAT_SECONDS = 60.0
"""A replica rewrites its entry at least this often, even when nothing changed, to show it is alive."""
STALE_SECONDS = 180.0
"""An entry older than this is not counted."""
PRUNE_SECONDS = 600.0
"""An entry older than this is removed from the status: its replica is gone (a live one renews its entry
every HEARTBEAT_SECONDS). Ten heartbeats: clocks of the replicas a few seconds apart never prune a live one."""


def entry(replica: str, figures: Figures | None, agreement: Agreement | None, now: str) -> dict:
    """This replica's `status.replicas` entry: its raw counts (not ratios, so that entries add up)."""
    figures = figures or Figures()
    rows = []
    for (tier, cls), results in sorted((agreement.results if agreement else {}).items()):
        rows.append({"tier": tier, "class": cls, "agreed": sum(results), "samples": len(results),
                     "escalated": (tier, cls) in agreement.escalated})  # type: ignore[union-attr]
    return {"name": replica, "updated": now,
            "tiers": [{"service": s, "requests": n} for s, n in sorted(figures.requests.items())],
            "hits": figures.hits, "misses": figures.misses,
            "cost": round(figures.cost, 9), "topCost": round(figures.top_cost, 9), "agreement": rows}


def fresh(entries: Iterable[dict], now: float, stale_seconds: float = STALE_SECONDS) -> list[dict]:
    """The entries renewed within `stale_seconds` of `now` (epoch seconds)."""
    out = []
    for e in entries:
        try:
            updated = kubetime.epoch(e.get("updated"))
        except (TypeError, ValueError):
            updated = None
        if updated is not None and now - updated <= stale_seconds:
            out.append(e)
    return out


def prune_patch(entries: list, now: float, keep: str, prune_seconds: float = PRUNE_SECONDS) -> list[dict]:
    """A JSON patch (RFC 6902) removing the `status.replicas` entries (as read, in order) not renewed
    within `prune_seconds` of `now` (epoch seconds); [] when there is none. Each removal is guarded by
    `test` operations on the entry's name and `updated` stamp at its index, all before any removal
    (removals last, from the highest index down, so that the tested indices still hold): if another
    replica pruned first, the entry was renewed or the list changed since the read, the apiserver refuses
    the whole patch and nothing is removed. `keep` (this replica) and entries without a readable stamp
    are never removed."""
    tests: list[dict] = []
    removes: list[dict] = []
    for index, e in enumerate(entries):
        if not isinstance(e, dict) or e.get("name") == keep or not isinstance(e.get("name"), str):
            continue
        try:
            updated = kubetime.epoch(e.get("updated"))
        except (TypeError, ValueError):
            updated = None
        if updated is None or now - updated <= prune_seconds:
            continue
        path = f"/status/replicas/{index}"
        tests += [{"op": "test", "path": f"{path}/name", "value": e["name"]},
                  {"op": "test", "path": f"{path}/updated", "value": e["updated"]}]
        removes.insert(0, {"op": "remove", "path": path})
    return tests + removes


def total_figures(entries: Iterable[dict]) -> Figures:
    out = Figures()
    for e in entries:
        for tier in e.get("tiers") or ():
            out.requests[tier["service"]] = out.requests.get(tier["service"], 0) + int(tier.get("requests", 0))
        out.hits += int(e.get("hits", 0))
        out.misses += int(e.get("misses", 0))
        out.cost += float(e.get("cost", 0.0))
        out.top_cost += float(e.get("topCost", 0.0))
    return out


def total_agreement(entries: Iterable[dict]) -> list[dict]:
    """Per (tier, class): the comparisons of every replica together; escalated when any replica has
    escalated it (that replica sends the class up)."""
    found: dict[tuple[str, str], list] = {}
    for e in entries:
        for row in e.get("agreement") or ():
            into = found.setdefault((row["tier"], row["class"]), [0, 0, False])
            into[0] += int(row.get("agreed", 0))
            into[1] += int(row.get("samples", 0))
            into[2] = into[2] or bool(row.get("escalated"))
    return [{"tier": tier, "class": cls, "agreement": round(agreed / samples, 4) if samples else 1.0,
             "samples": samples, "escalated": escalated}
            for (tier, cls), (agreed, samples, escalated) in sorted(found.items())]


def others(status: dict | None, replica: str) -> list[dict]:
    """The other replicas' entries of a route's status as read from the apiserver."""
    return [e for e in ((status or {}).get("replicas") or ()) if isinstance(e, dict) and e.get("name") != replica]
