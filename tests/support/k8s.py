"""Fixtures for tests against a real Kubernetes control plane (see e2e/control_plane.py).

The first run on a fresh machine builds the binaries (e2e/build-control-plane.sh, ~15 min
on 2 cores); later runs find them cached and start the control plane in seconds.
"""
from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from e2e.control_plane import ControlPlane, build_binaries
from e2e.operator_process import OperatorProcess
from kaon_operator.crd import CRD_PATH

ROOT = Path(__file__).resolve().parents[2]
PEERING_CRD = ROOT / "crds" / "kopf-peering.yaml"
ROUTE_CRD = ROOT / "crds" / "inferenceroute.yaml"  # InferenceRoute (issue 52): the router watches it
OPERATOR_RBAC = ROOT / "deploy" / "operator-rbac.yaml"

_names = itertools.count()


@pytest.fixture(scope="session")
def control_plane():
    """etcd, kube-apiserver (RBAC), controller-manager, scheduler, KWOK with 4 fake 8-GPU nodes,
    and the InferenceService CRD (installed before the controller-manager starts, so garbage
    collection of its children works at once)."""
    with ControlPlane(build_binaries(), crds=(CRD_PATH, PEERING_CRD, ROUTE_CRD)) as cp:
        yield cp


@pytest.fixture(scope="session")
def crd(control_plane):
    """The InferenceService CRD, applied (again: a no-op unless it changed) and Established."""
    control_plane.kubectl("apply", "--server-side", "-f", str(CRD_PATH), "-f", str(ROUTE_CRD))
    control_plane.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                          "crd/inferenceservices.kaon.dev", "crd/inferenceroutes.kaon.dev")
    return control_plane


@pytest.fixture
def namespace(control_plane):
    """A fresh namespace per test, deleted (without waiting) afterwards."""
    name = f"t{next(_names)}"
    control_plane.kubectl("create", "namespace", name)
    yield name
    control_plane.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="session")
def operator_kubeconfig(crd):
    """Credentials of the operator's own ServiceAccount, bound to deploy/operator-rbac.yaml's
    ClusterRole and nothing else: a verb missing from that role fails the tests."""
    crd.kubectl("apply", "-f", str(OPERATOR_RBAC))
    return crd.service_account_kubeconfig("kaon-system", "kaon-operator")


@pytest.fixture(scope="module")
def operator(crd, operator_kubeconfig):
    """`python -m kaon_operator` as that ServiceAccount, for one test module (the CRD tests
    write statuses by hand and must not meet a running operator). Its loops run every second
    (5 s and 10 s by default), so a test waits for what it checks, not for the next round."""
    proc = OperatorProcess(operator_kubeconfig, crd.workdir / "operator.log", "--autoscale-interval", "1",
                           "--adapter-interval", "1").start()
    yield proc
    proc.stop()
