"""spec.autoscaling.profile (issue 40): the key and its digest, when to run the profiling Job, its
manifest and the ConfigMap's, the model `kaon profile` writes as the operator reads it, and the
autoscale loop's use of the ConfigMap. Pure, or against a fake kube."""
from __future__ import annotations

import json

import pytest

from kaon_operator import api
from kaon_operator.autoscaling import autoscale_loop, profile_sync, profiling
from kaon_operator.autoscaling.perf_model import PerfModel
from kaon_operator.autoscaling.profiling import JobState, Step
from kaon_operator.children import resources
from kaon_operator.records import AutoscaleMemory
from kaon_operator.status import conditions
from kaon_runtime import cli
from kaon_runtime.server import perf_fit, perf_profile

OWNER = resources.Owner(name="chat", namespace="ns", uid="uid-1")
MODEL = PerfModel(a=0.02, b=0.0015, c=0.0004, d=1e-6, cold_start_seconds=30.0)


def spec(**kw) -> api.InferenceServiceSpec:
    body = {"model": {"uri": "hf://org/model", "quantization": "int8"},
            "engine": {"tensorParallelSize": 2, "image": "kaon:1"},
            "autoscaling": {"enabled": True, "policy": "predictive", "profile": "auto"}}
    for path, value in kw.items():
        node = body
        *parents, leaf = path.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return api.InferenceServiceSpec.model_validate(body)


def digest(s: api.InferenceServiceSpec) -> str:
    return profiling.key_digest(profiling.profile_key(s))


# The key --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("change", [
    {"model__uri": "hf://org/other"}, {"model__quantization": "int4"}, {"engine__tensorParallelSize": 4},
    {"engine__image": "kaon:2"}, {"engine__extraArgs": ["--dtype", "float16"]}, {"engine__maxNumSeqs": 32},
    {"scheduling": {"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}}}])
def test_what_the_engine_speed_depends_on_changes_the_digest(change):
    assert digest(spec(**change)) != digest(spec())


@pytest.mark.parametrize("change", [{"replicas": 3}, {"autoscaling__maxReplicas": 9}, {"drainSeconds": 5},
                                    {"scheduling": {"nodeSelector": {"zone": "a"}}}])
def test_what_it_does_not_depend_on_keeps_the_digest(change):
    assert digest(spec(**change)) == digest(spec())


def test_names_fit_a_label_value_and_follow_the_setting():
    name = profiling.object_name("a" * 63, "0123456789")
    assert len(name) <= 63 and name.endswith("-profile-0123456789")
    s = spec()
    assert profiling.config_map_name("chat", "auto", s) == f"chat-profile-{digest(s)}"
    assert profiling.config_map_name("chat", "mine", s) == "mine"
    assert profiling.config_map_name("chat", "none", s) is None and profiling.config_map_name("chat", None, s) is None


def test_predictive_needs_a_profile_other_than_none():
    with pytest.raises(ValueError, match="policy predictive needs profile"):
        spec(autoscaling__profile="none")
    assert spec(autoscaling__policy="reactive", autoscaling__profile="none").autoscaling.profile == "none"


# When to run the Job --------------------------------------------------------------------------------------------------


def job_body(condition: str | None) -> dict:
    return {"metadata": {"uid": "job-1"},
            "status": {"conditions": [{"type": condition, "status": "True", "reason": "BackoffLimitExceeded"}]
                       if condition else []}}


def pod(message: str, code: int = 0, job_uid: str = "job-1", name: str = "p") -> dict:
    """A pod of the Job `job_uid` (its controller, as the Job controller makes them)."""
    return {"metadata": {"name": name, "ownerReferences": [{"kind": "Job", "uid": job_uid, "controller": True}]},
            "status": {"containerStatuses": [{"name": profiling.CONTAINER, "state": {
                "terminated": {"exitCode": code, "message": message}}}]}}


def test_the_next_step_follows_the_configmap_then_the_job():
    good = JobState(True, True, MODEL.to_json(), "j")
    assert profiling.next_step(MODEL, None) is Step.USE
    assert profiling.next_step(MODEL, good) is Step.USE  # a saved model wins over any Job
    assert profiling.next_step(None, None) is Step.RUN
    assert profiling.next_step(None, JobState(False, False, "")) is Step.WAIT
    assert profiling.next_step(None, good) is Step.SAVE
    assert profiling.next_step(None, JobState(True, True, "not a model")) is Step.FAILED
    assert profiling.next_step(None, JobState(True, False, "kaon profile: error: boom")) is Step.FAILED


def test_the_job_state_reads_the_pods_termination_message():
    assert profiling.job_state(job_body(None), []) == JobState(False, False, "", "job-1")
    assert profiling.job_state(job_body("Complete"), [pod(MODEL.to_json())]).message == MODEL.to_json()
    failed = profiling.job_state(job_body("Failed"), [pod("loading...\nkaon profile: error: OOM", 1)])
    assert not failed.succeeded and failed.message == "kaon profile: error: OOM"
    assert profiling.job_state(job_body("Failed"), []).message == "BackoffLimitExceeded"


def test_conditions_say_true_unknown_false():
    assert conditions.profiled_condition(Step.USE, "cm")["status"] == "True"
    assert conditions.profiled_condition(Step.WAIT, "cm")["status"] == "Unknown"
    failed = conditions.profiled_condition(Step.FAILED, "cm", "boom")
    assert (failed["status"], failed["reason"]) == ("False", "ProfilingFailed") and "boom" in failed["message"]
    assert conditions.named_profile_condition("cm", None)["reason"] == "ProfileUnreadable"


# The manifests --------------------------------------------------------------------------------------------------------


def test_the_job_runs_kaon_profile_on_the_engines_own_pod():
    s = spec(auth={"apiKeySecret": "keys"})
    manifest = profiling.job(OWNER, s)
    name = f"chat-profile-{digest(s)}"
    assert manifest["metadata"]["name"] == name and manifest["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert manifest["spec"]["backoffLimit"] == 0 and manifest["spec"]["ttlSecondsAfterFinished"] > 0
    pod_spec = manifest["spec"]["template"]["spec"]
    assert pod_spec["restartPolicy"] == "Never" and pod_spec["initContainers"][0]["args"][:2] == ["kaon", "fetch"]
    (container,) = pod_spec["containers"]
    assert container["image"] == "kaon:1" and container["resources"]["limits"][api.GPU_RESOURCE] == "2"
    assert not {"startupProbe", "livenessProbe", "readinessProbe", "ports"} & set(container)
    args = container["args"]
    assert args[:6] == ["kaon", "profile", "--out", "/dev/termination-log", "--max-bytes", "4096"]
    serve_args = args[args.index("--") + 1:]
    assert "--api-key-file" not in serve_args  # it serves only itself, on loopback
    assert serve_args[serve_args.index("--quantization") + 1] == "int8"
    assert serve_args[serve_args.index("--tensor-parallel-size") + 1] == "2"
    # The engine reads these command lines: the profile's flags, and the serve arguments after `--`.
    parsed = perf_profile.build_parser().parse_args(args[2:])
    assert parsed.out == "/dev/termination-log" and parsed.max_bytes == 4096
    assert cli.build_parser().parse_args(["serve", *serve_args]).quantization == "int8"
    labels = manifest["spec"]["template"]["metadata"]["labels"]
    assert profiling.pod_selector("chat", digest(s)) == ",".join(
        f"{k}={labels[k]}" for k in ("kaon.dev/inferenceservice", "app.kubernetes.io/component", profiling.KEY_LABEL))


def test_the_configmap_holds_the_model_under_its_key():
    manifest = profiling.config_map(OWNER, spec(), MODEL.to_json())
    assert manifest["metadata"]["name"] == profiling.job(OWNER, spec())["metadata"]["name"]
    assert PerfModel.from_json(manifest["data"][api.PROFILE_KEY]) == MODEL
    assert json.loads(manifest["metadata"]["annotations"][profiling.KEY_ANNOTATION])["quantization"] == "int8"


# What kaon profile writes, as the operator reads it -------------------------------------------------------------------


def measured_model(points: int) -> dict:
    grid = [perf_fit.GridPoint(b, p, c, 0.02 + 0.0015 * b + 0.0004 * p + 1e-6 * c)
            for b, p, c in [(1, 0, 40), (4, 0, 160), (16, 0, 6000), (64, 0, 2600), (0, 64, 64), (0, 512, 512),
                            (2, 0, 800), (8, 0, 3200)][:points]]
    a, b, c, d = perf_fit.fit(grid)
    return {"a": a, "b": b, "c": c, "d": d, "cold_start_seconds": 9.0, "max_num_seqs": 64,
            "max_num_batched_tokens": 1024, "kv_cache_tokens": None,
            "key": {"device": "cpu (2 cores)", "model": "builtin://smollm2-135m-instruct"},
            "grid": [{"batch": g.batch, "prefill_tokens": g.prefill_tokens, "context_tokens": g.context_tokens,
                      "seconds": g.seconds} for g in grid]}


def test_the_fit_recovers_known_coefficients():
    model = measured_model(8)
    assert [model[t] for t in "abcd"] == pytest.approx([0.02, 0.0015, 0.0004, 1e-6], rel=1e-6)


def test_a_noisy_grid_without_a_fixed_cost_still_gives_the_operator_a_model():
    """Least squares puts this grid's intercept below zero (a small grid measured on a busy machine, as
    CI's kaon profile once was); every step costs something, and PerfModel refuses a <= 0."""
    grid = [perf_fit.GridPoint(1, 0, 0, 0.02), perf_fit.GridPoint(2, 0, 0, 0.06),
            perf_fit.GridPoint(0, 32, 32, 0.14), perf_fit.GridPoint(0, 128, 128, 0.89)]
    a, b, c, d = perf_fit.fit(grid)
    assert 0 < a <= 0.01 * 0.02 and min(b, c, d) >= 0
    body = {"a": a, "b": b, "c": c, "d": d, "cold_start_seconds": 9.0, "max_num_seqs": 8,
            "max_num_batched_tokens": 1024, "kv_cache_tokens": None, "key": {}, "grid": []}
    PerfModel.from_json(json.dumps(body))


def test_the_written_model_is_the_operators_and_fits_a_termination_message():
    body = measured_model(8)
    body["grid"] = body["grid"] * 12  # 96 points: more than 4 KiB
    text = perf_fit.fitting(body, 4096)
    assert len(text.encode()) <= 4096
    model = PerfModel.from_json(text)
    assert 2 <= len(model.grid) < 96 and model.a == pytest.approx(0.02)
    assert len(PerfModel.from_json(perf_fit.fitting(body, None)).grid) == 96  # unlimited: every point
    with pytest.raises(ValueError):
        perf_fit.fitting(body, 50)


# The I/O, against a fake kube -----------------------------------------------------------------------------------------


class FakeKube:
    def __init__(self):
        self.config_maps: dict[str, dict] = {}
        self.jobs: dict[str, dict] = {}
        self.pods: list[dict] = []
        self.listed: list[tuple[str, str]] = []
        self.deleted: list[tuple[str, str, str | None]] = []

    def config_map_data(self, namespace, name):
        found = self.config_maps.get(name)
        return None if found is None else found["data"]

    def get_config_map(self, namespace, name):
        return self.config_maps.get(name)

    def get_job(self, namespace, name):
        return self.jobs.get(name)

    def list_pods(self, namespace, selector):
        return self.pods

    def create_once(self, manifest):
        store = self.jobs if manifest["kind"] == "Job" else self.config_maps
        manifest["metadata"].setdefault("uid", "job-1" if manifest["kind"] == "Job" else "cm-1")
        return store.setdefault(manifest["metadata"]["name"], manifest)

    def list_objects(self, api_version, kind, namespace, selector):
        self.listed.append((kind, selector))
        wanted = dict(part.split("=") for part in selector.split(","))
        store = self.jobs if kind == "Job" else self.config_maps
        return [{**o, "apiVersion": api_version, "kind": kind} for o in store.values()
                if wanted.items() <= ((o.get("metadata") or {}).get("labels") or {}).items()]

    def delete(self, manifest, propagation=None):
        store = self.jobs if manifest["kind"] == "Job" else self.config_maps
        del store[manifest["metadata"]["name"]]
        self.deleted.append((manifest["kind"], manifest["metadata"]["name"], propagation))


def body(s: api.InferenceServiceSpec) -> dict:
    return {"metadata": {"namespace": "ns", "name": "chat", "uid": "uid-1"},
            "spec": s.model_dump(by_alias=True, exclude_none=True)}


def test_auto_runs_the_job_once_saves_its_model_and_reads_it_after():
    kube, events, memory, s = FakeKube(), [], profile_sync.ProfileMemory(), spec()

    def resolve():
        return profile_sync.resolve(kube, body(s), s, memory, lambda _, ev: events.extend(ev))

    first = resolve()
    assert first.model is None and first.condition["status"] == "Unknown" and list(kube.jobs) == [first.name]
    assert resolve().condition["reason"] == "Profiling" and len(kube.jobs) == 1  # waiting: no second Job
    kube.jobs[first.name]["status"] = job_body("Complete")["status"]
    kube.pods = [pod(MODEL.to_json())]
    saved = resolve()
    assert saved.model == MODEL and saved.condition["status"] == "True"
    assert PerfModel.from_json(kube.config_maps[first.name]["data"][api.PROFILE_KEY]) == MODEL
    kube.config_maps[first.name]["data"] = {}  # kept in memory: no reads once it has the model
    assert resolve().model == MODEL
    assert [e.reason for e in events] == ["Profiling", "Profiled"]
    changed = spec(model__quantization="int4")  # a new key: a new Job, the old model no more
    s = changed
    assert resolve().model is None and len(kube.jobs) == 2


def profile_objects(s: api.InferenceServiceSpec, owner: resources.Owner = OWNER) -> list[dict]:
    return [profiling.job(owner, s), profiling.config_map(owner, s, MODEL.to_json())]


def test_stale_profiles_are_this_services_other_keys_only():
    current, old = spec(), spec(model__quantization="int4")
    foreign = resources.Owner(name="chat", namespace="ns", uid="uid-0")  # a deleted service of the same name
    other = resources.Owner(name="other", namespace="ns", uid="uid-1")
    unowned = profiling.config_map(OWNER, spec(engine__maxNumSeqs=8), "{}")
    unowned["metadata"]["ownerReferences"] = []
    objects = [*profile_objects(current), *profile_objects(old), *profile_objects(spec(engine__maxNumSeqs=4), foreign),
               *profile_objects(spec(engine__maxNumSeqs=16), other), unowned,
               {"kind": "ConfigMap", "metadata": {"name": "mine", "namespace": "ns",  # no profile labels
                                                  "ownerReferences": [resources.owner_reference(OWNER)]}}]
    found = profiling.stale(objects, OWNER, keep_digest=digest(current))
    assert [(o["kind"], o["metadata"]["name"]) for o in found] == \
        [("Job", profiling.object_name("chat", digest(old))), ("ConfigMap", profiling.object_name("chat", digest(old)))]
    assert len(profiling.stale(objects, OWNER)) == 4  # profile none: every key of this service's
    kept = profiling.object_name("chat", digest(old))  # a named ConfigMap that auto once wrote is kept
    assert [o["metadata"]["name"] for o in profiling.stale(objects, OWNER, keep_name=kept)] == \
        [profiling.object_name("chat", digest(current))] * 2
    assert profiling.stale(objects, resources.Owner(name="chat", namespace="ns", uid="")) == []
    assert "Job a, ConfigMap a" in profiling.cleaned_message(
        [{"kind": k, "metadata": {"name": "a"}} for k in ("Job", "ConfigMap")])


def test_auto_deletes_the_old_keys_objects_once_the_new_model_is_saved():
    kube, events, memory, old = FakeKube(), [], profile_sync.ProfileMemory(), spec(model__quantization="int4")
    for o in profile_objects(old):
        (kube.jobs if o["kind"] == "Job" else kube.config_maps)[o["metadata"]["name"]] = o
    foreign = profile_objects(spec(engine__maxNumSeqs=4), resources.Owner(name="chat", namespace="ns", uid="uid-0"))
    kube.jobs["foreign"], kube.config_maps["foreign"] = foreign
    s = spec()

    def resolve():
        return profile_sync.resolve(kube, body(s), s, memory, lambda _, ev: events.extend(ev))

    name, stale_name = profiling.object_name("chat", digest(s)), profiling.object_name("chat", digest(old))
    assert resolve().model is None and stale_name in kube.jobs and not kube.deleted  # measuring: nothing removed
    kube.jobs[name]["status"] = job_body("Complete")["status"]
    kube.pods = [pod(MODEL.to_json())]
    assert resolve().model == MODEL
    assert kube.deleted == [("Job", stale_name, "Background"), ("ConfigMap", stale_name, "Background")]
    assert set(kube.jobs) == {name, "foreign"} and set(kube.config_maps) == {name, "foreign"}
    assert [e.reason for e in events] == ["Profiling", "Profiled", "ProfileCleaned"]
    assert events[-1].type == "Normal" and f"Job {stale_name}, ConfigMap {stale_name}" in events[-1].message
    listed = len(kube.listed)
    for _ in range(3):
        assert resolve().model == MODEL
    assert len(kube.listed) == listed and len(events) == 3  # once per setting


def test_leaving_auto_deletes_its_objects_but_not_a_named_one():
    kube, events, memory, s = FakeKube(), [], profile_sync.ProfileMemory(), spec()
    for o in profile_objects(s) + profile_objects(spec(model__quantization="int4")):
        (kube.jobs if o["kind"] == "Job" else kube.config_maps)[o["metadata"]["name"]] = o
    kept = profiling.object_name("chat", digest(s))
    named = spec(autoscaling__profile=kept)  # the model auto measured, pinned by name
    found = profile_sync.resolve(kube, body(named), named, memory, lambda _, ev: events.extend(ev))
    assert found.model == MODEL and set(kube.config_maps) == {kept} and set(kube.jobs) == {kept}
    off = spec(autoscaling__policy="reactive", autoscaling__profile="none")
    assert profile_sync.resolve(kube, body(off), off, memory, lambda _, ev: events.extend(ev)).model is None
    assert not kube.jobs and not kube.config_maps and all(p == "Background" for *_, p in kube.deleted)
    assert [e.reason for e in events] == ["ProfileCleaned", "ProfileCleaned"]


def test_a_failed_cleanup_keeps_the_model():
    class Forbidden(FakeKube):
        def list_objects(self, api_version, kind, namespace, selector):
            self.listed.append((kind, selector))
            raise profile_sync.ApiException(status=403, reason="Forbidden")

    kube, s = Forbidden(), spec()
    kube.config_maps[profiling.object_name("chat", digest(s))] = profiling.config_map(OWNER, s, MODEL.to_json())
    found = profile_sync.resolve(kube, body(s), s, profile_sync.ProfileMemory(), print)
    assert found.model == MODEL and found.condition["status"] == "True"
    assert kube.listed == [("Job", profiling.profile_selector("chat"))]  # tried once, then left to the next change


def test_a_failed_job_is_reported_once_and_the_reactive_policy_goes_on():
    kube, events, memory, s = FakeKube(), [], profile_sync.ProfileMemory(), spec()
    name = profiling.object_name("chat", digest(s))
    kube.jobs[name] = kube.create_once(profiling.job(OWNER, s)) | {"status": job_body("Failed")["status"]}
    kube.pods = [pod("kaon profile: error: kaon serve exited with 2 before it was ready", 1)]
    for _ in range(3):
        result = profile_sync.resolve(kube, body(s), s, memory, lambda _, ev: events.extend(ev))
        assert result.model is None and result.condition["reason"] == "ProfilingFailed"
    assert [(e.type, e.reason) for e in events] == [("Warning", "ProfilingFailed")]
    assert "exited with 2" in events[0].message and not kube.config_maps


def test_a_named_configmap_is_read_and_none_reads_nothing():
    kube, s = FakeKube(), spec(autoscaling__profile="mine")
    assert profile_sync.resolve(kube, body(s), s, profile_sync.ProfileMemory(), print).condition["status"] == "False"
    kube.config_maps["mine"] = {"data": {api.PROFILE_KEY: MODEL.to_json()}}
    found = profile_sync.resolve(kube, body(s), s, profile_sync.ProfileMemory(), print)
    assert found.model == MODEL and found.condition["reason"] == "ProfileConfigMap" and not kube.jobs
    off = spec(autoscaling__policy="reactive", autoscaling__profile="none")
    assert profile_sync.resolve(kube, body(off), off, profile_sync.ProfileMemory(), print) == \
        profile_sync.Resolved(None, None, None)


def test_the_loop_decides_by_the_profiled_model_or_says_why_not(monkeypatch):
    import asyncio

    from kaon_operator.autoscaling.autoscaler import Sample
    from kaon_operator.caches import Caches
    from kaon_operator.config import AutoscaleSettings, OperatorConfig
    from kaon_operator.context import Context

    kube, s, profiled = FakeKube(), spec(), {}
    monkeypatch.setattr(autoscale_loop.status_sync, "profile_changed", lambda ctx, key, c: profiled.__setitem__(key, c))
    ctx = Context(OperatorConfig(autoscale=AutoscaleSettings(interval=1)), kube, Caches())  # type: ignore[arg-type]
    ctx.post = lambda *_: None  # type: ignore[method-assign]
    loop = autoscale_loop.AutoscaleLoop(ctx)
    memory = AutoscaleMemory(history=[Sample(time=0.0, ready=1, answered=1, held_by_router=0.0)])

    def decide():
        return asyncio.run(loop._decide(("ns", "chat"), body(s), s, memory, 1.0, None))

    assert "no performance model in ConfigMap chat-profile-" in decide().reason
    assert profiled[("ns", "chat")]["reason"] == "Profiling"
    kube.config_maps[profiling.object_name("chat", digest(s))] = profiling.config_map(OWNER, s, MODEL.to_json())
    assert "performance model" in decide().reason and "no performance model" not in decide().reason
    assert profiled[("ns", "chat")]["status"] == "True"


# Objects posing as the profile (issue 48, low): someone who may write ConfigMaps or pods in the namespace,
# but not this InferenceService, tries to plant the performance model the autoscaler sizes replicas by.
PLANTED = PerfModel(a=5.0, b=0.0, c=0.0, d=0.0, cold_start_seconds=1.0)  # "one replica is always enough"


def test_a_pre_made_configmap_under_autos_name_is_ignored_and_reported():
    kube, events, s = FakeKube(), [], spec()
    name = profiling.object_name("chat", digest(s))
    planted = profiling.config_map(OWNER, s, PLANTED.to_json())
    for refs in ([], [{"kind": "InferenceService", "uid": "someone-else", "controller": True}]):
        planted["metadata"]["ownerReferences"] = refs
        kube.config_maps[name] = planted
        found = profile_sync.resolve(kube, body(s), s, profile_sync.ProfileMemory(), lambda _, ev: events.extend(ev))
        assert found.model is None and found.condition["status"] == "False", found
        assert "not this InferenceService" in found.condition["message"]
        assert events[-1].type == "Warning" and events[-1].reason == "ProfileNotOwned" and name in events[-1].message
    assert not kube.jobs  # nor is a Job run beside it: the name is taken


def test_a_labelled_pod_the_job_does_not_control_cannot_end_the_measurement():
    kube, events, memory, s = FakeKube(), [], profile_sync.ProfileMemory(), spec()

    def resolve():
        return profile_sync.resolve(kube, body(s), s, memory, lambda _, ev: events.extend(ev))

    first = resolve()
    kube.jobs[first.name]["status"] = job_body("Complete")["status"]
    kube.pods = [pod(PLANTED.to_json(), job_uid="not-the-job", name="impostor"), pod("", name="real")]
    found = resolve()
    assert found.model is None and first.name not in kube.config_maps  # the impostor's model was not saved
    assert [(e.type, e.reason) for e in events if "impostor" in e.message] == [("Warning", "ProfileNotOwned")]
    resolve()
    assert len([e for e in events if e.reason == "ProfileNotOwned"]) == 1  # once per object


def test_a_foreign_job_under_autos_name_is_not_read():
    kube, events, s = FakeKube(), [], spec()
    name = profiling.object_name("chat", digest(s))
    kube.jobs[name] = {"metadata": {"name": name, "uid": "job-x"}, "status": job_body("Complete")["status"]}
    kube.pods = [pod(PLANTED.to_json(), job_uid="job-x")]
    found = profile_sync.resolve(kube, body(s), s, profile_sync.ProfileMemory(), lambda _, ev: events.extend(ev))
    assert found.model is None and not kube.config_maps and "not this InferenceService" in found.condition["message"]
    assert events[-1].reason == "ProfileNotOwned" and f"Job {name}" in events[-1].message
