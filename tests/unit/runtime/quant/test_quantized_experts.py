"""Mixture-of-experts checkpoints whose experts are quantized (AWQ, GPTQ, compressed-tensors, GGUF) keep
them quantized: one of kaon's quantized linears per expert's gate|up and down, no float copy.

Tiny Mixtral and Qwen3-MoE directories (support/quantized_moe_dirs.py: GPTQ and AWQ packed to their
published layouts, compressed-tensors written by its own package) decode with kaon's reference kernels
to the greedy tokens of transformers on the dequantized weights (and, for compressed-tensors, of
transformers decompressing the same directory); GGUF files (written by the gguf package,
support/gguf_from_hf.py) decode as they do with the experts dequantized to float. The layer itself runs
on each quantized kernel (torch's CPU int4 / int8, Triton's W4A16 / W8A16 in its interpreter)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from kaon_runtime import LLM, SamplingParams
from kaon_runtime.errors import ModelLoadError
from kaon_runtime.kernels.moe_ref import moe_ref
from kaon_runtime.layers.activation import silu_and_mul
from kaon_runtime.layers.moe import QuantizedExperts, SparseMoE, has_quantized_experts
from kaon_runtime.quant import surgery
from kaon_runtime.quant.checkpoint_formats import scheme_from_config
from kaon_runtime.quant.group_int8 import GroupInt8Linear
from kaon_runtime.quant.int4 import Int4Linear
from kaon_runtime.quant.int8 import Int8Linear
from support.gptq_awq import np_dequantize, np_pack_columns, np_pack_rows, np_quantize
from support.quantized_dirs import greedy, shortfalls, transformers_reference
from support.quantized_moe_dirs import (
    tiny_moe,
    write_compressed_tensors_moe_dir,
    write_packed_moe_dir,
)

transformers = pytest.importorskip("transformers")
PROMPTS = [list(range(100, 120)), [5, 9, 300, 4000, 17]]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
HIDDEN, WIDTH, EXPERTS = 128, 128, 4  # support/quantized_moe_dirs.py's shape
INT4 = dict(num_bits=4, type="int", strategy="group", group_size=32)
NEAR_TIE = 0.2  # how far below transformers' best a GGUF run's token may be: twice what the int8 head explains
CASES = {  # id -> (family, writer arguments, the linear each expert's projections become)
    "mixtral-gptq-4bit-g32-asym": ("mixtral", ("gptq", 4, 32, False), Int4Linear),
    "qwen3_moe-gptq-8bit-channel-sym": ("qwen3_moe", ("gptq", 8, -1, True), Int8Linear),
    "qwen3_moe-awq-g64": ("qwen3_moe", ("awq", 4, 64, False), Int4Linear),
    "qwen3_moe-ct-w4a16-group32": ("qwen3_moe", ({**INT4, "symmetric": True}, "pack-quantized"), Int4Linear),
    "mixtral-ct-w8a16-group64": ("mixtral", (dict(num_bits=8, type="int", symmetric=True, strategy="group",
                                                  group_size=64), "pack-quantized"), GroupInt8Linear),
}


def _write(case: str, path, gguf_path):
    family, args, _ = CASES[case]
    if len(args) == 2:
        return write_compressed_tensors_moe_dir(path, gguf_path, family, *args)
    return write_packed_moe_dir(path, gguf_path, family, *args)


def _generate(path, **kwargs) -> tuple[LLM, list[list[int]]]:
    llm = LLM(str(path), show_progress=False, device="cpu", dtype="float32", kv_cache_bytes=1 << 22, **kwargs)
    return llm, [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _moe_layers(llm: LLM) -> list[SparseMoE]:
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoE)]


def _assert_no_float_experts(moe: SparseMoE, kept: type) -> None:
    """The experts are the quantized linears alone: the layer's only parameter is its router."""
    assert isinstance(moe.quantized, QuantizedExperts)
    assert all(isinstance(linear, kept) for linear in [*moe.quantized.gate_up, *moe.quantized.down])
    assert [name for name, _ in moe.named_parameters()] == ["gate.weight"]


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_quantized_experts_decode_as_transformers_on_the_dequantized_weights(case, tmp_path, gguf_path):
    reference = _write(case, tmp_path / "model", gguf_path)
    llm, tokens = _generate(tmp_path / "model")
    for moe in _moe_layers(llm):
        _assert_no_float_experts(moe, CASES[case][2])
    assert tokens == [greedy(reference, prompt, GREEDY.max_tokens) for prompt in PROMPTS]
    if "-ct-" in case:  # transformers decompresses compressed-tensors itself: the same directory, its own reading
        assert tokens == [greedy(transformers_reference(tmp_path / "model"), prompt, GREEDY.max_tokens)
                          for prompt in PROMPTS]


@pytest.mark.slow
def test_memory_held_is_the_quantized_size(tmp_path, gguf_path):
    """GPTQ 4-bit in groups of 32: each expert weight costs half a byte per value plus a float32 scale and
    offset per 32 values; a float copy of the experts (4 x 3 x 128 x 128 float32 per layer) would show."""
    _write("mixtral-gptq-4bit-g32-asym", tmp_path / "model", gguf_path)
    llm, _ = _generate(tmp_path / "model")
    values = EXPERTS * 3 * HIDDEN * WIDTH
    moes = _moe_layers(llm)
    assert len(moes) == 2 and all(moe.quantized is not None for moe in moes)
    for moe in moes:
        assert moe.quantized is not None
        held = sum(t.numel() * t.element_size() for t in moe.quantized.buffers())
        assert held == values // 2 + values // 32 * 8
    float_bytes = sum(t.numel() * t.element_size() for t in llm.engine.runner.model.parameters())
    embed_head_norms_routers = 4 * (2 * 49152 * HIDDEN + 2 * (2 * HIDDEN + 2 * 32 + EXPERTS * HIDDEN) + HIDDEN)
    assert float_bytes <= embed_head_norms_routers


@pytest.mark.slow
@pytest.mark.parametrize(("family", "type_name", "kept"), [("mixtral", "Q4_0", Int4Linear),
                                                           ("qwen3_moe", "Q8_0", GroupInt8Linear)])
def test_gguf_experts_stay_quantized_and_decode_as_when_dequantized(family, type_name, kept, tmp_path, gguf_path,
                                                                    float_kernels, monkeypatch):
    from support.gguf_from_hf import dequantized_reference, write_gguf_from_hf

    model = tiny_moe(family)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    path = write_gguf_from_hf(model, tmp_path / "model.gguf", gguf_path, type_name)
    kept_llm = LLM(str(path), show_progress=False, device="cpu", kv_cache_bytes=1 << 22)  # the file's own blocks
    ours = [list(o.outputs[0].token_ids) for o in kept_llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    for moe in _moe_layers(kept_llm):
        _assert_no_float_experts(moe, kept)
    monkeypatch.setattr(surgery, "_keep_experts", lambda model, given: [])  # experts dequantized to float
    float_llm = LLM(str(path), show_progress=False, device="cpu", kv_cache_bytes=1 << 22)
    assert not has_quantized_experts(float_llm.engine.runner.model)
    assert ours == [list(o.outputs[0].token_ids) for o in float_llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    float_experts = 2 * EXPERTS * 3 * HIDDEN * WIDTH * 4
    assert kept_llm.engine.runner.weight_bytes < float_llm.engine.runner.weight_bytes - float_experts // 2
    reference = dequantized_reference(model, type_name)  # transformers: the head in float, kaon's int8
    # Every token is transformers' greedy choice on kaon's path, or within a near-tie of it: the int8
    # head moves the logits by up to 0.04 here (measured through kaon's logprobs, 2026-11-29), so a
    # token can be chosen over one at most twice that above it; these runs have top-two margins of 0.01.
    below = [shortfalls(reference, prompt, run) for prompt, run in zip(PROMPTS, ours)]
    assert max(max(b) for b in below) <= NEAR_TIE, below



@pytest.mark.parametrize("kernel", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_experts_equal_the_float_layer_on_their_dequantized_weights(kernel, bits, monkeypatch):
    """QuantizedExperts on each kernel (Triton's interpreted without a GPU) against moe_ref on the float weights."""
    # Triton's interpreter runs the int4 gemv (each expert's 1-4 rows) at a cost that grows with the weight's
    # rows (3 rows: ~10 CPU s at 256, ~2.5 s at 64 on a Zen 2): 45 s for this case at the model's shape. It
    # gets hidden = width = 32 (one group of 32 along K, the smallest GPTQ group kaon's kernels take; still 2
    # of 4 experts per token, 1-4 rows each: the gemv path); the cheap kernels keep the model's shape.
    hidden, width = (32, 32) if kernel == "triton" else (HIDDEN, WIDTH)
    rng = np.random.default_rng(bits)
    scheme = scheme_from_config(dict(quant_method="gptq", bits=bits, group_size=32, sym=False))
    linears: dict[str, list] = {"gate_up": [], "down": []}
    dense: dict[str, list] = {"gate_up": [], "down": []}
    for _ in range(EXPERTS):
        for part, (n, k) in {"gate_up": (2 * width, hidden), "down": (hidden, width)}.items():
            q, zeros, scales, g_idx = np_quantize(rng.normal(size=(n, k)) * 0.1, bits, 32, False)
            tensors = {"qweight": np_pack_rows(q.T, bits), "qzeros": np_pack_columns((zeros - 1).T, bits),
                       "scales": scales.T}
            tensors = {key: torch.from_numpy(np.ascontiguousarray(v)) for key, v in tensors.items()}
            linears[part].append(scheme.convert(part, tensors, k).to_module(None, torch.device("cpu")))
            dense[part].append(torch.from_numpy(np_dequantize(q, zeros, scales, g_idx)))
    experts = QuantizedExperts(linears["gate_up"], linears["down"])
    x = torch.randn(7, hidden)
    ids = torch.stack([torch.randperm(EXPERTS)[:2] for _ in range(7)])
    weights = torch.rand(7, 2)
    expected = moe_ref(x, torch.stack(dense["gate_up"]), torch.stack(dense["down"]), weights, ids, silu_and_mul)
    monkeypatch.setenv("KAON_QUANT_KERNEL", kernel)
    close = dict(atol=1e-4, rtol=1e-4) if kernel != "cpu" else dict(atol=5e-2, rtol=2e-2)  # cpu: bfloat16 int4
    torch.testing.assert_close(experts(x, weights, ids), expected, **close)


@pytest.fixture(scope="module")
def gptq_moe_dir(tmp_path_factory, gguf_path):
    path = tmp_path_factory.mktemp("gptq-moe") / "model"
    write_packed_moe_dir(path, gguf_path, "qwen3_moe", "gptq", 4, 32, False)
    return path


def _edited_copy(src, dst, edit) -> None:
    import shutil

    shutil.copytree(src, dst)
    state = load_file(dst / "model.safetensors")
    edit(state)
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.slow
def test_a_layer_with_some_experts_float_is_a_one_line_error(gptq_moe_dir, tmp_path):
    expert = "model.layers.1.mlp.experts.2.down_proj"

    def float_expert(state):
        for suffix in ("qweight", "qzeros", "scales", "g_idx"):
            del state[f"{expert}.{suffix}"]
        state[f"{expert}.weight"] = torch.zeros(HIDDEN, WIDTH)

    _edited_copy(gptq_moe_dir, tmp_path / "m", float_expert)
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp: .*expert 2 down") as error:
        LLM(str(tmp_path / "m"), show_progress=False, device="cpu", dtype="float32")
    assert "\n" not in str(error.value)


@pytest.mark.slow
def test_a_truncated_expert_tensor_is_a_one_line_error_naming_it(gptq_moe_dir, tmp_path):
    expert = "model.layers.0.mlp.experts.3.up_proj"

    def truncate(state):
        state[f"{expert}.qweight"] = state[f"{expert}.qweight"][:-1].contiguous()

    _edited_copy(gptq_moe_dir, tmp_path / "m", truncate)
    with pytest.raises(ModelLoadError, match=rf"{expert}\.qweight") as error:
        LLM(str(tmp_path / "m"), show_progress=False, device="cpu", dtype="float32")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("name", ["model.layers.0.block_sparse_moe.experts.1.w2",  # Mixtral's down
                                  "model.layers.0.mlp.experts.1.gate_proj"])
def test_tensor_parallel_ranks_take_their_share_of_each_quantized_expert(name, float_kernels):
    """Each rank holds every expert, cut like a dense MLP: gate/up by rows, down by (whole groups of) columns."""
    from kaon_runtime.config import ModelConfig
    from kaon_runtime.distributed.parallel import TensorParallel
    from kaon_runtime.engine.prequantized import Prequantized

    config = ModelConfig(architecture="qwen3_moe", vocab_size=64, hidden_size=HIDDEN, intermediate_size=256,
                         num_layers=1, num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=64,
                         num_experts=EXPERTS, num_experts_per_tok=2, moe_intermediate_size=WIDTH)
    down = name.endswith(("down_proj", ".w2"))
    n, k = (HIDDEN, WIDTH) if down else (WIDTH, HIDDEN)
    q, zeros, scales, g_idx = np_quantize(np.random.default_rng(1).normal(size=(n, k)), 4, 32, False)
    tensors = {"qweight": np_pack_rows(q.T, 4), "qzeros": np_pack_columns((zeros - 1).T, 4), "scales": scales.T}
    scheme = scheme_from_config(dict(quant_method="gptq", bits=4, group_size=32, sym=False))
    whole = torch.from_numpy(np_dequantize(q, zeros, scales, g_idx))
    shards = []
    for rank in range(2):
        plan = Prequantized(scheme, config, {})
        plan.held[name] = {key: torch.from_numpy(np.ascontiguousarray(v)) for key, v in tensors.items()}
        module = plan._shard(name, TensorParallel(rank=rank, size=2)).to_module(None, torch.device("cpu"))
        shards.append(module(torch.eye(module.in_features)).t())  # its dequantized weight
    torch.testing.assert_close(torch.cat(shards, dim=1 if down else 0), whole, atol=1e-5, rtol=0)
