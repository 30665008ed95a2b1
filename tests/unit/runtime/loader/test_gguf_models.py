"""GGUF models kept quantized on CPU: a tiny Llama written by the gguf package with every type
kaon keeps (and Q4_K_M's mix within fused projections) loads in its own precision by default,
each projection holds exactly the weights the float load dequantizes, and greedy decoding on the
reference kernels equals the float32 model's token for token. Bad files: one line naming the tensor."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from kaon_runtime import LLM, SamplingParams
from kaon_runtime.config import EngineConfig
from kaon_runtime.engine.gguf_weights import own_method
from kaon_runtime.errors import ModelLoadError
from kaon_runtime.kernels import cpu_decode
from kaon_runtime.kernels.quant_gemm_ref import dequantize_int4
from kaon_runtime.loader import open_checkpoint
from kaon_runtime.quant.bit_planes import BitPlanesLinear, dequantize_bit_planes
from kaon_runtime.quant.gguf import BLOCKS
from kaon_runtime.quant.group_int8 import GroupInt8Linear, dequantize_group_int8
from kaon_runtime.quant.int4 import Int4Linear
from support.gguf_files import write_tiny_gguf

pytest.importorskip("gguf")
pytestmark = pytest.mark.slow  # each model loads the 49k-token tokenizer of the bundled file

PROMPTS = [[1, 500, 600, 700], [1, 42, 4242, 9000, 12, 7]]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _llm(path, **options) -> LLM:
    return LLM(str(path), show_progress=False, device="cpu", kv_cache_bytes=1 << 22, **options)


def _tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)]


def _projections(llm: LLM) -> dict[str, nn.Module]:
    model = llm.engine.runner.model
    return {name: m for name, m in model.named_modules() if name.endswith("_proj") and "layers" in name}


def _dequantized(module: nn.Module) -> torch.Tensor:
    if isinstance(module, GroupInt8Linear):
        return dequantize_group_int8(module.weight)
    if isinstance(module, BitPlanesLinear):
        return dequantize_bit_planes(module.weight)
    assert isinstance(module, Int4Linear), type(module)
    weight = module.int4_weight()  # (the engine's modules hold the fused step's layout: quant/kernel_layout.py)
    return dequantize_int4(weight.packed, weight.scales, weight.mins, weight.group_size)


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory, gguf_path):
    """Every kept type somewhere: Q4_K_M's mix in layer 0 and each other type in a layer of its own."""
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "mixed.gguf", gguf_path, "ALL")


@pytest.fixture(scope="module")
def float_llm(mixed_gguf):
    return _llm(mixed_gguf, dtype="float32")


def test_every_type_loads_kept_quantized_and_exact(mixed_gguf, float_llm):
    kept = _llm(mixed_gguf)
    assert kept.engine.runner.config.quantization == "none"  # nothing asked: the file's own precision
    floats = _projections(float_llm)
    projections = _projections(kept)
    assert projections.keys() == floats.keys()
    for name, module in projections.items():
        assert isinstance(module, (Int4Linear, GroupInt8Linear, BitPlanesLinear)), f"{name} is {type(module).__name__}"
        assert torch.equal(_dequantized(module), floats[name].weight.float()), name
    # the fused C step reads every layout: it decodes (its int8 activations may part from float32's tokens)
    assert all(len(t) == GREEDY.max_tokens for t in _tokens(kept))


def test_greedy_tokens_equal_the_float_model_on_the_reference_kernels(mixed_gguf, monkeypatch):
    monkeypatch.setenv("KAON_QUANT_KERNEL", "torch")  # dequantize and multiply in float32
    monkeypatch.setattr(cpu_decode, "library", lambda: None)  # no fused step, no int8 activations
    assert _tokens(_llm(mixed_gguf)) == _tokens(_llm(mixed_gguf, dtype="float32"))


def test_a_q8_0_file_runs_int8_and_a_q4_0_file_int4(tmp_path, gguf_path):
    for type_name, method in (("Q8_0", "int8"), ("Q4_0", "int4"), ("Q4_K_M", "int4"), ("Q5_K_M", "int8")):
        path = write_tiny_gguf(tmp_path / f"{type_name}.gguf", gguf_path, type_name)
        checkpoint = open_checkpoint(str(path))
        assert own_method(EngineConfig(), checkpoint, "cpu") == method
        assert own_method(EngineConfig(dtype="float32"), checkpoint, "cpu") is None  # the float reference
        assert own_method(EngineConfig(), checkpoint, "cuda") is None


def test_a_truncated_tensor_is_named_at_load(tmp_path, gguf_path):
    path = write_tiny_gguf(tmp_path / "cut.gguf", gguf_path, "Q8_0", truncate_last=True)
    with pytest.raises(ModelLoadError, match=r"^tensor blk\.1\.ffn_down\.weight is truncated: .* in cut\.gguf$"):
        open_checkpoint(str(path))


def test_an_unknown_type_is_named_at_load(tmp_path, gguf_path):
    path = write_tiny_gguf(tmp_path / "odd.gguf", gguf_path, "Q8_0")
    raw = bytearray(path.read_bytes())
    name = b"blk.0.attn_q.weight"
    at = raw.index(name) + len(name) + 4 + 2 * 8  # after the name: n_dims (uint32), two uint64 dims, the type
    raw[at:at + 4] = (99).to_bytes(4, "little")
    path.write_bytes(raw)
    with pytest.raises(ModelLoadError, match=r"^tensor blk\.0\.attn_q\.weight has an unknown GGML type 99 in odd"):
        open_checkpoint(str(path))


def test_types_kaon_keeps_are_all_written(mixed_gguf):
    import gguf
    written = {t.tensor_type.name for t in gguf.GGUFReader(str(mixed_gguf)).tensors}
    assert set(BLOCKS) <= written


@pytest.mark.parametrize("arch", ["qwen3"])
def test_families_beyond_llama_load_as_transformers_reads_them(tmp_path, gguf_path, arch):
    """The tensor-name map against transformers' own GGUF reader on the same file, greedy, in float32."""
    transformers = pytest.importorskip("transformers")
    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", gguf_path, "Q8_0", arch=arch)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name,
                                                                  dtype=torch.float32).eval()
    expected = []
    for prompt in PROMPTS:
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        expected.append(out[0, len(prompt):].tolist())
    # This tiny model's greedy runs repeat the prompt's last token by margins of 19 or more: tokens
    # alone would pass with every projection zeroed (tried). The logprobs are held to the reference too.
    floats, kept = _llm(path, dtype="float32"), _llm(path)
    assert _tokens(floats) == expected
    assert _logprob_gap(floats, reference) < 1e-3  # measured 4e-5 (2026-11-29)
    # Kept quantized (Q8_0 in groups), the activations go in as int8 blocks: measured 0.6 (projections
    # zeroed: 68); the same tokens.
    assert _tokens(kept) == expected
    assert _logprob_gap(kept, reference) < 2.0


def _logprob_gap(llm: LLM, reference) -> float:
    """The largest difference between kaon's logprobs (its top 5 at each token of its greedy runs)
    and the reference's on the same tokens."""
    params = SamplingParams(max_tokens=GREEDY.max_tokens, temperature=0, ignore_eos=True, logprobs=5)
    gap = 0.0
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params)):
        tokens = list(out.outputs[0].token_ids)
        with torch.inference_mode():
            logits = reference(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
        theirs = torch.log_softmax(logits, dim=-1)
        for at, top in enumerate(out.outputs[0].logprobs):
            gap = max(gap, *(abs(float(theirs[at, token]) - logprob) for token, logprob in top.items()))
    return gap
