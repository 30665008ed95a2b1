"""Offline throughput and batch-1 decode: kaon vs HF transformers, same model, same prompts, one run.

    python bench/throughput.py [--requests 64] [--device cpu] [--dtype float32]

GPU (`make bench-gpu`): Llama-3.2-1B's shape with random weights, 256 requests of 100-1024
tokens in and out:

    python bench/throughput.py --model random://llama-3.2-1b --device cuda --dtype bfloat16 \
        --requests 256 --input-len 100 1024 --output-len 100 1024 --max-num-seqs 256 \
        --max-num-batched-tokens 8192

Workload (CPU default): 64 requests, prompt lengths uniform in 32-512 tokens, output lengths
uniform in 32-256 tokens, EOS ignored so both engines produce exactly the requested tokens.
Prompts are slices of an English text for real models, random token ids for random:// ones.
HF runs the set as padded batches through `generate` (static batching: every row runs
until its batch's longest finishes), which is how HF serves a batch: the whole set at once,
or `--hf-batch N` requests at a time; only the tokens each request asked for are counted.

Each engine is timed in a fresh process of its own, one after the other (kaon's first: it draws
the workload, which HF's then runs): in one process, each would run with the other's model and
leftovers beside it (bench/history/throughput.md measured what that costs).
Each process has its engine's own OpenMP settings: kaon's those kaon_runtime sets on import
(GOMP_SPINCOUNT=0), HF's the user's environment (libgomp's default spin unless set).

`--profile FILE` runs the set's first 64 requests once more on kaon's side under torch's profiler and
writes the top operators by device and by CPU time, and the share of that pass the device was busy
(the rest is the host between steps: scheduling, sampling, launches). `--kaon-only` skips HF's side
(no ratio: for a profile when device time is short).

`--quantization int8|int4` runs kaon's side with narrow weights (int4: the GGUF's own Q4_1
blocks); HF's side stays as HF loads the file, dequantized to --dtype. That compares what each
engine makes of the same file, not the same arithmetic: the default (none) is the like-for-like
figure.

Over 300 lines for a stated reason: both engines' sides, the workload they share, the profile and the
fresh-process plumbing are one measurement; split, a GPU lease's single command would need several.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import random
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

# OpenMP's settings as the user left them, before kaon_runtime's import sets its own (GOMP_SPINCOUNT=0,
# see kaon_runtime/__init__.py): HF's process gets these back, kaon's keeps kaon's.
USER_OMP_ENV = {name: os.environ.get(name) for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}

from kaon_runtime import LLM, SamplingParams  # noqa: E402
from kaon_runtime.loader import open_checkpoint, resolve_model  # noqa: E402
from kaon_runtime.loader.random_weights import RANDOM_SCHEME, hf_config  # noqa: E402

TEXT = ("The history of computing is a story of layers: transistors became gates, gates became "
        "processors, processors ran operating systems, and operating systems hosted languages that "
        "let people describe ever larger ideas. Each layer hid the one below it and made new work "
        "possible. Serving language models is the newest layer, and it has its own physics: memory "
        "bandwidth, cache reuse, and the art of keeping every core busy while requests come and go. ")


def make_workload(llm: LLM, n: int, seed: int, input_len: tuple[int, int], output_len: tuple[int, int]):
    rng = random.Random(seed)
    longest = input_len[1]
    if llm.engine.config.model.startswith(RANDOM_SCHEME):
        corpus = [rng.randrange(llm.engine.model_config.vocab_size) for _ in range(longest + 200)]
    else:  # long enough for a prompt of the longest length at the latest start (below)
        repeats = 1 + 2 * longest // 100
        while len(corpus := llm.tokenizer.encode(TEXT * repeats)) < longest + 200:
            repeats += 1
    prompts, outputs = [], []
    for _ in range(n):
        length, start = rng.randint(*input_len), rng.randint(0, 200)
        prompts.append(corpus[start:start + length])
        outputs.append(rng.randint(*output_len))
    return prompts, outputs


def hf_model(model: str, dtype: torch.dtype, device: str):
    """The same model in HF transformers: the GGUF or HF directory, or the random:// weights kaon drew."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    if model.startswith(RANDOM_SCHEME):
        with torch.device(device):
            hf = LlamaForCausalLM(LlamaConfig(**hf_config(model[len(RANDOM_SCHEME):]))).to(dtype)
        params = hf.state_dict()
        with torch.no_grad():
            for name, tensor in open_checkpoint(model).weights():
                params[name].copy_(tensor)
        return hf.eval()
    path = resolve_model(model)
    if path.is_file():
        hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return hf.to(device).eval()


def bench_kaon(llm: LLM, prompts, output_lens) -> float:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outputs] == output_lens
    return elapsed


def profile_kaon(llm: LLM, prompts, output_lens, path: Path, requests: int = 64) -> None:
    """The first `requests` of the set under torch's profiler: top operators, and the device's busy share."""
    from torch.profiler import ProfilerActivity, profile
    on_gpu = torch.cuda.is_available() and llm.engine.runner.device.type == "cuda"
    requests = min(requests, len(prompts))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens[:requests]]
    engine, steps = llm.engine, [0]
    graphs = engine.runner.decode_graphs
    replays = graphs.replays if graphs is not None else 0
    step = engine.step

    def counted_step(*args, **kwargs):
        steps[0] += 1
        return step(*args, **kwargs)

    engine.step = counted_step  # an instance attribute: LLM.generate calls it, nothing else changes
    try:
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])) as prof:
            start = time.perf_counter()
            llm.generate(prompts[:requests], params, use_tqdm=False)
            if on_gpu:
                torch.cuda.synchronize()
            wall = time.perf_counter() - start
    finally:
        del engine.step
    averages = prof.key_averages()
    replayed = (graphs.replays - replays) if graphs is not None else 0
    lines = [f"{requests} requests, {sum(output_lens[:requests])} output tokens, {wall:.2f}s under the profiler, "
             f"{steps[0]} engine steps ({1e3 * wall / max(steps[0], 1):.2f} ms each; {replayed} decode steps from "
             "CUDA graphs)"]
    if on_gpu:
        busy = sum(event.self_device_time_total for event in averages) / 1e6
        lines.append(f"device busy {busy:.2f}s of {wall:.2f}s ({100 * busy / wall:.0f}%): the rest is the host "
                     "between kernels")
        lines.append(averages.table(sort_by="self_device_time_total", row_limit=25))
    lines.append(averages.table(sort_by="self_cpu_time_total", row_limit=25))
    path.write_text("\n".join(lines))
    print(lines[0] + ("; " + lines[1] if on_gpu else ""), flush=True)


def bench_hf(model, prompts, output_lens, pad_id: int, batch: int = 0) -> float:
    """Seconds for HF to serve the set as padded static batches of `batch` requests (0: one batch of all),
    each run until its longest request is done. Each batch's time is printed as it ends, so a run cut
    short still shows how far it got."""
    batch = batch or len(prompts)
    with torch.inference_mode():  # warm-up, as kaon's side has: CUDA and cuBLAS start, kernels chosen
        model.generate(torch.tensor([prompts[0][:16]], device=model.device), max_new_tokens=4, do_sample=False,
                       pad_token_id=pad_id)
    total = 0.0
    for first in range(0, len(prompts), batch):
        chunk, lens = prompts[first:first + batch], output_lens[first:first + batch]
        longest = max(map(len, chunk))
        ids = torch.full((len(chunk), longest), pad_id, dtype=torch.long, device=model.device)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(chunk):  # left padding, as decoder-only generation needs
            ids[row, longest - len(p):] = torch.tensor(p, device=model.device)
            mask[row, longest - len(p):] = 1
        sync_device(model.device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=max(lens), min_new_tokens=max(lens),
                                 do_sample=False, pad_token_id=pad_id)
        sync_device(model.device)
        elapsed = time.perf_counter() - start
        assert out.shape[1] == longest + max(lens)
        total += elapsed
        print(f"hf: requests {first}-{first + len(chunk) - 1} ({longest} + {max(lens)} tokens) in {elapsed:.1f}s",
              flush=True)
    return total


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_rate(generate, new_tokens: int, repeats: int = 3) -> float:
    """Decode tokens/s at batch 1, prefill excluded: time(1 + N tokens) - time(1 token), median of repeats."""
    generate(4)  # warm-up
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        generate(1)
        t1 = time.perf_counter()
        generate(1 + new_tokens)
        t2 = time.perf_counter()
        rates.append(new_tokens / ((t2 - t1) - (t1 - t0)))
    return statistics.median(rates)


def kaon_side(args) -> dict:
    """kaon's figures, and the workload it drew (for HF's side to run)."""
    llm = LLM(args.model, show_progress=False, device=args.device, dtype=args.dtype, quantization=args.quantization,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    prompts, output_lens = make_workload(llm, args.requests, args.seed, args.input_len, args.output_len)
    seconds = bench_kaon(llm, prompts, output_lens)
    if args.profile:
        profile_kaon(llm, prompts, output_lens, args.profile)

    def one(n):
        llm.generate([prompts[0][:64]], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)

    return {"prompts": prompts, "output_lens": output_lens, "pad_id": llm.tokenizer.eos_token_id,
            "seconds": seconds, "decode": decode_rate(one, args.decode_tokens)}


def hf_side(args, prompts, output_lens, pad_id: int) -> dict:
    hf = hf_model(args.model, getattr(torch, args.dtype), args.device)
    seconds = bench_hf(hf, prompts, output_lens, pad_id, args.hf_batch)

    def one(n):
        with torch.inference_mode():
            hf.generate(torch.tensor([prompts[0][:64]], device=args.device), max_new_tokens=n, min_new_tokens=n,
                        do_sample=False, pad_token_id=pad_id)

    return {"seconds": seconds, "decode": decode_rate(one, args.decode_tokens)}


def set_environment(env: dict[str, str | None]) -> None:
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def in_fresh_process(fn, *args, env: dict[str, str | None] | None = None):
    """fn(*args) in a new interpreter whose environment has `env` applied (None: unset). OpenMP
    reads its settings when torch loads it, in the child, so they must be in place at the start."""
    env = env or {}
    saved = {name: os.environ.get(name) for name in env}
    set_environment(env)
    try:
        with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
            return pool.submit(fn, *args).result()
    finally:
        set_environment(saved)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="builtin://smollm2-135m-instruct")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantization", default="none", help="kaon's side only (see above)")
    parser.add_argument("--input-len", type=int, nargs=2, default=(32, 512), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--hf-batch", type=int, default=0, help="HF's static batch size (0: the whole set at once)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--profile", type=Path, help="kaon's operators under torch's profiler, written here")
    parser.add_argument("--kaon-only", action="store_true", help="skip HF's side (no ratio)")
    args = parser.parse_args()

    kaon = in_fresh_process(kaon_side, args)
    print(f"kaon: {kaon['seconds']:.1f}s for the set, batch-1 decode {kaon['decode']:.1f} tok/s", flush=True)
    if args.kaon_only:
        total_out = sum(kaon["output_lens"])
        figures = {"requests": args.requests, "output_tokens": total_out, "kaon_seconds": round(kaon["seconds"], 2),
                   "kaon_output_tok_s": round(total_out / kaon["seconds"], 1),
                   "kaon_batch1_decode_tok_s": round(kaon["decode"], 1)}
        print(f"throughput  kaon {figures['kaon_output_tok_s']:8.1f} out tok/s (HF's side skipped: no ratio)")
        if args.json:
            args.json.write_text(json.dumps(figures, indent=2))
        return 0
    hf = in_fresh_process(hf_side, args, kaon["prompts"], kaon["output_lens"], kaon["pad_id"], env=USER_OMP_ENV)
    total_out, total_in = sum(kaon["output_lens"]), sum(map(len, kaon["prompts"]))
    kaon_s, hf_s, kaon_decode, hf_decode = kaon["seconds"], hf["seconds"], kaon["decode"], hf["decode"]

    figures = {
        "machine": (torch.cuda.get_device_name() if args.device.startswith("cuda") else
                    f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads")
                   + f", {args.model}, {args.dtype}"
                   + (f", kaon {args.quantization}" if args.quantization != "none" else ""),
        "requests": args.requests, "hf_batch": args.hf_batch or args.requests,
        "prompt_tokens": total_in, "output_tokens": total_out,
        "kaon_seconds": round(kaon_s, 2), "hf_seconds": round(hf_s, 2),
        "kaon_output_tok_s": round(total_out / kaon_s, 1), "hf_output_tok_s": round(total_out / hf_s, 1),
        "throughput_ratio": round(hf_s / kaon_s, 2),
        "kaon_batch1_decode_tok_s": round(kaon_decode, 1), "hf_batch1_decode_tok_s": round(hf_decode, 1),
        "decode_ratio": round(kaon_decode / hf_decode, 2),
    }
    print(f"workload: {args.requests} requests, {total_in} prompt tokens, {total_out} output tokens "
          f"({figures['machine']})")
    print(f"throughput  kaon {figures['kaon_output_tok_s']:8.1f} out tok/s ({kaon_s:.1f}s)   "
          f"hf {figures['hf_output_tok_s']:8.1f} out tok/s ({hf_s:.1f}s)   ratio {figures['throughput_ratio']}x")
    print(f"batch-1 decode  kaon {kaon_decode:.1f} tok/s   hf {hf_decode:.1f} tok/s   ratio "
          f"{figures['decode_ratio']}x")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
