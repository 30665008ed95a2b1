"""Creating an InferenceService reads no Secret its creator could not (issue 48, item 5), against a
real control plane and the operator as its least-privilege ServiceAccount, started with an image
allow-list (`--allowed-image`, the chart's operator.allowedImages): a tenant who may create
InferenceServices tries to get a Secret of its namespace into a pod it shapes, through a projected
volume, a secret volume, and an image of its own next to spec.auth's key Secret. Each spec is
refused before any pod is made: the InvalidSpec condition and a Warning Event name the field."""
from __future__ import annotations

import json

import pytest

from e2e.operator_process import OperatorProcess
from support.cluster import STAND_IN, Cluster, isvc, wait_for

SECRET = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "db-password"}, "type": "Opaque",
          "stringData": {"password": "hunter2"}}


@pytest.fixture(scope="module")
def operator(crd, operator_kubeconfig):
    proc = OperatorProcess(operator_kubeconfig, crd.workdir / "operator-spec-policy.log", "--autoscale-interval", "1",
                           f"--allowed-image={STAND_IN.split(':')[0]}").start()
    yield proc
    proc.stop()


@pytest.fixture
def cluster(operator, crd, namespace) -> Cluster:
    cluster = Cluster(crd, namespace)
    cluster.kubectl("apply", "-f", "-", input=json.dumps(SECRET))
    return cluster


def _refused(cluster: Cluster, name: str, field: str) -> None:
    refused = wait_for("the InvalidSpec condition", lambda: cluster.condition_if(name, "Degraded", "True"))
    assert refused["reason"] == "InvalidSpec" and refused["message"].startswith(field), refused
    wait_for("a Warning Event naming the field", lambda: any(
        t == "Warning" and field in m for t, _r, m in cluster.events(name)))
    assert cluster.get("deployment", name) is None and cluster.pods(name) == []


@pytest.mark.parametrize("volume", [
    {"name": "loot", "projected": {"sources": [{"configMap": {"name": "absent", "optional": True}},
                                               {"secret": {"name": "db-password"}}]}},
    {"name": "loot", "secret": {"secretName": "db-password"}},
], ids=["projected", "secret"])
def test_a_secret_mounted_through_a_volume_is_refused(cluster, volume):
    cluster.kubectl("apply", "-f", "-", input=isvc("thief", engine={
        "volumes": [volume], "volumeMounts": [{"name": "loot", "mountPath": "/loot"}]}))
    _refused(cluster, "thief", "engine.volumes: loot mounts Secret db-password")


def test_an_image_off_the_allow_list_never_sees_the_key_secret(cluster):
    cluster.kubectl("apply", "-f", "-", input=isvc("thief", engine={"image": "attacker.example/exfil:1"},
                                                   auth={"apiKeySecret": "db-password"}))
    _refused(cluster, "thief", "engine.image: attacker.example/exfil:1")


def test_an_allowed_image_still_serves(cluster):
    cluster.kubectl("apply", "-f", "-", input=isvc("fine"))
    wait_for("the Deployment", lambda: cluster.get("deployment", "fine"))
