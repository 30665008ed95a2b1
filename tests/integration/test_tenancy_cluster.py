"""Tenancy on the real control plane and chart: the router's RBAC scoped to its namespaces, NameConflict conditions
and Events."""
from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from e2e.control_plane import build_binaries
from kaon_operator.router.main import build_parser, default_namespace
from kaon_operator.status import conditions, summaries

CHART = Path(__file__).resolve().parents[2] / "charts" / "kaon"


def test_chart_scopes_the_routers_rbac_to_its_namespaces_and_passes_the_tenancy_flags():
    def template(*sets: str) -> list[dict]:
        args = [str(build_binaries() / "helm"), "template", "kaon", str(CHART), "-n", "kaon-system"]
        args += [a for s in sets for a in ("--set", s)]
        res = subprocess.run(args, capture_output=True, text=True, timeout=120, check=True,
                             env={"HOME": "/tmp", "PATH": "/usr/bin:/bin"})
        return [d for d in yaml.safe_load_all(res.stdout) if d]

    default = template()
    role = next(d for d in default if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "kaon-router")
    assert all("secrets" not in r["resources"] for r in role["rules"])  # digests in the status instead
    args = next(d for d in default if d["kind"] == "Deployment" and d["metadata"]["name"] == "kaon-router")[
        "spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--cluster-wide-names" not in args
    assert default_namespace(build_parser().parse_args(args[1:])) == "default"

    scoped = template("router.watchNamespaces={team-a,team-b}", "router.clusterWideNames=true",
                      "router.defaultNamespace=team-a")
    kinds = {(d["kind"], d["metadata"].get("namespace")) for d in scoped if "router" in d["metadata"]["name"]}
    assert ("ClusterRole", None) not in kinds and ("ClusterRoleBinding", None) not in kinds
    assert {("Role", "team-a"), ("Role", "team-b"), ("RoleBinding", "team-a"), ("RoleBinding", "team-b")} <= kinds
    roles = [d for d in scoped if d["kind"] == "Role" and d["metadata"]["name"] == "kaon-router"]
    assert all("secrets" not in r["resources"] for role in roles for r in role["rules"])
    args = next(d for d in scoped if d["kind"] == "Deployment" and d["metadata"]["name"] == "kaon-router")[
        "spec"]["template"]["spec"]["containers"][0]["args"]
    assert {"--default-namespace=team-a", "--cluster-wide-names"} <= set(args)
    parsed = build_parser().parse_args(args[1:])
    assert parsed.cluster_wide_names and parsed.namespace == ["team-a", "team-b"]
    # Without defaultNamespace, a router of a few namespaces resolves bare names in the first.
    assert default_namespace(build_parser().parse_args(["--namespace=team-b", "--namespace=team-a"])) == "team-b"


def test_the_later_of_two_serving_one_name_gets_name_conflict_and_events_on_both_edges():
    def body(name: str, served: str, created: str) -> dict:
        return {"metadata": {"namespace": "a", "name": name, "creationTimestamp": created},
                "spec": {"model": {"uri": "builtin://x", "servedName": served}}}

    older = summaries.served_name(body("first", "dup", "2026-01-01T00:00:00Z"))
    later = summaries.served_name(body("second", "dup", "2026-01-01T00:00:05Z"))
    alone = summaries.served_name(body("third", "solo", "2026-01-01T00:00:09Z"))
    assert later == summaries.ServedName(("a", "second"), "dup", older.created + 5)
    found = conditions.name_conflicts([later, alone, older])
    assert set(found) == {("a", "second")}
    cond = found[("a", "second")]
    assert cond["type"] == "NameConflict" and cond["status"] == "True" and cond["reason"] == "ServedNameTaken"
    assert "`dup`" in cond["message"] and "first" in cond["message"]
    ready = {"type": "Ready", "status": "True", "reason": "AllReplicasReady", "message": ""}
    raised = conditions.transition_events([ready, cond], [ready])
    assert [(e.type, e.reason) for e in raised] == [("Warning", "NameConflict")]
    assert conditions.transition_events([ready, cond], [ready, cond]) == []  # no repeat while it holds
    cleared = conditions.transition_events([ready], [ready, cond])
    assert [(e.type, e.reason) for e in cleared] == [("Normal", "NameConflictResolved")]
