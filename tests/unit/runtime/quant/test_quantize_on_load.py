"""`--quantization` on a float checkpoint quantizes each linear as its weights arrive (quant/on_load.py), and the
quantized numbers are exactly those the whole-model surgery (quant/surgery.quantize_model, run after a float load)
makes: for every method, with q|k|v biases, tied and untied heads, a tensor-parallel shard and a pipeline stage.
The peak this saves is measured in a subprocess by tests/unit/runtime/engine/test_load_memory.py."""
from __future__ import annotations

import weakref

import pytest
import torch

from kaon_runtime.distributed.parallel import TensorParallel
from kaon_runtime.distributed.stages import PipelineStage
from kaon_runtime.layers.kernel_backend import torch_kernels
from kaon_runtime.models.registry import build_model
from kaon_runtime.quant import on_load, quantize_model
from kaon_runtime.quant.on_load import DeferredLinear, defer
from support.tp_ranks import checkpoint

METHODS = ("int8", "int4", "fp8")


def _surgery_after_a_float_load(config, tensors, method, tp, dtype):
    """What kaon did before: the whole float model, loaded, then every linear swapped."""
    with torch.device("meta"):
        model = build_model(config, tp, torch_kernels()).to(dtype)
    model = model.to_empty(device="cpu")
    model.load_weights(tensors.items())
    quantize_model(model, method)
    return model


def _quantized_on_load(config, tensors, method, tp, dtype):
    with torch.device("meta"):
        model = build_model(config, tp, torch_kernels()).to(dtype)
        plan = defer(model, method, torch.device("cpu"), head=True)
    model = model.to_empty(device="cpu")
    model.load_weights(tensors.items(), plan)
    assert not plan.pending and plan.quantized
    head = getattr(model, "lm_head", None)
    assert head is None or head.quantized is not None  # as soon as its table was in
    quantize_model(model, method)  # what load_model still runs after the stream (nothing left here)
    return model


def _tensors(model):
    """Every parameter and buffer, the non-persistent ones too (the C step's kernel layouts, quant/kernel_layout.py)."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _assert_same_state(ours, theirs):
    mine, reference = _tensors(ours), _tensors(theirs)
    assert mine.keys() == reference.keys()
    assert not any(isinstance(m, DeferredLinear) for m in ours.modules())
    for name, tensor in reference.items():
        assert mine[name].dtype == tensor.dtype and torch.equal(mine[name], tensor), name


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("family, extra, dtype", [
    ("qwen2", {"tie_word_embeddings": True}, torch.float32),  # q|k|v biases, a tied head
    ("llama", {"tie_word_embeddings": False}, torch.bfloat16),  # an untied head; a bfloat16 model
])
def test_linears_quantized_as_they_load_equal_the_surgery_after_a_float_load(family, extra, dtype, method):
    config, tensors = checkpoint(family, extra)
    tp = TensorParallel()
    _assert_same_state(_quantized_on_load(config, tensors, method, tp, dtype),
                       _surgery_after_a_float_load(config, tensors, method, tp, dtype))


@pytest.mark.parametrize("tp", [TensorParallel(rank=1, size=2),
                                TensorParallel(stage=PipelineStage(index=1, size=2, start=1, end=None))],
                         ids=["tensor-parallel rank 1 of 2", "pipeline stage 2 of 2"])
def test_a_shard_or_a_stage_quantized_as_it_loads_equals_the_surgery(tp):
    config, tensors = checkpoint("qwen2", {"tie_word_embeddings": True})
    _assert_same_state(_quantized_on_load(config, tensors, "int8", tp, torch.float32),
                       _surgery_after_a_float_load(config, tensors, "int8", tp, torch.float32))


def test_no_more_than_one_layers_projections_are_float_at_once(monkeypatch):
    """The float weights of the deferred linears alive at any moment of the load: at most the ones a layer's
    fused projections are still waiting for, never the model's (the float model never exists whole). In a
    safetensors file's order (names sorted: k_proj, o_proj, q_proj, v_proj), q|k|v waits while o_proj comes."""
    config, tensors = checkpoint("llama", {"num_hidden_layers": 4})
    alive: list[weakref.ref] = []
    most = 0
    make = on_load.QuantizeOnLoad.buffer

    def counting(self, param_name):
        nonlocal most
        module, _, param = param_name.rpartition(".")
        linear = self.pending[module].linear
        tensor = make(self, param_name)
        weight = getattr(linear, param)  # the float Parameter the buffer lives in
        if not any(ref() is weight for ref in alive):
            alive.append(weakref.ref(weight))
        most = max(most, sum(ref() is not None for ref in alive))
        return tensor

    monkeypatch.setattr(on_load.QuantizeOnLoad, "buffer", counting)
    model = _quantized_on_load(config, dict(sorted(tensors.items())), "int8", TensorParallel(), torch.float32)
    assert len(alive) == 4 * 4 and sum(ref() is not None for ref in alive) == 0  # each made once, every one gone
    linears = [m for m in model.model.layers.modules() if type(m).__name__ == "Int8Linear"]
    assert len(linears) == 4 * 4 and most <= 2, most  # (qkv, o, gate_up, down a layer)


def test_a_tensor_that_comes_again_after_its_linear_was_quantized_is_refused():
    config, tensors = checkpoint("llama", {})
    name = "model.layers.0.self_attn.o_proj.weight"
    with torch.device("meta"):
        model = build_model(config, TensorParallel(), torch_kernels())
        plan = defer(model, "int8", torch.device("cpu"))
    model = model.to_empty(device="cpu")
    with pytest.raises(ValueError, match="comes again after its layer was already quantized"):
        model.load_weights([*tensors.items(), (name, tensors[name])], plan)


def test_a_linear_whose_weight_never_comes_is_reported_missing():
    config, tensors = checkpoint("llama", {})
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    with torch.device("meta"):
        model = build_model(config, TensorParallel(), torch_kernels())
        plan = defer(model, "int8", torch.device("cpu"))
    model = model.to_empty(device="cpu")
    with pytest.raises(KeyError, match="qkv_proj"):
        model.load_weights(tensors.items(), plan)


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_the_bundled_model_quantized_as_it_loads_holds_the_same_weights_as_before(method, monkeypatch):
    """The bundled Q4_1 file under --quantization: every quantized tensor equal to what load_model made until
    2026-11-30 (the whole float model loaded, then quant/surgery; int8 and fp8 also re-quantized the tied table from
    its dequantized floats, which now comes as the file's Q8_0 blocks: the same int8 table exactly)."""
    from kaon_runtime.config import EngineConfig
    from kaon_runtime.engine import model_loader
    from kaon_runtime.loader.opener import open_checkpoint
    from support import MODEL

    def load():
        config = EngineConfig(model=MODEL, device="cpu", quantization=method)
        return model_loader.load_model(config, open_checkpoint(MODEL), torch.device("cpu"), torch.float32,
                                       torch_kernels(), show_progress=False)

    ours = load()
    with monkeypatch.context() as before:
        before.setattr(model_loader, "defer", lambda *args, **kwargs: None)  # surgery after the float load
        if method != "int4":  # (int4 held the file's 4-bit layers, and with them the table, already)
            before.setattr(model_loader, "table_held", lambda *args: False)
        reference = load()
    _assert_same_state(ours, reference)
