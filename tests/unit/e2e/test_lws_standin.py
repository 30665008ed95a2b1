"""The local cluster's stand-ins for a group on one shared host: each group's own distributed port
(e2e/lws_standin.py) and the kubelet's $(VAR) expansion that carries it (e2e/pod_runner.py)."""
from __future__ import annotations

from e2e.lws_standin import DISTRIBUTED_PORT, pod_manifest
from e2e.pod_runner import expand

LWS = {"metadata": {"name": "pp", "namespace": "ns", "uid": "u"},
       "spec": {"leaderWorkerTemplate": {"size": 2, "workerTemplate": {
           "metadata": {}, "spec": {"containers": [{"name": "engine", "args": ["kaon", "serve"]}]}}}}}


def test_with_leader_ips_each_group_gets_its_own_port():
    leader = pod_manifest(LWS, 1, 0, leader_ip=True, port=31000)
    worker = pod_manifest(LWS, 1, 1, "127.1.0.9", leader_ip=True, port=31000)
    for pod in (leader, worker):
        assert pod["spec"]["containers"][0]["args"][-2:] == ["--distributed-init-address",
                                                             "$(LWS_LEADER_ADDRESS):31000"]
        assert pod["metadata"]["annotations"][DISTRIBUTED_PORT] == "31000"
    plain = pod_manifest(LWS, 1, 0)  # as LWS makes it: port 29500, nothing added
    assert plain["spec"]["containers"][0]["args"] == ["kaon", "serve"]
    assert DISTRIBUTED_PORT not in plain["metadata"]["annotations"]


def test_arguments_expand_the_containers_env_as_the_kubelet_does():
    env = {"LWS_LEADER_ADDRESS": "127.1.0.9"}
    assert expand("$(LWS_LEADER_ADDRESS):31000", env) == "127.1.0.9:31000"
    assert expand("$(UNSET) $$(LWS_LEADER_ADDRESS) $5", env) == "$(UNSET) $(LWS_LEADER_ADDRESS) $5"
