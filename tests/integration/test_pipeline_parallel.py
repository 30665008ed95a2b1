"""Pipeline parallelism on CPU with gloo: stages of layers in separate processes generate what one process does.

The tiny random models have 3 layers, so two stages split them unevenly (2 + 1). Every comparison runs
chunked prefill (a prompt longer than the step's token budget), a prefix-cache hit (two prompts sharing
three blocks) and preemption (a pool too small for every sequence at once), on the same engine options
at PP=1 and at PP=2 (x TP=2). Under PP several micro-batches are in flight at once (engine/micro_batches.py):
each test checks the stages did overlap.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch

from e2e.control_plane import free_ports
from kaon_runtime import LLM, SamplingParams
from kaon_runtime.errors import ModelLoadError
from support.hf_dirs import write_hf_dir
from support.server import RUNTIME

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=49152, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(tie_word_embeddings=False)),
    # Tied: the first stage holds the embedding, the last the same tensor as its head.
    "qwen3-moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16,
                       tie_word_embeddings=True)),
}
PREFIX = list(range(500, 548))  # three blocks of 16
PROMPTS = [PREFIX + list(range(100, 130)), list(range(300, 305)), PREFIX + list(range(1000, 1040)),
           list(range(2000, 2070))]
# A pool of 12 blocks cannot hold all four sequences at their full length: some are preempted.
OPTIONS = dict(device="cpu", dtype="float64", max_num_batched_tokens=64, num_kv_blocks=12, max_num_seqs=4)


def hf_dir(name: str, tmp_path_factory, gguf_path) -> str:
    config_cls, model_cls, extra = FAMILIES[name]
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(name)
    write_hf_dir(model_cls(config_cls(**SMALL, **extra)), path, gguf_path, {"eos_token": "<|im_end|>"})
    return str(path)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory, gguf_path):
    return request.param, hf_dir(request.param, tmp_path_factory, gguf_path)


def generate(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    first = llm.generate(PROMPTS[:1], params, use_tqdm=False)  # in the cache before the others share its prefix
    return [o.outputs[0].token_ids for o in first + llm.generate(PROMPTS[1:], params, use_tqdm=False)]


@pytest.mark.parametrize("pp,tp", [(2, 1), (2, 2)])
def test_stages_generate_what_one_process_does(family, pp, tp):
    name, path = family
    if name == "qwen3-moe" and tp == 1:
        pytest.skip("one layout per MoE family keeps the run short; PP x TP covers both cuts")
    one = LLM(path, show_progress=False, **OPTIONS)
    expected = generate(one)
    staged = LLM(path, show_progress=False, pipeline_parallel_size=pp, tensor_parallel_size=tp, **OPTIONS)
    try:
        assert generate(staged) == expected
        stats = staged.engine.stats()
        assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0
        assert staged.engine.in_flight is not None and staged.engine.in_flight.peak == pp
        # Each rank holds its share of its stage, nothing more: the ranks together hold the model once,
        # but for a tied embedding, which the first stage reads as embedding and the last as head.
        model = one.engine.runner.model
        tied = sum(p.numel() * p.element_size() for p in model.lm_head.parameters()) \
            if model.config.tie_word_embeddings else 0
        ranks = [staged.engine.runner.weight_bytes] + staged.engine.worker_weight_bytes
        assert len(ranks) == pp * tp and sum(ranks) <= 1.01 * (one.engine.runner.weight_bytes + tied)
        assert max(ranks) <= 1.05 * (one.engine.runner.weight_bytes + tied) / (pp * tp)
    finally:
        staged.close()


def test_a_busy_pipeline_keeps_a_micro_batch_per_stage_and_the_tokens(tmp_path_factory, gguf_path):
    """Eight requests of different lengths at once: two micro-batches of four stay in flight, so stage 0 runs
    one while stage 1 runs the other, and each sequence's tokens are still PP=1's, also when one of them is
    aborted while its micro-batch is in flight."""
    path = hf_dir("llama", tmp_path_factory, gguf_path)
    prompts = [PREFIX + list(range(100 + 9 * i, 110 + 12 * i)) for i in range(4)] + \
              [list(range(3000 + 100 * i, 3020 + 100 * i + 11 * i)) for i in range(4)]
    options = dict(OPTIONS, num_kv_blocks=64, max_num_seqs=8)
    params = [SamplingParams(temperature=0, max_tokens=12 + 3 * (i % 4), ignore_eos=True) for i in range(8)]
    expected = [o.outputs[0].token_ids for o in LLM(path, show_progress=False, **options).generate(
        prompts, params, use_tqdm=False)]
    staged = LLM(path, show_progress=False, pipeline_parallel_size=2, **options)
    try:
        outputs = staged.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert staged.engine.in_flight is not None and staged.engine.in_flight.peak == 2
        # A request aborted while its micro-batch is in flight: the others finish as before.
        engine = staged.engine
        for i in range(8):
            engine.add_request(f"r{i}", prompts[i], params[i])
        finished = {o.request_id: o for o in engine.step() if o.finished}
        aborted = next(seq.request_id for seq in engine.in_flight.busy)
        engine.abort_request(aborted)
        while engine.has_unfinished_requests():
            finished.update((o.request_id, o) for o in engine.step() if o.finished)
        assert aborted not in finished
        assert {r: o.outputs[0].token_ids for r, o in finished.items()} == \
            {f"r{i}": expected[i] for i in range(8) if f"r{i}" != aborted}
    finally:
        staged.close()


def test_speculative_decoding_rides_the_pipeline(tmp_path_factory, gguf_path):
    """The draft model runs whole beside the leader; its drafts are verified as extra rows through the stages.
    The model drafts for itself, so nearly every draft is kept."""
    path = hf_dir("llama", tmp_path_factory, gguf_path)
    spec = dict(OPTIONS, speculative_method="draft", speculative_draft_model=path, num_speculative_tokens=3)
    expected = generate(LLM(path, show_progress=False, **OPTIONS))
    staged = LLM(path, show_progress=False, pipeline_parallel_size=2, **spec)
    try:
        assert generate(staged) == expected
        stats = staged.engine.stats()
        assert stats.spec_accepted_tokens >= 0.9 * stats.spec_draft_tokens > 0
        assert staged.engine.in_flight is None  # drafts need every sequence's latest token: one step in flight
    finally:
        staged.close()


def test_more_stages_than_layers_are_refused(tmp_path_factory, gguf_path):
    path = hf_dir("llama", tmp_path_factory, gguf_path)
    with pytest.raises(ModelLoadError, match="pipeline_parallel_size 4 exceeds the model's 3 layers"):
        LLM(path, show_progress=False, device="cpu", pipeline_parallel_size=4)


def test_a_rank_that_never_joins_is_named(tmp_path_factory, gguf_path, monkeypatch):
    path = hf_dir("llama", tmp_path_factory, gguf_path)
    monkeypatch.setenv("LWS_GROUP_SIZE", "2")
    monkeypatch.setenv("KAON_DIST_AUTHKEY", "test-group-key")
    monkeypatch.setenv("LWS_WORKER_INDEX", "0")
    monkeypatch.setenv("KAON_DIST_JOIN_TIMEOUT_S", "3")
    start = time.monotonic()
    with pytest.raises(ModelLoadError, match=r"pipeline rank\(s\) 1 of 2 did not join within 3s"):
        LLM(path, show_progress=False, device="cpu", pipeline_parallel_size=2,
            distributed_init_address=f"127.0.0.1:{group_ports()[0]}")
    assert time.monotonic() - start < 30


# ---- every stage through the fused C step (issue 49 §2) ---------------------------------------------

def answer(output) -> tuple[list[int], list[float]]:
    """The tokens and each token's own log-probability."""
    completion = output.outputs[0]
    return completion.token_ids, [step[token] for token, step in zip(completion.token_ids, completion.logprobs)]


@pytest.mark.parametrize(("name", "dtype"), [("llama", "float32"), ("llama", "bfloat16"), ("qwen3-moe", "float32")])
def test_stages_take_the_c_step_and_answer_alike_alone_batched_chunked_and_cached(tmp_path_factory, gguf_path,
                                                                                    name, dtype):
    """Each stage runs its own layers through the fused C step, where every row is computed alone (the last
    stage the final norm and the head too), and hands the next its residual stream in float32. So PP=2 answers
    each prompt bit for bit as PP=1 does alone (tokens and log-probabilities): batched beside the others in
    chunks of 16 tokens, and again alone with its prefix cached. bfloat16: a boundary that rounded the stream to
    the model's dtype would show here. qwen3-moe: each stage's mixture-of-experts layers in the C step too."""
    path = hf_dir(name, tmp_path_factory, gguf_path)
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=0, ignore_eos=True)
    options = dict(device="cpu", dtype=dtype, num_kv_blocks=64, max_num_seqs=8)
    with LLM(path, show_progress=False, enable_prefix_caching=False, **options) as one:
        assert one.engine.runner.cpu_decode_step
        alone = [answer(one.generate([p], params, use_tqdm=False)[0]) for p in PROMPTS]
    with LLM(path, show_progress=False, pipeline_parallel_size=2, max_num_batched_tokens=16, **options) as staged:
        assert staged.engine.runner.cpu_decode_step  # the leader's stage; the last stage's shows in the answers
        assert [answer(o) for o in staged.generate(PROMPTS, params, use_tqdm=False)] == alone
        hits = staged.engine.stats().prefix_cache_hits
        assert [answer(staged.generate([p], params, use_tqdm=False)[0]) for p in PROMPTS] == alone
        assert staged.engine.stats().prefix_cache_hits > hits


def test_a_gguf_in_its_own_int4_blocks_answers_at_pp2_as_at_pp1(tmp_path, gguf_path):
    """A GGUF runs in its own blocks on CPU (engine/gguf_weights.py), named by their global layer; a later stage
    holds its layers numbered from 0, so it must take its own layers' blocks, not the first stage's (it did: the
    bundled model at PP=2 answered otherwise than at PP=1 from its first token, on either path)."""
    from support.gguf_from_hf import write_gguf_from_hf

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, tie_word_embeddings=False))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    path = str(write_gguf_from_hf(model, tmp_path / "tiny.gguf", gguf_path, "Q4_0"))
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=0, ignore_eos=True)
    options = dict(device="cpu", num_kv_blocks=64, max_num_seqs=8)
    with LLM(path, show_progress=False, **options) as one:
        expected = [answer(o) for o in one.generate(PROMPTS, params, use_tqdm=False)]
    with LLM(path, show_progress=False, pipeline_parallel_size=2, **options) as staged:
        assert [answer(o) for o in staged.generate(PROMPTS, params, use_tqdm=False)] == expected


# ---- two `kaon serve` hosts of one LeaderWorkerSet group ------------------------------------------

def group_ports() -> tuple[int, int, int]:
    """A rendezvous port whose next port is free too (the leader's control channel listens there:
    rendezvous.control_address) and two HTTP ports: four consecutive ports picked outside the kernel's
    ephemeral range (e2e.control_plane.free_ports). CI failed twice with "Address already in use" on ports
    from bind(0), which any process's outgoing connection can take as its source port before the host binds it."""
    first = free_ports(4, "127.0.0.1")
    return first, first + 2, first + 3


def start_host(path: str, index: int, init: str, port: int, log, key: str | None = "test-group-key"
               ) -> subprocess.Popen:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KAON_DIST_")}, "LWS_GROUP_SIZE": "2",
           "LWS_WORKER_INDEX": str(index), "LWS_LEADER_ADDRESS": "127.0.0.1",
           **({"KAON_DIST_AUTHKEY": key} if key else {}),
           "PYTHONPATH": f"{RUNTIME}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen([sys.executable, "-m", "kaon_runtime.cli", "serve", "--model", path, "--device", "cpu",
                             "--dtype", "float32", "--port", str(port), "--pipeline-parallel-size", "2",
                             "--distributed-init-address", init, "--log-level", "warning"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)


def wait_for(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"not {what} after {timeout_s}s")


def status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.TransportError:
        return None


def test_a_group_of_hosts_without_its_key_refuses_to_start(tmp_path, tmp_path_factory, gguf_path):
    """Plans are pickled: a leader reachable from other hosts never listens with a key everyone knows."""
    path = hf_dir("llama", tmp_path_factory, gguf_path)
    with open(tmp_path / "leader.log", "wb") as log:
        init_port, leader_http, _ = group_ports()
        leader = start_host(path, 0, f"127.0.0.1:{init_port}", leader_http, log, key=None)
        assert leader.wait(timeout=60) == 2
    lines = (tmp_path / "leader.log").read_text().strip().splitlines()
    assert len(lines) == 1 and "needs KAON_DIST_AUTHKEY" in lines[0], lines


def test_a_worker_killed_mid_batch_ends_the_whole_group(tmp_path, tmp_path_factory, gguf_path):
    """Leader and worker as LeaderWorkerSet starts them; the worker answers /health only. Killing it
    while a long request runs ends the leader too (its /health stops answering): no hung survivor."""
    path = hf_dir("llama", tmp_path_factory, gguf_path)
    init_port, leader_port, worker_port = group_ports()
    init = f"127.0.0.1:{init_port}"
    with open(tmp_path / "leader.log", "wb") as leader_log, open(tmp_path / "worker.log", "wb") as worker_log:
        worker = start_host(path, 1, init, worker_port, worker_log)
        leader = start_host(path, 0, init, leader_port, leader_log)
        try:
            url = f"http://127.0.0.1:{leader_port}"
            wait_for(lambda: status(f"{url}/ready") == 200 or leader.poll() is not None, 180, "ready")
            assert leader.poll() is None, (tmp_path / "leader.log").read_text()
            assert status(f"http://127.0.0.1:{worker_port}/health") == 200
            assert status(f"http://127.0.0.1:{worker_port}/v1/models") == 404  # the API is the leader's
            body = {"model": path, "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
            reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
            long = subprocess.Popen([sys.executable, "-c", "import httpx,sys; httpx.post(sys.argv[1], json={"
                                     "'model': sys.argv[2], 'prompt': [5, 6, 7], 'max_tokens': 400, "
                                     "'ignore_eos': True}, timeout=120)", f"{url}/v1/completions", path])
            wait_for(lambda: "kaon_num_requests_running 1" in httpx.get(f"{url}/metrics").text.replace(".0", ""),
                     30, "running")
            worker.send_signal(signal.SIGKILL)
            wait_for(lambda: leader.poll() is not None, 30, "the leader gone")
            assert status(f"{url}/health") is None
            long.wait(timeout=30)
            assert "pipeline rank 1 went away" in (tmp_path / "leader.log").read_text()
        finally:
            for proc in (worker, leader):
                if proc.poll() is None:
                    proc.kill()
                proc.wait()


def test_an_idle_connection_to_the_control_channel_does_not_stop_the_group(tmp_path, tmp_path_factory, gguf_path):
    """Issue 48 item 7, as an attacker who reaches the leader: one TCP connection to its control
    channel that never speaks. It failed before: the leader's accept loop sat in that connection's
    handshake, the worker was never accepted, and the group never formed (its join timeout: 300 s)."""
    path = hf_dir("llama", tmp_path_factory, gguf_path)
    init_port, leader_http, worker_http = group_ports()
    hosts: list[subprocess.Popen] = []
    idle = socket.socket()
    try:
        with open(tmp_path / "group.log", "wb") as log:
            hosts.append(start_host(path, 0, f"127.0.0.1:{init_port}", leader_http, log))
            wait_for(lambda: idle.connect_ex(("127.0.0.1", init_port + 1)) == 0, 60, "the control channel listening")
            hosts.append(start_host(path, 1, f"127.0.0.1:{init_port}", worker_http, log))
            wait_for(lambda: status(f"http://127.0.0.1:{leader_http}/health") == 200, 120, "the group formed")
        reply = httpx.post(f"http://127.0.0.1:{leader_http}/v1/completions", timeout=60,
                           json={"model": path, "prompt": [5, 6, 7], "max_tokens": 2})
        assert reply.status_code == 200, reply.text
    finally:
        idle.close()
        for host in hosts:
            host.kill()
            host.wait()
