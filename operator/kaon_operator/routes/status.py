"""An InferenceRoute's status and Events, from the router's figures. Pure: the router's status writer
(router/route_status.py) sends what these return."""
from __future__ import annotations

from kaon_operator.routes import monitor, replicas
from kaon_operator.routes.table import Route


def ready_condition(route: Route, missing: list[str], now: str) -> dict:
    if missing:
        return {"type": "Ready", "status": "False", "reason": "TierMissing", "lastTransitionTime": now,
                "message": f"no InferenceService {', '.join(missing)} in namespace {route.key.namespace}: requests "
                           "classified for it get a 503", "observedGeneration": route.generation}
    return {"type": "Ready", "status": "True", "reason": "TiersFound", "lastTransitionTime": now,
            "message": f"{len(route.services)} tiers: {', '.join(route.services)}",
            "observedGeneration": route.generation}


def status(route: Route, own: dict, others: list[dict], missing: list[str], now: str, now_epoch: float,
           previous: dict | None = None) -> dict:
    """The status one router replica applies: its own `replicas` entry (`own`, replicas.entry) and the
    totals of it and the other replicas' fresh entries (as last read). The Ready condition keeps its
    lastTransitionTime while its status holds."""
    counted = [own, *replicas.fresh(others, now_epoch)]
    out = replicas.total_figures(counted).status(route.services)
    out["agreement"] = replicas.total_agreement(counted)
    out["replicas"] = [own]
    condition = ready_condition(route, missing, now)
    for old in (previous or {}).get("conditions") or ():
        if old.get("type") == "Ready" and old.get("status") == condition["status"]:
            condition["lastTransitionTime"] = old.get("lastTransitionTime", now)
    out["conditions"] = [condition]
    out["observedGeneration"] = route.generation
    return out


def escalation_event(route: Route, tier: str, request_class: str, rate: float, samples: int) -> dict:
    """A Warning Event on the route: a class escalated to the next tier."""
    services = route.services
    to = services[min(services.index(tier) + 1, len(services) - 1)] if tier in services else "the next tier"
    return {"type": "Warning", "reason": "Escalated",
            "message": f"requests of class {request_class} agreed with the top tier in {rate:.0%} of {samples} "
                       f"comparisons on tier {tier}, below verify.minAgreement "
                       f"{route.spec.verify.min_agreement:.0%}: they go to {to} from now on"}


def recovery_event(route: Route, tier: str, request_class: str, rate: float, samples: int) -> dict:
    """A Normal Event on the route: an escalated class returns to its tier."""
    verify = route.spec.verify
    bar = monitor.recovery_bar(verify.min_agreement, verify.recover_agreement)
    return {"type": "Normal", "reason": "EscalationEnded",
            "message": f"requests of class {request_class} agreed with the top tier in {rate:.0%} of {samples} "
                       f"comparisons on tier {tier} since they were escalated, at or above {bar:.0%} "
                       f"(verify.recoverAgreement): they go to {tier} again"}
