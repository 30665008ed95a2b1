"""Two operator replicas with kopf peering: only the higher priority one acts; when it
stops, the other takes over. (No standalone operator runs in this module.)"""
from __future__ import annotations

import socket
from pathlib import Path

from e2e.operator_process import OperatorProcess
from support.cluster import Cluster, isvc, wait_for

PEERING = Path(__file__).resolve().parents[2] / "deploy" / "operator-peering.yaml"


def test_only_the_highest_priority_replica_acts_until_it_stops(crd, operator_kubeconfig, namespace):
    crd.kubectl("apply", "-f", str(PEERING))
    leader = OperatorProcess(operator_kubeconfig, crd.workdir / "operator-leader.log",
                             "--peering", "kaon-operator", "--priority", "100").start()
    standby = OperatorProcess(operator_kubeconfig, crd.workdir / "operator-standby.log",
                              "--peering", "kaon-operator", "--priority", "10").start()
    cluster = Cluster(crd, namespace)

    def created_by(name: str) -> set[str]:
        return {e["reportingInstance"] for e in cluster.get("events") or []
                if e["involvedObject"]["name"] == name and e["reason"] == "Created"}
    try:
        # Each replica announces itself in the peering object on its own schedule: a standby that
        # reads it before the leader's entry lands acts until it does (kopf's peering works that
        # way, and on a busy machine the window is seconds). The claim is about the settled state.
        def settled() -> bool:
            peers = crd.kubectl_json("get", "clusterkopfpeering", "kaon-operator").get("status")
            log = standby.log(10**6)
            return len(peers or {}) == 2 and log.rfind("Pausing operations") >= log.rfind("Resuming operations")
        wait_for("both replicas in the peering and the standby paused", settled, timeout=60)
        cluster.kubectl("apply", "-f", "-", input=isvc("first"))
        wait_for("first Ready", lambda: cluster.ready("first"))
        assert wait_for("the Created event", lambda: created_by("first")) == {
            f"{socket.gethostname()}-{leader.proc.pid}"}

        leader.stop()  # SIGTERM: kopf withdraws from the peering on the way out
        wait_for("the standby to resume", lambda: "Resuming operations after the pause" in standby.log(), timeout=30)
        cluster.kubectl("apply", "-f", "-", input=isvc("second"))
        wait_for("second Ready", lambda: cluster.ready("second"))
        assert wait_for("the Created event", lambda: created_by("second")) == {
            f"{socket.gethostname()}-{standby.proc.pid}"}
    finally:
        leader.stop()
        standby.stop()
