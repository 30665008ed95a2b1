"""CPU decode: kaon in each weight format against llama.cpp on the same GGUF, in one run.

    python bench/cpu_decode.py [--formats float32 bfloat16 float16 int8 int4] [--torch-ops float32 int4]
                               [--tokens 64] [--batch 16] [--invariance int4 float32] [--activations int4 int8]

The bundled SmolLM2-135M-Instruct is a Q4_1 GGUF. kaon loads it as float32 (greedy output
matches HF transformers), bfloat16 or float16 (the weights stored in that dtype, widened to
float32 in registers by the fused step), int8 (re-quantized per channel) or int4 (the file's
own Q4_1 blocks, the default without --dtype); every precision is measured by default, with
its ratio to float32 (no precision should be slower than the float32 it saves memory against).
The peer is llama-cpp-python (`pip install llama-cpp-python`, compiled from source), which runs the Q4_1 blocks with
llama.cpp's hand-written CPU kernels, with as many threads as torch uses.

Batch-1 decode: tokens/s after a short prompt, prefill excluded: (time(1 + N tokens) -
time(1 token)) / N, median of repeats. Batch of B: B prompts decoded together by kaon's
continuous batching; llama-cpp-python's Python API decodes one sequence at a time, so its
figure for B is the same requests run one after another (what a user of that API gets).

kaon runs its decode steps through the fused C step (kernels/cpu_decode.c); the formats in
`--torch-ops` are measured a second time with it off (torch ops, the path before it). The last
column: for a few prompts, how many greedy tokens each run shares with float32's before the
first that differs (64/64/64/64: the same text), the narrow formats' error as a user sees it.

--invariance: the cost of batch invariance (issue 49). Every step, prefill chunks included, runs
through the fused C step, whose rows are computed alone (models/cpu_decode_step.py; the default in
every precision, int8/int4 at their default one activation pass too); before, the prefill chunks went
through torch's GEMMs (KAON_CPU_PREFILL=torch, still there). Per format asked, both settings alternated
in one engine: batch-1 and batch-B decode tokens/s, and prefill tokens/s of a ~500-token prompt (time
to the first token), with the invariant setting's ratio to torch's prefill.

--activations: the same figures for int8/int4 weights, two int8 passes per activation block with every
row through the C step (KAON_CPU_ACTIVATIONS=int8x2) against one pass with the prompt rows through
torch's prefill (the default before invariance at one pass; --invariance compares that with today's
default, one pass through the C step), alternated in one engine; the median of the per-repeat
ratios. `--formats --torch-ops --activations int4` measures only that.

`--baseline-source OLD_cpu_decode.c` adds the default on that version's kernels, swapped in turn about
(the two / baseline one ratio: the invariant setting against the default before a kernel change).

--clock cpu: every rate per CPU second of the process (all its threads) instead of per wall second:
on a shared machine the other work's preemptions then cost each side less unevenly (A/B only).

--pair A B: two formats' engines built side by side and measured turn about (A, B, A, B, ...,
`--repeats` turns), each turn's batch-1 and batch-B rates; prints the median of the per-turn ratios
B / A. On a shared machine this ratio holds where the table's (one format after another) drifts with
the load. `--formats --torch-ops --pair float32 float16` measures only that; `--pair
bfloat16-int4:torch bfloat16-int4` the C step against torch ops for int4 weights in a bfloat16 model
(formats DTYPE-METHOD: --dtype DTYPE --quantization METHOD, and fp8, named only when asked for). The pair
measures prefill too (tokens/s of the --prompt-copies prompt, prefix caching off).

--model DIR: another model than the bundled one, for the pair and the A/B modes (the llama.cpp peer reads
the bundled GGUF only: `--formats --torch-ops`). A random mixture-of-experts directory for the C step's MoE
A/B: `python bench/random_moe.py DIR`, then `--model DIR --formats --torch-ops --pair float32:torch float32`.

Over 300 lines for a stated reason: the modes share one engine builder, one timing loop and one table,
and each is a few dozen lines on them; split into files, each would import the others' helpers back.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "runtime"))

# kaon_runtime tunes OpenMP's spinning through the environment when it is imported (see its
# __init__), and llama.cpp uses the same OpenMP runtime: the peer runs in a child process with
# the environment as the user had it, so each side gets its own defaults.
USER_ENV = dict(os.environ)

MODEL = ["builtin://smollm2-135m-instruct"]  # --model
PROMPT = "The river kept its own calendar. In spring it ran brown and fast with snowmelt, and in summer"


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
CLOCK = ["wall"]  # --clock: cpu times this process's CPU seconds (every thread's), which a shared machine's
# other work slows less than the wall clock; "tok/s" is then per CPU second


def clock() -> float:
    return CLOCKS[CLOCK[0]]()


def rate(run, batch: int, tokens: int, repeats: int) -> float:
    """Decoded tokens/s for `batch` sequences, prefill excluded (see the module docstring)."""
    run(batch, 2)  # warm-up
    rates = []
    for _ in range(repeats):
        t0 = clock()
        run(batch, 1)
        t1 = clock()
        run(batch, 1 + tokens)
        t2 = clock()
        rates.append(batch * tokens / ((t2 - t1) - (t1 - t0)))
    return statistics.median(rates)


# Greedy continuations compared with float32's: the narrow formats' error, as users would meet it.
AGREEMENT_PROMPTS = [PROMPT, "def fibonacci(n):", "The three primary colors are",
                     "Write a short letter to a friend about your summer holiday."]


FORMATS = ["float32", "bfloat16", "float16", "int8", "int4"]
# The narrow weights in a half-precision model (--dtype bfloat16 --quantization int4: bfloat16 norms,
# embedding rows and KV cache), measured when asked for by name (--formats, --torch-ops, --pair).
HALF_QUANTIZED = [f"{dtype}-{method}" for dtype in ("bfloat16", "float16") for method in ("int8", "int4")]
# fp8 (--quantization fp8: E4M3 weights widened exactly in the C step), measured when asked for by name too.
NAMED_ONLY = [*HALF_QUANTIZED, "fp8"]
ALL_FORMATS = FORMATS + NAMED_ONLY


def format_options(fmt: str) -> dict[str, str]:
    """The LLM options of a format name: a float dtype, a quantization (in float32), or dtype-quantization."""
    if fmt in HALF_QUANTIZED:
        dtype, method = fmt.split("-")
        return dict(dtype=dtype, quantization=method)
    if fmt in ("bfloat16", "float16"):
        return dict(dtype=fmt)
    return dict(dtype="float32", quantization="none" if fmt == "float32" else fmt)


def kaon_llm(fmt: str, fused: bool, prefill: str = "fused", activations: str | None = None, **engine_options):
    """An LLM in this format; fused=False builds it with the fused CPU decode step off (torch ops);
    prefill: KAON_CPU_PREFILL (fused: every step through the C step; torch: the chunks through torch);
    activations: KAON_CPU_ACTIVATIONS (None: the default), held while one request makes its structs."""
    from kaon_runtime import LLM, SamplingParams
    from kaon_runtime.kernels import cpu_decode
    options = format_options(fmt)
    saved = {name: os.environ.get(name) for name in ("KAON_CPU_DECODE", "KAON_CPU_PREFILL", "KAON_CPU_ACTIVATIONS")}
    os.environ.update(KAON_CPU_DECODE="on" if fused else "off", KAON_CPU_PREFILL=prefill)
    if activations:
        os.environ["KAON_CPU_ACTIVATIONS"] = activations
    cpu_decode.library.cache_clear()
    try:
        llm = LLM(MODEL[0], device="cpu", show_progress=False, **options, **engine_options)
        llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # (the head's struct)
        return llm
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None) if value is None else os.environ.update({name: value})
        cpu_decode.library.cache_clear()


PROMPT_COPIES = [24]  # --prompt-copies: the prefill prompt is PROMPT this many times (24: ~500 tokens)


def prefill_rate(llm, repeats: int) -> float:
    """Prompt tokens/s of a ~500-token prompt (--prompt-copies): its time to the first token, prefix caching off."""
    from kaon_runtime import SamplingParams
    ids = llm.tokenizer.encode(" ".join([PROMPT] * PROMPT_COPIES[0]))
    params = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([ids], params, use_tqdm=False)  # warm-up
    times = []
    for _ in range(repeats):
        t0 = clock()
        llm.generate([ids], params, use_tqdm=False)
        times.append(clock() - t0)
    return len(ids) / statistics.median(times)


def invariance_cost(formats: list[str], args) -> None:
    """Decode and prefill rates with every step through the C step (invariant, the default) and with the
    prefill chunks through torch (KAON_CPU_PREFILL=torch), per format, the two settings alternated
    `--repeats` times in one engine at its default activation passes (so a shared machine's load falls
    on both alike); medians, and the median of the per-turn ratios invariant / torch."""
    from kaon_runtime.kernels import cpu_decode
    print("\nbatch invariance: every step through the fused C step vs prefill chunks through torch "
          "(KAON_CPU_PREFILL=fused vs torch), alternated in one engine")
    print(f"{'':30} {'batch-1 tok/s':>14} {f'batch-{args.batch} tok/s':>15} {'prefill tok/s':>14}")
    for fmt in formats:
        llm = kaon_llm(fmt, True, "torch", enable_prefix_caching=False)
        run, passes = kaon_runner(llm), cpu_decode.activation_passes()
        figures: dict[str, list[tuple[float, float, float]]] = {"torch": [], "fused": []}
        for _ in range(args.repeats):
            for prefill in figures:
                use_activations(llm, passes, prefill == "fused")
                figures[prefill].append((rate(run, 1, args.tokens, 1), rate(run, args.batch, args.tokens, 1),
                                         prefill_rate(llm, 1)))
        for prefill, label in (("torch", "torch prefill"), ("fused", "invariant")):
            one, many, rows = (statistics.median(f[i] for f in figures[prefill]) for i in range(3))
            print(f"{'kaon ' + fmt + ' ' + label:30} {one:14.1f} {many:15.1f} {rows:14.1f}")
        ratios = [statistics.median(b[i] / a[i] for a, b in zip(figures["torch"], figures["fused"])) for i in range(3)]
        print(f"{'  invariant / torch (median)':30} {ratios[0]:13.2f}x {ratios[1]:14.2f}x {ratios[2]:13.2f}x",
              flush=True)
        del run, llm


def use_activations(llm, passes: int, c_prefill: bool) -> None:
    """Switch a built engine's narrow kernels to one or two int8 activation passes (KAON_CPU_ACTIVATIONS
    int8 / int8x2) and its prompt rows to the C step or torch (KAON_CPU_PREFILL), in place: the same
    weights and pool, so the two settings are measured turn about in one process (ratios that hold
    on a shared machine)."""
    model = llm.engine.runner.model
    step = model.model.cpu_decode
    step.activation_passes, step.prefills, step._built = passes, c_prefill, None  # structs rebuilt on the next step
    model.lm_head.cpu_weights().struct.act_passes = passes


def baseline_library(source: Path):
    """kernels/cpu_decode.c as another version (`git show <rev>:runtime/kaon_runtime/kernels/cpu_decode.c`),
    built and loaded beside this one (its own cache key: the source is part of it)."""
    from kaon_runtime.kernels import cpu_decode
    compiler = cpu_decode.compiler()
    if compiler is None:
        raise SystemExit(cpu_decode.NO_COMPILER)
    saved, cpu_decode.SOURCE = cpu_decode.SOURCE, source
    try:
        return cpu_decode.load(cpu_decode.build(compiler))
    finally:
        cpu_decode.SOURCE = saved


def activations_cost(formats: list[str], args) -> None:
    """Two int8 passes per activation block with every row through the C step (invariant, opt-in:
    KAON_CPU_ACTIVATIONS=int8x2) against the default (one pass, prompt rows through torch's prefill):
    batch-1 and batch-B decode tokens/s (decode runs the C step in both: the second pass's cost) and
    prefill tokens/s of a ~500-token prompt (the C step's prompt rows against torch's prefill),
    the settings alternated `--repeats` times in one engine, medians. --baseline-source OLD.c adds the
    default setting on that version's kernels (the engine's library swapped between turns: the structs
    are the same), so "two / baseline one" is the invariant setting against the default before a change."""
    from kaon_runtime.kernels import cpu_decode
    print("\nactivations: two int8 passes, prompt rows through the C step vs one pass, prompt rows through torch "
          "(KAON_CPU_ACTIVATIONS=int8x2 vs the default)")
    print(f"{'':44} {'batch-1 tok/s':>14} {f'batch-{args.batch} tok/s':>15} {'prefill tok/s':>14}")
    settings = {"one pass, torch prefill": (1, False, "this"), "two passes, C prefill": (2, True, "this")}
    libraries = {"this": cpu_decode.library}
    if args.baseline_source:
        baseline = baseline_library(args.baseline_source)
        libraries["baseline"] = lambda: baseline
        settings["baseline one pass, torch prefill"] = (1, False, "baseline")
    this_library = cpu_decode.library
    for fmt in formats:
        llm = kaon_llm(fmt, True, "torch", "int8", enable_prefix_caching=False)
        run = kaon_runner(llm)
        figures: dict[str, list[tuple[float, float, float]]] = {label: [] for label in settings}
        try:
            for _ in range(args.repeats):
                for label, (passes, c_prefill, lib) in settings.items():
                    cpu_decode.library = libraries[lib]
                    use_activations(llm, passes, c_prefill)
                    figures[label].append((rate(run, 1, args.tokens, 1), rate(run, args.batch, args.tokens, 1),
                                           prefill_rate(llm, 1)))
        finally:
            cpu_decode.library = this_library
        medians = {label: [statistics.median(f[i] for f in runs) for i in range(3)] for label, runs in figures.items()}
        for label, (one, many, prefill) in medians.items():
            print(f"{'kaon ' + fmt + ' ' + label:44} {one:14.1f} {many:15.1f} {prefill:14.1f}")
        pairs = [("two / one", "one pass, torch prefill")]
        if args.baseline_source:
            pairs += [("two / baseline one", "baseline one pass, torch prefill"),
                      ("one / baseline one", "baseline one pass, torch prefill")]
        for name, reference in pairs:
            this = figures["one pass, torch prefill" if name.startswith("one") else "two passes, C prefill"]
            ratios = [[b[i] / a[i] for a, b in zip(figures[reference], this)] for i in range(3)]
            print(f"{'  ' + name + ' (median ratio)':44} {statistics.median(ratios[0]):13.2f}x "
                  f"{statistics.median(ratios[1]):14.2f}x {statistics.median(ratios[2]):13.2f}x", flush=True)
        del run, llm


def pair_cost(first: str, second: str, args) -> None:
    """Batch-1 and batch-B decode of two formats, their engines alive together, alternated turn by turn;
    a name ending in ":torch" is that format with the fused step off (torch ops: the C step's A/B)."""
    llms = {fmt: kaon_llm(fmt.removesuffix(":torch"), not fmt.endswith(":torch"), enable_prefix_caching=False)
            for fmt in (first, second)}
    runs = {fmt: kaon_runner(llm) for fmt, llm in llms.items()}
    figures: dict[str, list[tuple[float, float, float]]] = {fmt: [] for fmt in llms}
    for _ in range(args.repeats):
        for fmt, run in runs.items():
            figures[fmt].append((rate(run, 1, args.tokens, 1), rate(run, args.batch, args.tokens, 1),
                                 prefill_rate(llms[fmt], 1)))
    print(f"\npair: {first} and {second} alternated, {args.repeats} turns (medians), {MODEL[0]}")
    print(f"{'':30} {'batch-1 tok/s':>14} {f'batch-{args.batch} tok/s':>15} {'prefill tok/s':>14}")
    for fmt, turns in figures.items():
        print(f"{'kaon ' + fmt:30} {statistics.median(t[0] for t in turns):14.1f} "
              f"{statistics.median(t[1] for t in turns):15.1f} {statistics.median(t[2] for t in turns):14.1f}")
    ratios = [[b[i] / a[i] for a, b in zip(figures[first], figures[second])] for i in range(3)]
    print(f"{'  ' + second + ' / ' + first + ' (median ratio)':30} {statistics.median(ratios[0]):13.2f}x "
          f"{statistics.median(ratios[1]):14.2f}x {statistics.median(ratios[2]):13.2f}x   per turn, batch 1: "
          + " ".join(f"{r:.2f}" for r in ratios[0]), flush=True)
    del runs, llms


def kaon_runner(llm):
    from kaon_runtime import SamplingParams

    def run(batch: int, n: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        llm.generate([PROMPT] * batch, params, use_tqdm=False)
    return run


def greedy_tokens(llm, tokens: int) -> list[list[int]]:
    from kaon_runtime import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(AGREEMENT_PROMPTS, params, use_tqdm=False)]


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> str:
    """Per prompt, how many greedy tokens equal the reference's before the first that differs."""
    same = [next((i for i, (a, b) in enumerate(zip(t, r)) if a != b), len(r)) for t, r in zip(tokens, reference)]
    return "/".join(map(str, same))


def llama_cpp_runner(gguf: Path, threads: int):
    from llama_cpp import Llama
    llm = Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=1024, verbose=False)

    prompt = llm.tokenize(PROMPT.encode())

    def run(batch: int, n: int) -> None:
        # Its Python API decodes one sequence at a time. generate() yields greedy tokens past
        # EOS (create_completion stops there, and its logit_bias costs a Python pass per token).
        for _ in range(batch):
            for _, _token in zip(range(n), llm.generate(prompt, top_k=1, temp=0.0)):
                pass
    return run


def llama_cpp_rates(gguf: Path, threads: int, args) -> tuple[float, float] | None:
    """(batch-1, batch-B) tokens/s of llama.cpp, measured in a child process (see USER_ENV)."""
    cmd = [sys.executable, __file__, "--peer", str(gguf), "--threads", str(threads), "--tokens", str(args.tokens),
           "--batch", str(args.batch), "--repeats", str(args.repeats), "--clock", args.clock]
    child = subprocess.run(cmd, env=USER_ENV, capture_output=True, text=True)
    if child.returncode != 0:
        print(f"llama.cpp peer failed (pip install llama-cpp-python?): {child.stderr.strip()[-300:]}")
        return None
    return tuple(json.loads(child.stdout.strip().splitlines()[-1]))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--formats", nargs="*", default=FORMATS, choices=ALL_FORMATS)
    parser.add_argument("--torch-ops", nargs="*", default=["float32", "int4"], choices=ALL_FORMATS,
                        help="formats also measured with the fused CPU decode step off")
    parser.add_argument("--invariance", nargs="*", default=[], choices=FORMATS,
                        help="formats whose decode and prefill are measured with and without batch invariance")
    parser.add_argument("--activations", nargs="*", default=[], choices=["int8", "int4"],
                        help="formats measured with one and two int8 passes per activation block")
    parser.add_argument("--baseline-source", type=Path,
                        help="--activations: also the default on this version of kernels/cpu_decode.c")
    parser.add_argument("--pair", nargs=2, choices=ALL_FORMATS + [f + ":torch" for f in ALL_FORMATS],
                        metavar=("A", "B"), help="two formats alternated turn by turn in one process: the ratio "
                        "B / A (FORMAT:torch: that format with the fused step off)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="cpu: rates per CPU second of this process (A/B on a shared machine)")
    parser.add_argument("--model", default=MODEL[0], help="the model of the pair and A/B modes (see above)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-copies", type=int, default=PROMPT_COPIES[0],
                        help="the prefill figures' prompt: the decode prompt this many times (24: ~500 tokens)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--peer", type=Path, help=argparse.SUPPRESS)  # the child: llama.cpp on this GGUF
    parser.add_argument("--threads", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    CLOCK[0] = args.clock
    MODEL[0] = args.model
    PROMPT_COPIES[0] = args.prompt_copies
    if args.peer:
        peer = llama_cpp_runner(args.peer, args.threads)
        print(json.dumps([rate(peer, 1, args.tokens, args.repeats), rate(peer, args.batch, args.tokens, 1)]))
        return 0

    import kaon_runtime  # noqa: F401  (before torch: its OpenMP settings)
    # isort: split
    import torch

    from kaon_runtime.loader import resolve_model
    threads = torch.get_num_threads()
    gguf = resolve_model(MODEL[0]) if args.formats else None  # (the peer and the table's title)
    rows = {}
    peer = llama_cpp_rates(gguf, threads, args) if gguf is not None else None  # (no table without formats)
    if peer is not None:
        rows["llama.cpp Q4_1"] = peer
    reference, agree = None, {}
    for fmt, fused in [(f, True) for f in args.formats] + [(f, False) for f in args.torch_ops]:
        name = f"kaon {fmt}" + ("" if fused else " (torch ops)")
        llm = kaon_llm(fmt, fused)
        run = kaon_runner(llm)
        rows[name] = (rate(run, 1, args.tokens, args.repeats), rate(run, args.batch, args.tokens, 1))
        greedy = greedy_tokens(llm, args.tokens)
        reference = reference or (greedy if fmt == "float32" else None)
        agree[name] = agreement(greedy, reference) if reference else "-"
        del run, llm

    print(f"{platform.processor() or platform.machine()}, {threads} threads, torch {torch.__version__}, "
          f"{MODEL[0] if gguf is None else gguf.name}, {args.tokens} tokens after a {len(PROMPT.split())}-word prompt")
    base = rows.get("llama.cpp Q4_1")
    f32 = rows.get("kaon float32")
    print(f"{'':26} {'batch-1 tok/s':>14} {'vs llama.cpp':>13} {'vs float32':>11} {f'batch-{args.batch} tok/s':>15} "
          f"{'vs llama.cpp':>13} {'vs float32':>11}  greedy tokens as float32's (per prompt, of {args.tokens})")
    for name, (one, many) in rows.items():
        r1 = f"{one / base[0]:.2f}x" if base else "-"
        rb = f"{many / base[1]:.2f}x" if base else "-"
        f1 = f"{one / f32[0]:.2f}x" if f32 else "-"
        fb = f"{many / f32[1]:.2f}x" if f32 else "-"
        print(f"{name:26} {one:14.1f} {r1:>13} {f1:>11} {many:15.1f} {rb:>13} {fb:>11}  {agree.get(name, '-')}")
    if args.invariance:
        invariance_cost(args.invariance, args)
    if args.activations:
        activations_cost(args.activations, args)
    if args.pair:
        pair_cost(args.pair[0], args.pair[1], args)
    if args.json:
        args.json.write_text(json.dumps({k: {"batch1_tok_s": v[0], f"batch{args.batch}_tok_s": v[1],
                                             "greedy_agreement": agree.get(k)} for k, v in rows.items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
