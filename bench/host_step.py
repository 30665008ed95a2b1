"""The engine's host time per step, apart from the model's: scheduling, the step plan, sampling, detokenization,
stop checks and outputs, at 64 and 256 running sequences.

    python bench/host_step.py [--base TREE] [--rounds 3] [--profile FILE]

A model so small that its forward pass is a small part of the step (a 1-layer Llama of hidden size 16, a
4,096-token vocabulary, random weights, the byte-level tokenizer random:// models use, which has no
token for ids past 255: bench/throughput.py's GPU run detokenizes through the same one, and most of its
128,256 ids are past 255) runs N requests (--max-num-seqs N, N in --batches), each a
prompt of --prompt-len tokens and --output-len tokens out, EOS ignored, on the CPU. Each decode-only step
with N sequences running is timed twice: the whole `engine.step()` and, inside it, the model's own
work (its forward pass and compute_logits). Host time = step - model; both in CPU seconds of this
process (the machine is shared: CPU time is what the host costs, wall time is what the neighbours
leave), the median over the steps, per step and per output token. Prompts of 1,024 tokens by default:
block tables as long as the GPU run's (100-1,024 tokens in and out, 16-token blocks).

`--base TREE`: the same measure of another tree's runtime/ (e.g. `git archive main runtime | tar -x -C
TREE`), in alternating fresh processes, `--rounds` of each: an A/B inside one run, for a shared machine.
`--parts`: the two costs this workload understates, alone, in this process: the decode block tables of 256
sequences of 8-128 blocks (the GPU run's contexts) through torch.tensor against engine.step_tensors.DecodeTables,
and detokenizing random:// Llama-3 ids (most past 255: no text) with the whole window against the detokenizer's;
and detokenizing the bundled SmolLM2 tokenizer's ids of English text with the Python window against the
detokenizer's (tokenizers' DecodeStream where the decoder is ByteLevel).
`--profile FILE`: cProfile's top functions of this tree's run at the largest batch, written there (a run of
its own, after the timed ones).
"""
from __future__ import annotations

import argparse
import cProfile
import inspect
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def write_tiny_model(path: Path, vocab: int = 4096) -> None:
    """A 1-layer random Llama with a byte-level tokenizer (ids past 255 decode to nothing, as random:// ones)."""
    import torch
    import transformers

    from kaon_runtime.loader.tokenizer import Tokenizer
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=8192,
                                      bos_token_id=vocab - 2, eos_token_id=vocab - 1, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    Tokenizer.bytes_only(vocab - 2, vocab - 1).backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text("{}")


def measure(model: str, batch: int, prompt_len: int, output_len: int, profile: str | None) -> dict:
    """Median CPU microseconds per decode-only step with `batch` sequences running: whole step, forward, host."""
    import torch

    from kaon_runtime import LLM, SamplingParams
    torch.manual_seed(0)
    llm = LLM(model, show_progress=False, device="cpu", dtype="float32", max_num_seqs=batch,
              max_num_batched_tokens=max(8192, batch * prompt_len // 4), enable_prefix_caching=False)
    engine = llm.engine
    model = engine.runner.model
    forward_s = [0.0]

    def timed(fn):
        def run(*args, **kwargs):
            start = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                forward_s[0] += time.process_time() - start
        return run

    # The model's own work: its forward pass and the logits of the sample rows (instance attributes shadow
    # the methods; nn.Module's __call__ reads self.forward).
    model.forward = timed(model.forward)
    model.compute_logits = timed(model.compute_logits)
    prompts = [[(7 * i + j) % 256 for j in range(prompt_len)] for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    # As the tree's LLM.generate steps: asking for finished outputs only where the engine can (this branch on).
    step_kwargs = {"only_finished": True} if "only_finished" in inspect.signature(engine.step).parameters else {}
    steps, tokens = [], 0
    profiler = cProfile.Profile() if profile else None
    while engine.has_unfinished_requests():
        decode_only = (len(engine.scheduler.running) == batch and not engine.scheduler.waiting
                       and all(s.is_decoding for s in engine.scheduler.running))
        forward_s[0] = 0.0
        if profiler is not None and decode_only:
            profiler.enable()
        start = time.process_time()
        outputs = engine.step(**step_kwargs)
        whole = time.process_time() - start
        if profiler is not None:
            profiler.disable()
        tokens += sum(len(o.outputs[0].token_ids) for o in outputs if o.finished)
        if decode_only:
            steps.append((whole, forward_s[0]))
    assert tokens == batch * output_len, (tokens, batch * output_len)
    if profiler is not None:
        with open(profile, "w") as out:
            out.write(f"cProfile of {len(steps)} decode-only steps, {batch} running\n")
            pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(40)
            pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(40)
    whole = statistics.median(s for s, _ in steps)
    forward = statistics.median(f for _, f in steps)
    host = statistics.median(s - f for s, f in steps)
    return {"batch": batch, "steps": len(steps), "step_us": whole * 1e6, "forward_us": forward * 1e6,
            "host_us": host * 1e6, "host_us_per_token": host * 1e6 / batch}


def parts() -> None:
    """CPU per step of the block tables and per token of the detokenizer, before and after (see the docstring)."""
    import random

    import torch

    from kaon_runtime.engine.step_plan import StepPlan
    from kaon_runtime.engine.step_tensors import DecodeTables
    from kaon_runtime.loader.tokenizer import IncrementalDetokenizer, Tokenizer
    rng = random.Random(0)
    live = {i: [rng.randrange(60000) for _ in range(rng.randint(8, 120))] for i in range(256)}
    cache = DecodeTables()

    def step():
        for table in live.values():
            if rng.random() < 1 / 16:  # a block per 16 tokens
                table.append(rng.randrange(60000))
        return list(live), [list(t) for t in live.values()]

    for name, build in (("torch.tensor(padded tables)",
                         lambda ids, ts: torch.tensor(StepPlan(decode_tables=ts).padded_decode_tables())),
                        ("DecodeTables.gather", cache.gather)):
        cpu = 0.0
        for _ in range(50):
            ids, ts = step()
            start = time.process_time()
            build(ids, ts)
            cpu += time.process_time() - start
        print(f"block tables, 256 x 8-128 blocks: {name}: {cpu / 50 * 1e6:.0f} us CPU per step")

    class WholeWindow(IncrementalDetokenizer):
        """The detokenizer before dropped ids were left out of its window."""

        def add(self, token_id: int) -> str:
            self.ids.append(token_id)
            prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
            full = self.tokenizer.decode(self.ids[self.prefix_offset:])
            if full.endswith("\ufffd") or len(full) <= len(prefix):
                return ""
            new = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += new
            return new

    tokenizer = Tokenizer.bytes_only(128000, 128001)
    ids = [rng.randrange(128256) for _ in range(1024)]
    texts = {}
    for name, cls in (("whole window", WholeWindow), ("IncrementalDetokenizer", IncrementalDetokenizer)):
        for n in (128, 512, 1024):
            detok = cls(tokenizer, ids[:6])
            start = time.process_time()
            for token in ids[:n]:
                detok.add(token)
            texts.setdefault(n, set()).add(detok.text)
            print(f"detokenizing random:// Llama-3 ids: {name}: {(time.process_time() - start) / n * 1e6:.1f} us "
                  f"CPU per token over {n} tokens")
    assert all(len(t) == 1 for t in texts.values()), "the two detokenizers' texts differ"

    # A real tokenizer (the bundled SmolLM2's, ByteLevel: tokenizers' DecodeStream applies) over English text.
    from kaon_runtime.loader import resolve_model
    from kaon_runtime.loader.gguf_file import load_gguf
    smol = load_gguf(resolve_model("builtin://smollm2-135m-instruct")).tokenizer
    ids = smol.encode((ROOT / "docs" / "architecture.md").read_text()[:20000])
    texts = {}
    for name, cls in (("Python window", WholeWindow), ("IncrementalDetokenizer", IncrementalDetokenizer)):
        detok = cls(smol, ids[:6])
        start = time.process_time()
        for token in ids[6:]:
            detok.add(token)
        texts[name] = detok.text
        print(f"detokenizing SmolLM2 ids of English text: {name}: "
              f"{(time.process_time() - start) / (len(ids) - 6) * 1e6:.1f} us CPU per token over {len(ids) - 6} tokens")
    assert len(set(texts.values())) == 1, "the two detokenizers' texts differ"


def child(args) -> None:
    for batch in [max(args.batches)] if args.profile else args.batches:
        print(json.dumps(measure(args.model, batch, args.prompt_len, args.output_len, args.profile)), flush=True)


def run_tree(tree: Path, args, model: str, profile: bool = False) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=f"{tree / 'runtime'}:{ROOT}")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--model", model, "--prompt-len",
           str(args.prompt_len), "--output-len", str(args.output_len), "--batches", *map(str, args.batches)]
    if profile:
        cmd += ["--profile", str(args.profile)]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", type=Path, help="another tree (its runtime/) to measure in turn, A/B")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--profile", type=Path)
    parser.add_argument("--model")
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--parts", action="store_true", help="the tables' and the detokenizer's costs alone")
    args = parser.parse_args()
    if args.parts:
        parts()
        return 0
    if args.child:
        child(args)
        return 0
    print(f"load {os.getloadavg()[0]:.1f} at start, {time.strftime('%H:%M UTC', time.gmtime())}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        write_tiny_model(Path(tmp))
        trees = [("this", ROOT)] + ([("base", args.base.resolve())] if args.base else [])
        results: dict[str, list[list[dict]]] = {name: [] for name, _ in trees}
        for r in range(args.rounds):
            for name, tree in (trees if r % 2 == 0 else trees[::-1]):
                results[name].append(run_tree(tree, args, tmp))
                for row in results[name][-1]:
                    print(f"round {r} {name:4s} batch {row['batch']:3d}: step {row['step_us']:7.0f} us, forward "
                          f"{row['forward_us']:6.0f} us, host {row['host_us']:7.0f} us/step "
                          f"({row['host_us_per_token']:5.1f} us/token), {row['steps']} steps", flush=True)
        if args.profile:  # its own run: cProfile's overhead stays out of the figures above
            run_tree(ROOT, args, tmp, profile=True)
    print(f"load {os.getloadavg()[0]:.1f} at end")
    for i, batch in enumerate(args.batches):
        medians = {name: statistics.median(rounds[i]["host_us"] for rounds in runs) for name, runs in results.items()}
        line = f"batch {batch}: host us/step (CPU, median of rounds) " + ", ".join(
            f"{name} {us:.0f}" for name, us in medians.items())
        if "base" in medians:
            line += f"; base/this {medians['base'] / medians['this']:.2f}x"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
