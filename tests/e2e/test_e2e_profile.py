"""spec.autoscaling.profile: auto end to end on the local cluster (e2e/local_cluster.py): the
operator runs the profiling Job, the pod runner runs its real `kaon profile` on the bundled
SmolLM2 (a small grid, through the engine's environment), the operator writes the model to the
ConfigMap of the spec's key, and the predictive policy decides by it.

The decision seen here is a scale-down (2 -> 1 with no load): the one the predictive policy
takes from the model within a test's minutes on a shared CPU. A scale-up on a prompt-length
shift at a constant rate is tested in the simulator and the pure tests (tests/unit/test_predictive.py).
"""
from __future__ import annotations

import json

import pytest

from e2e.local_cluster import LOCAL_IMAGE, LocalCluster
from kaon_operator.perf_model import PerfModel
from support.cluster import Cluster, isvc, wait_for

MODEL = {"uri": "builtin://smollm2-135m-instruct", "servedName": "smollm2"}
# About 25 s of measurement on a CPU (the default grid takes minutes).
PROFILE_ARGS = ("--batch-sizes 1,2,4 --context-lengths 0,128 --prompt-lengths 32,128,256 --decode-tokens 8 "
                "--repeats 2")


@pytest.fixture
def local(crd):
    with LocalCluster(crd, release="kaon-e2e") as local:
        yield local


def test_profile_auto_measures_the_engine_and_the_predictive_policy_reads_the_model(local, crd, namespace):
    cluster = Cluster(crd, namespace)
    spec = {"model": MODEL, "replicas": 1,
            "engine": {"image": LOCAL_IMAGE, "maxNumSeqs": 8,
                       "env": [{"name": "KAON_PROFILE_ARGS", "value": PROFILE_ARGS}]},
            "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 2, "policy": "reactive",
                            "profile": "auto", "scaleUpWindowSeconds": 10, "scaleDownStabilizationSeconds": 20}}
    cluster.kubectl("apply", "-f", "-", input=isvc("measured", **spec))
    profiled = wait_for("Profiled", lambda: cluster.condition_if("measured", "Profiled", "True"), timeout=300,
                        interval=2)
    name = profiled["message"].rsplit(" ", 1)[-1]
    assert name.startswith("measured-profile-"), profiled
    model = PerfModel.from_json(cluster.get("configmap", name)["data"]["model.json"])
    assert model.a > 0 and len(model.grid) >= 6 and model.cold_start_seconds > 0
    assert model.key["model"] == MODEL["uri"] and model.max_num_seqs == 8
    job = cluster.get("job", name)
    assert job["status"].get("succeeded") == 1 and json.loads(
        job["metadata"]["annotations"]["kaon.dev/profile-key"])["model"] == MODEL["uri"]
    reasons = [r for _, r, _ in cluster.events("measured")]
    assert "Profiling" in reasons and "Profiled" in reasons and "ProfilingFailed" not in reasons

    # Predictive now, with a replica more than an idle service needs: the model says one fits.
    cluster.kubectl("patch", "infsvc", "measured", "--type=merge", "-p",
                    json.dumps({"spec": {"replicas": 2, "autoscaling": {"policy": "predictive"}}}))
    down = wait_for("a scale-down", lambda: [m for _, r, m in cluster.events("measured")
                                             if r == "Scaled" and m.startswith("Scaled down")], timeout=180, interval=2)
    assert down[0].startswith("Scaled down 2 → 1: ") and "by the performance model" in down[0], down
    assert "no performance model" not in down[0]
    # Neither the replica count nor the policy is in the key: still the one Job.
    jobs = cluster.get("jobs", selector="kaon.dev/inferenceservice=measured") or []
    assert [j["metadata"]["name"] for j in jobs] == [name]
