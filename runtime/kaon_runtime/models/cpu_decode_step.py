"""Every step of a plain Llama-family decoder on CPU, through the fused C step.

Steps whose every token is a decode (one new token per sequence) run all layers in one call
of kernels/cpu_decode.c. A prefill chunk's (or a draft's) tokens go through the same call, each
token a row of its own that attends to the cache up to itself (as_decode_rows): its key and value
are written before any row attends, so the rows of a chunk see each other as a prompt's tokens do.

Why prefills too (batch invariance, issue 49): every kernel of the C step computes a row alone,
in one summation order whatever the number of rows, the thread count or the tile (cpu_decode.c),
so a token's numbers do not depend on how many tokens share its step. Prefill chunks through
torch's GEMMs would not hold that: their kernels switch paths and blocking with the row count,
and so the same prompt gave other answers at near-ties when its prefix was cached, its prefill
chunked, or its neighbours in the batch changed. Wide steps run in pieces (piece_rows), in
order (a piece's rows see the keys the earlier pieces wrote). KAON_CPU_PREFILL=torch sends the
chunks back to torch (faster prefill on long prompts, answers no longer invariant). int8/int4 prompt
rows take the C step too, at the activation passes their decode rows take (one int8 pass per block
by default): so every precision's answers are invariant, at the price of prompt rows rounded as decode
rows are (see prefills_take_the_c_step).

The model's dtype: float32, or float16 / bfloat16, whose float weights the kernels read as stored
(widened in registers), and their int8/int4 weights as at float32; the activations are float32 inside
the step. The fused step covers what Llama, SmolLM2, Mistral, Qwen2, Qwen3, Phi-3 and Gemma 2 need (full
or sliding-window attention, SwiGLU or GeGLU, RMSNorm plain or with Gemma's offset, Gemma 2's sandwich norms
and attention soft-cap, biases, Qwen3's per-head q/k norms, partial rotary), and Mixtral's and Qwen3-MoE's
mixture-of-experts layers (FusedExperts: each row routed alone in float32, its chosen experts through the
same projection kernels, float stacks read in place or a quantized checkpoint's per-expert linears;
cpu_decode.c experts_mlp), their dense layers as dense; whole, a pipeline stage's layers or a tensor-parallel
rank's shard (below). What it cannot run: `unsupported`, `blocker`. Gemma's embedding scale and final logit
soft-cap are computed outside the layers, row by row (models/decoder.py), so they are invariant as they are.

Pipeline stages (issue 49 §2): each stage's step runs the layers its decoder holds (their windows by their
global index) and the final norm on the last stage only (FusedWeights.final_norm None before it: the C step
then hands back the residual stream). The stages hand on (stream, zeros) in float32 (models/decoder.py,
DecoderModel._fused), so a stage boundary rounds nothing and PP=N computes every row as PP=1 does.

The step reads the decoder through a declared interface (FusedDecoder): the decoder exports
its projections, norms, caches and rotary tables as FusedWeights, and the step turns them
into the C structs.

Tensor parallelism: each rank's step runs its shard (local_config: its heads, KV heads and MLP width; its
weights and KV pool). o's and down's outputs are then partial sums; the C step calls back (Model.sum_ranks,
rank_sum) at those two points of every layer, before anything reads them (the residual add, Gemma 2's post
norms), and the rank sums them over the ranks in rank order (TensorParallel.sum_in_rank_order: gloo's
all-reduce order moves with the step's size from three ranks on), so a row's numbers still do not depend on the
rows beside it. Row-parallel projections carry no bias in any family (decoder.py); a LoRA adapter's
row-parallel share (distributed/lora_sharding.py) joins the partial sum before it is summed, as in torch's path.

LoRA: a projection wrapped in a LoraLinear (models.lora_targets) hands the C step its base
weights and its slots (A and B in the model's dtype, float32, float16 or bfloat16, and each slot's
ranks), which it reads in place (half slots widened in registers as they are loaded, as half weights
are), so adapters loaded later are seen; the step takes each row's slot (LoraBatch.slots, -1 for the
base) and adds the adapters' terms after each projection, any mix of adapters in one call, each row in
its own sums (a half model's step with adapters is the float32 step on the same values, bit for bit).

What the step reads of the decoder, and how each part becomes a C struct: models/fused_weights.py.
Over 300 lines for a stated reason: about 50 of them are this docstring (what the step covers, and why); the
rest is the policy (which steps take it, what blocks it) beside the one class that builds and runs it.
"""
from __future__ import annotations

import ctypes
import os
import weakref
from dataclasses import replace
from typing import Any

import torch

from kaon_runtime.config import ModelConfig
from kaon_runtime.distributed.parallel import TensorParallel
from kaon_runtime.distributed.sharding import local_config
from kaon_runtime.kernels import cpu_decode
from kaon_runtime.layers.attention import AttentionMetadata, as_decode_rows
from kaon_runtime.models.fused_weights import (
    FusedDecoder,
    expert_linears,
    experts_struct,
    hold_kernel_layout,
    linear_weights,
    lora_slots,
    norm_copy,
)


def prefills_take_the_c_step() -> bool:
    """KAON_CPU_PREFILL: fused (the default: invariant answers) or torch (the chunks through torch's GEMMs).

    Fused for every weight the C step reads, float32/float16/bfloat16 and int8/int4 alike (issue 49 §2:
    the same request gets the same answer in every precision). int8/int4 prompt rows then take the
    kernels their decode rows take, at the same activation passes (KAON_CPU_ACTIVATIONS: one int8 pass
    per block of 32 by default, llama.cpp's trade; int8x2 two), so a token's numbers do not depend on
    whether it was computed in a prompt chunk or a decode step: nothing decode does changes. Torch's
    prefill (bfloat16 activations, torch's int4/int8 CPU kernels) is nearer the weights' exact
    arithmetic than one int8 pass (the bundled model's final hidden states ~1.9% off it against ~4.2%;
    bench/prefill_precision.py), which tips the bundled model's 0.08-nat near tie on "What is the
    capital of France?"; docs/serving.md gives the default's measured deviation per format, and
    KAON_CPU_PREFILL=torch keeps torch's prefill (answers not invariant)."""
    choice = os.environ.get("KAON_CPU_PREFILL", "fused")
    if choice not in ("fused", "torch"):
        raise ValueError(f"KAON_CPU_PREFILL must be fused or torch, got {choice!r}")
    return choice == "fused"


# A wide step (a prompt chunk) runs in pieces of up to PIECE_ROWS rows: every piece reads all the weights
# again and crosses each layer's thread barriers, so fewer pieces cost less (a 504-token int4 prompt with two
# activation passes, load ~11: 256-row pieces 6-8% less CPU time than 64-row ones). The attention scores'
# room grows with a piece's rows x heads x context, so pieces shrink where that would pass PIECE_SCORES_BYTES,
# to no fewer than max_rows rows (the pieces before). A row's numbers do not depend on its piece (the
# module's docstring), so this is a speed and memory choice only.
PIECE_ROWS = 256
PIECE_SCORES_BYTES = 64 << 20


def piece_rows(max_rows: int, most: int, heads: int, context: int) -> int:
    """Rows per piece of a wide step: up to `most`, fewer where rows x heads x context float32 scores would
    pass PIECE_SCORES_BYTES, and never fewer than min(most, max_rows)."""
    fits = PIECE_SCORES_BYTES // (4 * max(1, heads * context))
    return max(min(most, max_rows), min(most, fits))


def split_decodes(meta: AttentionMetadata) -> tuple[AttentionMetadata, AttentionMetadata]:
    """A mixed step's metadata as two: its decodes (the first rows) and its prefill chunks, whose
    rows then start at 0."""
    n = meta.num_decode_tokens
    decodes = AttentionMetadata(slot_mapping=meta.slot_mapping[:n], num_decode_tokens=n,
                                decode_block_tables=meta.decode_block_tables,
                                decode_context_lens=meta.decode_context_lens)
    prefills = AttentionMetadata(slot_mapping=meta.slot_mapping[n:],
                                 prefills=[replace(c, query_start=c.query_start - n) for c in meta.prefills])
    return decodes, prefills


# Quantization methods whose projections the C kernels read (fp8: per channel or per tensor, its weight-only
# arithmetic, FP8 dynamic's per-token inputs or static FP8 inputs; block-scaled, weight-only or with static FP8
# inputs. Checkpoints the step does not read (e.g. GPTQ act-order) say their description, not "fp8": see
# engine/model_loader._weights_quantization and compressed_tensors.scheme).
READABLE_QUANTIZATIONS = ("none", "int8", "int4", "fp8")
KV_DTYPES = tuple(cpu_decode.KV_FORMATS)  # the caches the C step reads: float32, float16, bfloat16
# The model dtypes whose steps it takes: the activations are float32 inside, the float weights are
# read in their own dtype (cpu_decode.c), the hidden state comes back in the model's dtype.
DTYPES = tuple(cpu_decode.FLOAT_KINDS)


def blocker(config: ModelConfig, tp_size: int = 1, quantization: str = "none") -> str | None:
    """Why the fused step cannot run this model on this many ranks under this quantization (the
    model's options as one rank holds them, or no C compiler), or None when it can."""
    reason = unsupported(config, quantization) or (unsupported_shard(config, tp_size, quantization) if tp_size > 1
                                                   else None)
    if reason is None and quantization not in READABLE_QUANTIZATIONS:
        reason = f"{quantization} weights"
    if reason is None and cpu_decode.library() is None:
        reason = "the C step could not be built (see the warning above)"
    return reason


def any_width(quantization: str) -> bool:
    """Whether the step reads this quantization's projections at any width. Float weights (quantization "none":
    float32, float16, bfloat16) do: their kernels, the norms and attention sum over the true width with scalar
    tails in one order per row (cpu_decode.c tile_f32, f32_t_outputs, dot_f32, attention_scores/values), so a
    model whose hidden or MLP width is not whole blocks of 32 (e.g. 48 / 80) stays on the invariant step instead
    of torch's GEMMs (issue 49 §2). int8 does too: kaon's int8 and group int8 (narrow kinds: activations in int8
    blocks of QBLOCK) are packed with zero columns up to whole blocks and each input row copied zero-padded to them
    (cpu_decode.padded_columns, Linear.k_in), so every sum is the true width's; W8A8 int8 (INT8_A8, INT8_S8) and
    int8's reference kind (REF_INT8) sum over any K with tails. fp8 too: its kinds (FP8, FP8_A8, FP8_STATIC,
    FP8_BLOCK) read any K, and the vocabulary head's int8 copy is padded as int8 is. Each is tested at hidden 48 /
    MLP 80 / head_dim 12 (test_cpu_decode_oddquant.py). int4 too: kaon's quantizer pads K to whole groups of 32
    (quant/int4.py quantize_int4, the padding columns copies of the row's last weight so no group's range moves) and
    per-channel int4 checkpoints are padded as they load (checkpoint_formats/loaded.py), their inputs zero-padded
    (Linear.k_in, and Int4Linear's torch path); int4 checkpoints in other groups divide K, which REF_Q4 reads as it
    is, and are otherwise not cpu_fused. Still refused: odd expert widths and tensor-parallel shards (unsupported)."""
    return quantization in ("none", "int8", "fp8", "int4")


def unsupported(config: ModelConfig, quantization: str = "none") -> str | None:
    """Why the fused step cannot run this model with these weights (see any_width), or None when it can. The experts'
    width as the dense ones (experts_mlp runs each expert's projections through kaon_linear: test_cpu_decode_oddquant's
    mixture-of-experts tests)."""
    dense_widths = config.hidden_size % cpu_decode.QBLOCK or config.intermediate_size % cpu_decode.QBLOCK
    # o's input (the heads' width) too where weights may take kinds that need whole blocks: without it the
    # blocker passed e.g. int4 at head_dim 20 x 4 heads = 80 and the step's packing raised at load (_check_blocks)
    heads_width = (config.num_heads * config.head_dim) % cpu_decode.QBLOCK and not any_width(quantization)
    experts_width = config.moe_intermediate_size % cpu_decode.QBLOCK  # (experts_mlp: kaon_linear per expert)
    reasons = [
        (config.hidden_act not in cpu_decode.ACTIVATIONS_C, f"the {config.hidden_act} activation"),
        (((dense_widths or experts_width) and not any_width(quantization)) or heads_width,
         f"widths that are not multiples of {cpu_decode.QBLOCK}"),
    ]
    found = [reason for applies, reason in reasons if applies]
    return ", ".join(found) or None


def unsupported_shard(config: ModelConfig, tp_size: int, quantization: str = "none") -> str | None:
    """Why the fused step cannot run one tensor-parallel rank's shard, or None. A rank's shard at any width under every
    quantization any_width reads (float, int8, int4, fp8): each rank's projections are those kinds at its widths (a
    row-parallel input of 40 or 24 packed or padded as a model's own odd widths are), and the rank-order sum does not
    depend on them. tests/integration/test_tensor_parallel_step.py: float and int8 / int4 / fp8 shards of a model
    whose rank widths are MLP 40 and heads 24 (the ranks alike, prompt rows alone = chunked = beside decodes, bit for
    bit). A kind that needs whole blocks would still need the rank's row-parallel inputs (its MLP width, its heads'
    width, its experts' width) in them."""
    if any_width(quantization):
        return None
    local = local_config(config, tp_size)
    widths = {"MLP width": local.intermediate_size, "heads' width": local.num_heads * local.head_dim,
              "experts' width": local.moe_intermediate_size}
    found = [f"{name} {width}" for name, width in widths.items() if width % cpu_decode.QBLOCK]
    return f"a rank's {' and '.join(found)} at tensor_parallel_size {tp_size} (not a multiple of " \
           f"{cpu_decode.QBLOCK})" if found else None


def rank_sum(tp: TensorParallel, failures: list[BaseException]) -> Any:
    """The C step's sum_ranks callback (cpu_decode.SUM_RANKS): the rows' partial sums of o or down, read in
    place from the step's workspace, summed over the ranks in rank order (TensorParallel.sum_in_rank_order:
    a row's sum does not depend on the rows beside it). An error is kept in `failures` (ctypes cannot pass it
    through C) and the step stops; the caller raises it."""
    # The tensor over the last buffer: a step's calls (two a layer) share one, and so do the steps whose
    # workspace comes back at the same address (a ctypes array type and a tensor a call cost ~20 us).
    view: list[Any] = [None, None]

    def sum_ranks(address: int, count: int) -> int:
        if failures:
            return 1
        try:
            if view[0] != (address, count):
                array = (ctypes.c_float * count).from_address(address)
                view[:] = [(address, count), torch.frombuffer(array, dtype=torch.float32)]
            tp.sum_in_rank_order(view[1])
        except BaseException as exc:  # noqa: BLE001 -- raised again by CpuDecodeStep.__call__ once C returns
            failures.append(exc)
            return 1
        return 0
    return cpu_decode.SUM_RANKS(sum_ranks)


class CpuDecodeStep:
    """Holds the C structs that point at the decoder's weights and KV pool (built on first use:
    the pool is attached after the model is made, and built again when it changes)."""

    def __init__(self, decoder: FusedDecoder, config: ModelConfig, max_rows: int, tp: TensorParallel | None = None):
        # The decoder holds this step: a weak reference back, so that dropping the model frees it (and the
        # KV pool its attention layers point at) at once rather than when Python's cycle collector runs.
        self._decoder = weakref.ref(decoder)
        self.config = config  # one rank's shapes under tensor parallelism (local_config)
        self.tp = tp if tp is not None and tp.size > 1 else None  # o's and down's outputs summed over its ranks
        self._failures: list[BaseException] = []  # a collective's error inside the C step (rank_sum)
        self.max_rows = max_rows  # decode-only steps up to this many rows (wider ones go to torch, see applies)
        self.piece_rows = PIECE_ROWS  # wider steps' pieces: at most this many rows (see piece_rows)
        self.prefills = prefills_take_the_c_step()  # read again by check(), once the weights are in
        # KAON_CPU_ACTIVATIONS as the engine was built: its structs get it, whenever they are (re)built
        self.activation_passes = cpu_decode.activation_passes()
        self._built: tuple[tuple[int, ...], cpu_decode.Model, list] | None = None
        self._reads_lora = False

    @property
    def decoder(self) -> FusedDecoder:
        decoder = self._decoder()
        assert decoder is not None, "the decoder this step belongs to is gone"
        return decoder

    def check(self) -> None:
        """Raise ValueError if a projection has no fused kernel (call once the weights are loaded)."""
        for layer in self.decoder.fused_weights().layers:
            for module in (layer.qkv, layer.o, layer.gate_up, layer.down):
                if module is not None:
                    linear_weights(module)
            if layer.experts is not None:
                expert_linears(layer.experts.gate_up)
                expert_linears(layer.experts.down)
        self.prefills = prefills_take_the_c_step()
        self.activation_passes = cpu_decode.activation_passes()

    def hold_weights(self) -> int:
        """Each quantized projection the step reads keeps its weight only in the step's layout (quant/kernel_layout.py:
        before, the step's interleaved copy sat beside the module's own); how many do now. Called by an engine
        once its model is loaded and checked."""
        held = 0
        for layer in self.decoder.fused_weights().layers:
            modules = [m for m in (layer.qkv, layer.o, layer.gate_up, layer.down) if m is not None]
            if layer.experts is not None:
                modules += [m for stack in (layer.experts.gate_up, layer.experts.down)
                            if not isinstance(stack, torch.Tensor) for m in stack]
            held += sum(hold_kernel_layout(m) for m in modules)
        self._built = None  # (any struct made before points at the layouts dropped)
        return held

    def _model(self) -> cpu_decode.Model:
        address = self.decoder.kv_cache_address()
        if self._built is not None and self._built[0] == address:
            return self._built[1]
        c, weights = self.config, self.decoder.fused_weights()
        keep: list[object] = []  # what the structs point into, alive as long as they are
        reads_lora = True
        layers = weights.layers
        structs = (cpu_decode.Layer * len(layers))()
        for i, layer in enumerate(layers):
            projections = (layer.qkv, layer.o, layer.gate_up, layer.down)
            linears = [cpu_decode.LinearWeights(cpu_decode.Linear()) if m is None else linear_weights(m)
                       for m in projections]  # (an MoE layer's dense MLP: an empty struct, never read)
            if self.tp is not None and (linears[1].struct.bias or linears[3].struct.bias):
                # The torch path sums o's and down's outputs with no bias (decoder.py builds them bias=False in
                # every family), so none is added after the sum; a bias here would be summed tp.size times.
                raise ValueError("a row-parallel projection (o, down) with a bias under tensor parallelism")
            found = [(cpu_decode.Lora(), []) if m is None else lora_slots(m) for m in projections]
            loras = [slots or (cpu_decode.Lora(), []) for slots in found]
            reads_lora = reads_lora and None not in found
            # The layer's norms in the Layer struct's order: input, post-attention, q, k, pre- and post-feedforward
            norms = [None if n is None else norm_copy(n, c)
                     for n in (layer.input_norm, layer.post_attention_norm, layer.q_norm, layer.k_norm,
                               layer.pre_feedforward_norm, layer.post_feedforward_norm)]
            pointers = [None if n is None else n.data_ptr() for n in norms]
            keep += [*linears, *norms, *(tensors for _, tensors in loras)]
            assert layer.k_cache is not None and layer.v_cache is not None, "the KV pool is not attached"
            structs[i] = cpu_decode.Layer(*(w.struct for w in linears), *pointers[:2],
                                          layer.k_cache.data_ptr(), layer.v_cache.data_ptr(),
                                          (cpu_decode.Lora * 4)(*(struct for struct, _ in loras)), layer.window or 0,
                                          *pointers[2:])
            if layer.experts is not None:
                experts, kept = experts_struct(layer.experts, self.activation_passes)
                structs[i].experts = ctypes.addressof(experts)
                keep += [experts, *kept]
            for name in ("qkv", "o", "gate_up", "down"):  # (copies of the structs: shared weights keep theirs)
                linear = getattr(structs[i], name)
                if linear.kind not in cpu_decode.UNQUANTIZED_INPUTS:
                    linear.act_passes = self.activation_passes
        final_norm = None if weights.final_norm is None else norm_copy(weights.final_norm, c)
        keep += [structs, weights.cos, weights.sin, final_norm]
        first_cache = layers[0].k_cache
        assert first_cache is not None
        kv_heads, num_blocks, block_size, _ = first_cache.shape
        if block_size & (block_size - 1):
            raise ValueError(f"the fused step needs a power-of-two block size, got {block_size}")
        if first_cache.dtype not in KV_DTYPES:
            raise ValueError(f"the fused step reads a float32, float16 or bfloat16 KV cache, not {first_cache.dtype}")
        rotary_dim = c.rotary_dim or c.head_dim  # Phi-3's partial rotary: the tables cover the rotated dims only
        if weights.cos.shape[-1] * 2 != rotary_dim:
            raise ValueError(f"rotary tables of {weights.cos.shape[-1]} pairs for {rotary_dim} rotated dims")
        sum_ranks = None if self.tp is None else rank_sum(self.tp, self._failures)  # (kept: C calls it)
        keep.append(sum_ranks)
        model = cpu_decode.Model(
            num_layers=len(layers), hidden=c.hidden_size, num_heads=c.num_heads, num_kv_heads=kv_heads,
            head_dim=c.head_dim, intermediate=c.intermediate_size, block_size=block_size, num_blocks=num_blocks,
            kv_half=cpu_decode.KV_FORMATS[first_cache.dtype],
            eps=c.rms_norm_eps, scale=layers[0].scale, final_norm=None if final_norm is None else final_norm.data_ptr(),
            cos=weights.cos.data_ptr(), sin=weights.sin.data_ptr(),
            layers=ctypes.cast(structs, ctypes.POINTER(cpu_decode.Layer)), rotary_dim=rotary_dim,
            act=cpu_decode.ACTIVATIONS_C[c.hidden_act], softcap=c.attn_softcap or 0.0)
        if sum_ranks is not None:
            model.sum_ranks = sum_ranks
        self._built, self._reads_lora = (address, model, keep), reads_lora
        return model

    def reads_lora(self) -> bool:
        """Whether the step can add the adapters (their slots are float32, float16 or bfloat16 on CPU), else
        their steps take torch."""
        self._model()
        return self._reads_lora

    def applies(self, x: torch.Tensor, meta: AttentionMetadata) -> bool:
        """The whole step: always with prefills on (see the module's docstring), else decode-only steps."""
        if self.prefills:
            return x.shape[0] > 0
        return not meta.prefills and self.max_rows >= meta.num_decode_tokens == x.shape[0] > 0

    def applies_to_decodes_of(self, meta: AttentionMetadata) -> bool:
        """KAON_CPU_PREFILL=torch: a mixed step whose decodes the C step can take on their own (see split_decodes)."""
        return not self.prefills and bool(meta.prefills) and 0 < meta.num_decode_tokens <= self.max_rows

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 lora_slots: torch.Tensor | None = None) -> torch.Tensor:
        """The decode step; lora_slots [rows]: each row's adapter slot, -1 for the base (None: no adapters)."""
        hidden = x.float().clone(memory_format=torch.contiguous_format)  # written in place by the C step
        if meta.prefills:
            tables, lens = as_decode_rows(meta)
        else:
            tables, lens = meta.decodes()
        model, slots, positions = self._model(), meta.slot_mapping.contiguous(), positions.contiguous()
        rows, block_size = hidden.shape[0], model.block_size
        size = piece_rows(self.max_rows, self.piece_rows, model.num_heads, int(lens.max()) if rows else 0)
        for start in range(0, rows, size):  # in order: a chunk's later rows read its earlier rows' keys
            piece = slice(start, min(start + size, rows))
            piece_lens = lens[piece].contiguous()
            blocks = -(-int(piece_lens.max()) // block_size)  # the attention scores' room goes by the widest
            cpu_decode.decode(model, hidden[piece], positions[piece], slots[piece],
                              tables[piece, :blocks].contiguous(), piece_lens,
                              None if lora_slots is None else lora_slots[piece])
            if self._failures:  # a collective failed inside the step (rank_sum): its error, once
                failure, self._failures[:] = self._failures[0], []
                raise failure
        return hidden.to(x.dtype)
