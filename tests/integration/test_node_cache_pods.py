"""Issue 53, the node-local model cache (spec.model.cache.node): a second pod on a node skips the download, and
the prefetch DaemonSet's pod fills the node's cache before an engine pod comes.

The level: the operator's real pod specs (engine pod and prefetch DaemonSet pod), the local cluster's pod runner
playing the kubelet (e2e/pod_runner.py: the hostPath volume as the node's folder, the namespace's subPathExpr,
the env and the init container's command line as it starts them), real `kaon fetch` processes and the real
huggingface_hub client against the stand-in hub (e2e/fake_hub.py), which counts every download. Not here: the
control plane's scheduler and DaemonSet controller placing the pods (the pods are given their node), which the
e2e tests' shared cluster would add at the cost of its slowest part."""
from __future__ import annotations

import copy
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from e2e.pod_runner import PodRunner, _command, _Pod
from kaon_operator import api
from kaon_operator.children import node_prefetch, pod_template
from support.sources import PUBLIC_REPO

pytestmark = pytest.mark.slow  # three `kaon fetch` processes, ~1-3 s each

NEEDED = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


def _spec(hub_url: str) -> api.InferenceServiceSpec:
    # The hub's address reaches the pods as a user would give it: the spec's engine env.
    return api.InferenceServiceSpec.model_validate({
        "model": {"uri": f"hf://{PUBLIC_REPO}", "cache": {"node": True}},
        "engine": {"image": "local/kaon", "env": [{"name": "HF_ENDPOINT", "value": hub_url}]}})


def _pod(template: dict, name: str, node: str, namespace: str = "team-a") -> dict:
    return {"metadata": {"name": name, "namespace": namespace},
            "spec": {**copy.deepcopy(template), "nodeName": node}, "status": {"podIP": "127.0.0.1"}}


def _downloads(hub) -> Counter:
    return Counter({k.removeprefix(PUBLIC_REPO + "/"): v for k, v in hub.downloads.items()
                    if k.startswith(PUBLIC_REPO + "/")})


def _run_init(runner: PodRunner, pod: dict) -> tuple[_Pod, Path]:
    """Start the pod's init container (`kaon fetch`) as the runner does, to completion; the host folder of
    its cache mount."""
    state = _Pod(dirs=runner._volumes(f"{pod['metadata']['namespace']}/{pod['metadata']['name']}", pod))
    [init] = pod["spec"]["initContainers"]
    command, env = runner.init_command(pod, state, init)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    [cache] = [host for path, host in runner._mounts(init, state, pod) if path == pod_template.CACHE_DIR]
    return state, cache


def test_a_second_pod_on_the_node_reuses_the_node_cache_and_the_prefetch_pod_fills_it(hf_hub, tmp_path):
    spec = _spec(hf_hub.url)
    engine_template = pod_template.pod_spec("smol", spec)
    runner = PodRunner(None, tmp_path)  # type: ignore[arg-type]  # no control plane: nothing here calls the API

    before = _downloads(hf_hub)
    first_state, first = _run_init(runner, _pod(engine_template, "smol-a", "node-1"))
    assert _downloads(hf_hub) - before == Counter(NEEDED)  # the first pod on node-1 downloads each file once

    # A second pod of the service on the same node: nothing downloaded, the same folder (the node's).
    again = _downloads(hf_hub)
    second_pod = _pod(engine_template, "smol-b", "node-1")
    second_state, second = _run_init(runner, second_pod)
    assert _downloads(hf_hub) == again
    assert second == first == runner.node_dir(second_pod) / "var/lib/kaon/cache/team-a"
    # ... and its engine container reads the model from there (its caches' env points into that folder).
    engine_env = runner._env(second_pod, second_pod["spec"]["containers"][0], second_state)
    assert engine_env["HF_HOME"].startswith(str(first)) and engine_env["XDG_CACHE_HOME"] == str(first)

    # Another namespace on the node has its own folder (one tenant's models are not another's), another
    # node its own disk: neither finds node-1's files.
    other_tenant = _pod(engine_template, "smol-c", "node-1", namespace="team-b")
    state = _Pod(dirs=runner._volumes("team-b/smol-c", other_tenant))
    [init] = other_tenant["spec"]["initContainers"]
    assert [h for p, h in runner._mounts(init, state, other_tenant) if p == pod_template.CACHE_DIR] \
        == [first.parent / "team-b"]
    other_node = _pod(engine_template, "smol-d", "node-2")
    assert runner._volumes("team-a/smol-d", other_node)["cache"] != first_state.dirs["cache"]

    # The prefetch DaemonSet's pod on node-2: its init container (the engine pod's own fetch) downloads the
    # model into node-2's folder, the very folder an engine pod there mounts, with the completion marker a
    # fetch finds (so it downloads nothing: the second pod above); then its `hold` container waits.
    prefetch_pod = _pod(node_prefetch.pod_spec("smol", spec), "smol-prefetch-x1", "node-2")
    before = _downloads(hf_hub)
    _, prefetched = _run_init(runner, prefetch_pod)
    assert _downloads(hf_hub) - before == Counter(NEEDED)
    engine_pod = _pod(engine_template, "smol-e", "node-2")
    state = _Pod(dirs=runner._volumes("team-a/smol-e", engine_pod))
    [init] = engine_pod["spec"]["initContainers"]
    assert [h for p, h in runner._mounts(init, state, engine_pod) if p == pod_template.CACHE_DIR] == [prefetched]
    assert list(prefetched.rglob(".kaon-complete.json")) and prefetched != first
    [hold] = prefetch_pod["spec"]["containers"]
    waiting = subprocess.Popen(_command(hold.get("args") or [], "127.0.0.1", hold["command"]))
    try:
        time.sleep(0.5)
        assert waiting.poll() is None  # it waits (the DaemonSet's pod stays Running: the node is ready)
    finally:
        waiting.send_signal(signal.SIGTERM)
        assert waiting.wait(timeout=10) == -signal.SIGTERM
