"""The operator never takes over what it did not create (a real control plane, the operator as
its least-privilege ServiceAccount): an InferenceService named like an existing Service leaves
it untouched, says so (ResourceConflict condition, Warning Event naming it), and deleting the
InferenceService deletes nothing of it; a spec asking for more than the admin allows (a hostPath
volume) is refused before any pod is made."""
from __future__ import annotations

import json
import time

import pytest

from support.cluster import Cluster, isvc, wait_for

VICTIM = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "victim", "labels": {"app": "someone-else"}},
          "spec": {"selector": {"app": "someone-else"}, "ports": [{"port": 80, "targetPort": 8080}]}}


@pytest.fixture
def cluster(operator, crd, namespace) -> Cluster:
    return Cluster(crd, namespace)


def test_an_unowned_service_of_the_same_name_is_left_untouched_and_reported(cluster):
    cluster.kubectl("apply", "-f", "-", input=json.dumps(VICTIM))
    before = cluster.get("service", "victim")
    cluster.kubectl("apply", "-f", "-", input=isvc("victim"))
    conflict = wait_for("the ResourceConflict condition",
                        lambda: cluster.condition_if("victim", "ResourceConflict", "True"))
    assert "Service" in conflict["message"] and "victim" in conflict["message"]
    assert cluster.condition("victim", "Ready")["reason"] == "ResourceConflict"
    wait_for("the Warning Event naming it", lambda: any(
        t == "Warning" and r == "ResourceConflict" and "victim" in m for t, r, m in cluster.events("victim")))
    after = cluster.get("service", "victim")
    assert after["spec"]["selector"] == {"app": "someone-else"}
    assert not after["metadata"].get("ownerReferences")
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]

    cluster.kubectl("delete", "infsvc", "victim", "--wait=true")
    time.sleep(2)  # the garbage collector would have acted by now
    kept = cluster.get("service", "victim")
    assert kept is not None and kept["metadata"]["uid"] == before["metadata"]["uid"]


def test_a_spec_asking_for_a_host_path_is_invalid_and_makes_no_pod(cluster):
    cluster.kubectl("apply", "-f", "-", input=isvc("hostile", engine={
        "volumes": [{"name": "root", "hostPath": {"path": "/"}}],
        "volumeMounts": [{"name": "root", "mountPath": "/host"}]}))
    refused = wait_for("the InvalidSpec condition", lambda: cluster.condition_if("hostile", "Degraded", "True"))
    assert refused["reason"] == "InvalidSpec" and "hostPath" in refused["message"]
    assert cluster.get("deployment", "hostile") is None
