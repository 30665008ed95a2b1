"""How far kaon's fast default strays from what a quantized checkpoint specifies, per format (issue 49 §1).

    python bench/quant_reference.py [--rows GPTQ AWQ W4A16 W8A16 W8A8 FP8-dynamic] [--tokens 512]

Each row is the bundled SmolLM2-135M-Instruct (its Q4_1 GGUF dequantized) written as a checkpoint of that
format (compressed-tensors by its own compressor from a float HF directory of it, GPTQ / AWQ packed by the
tests' numpy writer), then loaded
twice in the same run: kaon's default (`dtype="auto"`: the fused C step, whose narrow kernels round
activations to int8 in blocks of 32, for decode and, since invariance at one pass, prompt rows too; before,
prompt rows took torch's int4 / int8 kernels with bfloat16 activations, KAON_CPU_PREFILL=torch) and its
reference mode (`dtype="float32"`: float32 activations times the dequantized weights, plus only the
activation quantization the checkpoint specifies; it equals transformers token for token, see
tests/unit/runtime/quant/test_reference_arithmetic.py).

Printed per format:
  first-token logprob   over PROMPTS, each prompt's first generated token's distribution (a prefill): the
                        largest |default - reference| log-probability among the reference's top 5 tokens,
                        and on how many prompts the top token differs;
  perplexity            bench/data/perplexity_sample.txt's first --tokens tokens in one window, default vs
                        reference, and their ratio. The default runs the decode path (one token per step, as
                        serving runs: the fused C step). The reference runs the window as one prefill
                        (--reference-path): its arithmetic is row by row (float activations; the activation
                        quantization these checkpoints specify is per token), so a prefill computes what decode
                        steps would, up to float32 summation order, and its weights are dequantized once per
                        forward instead of once per token (decoding, the reference dequantizes every weight once
                        per token: earlier runs on a loaded 2-vCPU machine never finished a row).
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "runtime"))
sys.path.insert(0, str(ROOT / "bench"))

from format_perplexity import FP8, PER_TOKEN_INT8, W4A16, W8A8_WEIGHTS, compress_and_save  # noqa: E402
from perplexity import TEXT, score  # noqa: E402

from kaon_runtime import LLM  # noqa: E402
from kaon_runtime.layers.attention import AttentionMetadata, PrefillChunk  # noqa: E402
from kaon_runtime.loader import open_checkpoint, resolve_model  # noqa: E402

ROWS = ("GPTQ", "AWQ", "W4A16", "W8A16", "W8A8", "FP8-dynamic")
W8A16 = dict(num_bits=8, type="int", symmetric=True, strategy="channel")
PER_TOKEN_FP8 = dict(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True)
PACKED = {"GPTQ": dict(method="gptq", bits=4, group=64, sym=False), "AWQ": dict(method="awq", bits=4, group=64,
                                                                                 sym=False)}
COMPRESSED = {  # name -> (weights, format, input activations)
    "W4A16": (W4A16, "pack-quantized", None),
    "W8A16": (W8A16, "pack-quantized", None),
    "W8A8": (W8A8_WEIGHTS, "int-quantized", PER_TOKEN_INT8),
    "FP8-dynamic": (FP8, "float-quantized", PER_TOKEN_FP8),
}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of",
           "Once upon a time, in a small village,", "The three primary colors are", "2 + 2 =",
           "Photosynthesis is the process by which", "The best way to learn a language is",
           "In 1969, the first humans"]


def write(name: str, directory: Path, bundled: Path) -> None:
    directory.mkdir()
    from packed_checkpoints import write_packed

    if name in PACKED:
        write_packed(directory, **PACKED[name])
        return
    # The bundled model's float weights as an HF directory (packed_checkpoints' writer, with nothing packed:
    # a GPTQ run whose quantization_config is then replaced), then quantized by compressed-tensors itself.
    weights, fmt, inputs = COMPRESSED[name]
    float_dir = directory.parent / f"{name}-float"
    float_dir.mkdir()
    write_float(float_dir)
    write_compressed_from_dir(directory, float_dir, weights, fmt, inputs)


def write_float(directory: Path) -> None:
    """The bundled GGUF dequantized, as a float32 HF directory (config.json, model.safetensors, tokenizer)."""
    import json

    from safetensors.torch import save_file

    from kaon_runtime.loader import open_checkpoint

    checkpoint = open_checkpoint("builtin://smollm2-135m-instruct")
    c = checkpoint.config
    save_file({name: t.contiguous() for name, t in checkpoint.weights()}, directory / "model.safetensors",
              metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads, max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta, tie_word_embeddings=c.tie_word_embeddings,
        bos_token_id=checkpoint.tokenizer.bos_token_id, eos_token_id=checkpoint.tokenizer.eos_token_ids[0])))
    checkpoint.tokenizer.backend.save(str(directory / "tokenizer.json"))


def write_compressed_from_dir(directory: Path, source: Path, weights: dict, fmt: str, inputs: dict | None) -> None:
    """format_perplexity.write_compressed's quantization (round to nearest, min-max scales, lm_head float), from an
    HF float directory instead of transformers' GGUF conversion (minutes on a shared 2-vCPU machine)."""
    import shutil

    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    compress_and_save(model, directory, weights, fmt, inputs)
    shutil.copy(source / "tokenizer.json", directory / "tokenizer.json")


@torch.inference_mode()  # as the engine runs: without it autograd kept every forward's dequantized weights
def first_token_logprobs(runner, ids: list[int]) -> torch.Tensor:
    """log-softmax of the token after `ids`, from one prefill of them. Under inference mode: outside it, the
    reference's tensors carried an autograd graph that saved each forward's dequantized float weights (404 MiB a
    prompt for AWQ, kept alive by the returned log-probabilities: the 14 GB of an earlier run)."""
    n, device = len(ids), runner.device
    blocks = torch.arange(-(-n // runner.block_size), device=device)
    meta = AttentionMetadata(slot_mapping=torch.arange(n, device=device), prefills=[PrefillChunk(0, n, n, blocks)])
    hidden = runner.model(torch.tensor(ids, device=device), torch.arange(n, device=device), meta)
    return torch.log_softmax(runner.model.compute_logits(hidden[-1:])[0].float(), dim=-1)


def resident_mib() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20


def release() -> None:
    """Give a closed engine's memory back. A closed LLM's model, KV pool and kernels stay reachable through
    reference cycles until the cycle collector runs (measured: 2,069 MiB resident after closing a float32 engine,
    738 MiB after gc.collect(), 623 MiB after malloc_trim), and glibc keeps freed arenas: without this each row's
    two engines piled up (14 GB in one earlier run, 3.6 GB before the second row here)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: nothing to trim
        pass


def measure(directory: Path, dtype: str, prompts: list[list[int]], window: list[int], path: str) -> dict:
    start = time.perf_counter()
    with LLM(str(directory), show_progress=False, device="cpu", dtype=dtype) as llm:  # closed: one engine at a time
        runner = llm.engine.runner
        logprobs = [first_token_logprobs(runner, ids) for ids in prompts]
        perplexity = score(runner, [window], path)[0]
        cpu_decode = runner.kernels.cpu_decode
        del runner
    del llm
    release()
    return dict(logprobs=logprobs, perplexity=perplexity, cpu_decode=cpu_decode, seconds=time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help="the first N of the 9 prompts")
    parser.add_argument("--reference-path", choices=("prefill", "decode"), default="prefill",
                        help="how the reference mode runs the perplexity window (the default mode always decodes)")
    parser.add_argument("--reference-only", action="store_true",
                        help="measure the reference mode alone (its perplexity and the C step's part in it)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    bundled = resolve_model("builtin://smollm2-135m-instruct")
    tokenizer = open_checkpoint(str(bundled)).tokenizer  # the engine's tokenizer, without building an engine
    prompts = [tokenizer.encode(p) for p in PROMPTS[:args.prompts]]
    window = tokenizer.encode(TEXT.read_text())[:args.tokens]
    print(f"torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} threads; "
          f"{len(prompts)} prompts; perplexity on {len(window)} tokens of {TEXT.relative_to(ROOT)}: default by decode "
          f"steps, reference by {args.reference_path}")
    print(f"{'format':<12} {'max |dlogp| top5':>17} {'top-1 flips':>11} {'ppl default':>12} {'ppl reference':>14} "
          f"{'ratio':>7}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.rows:
            directory = Path(tmp) / name
            write(name, directory, bundled)
            release()
            ref = measure(directory, "float32", prompts, window, args.reference_path)
            if args.reference_only:
                print(f"{name:<12} {'':>17} {'':>11} {'':>12} {ref['perplexity']:>14.4f}   (fused C step: reference "
                      f"{ref['cpu_decode']}; {ref['seconds']:.0f} s)", flush=True)
                continue
            fast = measure(directory, "auto", prompts, window, "decode")
            gaps, flips = [], 0
            for ours, theirs in zip(fast["logprobs"], ref["logprobs"]):
                top = theirs.topk(5).indices
                gaps.append(float((ours[top] - theirs[top]).abs().max()))
                flips += int(ours.argmax() != theirs.argmax())
            ratio = fast["perplexity"] / ref["perplexity"]
            print(f"{name:<12} {max(gaps):>17.4f} {flips:>8}/{len(prompts)} {fast['perplexity']:>12.4f} "
                  f"{ref['perplexity']:>14.4f} {ratio:>7.4f}   (fused C step: default {fast['cpu_decode']}, "
                  f"reference {ref['cpu_decode']}; {fast['seconds']:.0f} s / {ref['seconds']:.0f} s; "
                  f"{resident_mib()} MiB resident after)", flush=True)
            rows.append(dict(format=name, max_first_token_logprob_gap=max(gaps), top1_flips=flips,
                             prompts=len(prompts), perplexity_default=fast["perplexity"],
                             perplexity_reference=ref["perplexity"], ratio=ratio))
    if args.json:
        args.json.write_text(json.dumps(dict(tokens=len(window), reference_path=args.reference_path, rows=rows),
                                        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
