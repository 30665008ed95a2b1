"""Why a pod cannot serve its model, from the fetch's and the engine's termination messages
(summaries.py and status.py, pure): the condition's reason and message and the Warning Event."""
from __future__ import annotations

from kaon_operator.status import conditions, summaries

FETCH_401 = "kaon fetch: hf://org/private@main: 1 of 3 files\nkaon fetch: unauthorized: hf://org/private@main: " \
            "the hub refused the credentials (401) (HF_TOKEN is set)\n"


def pod(name="p", *, init=None, engine=None, ready=False) -> dict:
    st = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if init is not None:
        st["initContainerStatuses"] = [{"name": "fetch", **init}]
    if engine is not None:
        st["containerStatuses"] = [{"name": "engine", **engine}]
    return {"metadata": {"name": name}, "status": st}


def terminated(code: int, message: str = "") -> dict:
    return {"terminated": {"exitCode": code, "reason": "Error" if code else "Completed", "message": message}}


def degraded(*pods: dict) -> dict:
    summarized = [summaries.summarize_pod(p) for p in pods]
    conds = conditions.conditions(deployment=None, pods=summarized, desired=1, gpus_per_pod=1, generation_applied=True)
    return next(c for c in conds if c["type"] == "Degraded")


def test_a_failed_fetch_is_model_fetch_failed_with_its_last_line():
    crash_looping = {"state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 10s"}},
                     "lastState": terminated(3, FETCH_401)}
    summary = summaries.summarize_pod(pod("llama-0", init=crash_looping))
    assert summary.model_failure == ("ModelFetchFailed", "unauthorized: hf://org/private@main: the hub refused "
                                                         "the credentials (401) (HF_TOKEN is set)")
    cond = degraded(pod("llama-0", init=crash_looping))
    assert cond["status"] == "True" and cond["reason"] == "ModelFetchFailed"
    assert cond["message"].startswith("1 pod(s) cannot serve the model; llama-0: unauthorized: ")


def test_the_reason_while_the_fetch_retries_and_its_end_once_it_succeeds():
    retrying = {"state": {"running": {}}, "lastState": terminated(4, "not found: s3://models/x: NoSuchBucket")}
    assert summaries.summarize_pod(pod(init=retrying)).model_failure == \
        ("ModelFetchFailed", "not found: s3://models/x: NoSuchBucket")
    done = {"state": terminated(0), "lastState": terminated(4, "not found: s3://models/x: NoSuchBucket")}
    assert summaries.summarize_pod(pod(init=done)).model_failure is None
    assert summaries.summarize_pod(pod(init={"state": {"running": {}}})).model_failure is None
    assert degraded(pod(init=done))["reason"] == "AsExpected"


def test_a_fetch_without_a_message_still_says_it_failed():
    assert summaries.summarize_pod(pod(init={"state": terminated(137)})).model_failure == \
        ("ModelFetchFailed", "kaon fetch exited with code 137")


def test_a_tensor_parallel_size_that_does_not_fit_is_model_does_not_fit():
    fit = "kaon fetch: model does not fit: tensorParallelSize 3 does not divide its 4 attention heads"
    assert degraded(pod(init={"state": terminated(6, fit)}))["reason"] == "ModelDoesNotFit"
    # The same from the engine's own start error (a path or builtin:// model: no fetch ran).
    engine = {"state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off"}},
              "lastState": terminated(2, "INFO loading\nkaon: error: model does not fit: tensor_parallel_size 3 "
                                         "does not divide its 4 attention heads")}
    cond = degraded(pod("e", engine=engine))
    assert cond["reason"] == "ModelDoesNotFit"  # not a bare CrashLoopBackOff
    assert cond["message"].endswith("e: model does not fit: tensor_parallel_size 3 does not divide its "
                                    "4 attention heads")
    other_crash = {"state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off"}},
                   "lastState": terminated(1, "Segmentation fault")}
    assert degraded(pod(engine=other_crash))["reason"] == "CrashLoopBackOff"


def test_the_warning_event_carries_the_reason_once():
    old = [{"type": "Degraded", "status": "False", "reason": "AsExpected", "message": ""}]
    failing = pod(init={"state": terminated(5, "no space: the model needs 16.07 GB more but /var/cache/kaon has "
                                               "2.00 GB free")})
    new = [degraded(failing)]
    (event,) = conditions.transition_events(new, old)
    assert (event.type, event.reason) == ("Warning", "ModelFetchFailed") and "no space: " in event.message
    assert conditions.transition_events(new, new) == []  # the crash loop goes on: no new Event each retry


def test_a_flag_the_engines_model_refuses_is_unsupported_by_model_with_a_warning():
    """A sentence encoder given --enable-runtime-lora (say through spec.engine.extraArgs) exits at start; the
    engine's line becomes the reason, not a bare CrashLoopBackOff the admin must read the pod's logs for."""
    line = ("kaon: error: unsupported by the model: --enable-runtime-lora do(es) not apply to a sentence encoder "
            "(builtin://all-minilm-l6-v2): it generates no tokens, so it has no prefill/decode roles and takes no "
            "LoRA adapters; drop the flag")
    engine = {"state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off"}},
              "lastState": terminated(2, "INFO starting\n" + line)}
    cond = degraded(pod("enc", engine=engine))
    assert (cond["status"], cond["reason"]) == ("True", "UnsupportedByModel")
    assert cond["message"].endswith("enc: " + line.removeprefix("kaon: error: "))
    (event,) = conditions.transition_events([cond], [{"type": "Degraded", "status": "False", "reason": "AsExpected",
                                                      "message": ""}])
    assert (event.type, event.reason) == ("Warning", "UnsupportedByModel") and "sentence encoder" in event.message
