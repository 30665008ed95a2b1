"""The decoder every supported family shares (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3, Gemma 2,
Phi-3, Mixtral, Qwen3-MoE), over a flattened token batch. The families differ only in options of
ModelConfig: q/k norms, sliding windows, soft-capping, sandwich norms, the MLP's activation, and
sparse experts in place of the MLP. Checkpoint names are mapped in models.weights.

Under tensor parallelism each rank builds the model with its share of the heads and of
the MLP width (`local_config`): q/k/v and gate/up are column-parallel, and the outputs of
o_proj and down_proj are partial sums that an all-reduce completes. Under pipeline parallelism
each rank builds only its stage's layers (`tp.stage`): the embedding on the first stage, the
final norm and the head on the last; a later stage starts from the previous one's (hidden, residual).
With the fused CPU step a stage's pair is (residual stream, zeros) in float32, which the next stage's step
reads on exactly (DecoderModel._fused).

The kernels come in at construction (layers.kernel_backend): each layer takes the fused ones
that apply to it, and the torch code where none does.

Over 300 lines for a stated reason: one decoder serves nine families, and its torch path and the
fused CPU step's hand-offs (whole model, pipeline stage, mixed steps) sit side by side.
"""
from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any, cast

import torch
from torch import nn

from kaon_runtime.config import ModelConfig
from kaon_runtime.distributed.parallel import TensorParallel
from kaon_runtime.distributed.sharding import local_config
from kaon_runtime.layers.activation import GATED_ACTIVATIONS
from kaon_runtime.layers.attention import Attention, AttentionMetadata
from kaon_runtime.layers.invariant_linear import linear_class
from kaon_runtime.layers.kernel_backend import KernelBackend, torch_kernels
from kaon_runtime.layers.lora import LoraBatch
from kaon_runtime.layers.moe import SparseMoE
from kaon_runtime.layers.norm import RMSNorm
from kaon_runtime.layers.rotary import RotaryEmbedding, apply_rotary
from kaon_runtime.layers.vocab import VocabEmbedding, VocabHead
from kaon_runtime.models import weights as checkpoint_names
from kaon_runtime.models.cpu_decode_step import CpuDecodeStep, split_decodes
from kaon_runtime.models.fused_weights import FusedExperts, FusedLayer, FusedWeights

_LAYER = re.compile(r"model\.layers\.(\d+)\.")  # a checkpoint tensor's layer index


def _norm(c: ModelConfig, size: int | None = None, kernel=None) -> RMSNorm:
    return RMSNorm(size or c.hidden_size, c.rms_norm_eps, c.norm_weight_offset, kernel)


def _norm_kernel(c: ModelConfig, kernels: KernelBackend):
    """The fused norm for the residual-stream norms, where it applies: Gemma's offset norms and
    sandwich norms keep torch's code (as do Qwen3's q/k norms, over strided head views), except
    with the GPU's batch-invariant kernels, where every norm takes it (kernels/norm.py says why)."""
    if kernels.batch_invariant and kernels.rms_norm is not None:
        return functools.partial(kernels.rms_norm, weight_offset=c.norm_weight_offset)
    return kernels.rms_norm if c.norm_weight_offset == 0 and not c.sandwich_norms else None


class SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, tp: TensorParallel, kernels: KernelBackend):
        super().__init__()
        c = config
        self.tp = tp
        self.q_size, self.kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.rotary_dim = c.rotary_dim or c.head_dim
        linear = linear_class(kernels)  # nn.Linear, or the batch-invariant GEMM's (layers/invariant_linear.py)
        self.qkv_proj = linear(c.hidden_size, self.q_size + 2 * self.kv_size, bias=c.attention_bias)
        self.o_proj = linear(self.q_size, c.hidden_size, bias=False)
        # Qwen3: each head's q and k are normalised (one weight over head_dim, shared by the heads) before rotary.
        head_norm = _norm_kernel(c, kernels) if kernels.batch_invariant else None
        self.q_norm = _norm(c, c.head_dim, head_norm) if c.qk_norm else None
        self.k_norm = _norm(c, c.head_dim, head_norm) if c.qk_norm else None
        self.attn = Attention(c.num_heads, c.num_kv_heads, c.head_dim, c.attn_scale, c.window(layer), c.attn_softcap,
                              kernels.attention)
        self.rotary_kernel = kernels.rotary  # in place; None: torch's apply_rotary
        # The Triton backend rotates q and k in the launch that caches k and v (one launch fewer a layer).
        self.rotary_in_attention = getattr(kernels.attention, "fuses_rotary", False)

    def forward(self, rope, x, meta: AttentionMetadata):
        qkv = self.qkv_proj(x).view(x.shape[0], -1, self.head_dim)  # [T, H + 2 Hkv, D]
        rotated_heads = self.num_heads + self.num_kv_heads
        qk = qkv[:, :rotated_heads]  # q and k heads sit side by side: one pass
        if self.q_norm is not None and self.k_norm is not None:
            qk[:, :self.num_heads] = self.q_norm(qk[:, :self.num_heads])
            qk[:, self.num_heads:] = self.k_norm(qk[:, self.num_heads:])
        q, k, v = qk[:, :self.num_heads], qk[:, self.num_heads:], qkv[:, rotated_heads:]
        if self.rotary_in_attention:
            out = self.attn(q, k, v, meta, rope=(*rope, self.rotary_dim))
            return self.tp.all_reduce(self.o_proj(out.reshape(-1, self.q_size)))
        rotated = qk[..., :self.rotary_dim]  # Phi-3 variants may rotate only a leading part of each head
        if self.rotary_kernel is None:
            rotated.copy_(apply_rotary(rotated, *rope))
        else:
            self.rotary_kernel(rotated, *rope, out=rotated)  # in place: q and k stay views of qkv
        out = self.attn(q, k, v, meta)
        return self.tp.all_reduce(self.o_proj(out.reshape(-1, self.q_size)))


class GatedMLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, kernels: KernelBackend):
        super().__init__()
        self.tp = tp
        linear = linear_class(kernels)
        self.gate_up_proj = linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = linear(config.intermediate_size, config.hidden_size, bias=False)
        fused = kernels.silu_and_mul if config.hidden_act == "silu" else None
        self.act = fused or GATED_ACTIVATIONS[config.hidden_act]

    def forward(self, x):
        return self.tp.all_reduce(self.down_proj(self.act(self.gate_up_proj(x))))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, tp: TensorParallel, kernels: KernelBackend):
        super().__init__()
        self.self_attn = SelfAttention(config, layer, tp, kernels)
        self.mlp = (SparseMoE(config, tp, kernels.fused_moe, kernels.batch_invariant, kernels.cpu_rows_alone)
                    if config.is_moe_layer(layer)
                    else GatedMLP(config, tp, kernels))
        norm_kernel = _norm_kernel(config, kernels)
        self.input_layernorm = _norm(config, kernel=norm_kernel)
        self.post_attention_layernorm = _norm(config, kernel=norm_kernel)
        # Gemma 2's sandwich: attention's and the MLP's outputs are normalised before they join the residual.
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            sandwich_kernel = norm_kernel if kernels.batch_invariant else None
            self.pre_feedforward_layernorm = _norm(config, kernel=sandwich_kernel)
            self.post_feedforward_layernorm = _norm(config, kernel=sandwich_kernel)

    def forward(self, rope, x, residual, meta):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(rope, x, meta)
        if not self.sandwich:
            x, residual = self.post_attention_layernorm(x, residual)
            return self.mlp(x), residual
        x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(x), residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual

    def fused_layer(self) -> FusedLayer:
        """What the fused CPU decode step reads of this layer (its norms as stored: the step adds Gemma's offset)."""
        attn, mlp = self.self_attn, self.mlp
        sandwich = (self.pre_feedforward_layernorm, self.post_feedforward_layernorm) if self.sandwich else (None, None)
        experts = _fused_experts(mlp) if isinstance(mlp, SparseMoE) else None
        gate_up, down = (None, None) if isinstance(mlp, SparseMoE) else (mlp.gate_up_proj, mlp.down_proj)
        layer = FusedLayer(attn.qkv_proj, attn.o_proj, gate_up, down, self.input_layernorm.weight,
                           self.post_attention_layernorm.weight, attn.attn.k_cache, attn.attn.v_cache, attn.attn.scale,
                           attn.attn.sliding_window,
                           *(None if norm is None else norm.weight for norm in (attn.q_norm, attn.k_norm, *sandwich)))
        return layer if experts is None else replace(layer, experts=experts)


def _fused_experts(moe: SparseMoE) -> FusedExperts:
    """What the fused step reads of an MoE layer: its router, its routing's options, its experts (float stacks, or
    a quantized checkpoint's per-expert linears)."""
    quantized = moe.quantized
    gate_up, down = (moe.w13, moe.w2) if quantized is None else (list(quantized.gate_up), list(quantized.down))
    return FusedExperts(moe.gate.weight, moe.top_k, moe.renormalize, gate_up, down)


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, kernels: KernelBackend, layers: range):
        super().__init__()
        stage = tp.stage
        self.rotary = RotaryEmbedding(config.rotary_dim or config.head_dim, config.max_position_embeddings,
                                      config.rope_theta, config.rope_scaling)
        self.embed_tokens = None if config.tie_word_embeddings or not stage.is_first else VocabEmbedding(
            config.vocab_size, config.hidden_size, tp)
        # Local index i is global layer layers[i] (the stage's); windows and experts go by the global one.
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp, kernels) for i in layers)
        self.norm = _norm(config, kernel=_norm_kernel(config, kernels)) if stage.is_last else None
        # Decode-only steps on CPU (and the decodes of mixed ones) through the fused C step.
        self.cpu_decode = CpuDecodeStep(self, config, kernels.cpu_decode_rows, tp) if kernels.cpu_decode else None
        self.staged = stage.size > 1  # a pipeline stage: the C step's input and output differ (see _fused)
        self.lora: LoraBatch | None = None  # set by models.lora_targets when adapters are served

    def decoder_layers(self) -> list[DecoderLayer]:
        return cast("list[DecoderLayer]", list(self.layers))

    def fused_weights(self) -> FusedWeights:
        """What the fused CPU decode step reads of the decoder (models.fused_weights.FusedDecoder)."""
        cos, sin = self.rotary.tables(torch.device("cpu"))
        # A pipeline stage's own layers (their windows go by the global index: DecoderLayer), and the final
        # norm on the last stage only.
        final_norm = None if self.norm is None else self.norm.weight
        return FusedWeights([layer.fused_layer() for layer in self.decoder_layers()], final_norm, cos, sin)

    def kv_cache_address(self) -> tuple[int, ...]:
        """Where the first layer's key cache starts, and its shape: a new pool means the fused step's
        pointers and strides are stale. The shape too, because a pool freed and another allocated can
        start at the same address (the profiling run's scratch cache, then the real pool)."""
        cache = self.decoder_layers()[0].self_attn.attn.k_cache
        return (0,) if cache is None else (cache.data_ptr(), *cache.shape)

    def forward(self, x, positions, meta, residual=None):
        if self.cpu_decode is None:
            return self._layers(x, positions, meta, residual)
        # The fused C step adds the adapters itself (each row's slot), where it can read their slots.
        lora = self.lora if self.lora is not None and self.lora.active else None
        step = self.cpu_decode
        if step is not None and lora is not None and not step.reads_lora():
            step = None
        slots = None if lora is None else lora.slots
        if step is not None and step.applies(x, meta):
            return self._fused(step, x, positions, meta, residual, slots)
        if step is not None and step.applies_to_decodes_of(meta):
            # A step with prefill chunks: its decodes (the first rows) through the C step, the
            # chunks through torch. They are other sequences, so nothing changes but the time
            # the decoding streams wait while a new prompt is prefilled.
            n = meta.num_decode_tokens
            decodes, prefills = split_decodes(meta)
            decoded = self._fused(step, x[:n], positions[:n], decodes, _rows(residual, slice(None, n)),
                                  None if slots is None else slots[:n])
            if lora is not None and slots is not None:
                lora.set(slots[n:].tolist(), x.device)  # the torch layers see the chunks' rows only
            return _joined(decoded, self._layers(x[n:], positions[n:], prefills, _rows(residual, slice(n, None))))
        return self._layers(x, positions, meta, residual)

    def _fused(self, step: CpuDecodeStep, x, positions, meta, residual, slots):
        """The C step over this decoder's layers. A pipeline stage (issue 49 §2) runs the step on the residual
        stream in float32: a later stage's input is the pair's sum (the stage before handed on (stream, zeros),
        which sums to the stream exactly), a stage before the last hands on (stream, zeros) in float32 (the
        transport carries at least float32 on CPU: engine/model_runner.py), and the last stage's output is
        rounded to the model's dtype as a whole model's is. So a stage boundary changes no bit of a row."""
        if not self.staged:
            return step(x, positions, meta, slots)
        stream = step(x.float() if residual is None else x.float() + residual.float(), positions, meta, slots)
        if self.norm is None:
            return stream, torch.zeros_like(stream)
        return stream.to(self.norm.weight.dtype)  # the model's dtype

    def _layers(self, x, positions, meta, residual=None):
        if residual is not None:  # a later stage's pair, in float32 on CPU whatever the model's dtype
            dtype = self.decoder_layers()[0].input_layernorm.weight.dtype
            x, residual = x.to(dtype), residual.to(dtype)
        rope = self.rotary.lookup(positions, x.device)
        for layer in self.layers:
            x, residual = layer(rope, x, residual, meta)
        if self.norm is None:  # a pipeline stage before the last: the next one continues from here
            return x, residual
        x, _ = self.norm(x, residual)
        return x


def _rows(residual: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return None if residual is None else residual[rows]


def _joined(first, second):
    """Two parts of a step's rows in order: hidden states, or a stage's (hidden, residual) pairs (in float32:
    the C step's part is float32, torch's the model's dtype, and the transport carries float32 on CPU)."""
    if isinstance(first, tuple):
        return tuple(torch.cat([a.float(), b.float()]) for a, b in zip(first, second))
    return torch.cat([first, second])


class DecoderForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel = TensorParallel(),
                 kernels: KernelBackend | None = None):
        super().__init__()
        kernels = kernels or torch_kernels()
        self.config, self.tp, self.kernels = config, tp, kernels
        stage = tp.stage
        self.layer_range = stage.layers(config.num_layers)  # the global indices of the layers held here
        # The shapes this rank holds: its share of the heads and widths, its stage's layers.
        self.local_config = replace(local_config(config, tp.size), num_layers=len(self.layer_range))
        self.model = DecoderModel(self.local_config, tp, kernels, self.layer_range)
        # The head on the last stage; on the first too when tied, as the embedding.
        holds_head = stage.is_last or (stage.is_first and config.tie_word_embeddings)
        self.lm_head = VocabHead(config.hidden_size, config.vocab_size, tp, kernels.cpu_decode_rows,
                                 kernels.batch_invariant, kernels.cpu_rows_alone) if holds_head else None

    def forward(self, input_ids, positions, meta: AttentionMetadata, intermediate=None):
        """Final hidden states; under pipeline parallelism, a stage before the last returns (hidden,
        residual) and a stage after the first starts from `intermediate`, the previous stage's pair."""
        if intermediate is not None:
            return self.model(intermediate[0], positions, meta, intermediate[1])
        embed = self._head().embed if self.model.embed_tokens is None else self.model.embed_tokens
        x = embed(input_ids)
        if self.config.embedding_scale is not None:
            # Gemma: the scale is a float32 constant rounded to the model's dtype, as in HF.
            x = x * torch.tensor(self.config.embedding_scale, dtype=torch.float32).to(x.dtype)
        return self.model(x, positions, meta)

    def _head(self) -> VocabHead:
        assert self.lm_head is not None, "this pipeline stage holds no head"
        return self.lm_head

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._head()(hidden).float()
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.decoder_layers()]

    def check_kernels(self) -> None:
        """Raise ValueError if a loaded (and quantized) weight has no kernel in the backend the
        model was built with: the fused CPU step reads float32, int8 and int4 (Q4_1) projections."""
        if self.model.cpu_decode is not None:
            self.model.cpu_decode.check()
        if self.lm_head is not None and self.lm_head.cpu_logits_rows:
            self.lm_head.cpu_weights()

    def hold_kernel_layouts(self) -> int:
        """The quantized weights the fused CPU step reads (its projections, an int8 head) held once, in its layout
        (quant/kernel_layout.py); how many linears do. An engine calls it once its model is loaded and checked."""
        held = 0 if self.model.cpu_decode is None else self.model.cpu_decode.hold_weights()
        return held + int(self.lm_head is not None and self.lm_head.hold_kernel_layout())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     deferred: checkpoint_names.Deferred | None = None) -> None:
        """Copy HF-named tensors in, each cut to this rank's shard as it streams by (so no rank
        ever holds the whole model), fusing q/k/v, gate/up and the experts; fails loudly on anything missing.
        `deferred`: linears quantized as their weights arrive (quant/on_load.py)."""
        checkpoint_names.load(self, self.stage_weights(weights), deferred)

    def stage_weights(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """The checkpoint's tensors (or a GGUF's own blocks, by module name) this pipeline stage holds, its
        layers renumbered from 0."""
        stage, span = self.tp.stage, self.layer_range
        if stage.size == 1:
            yield from weights
            return
        tied = self.config.tie_word_embeddings
        for name, tensor in weights:
            found = _LAYER.match(name)
            if found is not None:
                layer = int(found.group(1))
                if layer in span:
                    yield f"model.layers.{layer - span.start}.{name[found.end():]}", tensor
            elif name.startswith("model.embed_tokens."):
                if stage.is_first or (tied and stage.is_last):
                    yield name, tensor
            elif name.startswith(("lm_head.", "model.norm.")):
                if stage.is_last:
                    yield name, tensor
            else:
                yield name, tensor

    def fuse_rows(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Stack HF-named per-output-row tensors the way load_weights fuses weights: q|k|v and
        gate|up along dim 0, keyed by parameter name. A fused group missing a part is left out."""
        return checkpoint_names.fuse_rows(tensors)
