"""GGUF files kept quantized: kaon against llama.cpp on the same Q4_K_M and Q8_0 files, in one run.

    python bench/gguf_decode.py [--types Q8_0 Q4_K_M Q5_K_M] [--tokens 64] [--repeats 3] [--rounds 1]

The files are made here by llama.cpp's own quantizer (llama-cpp-python's llama_model_quantize)
from the bundled SmolLM2-135M-Instruct Q4_1 GGUF (requantized: no bf16 weights on this machine;
fine for speed and memory, not for quality). SmolLM2's hidden size, 576, is not a multiple of
256, so llama.cpp's Q4_K_M falls back to Q5_0 for most tensors (Q4_K/Q6_K only where K = 1536),
and its Q5_K_M to Q5_1 (Q5_K/Q6_K where K = 1536).

Per file, each side in a child process of its own (with --rounds N, llama.cpp and kaon alternate N
times and each side's median is reported with every round's ratio: on a shared machine the load moves
between two children more than the kernels differ): batch-1 decode tokens/s after a short prompt,
prefill excluded (bench/cpu_decode.py's `rate`); kaon also reports the bytes of its loaded weights
(parameters and buffers), the same with every copy its kernels made of them (distinct storages
after decoding, the KV pool not counted), the KV pool's bytes, and its process's resident memory
after loading and after decoding (pool, libraries and allocator included), against the file's size.
Greedy tokens: kaon in the file's own precision against kaon float32 on the same file, and
llama.cpp against kaon float32, as the common prefix per prompt (llama.cpp and kaon's fused step
both quantize activations to int8).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "runtime"))
sys.path.insert(0, str(ROOT / "bench"))

from cpu_decode import AGREEMENT_PROMPTS, PROMPT, USER_ENV, agreement, rate  # noqa: E402

OUT = ROOT / "bench" / "out" / "gguf"
FTYPES = {name: f"LLAMA_FTYPE_MOSTLY_{name}" for name in ("Q8_0", "Q4_K_M", "Q5_K_M", "Q4_0")}


def make_file(type_name: str) -> Path:
    """SmolLM2 in `type_name`, by llama.cpp's quantizer (made once, kept in bench/out)."""
    import llama_cpp

    from kaon_runtime.loader import resolve_model
    target = OUT / f"SmolLM2-135M-Instruct.{type_name}.gguf"
    if not target.exists():
        OUT.mkdir(parents=True, exist_ok=True)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.allow_requantize = getattr(llama_cpp, FTYPES[type_name]), True
        source = str(resolve_model("builtin://smollm2-135m-instruct"))
        if llama_cpp.llama_model_quantize(source.encode(), str(target).encode(), ctypes.byref(params)) != 0:
            raise SystemExit(f"llama.cpp could not quantize to {type_name}")
    return target


def rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def prompt_ids(path: Path) -> list[list[int]]:
    """The agreement prompts as llama.cpp tokenizes them (both sides then start from the same ids)."""
    from llama_cpp import Llama
    llm = Llama(model_path=str(path), vocab_only=True, verbose=False)
    return [llm.tokenize(p.encode()) for p in AGREEMENT_PROMPTS]


def resident_weight_bytes(model, kv_cache) -> int:
    """Bytes of the distinct storages the loaded model's weights occupy: its parameters and buffers and
    whatever copies its kernels made of them (the fused step's structs, a head's kernel copy); the KV
    pool and the rotary tables not included."""
    import torch

    from kaon_runtime.kernels.cpu_decode import LinearWeights
    seen: dict[int, int] = {}

    def add(t) -> None:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    for module in model.modules():
        for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            add(t)
        for value in vars(module).values():
            for item in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(item, LinearWeights):
                    for t in item.tensors:
                        add(t)
                elif isinstance(item, torch.Tensor) and item.dtype in (torch.uint8, torch.int8):
                    add(item)  # int4's second copy for torch's kernels (a tuple of tensors)
    step = getattr(model.model, "cpu_decode", None)
    for kept in (step._built[2] if step is not None and step._built is not None else []):
        for t in kept.tensors if isinstance(kept, LinearWeights) else ():
            add(t)
    seen.pop(kv_cache.untyped_storage().data_ptr(), None)
    return sum(seen.values())


def kaon_child(path: Path, dtype: str, tokens: int, repeats: int, ids: list[list[int]]) -> dict:
    import kaon_runtime  # noqa: F401  (before torch: its OpenMP settings)
    from kaon_runtime import LLM, SamplingParams
    before = rss()
    llm = LLM(str(path), device="cpu", dtype=dtype, show_progress=False, kv_cache_bytes=1 << 25)
    loaded = rss() - before
    runner = llm.engine.runner

    def run(batch: int, n: int) -> None:
        llm.generate([PROMPT] * batch, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)

    one = rate(run, 1, tokens, repeats)
    greedy = [o.outputs[0].token_ids for o in llm.generate(
        ids, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)]
    return {"tok_s": one, "weight_bytes": runner.weight_bytes,
            "resident_weights": resident_weight_bytes(runner.model, runner.kv_cache),
            "kv_bytes": runner.kv_cache.numel() * runner.kv_cache.element_size(),
            "rss_loaded": loaded, "rss_decoded": rss() - before,
            "quantization": runner.config.quantization, "greedy": [list(g) for g in greedy]}


def llama_child(path: Path, tokens: int, repeats: int, ids: list[list[int]]) -> dict:
    from llama_cpp import Llama
    threads = len(os.sched_getaffinity(0))
    llm = Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=1024, verbose=False)
    prompt = llm.tokenize(PROMPT.encode())

    def run(batch: int, n: int) -> None:
        for _ in range(batch):
            for _, _token in zip(range(n), llm.generate(prompt, top_k=1, temp=0.0)):
                pass

    one = rate(run, 1, tokens, repeats)
    greedy = []
    for p in ids:
        llm.reset()
        greedy.append([t for _, t in zip(range(tokens), llm.generate(p, top_k=1, temp=0.0))])
    return {"tok_s": one, "greedy": greedy}


def child(args, *extra: str) -> dict:
    cmd = [sys.executable, __file__, "--tokens", str(args.tokens), "--repeats", str(args.repeats), *extra]
    done = subprocess.run(cmd, env=USER_ENV, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(extra)} failed: {done.stderr.strip()[-1500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--types", nargs="+", default=["Q8_0", "Q4_K_M"], choices=list(FTYPES))
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)  # side, file, dtype
    args = parser.parse_args()
    if args.child:
        side, path, dtype = args.child
        ids = json.loads(os.environ["KAON_BENCH_IDS"])
        result = (llama_child(Path(path), args.tokens, args.repeats, ids) if side == "llama.cpp"
                  else kaon_child(Path(path), dtype, args.tokens, args.repeats, ids))
        print(json.dumps(result))
        return 0

    import torch
    print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, batch-1 decode of {args.tokens} tokens")
    mib = 1 << 20
    for type_name in args.types:
        path = make_file(type_name)
        USER_ENV["KAON_BENCH_IDS"] = json.dumps(prompt_ids(path))
        peers, owns = [], []
        for _ in range(args.rounds):
            peers.append(child(args, "--child", "llama.cpp", str(path), "-"))
            owns.append(child(args, "--child", "kaon", str(path), "auto"))
        ref = child(args, "--child", "kaon", str(path), "float32")
        peer = dict(peers[0], tok_s=statistics.median(p["tok_s"] for p in peers))
        own = dict(owns[0], tok_s=statistics.median(o["tok_s"] for o in owns))
        size = path.stat().st_size
        print(f"{path.name}: {size / mib:.1f} MiB")
        print(f"  llama.cpp            {peer['tok_s']:7.1f} tok/s                      greedy as kaon float32's: "
              f"{agreement(peer['greedy'], ref['greedy'])}")
        for name, r in (("kaon, the file's own", own), ("kaon float32", ref)):
            print(f"  {name:20} {r['tok_s']:7.1f} tok/s  {r['tok_s'] / peer['tok_s']:.2f}x llama.cpp;  weights "
                  f"{r['weight_bytes'] / mib:.1f} MiB ({r['weight_bytes'] / size:.2f}x file), with the kernels' "
                  f"copies {r['resident_weights'] / mib:.1f} MiB ({r['resident_weights'] / size:.2f}x), KV pool "
                  f"{r['kv_bytes'] / mib:.0f} MiB; process +"
                  f"{r['rss_loaded'] / mib:.0f} MiB loaded, +{r['rss_decoded'] / mib:.0f} MiB after decoding"
                  + (f"; greedy as float32's: {agreement(r['greedy'], ref['greedy'])}" if r is own else ""))
        if args.rounds > 1:
            print("  rounds (llama.cpp / kaon tok/s, ratio): " + ", ".join(
                f"{p['tok_s']:.1f} / {o['tok_s']:.1f} {o['tok_s'] / p['tok_s']:.2f}x" for p, o in zip(peers, owns)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
