"""The fused CPU decode step (cpu_decode.c): built on first use, called through ctypes.

Built with the system C compiler for this CPU (-march=native) into a cache outside the
package (`cache_dir()`), keyed by the source, the flags
and the CPU, so a cache shared by different machines never hands one a binary it cannot run.
The build takes a couple of seconds; where there is no compiler, or KAON_CPU_DECODE=off, the
caller keeps its torch path (`library()` returns None and says why once).

ctypes, not a torch extension: the step is one call with raw pointers, so nothing here needs
torch's C++ headers (a torch extension takes about a minute to compile and needs ninja).

Over 300 lines for a stated reason: the ctypes mirror of the C step's structs and every weight
kind's packing must match cpu_decode.c field for field, so they stay in one module beside it.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_decode.c")
FLAGS = ["-O3", "-march=native", "-pthread", "-shared", "-fPIC", "-std=c11"]
QBLOCK = 32  # activations are quantized in blocks of this many for the narrow weights
LANES = 8  # the narrow kernels compute eight output channels at once, their weights interleaved
KIND_F32, KIND_INT8, KIND_Q4_1, KIND_F32_T, KIND_Q4_F32, KIND_Q8_G16 = 0, 1, 2, 3, 4, 5
KIND_Q5, KIND_Q5_F32, KIND_Q6_G16 = 6, 7, 8
KIND_F16, KIND_BF16, KIND_F16_T, KIND_BF16_T = 9, 10, 11, 12
KIND_FP8, KIND_FP8_A8 = 13, 14  # float8 e4m3 [N, K], a scale per output; A8: input rows rounded to FP8 per token
# float8 e4m3 [N, K] with a scale per block (quant/fp8_block.py); FP8's weights with inputs rounded to FP8 at a fixed
# input scale (compressed-tensors' static input_activations, quant/static_inputs.py)
KIND_FP8_BLOCK, KIND_FP8_STATIC = 15, 16
KIND_INT8_A8 = 17  # int8 [N, K], a scale per output, input rows quantized to int8 per token (W8A8 int8, dynamic)
KIND_INT8_S8 = 18  # the same weights, inputs rounded to a static per-tensor int8 grid (W8A8 int8, static)
# The reference mode of weight-only checkpoints (--dtype float32, quant/reference.py): float32 activations times each
# weight dequantized as quant_gemm_ref does it. int8 [N, K] with a scale per output (read in place); kaon's int4
# layout, any even group, float32 scales and mins (read in place); Q8_G16's interleaved copy (GroupInt8Linear's);
# int8 [N, K] with float32 scales (and mins) per group of any size dividing K (read in place: 8-bit groups that are
# not a multiple of 16, which Q8_G16 cannot hold).
KIND_REF_INT8, KIND_REF_Q4, KIND_REF_Q8_G16, KIND_REF_Q8_G = 19, 20, 21, 22
REFERENCE_KINDS = frozenset({KIND_REF_INT8, KIND_REF_Q4, KIND_REF_Q8_G16, KIND_REF_Q8_G})
# Float weights read as stored (widened to float32 in registers, cpu_decode.c): kind by dtype, [N, K] and [K, N].
FLOAT_KINDS = {torch.float32: (KIND_F32, KIND_F32_T), torch.float16: (KIND_F16, KIND_F16_T),
               torch.bfloat16: (KIND_BF16, KIND_BF16_T)}
FLOAT_KIND_SET = frozenset(kind for pair in FLOAT_KINDS.values() for kind in pair)
# Kinds whose activations stay float32 (no int8 blocks: act_passes means nothing to them)
UNQUANTIZED_INPUTS = FLOAT_KIND_SET | REFERENCE_KINDS | {KIND_FP8, KIND_FP8_A8, KIND_FP8_BLOCK, KIND_FP8_STATIC,
                                                          KIND_INT8_A8, KIND_INT8_S8}
KV_FORMATS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # Model.kv_half: the cache's format
G16 = 16  # Q8_G16's group: two per activation block
NO_COMPILER = "no C compiler on this machine: the fused CPU decode step and its tests are off (install gcc or set CC)"


class Linear(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int32), ("n", ctypes.c_int32), ("k", ctypes.c_int32),
                ("w", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("d", ctypes.c_void_p),
                ("m", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("gscales", ctypes.c_void_p),
                ("gmins", ctypes.c_void_p), ("high", ctypes.c_void_p), ("act_passes", ctypes.c_int32),
                ("block_rows", ctypes.c_int32), ("block_cols", ctypes.c_int32), ("input_scale", ctypes.c_float),
                ("perm", ctypes.c_void_p),  # REF_Q4 / REF_Q8_G16: act-order's int64 column order, or None
                # the inputs' true width where the weights were packed with zero columns to whole blocks of QBLOCK
                # (k then that padded width; kaon_linear copies each row zero-padded to it); 0: k (padded_columns)
                ("k_in", ctypes.c_int32)]


# How the narrow kernels quantize activations (KAON_CPU_ACTIVATIONS): "int8", one int8 pass per block
# of 32 (llama.cpp's Q8 trade: ~7 bits; the int4 model's hidden states ~4% off its exact arithmetic,
# bench/prefill_precision.py), or "int8x2", two (the block, then its rounding remainder: ~15 bits,
# ~0.02% off; twice the integer dot products, which batched decode pays: bench/cpu_decode.py
# --activations). See quantize_passes in cpu_decode.c. Prompt rows take the same passes as decode rows
# (models/cpu_decode_step.prefills_take_the_c_step: invariant answers under either setting).
ACTIVATIONS = {"int8": 1, "int8x2": 2}
DEFAULT_ACTIVATIONS = "int8"


def activation_passes() -> int:
    """The int8 passes per activation block that narrow weights made now get (KAON_CPU_ACTIVATIONS)."""
    choice = os.environ.get("KAON_CPU_ACTIVATIONS", DEFAULT_ACTIVATIONS)
    if choice not in ACTIVATIONS:
        raise ValueError(f"KAON_CPU_ACTIVATIONS must be one of {', '.join(ACTIVATIONS)}, got {choice!r}")
    return ACTIVATIONS[choice]


LORA_PARTS = 3  # the most parts a fused projection has (q|k|v)


class Lora(ctypes.Structure):
    """A projection's LoRA slots (layers.lora.LoraLinear's a, b and ranks); all zero: none. fmt: the slots'
    dtype as KV_FORMATS numbers it (float32, float16, bfloat16: widened in registers as they are read)."""

    _fields_ = [("a", ctypes.c_void_p), ("b", ctypes.c_void_p), ("ranks", ctypes.c_void_p),
                ("parts", ctypes.c_int32), ("rank", ctypes.c_int32), ("sizes", ctypes.c_int32 * LORA_PARTS),
                ("fmt", ctypes.c_int32)]


class Layer(ctypes.Structure):
    _fields_ = [("qkv", Linear), ("o", Linear), ("gate_up", Linear), ("down", Linear),
                ("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
                ("lora", Lora * 4),  # qkv, o, gate_up, down
                ("window", ctypes.c_int32),  # the sliding window (keys a query sees, itself included); 0: all
                ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p),  # Qwen3's per-head norms; None: none
                # Gemma 2's sandwich: the MLP's input norm and its output's norm (post_norm then normalises
                # attention's output); None: none
                ("pre_ff_norm", ctypes.c_void_p), ("post_ff_norm", ctypes.c_void_p),
                ("experts", ctypes.c_void_p)]  # a pointer to Experts: a mixture-of-experts layer; None: dense


class Experts(ctypes.Structure):
    """A mixture-of-experts layer (cpu_decode.c experts_mlp): the router float32 [E, hidden] as a Linear, each
    expert's gate|up [2 width, hidden] and down [hidden, width] as arrays of Linear."""

    _fields_ = [("num_experts", ctypes.c_int32), ("top_k", ctypes.c_int32), ("renormalize", ctypes.c_int32),
                ("width", ctypes.c_int32), ("router", Linear), ("gate_up", ctypes.POINTER(Linear)),
                ("down", ctypes.POINTER(Linear))]


# Model.sum_ranks: the partial sums of o and down replaced by their sum over the tensor-parallel ranks
# (x's address, its float count); 0, or non-zero when the collective failed (the step stops).
SUM_RANKS = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int64)


class Model(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_int32) for name in ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim",
                                              "intermediate", "block_size", "num_blocks", "kv_half")),
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("final_norm", ctypes.c_void_p),
        ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p), ("layers", ctypes.POINTER(Layer)),
        ("rotary_dim", ctypes.c_int32),  # each head's leading dims that rotate (partial rotary); 0: all
        ("act", ctypes.c_int32),  # the gated MLP's activation: a value of ACTIVATIONS_C
        ("softcap", ctypes.c_float),  # attention scores become softcap * tanh(score / softcap); 0: none
        ("sum_ranks", SUM_RANKS)]  # tensor parallelism: see SUM_RANKS; None: one rank


# Model.act: the gated MLP's activations the C step computes (config.hidden_act -> ACT_ in cpu_decode.c).
ACTIVATIONS_C = {"silu": 0, "gelu_pytorch_tanh": 1}


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))
    except OSError:
        return platform.processor() or platform.machine()


def cache_dir() -> Path:
    """$KAON_KERNEL_CACHE, else kaon/kernels under $XDG_CACHE_HOME (engine pods: the cache volume) or ~/.cache."""
    if "KAON_KERNEL_CACHE" in os.environ:
        return Path(os.environ["KAON_KERNEL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kaon" / "kernels"


def compiler() -> str | None:
    """The C compiler the step is built with: $CC, else cc or gcc on PATH; None where there is none."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(compiler: str, flags: list[str] = FLAGS) -> Path:
    """The library built with these flags (the cached one if built before); RuntimeError with the
    compiler's message if it fails. Other flags than FLAGS: the tests' builds of each CPU-flag path."""
    source = SOURCE.read_bytes()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(b"\0".join([source, " ".join(flags).encode(), version.encode(),
                                     _cpu_signature().encode()])).hexdigest()[:16]
    target = cache_dir() / f"cpu_decode-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed into place: engines starting together never load half a file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run([compiler, *flags, str(SOURCE), "-o", str(built), "-lm"],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(built, target)
    return target


def load(path: Path) -> ctypes.CDLL:
    """A built library, its functions' signatures declared."""
    lib = ctypes.CDLL(str(path))
    lib.kaon_linear_workspace.restype = ctypes.c_size_t
    lib.kaon_linear_workspace.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.kaon_decode_workspace.restype = ctypes.c_size_t
    lib.kaon_decode_workspace.argtypes = [ctypes.POINTER(Model), ctypes.c_int, ctypes.c_int]
    lib.kaon_linear.restype = None
    lib.kaon_linear.argtypes = [ctypes.POINTER(Linear), ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                ctypes.c_void_p, ctypes.c_int]
    lib.kaon_decode.restype = None
    lib.kaon_decode.argtypes = [ctypes.POINTER(Model), ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    lib.kaon_pool_set_yield.restype = None
    lib.kaon_pool_set_yield.argtypes = [ctypes.c_int]
    lib.kaon_pool_yields.restype = ctypes.c_long
    lib.kaon_pool_yields.argtypes = []
    lib.kaon_set_amx.restype = ctypes.c_int
    lib.kaon_set_amx.argtypes = [ctypes.c_int]
    lib.kaon_set_halves.restype = ctypes.c_int
    lib.kaon_set_halves.argtypes = [ctypes.c_int]
    lib.kaon_widen_q4_1.restype = None
    lib.kaon_widen_q4_1.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                    ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    return lib


def set_pool_yield(lib: ctypes.CDLL, on: bool) -> None:
    """Whether the step's threads yield their core while they wait for each other past a short spin (the
    default: see wait_round in cpu_decode.c), or spin on (only bench/engine_contention.py's A/B sets it)."""
    lib.kaon_pool_set_yield(int(on))


def set_amx(lib: ctypes.CDLL, on: bool) -> bool:
    """Whether two-pass activations of many rows take the AMX tiles (on by default where the CPU and the kernel
    have them: Intel AMX-INT8) or the 512-bit pair kernels at every row count (the tests' and the bench's A/B;
    the bits are the same). Returns whether this CPU, build and kernel have the AMX path at all."""
    return bool(lib.kaon_set_amx(int(on)))


def set_halves(lib: ctypes.CDLL, on: bool) -> bool:
    """Whether batch 1's two activation passes take the half-register kernels (on by default where the build has
    the 512-bit pair kernels: AVX-512 VNNI) or the pair kernels (the tests' and the bench's A/B; the bits are the
    same). Returns whether this build has the half-register kernels at all."""
    return bool(lib.kaon_set_halves(int(on)))


def pool_yields(lib: ctypes.CDLL) -> int:
    """How many wait rounds of the step's threads have yielded their core so far (this process)."""
    return int(lib.kaon_pool_yields())


def widen_q4_1(lib: ctypes.CDLL, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int,
               dtype: torch.dtype) -> torch.Tensor:
    """kaon's int4 weight (packed uint8 [N, K / 2], float16 scales and mins [N, K / group_size]) dequantized to
    `dtype` (bfloat16 or float32) [N, K] in one pass on torch's thread count: the same bits as
    dequantize_int4(...).to(dtype) (kaon_widen_q4_1 in cpu_decode.c)."""
    assert dtype in (torch.bfloat16, torch.float32) and group_size % 2 == 0
    assert packed.dtype == torch.uint8 and scales.dtype == mins.dtype == torch.float16
    packed, scales, mins = packed.contiguous(), scales.contiguous(), mins.contiguous()
    n, k = packed.shape[0], packed.shape[1] * 2
    assert scales.shape == mins.shape == (n, k // group_size)
    out = torch.empty(n, k, dtype=dtype)
    lib.kaon_widen_q4_1(packed.data_ptr(), scales.data_ptr(), mins.data_ptr(), n, k, group_size,
                        int(dtype == torch.bfloat16), out.data_ptr(), torch.get_num_threads())
    return out


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built library, or None (logged once) where it cannot be had. An engine runs on without it
    (torch ops); the tests do not: tests/unit/runtime/kernels/test_cpu_decode.py builds it and fails
    with the compiler's message wherever there is a compiler."""
    if os.environ.get("KAON_CPU_DECODE", "on") == "off":
        return None
    cc = compiler()
    if cc is None:
        log.warning("no C compiler found: the fused CPU decode step is off (torch ops instead, slower)")
        return None
    try:
        return load(build(cc))
    except (OSError, RuntimeError) as exc:
        log.warning("the fused CPU decode step could not be built, torch ops instead: %s", exc)
        return None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _perm(perm: torch.Tensor | None, k: int) -> dict[str, torch.Tensor]:
    """act-order's column order as the reference kinds read it (int64 [K], each column once), or nothing."""
    if perm is None:
        return {}
    perm = perm.detach().to(torch.int64).contiguous()
    if perm.shape != (k,) or not torch.equal(torch.sort(perm).values, torch.arange(k)):
        raise ValueError(f"a column order must name each of the {k} input columns once")
    return {"perm": perm}


def _int8_per_output(kind: str, qweight: torch.Tensor, scales: torch.Tensor) -> tuple[int, int]:
    """int8 [N, K] weights with one scale per output, as the int8 kinds read them: their N and K, or ValueError."""
    if qweight.dtype != torch.int8 or scales.shape != (qweight.shape[0],):
        raise ValueError(f"{kind} needs int8 [N, K] and scales [N], got {qweight.dtype} and {tuple(scales.shape)}")
    n, k = qweight.shape
    return n, k


@dataclass
class LinearWeights:
    """One projection as the C code reads it; keeps its tensors alive while the struct points at them."""

    struct: Linear
    tensors: list[torch.Tensor] = field(default_factory=list)
    names: list[str] = field(default_factory=list)  # the struct's pointer field each of `tensors` fills

    @classmethod
    def _make(cls, kind: int, n: int, k: int, bias: torch.Tensor | None, **tensors) -> LinearWeights:
        kept = {name: t.detach().contiguous() for name, t in tensors.items()}
        if bias is not None:
            kept["bias"] = bias.detach().float().contiguous()
        for name, t in kept.items():
            if t.device.type != "cpu":
                raise ValueError(f"{name} is on {t.device}, not the CPU")
        struct = Linear(kind=kind, n=n, k=k, **{name: _ptr(t) for name, t in kept.items()},
                        act_passes=1 if kind in UNQUANTIZED_INPUTS else activation_passes())
        return cls(struct, list(kept.values()), list(kept))

    def with_true_width(self, k_in: int) -> LinearWeights:
        """These weights, packed with zero or padding columns past the inputs' true width k_in up to struct.k (int4's
        quantizer pads to whole groups, quant/int4.py), read from inputs k_in wide (Linear.k_in: kaon_linear copies
        each row zero-padded to k). Itself where k_in is k."""
        if not 0 < k_in <= self.struct.k:
            raise ValueError(f"an input width of {k_in} for weights {self.struct.k} wide")
        self.struct.k_in = k_in if k_in < self.struct.k else 0
        return self

    def named(self) -> dict[str, torch.Tensor]:
        """The tensors by the struct field each fills (w, scales, d, m, gscales, gmins, high, bias, perm)."""
        return dict(zip(self.names, self.tensors, strict=True))

    def stale(self) -> bool:
        """Whether a tensor's storage moved since the struct was made (see rebound)."""
        return any((getattr(self.struct, name) or 0) != t.data_ptr() for name, t in self.named().items())

    def rebound(self, bias: bool = True) -> LinearWeights:
        """The same weights, the struct pointing at its tensors' storage as it is now: a module that holds these
        tensors as its buffers may have had their storage swapped in place since (sleep level 2 writes the weights
        out and maps them back, engine/sleep.py), which the struct's raw pointers would not follow. bias=False: the
        struct without its bias (a module's matmul adds its own)."""
        struct = Linear.from_buffer_copy(self.struct)
        for name, t in self.named().items():
            setattr(struct, name, t.data_ptr())
        if not bias:
            struct.bias = None
        return LinearWeights(struct, self.tensors, self.names)

    @classmethod
    def f32(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> LinearWeights:
        """A float weight [N, K]: float32, float16 and bfloat16 are read as they are (no copy); other
        dtypes as a float32 copy."""
        n, k = weight.shape
        w = weight if weight.dtype in FLOAT_KINDS else weight.float()
        return cls._make(FLOAT_KINDS[w.dtype][0], n, k, bias, w=w)

    @classmethod
    def f32_t(cls, weight_t: torch.Tensor) -> LinearWeights:
        """A float weight stored [K, N] (the vocabulary head's layout), read as f32 reads."""
        k, n = weight_t.shape
        w = weight_t if weight_t.dtype in FLOAT_KINDS else weight_t.float()
        return cls._make(FLOAT_KINDS[w.dtype][1], n, k, None, w=w)

    @classmethod
    def fp8(cls, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
            fp8_inputs: bool = False, input_scale: float | None = None) -> LinearWeights:
        """FP8 e4m3fn [N, K] with one float32 scale per output (quant/fp8.py), read in place: each weight
        widened exactly, float32 activations (fp8_inputs: each input row rounded to FP8 per token first,
        compressed-tensors FP8 dynamic; input_scale: each rounded to FP8 at that fixed scale first, its
        static input_activations)."""
        if qweight.dtype != torch.float8_e4m3fn or scales.shape != (qweight.shape[0],):
            raise ValueError(f"fp8 needs float8_e4m3fn [N, K] and scales [N], got {qweight.dtype} and "
                             f"{tuple(scales.shape)}")
        if input_scale is not None and (fp8_inputs or not input_scale > 0):
            raise ValueError(f"a static input scale must be positive and not per token, got {input_scale}")
        n, k = qweight.shape
        if input_scale is not None:
            made = cls._make(KIND_FP8_STATIC, n, k, bias, w=qweight, scales=scales.float())
            made.struct.input_scale = input_scale
            return made
        return cls._make(KIND_FP8_A8 if fp8_inputs else KIND_FP8, n, k, bias, w=qweight,
                         scales=scales.float())

    @classmethod
    def int8_a8(cls, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
                ) -> LinearWeights:
        """W8A8 int8 (quant/dynamic_inputs.py): int8 [N, K] and one float32 scale per output, read in place;
        each input row quantized to int8 per token in C, the products summed exactly in int32."""
        n, k = _int8_per_output("int8_a8", qweight, scales)
        return cls._make(KIND_INT8_A8, n, k, bias, w=qweight, scales=scales.float())

    @classmethod
    def int8_s8(cls, qweight: torch.Tensor, scales: torch.Tensor, input_scale: float, zero_point: float = 0.0,
                bias: torch.Tensor | None = None) -> LinearWeights:
        """W8A8 int8 with a static input grid (quant/static_inputs.py): int8 [N, K], one float32 scale per
        output, read in place; each input rounded to the grid (scale, zero point) in C, integer sums."""
        n, k = _int8_per_output("int8_s8", qweight, scales)
        grid = torch.tensor([input_scale, zero_point], dtype=torch.float32)
        return cls._make(KIND_INT8_S8, n, k, bias, w=qweight, scales=scales.float(), gscales=grid)

    @classmethod
    def fp8_block(cls, qweight: torch.Tensor, scales: torch.Tensor, block: tuple[int, int],
                  bias: torch.Tensor | None = None, input_scale: float | None = None) -> LinearWeights:
        """FP8 e4m3fn [N, K] with one scale per block of block[0] x block[1] weights, scales
        [ceil(N / block[0]), ceil(K / block[1])] (quant/fp8_block.py), read in place: each weight widened
        exactly and times its block's scale in float32, as dequantize_fp8_blocks does, float32 activations
        (input_scale: each input first rounded to FP8 at that fixed scale, as fp8's static inputs are)."""
        if input_scale is not None and not input_scale > 0:
            raise ValueError(f"a static input scale must be positive, got {input_scale}")
        n, k = qweight.shape
        rows, cols = block
        if (qweight.dtype != torch.float8_e4m3fn or rows < 1 or cols < 1
                or scales.shape != (-(-n // rows), -(-k // cols))):
            raise ValueError(f"fp8_block needs float8_e4m3fn [N, K] and scales [ceil(N / {rows}), ceil(K / {cols})], "
                             f"got {qweight.dtype} {tuple(qweight.shape)} and {tuple(scales.shape)}")
        made = cls._make(KIND_FP8_BLOCK, n, k, bias, w=qweight, scales=scales.float())
        made.struct.block_rows, made.struct.block_cols = rows, cols
        made.struct.input_scale = input_scale or 0.0  # 0: weight-only (no rounding of the inputs)
        return made

    @classmethod
    def ref_int8(cls, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
                 ) -> LinearWeights:
        """The reference mode of int8 [N, K] with a float32 scale per output (quant/int8.py), read in place:
        float32 activations times the integers, the sum times the row's scale (w8a16_matmul_ref's order)."""
        n, k = _int8_per_output("ref_int8", qweight, scales)
        return cls._make(KIND_REF_INT8, n, k, bias, w=qweight, scales=scales.float())

    @classmethod
    def ref_q4(cls, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int,
               bias: torch.Tensor | None = None, perm: torch.Tensor | None = None) -> LinearWeights:
        """The reference mode of kaon's int4 layout (quant/int4.py: packed uint8 [N, K / 2], scales and mins
        [N, K / group_size], any even group), read in place: each weight q * scale + min in float32, as
        dequantize_int4 rounds it; perm: act-order's column order (quant/checkpoint_formats/loaded.py)."""
        n, k = packed.shape[0], packed.shape[1] * 2
        if (packed.dtype != torch.uint8 or group_size % 2 or k % group_size
                or scales.shape != (n, k // group_size) or mins.shape != scales.shape):
            raise ValueError(f"ref_q4 needs uint8 [N, K / 2] and scales, mins [N, K / {group_size}], got "
                             f"{packed.dtype} {tuple(packed.shape)} and {tuple(scales.shape)}")
        made = cls._make(KIND_REF_Q4, n, k, bias, w=packed, gscales=scales.float(), gmins=mins.float(),
                         **_perm(perm, k))
        made.struct.block_cols = group_size
        return made

    @classmethod
    def ref_q8_g(cls, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group_size: int,
                 bias: torch.Tensor | None = None, perm: torch.Tensor | None = None) -> LinearWeights:
        """The reference mode of group int8 in groups Q8_G16 cannot hold (quant/group_int8.py's own tensors: int8
        [N, K], float32 scales and optional mins [N, K / group_size], any group dividing K), read in place: each
        weight q * scale (+ min) in float32, as dequantize_group_int8 rounds it; perm: act-order's columns."""
        n, k = qweight.shape
        groups = k // group_size if group_size > 0 and k % group_size == 0 else -1
        if (qweight.dtype != torch.int8 or groups < 0 or scales.shape != (n, groups)
                or (mins is not None and mins.shape != scales.shape)):
            raise ValueError(f"ref_q8_g needs int8 [N, K] and scales (mins) [N, K / {group_size}], got "
                             f"{qweight.dtype} {tuple(qweight.shape)} and {tuple(scales.shape)}")
        tensors = dict(w=qweight.contiguous(), gscales=scales.float().contiguous())
        if mins is not None:
            tensors["gmins"] = mins.float().contiguous()
        made = cls._make(KIND_REF_Q8_G, n, k, bias, **tensors, **_perm(perm, k))
        made.struct.block_cols = group_size
        return made

    @classmethod
    def ref_q8_g16(cls, held: LinearWeights, perm: torch.Tensor | None = None) -> LinearWeights:
        """The reference mode of a Q8_G16 weight (quant/group_int8.py's kernel_weights), read in place: each
        weight q * scale (+ min) in float32, as dequantize_group_int8 rounds it; perm: act-order's columns."""
        if held.struct.kind != KIND_Q8_G16:
            raise ValueError(f"ref_q8_g16 reads a Q8_G16 weight, got kind {held.struct.kind}")
        struct = Linear.from_buffer_copy(held.struct)
        struct.kind = KIND_REF_Q8_G16
        if perm is not None and struct.k_in:  # packed with zero columns: they keep their places (kaon_linear pads x
            perm = torch.cat([perm.to(torch.int64), torch.arange(struct.k_in, struct.k)])  # before it gathers)
        kept = _perm(perm, struct.k)
        struct.perm = _ptr(kept.get("perm"))
        return cls(struct, [*held.tensors, *kept.values()], [*held.names, *kept])

    @classmethod
    def int8(cls, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> LinearWeights:
        """kaon's int8: int8 [N, K], one float scale per output; the C kernel reads a copy, interleaved. At a K that
        is not whole blocks of QBLOCK the copy gets zero columns up to the next block (padded_columns)."""
        n, k = qweight.shape
        qweight = padded_columns(qweight)
        kp = qweight.shape[1]
        # [groups, 8 lanes, K/4, 4] -> [groups, K/4, 8 lanes, 4]: four k of eight outputs per vector
        w = _pad_rows(qweight).reshape(-1, LANES, kp // 4, 4).transpose(1, 2)
        made = cls._make(KIND_INT8, n, kp, bias, w=w, scales=_pad_rows(scales.float()))
        made.struct.k_in = k if kp != k else 0
        return made

    @classmethod
    def q4_1(cls, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
             bias: torch.Tensor | None = None) -> LinearWeights:
        """kaon's int4 layout with groups of 32 (GGUF Q4_1's): packed uint8 [N, K/2], float16 scales and
        mins; the C kernel reads a copy, interleaved."""
        n, k, w, d, m = _q4_groups("q4_1", packed, scales, mins, torch.float16)
        return cls._make(KIND_Q4_1, n, k, bias, w=w, d=d, m=m)

    @classmethod
    def q4_f32(cls, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
               bias: torch.Tensor | None = None) -> LinearWeights:
        """q4_1's layout with float32 scales and mins (GGUF Q4_K's products, which float16 would round)."""
        n, k, w, d, m = _q4_groups("q4_f32", packed, scales, mins, torch.float32)
        return cls._make(KIND_Q4_F32, n, k, bias, w=w, gscales=d, gmins=m)

    @classmethod
    def q8_g16(cls, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
               bias: torch.Tensor | None = None) -> LinearWeights:
        """int8 [N, K] with float32 scales (and mins, or None) [N, K / 16]: w = q * scale + min. At a K of an odd
        number of groups (not whole blocks of QBLOCK) the copy gets a group of zero weights, scale and min 0
        (padded_columns; Linear.k_in the true K)."""
        n, k = qweight.shape
        if k % G16 or scales.shape != (n, k // G16) or (mins is not None and mins.shape != scales.shape):
            raise ValueError(f"q8_g16 needs groups of {G16}: scales {tuple(scales.shape)} for a {n} x {k} weight")
        qweight = padded_columns(qweight)
        kp = qweight.shape[1]
        w = _pad_rows(qweight).reshape(-1, LANES, kp // 4, 4).transpose(1, 2)
        # [groups, 8 lanes, blocks, 2 halves] -> [groups, blocks, 2 halves, 8 lanes]
        per_block = {name: _pad_rows(padded_columns(t.float(), G16)).reshape(-1, LANES, kp // QBLOCK, 2)
                     .permute(0, 2, 3, 1) for name, t in (("gscales", scales), ("gmins", mins)) if t is not None}
        made = cls._make(KIND_Q8_G16, n, kp, bias, w=w, **per_block)
        made.struct.k_in = k if kp != k else 0
        return made


    @classmethod
    def q5(cls, values: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
           bias: torch.Tensor | None = None) -> LinearWeights:
        """5-bit values uint8 [N, K] (0..31) with scales and mins [N, K / 32], float16 or float32 alike:
        w = u * scale + min, held as Q4_1's nibbles and a plane of fifth bits (cpu_decode.c, Q5)."""
        n, k = values.shape
        _check_blocks(k)
        if scales.shape != (n, k // QBLOCK) or mins.shape != scales.shape or mins.dtype != scales.dtype:
            raise ValueError(f"q5 needs groups of {QBLOCK}: scales {tuple(scales.shape)} for a {n} x {k} weight")
        blocks = k // QBLOCK
        # bit t of byte (lane, i): t < 4 the value 4t + i of a block, t >= 4 the value 16 + 4(t - 4) + i
        bits = (_pad_rows(values) >> 4).reshape(-1, LANES, blocks, 2, 4, 4)  # [g, lane, b, half, t', i]
        weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8).reshape(1, 1, 1, 2, 4, 1)
        high = (bits * weights).sum(dim=(3, 4), dtype=torch.uint8).permute(0, 2, 1, 3)  # [g, b, lane, i]
        nibbles = _interleaved_nibbles(values)
        f32 = scales.dtype == torch.float32
        d, m = (_pad_rows(t.float() if f32 else t.half()).reshape(-1, LANES, blocks).transpose(1, 2)
                for t in (scales, mins))
        named = {"gscales": d, "gmins": m} if f32 else {"d": d, "m": m}
        return cls._make(KIND_Q5_F32 if f32 else KIND_Q5, n, k, bias, w=nibbles, high=high, **named)

    @classmethod
    def q6_g16(cls, values: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> LinearWeights:
        """6-bit values uint8 [N, K] (0..63) with float32 scales [N, K / 16]: w = (u - 32) * scale
        (GGUF Q6_K), held as Q4_1's nibbles and a plane of the top two bits (cpu_decode.c, Q6_G16)."""
        n, k = values.shape
        _check_blocks(k)
        if scales.shape != (n, k // G16):
            raise ValueError(f"q6_g16 needs groups of {G16}: scales {tuple(scales.shape)} for a {n} x {k} weight")
        blocks = k // QBLOCK
        # byte (lane, i) of half h: bits 2j, 2j + 1 are the top bits of the value 16h + 4j + i of a block
        bits = (_pad_rows(values) >> 4).reshape(-1, LANES, blocks, 2, 4, 4)  # [g, lane, b, h, j, i]
        weights = torch.tensor([1, 4, 16, 64], dtype=torch.uint8).reshape(1, 1, 1, 1, 4, 1)
        high = (bits * weights).sum(dim=4, dtype=torch.uint8).permute(0, 2, 3, 1, 4)  # [g, b, h, lane, i]
        gscales = _pad_rows(scales.float()).reshape(-1, LANES, blocks, 2).permute(0, 2, 3, 1)
        return cls._make(KIND_Q6_G16, n, k, bias, w=_interleaved_nibbles(values), high=high, gscales=gscales)


def _interleaved_nibbles(values: torch.Tensor) -> torch.Tensor:
    """The low four bits of values uint8 [N, K] in Q4_1's interleaved layout (see q4_1)."""
    n, k = values.shape
    low = (values & 0x0F).reshape(n, -1, 2, 16)
    packed = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, -1)  # byte j: value j low, j + 16 high
    return _pad_rows(packed).reshape(-1, LANES, k // QBLOCK, 4, 4).permute(0, 2, 3, 1, 4)



def _q4_groups(kind: str, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, dtype: torch.dtype):
    """The int4 layout with groups of 32 that q4_1 and q4_f32 share, their scales and mins in `dtype`:
    (n, k, interleaved weights, scales, mins)."""
    n, k = packed.shape[0], packed.shape[1] * 2
    _check_blocks(k)
    if scales.shape != (n, k // QBLOCK):
        raise ValueError(f"{kind} needs groups of {QBLOCK}: scales {tuple(scales.shape)} for a {n} x {k} weight")
    blocks = k // QBLOCK
    # bytes [groups, 8 lanes, blocks, 4 t, 4] -> [groups, blocks, 4 t, 8 lanes, 4]; scales [groups, blocks, 8 lanes]
    w = _pad_rows(packed).reshape(-1, LANES, blocks, 4, 4).permute(0, 2, 3, 1, 4)
    d, m = (_pad_rows(t.to(dtype)).reshape(-1, LANES, blocks).transpose(1, 2) for t in (scales, mins))
    return n, k, w, d, m

def plain_int8(held: LinearWeights, ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """int8's interleaved copy (LinearWeights.int8) back as int8 [N, K] and float32 scales [N] (a copy), or only
    the rows `ids`: what a module holding only that copy hands torch's paths (quant/kernel_layout.py)."""
    assert held.struct.kind == KIND_INT8
    named, n, k = held.named(), held.struct.n, held.struct.k_in or held.struct.k
    w, scales = named["w"], named["scales"]  # [groups, K / 4, 8 lanes, 4], [N padded to lanes]
    if ids is None:  # (the padding columns dropped: a copy either way)
        return w.transpose(1, 2).reshape(-1, held.struct.k)[:n, :k].contiguous(), scales[:n]
    return w[ids // LANES, :, ids % LANES].reshape(len(ids), -1)[:, :k].contiguous(), scales[ids]


def plain_q4(held: LinearWeights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q4_1's or q4_f32's interleaved copy back as kaon's int4 layout in groups of 32 (a copy): packed uint8
    [N, K / 2], scales and mins [N, K / 32] (float16 for q4_1, float32 for q4_f32)."""
    assert held.struct.kind in (KIND_Q4_1, KIND_Q4_F32)
    named, n, blocks = held.named(), held.struct.n, held.struct.k // QBLOCK
    scale, low = ("d", "m") if held.struct.kind == KIND_Q4_1 else ("gscales", "gmins")
    packed = named["w"].permute(0, 3, 1, 2, 4).reshape(-1, blocks * QBLOCK // 2)[:n]  # [g, b, t, lane, 4] -> rows

    def per_row(t: torch.Tensor) -> torch.Tensor:  # [groups, blocks, 8 lanes] -> [N, blocks]
        return t.transpose(1, 2).reshape(-1, blocks)[:n]

    return packed, per_row(named[scale]), per_row(named[low])


def _check_blocks(k: int) -> None:
    if k % QBLOCK:
        raise ValueError(f"in_features {k} is not a multiple of {QBLOCK}")


def padded_columns(t: torch.Tensor, per_column: int = 1) -> torch.Tensor:
    """t [N, K] with zero columns up to a multiple of QBLOCK (t itself where K already is one): the narrow kinds'
    packing at widths that are not whole blocks. kaon_linear copies each input row zero-padded to the same width
    (Linear.k_in), so a zero weight only ever meets a zero input, and the kernels run on whole blocks unchanged.
    per_column: how many inputs a column of t covers (a group's scales: 16), so that t covers whole blocks."""
    missing = -t.shape[1] % (QBLOCK // per_column)
    return torch.cat([t, t.new_zeros((t.shape[0], missing))], dim=1) if missing else t


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    """t with its first dimension padded with zeros to a multiple of LANES (the kernels' output groups)."""
    missing = -t.shape[0] % LANES
    return torch.cat([t, t.new_zeros((missing, *t.shape[1:]))]) if missing else t


def linear(weights: LinearWeights, x: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 -> [M, N] through the C kernel (narrow weights: activations in int8 blocks)."""
    lib = library()
    assert lib is not None, "the fused CPU kernels are not built (cpu_decode.library())"
    rows = x.shape[0]
    x = x.float().contiguous()
    out = torch.empty(rows, weights.struct.n, dtype=torch.float32)
    work = torch.empty(lib.kaon_linear_workspace(weights.struct.k_in or weights.struct.k, rows), dtype=torch.uint8)
    lib.kaon_linear(ctypes.byref(weights.struct), rows, x.data_ptr(), out.data_ptr(), work.data_ptr(),
                    torch.get_num_threads())
    return out


def decode(model: Model, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
           block_tables: torch.Tensor, context_lens: torch.Tensor,
           lora_slots: torch.Tensor | None = None) -> torch.Tensor:
    """Every layer of a decode step for x [S, hidden] (float32, contiguous, overwritten): returns
    the final norm's output in x. All index tensors int64 on the CPU; block_tables [S, M];
    lora_slots [S]: each row's adapter slot, -1 for the base model (None: no adapters)."""
    lib = library()
    assert lib is not None, "the fused CPU kernels are not built (cpu_decode.library())"
    rows, max_blocks = block_tables.shape
    work = torch.empty(lib.kaon_decode_workspace(ctypes.byref(model), rows, max_blocks), dtype=torch.float32)
    lora_rows = None
    if lora_slots is not None:
        # The adapter rows grouped by slot: one adapter's rows run one after another, its weights in cache.
        lora_slots = lora_slots.to(torch.int64).contiguous()
        with_adapter = (lora_slots >= 0).nonzero().flatten()
        lora_rows = with_adapter[lora_slots[with_adapter].argsort(stable=True)].contiguous()
    lib.kaon_decode(ctypes.byref(model), rows, x.data_ptr(), positions.data_ptr(), slots.data_ptr(),
                    block_tables.data_ptr(), max_blocks, context_lens.data_ptr(), _ptr(lora_slots), _ptr(lora_rows),
                    0 if lora_rows is None else lora_rows.numel(), work.data_ptr(), torch.get_num_threads())
    return x
