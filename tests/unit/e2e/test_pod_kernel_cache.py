"""The local cluster's engine pods share the machine's cache of kaon's compiled C kernels (e2e/pod_runner.py):
each pod's XDG_CACHE_HOME is its own emptyDir, so without it every engine start compiled cpu_decode.c again."""
from __future__ import annotations

from e2e.pod_runner import KERNEL_CACHE_ENV, PodRunner, _Pod, shared_kernel_cache
from kaon_operator import api
from kaon_operator.children import pod_template
from kaon_runtime.kernels import cpu_decode


def _engine_env(tmp_path, engine: dict | None = None) -> tuple[dict[str, str], _Pod]:
    spec = api.InferenceServiceSpec.model_validate(
        {"model": {"uri": "builtin://smollm2-135m-instruct"}, "engine": {"image": "local/kaon", **(engine or {})}})
    pod = {"metadata": {"name": "smol-a", "namespace": "team-a"},
           "spec": {**pod_template.pod_spec("smol", spec), "nodeName": "node-1"}, "status": {"podIP": "127.0.0.1"}}
    runner = PodRunner(None, tmp_path / "runner")  # type: ignore[arg-type]  # nothing here calls the API
    state = _Pod(dirs=runner._volumes("team-a/smol-a", pod))
    return runner._env(pod, pod["spec"]["containers"][0], state), state


def test_engine_pods_get_the_machines_kernel_cache_even_under_a_path_a_pod_mounts(tmp_path, monkeypatch):
    # A cold CI's HOME lies under /tmp, which every engine pod mounts (its tmp volume): the cache must not be
    # rewritten into the pod's own folder, or each pod compiles again.
    home = tmp_path / "home"
    monkeypatch.delenv(KERNEL_CACHE_ENV, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(home))
    env, state = _engine_env(tmp_path)
    assert env[KERNEL_CACHE_ENV] == str(home / ".cache" / "kaon" / "kernels") == str(shared_kernel_cache())
    assert env[KERNEL_CACHE_ENV] == str(cpu_decode.cache_dir())  # where the runner's own process builds them
    assert env["XDG_CACHE_HOME"] == str(state.dirs["cache"])  # the pod's other caches stay its own


def test_the_runners_kernel_cache_variable_and_a_specs_own_value_win(tmp_path, monkeypatch):
    monkeypatch.setenv(KERNEL_CACHE_ENV, str(tmp_path / "kernels"))
    env, _ = _engine_env(tmp_path)
    assert env[KERNEL_CACHE_ENV] == str(tmp_path / "kernels")
    env, state = _engine_env(tmp_path, {"env": [{"name": KERNEL_CACHE_ENV, "value": "/var/cache/kaon/k"}]})
    assert env[KERNEL_CACHE_ENV] == str(state.dirs["cache"] / "k")  # the spec's path, in the pod's volume
