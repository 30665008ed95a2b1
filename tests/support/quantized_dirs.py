"""Tiny quantized HF directories for the checkpoint-format tests.

compressed-tensors directories are written by the compressed-tensors package itself (the library
llm-compressor saves with): its scheme applied to a tiny random Llama, the weight scales set from
each group's range (what llm-compressor's min-max observer computes), then its ModelCompressor.
GPTQ and AWQ directories are packed with numpy from the formats' published layouts (support/gptq_awq.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from support.gptq_awq import act_orders, pack_linears, quantization_config
from support.hf_dirs import write_hf_dir

SHAPE = dict(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
             tie_word_embeddings=False)


def tiny_llama(seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).eval()


def write_compressed_tensors(path: Path, gguf_path, weights: dict, fmt: str, seed: int = 0) -> None:
    """A tiny Llama quantized by compressed-tensors with weight arguments `weights` (QuantizationArgs
    fields), lm_head ignored, saved in format `fmt` (pack-quantized, int-quantized, float-quantized)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    model = tiny_llama(seed)
    write_hf_dir(model, path, gguf_path, {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"})
    args = QuantizationArgs(**weights)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                                ignore=["lm_head"], format=fmt)
    apply_quantization_config(model, config)
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "weight_scale", None) is None:
                continue
            w = module.weight
            n, k = w.shape
            if args.strategy == "group":
                lo, hi = (f(w.reshape(n, k // args.group_size, -1), -1) for f in (torch.amin, torch.amax))
            elif args.strategy == "channel":
                lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
            elif args.strategy == "block":
                b0, b1 = args.block_structure
                blocks = w.reshape(n // b0, b0, k // b1, b1)
                lo, hi = blocks.amin((1, 3)), blocks.amax((1, 3))
            else:
                lo, hi = w.amin().reshape(1), w.amax().reshape(1)
            scale, zero = calculate_qparams(lo, hi, args)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            if getattr(module, "weight_zero_point", None) is not None:
                module.weight_zero_point.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(str(path))


def add_input_scales(path: Path, activations: dict, scale: float) -> None:
    """Static input quantization added to a compressed-tensors directory: an `input_scale` of `scale` for every
    quantized linear and `activations` (QuantizationArgs fields, dynamic false) as its group's input_activations."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(file)
    for name in [n for n in tensors if n.endswith(".weight_scale")]:
        tensors[name.replace(".weight_scale", ".input_scale")] = torch.tensor([scale])
    save_file(tensors, file, metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    config["config_groups"]["group_0"]["input_activations"] = activations
    update_config(path, quantization_config=config)


def transformers_reference(path: Path):
    """transformers on the same directory, decompressed to float32 weights."""
    import transformers

    quant = transformers.CompressedTensorsConfig(run_compressed=False)
    return transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=quant,
                                                             torch_dtype=torch.float32).eval()


def greedy(model, prompt: list[int], tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=2)
    return out[0, len(prompt):].tolist()


def teacher_forced_logits(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """`model`'s float32 logits at each of `tokens`' steps ([len(tokens), vocab]: row i follows prompt +
    tokens[:i]), from one forward pass over prompt + tokens."""
    with torch.inference_mode():
        return model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()


def shortfalls(model, prompt: list[int], tokens: list[int]) -> list[float]:
    """How far below `model`'s best logit each of `tokens` is, scored on prompt + tokens at once:
    0 where it is the model's greedy choice. Teacher-forced (the tokens' own path), so one near-tie
    that parts two greedy runs does not count the rest of the run against them."""
    logits = teacher_forced_logits(model, prompt, tokens)
    chosen = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    return (logits.max(dim=1).values - chosen).tolist()


def update_config(path: Path, **fields) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(fields)
    (path / "config.json").write_text(json.dumps(config))


def write_packed_dir(path: Path, gguf_path, method: str, bits: int, group: int, sym: bool = True,
                     act_order: bool = False, seed: int = 0):
    """A tiny Llama as a GPTQ ("gptq", AutoGPTQ's v1 format with its zero - 1) or AutoAWQ GEMM ("awq")
    directory; returns the transformers model holding the dequantized float weights (the reference)."""
    from safetensors.torch import load_file, save_file

    model = tiny_llama(seed)
    write_hf_dir(model, path, gguf_path, {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"})
    linears = {name: module for name, module in model.named_modules()
               if isinstance(module, torch.nn.Linear) and name != "lm_head"}
    widths = {name: module.in_features for name, module in linears.items()}
    orders = act_orders(widths, np.random.default_rng(seed)) if act_order else dict.fromkeys(linears)
    state = load_file(path / "model.safetensors")
    dequantized = pack_linears(state, orders, method, bits, group, sym)
    with torch.no_grad():
        for name, module in linears.items():
            module.weight.copy_(dequantized[f"{name}.weight"])
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    update_config(path, quantization_config=quantization_config(method, bits, group, sym, act_order))
    return model
