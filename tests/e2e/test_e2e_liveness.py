"""Probes, kills and memory limits as a kubelet and the kernel apply them, on the local cluster.

The pod runner (e2e/pod_runner.py) runs the startup, liveness and readiness probes the operator
renders, kills and restarts a container whose startup or liveness probe fails, and kills one whose
process tree passes its memory limit (OOMKilled). Each test breaks a real `kaon serve` engine and
checks what a cluster admin reads: the Degraded condition's reason and message, one Warning Event,
the pod's restartCount and lastState, the kubelet-style pod Events, and Recovered once it is fixed.
Probe periods are kept short through the spec (startupTimeoutSeconds, stallTimeoutSeconds), never
by asserting on durations.
"""
from __future__ import annotations

import json
import os
import signal

import pytest
from openai import OpenAI

from e2e.local_cluster import LOCAL_IMAGE
from e2e.probes import ProbeState, parse_quantity
from support.cluster import Cluster, isvc, wait_for

ENGINE = {"image": LOCAL_IMAGE, "maxNumSeqs": 2}


@pytest.fixture
def local(local):
    """The shared local cluster (tests/e2e/conftest.py), its pod runner probing as declared: these
    tests are of the probes, so no quick looks between runs for the engines they start."""
    look, local.pods.probe_look = local.pods.probe_look, None
    yield local
    local.pods.probe_look = look


def pod_events(cluster: Cluster, pod: str) -> list[tuple[str, str, str]]:
    return [(e["type"], e["reason"], e["message"]) for e in cluster.get("events") or []
            if e["involvedObject"]["kind"] == "Pod" and e["involvedObject"]["name"] == pod]


def engine_status(cluster: Cluster, name: str) -> dict:
    pods = cluster.running_pods(name)
    return (pods[0]["status"].get("containerStatuses") or [{}])[0] if pods else {}


def warnings(cluster: Cluster, name: str) -> list[str]:
    return [r for t, r, _m in cluster.events(name) if t == "Warning"]


def test_a_stopped_engine_fails_liveness_and_is_restarted(local, crd, namespace):
    """SIGSTOP: the engine answers nothing; its liveness probe times out three times, the runner kills it
    (SIGTERM is ignored while stopped, so SIGKILL after the probe's grace period), restarts it, and the
    new process serves again."""
    cluster = Cluster(crd, namespace)
    # stallTimeoutSeconds 12 -> /health probed every second with a 1 s timeout, three failures.
    cluster.kubectl("apply", "-f", "-", input=isvc("hang", engine={**ENGINE, "stallTimeoutSeconds": 12}))
    wait_for("Ready", lambda: cluster.ready("hang"), timeout=240)
    probe = cluster.pods("hang")[0]["spec"]["containers"][0]["livenessProbe"]
    assert (probe["periodSeconds"], probe["timeoutSeconds"], probe["failureThreshold"]) == (1, 1, 3), probe
    key = f"{namespace}/{cluster.pods('hang')[0]['metadata']['name']}"
    stopped = local.pods.processes[key].proc
    os.kill(stopped.pid, signal.SIGSTOP)
    try:
        cond = wait_for("Degraded Unhealthy", lambda: cluster.condition_if("hang", "Degraded", "True"), timeout=120)
        assert cond["reason"] == "Unhealthy", cond
        assert "was killed (SIGKILL) and restarted" in cond["message"] and "liveness probe failed" in cond["message"]
        assert stopped.poll() == -signal.SIGKILL  # killed after the grace period, not by SIGTERM
    finally:
        if stopped.poll() is None:
            os.kill(stopped.pid, signal.SIGCONT)
    engine = engine_status(cluster, "hang")
    assert engine["restartCount"] >= 1 and engine["lastState"]["terminated"]["exitCode"] == 137, engine
    pod = key.split("/")[1]
    events = pod_events(cluster, pod)
    assert any(t == "Warning" and r == "Unhealthy" and m.startswith("Liveness probe failed: ") for t, r, m in events)
    assert ("Normal", "Killing", "Container engine failed liveness probe, will be restarted") in events

    wait_for("Ready again and not Degraded", lambda: cluster.ready("hang") and
             cluster.condition("hang", "Degraded").get("status") == "False", timeout=240)
    restarted = local.pods.processes[key]
    assert restarted.proc.pid != stopped.pid
    # The new process serves (asked at the pod's IP: the router's side of a hang is another module's).
    engine_url = f"http://{restarted.ip}:{restarted.ports['http']}/v1"
    answer = OpenAI(base_url=engine_url, api_key="unused", max_retries=0, timeout=120).completions.create(
        model="hang", prompt="The capital of France is", max_tokens=4, temperature=0)
    assert answer.choices[0].text
    # Once each, not per failed probe or tick: it stopped answering (NotReady), and why (Unhealthy).
    assert sorted(warnings(cluster, "hang")) == ["NotReady", "Unhealthy"]
    assert ("Normal", "Recovered", "no longer degraded (Unhealthy)") in cluster.event_posted("hang", "Recovered")


def test_an_engine_over_its_memory_limit_is_oom_killed_then_recovers(local, crd, namespace):
    """limits.memory below what the engine needs to load: the runner SIGKILLs it as the OOM killer would
    and reports OOMKilled (exit 137), which the operator names; a higher limit rolls out and serves."""
    cluster = Cluster(crd, namespace)
    cluster.kubectl("apply", "-f", "-", input=isvc("oom", engine=ENGINE,
                                                   resources={"limits": {"memory": "200Mi"}}))
    cond = wait_for("Degraded OOMKilled", lambda: cluster.condition_if("oom", "Degraded", "True"), timeout=120)
    assert cond["reason"] == "OOMKilled", cond
    assert "more memory than its limit (exit code 137" in cond["message"], cond
    last = wait_for("lastState", lambda: engine_status(cluster, "oom").get("lastState"), timeout=30)
    assert last["terminated"]["reason"] == "OOMKilled" and last["terminated"]["exitCode"] == 137, last
    assert not cluster.ready("oom")

    cluster.kubectl("patch", "infsvc", "oom", "--type=merge", "-p",
                    json.dumps({"spec": {"resources": {"limits": {"memory": "16Gi"}}}}))
    wait_for("Ready and not Degraded", lambda: cluster.ready("oom") and
             cluster.condition("oom", "Degraded").get("status") == "False", timeout=240)
    assert warnings(cluster, "oom") == ["OOMKilled"]
    assert ("Normal", "Recovered", "no longer degraded (OOMKilled)") in cluster.event_posted("oom", "Recovered")


def test_an_engine_slower_than_its_startup_budget_is_restarted_and_startup_timeout(local, crd, namespace):
    """startupTimeoutSeconds 1: the startup probe fails before the engine can listen; the runner kills
    and restarts it with a back-off, and the operator says StartupTimeout with the knob to turn."""
    cluster = Cluster(crd, namespace)
    cluster.kubectl("apply", "-f", "-", input=isvc("slow", engine={**ENGINE, "startupTimeoutSeconds": 1}))
    cond = wait_for("Degraded StartupTimeout", lambda: cluster.condition_if("slow", "Degraded", "True"), timeout=120)
    assert cond["reason"] == "StartupTimeout", cond
    assert "before it ever became ready" in cond["message"] and "startupTimeoutSeconds" in cond["message"], cond
    engine = wait_for("a restart", lambda: engine_status(cluster, "slow").get("restartCount", 0) >= 2 and
                      engine_status(cluster, "slow"), timeout=120)
    assert engine["lastState"]["terminated"]["exitCode"] in (137, 143), engine
    pod = cluster.running_pods("slow")[0]["metadata"]["name"]
    assert ("Normal", "Killing", "Container engine failed startup probe, will be restarted") in pod_events(cluster, pod)
    assert not cluster.ready("slow")

    cluster.kubectl("patch", "infsvc", "slow", "--type=merge", "-p",
                    json.dumps({"spec": {"engine": {"startupTimeoutSeconds": 600}}}))
    wait_for("Ready and not Degraded", lambda: cluster.ready("slow") and
             cluster.condition("slow", "Degraded").get("status") == "False", timeout=240)
    assert warnings(cluster, "slow") == ["StartupTimeout"]
    assert ("Normal", "Recovered", "no longer degraded (StartupTimeout)") in cluster.event_posted("slow", "Recovered")


# The probe rules themselves, without processes --------------------------------------------------------------------


def test_probe_thresholds_periods_and_initial_delay():
    probe = ProbeState("livenessProbe", {"periodSeconds": 2, "failureThreshold": 3, "initialDelaySeconds": 5},
                       started_at=100.0)
    assert not probe.due(104.9) and probe.due(105.0)
    assert probe.record(True, 105.0) is True and probe.next_at == 107.0
    assert probe.record(False, 107.0) is True and probe.record(False, 109.0) is True  # two failures: still live
    assert probe.record(False, 111.0) is False  # the third in a row fails it
    assert probe.record(True, 113.0) is True  # a success counts the failures from zero
    assert probe.record(False, 115.0) is True
    probe.in_flight = object()
    assert not probe.due(1000.0)  # one GET at a time: a hung process does not pile them up


def test_a_startup_probe_is_undecided_until_it_succeeds_or_runs_out():
    probe = ProbeState("startupProbe", {"periodSeconds": 1, "failureThreshold": 2}, started_at=0.0)
    assert probe.record(False, 0.0) is None and probe.record(True, 1.0) is True
    exhausted = ProbeState("startupProbe", {"periodSeconds": 1, "failureThreshold": 2}, started_at=0.0)
    assert exhausted.record(False, 0.0) is None and exhausted.record(False, 1.0) is False


def test_quantities():
    assert parse_quantity("512Mi") == 512 << 20 and parse_quantity("2Gi") == 2 << 30
    assert parse_quantity("1G") == 10 ** 9 and parse_quantity("1500k") == 1_500_000
    assert parse_quantity("1e9") == 10 ** 9 and parse_quantity(1024) == 1024


def test_a_pdb_refusing_evictions_is_reported_then_clears(local, crd, namespace):
    """Three replicas that all fail: the PDB (minAvailable 2) refuses every eviction; an eviction, as
    `kubectl drain` sends it, really gets 429; the InferenceService says DisruptionAllowed=False with a
    Warning, and True with a Normal Event once the replicas are healthy (KWOK pods, no engines)."""
    cluster = Cluster(crd, namespace)
    cluster.kubectl("apply", "-f", "-", input=isvc("drain", replicas=3, engine={"image": "kwok-fail/crashloop:1"}))
    # ReplicasStarting (quiet) while the pods start, InsufficientHealthyReplicas once they are seen failing
    # (its counts follow the PDB's status while the three pods come: one Warning, the message kept current).
    cond = wait_for("DisruptionAllowed False, all three replicas failing", lambda: (
        c := cluster.condition_if("drain", "DisruptionAllowed", "False"))
        and c["reason"] == "InsufficientHealthyReplicas"
        and "the PodDisruptionBudget keeps 2 of 3 replicas healthy and 0 are" in c["message"] and c, timeout=60)
    pod = cluster.pods("drain")[0]["metadata"]["name"]
    eviction = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": pod, "namespace": namespace}}
    refused = cluster.kubectl("create", "--raw", f"/api/v1/namespaces/{namespace}/pods/{pod}/eviction", "-f", "-",
                              input=json.dumps(eviction), check=False)
    assert refused.returncode != 0 and "disruption budget" in refused.stderr, refused.stderr
    cluster.event_posted("drain", "DisruptionBlocked", "Warning", contains="are refused")

    cluster.kubectl("patch", "infsvc", "drain", "--type=merge", "-p",
                    json.dumps({"spec": {"engine": {"image": "kwok-ready/kaon:1"}}}))
    cond = wait_for("DisruptionAllowed True", lambda: cluster.condition_if("drain", "DisruptionAllowed", "True"),
                    timeout=60)
    assert cond["reason"] == "SufficientHealthyReplicas", cond
    events = cluster.event_posted("drain", "DisruptionAllowed", "Normal")  # trails the condition (kopf's queue)
    assert [r for t, r, _m in events if r == "DisruptionBlocked"] == ["DisruptionBlocked"]


def test_the_rendered_probes_follow_the_spec():
    from kaon_operator import api
    from kaon_operator.children import pod_template

    def engine(**fields) -> api.InferenceServiceSpec:
        return api.InferenceServiceSpec.model_validate({"model": {"uri": "builtin://smollm2-135m-instruct"},
                                                        "engine": fields})

    def shape(probe: dict) -> tuple:
        return probe["periodSeconds"], probe["failureThreshold"], probe["timeoutSeconds"]

    default = engine()
    assert shape(pod_template.startup_probe(default.engine)) == (10, 180, 5)  # 30 minutes, as before
    assert shape(pod_template.liveness_probe(default.engine)) == (10, 3, 5)
    assert pod_template.startup_probe(default.engine)["terminationGracePeriodSeconds"] == 10
    assert "--stall-timeout" in pod_template.engine_args("m", default)
    assert shape(pod_template.startup_probe(engine(startupTimeoutSeconds=1).engine)) == (1, 1, 1)
    assert shape(pod_template.startup_probe(engine(startupTimeoutSeconds=45).engine)) == (4, 12, 4)
    assert shape(pod_template.liveness_probe(engine(stallTimeoutSeconds=12).engine)) == (1, 3, 1)
    assert shape(pod_template.liveness_probe(engine(stallTimeoutSeconds=0).engine)) == (10, 3, 5)
    # A longer startup budget moves the Deployment's progress deadline with it (no false ProgressDeadlineExceeded).
    longer = engine(startupTimeoutSeconds=7200)
    assert (pod_template.progress_deadline_seconds(longer) - pod_template.progress_deadline_seconds(default)
            == 7200 - 1800)
