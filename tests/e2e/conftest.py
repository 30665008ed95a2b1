"""One local cluster (e2e/local_cluster.py) for every e2e test that can share one.

Each test used to start its own (the chart, the operator, the router, the pod runner) and stop
it, waiting for every engine to drain. Sharing is honest here: every test has a namespace of its
own, and the router serves bare names of every namespace (--cluster-wide-names), as it did for
each test alone. What a test leaves behind could still reach the next one: a bare name resolves
to the oldest InferenceService serving it in any namespace, and a namespace is deleted without
waiting; so after each test its InferenceServices are deleted and gone before the next starts.

The cluster stops after the last test that uses it, not at the end of the session: the
integration tests that follow on the same control plane run operators of their own, which must
not meet this one. test_e2e_stop starts clusters of its own; test_e2e_liveness turns the pod
runner's quick probe looks off for its engines.
"""
from __future__ import annotations

from contextlib import ExitStack

import pytest

from e2e.local_cluster import LocalCluster

RELEASE = "kaon-e2e"  # not deploy/'s "kaon-*" names, which the integration tests' operator uses
_shared: dict[str, LocalCluster] = {}
_stack = ExitStack()


@pytest.fixture
def local(crd, namespace):
    """The shared local cluster (started by the first test that asks), with the LWS stand-in for
    multi-node InferenceServices."""
    if "cluster" not in _shared:
        _shared["cluster"] = _stack.enter_context(LocalCluster(crd, release=RELEASE, leader_worker_sets=True))
    yield _shared["cluster"]
    crd.kubectl("delete", "inferenceservices", "--all", "-n", namespace, "--wait=true", "--timeout=120s",
                check=False, timeout=150)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """Stop the shared cluster once no later test of the session uses it."""
    if "cluster" not in _shared:
        return
    later = item.session.items[item.session.items.index(item) + 1:] if nextitem is not None else []
    if not any("local" in getattr(i, "fixturenames", ()) and i.path.parent == item.path.parent for i in later):
        _shared.clear()
        _stack.close()
