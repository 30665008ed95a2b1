"""Pure: the prefill pool's part of the status (spec.prefill, docs/disaggregation.md): its replica counts,
the PrefillReady condition and the Events of its changes.

Without ready prefill pods the service still answers (the decode pods prefill every prompt themselves,
counting the fallback), so a missing pool is its own condition, not a reason for Ready to be False."""
from __future__ import annotations

from kaon_operator.status.summaries import DeploymentSummary

PREFILL_READY = "PrefillReady"


def counts(deployment: DeploymentSummary | None) -> dict:
    """status.prefillReplicas / prefillReadyReplicas (the `kubectl get infsvc` column)."""
    return {"prefillReplicas": deployment.total if deployment else 0,
            "prefillReadyReplicas": deployment.ready if deployment else 0}


def condition(deployment: DeploymentSummary | None, desired: int) -> dict:
    ready = deployment.ready if deployment else 0
    if desired == 0:
        ok, reason, message = True, "NoPrefillPool", "prefill.replicas is 0: the decode pods prefill every prompt"
    elif deployment is None:
        ok, reason, message = False, "PrefillPending", "the prefill Deployment is not there yet"
    elif deployment.replica_failure:
        ok, reason, message = False, "PrefillReplicaFailure", deployment.replica_failure
    elif ready >= desired:
        ok, reason, message = True, "PrefillPoolReady", f"{ready}/{desired} prefill replicas ready"
    else:
        ok, reason = False, "PrefillPoolNotReady"
        message = f"{ready}/{desired} prefill replicas ready; until then the decode pods prefill prompts themselves"
    return {"type": PREFILL_READY, "status": "True" if ok else "False", "reason": reason, "message": message}


def event(new: dict, prev: dict) -> tuple[str, str, str] | None:
    """(type, reason, message) of the Event a change of PrefillReady deserves, or None."""
    if new["status"] == "True" and prev.get("status") != "True":
        return "Normal", "PrefillReady", new["message"]
    if new["status"] == "False" and prev.get("status") == "True":
        return "Warning", "PrefillNotReady", f"{new['reason']}: {new['message']}"
    return None
