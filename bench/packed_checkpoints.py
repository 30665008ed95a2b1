"""SmolLM2 (the bundled Q4_1 GGUF, dequantized) as GPTQ and AutoAWQ GEMM directories and as other GGUF
types, for bench/format_perplexity.py.

GPTQ (AutoGPTQ's v1 layout: qzeros hold zero - 1) and AutoAWQ GEMM (columns interleaved 0 2 4 6 1 3 5 7
in each word) are packed with numpy from the formats' published layouts by the tests' own writer
(tests/support/gptq_awq.py), by round-to-nearest min-max quantization; act-order permutes each layer's
input columns (shared by the layers that read the same input, as GPTQ's order is) and records each
column's group in g_idx. The writer returns the float weights it quantized to (its own dequantization,
independent of kaon's loader) for the reference.
"""
from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support.gptq_awq: the tests' packers

from tests.support.gptq_awq import act_orders, pack_linears, quantization_config

MODEL = "builtin://smollm2-135m-instruct"
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_packed(directory: Path, method: str, bits: int, group: int, sym: bool,
                 act_order: bool = False) -> dict[str, torch.Tensor]:
    """The model as a "gptq" or "awq" directory; returns each quantized linear's float weight as written."""
    from safetensors.torch import save_file

    from kaon_runtime.loader import open_checkpoint

    checkpoint = open_checkpoint(MODEL)
    c = checkpoint.config
    state = {name: tensor.contiguous() for name, tensor in checkpoint.weights()}
    widths = {name.removesuffix(".weight"): t.shape[1] for name, t in state.items()
              if name.endswith(".weight") and name.removesuffix(".weight").rpartition(".")[2] in LINEARS}
    orders = act_orders(widths, np.random.default_rng(0)) if act_order else dict.fromkeys(widths)
    floats = pack_linears(state, orders, method, bits, group, sym)
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    quant = quantization_config(method, bits, group, sym, act_order)
    config = dict(architectures=["LlamaForCausalLM"], vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                  intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers,
                  num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                  max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
                  rope_theta=c.rope_theta, tie_word_embeddings=c.tie_word_embeddings, quantization_config=quant)
    (directory / "config.json").write_text(json.dumps(config))
    tokenizer = checkpoint.tokenizer
    tokenizer.backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": tokenizer.backend.id_to_token(tokenizer.bos_token_id) if tokenizer.bos_token_id is not None
        else None, "eos_token": tokenizer.backend.id_to_token(tokenizer.eos_token_ids[0])}))
    return floats


def quantized_gguf(type_name: str, directory: Path) -> Path:
    """The bundled GGUF requantized to `type_name` (Q6_K, Q5_0, ...) by llama.cpp's own quantizer."""
    import llama_cpp

    from kaon_runtime.loader import resolve_model

    target = directory / f"SmolLM2-135M-Instruct.{type_name}.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{type_name}"), True
    if llama_cpp.llama_model_quantize(str(resolve_model(MODEL)).encode(), str(target).encode(),
                                      ctypes.byref(params)) != 0:
        raise SystemExit(f"llama.cpp could not quantize to {type_name}")
    return target
