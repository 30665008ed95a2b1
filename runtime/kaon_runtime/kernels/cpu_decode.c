/* A whole decode step of a Llama-family decoder on CPU, in one call: no per-op dispatch.
 *
 * Why hand-written: at batch 1 a torch decode step of SmolLM2-135M spends more time in its
 * thousands of small ops and in Python (~17 ms) than in its matrix products (~9 ms); llama.cpp
 * runs one fused graph per token in C. This file does the same for kaon's own layouts: every
 * layer's norms, projections, rotary, KV-cache write, paged attention and SwiGLU (or a mixture of
 * experts: experts_mlp), then the final norm; the vocabulary head is a separate call of the same projection kernels (the
 * embedding lookup stays in torch).
 *
 * Projections read their weights as stored:
 *   F32   float32 [N, K]
 *   F32_T float32 [K, N] (kaon's vocabulary head: the transposed embedding)
 *   F16, BF16, F16_T, BF16_T  the same in float16 or bfloat16 (a --dtype float16 / bfloat16
 *         model's own weights): each weight widened to float32 in registers as it is loaded
 *         (F16C's vcvtph2ps; bfloat16 is float32's top half, one shift), then the float32 path
 *         in its order, so the result equals the float32 kernel's on the widened weight, bit for
 *         bit. Decode reads half the bytes of float32. Why not AVX512-BF16's dot products: they
 *         round the activations to bfloat16 too, and a decode step is bound by reading weights,
 *         not by arithmetic (cvtph and a shift are all that AVX2 CPUs, Zen 4 and Intel share).
 *   FP8, FP8_A8  float8 e4m3 [N, K] with one float32 scale per output row (kaon's fp8, compressed-
 *         tensors FP8 per channel or per tensor): each weight widened to float32 exactly as it is
 *         loaded (load8), the float path's order, then times the row's scale: the numbers torch's
 *         weight-only fp8 matmul computes (float32 activations), summed in one order per row.
 *         FP8_A8 first rounds each activation row to FP8 per token (compressed-tensors FP8 dynamic,
 *         W8A8: round_fp8_rows), a row's own arithmetic too. Not narrow: no int8 activation blocks.
 *   INT8_A8  int8 [N, K] with one float32 scale per output row, read in place, and each input row
 *         quantized to int8 per token (compressed-tensors W8A8 int8, dynamic: quantize_int8_rows, as
 *         quant/dynamic_inputs.quantize_per_token): the int8 x int8 products summed exactly in int32
 *         (so in any order), then times the row's scale and the output's: quant/dynamic_inputs' numbers
 *         bit for bit. Not narrow: one scale per row, not per block of 32.
 *   INT8_S8  the same weights with static input scales (compressed-tensors W8A8 int8, dynamic false:
 *         gscales = [input scale, zero point]): each input rounded to the checkpoint's grid as
 *         quant/static_inputs.round_to_grid does (quantize_static_rows), the integer levels times the
 *         weights summed exactly in int32, then the input scale and the output's. Torch's path multiplies
 *         the rounded inputs in float: the same values, its float rounding and order.
 *   FP8_BLOCK  float8 e4m3 [N, K] with one float32 scale per block of block_rows x block_cols
 *         (DeepSeek's / Qwen3's / compressed-tensors' 128 x 128; scales [ceil(N/br), ceil(K/bc)]):
 *         each weight widened exactly and times its block's scale (one float32 rounding, as torch's
 *         q.float() * scales does it: quant/fp8_block.py), into a strip of float32 rows the float
 *         path's tiles then read in its order (fp8_block_outputs). With input_scale > 0 (compressed-
 *         tensors block FP8 with static input_activations) each activation row is first rounded to FP8 at
 *         that fixed scale, as FP8_STATIC rounds it.
 *   FP8_STATIC FP8's weights, each activation row first rounded to FP8 with the checkpoint's fixed
 *         input_scale (compressed-tensors static input_activations: quant/static_inputs.py).
 *   REF_INT8, REF_Q4, REF_Q8_G16  the reference mode of weight-only checkpoints (W4A16 / W8A16 of GPTQ,
 *         AWQ, compressed-tensors under --dtype float32: quant/reference.py): float32 activations times
 *         each weight dequantized as kernels/quant_gemm_ref.py and quant/group_int8.py do it, the same
 *         float32 value per weight, into a strip of float32 rows the float path's tiles then read in
 *         their one order per output (ref_outputs). REF_INT8: int8 [N, K] read in place, widened exactly,
 *         the sum times the row's scale (w8a16_matmul_ref's order); REF_Q4: kaon's int4 layout read in
 *         place, any even group (block_cols), w = q * scale + min with float32 scales and mins, product
 *         and sum each rounded (dequantize_int4); REF_Q8_G16: Q8_G16's interleaved copy (the one the
 *         default mode reads), w = q * scale (+ min); REF_Q8_G: int8 [N, K] read in place (GroupInt8Linear's
 *         own tensors), a float32 scale (and min) per group of block_cols, any group dividing K (8-bit groups
 *         not a multiple of 16, which Q8_G16 cannot hold), w = q * scale (+ min) as dequantize_group_int8
 *         rounds it. perm: act-order's column order, each input row gathered
 *         into it once per call (as InputPermutedLinear does). Not narrow: no int8 activation blocks.
 *   INT8  int8 [N, K] with one float32 scale per output row (kaon's int8)
 *   Q4_1  uint8 [N, K/2] with float16 scales and mins per group of 32 (kaon's int4 = GGUF Q4_1;
 *         byte j of a group holds element j low and element j + 16 high)
 *   Q4_F32 the same with float32 scales and mins (GGUF Q4_K's d * sc and dmin * m, exact)
 *   Q8_G16 int8 [N, K] with a float32 scale and an optional float32 min per group of 16:
 *         w = q * scale + min (GGUF's 8-bit types and Q2_K/Q3_K, repacked losslessly)
 *   Q5, Q5_F32  Q4_1's / Q4_F32's layout and a plane of fifth bits (GGUF Q5_0, Q5_1, Q5_K)
 *   Q6_G16 a 4-bit plane as Q4_1's, a plane of two high bits, a float32 scale per group of
 *         16: w = (u6 - 32) * scale (GGUF Q6_K)
 *   both with eight output rows interleaved (see "narrow weights" below; cpu_decode.py
 *   makes the copy at load)
 * The narrow ones multiply activations quantized to int8 in blocks of 32 (one float scale per
 * block), so the inner loop is an integer dot product (AVX2 maddubs, or VNNI where the CPU
 * has it), as llama.cpp's Q8_1 activations do. The float path is plain float32 FMA.
 *
 * Threads: the caller's and a small pool of our own (see parallel_for for why not OpenMP), as
 * many as torch.get_num_threads(). Built with -march=native; without AVX2 scalar loops run.
 * References: tests/unit/runtime/kernels/test_cpu_decode.py compares each kernel and the whole step with torch.
 * One file of ~3,000 lines on purpose: one translation unit, so that the compiler inlines the kernels into the
 * step's loops, and one source hash names the build kernels/cpu_decode.py caches per CPU.
 */
#define _GNU_SOURCE  /* sched_yield under -std=c11 */
#include <math.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <stdatomic.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KAON_AVX2 1
#endif

#ifdef KAON_AVX2
/* Sums of four u8 x s8 products per 32-bit lane. With VNNI (AVX512-VNNI with VL, or AVX-VNNI)
 * one instruction; without, maddubs then madd. Both sums are exact (the pairs maddubs makes
 * here stay within int16: 4-bit weights, or |int8| weights against x with their sign), so the
 * two give the same bits. */
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define KAON_VNNI 1
#endif
/* acc + the dot: with VNNI the accumulate is the instruction's own (one uop where an add followed
 * each dot: 8 of a block's ~24 integer ops per row); integer sums are exact, so the order of the
 * adds changes no bit and every flag path still agrees with the others. */
static inline __m256i dot_u8s8_acc(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}
#endif

#define QBLOCK 32

enum { KIND_F32 = 0, KIND_INT8 = 1, KIND_Q4_1 = 2, KIND_F32_T = 3, KIND_Q4_F32 = 4, KIND_Q8_G16 = 5, KIND_Q5 = 6,
       KIND_Q5_F32 = 7, KIND_Q6_G16 = 8, KIND_F16 = 9, KIND_BF16 = 10, KIND_F16_T = 11, KIND_BF16_T = 12,
       KIND_FP8 = 13, KIND_FP8_A8 = 14, KIND_FP8_BLOCK = 15, KIND_FP8_STATIC = 16, KIND_INT8_A8 = 17,
       KIND_INT8_S8 = 18, KIND_REF_INT8 = 19, KIND_REF_Q4 = 20, KIND_REF_Q8_G16 = 21,
       KIND_REF_Q8_G = 22 };

/* How float values are stored, in weights and in the KV cache: float32, float16 or bfloat16;
 * FP8 (float8 e4m3fn) for weights only. */
enum { FMT_F32 = 0, FMT_F16 = 1, FMT_BF16 = 2, FMT_FP8 = 3 };

typedef struct {
    int32_t kind, n, k;
    const void *w;          /* see the kinds above */
    const float *scales;    /* INT8, FP8, FP8_A8, FP8_STATIC: [n]; FP8_BLOCK: [ceil(n/block_rows), ceil(k/block_cols)] */
    const uint16_t *d, *m;  /* Q4_1: float16 [n, k/32] scales and mins */
    const float *bias;      /* [n] or NULL */
    const float *gscales, *gmins;  /* Q4_F32, Q5_F32: [n, k/32]; Q8_G16, Q6_G16: [n, k/16], gmins may be NULL */
    const uint8_t *high;    /* Q5*: one bit per weight, Q6_G16: two (see "narrow weights" below) */
    int32_t act_passes;     /* narrow kinds: the activations in 1 int8 pass per block (0 reads as 1), or 2:
                             * the block's rounding remainder in a second (see quantize_passes) */
    int32_t block_rows, block_cols;  /* FP8_BLOCK: a scale's block */
    float input_scale;      /* FP8_STATIC, and FP8_BLOCK where > 0: x is rounded to fp8(x / input_scale) * input_scale */
    const int64_t *perm;    /* REF_Q4, REF_Q8_G16, REF_Q8_G: GPTQ act-order, stored column i is input column perm[i]; or NULL */
    int32_t k_in;           /* the inputs' true width (x's row stride) where the weights were packed with k - k_in zero
                             * columns to whole blocks of QBLOCK (narrow kinds at odd widths); 0: k (see kaon_linear) */
} Linear;

/* A projection's LoRA slots (layers/lora.py's LoraLinear): a projection of P parts (q|k|v: 3,
 * gate|up: 2, else 1) holds per slot A [P * R, k] (the parts' A stacked along the rank) and
 * B [P * R, n] (part p's rows non-zero only in its own columns), R the pool's max rank, the
 * scaling folded into B. ranks [slots, P]: the rank each slot's adapter has on each part (0:
 * it leaves the part alone), so padding and untouched parts cost nothing. a NULL: no slots.
 * fmt: the slots' FMT_ (F32, F16, BF16: a half model's slots are in its dtype), widened to float32
 * in registers as they are loaded, as the projections' half weights are: the float32 arithmetic on
 * the widened values, bit for bit. */
#define LORA_PARTS 3
typedef struct {
    const void *a, *b;
    const int32_t *ranks;
    int32_t parts, rank;
    int32_t sizes[LORA_PARTS];  /* each part's outputs, side by side in y */
    int32_t fmt;
} Lora;

enum { LORA_QKV = 0, LORA_O = 1, LORA_GATE_UP = 2, LORA_DOWN = 3 };

typedef struct {
    Linear qkv, o, gate_up, down;
    const float *input_norm, *post_norm;
    void *k_cache, *v_cache;  /* [kv_heads, num_blocks, block_size, head_dim]: float32, or float16 (kv_half) */
    Lora lora[4];             /* by the LORA_ names above */
    int32_t window;           /* sliding window: a query at position p sees keys p - window + 1 .. p; 0: all */
    const float *q_norm, *k_norm;  /* Qwen3: one RMSNorm weight [head_dim] for every q head, one for every k
                                    * head, applied before rotary; NULL: none */
    const float *pre_ff_norm, *post_ff_norm;  /* Gemma 2's sandwich: post_norm then normalises attention's output
                                               * before the residual add, pre_ff_norm the MLP's input and
                                               * post_ff_norm its output; NULL: none (post_norm is the MLP's input
                                               * norm, as in Llama) */
    const struct Experts *experts;  /* a mixture-of-experts layer's experts in place of gate_up and down (see
                                     * experts_mlp); NULL: the dense MLP */
} Layer;

typedef struct {
    int32_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size, num_blocks;
    int32_t kv_half;  /* the KV cache holds float32 (0), float16 (1) or bfloat16 (2): an FMT_ */
    float eps, scale;
    const float *final_norm;
    const float *cos, *sin;  /* [positions, rotary_dim / 2] */
    const Layer *layers;
    int32_t rotary_dim;  /* each head's leading dims that rotate (Phi-3's partial rotary); 0: all head_dim */
    int32_t act;         /* the gated MLP's activation: ACT_SILU (SwiGLU) or ACT_GELU_TANH (Gemma's GeGLU) */
    float softcap;       /* attention scores become softcap * tanh(score / softcap) (Gemma 2); 0: none */
    /* Tensor parallelism: each rank holds its share of the heads and of the MLP width, so o's and down's
     * outputs are partial sums over the ranks. sum_ranks(x, count) replaces x's count floats by their sum
     * over the ranks (models/cpu_decode_step.py calls the rank's collective) and returns 0, or non-zero when
     * the collective failed: the step then stops (the caller raises its error). NULL: one rank. */
    int (*sum_ranks)(float *x, int64_t count);
} Model;

enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };

/* ---- small helpers ------------------------------------------------------------------ */

static inline float half_to_float(uint16_t h) {
#ifdef KAON_AVX2
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) { bits = sign; }
        else {  /* subnormal: normalise */
            exp = 113;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) { bits = sign | 0x7f800000 | (man << 13); }
    else { bits = sign | ((exp + 112) << 23) | (man << 13); }
    float f; memcpy(&f, &bits, 4); return f;
#endif
}

/* Rounded to nearest, ties to even, as torch's .to(torch.float16) rounds: a float16 cache holds
 * the same bits whichever path wrote it. */
static inline uint16_t float_to_half(float f) {
#ifdef KAON_AVX2
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t x; memcpy(&x, &f, 4);
    const uint16_t sign = (x >> 16) & 0x8000;
    const uint32_t mag = x & 0x7fffffff;
    if (mag > 0x7f800000) return sign | 0x7e00;            /* NaN */
    if (mag >= 0x477ff000) return sign | 0x7c00;           /* rounds to 65536 or more: infinity */
    if (mag < 0x38800000) {                                 /* below 2^-14: a multiple of 2^-24 */
        float a; memcpy(&a, &mag, 4);
        return sign | (uint16_t)lrintf(a * 16777216.f);     /* exact product; lrintf rounds to even */
    }
    uint32_t h = (mag >> 13) - (112u << 10);                /* exponent rebiased, top ten mantissa bits */
    const uint32_t rest = mag & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++;  /* a carry moves into the exponent, as it should */
    return sign | (uint16_t)h;
#endif
}

static inline float bf16_to_float(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f; memcpy(&f, &bits, 4); return f;
}

/* Rounded to nearest, ties to even, as torch's .to(torch.bfloat16) rounds (NaN stays NaN). */
static inline uint16_t float_to_bf16(float f) {
    uint32_t x; memcpy(&x, &f, 4);
    if ((x & 0x7fffffff) > 0x7f800000) return (uint16_t)((x >> 16) | 0x40);
    return (uint16_t)((x + 0x7fff + ((x >> 16) & 1)) >> 16);
}

/* An e4m3fn byte's bits moved into a float16's (sign to bit 15, exponent and mantissa up by 7): that
 * float16 is the FP8 value times 2^-8, normal and subnormal alike (the two formats' exponent biases differ
 * by 8 and both have an implicit-zero subnormal range), so widening it and multiplying by 256 is exact.
 * 0x7f / 0xff (e4m3fn's NaN) widen to 480: quantized weights hold none (quantize_fp8 clamps to 448). */
static inline float fp8_to_float(uint8_t b) {
    return half_to_float((uint16_t)(((b & 0x80u) << 8) | ((b & 0x7fu) << 7))) * 256.f;
}

/* Element i of a float row stored in format fmt, as float32 (exact: both halves widen exactly). */
static inline float load1(const void *row, size_t i, int fmt) {
    return fmt == FMT_F32 ? ((const float *)row)[i]
         : fmt == FMT_F16 ? half_to_float(((const uint16_t *)row)[i])
         : fmt == FMT_FP8 ? fp8_to_float(((const uint8_t *)row)[i]) : bf16_to_float(((const uint16_t *)row)[i]);
}

static inline size_t fmt_bytes(int fmt) {
    return fmt == FMT_F32 ? sizeof(float) : fmt == FMT_FP8 ? 1 : sizeof(uint16_t);
}

#ifdef KAON_AVX2
/* Elements i..i+7 of a float row stored in format fmt, widened to float32 in registers. */
static inline __m256 load8(const void *row, size_t i, int fmt) {
    if (fmt == FMT_F32) return _mm256_loadu_ps((const float *)row + i);
    if (fmt == FMT_FP8) {  /* as fp8_to_float, eight at once */
        const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)((const uint8_t *)row + i)));
        const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                                       _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7));
        return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f));
    }
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + i));
    if (fmt == FMT_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

static float dot_f32(const float *a, const float *b, int n) {
    int i = 0; float sum = 0.f;
#ifdef KAON_AVX2
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps(),
           acc3 = _mm256_setzero_ps();
    for (; i + 32 <= n; i += 32) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
        acc2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), acc2);
        acc3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), acc3);
    }
    for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    sum = hsum8(_mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3)));
#endif
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* Into L2 (locality 2: prefetcht1 on x86): a block is used by every row tile of the batch,
 * over more time than L1 keeps it. */
static inline void prefetch(const void *p) { __builtin_prefetch(p, 0, 2); }

/* Batch 1 reads each weight once per token, and each projection starts a new stream the hardware
 * prefetcher has to find again: the narrow kernels' one-row loops (and two-row ones: batch 1's two
 * activation passes in the 256-bit kernels) ask for the weights STREAM_AHEAD bytes ahead (into L2)
 * as they go. A whole int8/int4 model's projections at batch 1, one thread (weights from L3; load
 * ~10): one pass 13% / 21% less time, two passes (half registers) 17% / 22%; two passes in the
 * 256-bit kernels on a Zen 2: 0.67x / 0.65x the time once they had it and their constant two-row
 * copy (narrow_group), 0.98x / 1.05x one pass's (bench/cpu_projections.py --rows 1 --layers 30).
 * 1-4 KiB ahead measured alike. In asm: GCC 12 dropped __builtin_prefetch calls inlined into these
 * loops. -DSTREAM_AHEAD=0 (no prefetches) and -DONE_PASS_AHEAD=0 (none in the 256-bit kernels) are
 * for A/B builds. */
#ifndef STREAM_AHEAD
#define STREAM_AHEAD 2048
#endif
#ifndef ONE_PASS_AHEAD
#define ONE_PASS_AHEAD 1
#endif
static inline void prefetch_ahead(const void *p, int bytes) {
#if defined(__x86_64__)
    for (int i = 0; STREAM_AHEAD > 0 && i < bytes; i += 64)
        __asm__ volatile("prefetcht1 %0" : : "m"(*((const char *)p + STREAM_AHEAD + i)));
#else
    (void)p; (void)bytes;
#endif
}

/* Tile shapes (measured on a 2-core AVX2 EPYC): MR x NR for batches (12 FMAs per 8 loads, 15
 * vector registers), 1 x NR1 for one row (eight independent chains while streaming weights). */
#define MR 6
#define NR 2
#define NR1 8
#define TILE_ROWS_MAX MR
#define TILE_COLS_MAX NR1

/* Float32 [N, K] weights: a tile of R activation rows by C weight rows. Every output is summed
 * in one order whatever the tile, the batch or the thread count: one 8-lane accumulator over k,
 * then hsum8, then the scalar tail; so a sequence's result does not depend on its batch.
 * R and C are constants at every call (always_inline) and the arrays have fixed sizes, so once
 * the loops unroll the accumulators live in registers. */
static inline __attribute__((always_inline)) void tile_f32(const void *w, const int fmt, const float *x, int k,
                                                           const int R, const int C, const float *bias, float *y,
                                                           size_t ystride) {
    int i = 0;
    float sums[TILE_ROWS_MAX][TILE_COLS_MAX];
#ifdef KAON_AVX2
    __m256 acc[TILE_ROWS_MAX][TILE_COLS_MAX];
    for (int r = 0; r < R; r++) for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    for (; i + 8 <= k; i += 8) {
        __m256 wv[TILE_COLS_MAX];
        for (int c = 0; c < C; c++) wv[c] = load8(w, (size_t)c * k + i, fmt);
        for (int r = 0; r < R; r++) {
            __m256 xv = _mm256_loadu_ps(x + (size_t)r * k + i);
            __asm__("" : "+x"(xv));  /* keep it in a register: GCC would load it again for each output */
            for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++) for (int c = 0; c < C; c++) sums[r][c] = hsum8(acc[r][c]);
#else
    for (int r = 0; r < R; r++) for (int c = 0; c < C; c++) sums[r][c] = 0.f;
#endif
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            float sum = sums[r][c];
            for (int j = i; j < k; j++) sum += x[(size_t)r * k + j] * load1(w, (size_t)c * k + j, fmt);
            y[r * ystride + c] = bias ? sum + bias[c] : sum;
        }
}

static void tile_f32_any(const void *w, int fmt, const float *x, int k, int R, int C, const float *bias, float *y,
                         size_t ystride) {
#define TILE_CASE(f, r, c) case (f) * 256 + (r) * 16 + (c): tile_f32(w, f, x, k, r, c, bias, y, ystride); return;
#define TILE_CASES(f) \
        TILE_CASE(f, 1, 1) TILE_CASE(f, 1, 2) TILE_CASE(f, 1, 3) TILE_CASE(f, 1, 4) \
        TILE_CASE(f, 1, 5) TILE_CASE(f, 1, 6) TILE_CASE(f, 1, 7) TILE_CASE(f, 1, 8) \
        TILE_CASE(f, 2, 1) TILE_CASE(f, 2, 2) TILE_CASE(f, 3, 1) TILE_CASE(f, 3, 2) \
        TILE_CASE(f, 4, 1) TILE_CASE(f, 4, 2) TILE_CASE(f, 5, 1) TILE_CASE(f, 5, 2) \
        TILE_CASE(f, 6, 1) TILE_CASE(f, 6, 2)
    switch (fmt * 256 + R * 16 + C) {
        TILE_CASES(FMT_F32) TILE_CASES(FMT_F16) TILE_CASES(FMT_BF16) TILE_CASES(FMT_FP8)
    }
#undef TILE_CASES
#undef TILE_CASE
    abort();  /* a shape the dispatch lacks: MR, NR or NR1 changed without it */
}

/* y[:, begin:end] for float32 [N, K] weights. Outputs go in blocks whose weights stay in L2
 * (~64 KB) while every row tile of the batch passes over them, so each weight is read from
 * memory once a call; within a block a row tile's activations stay in L1. */
#define F32_BLOCK 16384  /* floats: 64 KB of weights */
static void f32_outputs(const void *weights, int fmt, const float *bias, int n, int k, int rows, const float *x,
                        float *y, int begin, int end) {
    const char *w = weights;
    const size_t row_bytes = (size_t)k * fmt_bytes(fmt);
    const int r_step = rows == 1 ? 1 : MR, c_step = rows == 1 ? NR1 : NR;
    int block = (F32_BLOCK / k) / c_step * c_step;
    if (block < c_step) block = c_step;
    for (int j0 = begin; j0 < end; j0 += block) {
        const int j1 = j0 + block < end ? j0 + block : end;
        /* While the batch's tiles pass over this block, the next block's weights (the rows
         * after it in memory, whichever thread takes them) are fetched a slice per tile: with
         * the whole model far larger than the caches, each block would otherwise arrive at the
         * latency of the first tile's loads, not at memory's bandwidth. One row of float32 needs
         * no help: its single pass streams, which the hardware prefetcher follows (prefetching
         * cost it 14% more CPU time). One row of float16 / bfloat16 does: converting as it reads,
         * it left the prefetcher behind, and the slices ahead cut its projections' CPU time by
         * 16% (30 SmolLM2 layers, one thread, weights from memory; issue 49 §5). */
        const char *ahead = w + (size_t)j1 * row_bytes;
        const char *ahead_end = w + (size_t)(j1 + block < n ? j1 + block : n) * row_bytes;
        const size_t tiles = (size_t)((rows + r_step - 1) / r_step) * ((j1 - j0 + c_step - 1) / c_step);
        const size_t left = ahead_end > ahead ? (size_t)(ahead_end - ahead) : 0;
        const size_t slice = rows == 1 && fmt == FMT_F32 ? 0
                           : (left / tiles + 63) & ~(size_t)63;  /* whole cache lines */
        for (int r0 = 0; r0 < rows; r0 += r_step) {
            const int R = rows - r0 < r_step ? rows - r0 : r_step;
            for (int j = j0; j < j1; j += c_step) {
                const int C = j1 - j < c_step ? j1 - j : c_step;
                for (const char *stop = ahead + slice; ahead < stop && ahead < ahead_end; ahead += 64)
                    prefetch(ahead);
                tile_f32_any(w + (size_t)j * row_bytes, fmt, x + (size_t)r0 * k, k, R, C, bias ? bias + j : NULL,
                             y + (size_t)r0 * n + j, (size_t)n);
            }
        }
    }
}

/* One step of an output's FMA chain, as the vector lanes do it where they exist (one rounding). */
static inline float madd1(float a, float x, float y) {
#ifdef KAON_AVX2
    return fmaf(a, x, y);
#else
    return y + a * x;
#endif
}

/* y += a * x */
static void axpy(float *y, float a, const float *x, int n) {
    int i = 0;
#ifdef KAON_AVX2
    __m256 va = _mm256_set1_ps(a);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
    for (; i < n; i++) y[i] = madd1(a, x[i], y[i]);
}

/* Float32 [K, N] weights (the vocabulary head, a transposed embedding), R activation rows by
 * NT outputs over KT of the k: a strip of W packed contiguous ([KT, NT], see f32_t_outputs)
 * streams from cache while each row's NT sums stay in registers. Every output is one FMA chain
 * over k from zero (a later k-block carries on from y), so a row gets the same bits alone or
 * batched. */
#define NT 16
#define KT 128
_Static_assert(NT == 16, "f32_t_outputs widens a 16-bit strip row as two vectors of eight");
static inline __attribute__((always_inline)) void tile_f32_t(const float *packed, const float *x, int kt, int k,
                                                             int n, const int R, int first, float *y) {
#ifdef KAON_AVX2
    __m256 acc[TILE_ROWS_MAX][2];
    for (int r = 0; r < R; r++) {
        acc[r][0] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + (size_t)r * n);
        acc[r][1] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + (size_t)r * n + 8);
    }
    for (int i = 0; i < kt; i++) {
        const __m256 w0 = _mm256_loadu_ps(packed + i * NT), w1 = _mm256_loadu_ps(packed + i * NT + 8);
        for (int r = 0; r < R; r++) {
            const __m256 xb = _mm256_broadcast_ss(x + (size_t)r * k + i);
            acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(y + (size_t)r * n, acc[r][0]);
        _mm256_storeu_ps(y + (size_t)r * n + 8, acc[r][1]);
    }
#else
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NT; c++) {
            float sum = first ? 0.f : y[(size_t)r * n + c];
            for (int i = 0; i < kt; i++) sum = madd1(x[(size_t)r * k + i], packed[i * NT + c], sum);
            y[(size_t)r * n + c] = sum;
        }
#endif
}

static void tile_f32_t_any(const float *packed, const float *x, int kt, int k, int n, int R, int first, float *y) {
#define TILE_T_CASE(r) case r: tile_f32_t(packed, x, kt, k, n, r, first, y); return;
    switch (R) { TILE_T_CASE(1) TILE_T_CASE(2) TILE_T_CASE(3) TILE_T_CASE(4) TILE_T_CASE(5) TILE_T_CASE(6) }
#undef TILE_T_CASE
    abort();
}

/* y[:, begin:end] for float32 [K, N] weights, in register tiles: each [KT, NC] block of W is
 * copied once into contiguous [KT, NT] panels, read a row segment at a time as memory serves
 * it best (a walk down one NT-wide strip would touch a new page on every row of W, and every
 * row tile would pay for it again), and all the rows' tiles read the panels from cache. On
 * the 2-core test machine (Zen 4), the 49,152 x 576 head: 6-7 ms for 1 to 4 rows, 15.7 for 35
 * and 24.3 for 64, against MKL's 4.8, 19, 28 and 38.5 ms (MKL packs the whole weight per call). */
#define NC 128
static void f32_t_outputs(const void *w, int fmt, const float *bias, int n, int k, int rows, const float *x,
                          float *y, int begin, int end) {
    const size_t es = fmt_bytes(fmt);
    float packed[KT * NC];  /* 64 KB, on the stack of the caller or a pool thread */
    int j = begin;
    while (j + NT <= end) {
        const int nc = (end - j) / NT * NT < NC ? (end - j) / NT * NT : NC;
        for (int k0 = 0; k0 < k; k0 += KT) {
            const int kt = k - k0 < KT ? k - k0 : KT;
            for (int i = 0; i < kt; i++)  /* (float16 and bfloat16 rows widen here, once per call) */
                for (int p = 0; p < nc / NT; p++) {
                    float *to = packed + ((size_t)p * kt + i) * NT;
                    const size_t from = (size_t)(k0 + i) * n + j + p * NT;
                    if (fmt == FMT_F32) memcpy(to, (const float *)w + from, sizeof(float) * NT);
#ifdef KAON_AVX2
                    /* Eight at a time (vcvtph2ps / a shift): one element at a time, the float16 head's
                     * widening cost more than its halved reads saved, and a float16 model decoded
                     * slower than float32 at batch 1 (issue 49 §5). Exact either way: the same bits. */
                    else {
                        _mm256_storeu_ps(to, load8(w, from, fmt));
                        _mm256_storeu_ps(to + 8, load8(w, from + 8, fmt));
                    }
#else
                    else for (int c = 0; c < NT; c++) to[c] = load1(w, from + c, fmt);
#endif
                }
            /* The next block's row segments (the next k-block of these columns, or the next
             * columns' first), a few per strip: 128 rows a whole row of W apart, which the
             * hardware prefetcher does not guess. */
            const int k_next = k0 + KT < k ? k0 + KT : 0, j_next = k0 + KT < k ? j : j + nc;
            const int kt_next = j_next < end ? (k - k_next < KT ? k - k_next : KT) : 0;  /* 0: none left */
            const int strips = nc / NT, per_strip = (kt_next + strips - 1) / strips;
            const int segment = (j_next + nc <= end ? nc : end - j_next) * (int)es;
            for (int p = 0; p < strips; p++) {
                for (int i = p * per_strip; i < (p + 1) * per_strip && i < kt_next; i++)
                    for (int b = 0; b < segment; b += 64)
                        prefetch((const char *)w + ((size_t)(k_next + i) * n + j_next) * es + b);
                for (int r0 = 0; r0 < rows; r0 += MR)
                    tile_f32_t_any(packed + (size_t)p * kt * NT, x + (size_t)r0 * k + k0, kt, k, n,
                                   rows - r0 < MR ? rows - r0 : MR, k0 == 0, y + (size_t)r0 * n + j + p * NT);
            }
        }
        j += nc;
    }
    for (int r = 0; r < rows; r++)  /* the last columns, fewer than a strip: the same chains */
        for (int c = j; c < end; c++) {
            float sum = 0.f;
            for (int i = 0; i < k; i++) sum = madd1(x[(size_t)r * k + i], load1(w, (size_t)i * n + c, fmt), sum);
            y[(size_t)r * n + c] = sum;
        }
    if (bias)
        for (int r = 0; r < rows; r++)
            for (int j = begin; j < end; j++) y[(size_t)r * n + j] += bias[j];
}

/* ---- activations quantized in blocks of 32: x ~ d[b] * q[b*32 + i]; qs[b] = sum(q), s[b] = d[b] * qs[b] */

/* One block of 32: q = x / d rounded half to even, d = amax / 127; returns sum(q); rest (or NULL):
 * the rounding remainder x - d q. The AVX2 path computes the same bits as the scalar one (max,
 * one multiply, round to nearest even, exact integer sums; the remainder as a product then a
 * difference, as the scalar code is compiled without contraction: -std=c11), and is ~8x faster: the
 * caller quantizes before the projection's threads start, so at 16 rows with two passes the scalar
 * loops were a third of a small projection's time. */
static inline int32_t quantize_block(const float *xb, int8_t *qb, float *d, float *rest) {
#ifdef KAON_AVX2
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 xv[4], m = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) {
        xv[j] = _mm256_loadu_ps(xb + 8 * j);
        m = _mm256_max_ps(_mm256_andnot_ps(sign, xv[j]), m);  /* a NaN element loses, as below */
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
#else
    float amax = 0.f;
    for (int i = 0; i < QBLOCK; i++) {
        float a = fabsf(xb[i]);
        amax = a > amax ? a : amax;  /* fmaxf's NaN rule, without a call into libm per element */
    }
#endif
    const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    *d = scale;
#ifdef KAON_AVX2
    __m256i qi[4], total = _mm256_setzero_si256();
    for (int j = 0; j < 4; j++) {
        const __m256 r = _mm256_round_ps(_mm256_mul_ps(xv[j], _mm256_set1_ps(inv)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        qi[j] = _mm256_cvtps_epi32(r);
        total = _mm256_add_epi32(total, qi[j]);
        if (rest) _mm256_storeu_ps(rest + 8 * j, _mm256_sub_ps(xv[j], _mm256_mul_ps(_mm256_set1_ps(scale), r)));
    }
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
    _mm256_storeu_si256((__m256i *)qb, _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
    return _mm_cvtsi128_si32(t);
#else
    int sum = 0;
    for (int i = 0; i < QBLOCK; i++) {
        int v = (int)nearbyintf(xb[i] * inv);
        qb[i] = (int8_t)v;
        sum += v;
        if (rest) rest[i] = xb[i] - scale * (float)v;
    }
    return sum;
#endif
}

static void quantize_q8(const float *x, int k, int8_t *q, float *d, float *s, int32_t *qs) {
    for (int b = 0; b < k / QBLOCK; b++) {
        qs[b] = quantize_block(x + b * QBLOCK, q + b * QBLOCK, d + b, NULL);
        s[b] = d[b] * (float)qs[b];
    }
}

/* Two int8 passes over each block: x ~ d1 q1 + d2 q2, q1 the block rounded as quantize_q8 rounds
 * it, q2 the rounding remainder x - d1 q1 (at most d1 / 2 per element) quantized the same way in
 * its own block scale. About 15 bits of each block's largest magnitude instead of 7, for twice the
 * integer dot products (the weights are unpacked once for both: a decode step bound by reading
 * weights barely notices). The two passes are two rows of the quantized activations (q, d, s, qs
 * at row 2 of x's rows and the next), so every kernel below runs them unchanged, each pass's output
 * summed into one row afterwards in a fixed order: a row's bits still depend on that row alone.
 * Why: with one pass the int4 model's hidden states sit ~4% off the weights' exact arithmetic
 * against ~2% for bfloat16 activations, which tips near ties (issue 49, bench/prefill_precision.py). */
static void quantize_passes(const float *x, int k, int8_t *q, float *d, float *s, int32_t *qs) {
    const int blocks = k / QBLOCK;
    float rest[QBLOCK];
    for (int b = 0; b < blocks; b++) {
        qs[b] = quantize_block(x + b * QBLOCK, q + b * QBLOCK, d + b, rest);
        s[b] = d[b] * (float)qs[b];
        qs[blocks + b] = quantize_block(rest, q + k + b * QBLOCK, d + blocks + b, NULL);
        s[blocks + b] = d[blocks + b] * (float)qs[blocks + b];
    }
}

/* quantize_passes' two passes of one row written as pairs for the 512-bit kernels (KAON_PAIRS):
 * per block [t][pass][4 bytes], and d, s, qs as [block][pass]. */
static void quantize_pairs(const float *x, int k, int8_t *qp, float *dp, float *sp, int32_t *qsp) {
    int8_t pass_q[2][QBLOCK];
    float rest[QBLOCK];
    for (int b = 0; b < k / QBLOCK; b++) {
        qsp[2 * b] = quantize_block(x + b * QBLOCK, pass_q[0], dp + 2 * b, rest);
        qsp[2 * b + 1] = quantize_block(rest, pass_q[1], dp + 2 * b + 1, NULL);
        for (int pass = 0; pass < 2; pass++) {
            sp[2 * b + pass] = dp[2 * b + pass] * (float)qsp[2 * b + pass];
            for (int t = 0; t < QBLOCK / 4; t++) memcpy(qp + (size_t)b * 2 * QBLOCK + 8 * t + 4 * pass, pass_q[pass] + 4 * t, 4);
        }
    }
}

/* ---- narrow weights, eight output channels interleaved -----------------------------------
 * A batch's rows make a decode step compute-bound in these kernels, and with one output per
 * pass each 32-element block cost a float conversion and an FMA per row and output besides its
 * integer dot product. Here the eight lanes of a vector are eight outputs: one u8 x s8 dot
 * instruction takes four k of each, a block is eight of them, and the conversion and FMA are
 * paid once per block for all eight (the idea of llama.cpp's repacked CPU weights).
 * Layouts (made once at load, cpu_decode.py): for group g of outputs 8g..8g+7 and block b,
 *   INT8: 256 bytes, [t = 0..7][lane][4]: w[8g + lane][32b + 4t + i];
 *   Q4_1: 128 bytes, [t = 0..3][lane][4], GGUF's bytes as they are: the low nibble of byte i
 *         is element 32b + 4t + i, the high one element 32b + 16 + 4t + i;
 *         scales and mins float16 [g][b][lane];
 *   Q5:   Q4_1's, and 32 bytes [lane][4] of high bits: bit t of byte (lane, i) is the fifth bit
 *         of the value whose nibble sits in vector t (t < 4 low nibbles, t >= 4 high ones) at
 *         byte (lane, i), so one shift and mask per vector puts it in place;
 *   Q6_G16: Q4_1's nibbles, and 64 bytes [half][lane][4]: bits 2j, 2j + 1 of byte (lane, i) in
 *         half h are the top two bits of the value in nibble vector 4h + j at byte (lane, i).
 * Each output's sum is one chain over the blocks, whatever the number of rows, so a sequence's
 * bits do not depend on its batch. */
#define LANES 8
#define TILE 4  /* activation rows per pass over a group's weights */

static inline int32_t load_i32(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return v; }

#ifdef KAON_AVX2
/* acc + the u8 x s8 dots of u[t] with activation bytes q[4t..4t+3] broadcast, for t < n (n, run:
 * constants where inlined). With VNNI one instruction each. Without, maddubs's int16 pair sums are
 * added `run` at a time in int16 before one madd widens them to int32, where each maddubs had its
 * own madd: maddubs and madd both take the vector-multiply port(s) (one on Zen 2), so a 4-bit
 * block's integer work per row was 16 multiply-port instructions and is now 9 (batched 4-bit
 * projections on a Zen 2: 0.80-0.83x the CPU time, bench/cpu_projections.py). Exact, so the same bits
 * as before and as VNNI: the activations are quantize_block's (|q| <= 127) and `run` x 2 pair products
 * of unsigned weights up to umax stay within int16 while run * 2 * umax * 127 < 32768 (4-bit weights:
 * run 8; 5-bit: 4; 6-bit: 2; test_cpu_decode.py's largest-sums test). int8 weights (|w| up to 128
 * against q carrying w's sign) fill an int16 lane with one pair: they keep a madd per maddubs. */
static inline __attribute__((always_inline)) __m256i dots_u8s8(__m256i acc, const __m256i *u, const int8_t *q,
                                                               const int n, const int run) {
#ifdef KAON_VNNI
    (void)run;
    for (int t = 0; t < n; t++) acc = dot_u8s8_acc(acc, u[t], _mm256_set1_epi32(load_i32(q + 4 * t)));
#else
    for (int t0 = 0; t0 < n; t0 += run) {
        __m256i pairs = _mm256_maddubs_epi16(u[t0], _mm256_set1_epi32(load_i32(q + 4 * t0)));
        for (int t = t0 + 1; t < t0 + run && t < n; t++)
            pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(u[t], _mm256_set1_epi32(load_i32(q + 4 * t))));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
    }
#endif
    return acc;
}
#endif

/* y[r][c] for r < rows (<= TILE) of group g's eight outputs c, int8 weights:
 * y = scale_c * sum_b d[r, b] * (sum_i w[c, i] q[r, i] over block b). */
static inline __attribute__((always_inline)) void group_int8(const int8_t *w, const float *scales, const int8_t *q,
                                                             const float *d, const int32_t *qs, int k, int rows,
                                                             float out[TILE][LANES]) {
    const int blocks = k / QBLOCK;
#ifdef KAON_AVX2
    __m256 acc[TILE];
    for (int r = 0; r < TILE; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const __m256i *wb = (const __m256i *)(w + (size_t)b * QBLOCK * LANES);
        if (rows <= 2 && ONE_PASS_AHEAD) prefetch_ahead(wb, QBLOCK * LANES);
        __m256i wv[8];
        for (int t = 0; t < 8; t++) wv[t] = _mm256_loadu_si256(wb + t);
#ifdef KAON_VNNI
        /* u8 x s8 needs an unsigned side: w + 128 (w ^ 0x80), whose dot is sum(w q) + 128 sum(q);
         * the second term, the same for every output, comes off exactly in integers. */
        for (int t = 0; t < 8; t++) wv[t] = _mm256_xor_si256(wv[t], _mm256_set1_epi8((char)0x80));
#endif
        for (int r = 0; r < TILE; r++) {
            if (r >= rows) break;
            const int8_t *qb = q + (size_t)r * k + b * QBLOCK;
#ifdef KAON_VNNI
            __m256i sum = _mm256_set1_epi32(-128 * qs[(size_t)r * blocks + b]);
            for (int t = 0; t < 8; t++)
                sum = dot_u8s8_acc(sum, wv[t], _mm256_set1_epi32(load_i32(qb + 4 * t)));
#else       /* maddubs would overflow int16 on w + 128: |w| against q carrying w's sign instead */
            __m256i sum = _mm256_setzero_si256();
            for (int t = 0; t < 8; t++)
                sum = dot_u8s8_acc(sum, _mm256_sign_epi8(wv[t], wv[t]),
                                                     _mm256_sign_epi8(_mm256_set1_epi32(load_i32(qb + 4 * t)), wv[t]));
#endif
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(d[(size_t)r * blocks + b]), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) _mm256_storeu_ps(out[r], _mm256_mul_ps(acc[r], _mm256_loadu_ps(scales)));
#else
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < LANES; c++) {
            float acc = 0.f;
            for (int b = 0; b < blocks; b++) {
                int32_t sum = 0;
                for (int t = 0; t < 8; t++)
                    for (int i = 0; i < 4; i++)
                        sum += w[((size_t)b * 8 + t) * 32 + c * 4 + i] * q[(size_t)r * k + b * QBLOCK + 4 * t + i];
                acc = fmaf((float)sum, d[(size_t)r * blocks + b], acc);
            }
            out[r][c] = acc * scales[c];
        }
#endif
}

#ifdef KAON_AVX2
/* A block's packed 4-bit values (four 32-byte words of eight lanes' nibbles): u[t] the low nibbles
 * of word t, u[t + 4] its high ones. Shared by Q4_1, Q5 and Q6. */
static inline __attribute__((always_inline)) void split_nibbles(const __m256i *wb, __m256i low, __m256i u[8]) {
    for (int t = 0; t < 4; t++) {
        const __m256i raw = _mm256_loadu_si256(wb + t);
        u[t] = _mm256_and_si256(raw, low);
        u[t + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
    }
}

/* The high bits from one plane hv onto n nibbles: bits width * j .. width * (j + 1) - 1 of each byte
 * -> bits 4.. of u[j] (Q5: width 1, Q6: width 2). 16-bit shifts: the mask drops what crossed a byte.
 * Inlined with constant n and width (-O3), the loop unrolls and each shift, its direction included,
 * is an immediate: no branch and no variable shift in the block loop. */
static inline __attribute__((always_inline)) void add_high_bits(__m256i *u, const int n, __m256i hv, const int width) {
    const __m256i mask = _mm256_set1_epi8((char)(((1 << width) - 1) << 4));
    for (int j = 0; j < n; j++) {
        const int up = 4 - width * j;
        const __m256i bits = up >= 0 ? _mm256_slli_epi16(hv, up) : _mm256_srli_epi16(hv, -up);
        u[j] = _mm256_or_si256(u[j], _mm256_and_si256(bits, mask));
    }
}
#endif

/* The same for 4-bit weights w = q4 * wd + wm per block and output:
 * y = sum_b (wd * d[r, b]) * (q4 . q over block b) + sum_b wm * s[r, b]. */
static inline __attribute__((always_inline)) void group_q4_1(const uint8_t *w, const uint8_t *hi, const void *wdv,
                                                             const void *wmv, const int f32, const int8_t *q,
                                                             const float *d, const float *s, int k, int rows,
                                                             float out[TILE][LANES]) {
    /* f32 (a constant where inlined): the scales and mins are float32 (Q4_F32), else float16;
     * hi: the plane of fifth bits (Q5: values 0..31, still within maddubs' exact range), or NULL */
    const uint16_t *wd = wdv, *wm = wmv;
    const float *wdf = wdv, *wmf = wmv;
    const int blocks = k / QBLOCK;
#ifdef KAON_AVX2
    const __m256i low = _mm256_set1_epi8(0x0f);
    __m256 acc[TILE], mins[TILE];
    for (int r = 0; r < TILE; r++) acc[r] = mins[r] = _mm256_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        __m256i nib[8];
        if (rows <= 2 && ONE_PASS_AHEAD) {
            prefetch_ahead(w + (size_t)b * QBLOCK / 2 * LANES, QBLOCK / 2 * LANES);
            if (hi) prefetch_ahead(hi + (size_t)b * QBLOCK, QBLOCK);
        }
        split_nibbles((const __m256i *)(w + (size_t)b * QBLOCK / 2 * LANES), low, nib);
        if (hi)  /* bit t of each byte -> bit 4 of nib[t] */
            add_high_bits(nib, 8, _mm256_loadu_si256((const __m256i *)(hi + (size_t)b * QBLOCK)), 1);
        const __m256 scale = f32 ? _mm256_loadu_ps(wdf + (size_t)b * LANES)
                                 : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wd + (size_t)b * LANES)));
        const __m256 min = f32 ? _mm256_loadu_ps(wmf + (size_t)b * LANES)
                               : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wm + (size_t)b * LANES)));
        for (int r = 0; r < TILE; r++) {
            if (r >= rows) break;
            const int8_t *qb = q + (size_t)r * k + b * QBLOCK;
            /* nibbles t < 4: elements 4t.., t >= 4: 16 + 4(t - 4).., so q + 4t for every t; 5-bit values
             * (hi) take runs of 4 (dots_u8s8) */
            const __m256i sum = hi ? dots_u8s8(_mm256_setzero_si256(), nib, qb, 8, 4)
                                   : dots_u8s8(_mm256_setzero_si256(), nib, qb, 8, 8);
            const __m256 sd = _mm256_mul_ps(scale, _mm256_set1_ps(d[(size_t)r * blocks + b]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), sd, acc[r]);
            mins[r] = _mm256_fmadd_ps(min, _mm256_set1_ps(s[(size_t)r * blocks + b]), mins[r]);
        }
    }
    for (int r = 0; r < rows; r++) _mm256_storeu_ps(out[r], _mm256_add_ps(acc[r], mins[r]));
#else
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < LANES; c++) {
            float acc = 0.f, mins = 0.f;
            for (int b = 0; b < blocks; b++) {
                const uint8_t *wb = w + (size_t)b * QBLOCK / 2 * LANES;
                int32_t sum = 0;
                for (int t = 0; t < 4; t++)
                    for (int i = 0; i < 4; i++) {
                        uint8_t byte = wb[t * 32 + c * 4 + i], h = hi ? hi[(size_t)b * QBLOCK + c * 4 + i] : 0;
                        sum += ((byte & 0xf) | (((h >> t) & 1) << 4)) * q[(size_t)r * k + b * QBLOCK + 4 * t + i]
                             + ((byte >> 4) | (((h >> (t + 4)) & 1) << 4)) * q[(size_t)r * k + b * QBLOCK + 16 + 4 * t + i];
                    }
                const size_t at = (size_t)b * LANES + c;
                const float scale = f32 ? wdf[at] : half_to_float(wd[at]), min = f32 ? wmf[at] : half_to_float(wm[at]);
                acc = fmaf((float)sum, scale * d[(size_t)r * blocks + b], acc);
                mins = fmaf(min, s[(size_t)r * blocks + b], mins);
            }
            out[r][c] = acc + mins;
        }
#endif
}

/* int8 weights with a float32 scale (and optionally a min) per 16 elements, w = q8 * ws + wm:
 * two integer dot products per block (its halves), each with its own scale; the mins meet the
 * activations' half-block sums (slo: the first 16 elements' d * sum(q), s - slo the rest's).
 * Scales and mins are laid out [g][b][half][lane]. */
static inline __attribute__((always_inline)) void group_q8_g16(const int8_t *w, const float *ws, const float *wm,
                                                               const int8_t *q, const float *d, const float *s,
                                                               const float *slo, int k, int rows,
                                                               float out[TILE][LANES]) {
    const int blocks = k / QBLOCK;
#ifdef KAON_AVX2
    __m256 acc[TILE], mins[TILE];
    for (int r = 0; r < TILE; r++) acc[r] = mins[r] = _mm256_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const __m256i *wb = (const __m256i *)(w + (size_t)b * QBLOCK * LANES);
        if (rows <= 2 && ONE_PASS_AHEAD) prefetch_ahead(wb, QBLOCK * LANES);
        __m256i wv[8], aw[8];
        for (int t = 0; t < 8; t++) {
            wv[t] = _mm256_loadu_si256(wb + t);
            aw[t] = _mm256_sign_epi8(wv[t], wv[t]);  /* |w| as u8 (-128 reads 128), q takes w's sign */
        }
        const __m256 s0 = _mm256_loadu_ps(ws + (size_t)b * 2 * LANES), s1 = _mm256_loadu_ps(ws + ((size_t)b * 2 + 1) * LANES);
        for (int r = 0; r < TILE; r++) {
            if (r >= rows) break;
            const int8_t *qb = q + (size_t)r * k + b * QBLOCK;
            __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
            for (int t = 0; t < 4; t++)
                lo = dot_u8s8_acc(lo, aw[t], _mm256_sign_epi8(_mm256_set1_epi32(load_i32(qb + 4 * t)), wv[t]));
            for (int t = 4; t < 8; t++)
                hi = dot_u8s8_acc(hi, aw[t], _mm256_sign_epi8(_mm256_set1_epi32(load_i32(qb + 4 * t)), wv[t]));
            const __m256 dr = _mm256_set1_ps(d[(size_t)r * blocks + b]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_mul_ps(s0, dr), acc[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_mul_ps(s1, dr), acc[r]);
            if (wm) {
                const float a = slo[(size_t)r * blocks + b], z = s[(size_t)r * blocks + b] - a;
                mins[r] = _mm256_fmadd_ps(_mm256_loadu_ps(wm + (size_t)b * 2 * LANES), _mm256_set1_ps(a), mins[r]);
                mins[r] = _mm256_fmadd_ps(_mm256_loadu_ps(wm + ((size_t)b * 2 + 1) * LANES), _mm256_set1_ps(z), mins[r]);
            }
        }
    }
    for (int r = 0; r < rows; r++) _mm256_storeu_ps(out[r], _mm256_add_ps(acc[r], mins[r]));
#else
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < LANES; c++) {
            float acc = 0.f, mins = 0.f;
            for (int b = 0; b < blocks; b++) {
                int32_t sum[2] = {0, 0};
                for (int t = 0; t < 8; t++)
                    for (int i = 0; i < 4; i++)
                        sum[t / 4] += w[((size_t)b * 8 + t) * 32 + c * 4 + i] * q[(size_t)r * k + b * QBLOCK + 4 * t + i];
                const float dr = d[(size_t)r * blocks + b];
                for (int h = 0; h < 2; h++) {
                    const size_t at = ((size_t)b * 2 + h) * LANES + c;
                    acc = fmaf((float)sum[h], ws[at] * dr, acc);
                    if (wm) {
                        const float a = slo[(size_t)r * blocks + b];
                        mins = fmaf(wm[at], h ? s[(size_t)r * blocks + b] - a : a, mins);
                    }
                }
            }
            out[r][c] = acc + mins;
        }
#endif
}

/* 6-bit weights w = (u6 - 32) * ws per 16 elements (GGUF Q6_K): u6 = nibble | two high bits << 4,
 * u8 x s8 dots as Q4_1's (u6 <= 63 keeps maddubs exact), and the offset comes off exactly in
 * integers: 32 * sum(q) over each half block (qlo: the first half's, qs - qlo the second's). */
static inline __attribute__((always_inline)) void group_q6_g16(const uint8_t *w, const uint8_t *hi, const float *ws,
                                                               const int8_t *q, const float *d, const int32_t *qs,
                                                               const int32_t *qlo, int k, int rows,
                                                               float out[TILE][LANES]) {
    const int blocks = k / QBLOCK;
#ifdef KAON_AVX2
    const __m256i low = _mm256_set1_epi8(0x0f);
    __m256 acc[TILE];
    for (int r = 0; r < TILE; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const __m256i *hb = (const __m256i *)(hi + (size_t)b * 2 * QBLOCK);
        __m256i u[8];
        split_nibbles((const __m256i *)(w + (size_t)b * QBLOCK / 2 * LANES), low, u);
        for (int h = 0; h < 2; h++)  /* bits 2j, 2j + 1 of plane h -> bits 4, 5 of u[4h + j] */
            add_high_bits(u + 4 * h, 4, _mm256_loadu_si256(hb + h), 2);
        const __m256 s0 = _mm256_loadu_ps(ws + (size_t)b * 2 * LANES), s1 = _mm256_loadu_ps(ws + ((size_t)b * 2 + 1) * LANES);
        for (int r = 0; r < TILE; r++) {
            if (r >= rows) break;
            const int8_t *qb = q + (size_t)r * k + b * QBLOCK;
            const int32_t first = qlo[(size_t)r * blocks + b], second = qs[(size_t)r * blocks + b] - first;
            const __m256i lo = dots_u8s8(_mm256_set1_epi32(-32 * first), u, qb, 4, 2);
            const __m256i up = dots_u8s8(_mm256_set1_epi32(-32 * second), u + 4, qb + 16, 4, 2);
            const __m256 dr = _mm256_set1_ps(d[(size_t)r * blocks + b]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_mul_ps(s0, dr), acc[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(up), _mm256_mul_ps(s1, dr), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) _mm256_storeu_ps(out[r], acc[r]);
#else
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < LANES; c++) {
            float acc = 0.f;
            for (int b = 0; b < blocks; b++) {
                const uint8_t *wb = w + (size_t)b * QBLOCK / 2 * LANES, *hb = hi + (size_t)b * 2 * QBLOCK;
                int32_t sum[2] = {0, 0};
                for (int t = 0; t < 8; t++)
                    for (int i = 0; i < 4; i++) {
                        const uint8_t byte = wb[(t % 4) * 32 + c * 4 + i], h = hb[(t / 4) * 32 + c * 4 + i];
                        const int u6 = (t < 4 ? byte & 0xf : byte >> 4) | (((h >> (2 * (t % 4))) & 3) << 4);
                        const int e = t < 4 ? 4 * t + i : 16 + 4 * (t - 4) + i;
                        sum[e / 16] += (u6 - 32) * q[(size_t)r * k + b * QBLOCK + e];
                    }
                const float dr = d[(size_t)r * blocks + b];
                for (int h = 0; h < 2; h++) acc = fmaf((float)sum[h], ws[((size_t)b * 2 + h) * LANES + c] * dr, acc);
            }
            out[r][c] = acc;
        }
#endif
}

/* ---- the two activation passes side by side in 512-bit registers -----------------------
 * With KAON_CPU_ACTIVATIONS=int8x2 each activation row is two quantized rows (the block and its
 * remainder), which above cost two passes of 256-bit dot products: batched decode paid 25-40%.
 * With AVX-512 (VNNI and BW) a 512-bit register holds both: lane 2c is output c's first pass,
 * lane 2c + 1 its remainder's, the weights' dwords duplicated into both (one permute per weight
 * vector per block, shared by the tile's rows) and the two passes' four bytes of activations
 * side by side in memory (the "pair" layout kaon_linear makes: [row][block][t][pass][4]), so one
 * 64-bit broadcast feeds both. Every lane computes exactly what the 256-bit path computes for
 * that quantized row and output (the same integer sums, the same float operations in the same
 * order), and the lanes are split back into the two quantized rows before linear_chunk adds
 * them: the bits equal the AVX2 and scalar paths' (test_cpu_decode_build.py checks). Zen 4 runs
 * 512-bit operations in two halves, so there it saves the broadcasts and scalar work only;
 * Intel's cores with two 512-bit ports do both passes for about the price of one. */
#define PAIRS_TILE 4  /* activation rows (pairs of quantized rows) per pass over a group's weights */
#if defined(KAON_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define KAON_PAIRS 1

static inline __m512i dup_lanes(__m256i v) {  /* dwords [a b c ..] -> [a a b b c c ..] */
    return _mm512_permutexvar_epi32(_mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0),
                                    _mm512_castsi256_si512(v));
}
static inline __m512 dup_lanes_ps(__m256 v) { return _mm512_castsi512_ps(dup_lanes(_mm256_castps_si256(v))); }
static inline __m512 load_pair_ps(const float *p) {  /* (p[0], p[1]) in every pair of lanes */
    double v; memcpy(&v, p, sizeof v); return _mm512_castpd_ps(_mm512_set1_pd(v));
}
static inline __m512i load_pair_q(const int8_t *p) { int64_t v; memcpy(&v, p, sizeof v); return _mm512_set1_epi64(v); }

/* The even lanes (first passes) to out[0], the odd ones to out[1]. */
static inline void split_pair(__m512 v, float *first, float *second) {
    const __m512 parted = _mm512_permutexvar_ps(
        _mm512_set_epi32(15, 13, 11, 9, 7, 5, 3, 1, 14, 12, 10, 8, 6, 4, 2, 0), v);
    _mm256_storeu_ps(first, _mm512_castps512_ps256(parted));
    _mm256_storeu_ps(second, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(parted), 1)));
}

/* group_int8 for `rows` (<= PAIRS_TILE) activation rows in pairs: qp/dp/qsp the pair layouts. */
static inline __attribute__((always_inline)) void group_int8_pairs(const int8_t *w, const float *scales,
                                                                   const int8_t *qp, const float *dp,
                                                                   const int32_t *qsp, int k, int rows,
                                                                   float out[][LANES]) {
    const int blocks = k / QBLOCK;
    __m512 acc[PAIRS_TILE];
    for (int r = 0; r < PAIRS_TILE; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const __m256i *wb = (const __m256i *)(w + (size_t)b * QBLOCK * LANES);
        __m512i wv[8];
        for (int t = 0; t < 8; t++)  /* w + 128 as group_int8's VNNI path: the -128 sum(q) term below */
            wv[t] = _mm512_xor_si512(dup_lanes(_mm256_loadu_si256(wb + t)), _mm512_set1_epi8((char)0x80));
        for (int r = 0; r < PAIRS_TILE; r++) {
            if (r >= rows) break;
            const size_t at = (size_t)r * blocks + b;
            const int8_t *qb = qp + at * 2 * QBLOCK;
            const uint64_t first = (uint32_t)(-128 * qsp[2 * at]), second = (uint32_t)(-128 * qsp[2 * at + 1]);
            __m512i sum = _mm512_set1_epi64((int64_t)(first | second << 32));
            for (int t = 0; t < 8; t++) sum = _mm512_dpbusd_epi32(sum, wv[t], load_pair_q(qb + 8 * t));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), load_pair_ps(dp + 2 * at), acc[r]);
        }
    }
    const __m512 sc = dup_lanes_ps(_mm256_loadu_ps(scales));
    for (int r = 0; r < rows; r++) split_pair(_mm512_mul_ps(acc[r], sc), out[2 * r], out[2 * r + 1]);
}

/* group_q4_1 (Q4_1, Q4_F32, Q5, Q5_F32) in pairs; sp: the pair layout of s. */
static inline __attribute__((always_inline)) void group_q4_1_pairs(const uint8_t *w, const uint8_t *hi,
                                                                   const void *wdv, const void *wmv, const int f32,
                                                                   const int8_t *qp, const float *dp,
                                                                   const float *sp, int k, int rows,
                                                                   float out[][LANES]) {
    const uint16_t *wd = wdv, *wm = wmv;
    const float *wdf = wdv, *wmf = wmv;
    const int blocks = k / QBLOCK;
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512 acc[PAIRS_TILE], mins[PAIRS_TILE];
    for (int r = 0; r < PAIRS_TILE; r++) acc[r] = mins[r] = _mm512_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const __m256i *wb = (const __m256i *)(w + (size_t)b * QBLOCK / 2 * LANES);
        __m512i nib[8];
        for (int t = 0; t < 4; t++) {  /* as split_nibbles */
            const __m512i raw = dup_lanes(_mm256_loadu_si256(wb + t));
            nib[t] = _mm512_and_si512(raw, low);
            nib[t + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
        }
        if (hi) {  /* as add_high_bits(nib, 8, ., 1): bit t of each byte -> bit 4 of nib[t] */
            const __m512i hv = dup_lanes(_mm256_loadu_si256((const __m256i *)(hi + (size_t)b * QBLOCK)));
            const __m512i mask = _mm512_set1_epi8(0x10);
            for (int t = 0; t < 8; t++) {
                const int up = 4 - t;
                const __m512i bits = up >= 0 ? _mm512_slli_epi16(hv, up) : _mm512_srli_epi16(hv, -up);
                nib[t] = _mm512_or_si512(nib[t], _mm512_and_si512(bits, mask));
            }
        }
        const __m512 scale = dup_lanes_ps(f32 ? _mm256_loadu_ps(wdf + (size_t)b * LANES)
                                              : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wd + (size_t)b * LANES))));
        const __m512 min = dup_lanes_ps(f32 ? _mm256_loadu_ps(wmf + (size_t)b * LANES)
                                            : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wm + (size_t)b * LANES))));
        for (int r = 0; r < PAIRS_TILE; r++) {
            if (r >= rows) break;
            const size_t at = (size_t)r * blocks + b;
            const int8_t *qb = qp + at * 2 * QBLOCK;
            __m512i sum = _mm512_setzero_si512();
            for (int t = 0; t < 8; t++) sum = _mm512_dpbusd_epi32(sum, nib[t], load_pair_q(qb + 8 * t));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(scale, load_pair_ps(dp + 2 * at)), acc[r]);
            mins[r] = _mm512_fmadd_ps(min, load_pair_ps(sp + 2 * at), mins[r]);
        }
    }
    for (int r = 0; r < rows; r++) split_pair(_mm512_add_ps(acc[r], mins[r]), out[2 * r], out[2 * r + 1]);
}

/* ---- batch 1: the two passes as the two halves of a 512-bit register --------------------
 * One activation row (batch-1 decode) reads each group's weights for one quantized row pair only,
 * and in the pair layout above every weight vector then paid a lane-duplicating permute (the
 * shuffle port, beside the dot products' ports). Here lanes 0-7 are the first pass's eight outputs
 * and lanes 8-15 the remainder's: the weights' 32 bytes are broadcast into both halves straight
 * from memory (a load, no shuffle), and the activations, shared by every group, are laid out once
 * per projection as whole 64-byte vectors (HalfRow). Each lane does the pair kernels' integer sums
 * (exact) and float operations in their order, so the bits are the pair kernels' and the tiles'
 * (test_cpu_decode_invariance.py checks every path against the others). Q8_G16 (the vocabulary
 * head) gets the same: at batch 1 with two passes it ran the two-row 256-bit kernel. */
typedef struct {
    const int8_t *q;       /* [block][t][64]: bytes 4t..4t+3 of the first pass x8, then the second's x8 */
    const float *d, *s;    /* [block][16]: the first pass's x8, then the second's */
    const int32_t *q0;     /* [block][16] int8: -128 qs; Q8_G16: -128 sum(q) over the first half block */
    const int32_t *q1;     /* [block][16] Q8_G16: -128 sum(q) over the second half */
    const float *a, *z;    /* [block][16] Q8_G16 with mins: slo and s - slo (group_q8_g16's a, z) */
} HalfRow;

static inline __m512i halves_i(const void *p) { return _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)p)); }
static inline __m512 halves_ps(const float *p) {
    return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(p))));
}
static inline void split_halves(__m512 v, float *first, float *second) {
    _mm256_storeu_ps(first, _mm512_castps512_ps256(v));
    _mm256_storeu_ps(second, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

/* HalfRow from quantize_passes' layout of one activation row (q, d, s, qs: rows 0 and 1). */
static void half_row(const int8_t *q, const float *d, const float *s, const int32_t *qs, int k, int g16,
                     int8_t *hq, float *hd, float *hs, int32_t *h0, int32_t *h1, float *ha, float *hz) {
    const int blocks = k / QBLOCK;
    for (int b = 0; b < blocks; b++) {
        for (int pass = 0; pass < 2; pass++) {
            const int8_t *qb = q + (size_t)pass * k + (size_t)b * QBLOCK;
            const size_t at = (size_t)pass * blocks + b, lane = (size_t)b * 16 + 8 * pass;
            for (int t = 0; t < 8; t++)
                _mm256_storeu_si256((__m256i *)(hq + ((size_t)b * 8 + t) * 64 + 32 * pass),
                                    _mm256_set1_epi32(load_i32(qb + 4 * t)));
            int lo = 0;  /* Q8_G16: sum(q) over the first half block */
            for (int i = 0; g16 && i < QBLOCK / 2; i++) lo += qb[i];
            const float slo = d[at] * (float)lo;  /* kaon_linear's slo */
            _mm256_storeu_ps(hd + lane, _mm256_set1_ps(d[at]));
            _mm256_storeu_ps(hs + lane, _mm256_set1_ps(s[at]));
            _mm256_storeu_si256((__m256i *)(h0 + lane), _mm256_set1_epi32(-128 * (g16 ? lo : qs[at])));
            if (g16) {
                _mm256_storeu_si256((__m256i *)(h1 + lane), _mm256_set1_epi32(-128 * (qs[at] - lo)));
                _mm256_storeu_ps(ha + lane, _mm256_set1_ps(slo));
                _mm256_storeu_ps(hz + lane, _mm256_set1_ps(s[at] - slo));
            }
        }
    }
}

static inline __attribute__((always_inline)) void group_int8_halves(const int8_t *w, const float *scales,
                                                                    const HalfRow *h, int k, float out[][LANES]) {
    const int blocks = k / QBLOCK;
    __m512 acc = _mm512_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const int8_t *wb = w + (size_t)b * QBLOCK * LANES;
        const int8_t *qb = h->q + (size_t)b * 8 * 64;
        prefetch_ahead(wb, QBLOCK * LANES);
        __m512i sum = _mm512_loadu_si512(h->q0 + (size_t)b * 16);
        for (int t = 0; t < 8; t++)  /* w + 128 as group_int8_pairs: the -128 sum(q) start above */
            sum = _mm512_dpbusd_epi32(sum, _mm512_xor_si512(halves_i(wb + 32 * t), _mm512_set1_epi8((char)0x80)),
                                      _mm512_loadu_si512(qb + 64 * t));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_loadu_ps(h->d + (size_t)b * 16), acc);
    }
    split_halves(_mm512_mul_ps(acc, halves_ps(scales)), out[0], out[1]);
}

static inline __attribute__((always_inline)) void group_q4_1_halves(const uint8_t *w, const uint8_t *hi,
                                                                     const void *wdv, const void *wmv, const int f32,
                                                                     const HalfRow *h, int k, float out[][LANES]) {
    const uint16_t *wd = wdv, *wm = wmv;
    const float *wdf = wdv, *wmf = wmv;
    const int blocks = k / QBLOCK;
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512 acc = _mm512_setzero_ps(), mins = _mm512_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const uint8_t *wb = w + (size_t)b * QBLOCK / 2 * LANES;
        const int8_t *qb = h->q + (size_t)b * 8 * 64;
        prefetch_ahead(wb, QBLOCK / 2 * LANES);
        if (hi) prefetch_ahead(hi + (size_t)b * QBLOCK, QBLOCK);
        __m512i nib[8];
        for (int t = 0; t < 4; t++) {  /* as split_nibbles */
            const __m512i raw = halves_i(wb + 32 * t);
            nib[t] = _mm512_and_si512(raw, low);
            nib[t + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
        }
        if (hi) {  /* as add_high_bits(nib, 8, ., 1) */
            const __m512i hv = halves_i(hi + (size_t)b * QBLOCK);
            const __m512i mask = _mm512_set1_epi8(0x10);
            for (int t = 0; t < 8; t++) {
                const int up = 4 - t;
                const __m512i bits = up >= 0 ? _mm512_slli_epi16(hv, up) : _mm512_srli_epi16(hv, -up);
                nib[t] = _mm512_or_si512(nib[t], _mm512_and_si512(bits, mask));
            }
        }
        const __m512 scale = f32 ? halves_ps(wdf + (size_t)b * LANES)
                                 : _mm512_cvtph_ps(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(wd + (size_t)b * LANES))));
        const __m512 min = f32 ? halves_ps(wmf + (size_t)b * LANES)
                               : _mm512_cvtph_ps(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(wm + (size_t)b * LANES))));
        __m512i sum = _mm512_setzero_si512();
        for (int t = 0; t < 8; t++) sum = _mm512_dpbusd_epi32(sum, nib[t], _mm512_loadu_si512(qb + 64 * t));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(scale, _mm512_loadu_ps(h->d + (size_t)b * 16)), acc);
        mins = _mm512_fmadd_ps(min, _mm512_loadu_ps(h->s + (size_t)b * 16), mins);
    }
    split_halves(_mm512_add_ps(acc, mins), out[0], out[1]);
}

/* group_q8_g16 for the two passes of one row; its integer sums by the w + 128 start (exact, so the
 * same sums as its sign trick). */
static inline __attribute__((always_inline)) void group_q8_g16_halves(const int8_t *w, const float *ws,
                                                                       const float *wm, const HalfRow *h, int k,
                                                                       float out[][LANES]) {
    const int blocks = k / QBLOCK;
    __m512 acc = _mm512_setzero_ps(), mins = _mm512_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const int8_t *wb = w + (size_t)b * QBLOCK * LANES;
        const int8_t *qb = h->q + (size_t)b * 8 * 64;
        prefetch_ahead(wb, QBLOCK * LANES);
        __m512i lo = _mm512_loadu_si512(h->q0 + (size_t)b * 16), hi = _mm512_loadu_si512(h->q1 + (size_t)b * 16);
        for (int t = 0; t < 4; t++)
            lo = _mm512_dpbusd_epi32(lo, _mm512_xor_si512(halves_i(wb + 32 * t), _mm512_set1_epi8((char)0x80)),
                                     _mm512_loadu_si512(qb + 64 * t));
        for (int t = 4; t < 8; t++)
            hi = _mm512_dpbusd_epi32(hi, _mm512_xor_si512(halves_i(wb + 32 * t), _mm512_set1_epi8((char)0x80)),
                                     _mm512_loadu_si512(qb + 64 * t));
        const __m512 dr = _mm512_loadu_ps(h->d + (size_t)b * 16);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_mul_ps(halves_ps(ws + (size_t)b * 2 * LANES), dr), acc);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_mul_ps(halves_ps(ws + ((size_t)b * 2 + 1) * LANES), dr), acc);
        if (wm) {
            mins = _mm512_fmadd_ps(halves_ps(wm + (size_t)b * 2 * LANES), _mm512_loadu_ps(h->a + (size_t)b * 16), mins);
            mins = _mm512_fmadd_ps(halves_ps(wm + ((size_t)b * 2 + 1) * LANES), _mm512_loadu_ps(h->z + (size_t)b * 16), mins);
        }
    }
    split_halves(_mm512_add_ps(acc, mins), out[0], out[1]);
}
#endif

/* Whether kind runs in pairs (above) when its activations take two passes. */
static inline int pairs_kind(int kind) {
#ifdef KAON_PAIRS
    return kind == KIND_INT8 || kind == KIND_Q4_1 || kind == KIND_Q4_F32 || kind == KIND_Q5 || kind == KIND_Q5_F32;
#else
    (void)kind;
    return 0;
#endif
}

/* ---- a pool of worker threads ----------------------------------------------------------
 * Why not OpenMP: its parallel regions end in a barrier that waits for every thread, so when
 * another thread of the process (the server's event loop, the tokenizer) takes a core for a
 * moment, a whole region waits for the thread it pushed off, and a decode step has ~150
 * regions: served at batch 1 on 2 cores a step took twice its offline time. Here the caller
 * works through the chunks itself and waits only for chunks a worker has already claimed;
 * a worker that is not running claims nothing and delays nothing. */

typedef void (*chunk_fn)(const void *ctx, int begin, int end);

#define MAX_WORKERS 63
/* Between the jobs of one decode step (`hold` set) a worker spins for the next job: they come
 * microseconds apart. Otherwise it spins briefly and sleeps: between steps torch runs the
 * sampler and any prefill on its own threads, and a spinning worker would slow them. */
#define SPIN_ROUNDS 1000

/* Past SPIN_ROUNDS a waiting thread yields its core on every round instead of spinning on.
 * Why: on a machine with more runnable threads than cores (other processes, or two engines
 * sharing cores) the thread waited for is often not running: a worker preempted with a chunk
 * claimed, or the caller preempted between jobs while a worker holds its spin. A spinning
 * waiter then burns the rest of its time slice (milliseconds) on the core that thread needs,
 * and a step of ~150 jobs paid it again and again: measured under load ~12 on 2 cores, a
 * 4-sequence decode step took 140-320 ms on 2 threads against ~60 ms on 1 (bench/history/
 * engine_contention.md). A 1 ms timer on the server's event loop hid part of it (its wakeups
 * preempt the spinner, so the waited-for thread runs sooner): that was the "timer effect".
 * sched_yield returns at once when nothing else wants the core, so a quiet machine keeps the
 * spin's microsecond hand-offs. kaon_pool_set_yield(0) restores pure spinning (the A/B bench). */
static atomic_int yield_waits = 1;
static atomic_long yields;  /* rounds that yielded, for the tests */

static void pause_cpu(void);

/* One round of a wait for another pool thread; `spins` counts this wait's rounds. */
static void wait_round(int *spins) {
    if (*spins < SPIN_ROUNDS || !atomic_load_explicit(&yield_waits, memory_order_relaxed)) {
        (*spins)++;
        pause_cpu();
        return;
    }
    atomic_fetch_add_explicit(&yields, 1, memory_order_relaxed);
    sched_yield();
}

void kaon_pool_set_yield(int on) { atomic_store(&yield_waits, on != 0); }
long kaon_pool_yields(void) { return atomic_load(&yields); }

static struct {
    pthread_mutex_t jobs, mutex;
    pthread_cond_t wake;
    int workers;              /* started so far */
    /* Each counter on its own cache line: workers spin reading `generation` while the
     * caller and they bump `next` and `done`. */
    _Alignas(64) atomic_int generation;  /* odd while a job is being set up, even when it may run */
    _Alignas(64) atomic_int sleeping;
    _Alignas(64) atomic_int hold;  /* set for the length of a decode step */
    _Alignas(64) atomic_int active;
    _Alignas(64) atomic_int next;
    _Alignas(64) atomic_int done;
    _Alignas(64) chunk_fn fn;  /* the job: fn(ctx, i, j) over [0, total) in chunks of `chunk` */
    const void *ctx;
    int total, chunk, helpers;
} pool = {.jobs = PTHREAD_MUTEX_INITIALIZER, .mutex = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER};

static void pause_cpu(void) {
#ifdef KAON_AVX2
    _mm_pause();
#endif
}

static void run_chunks(void) {
    for (;;) {
        int begin = atomic_fetch_add(&pool.next, pool.chunk);
        if (begin >= pool.total) return;
        int end = begin + pool.chunk < pool.total ? begin + pool.chunk : pool.total;
        pool.fn(pool.ctx, begin, end);
        atomic_fetch_add(&pool.done, end - begin);
    }
}

static void *worker(void *arg) {
    const int index = (int)(intptr_t)arg;
    int seen = 0;
    for (;;) {
        int g = atomic_load(&pool.generation);
        for (int spins = 0; g == seen || (g & 1); g = atomic_load(&pool.generation)) {
            if (spins < SPIN_ROUNDS || atomic_load(&pool.hold)) { wait_round(&spins); continue; }
            pthread_mutex_lock(&pool.mutex);
            atomic_fetch_add(&pool.sleeping, 1);
            while ((g = atomic_load(&pool.generation)) == seen || (g & 1))
                pthread_cond_wait(&pool.wake, &pool.mutex);
            atomic_fetch_sub(&pool.sleeping, 1);
            pthread_mutex_unlock(&pool.mutex);
            break;
        }
        seen = g;
        if (index >= pool.helpers) continue;
        atomic_fetch_add(&pool.active, 1);
        if (atomic_load(&pool.generation) == g) run_chunks();  /* else the job is over and being replaced */
        atomic_fetch_sub(&pool.active, 1);
    }
    return NULL;
}

/* fn over [0, total) on the caller and up to threads - 1 workers. */
static void parallel_for(int total, int threads, chunk_fn fn, const void *ctx) {
    int helpers = threads - 1 < MAX_WORKERS ? threads - 1 : MAX_WORKERS;
    if (helpers <= 0 || total <= 1) { fn(ctx, 0, total); return; }
    pthread_mutex_lock(&pool.jobs);  /* one job at a time, whichever thread calls (two engines in a process) */
    while (pool.workers < helpers) {
        pthread_t thread;
        if (pthread_create(&thread, NULL, worker, (void *)(intptr_t)pool.workers) != 0) break;
        pthread_detach(thread);
        pool.workers++;
    }
    atomic_fetch_add(&pool.generation, 1);  /* odd: workers keep off while the job is rewritten */
    for (int spins = 0; atomic_load(&pool.active);) wait_round(&spins);
    pool.fn = fn; pool.ctx = ctx; pool.total = total; pool.helpers = helpers;
    pool.chunk = total / ((helpers + 1) * 8) > 0 ? total / ((helpers + 1) * 8) : 1;
    atomic_store(&pool.next, 0);
    atomic_store(&pool.done, 0);
    atomic_fetch_add(&pool.generation, 1);
    if (atomic_load(&pool.sleeping)) {
        pthread_mutex_lock(&pool.mutex);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.mutex);
    }
    run_chunks();
    for (int spins = 0; atomic_load(&pool.done) < total;) wait_round(&spins);
    pthread_mutex_unlock(&pool.jobs);
}

/* y [rows, n] = x [rows, k] @ W.T (+ bias) on `threads` threads (torch's count).
 * work: room for kaon_linear_workspace(k, rows) bytes. */
size_t kaon_linear_workspace(int k, int rows) {
    /* k: the inputs' true width (k_in). Weights packed to whole blocks read k rounded up to QBLOCK, their rows first
     * copied zero-padded to it (kaon_linear): room for that copy ahead of the rest where k is not whole blocks. */
    const size_t padded_copy = k % QBLOCK ? ((size_t)rows * (k + QBLOCK - k % QBLOCK) * sizeof(float) + 63) & ~(size_t)63
                                          : 0;
    k += -k & (QBLOCK - 1);
    /* room for two int8 passes of every row (act_passes 2), and their pair layout (KAON_PAIRS); FP8_A8's
     * rounded rows (4 bytes a value) and INT8_A8's int8 rows with their scales and INT8_S8's int16 rows fit in the first two terms */
    return padded_copy + 2 * (size_t)rows * ((size_t)k + 5 * sizeof(float) * (k / QBLOCK))
           + 2 * (size_t)rows * ((size_t)k + 3 * sizeof(float) * (k / QBLOCK)) + 128
           + (size_t)(k / QBLOCK) * (8 * 64 + 6 * 16 * sizeof(float)) + 64;  /* HalfRow (KAON_PAIRS, batch 1) */
}

typedef struct {
    const Linear *l;
    int rows;               /* quantized rows: passes per activation row */
    int passes;
    const float *x;
    const int8_t *q;        /* x in int8 blocks, for the narrow weights */
    const float *d, *s;
    const int32_t *qs;
    const float *slo;       /* Q8_G16 with mins: d * sum(q) over each block's first 16 elements */
    const int32_t *qlo;     /* Q6_G16: sum(q) over each block's first 16 elements */
    const int8_t *qp;       /* two passes in pairs (KAON_PAIRS): q, d, s, qs as [row][block][(t)][pass] */
    const float *dp, *sp;
    const int32_t *qsp;
    float *y;
    int amx;                /* KAON_AMX: two passes of many rows in AMX tiles (q, d, s as quantize_passes) */
    const void *half;       /* KAON_PAIRS: a HalfRow, the two passes of one activation row (batch 1) */
} LinearJob;

/* ---- AMX: the two passes of many rows at once (Intel AMX-INT8; not Zen 4) ---------------
 * With two passes the pair kernels above still do twice the integer dot products of one pass,
 * so a batched decode step or a prompt chunk paid ~40-50% more in its projections. An AMX tile
 * instruction multiplies up to 16 quantized rows by 16 outputs over a block of 32 in one go
 * (TDPBSUD: int8 activations x the 4-bit weights as bytes; TDPBSSD for int8 weights), so the
 * second pass's integer work nearly disappears. The integer block sums are exact, the same as
 * VNNI's, and every lane then does the pair kernel's float operations in its order (per block
 * fma(sum, scale * d, acc), fma(min, s, mins); acc + mins per pass; the passes summed in
 * linear_chunk), so the bits equal the other paths' and a row's result still depends on that row
 * alone, whichever path its step's row count picks (test_cpu_decode_invariance.py checks).
 * Used from AMX_MIN_ROWS activation rows up (batch 1 stays on the pair kernels: one row would
 * use a sixteenth of a tile); the kernel asks Linux for the tile state once (arch_prctl) and
 * falls back to the pair kernels where that fails. */
#if defined(KAON_PAIRS) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define KAON_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#define AMX_MIN_ROWS 4      /* activation rows */
#define AMX_TILE_ROWS 16    /* quantized rows per tile */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

static atomic_int amx_permitted = -1;  /* -1: not asked yet */
static atomic_int amx_wanted = -1;     /* kaon_set_amx (the tests' and bench's A/B), else KAON_CPU_AMX=0 turns it off */

static int amx_permission(void) {  /* asked once per process: it covers every thread */
    int state = atomic_load(&amx_permitted);
    if (state < 0) {
        state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
        atomic_store(&amx_permitted, state);
    }
    return state;
}
static int amx_usable(void) {
    int wanted = atomic_load(&amx_wanted);
    if (wanted < 0) {
        const char *env = getenv("KAON_CPU_AMX");
        wanted = !(env && (strcmp(env, "0") == 0 || strcmp(env, "off") == 0));
        atomic_store(&amx_wanted, wanted);
    }
    return wanted && amx_permission();
}

/* tmm0 and tmm3: C (m rows of 16 int32), tmm1 and tmm4: A (m rows of `bytes` int8: a block's 32, or
 * a half block's 16), tmm2 and tmm5: B (bytes / 4 rows of 16 outputs x 4 bytes); tmm6 and tmm7 (when
 * rest > 0): C and A of `rest` rows, a shorter last tile (B: tmm2). */
static inline void amx_configure(int m, int rest, int bytes) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int set = 0; set < 6; set += 3) {
        cfg.rows[set] = (uint8_t)m; cfg.colsb[set] = 64;
        cfg.rows[set + 1] = (uint8_t)m; cfg.colsb[set + 1] = (uint16_t)bytes;
        cfg.rows[set + 2] = (uint8_t)(bytes / 4); cfg.colsb[set + 2] = 64;
    }
    if (rest > 0) {
        cfg.rows[6] = (uint8_t)rest; cfg.colsb[6] = 64;
        cfg.rows[7] = (uint8_t)rest; cfg.colsb[7] = (uint16_t)bytes;
    }
    _tile_loadconfig(&cfg);
}

/* Two groups' eight-lane words side by side (the second group's half zero where there is none). */
static inline __m512i two_groups(const void *a, const void *b) {
    const __m256i lo = _mm256_loadu_si256((const __m256i *)a);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), b ? _mm256_loadu_si256((const __m256i *)b)
                                                                : _mm256_setzero_si256(), 1);
}
static inline __m512 two_groups_ps(__m256 a, __m256 b) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(a)), _mm256_castps_pd(b), 1));
}
static inline __m256 load8_scales(const void *p, size_t at, int f32) {  /* eight scales or mins */
    if (!p) return _mm256_setzero_ps();
    return f32 ? _mm256_loadu_ps((const float *)p + at)
               : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + at)));
}

/* Outputs of groups g and g + 1 (g + 1 < groups or not) for quantized rows [0, m) (m <= AMX_SPAN,
 * even: both passes of each activation row): v[i][c] for quantized row i, output 8g + c (c < 16).
 * q, d, s: quantize_passes' layout (row 2r the first pass of activation row r, 2r + 1 its
 * remainder's). A slice of blocks at a time: its weights unpacked into B tiles once, then for each
 * tile of 16 quantized rows (a shorter last one: tiles 6 and 7, see amx_configure) the tiles'
 * integer sums of every block of the slice (two sets of tiles in turn, so a block's dot product
 * runs while the other's sums are stored), then the float work row by row over the slice.
 * Before, every 16 rows unpacked (nibble split) and read the weights again; now every AMX_SPAN rows:
 * bench/cpu_projections.py --rows 16 64 --layers 30, two passes, CPU time under load ~9: 16 rows
 * (batch 16) 9-15% less time, 64 rows (a prompt piece) 2-5% less. 128 rows per span was 12% slower
 * than 64 at 64 rows (each unit then read 32 KB of activation tiles per slice from L2); 32 as 64. */
#define AMX_SLICE 8  /* blocks: sums 8 KB, weights 4 KB (16 and 24 were 10-20% slower at 16-64 rows: bench/cpu_projections.py) */
#define AMX_SPAN 64  /* quantized rows per amx_groups call: four tiles, their slice of activations 16 KB */
static void amx_groups(const Linear *l, int g, int two, const int8_t *q, const float *d, const float *s, int m,
                       float v[][2 * LANES]) {
    const int k = l->k, blocks = k / QBLOCK;
    const int int8 = l->kind == KIND_INT8;
    const int f32 = l->kind == KIND_Q4_F32 || l->kind == KIND_Q5_F32;
    const int five = l->kind == KIND_Q5 || l->kind == KIND_Q5_F32;
    const size_t wbytes = int8 ? (size_t)LANES * k : (size_t)LANES * k / 2;  /* a group's weights */
    const uint8_t *w0 = (const uint8_t *)l->w + (size_t)g * wbytes, *w1 = two ? w0 + wbytes : NULL;
    const uint8_t *h0 = five ? l->high + (size_t)g * LANES * k / 8 : NULL;
    const uint8_t *h1 = five && two ? h0 + (size_t)LANES * k / 8 : NULL;
    const void *wd = f32 ? (const void *)l->gscales : (const void *)l->d;
    const void *wm = f32 ? (const void *)l->gmins : (const void *)l->m;
    const size_t sg = (size_t)g * LANES * blocks;  /* group g's first scale */
    __m512 acc[AMX_SPAN], mins[AMX_SPAN];  /* set by the first slice (a zeroing loop here became a memset: 2.5%) */
    uint8_t bt[AMX_SLICE][QBLOCK / 4][64] __attribute__((aligned(64)));
    int32_t ct[AMX_SLICE][AMX_TILE_ROWS][16] __attribute__((aligned(64)));
    __m512 scale[AMX_SLICE], min[AMX_SLICE];
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int b0 = 0; b0 < blocks; b0 += AMX_SLICE) {
        const int nb = blocks - b0 < AMX_SLICE ? blocks - b0 : AMX_SLICE;
        for (int j = 0; j < nb; j++) {  /* the slice's weights as B tiles, and its scales */
            const int b = b0 + j;
            if (int8) {  /* [t][lane][4]: word t is B's row t */
                for (int t = 0; t < 8; t++)
                    _mm512_store_si512(bt[j][t], two_groups(w0 + ((size_t)b * 8 + t) * 32,
                                                            w1 ? w1 + ((size_t)b * 8 + t) * 32 : NULL));
                continue;
            }
            /* word t's low nibbles: elements 4t.., B's row t; its high ones: 16 + 4t.., row 4 + t */
            __m512i nib[8];
            for (int t = 0; t < 4; t++) {
                const size_t at = (size_t)b * QBLOCK / 2 * LANES + 32 * t;
                const __m512i raw = two_groups(w0 + at, w1 ? w1 + at : NULL);
                nib[t] = _mm512_and_si512(raw, low);
                nib[t + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
            }
            if (five) {  /* as add_high_bits(nib, 8, ., 1) */
                const __m512i hv = two_groups(h0 + (size_t)b * QBLOCK, h1 ? h1 + (size_t)b * QBLOCK : NULL);
                const __m512i mask = _mm512_set1_epi8(0x10);
                for (int t = 0; t < 8; t++) {
                    const int up = 4 - t;
                    const __m512i bits = up >= 0 ? _mm512_slli_epi16(hv, up) : _mm512_srli_epi16(hv, -up);
                    nib[t] = _mm512_or_si512(nib[t], _mm512_and_si512(bits, mask));
                }
            }
            for (int t = 0; t < 8; t++) _mm512_store_si512(bt[j][t], nib[t]);
            const size_t at = sg + (size_t)b * LANES, next = at + (size_t)LANES * blocks;
            scale[j] = two_groups_ps(load8_scales(wd, at, f32), two ? load8_scales(wd, next, f32) : _mm256_setzero_ps());
            min[j] = two_groups_ps(load8_scales(wm, at, f32), two ? load8_scales(wm, next, f32) : _mm256_setzero_ps());
        }
        for (int m0 = 0; m0 < m; m0 += AMX_TILE_ROWS) {
            const int8_t *qt = q + (size_t)m0 * k;
            const int rows = m - m0 < AMX_TILE_ROWS ? m - m0 : AMX_TILE_ROWS;
            /* tiles 0-2 and 3-5 in turn: C, A, B of one block (16 rows); a shorter last tile: 6, 7 and 2 */
#define AMX_BLOCK(C, A, B, j) do {                                             \
            _tile_loadd(B, bt[j], 64);                                         \
            _tile_loadd(A, qt + (size_t)(b0 + (j)) * QBLOCK, k);               \
            _tile_zero(C);                                                     \
            if (int8) _tile_dpbssd(C, A, B); else _tile_dpbsud(C, A, B);       \
            _tile_stored(C, ct[j], 64);                                        \
        } while (0)
            if (rows == AMX_TILE_ROWS) {
                int j = 0;
                for (; j + 1 < nb; j += 2) { AMX_BLOCK(0, 1, 2, j); AMX_BLOCK(3, 4, 5, j + 1); }
                if (j < nb) AMX_BLOCK(0, 1, 2, j);
            } else {
                for (int j = 0; j < nb; j++) AMX_BLOCK(6, 7, 2, j);
            }
#undef AMX_BLOCK
            for (int t = 0; t < rows; t += 2) {  /* the pair kernels' float operations, block by block; two
                                                  * rows at a time (m is even): independent chains hide the FMA latency */
                const int i = m0 + t;
                const __m512 zero = _mm512_setzero_ps();
                __m512 a0 = b0 ? acc[i] : zero, a1 = b0 ? acc[i + 1] : zero;
                __m512 n0 = b0 ? mins[i] : zero, n1 = b0 ? mins[i + 1] : zero;
                const float *d0 = d + (size_t)i * blocks + b0, *d1 = d0 + blocks;
                const float *s0 = s + (size_t)i * blocks + b0, *s1 = s0 + blocks;
                if (int8)  /* group_int8_pairs: acc = fma(sum, d, acc); the row scales at the end */
                    for (int jj = 0; jj < nb; jj++) {
                        a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(ct[jj][t])), _mm512_set1_ps(d0[jj]), a0);
                        a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(ct[jj][t + 1])), _mm512_set1_ps(d1[jj]), a1);
                    }
                else  /* group_q4_1_pairs */
                    for (int jj = 0; jj < nb; jj++) {
                        a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(ct[jj][t])),
                                             _mm512_mul_ps(scale[jj], _mm512_set1_ps(d0[jj])), a0);
                        a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(ct[jj][t + 1])),
                                             _mm512_mul_ps(scale[jj], _mm512_set1_ps(d1[jj])), a1);
                        n0 = _mm512_fmadd_ps(min[jj], _mm512_set1_ps(s0[jj]), n0);
                        n1 = _mm512_fmadd_ps(min[jj], _mm512_set1_ps(s1[jj]), n1);
                    }
                acc[i] = a0; acc[i + 1] = a1; mins[i] = n0; mins[i + 1] = n1;
            }
        }
    }
    if (int8) {
        const __m512 sc = two_groups_ps(_mm256_loadu_ps(l->scales + (size_t)g * LANES),
                                        two ? _mm256_loadu_ps(l->scales + (size_t)(g + 1) * LANES) : _mm256_setzero_ps());
        for (int i = 0; i < m; i++) _mm512_storeu_ps(v[i], _mm512_mul_ps(acc[i], sc));
    } else {
        for (int i = 0; i < m; i++) _mm512_storeu_ps(v[i], _mm512_add_ps(acc[i], mins[i]));
    }
}

/* The same for Q8_G16 (int8 weights, a float32 scale and optional min per 16 elements: the int8
 * copy of a quantized model's vocabulary head among others): each half block its own dot product,
 * tiles 0-2 the first 16 elements (A 16 bytes a row, B 4 rows), 3-5 the second; then
 * group_q8_g16's float operations in its order. */
static void amx_groups_g16(const Linear *l, int g, int two, const int8_t *q, const float *d, const float *s,
                           const float *slo, int m, float v[][2 * LANES]) {
    const int k = l->k, blocks = k / QBLOCK;
    const size_t wbytes = (size_t)LANES * k, sbytes = (size_t)LANES * blocks * 2;  /* a group's weights, scales */
    const int8_t *w0 = (const int8_t *)l->w + (size_t)g * wbytes, *w1 = two ? w0 + wbytes : NULL;
    const float *ws0 = l->gscales + (size_t)g * sbytes, *ws1 = two ? ws0 + sbytes : NULL;
    const float *wm0 = l->gmins ? l->gmins + (size_t)g * sbytes : NULL, *wm1 = wm0 && two ? wm0 + sbytes : NULL;
    __m512 acc[AMX_TILE_ROWS], mins[AMX_TILE_ROWS];
    for (int i = 0; i < m; i++) acc[i] = mins[i] = _mm512_setzero_ps();
    uint8_t bt[AMX_SLICE][QBLOCK / 4][64] __attribute__((aligned(64)));
    int32_t ct[AMX_SLICE][2][AMX_TILE_ROWS][16] __attribute__((aligned(64)));
    __m512 scale[AMX_SLICE][2], min[AMX_SLICE][2];
    const __m256 zero = _mm256_setzero_ps();
    for (int b0 = 0; b0 < blocks; b0 += AMX_SLICE) {
        const int nb = blocks - b0 < AMX_SLICE ? blocks - b0 : AMX_SLICE;
        for (int j = 0; j < nb; j++) {
            const int b = b0 + j;
            for (int t = 0; t < 8; t++)  /* [t][lane][4]: word t is B's row t (t < 4 the first half) */
                _mm512_store_si512(bt[j][t], two_groups(w0 + ((size_t)b * 8 + t) * 32,
                                                        w1 ? w1 + ((size_t)b * 8 + t) * 32 : NULL));
            for (int h = 0; h < 2; h++) {
                const size_t at = ((size_t)b * 2 + h) * LANES;
                scale[j][h] = two_groups_ps(_mm256_loadu_ps(ws0 + at), ws1 ? _mm256_loadu_ps(ws1 + at) : zero);
                min[j][h] = two_groups_ps(wm0 ? _mm256_loadu_ps(wm0 + at) : zero, wm1 ? _mm256_loadu_ps(wm1 + at) : zero);
            }
        }
        for (int j = 0; j < nb; j++) {
            const int8_t *qb = q + (size_t)(b0 + j) * QBLOCK;
            _tile_loadd(2, bt[j][0], 64);
            _tile_loadd(1, qb, k);
            _tile_zero(0);
            _tile_dpbssd(0, 1, 2);
            _tile_loadd(5, bt[j][4], 64);
            _tile_loadd(4, qb + QBLOCK / 2, k);
            _tile_zero(3);
            _tile_dpbssd(3, 4, 5);
            _tile_stored(0, ct[j][0], 64);
            _tile_stored(3, ct[j][1], 64);
        }
        for (int i = 0; i < m; i++) {
            __m512 a = acc[i], mn = mins[i];
            const size_t row = (size_t)i * blocks + b0;
            for (int j = 0; j < nb; j++) {
                const __m512 dr = _mm512_set1_ps(d[row + j]);
                a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(ct[j][0][i])), _mm512_mul_ps(scale[j][0], dr), a);
                a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(ct[j][1][i])), _mm512_mul_ps(scale[j][1], dr), a);
                if (wm0) {
                    const float lo = slo[row + j], hi = s[row + j] - lo;
                    mn = _mm512_fmadd_ps(min[j][0], _mm512_set1_ps(lo), mn);
                    mn = _mm512_fmadd_ps(min[j][1], _mm512_set1_ps(hi), mn);
                }
            }
            acc[i] = a; mins[i] = mn;
        }
    }
    for (int i = 0; i < m; i++) _mm512_storeu_ps(v[i], _mm512_add_ps(acc[i], mins[i]));
}

/* linear_chunk's AMX case: units are pairs of groups (16 outputs). */
static void amx_chunk(const LinearJob *job, int begin, int end) {
    const Linear *l = job->l;
    const int n = l->n, k = l->k, blocks = k / QBLOCK, groups = (n + LANES - 1) / LANES;
    const int halves = l->kind == KIND_Q8_G16;
    const int span = halves ? AMX_TILE_ROWS : AMX_SPAN;  /* quantized rows per amx_groups(_g16) call */
    float v[AMX_SPAN][2 * LANES];
    int configured = 0;
    for (int m0 = 0; m0 < job->rows; m0 += span) {  /* rows outside: the tiles' shape changes at most once */
        const int m = job->rows - m0 < span ? job->rows - m0 : span;
        const int shape = halves ? m + 1024 : (m % AMX_TILE_ROWS) + 64 * (m >= AMX_TILE_ROWS);
        if (shape != configured) {
            if (halves) amx_configure(m, 0, QBLOCK / 2);
            else amx_configure(AMX_TILE_ROWS, m % AMX_TILE_ROWS, QBLOCK);
            configured = shape;
        }
        for (int unit = begin; unit < end; unit++) {
            const int g = 2 * unit, two = g + 1 < groups;
            if (halves)
                amx_groups_g16(l, g, two, job->q + (size_t)m0 * k, job->d + (size_t)m0 * blocks,
                               job->s + (size_t)m0 * blocks, job->slo + (size_t)m0 * blocks, m, v);
            else
                amx_groups(l, g, two, job->q + (size_t)m0 * k, job->d + (size_t)m0 * blocks,
                           job->s + (size_t)m0 * blocks, m, v);
            const int j = g * LANES, width = n - j < 2 * LANES ? n - j : 2 * LANES;
            const __mmask16 keep = (__mmask16)((1u << width) - 1);
            for (int i = 0; i < m; i += 2) {  /* as linear_chunk: the passes summed, then the bias */
                __m512 sum = _mm512_add_ps(_mm512_loadu_ps(v[i]), _mm512_loadu_ps(v[i + 1]));
                if (l->bias) sum = _mm512_add_ps(sum, _mm512_maskz_loadu_ps(keep, l->bias + j));
                _mm512_mask_storeu_ps(job->y + (size_t)((m0 + i) / 2) * n + j, keep, sum);
            }
        }
    }
    if (configured) _tile_release();
}
#endif

/* Whether the AMX path is on where this build has it (1: the default); off, the pair kernels run
 * every row count (the tests' and the bench's comparison). Returns whether this build and kernel have it. */
int kaon_set_amx(int on) {
#ifdef KAON_AMX
    atomic_store(&amx_wanted, on != 0);
    return amx_permission();
#else
    (void)on;
    return 0;
#endif
}

/* Whether batch 1's two passes take HalfRow's kernels where this build has them (1: the default);
 * off, the pair kernels run (the tests' and bench's A/B; the bits are the same). Returns whether the
 * build has them. */
static atomic_int kaon_halves_on = 1;
int kaon_set_halves(int on) {
    atomic_store(&kaon_halves_on, on != 0);
#ifdef KAON_PAIRS
    return 1;
#else
    return 0;
#endif
}

#ifdef KAON_PAIRS
/* Group g's 4-bit weights as the Q4_1-family group kernels take them: the nibbles, Q5's high bits (NULL for
 * the 4-bit kinds), the scales and mins (float per group for the *_F32 kinds, else 16-bit per block). */
typedef struct {
    const uint8_t *w, *hi;
    const void *wd, *wm;
    int f32;
} Q4Group;

static inline __attribute__((always_inline)) Q4Group q4_group(const Linear *l, int g) {
    const int k = l->k;
    const size_t first = (size_t)g * LANES * (k / QBLOCK);  /* group g's first scale */
    const int f32 = l->kind == KIND_Q4_F32 || l->kind == KIND_Q5_F32;
    return (Q4Group){
        .w = (const uint8_t *)l->w + (size_t)g * LANES * k / 2,
        .hi = l->kind == KIND_Q5 || l->kind == KIND_Q5_F32 ? l->high + (size_t)g * LANES * k / 8 : NULL,
        .wd = f32 ? (const void *)(l->gscales + first) : (const void *)(l->d + first),
        .wm = f32 ? (const void *)(l->gmins + first) : (const void *)(l->m + first),
        .f32 = f32,
    };
}

/* Group g's outputs for activation rows [row, row + rows) in pairs (KAON_PAIRS): each quantized
 * row's eight outputs in v[2 (r - row) + pass]. */
static inline __attribute__((always_inline)) void linear_pairs(const LinearJob *job, int g, int row, int rows,
                                                               float v[][LANES]) {
    const Linear *l = job->l;
    const int k = l->k, blocks = k / QBLOCK;
    const size_t at = (size_t)row * blocks;  /* the row's first block */
    const int8_t *qp = job->qp + at * 2 * QBLOCK;
    const float *dp = job->dp + at * 2, *sp = job->sp + at * 2;
    if (l->kind == KIND_INT8) {
        group_int8_pairs((const int8_t *)l->w + (size_t)g * LANES * k, l->scales + (size_t)g * LANES, qp, dp,
                         job->qsp + at * 2, k, rows, v);
        return;
    }
    const Q4Group q = q4_group(l, g);
    if (q.f32 && q.hi) group_q4_1_pairs(q.w, q.hi, q.wd, q.wm, 1, qp, dp, sp, k, rows, v);
    else if (q.f32) group_q4_1_pairs(q.w, NULL, q.wd, q.wm, 1, qp, dp, sp, k, rows, v);
    else if (q.hi) group_q4_1_pairs(q.w, q.hi, q.wd, q.wm, 0, qp, dp, sp, k, rows, v);
    else group_q4_1_pairs(q.w, NULL, q.wd, q.wm, 0, qp, dp, sp, k, rows, v);
}
#endif

#ifdef KAON_PAIRS
/* Group g's outputs for one activation row's two passes (HalfRow): v[0] the first's, v[1] the second's. */
static inline __attribute__((always_inline)) void linear_halves(const LinearJob *job, int g, float v[][LANES]) {
    const Linear *l = job->l;
    const int k = l->k, blocks = k / QBLOCK;
    const HalfRow *h = job->half;
    if (l->kind == KIND_INT8) {
        group_int8_halves((const int8_t *)l->w + (size_t)g * LANES * k, l->scales + (size_t)g * LANES, h, k, v);
        return;
    }
    if (l->kind == KIND_Q8_G16) {
        const float *wm = l->gmins ? l->gmins + (size_t)g * LANES * blocks * 2 : NULL;
        group_q8_g16_halves((const int8_t *)l->w + (size_t)g * LANES * k, l->gscales + (size_t)g * LANES * blocks * 2,
                            wm, h, k, v);
        return;
    }
    const Q4Group q = q4_group(l, g);
    if (q.f32 && q.hi) group_q4_1_halves(q.w, q.hi, q.wd, q.wm, 1, h, k, v);
    else if (q.f32) group_q4_1_halves(q.w, NULL, q.wd, q.wm, 1, h, k, v);
    else if (q.hi) group_q4_1_halves(q.w, q.hi, q.wd, q.wm, 0, h, k, v);
    else group_q4_1_halves(q.w, NULL, q.wd, q.wm, 0, h, k, v);
}
#endif

/* Group g's outputs for quantized rows [r0, r0 + tile) through the 256-bit (or scalar) kernels: v[r - r0].
 * Inlined with tile a constant where it is 1 or 2 (batch 1 at one pass, and at two: the passes of one
 * row), so those copies of the loops know their row count (no per-row branch, their accumulators in
 * registers) and stream the weights with prefetches. */
static inline __attribute__((always_inline)) void narrow_group(const LinearJob *job, int g, int r0, const int tile,
                                                               float v[][LANES]) {
    const Linear *l = job->l;
    const int k = l->k, blocks = k / QBLOCK;
    const int8_t *q = job->q + (size_t)r0 * k;
    const float *d = job->d + (size_t)r0 * blocks, *s = job->s + (size_t)r0 * blocks;
    if (l->kind == KIND_INT8) {
        const int8_t *w = (const int8_t *)l->w + (size_t)g * LANES * k;
        const float *scales = l->scales + (size_t)g * LANES;
        const int32_t *qs = job->qs + (size_t)r0 * blocks;
        group_int8(w, scales, q, d, qs, k, tile, v);
    } else if (l->kind == KIND_Q8_G16) {
        const int8_t *w = (const int8_t *)l->w + (size_t)g * LANES * k;
        const float *ws = l->gscales + (size_t)g * LANES * blocks * 2;
        const float *wm = l->gmins ? l->gmins + (size_t)g * LANES * blocks * 2 : NULL;
        const float *slo = job->slo + (size_t)r0 * blocks;
        group_q8_g16(w, ws, wm, q, d, s, slo, k, tile, v);
    } else if (l->kind == KIND_Q6_G16) {
        const uint8_t *w = (const uint8_t *)l->w + (size_t)g * LANES * k / 2;
        const uint8_t *hi = l->high + (size_t)g * LANES * k / 4;
        const float *ws = l->gscales + (size_t)g * LANES * blocks * 2;
        const int32_t *qs = job->qs + (size_t)r0 * blocks, *qlo = job->qlo + (size_t)r0 * blocks;
        group_q6_g16(w, hi, ws, q, d, qs, qlo, k, tile, v);
    } else if (l->kind == KIND_Q4_F32 || l->kind == KIND_Q5_F32) {
        const uint8_t *w = (const uint8_t *)l->w + (size_t)g * LANES * k / 2;
        const float *wd = l->gscales + (size_t)g * LANES * blocks, *wm = l->gmins + (size_t)g * LANES * blocks;
        if (l->kind == KIND_Q5_F32) {
            const uint8_t *hi = l->high + (size_t)g * LANES * k / 8;
            group_q4_1(w, hi, wd, wm, 1, q, d, s, k, tile, v);
        } else group_q4_1(w, NULL, wd, wm, 1, q, d, s, k, tile, v);
    } else {
        const uint8_t *w = (const uint8_t *)l->w + (size_t)g * LANES * k / 2;
        const uint16_t *wd = l->d + (size_t)g * LANES * blocks, *wm = l->m + (size_t)g * LANES * blocks;
        if (l->kind == KIND_Q5) {
            const uint8_t *hi = l->high + (size_t)g * LANES * k / 8;
            group_q4_1(w, hi, wd, wm, 0, q, d, s, k, tile, v);
        } else group_q4_1(w, NULL, wd, wm, 0, q, d, s, k, tile, v);
    }
}

/* ---- FP8 weights (FP8, FP8_A8) --------------------------------------------------------
 * The float path's tiles on the widened e4m3 weights (load8), then each output times its row's
 * scale and plus its bias: torch's (x @ float(q).T) * scales + bias (quant/fp8.py), one order per row. */
static void fp8_outputs(const Linear *l, int rows, const float *x, float *y, int begin, int end) {
    const int n = l->n;
    f32_outputs(l->w, FMT_FP8, NULL, n, l->k, rows, x, y, begin, end);
    for (int r = 0; r < rows; r++)
        for (int j = begin; j < end; j++) {
            const float v = y[(size_t)r * n + j] * l->scales[j];
            y[(size_t)r * n + j] = l->bias ? v + l->bias[j] : v;
        }
}

/* FP8_BLOCK: output channels [begin, end) a strip at a time: the strip's weights widened, each times its
 * block's scale, into float32 rows (a float32 product per weight, as torch's dequantize_fp8_blocks rounds
 * it), then the float32 path's tiles (their one order per output) on the strip, bias added there. The
 * strip (F32_BLOCK floats, at least one tile of rows) stays in L2 while the batch's row tiles pass over it. */
static void fp8_block_outputs(const Linear *l, int rows, const float *x, float *y, int begin, int end) {
    const int n = l->n, k = l->k, br = l->block_rows, bc = l->block_cols, kb = (k + bc - 1) / bc;
    int strip = (F32_BLOCK / k) / NR1 * NR1;
    if (strip < NR1) strip = NR1;
    float *wide = malloc((size_t)strip * k * sizeof(float));
    if (!wide) abort();
    const uint8_t *q = l->w;
    for (int j0 = begin; j0 < end; j0 += strip) {
        const int j1 = j0 + strip < end ? j0 + strip : end;
        for (int j = j0; j < j1; j++) {
            const uint8_t *qr = q + (size_t)j * k;
            const float *sr = l->scales + (size_t)(j / br) * kb;
            float *wr = wide + (size_t)(j - j0) * k;
            for (int b = 0; b < kb; b++) {
                const int i1 = (b + 1) * bc < k ? (b + 1) * bc : k;
                const float s = sr[b];
                int i = b * bc;
#ifdef KAON_AVX2
                for (; i + 8 <= i1; i += 8)  /* load8 widens exactly, as fp8_to_float: the same products */
                    _mm256_storeu_ps(wr + i, _mm256_mul_ps(load8(qr, (size_t)i, FMT_FP8), _mm256_set1_ps(s)));
#endif
                for (; i < i1; i++) wr[i] = fp8_to_float(qr[i]) * s;
            }
        }
        /* y's columns j0..j1 as outputs 0..j1-j0 of the strip (y's row stride stays n) */
        f32_outputs(wide, FMT_F32, l->bias ? l->bias + j0 : NULL, n, k, rows, x, y + j0, 0, j1 - j0);
    }
    free(wide);
}

/* ---- the reference mode's weight-only kinds (REF_INT8, REF_Q4, REF_Q8_G16, REF_Q8_G) -------
 * Weight row j widened to float32 in wr [k], in the input's column order. The products and sums are
 * rounded one at a time (-std=c11: GCC contracts no multiply-add), as torch's q * scale + min. */
static void ref_widen_row(const Linear *l, int j, float *wr) {
    const int k = l->k;
    if (l->kind == KIND_REF_INT8) {  /* the integers, exactly: the row's scale comes after the sum */
        const int8_t *q = (const int8_t *)l->w + (size_t)j * k;
        int i = 0;
#ifdef KAON_AVX2
        for (; i + 8 <= k; i += 8)
            _mm256_storeu_ps(wr + i,
                             _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + i)))));
#endif
        for (; i < k; i++) wr[i] = (float)q[i];
    } else if (l->kind == KIND_REF_Q4) {  /* byte i of a group: element i low, i + group / 2 high */
        const int group = l->block_cols, half = group / 2, groups = k / group;
        const uint8_t *p = (const uint8_t *)l->w + (size_t)j * (k / 2);
        for (int g = 0; g < groups; g++) {
            const float scale = l->gscales[(size_t)j * groups + g], min = l->gmins[(size_t)j * groups + g];
            const uint8_t *bytes = p + (size_t)g * half;
            float *o = wr + (size_t)g * group;
            int i = 0;
#ifdef KAON_AVX2
            const __m256 vs = _mm256_set1_ps(scale), vm = _mm256_set1_ps(min);
            for (; i + 8 <= half; i += 8) {
                const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(bytes + i)));
                const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(0xf)));
                const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
                _mm256_storeu_ps(o + i, _mm256_add_ps(_mm256_mul_ps(lo, vs), vm));
                _mm256_storeu_ps(o + half + i, _mm256_add_ps(_mm256_mul_ps(hi, vs), vm));
            }
#endif
            for (; i < half; i++) {
                o[i] = (float)(bytes[i] & 0xf) * scale + min;
                o[half + i] = (float)(bytes[i] >> 4) * scale + min;
            }
        }
    } else if (l->kind == KIND_REF_Q8_G) {  /* q [N, K], scales / mins [N, K / group]: any group dividing K */
        const int group = l->block_cols, groups = k / group;
        const int8_t *q = (const int8_t *)l->w + (size_t)j * k;
        const float *sc = l->gscales + (size_t)j * groups, *mn = l->gmins ? l->gmins + (size_t)j * groups : NULL;
        for (int g = 0; g < groups; g++) {
            const float scale = sc[g], min = mn ? mn[g] : 0.f;
            float *o = wr + (size_t)g * group;
            for (int t = 0; t < group; t++) o[t] = (float)q[(size_t)g * group + t] * scale;
            if (mn) for (int t = 0; t < group; t++) o[t] = o[t] + min;
        }
    } else {  /* REF_Q8_G16: q [groups of 8 rows, k / 4, 8 lanes, 4], scales / mins [groups, k / 16, 8 lanes] */
        const int g8 = j / LANES, lane = j % LANES;
        const int8_t *q = (const int8_t *)l->w + (size_t)g8 * k * LANES;
        const float *sc = l->gscales + (size_t)g8 * (k / 16) * LANES;
        const float *mn = l->gmins ? l->gmins + (size_t)g8 * (k / 16) * LANES : NULL;
        for (int b = 0; b < k / 16; b++) {  /* a group of 16: its scale (and min), four runs of four values */
            const float scale = sc[(size_t)b * LANES + lane], min = mn ? mn[(size_t)b * LANES + lane] : 0.f;
            for (int c = 0; c < 4; c++) {
                const int8_t *run = q + ((size_t)(b * 4 + c) * LANES + lane) * 4;
                float *o = wr + b * 16 + c * 4;
                for (int t = 0; t < 4; t++) o[t] = (float)run[t] * scale;
                if (mn) for (int t = 0; t < 4; t++) o[t] = o[t] + min;
            }
        }
    }
}

/* Output channels [begin, end) a strip at a time: the strip's weights widened (ref_widen_row), then the
 * float32 path's tiles (one order per output) on it; REF_INT8 then times the row's scale, plus the bias. The
 * strip (F32_BLOCK floats, at least one tile of rows) stays in L2 while the batch's row tiles pass over it. */
static void ref_outputs(const Linear *l, int rows, const float *x, float *y, int begin, int end) {
    const int n = l->n, k = l->k, scaled = l->kind == KIND_REF_INT8;
    int strip = (F32_BLOCK / k) / NR1 * NR1;
    if (strip < NR1) strip = NR1;
    float *wide = malloc((size_t)strip * k * sizeof(float));
    if (!wide) abort();
    for (int j0 = begin; j0 < end; j0 += strip) {
        const int j1 = j0 + strip < end ? j0 + strip : end;
        for (int j = j0; j < j1; j++) ref_widen_row(l, j, wide + (size_t)(j - j0) * k);
        f32_outputs(wide, FMT_F32, scaled || !l->bias ? NULL : l->bias + j0, n, k, rows, x, y + j0, 0, j1 - j0);
        if (scaled)
            for (int r = 0; r < rows; r++)
                for (int j = j0; j < j1; j++) {
                    const float v = y[(size_t)r * n + j] * l->scales[j];
                    y[(size_t)r * n + j] = l->bias ? v + l->bias[j] : v;
                }
    }
    free(wide);
}

/* v (|v| <= 448) rounded to the nearest e4m3fn value, ties to even, as torch's .to(float8_e4m3fn)
 * rounds: below 2^-6 (subnormals) to a multiple of 2^-9 (the product and quotient are exact; rintf
 * rounds to even), above to three mantissa bits (a carry moves into the exponent, as it should). */
static inline float round_fp8(float v) {
    if (fabsf(v) < 0x1p-6f) return rintf(v * 512.f) / 512.f;
    uint32_t bits;
    memcpy(&bits, &v, 4);
    bits = (bits + 0x7ffffu + ((bits >> 20) & 1u)) & 0xfff00000u;
    memcpy(&v, &bits, 4);
    return v;
}

/* Each row of x [rows, k] rounded to its own FP8 grid (compressed-tensors' dynamic per-token FP8, as
 * quant/dynamic_fp8.round_to_fp8_per_token does it in float32): scale = max |x| / 448 (a zero row
 * float32's eps), x' = fp8(clamp(x / scale)) * scale. A row's result is its own. */
static void round_fp8_rows(const float *x, int rows, int k, float fixed_scale, float *out) {
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * k;
        float *o = out + (size_t)r * k, amax = 0.f;
        float scale = fixed_scale;  /* FP8_STATIC: the checkpoint's input_scale, the same for every row */
        if (scale <= 0.f) {
            for (int i = 0; i < k; i++) amax = fmaxf(amax, fabsf(xr[i]));
            scale = amax / 448.f;
            if (scale == 0.f) scale = 0x1p-23f;
        }
        for (int i = 0; i < k; i++) {
            const float v = xr[i] / scale;
            o[i] = round_fp8(v < -448.f ? -448.f : v > 448.f ? 448.f : v) * scale;
        }
    }
}

/* ---- W8A8 int8, dynamic (INT8_A8) ---------------------------------------------------------
 * Each input row quantized per token as compressed-tensors specifies and quant/dynamic_inputs.
 * quantize_per_token computes in float32: scale = max |x| / 127.5 (a zero row float32's eps),
 * q = rint(clamp(x / scale, -128, 127)) (rintf: half to even, as torch.round). q [rows, k] int8, scale [rows]. */
static void quantize_int8_rows(const float *x, int rows, int k, int8_t *q, float *scale) {
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * k;
        float amax = 0.f;
        for (int i = 0; i < k; i++) amax = fmaxf(amax, fabsf(xr[i]));
        float s = amax / 127.5f;
        if (s == 0.f) s = 0x1p-23f;
        scale[r] = s;
        for (int i = 0; i < k; i++) {
            const float v = xr[i] / s;
            q[(size_t)r * k + i] = (int8_t)rintf(v < -128.f ? -128.f : v > 127.f ? 127.f : v);
        }
    }
}

#ifdef KAON_AVX2
/* The eight int32 lanes' sum (exact: the W8A8 dots' partial sums). */
static inline int32_t hsum8_epi32(__m256i v) {
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1));
    return _mm_cvtsi128_si32(h);
}
#endif

/* sum_i a[i] * b[i] over int8 rows, in int32: exact (|a b| <= 2^14, k < 2^17), so its order is free. */
static inline int32_t dot_s8s8(const int8_t *a, const int8_t *b, int k) {
    int i = 0, sum = 0;
#ifdef KAON_AVX2
    __m256i acc = _mm256_setzero_si256();
    for (; i + 16 <= k; i += 16) {  /* sign-extended to int16, madd: pairs of products into int32 */
        const __m256i va = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(a + i)));
        const __m256i vb = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + i)));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(va, vb));
    }
    sum = hsum8_epi32(acc);
#endif
    for (; i < k; i++) sum += (int32_t)a[i] * b[i];
    return sum;
}

/* Outputs [begin, end) of every row: (float)acc * row scale * output scale (+ bias), the order of
 * quant/dynamic_inputs' (int32.float() * row_scales * scales) + bias. */
static void int8_a8_outputs(const Linear *l, int rows, const int8_t *q, const float *qscale, float *y,
                            int begin, int end) {
    const int n = l->n, k = l->k;
    const int8_t *w = l->w;
    for (int j = begin; j < end; j++)
        for (int r = 0; r < rows; r++) {
            const float v = (float)dot_s8s8(q + (size_t)r * k, w + (size_t)j * k, k) * qscale[r] * l->scales[j];
            y[(size_t)r * n + j] = l->bias ? v + l->bias[j] : v;
        }
}

/* ---- W8A8 int8, static (INT8_S8) ----------------------------------------------------------
 * Each input rounded to the per-tensor grid (scale s, zero point z) as quant/static_inputs.round_to_grid
 * does in float32: q = clamp(rint(x / s) + z, -128, 127) - z, an integer in [-128 - z, 127 - z] (int16:
 * a zero point can take it past int8). */
static void quantize_static_rows(const float *x, int rows, int k, float s, float z, int16_t *q) {
    for (size_t i = 0; i < (size_t)rows * k; i++) {
        float v = rintf(x[i] / s) + z;
        v = v < -128.f ? -128.f : v > 127.f ? 127.f : v;
        q[i] = (int16_t)(v - z);
    }
}

/* sum_i a[i] * b[i], int16 levels against int8 weights, in int32: exact (|a b| <= 255 * 128). */
static inline int32_t dot_s16s8(const int16_t *a, const int8_t *b, int k) {
    int i = 0, sum = 0;
#ifdef KAON_AVX2
    __m256i acc = _mm256_setzero_si256();
    for (; i + 16 <= k; i += 16) {
        const __m256i va = _mm256_loadu_si256((const __m256i *)(a + i));
        const __m256i vb = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + i)));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(va, vb));
    }
    sum = hsum8_epi32(acc);
#endif
    for (; i < k; i++) sum += (int32_t)a[i] * b[i];
    return sum;
}

/* Outputs [begin, end) of every row: (float)acc * input scale * output scale (+ bias). */
static void int8_s8_outputs(const Linear *l, int rows, const int16_t *q, float *y, int begin, int end) {
    const int n = l->n, k = l->k;
    const int8_t *w = l->w;
    for (int j = begin; j < end; j++)
        for (int r = 0; r < rows; r++) {
            const float v = (float)dot_s16s8(q + (size_t)r * k, w + (size_t)j * k, k) * l->gscales[0] * l->scales[j];
            y[(size_t)r * n + j] = l->bias ? v + l->bias[j] : v;
        }
}

/* Float kinds: output channels [begin, end). Narrow kinds: groups of eight output channels,
 * each group's weights read once for up to TILE quantized rows (one row and two, batch 1 at one
 * activation pass and at two, get their own copies of the loops with the row count constant). */
static void linear_chunk(const void *arg, int begin, int end) {
    const LinearJob *job = arg;
    const Linear *l = job->l;
    const int n = l->n, k = l->k;
    if (l->kind == KIND_F32 || l->kind == KIND_F16 || l->kind == KIND_BF16) {
        const int fmt = l->kind == KIND_F32 ? FMT_F32 : l->kind == KIND_F16 ? FMT_F16 : FMT_BF16;
        f32_outputs(l->w, fmt, l->bias, n, k, job->rows, job->x, job->y, begin, end);
        return;
    }
    if (l->kind == KIND_F32_T || l->kind == KIND_F16_T || l->kind == KIND_BF16_T) {
        const int fmt = l->kind == KIND_F32_T ? FMT_F32 : l->kind == KIND_F16_T ? FMT_F16 : FMT_BF16;
        f32_t_outputs(l->w, fmt, l->bias, n, k, job->rows, job->x, job->y, begin, end);
        return;
    }
    if (l->kind == KIND_FP8 || l->kind == KIND_FP8_A8 || l->kind == KIND_FP8_STATIC) {
        fp8_outputs(l, job->rows, job->x, job->y, begin, end);
        return;
    }
    if (l->kind == KIND_INT8_A8) {  /* kaon_linear quantized the rows: q, one scale each in d */
        int8_a8_outputs(l, job->rows, job->q, job->d, job->y, begin, end);
        return;
    }
    if (l->kind == KIND_INT8_S8) {  /* kaon_linear rounded the rows: int16 levels in q */
        int8_s8_outputs(l, job->rows, (const int16_t *)job->q, job->y, begin, end);
        return;
    }
    if (l->kind == KIND_FP8_BLOCK) {
        fp8_block_outputs(l, job->rows, job->x, job->y, begin, end);
        return;
    }
    if (l->kind == KIND_REF_INT8 || l->kind == KIND_REF_Q4 || l->kind == KIND_REF_Q8_G16 || l->kind == KIND_REF_Q8_G) {
        ref_outputs(l, job->rows, job->x, job->y, begin, end);
        return;
    }
#ifdef KAON_AMX
    if (job->amx) { amx_chunk(job, begin, end); return; }
#endif
    float v[2 * TILE][LANES];
    const int paired = job->qp != NULL, step = paired ? 2 * PAIRS_TILE : TILE;
    for (int g = begin; g < end; g++) {
        for (int r0 = 0; r0 < job->rows; r0 += step) {
            const int tile = job->rows - r0 < step ? job->rows - r0 : step;
            if (job->half) {  /* rows == 2: one activation row's two passes */
#ifdef KAON_PAIRS
                linear_halves(job, g, v);
#endif
            } else if (paired) {
#ifdef KAON_PAIRS
                /* one activation row (batch-1 decode) gets its own copy of the loops, as below */
                if (tile == 2) linear_pairs(job, g, r0 / 2, 1, v);
                else linear_pairs(job, g, r0 / 2, tile / 2, v);
#endif
            } else if (tile == 1) {
                narrow_group(job, g, r0, 1, v);
            } else if (tile == 2) {  /* batch 1's two passes, or batch 2's one */
                narrow_group(job, g, r0, 2, v);
            } else {
                narrow_group(job, g, r0, tile, v);
            }
            if (job->passes == 2)  /* the pairs (hi, lo) of one row never straddle tiles: TILE is even */
                for (int r = 0; r < tile; r += 2)
                    for (int c = 0; c < LANES && g * LANES + c < n; c++) {
                        const int j = g * LANES + c;
                        const float sum = v[r][c] + v[r + 1][c];
                        job->y[(size_t)((r0 + r) / 2) * n + j] = l->bias ? sum + l->bias[j] : sum;
                    }
            else
                for (int r = 0; r < tile; r++)
                    for (int c = 0; c < LANES && g * LANES + c < n; c++) {
                        const int j = g * LANES + c;
                        job->y[(size_t)(r0 + r) * n + j] = l->bias ? v[r][c] + l->bias[j] : v[r][c];
                    }
        }
    }
}

void kaon_linear(const Linear *l, int rows, const float *x, float *y, void *work, int threads) {
    const int k = l->k, blocks = k / QBLOCK;
    if (l->k_in > 0 && l->k_in < k) {
        /* Weights packed with k - k_in zero columns (a width that is not whole blocks of QBLOCK): each row copied to
         * k floats, its last k - k_in zero, so every kernel below runs unchanged on whole blocks (the SIMD variants
         * this CPU lacks too: nothing in their loops changes). A zero lane leaves its block's amax, scale and sums
         * alone and quantizes to 0, and a zero weight times it adds an exact 0: the row's numbers are those of its
         * true width, and still depend on that row alone. */
        float *padded = (float *)work;
        for (int r = 0; r < rows; r++) {
            memcpy(padded + (size_t)r * k, x + (size_t)r * l->k_in, (size_t)l->k_in * sizeof(float));
            memset(padded + (size_t)r * k + l->k_in, 0, (size_t)(k - l->k_in) * sizeof(float));
        }
        x = padded;
        work = (int8_t *)work + (((size_t)rows * k * sizeof(float) + 63) & ~(size_t)63);
    }
    const int narrow = l->kind != KIND_F32 && l->kind != KIND_F32_T && l->kind != KIND_F16 && l->kind != KIND_BF16
                       && l->kind != KIND_F16_T && l->kind != KIND_BF16_T && l->kind != KIND_FP8
                       && l->kind != KIND_FP8_A8 && l->kind != KIND_FP8_BLOCK && l->kind != KIND_FP8_STATIC
                       && l->kind != KIND_INT8_A8 && l->kind != KIND_INT8_S8 && l->kind != KIND_REF_INT8
                       && l->kind != KIND_REF_Q4 && l->kind != KIND_REF_Q8_G16 && l->kind != KIND_REF_Q8_G;
    if (l->kind == KIND_INT8_S8) {  /* rows rounded to the static grid into the workspace: int16 [rows, k] */
        int16_t *q = (int16_t *)work;
        quantize_static_rows(x, rows, k, l->gscales[0], l->gscales[1], q);
        LinearJob job = {l, rows, 1, x, (const int8_t *)q, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, y, 0,
                         NULL};
        parallel_for(l->n, threads, linear_chunk, &job);
        return;
    }
    if (l->kind == KIND_INT8_A8) {  /* rows quantized per token into the workspace: int8 [rows, k], then a scale each */
        int8_t *q = (int8_t *)work;
        float *scale = (float *)(q + (size_t)rows * k + (-(size_t)rows * k & 3));
        quantize_int8_rows(x, rows, k, q, scale);
        LinearJob job = {l, rows, 1, x, q, scale, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, y, 0, NULL};
        parallel_for(l->n, threads, linear_chunk, &job);
        return;
    }
    if ((l->kind == KIND_REF_Q4 || l->kind == KIND_REF_Q8_G16 || l->kind == KIND_REF_Q8_G) && l->perm) {
        /* act-order: each row gathered into the weights' stored column order once (InputPermutedLinear's
         * x[:, perm]), in the workspace (4 bytes a value); scattering the widened weights instead cost 3.5x */
        float *gathered = (float *)work;
        for (int r = 0; r < rows; r++)
            for (int i = 0; i < k; i++) gathered[(size_t)r * k + i] = x[(size_t)r * k + l->perm[i]];
        x = gathered;
    }
    if (l->kind == KIND_FP8_A8 || l->kind == KIND_FP8_STATIC || (l->kind == KIND_FP8_BLOCK && l->input_scale > 0.f)) {
        /* the rows rounded to FP8 per token (A8) or with the fixed input scale (FP8_STATIC, FP8_BLOCK with
         * static inputs), in the workspace (4 bytes a value) */
        round_fp8_rows(x, rows, k, l->kind == KIND_FP8_A8 ? 0.f : l->input_scale, (float *)work);
        x = (float *)work;
    }
    const int passes = narrow && l->act_passes == 2 ? 2 : 1;
    const int activation_rows = rows;
    rows *= passes;  /* quantized rows: with two passes row 2r is x_r's first pass, 2r + 1 its remainder's */
    int8_t *q = (int8_t *)work;
    float *d = (float *)(q + (size_t)rows * k + (-(size_t)rows * k & 3)), *s = d + (size_t)rows * blocks;
    int32_t *qs = (int32_t *)(s + (size_t)rows * blocks);
    float *slo = (float *)(qs + (size_t)rows * blocks);
    int32_t *qlo = (int32_t *)(slo + (size_t)rows * blocks);
    const int paired = narrow && passes == 2 && pairs_kind(l->kind);  /* quantized straight into pairs, below */
#ifdef KAON_AMX
    const int amx = narrow && passes == 2 && (paired || l->kind == KIND_Q8_G16) && activation_rows >= AMX_MIN_ROWS
                    && amx_usable();  /* the passes' layout, in tiles */
#else
    const int amx = 0;
#endif
#ifdef KAON_PAIRS  /* batch 1 with two passes: HalfRow's kernels (above) */
    const int halves = narrow && passes == 2 && activation_rows == 1 && !amx
                       && (paired || l->kind == KIND_Q8_G16) && kaon_halves_on;
#else
    const int halves = 0;
#endif
    if (narrow && passes == 2 && (!paired || amx || halves))
        for (int r = 0; r < activation_rows; r++)
            quantize_passes(x + (size_t)r * k, k, q + (size_t)2 * r * k, d + (size_t)2 * r * blocks,
                            s + (size_t)2 * r * blocks, qs + (size_t)2 * r * blocks);
    else if (narrow && passes == 1)
        for (int r = 0; r < rows; r++)
            quantize_q8(x + (size_t)r * k, k, q + (size_t)r * k, d + (size_t)r * blocks, s + (size_t)r * blocks,
                        qs + (size_t)r * blocks);
    if ((l->kind == KIND_Q8_G16 && l->gmins) || l->kind == KIND_Q6_G16)
        for (int r = 0; r < rows; r++)
            for (int b = 0; b < blocks; b++) {
                const int8_t *qb = q + (size_t)r * k + b * QBLOCK;
                int sum = 0;
                for (int i = 0; i < QBLOCK / 2; i++) sum += qb[i];
                qlo[(size_t)r * blocks + b] = sum;
                slo[(size_t)r * blocks + b] = d[(size_t)r * blocks + b] * (float)sum;
            }
    int8_t *qp = NULL;
    float *dp = NULL, *sp = NULL;
    int32_t *qsp = NULL;
    const void *half = NULL;
#ifdef KAON_PAIRS
    HalfRow half_row_layout;
    if (halves) {
        const size_t used = (size_t)((int8_t *)(qlo + (size_t)rows * blocks) - (int8_t *)work);
        int8_t *hq = (int8_t *)work + ((used + 63) & ~(size_t)63);
        float *hd = (float *)(hq + (size_t)blocks * 8 * 64), *hs = hd + (size_t)blocks * 16;
        int32_t *h0 = (int32_t *)(hs + (size_t)blocks * 16), *h1 = h0 + (size_t)blocks * 16;
        float *ha = (float *)(h1 + (size_t)blocks * 16), *hz = ha + (size_t)blocks * 16;
        half_row(q, d, s, qs, k, l->kind == KIND_Q8_G16, hq, hd, hs, h0, h1, ha, hz);
        half_row_layout = (HalfRow){hq, hd, hs, h0, h1, ha, hz};
        half = &half_row_layout;
    }
#endif
    if (paired && !amx && !halves) {  /* the pair layout (KAON_PAIRS, above) */
        qp = (int8_t *)(qlo + (size_t)rows * blocks);
        dp = (float *)(qp + (size_t)rows * k);
        sp = dp + (size_t)rows * blocks;
        qsp = (int32_t *)(sp + (size_t)rows * blocks);
        for (int r = 0; r < activation_rows; r++)
            quantize_pairs(x + (size_t)r * k, k, qp + (size_t)2 * r * k, dp + (size_t)2 * r * blocks,
                           sp + (size_t)2 * r * blocks, qsp + (size_t)2 * r * blocks);
    }
    LinearJob job = {l, rows, passes, x, q, d, s, qs, slo, qlo, qp, dp, sp, qsp, y, amx, half};
    const int groups = (l->n + LANES - 1) / LANES;
    parallel_for(amx ? (groups + 1) / 2 : narrow ? groups : l->n, threads, linear_chunk, &job);
}

/* ---- the rest of a layer ------------------------------------------------------------- */

/* out = weight * (x / rms(x)) per row, in float32 like the torch reference (Llama's RMSNorm). */
static void rms_norm(const float *x, const float *weight, float eps, int rows, int n, float *out) {
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * n;
        float inv = 1.f / sqrtf(dot_f32(xr, xr, n) / (float)n + eps);
        for (int i = 0; i < n; i++) out[(size_t)r * n + i] = weight[i] * (xr[i] * inv);
    }
}

/* HF's split-halves rotary on the leading `rotated` dims of `heads` heads (`dim` apart) of one token, in place
 * (rotated < dim: partial rotary, the rest of each head as it is). */
static void rotary(float *x, int heads, int dim, int rotated, const float *cos, const float *sin) {
    int half = rotated / 2;
    for (int h = 0; h < heads; h++) {
        float *v = x + (size_t)h * dim;
        for (int i = 0; i < half; i++) {
            float a = v[i], b = v[i + half];
            v[i] = a * cos[i] - b * sin[i];
            v[i + half] = b * cos[i] + a * sin[i];
        }
    }
}

static float silu(float x) { return x / (1.f + expf(-x)); }

/* gelu with the tanh approximation, torch's approximate="tanh" formula (GeGLU's gate in Gemma). */
static float gelu_tanh(float x) {
    const float inner = 0.7978845608028654f * (x + 0.044715f * x * x * x);  /* sqrt(2 / pi) */
    return 0.5f * x * (1.f + tanhf(inner));
}

typedef struct {
    const Model *md;
    const Layer *layer;
    const float *qkv;
    int qkv_width, max_blocks;
    const int64_t *tables, *context_lens;
    float *scores, *out;
} AttentionJob;

#ifdef KAON_AVX2
/* The eight lanes' sums of a[0..7], in lane order: scores for eight tokens at once (one hsum
 * per token cost as much as its dot product at head_dim 64). */
static inline __m256 hsum8x8(const __m256 a[8]) {
    const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}
#endif

/* Token t's row in a paged cache head (block size 1 << shift: the engine's is a power of two;
 * a division per token cost as much as its dot product), float32 or float16 (half). */
static inline const void *token_row(const void *cache, int half, const int64_t *table, int shift, int t, int dim) {
    const size_t at = ((size_t)table[t >> shift] << shift | (size_t)(t & ((1 << shift) - 1))) * dim;
    return half ? (const void *)((const uint16_t *)cache + at) : (const void *)((const float *)cache + at);
}

/* A cached row as float32: the row itself, or widened into buf. A 16-bit cache (half: FMT_F16 or
 * FMT_BF16, read with load8) halves what attention reads (it is bound by memory: every cached key
 * and value of every sequence, once per layer and step); the arithmetic stays float32. */
static inline const float *row_f32(const void *row, int half, int n, float *buf) {
    if (!half) return row;
    for (int i = 0; i < n; i++) buf[i] = load1(row, i, half);
    return buf;
}

/* One token's key or value into its cache slot. */
static void store_row(void *cache, int half, size_t at, const float *x, int dim) {
    if (!half) {
        memcpy((float *)cache + at, x, sizeof(float) * dim);
        return;
    }
    uint16_t *h = (uint16_t *)cache + at;
    int i = 0;
    if (half == FMT_BF16) {
        for (; i < dim; i++) h[i] = float_to_bf16(x[i]);
        return;
    }
#ifdef KAON_AVX2
    for (; i + 8 <= dim; i += 8)
        _mm_storeu_si128((__m128i *)(h + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < dim; i++) h[i] = float_to_half(x[i]);
}

/* Query heads that share a key/value head are taken together (up to GH at a time), so each key
 * and value row loaded serves all of them; each head's arithmetic is what it would be alone. */
#define GH 3

/* sc[h * sc_stride + t] = scale * q_h . k_t for first <= t < ctx, for gh (<= GH) heads whose queries are `dim`
 * apart. */
static inline __attribute__((always_inline)) void attention_scores(const float *q, int gh, const void *kc, int half,
                                                                   const int64_t *table, int shift, int dim,
                                                                   int first, int ctx, float scale, float *sc,
                                                                   size_t sc_stride) {
    int t = first;
#ifdef KAON_AVX2
    if (dim % 8 == 0)
        for (; t + 8 <= ctx; t += 8) {
            const void *k[8];
            __m256 acc[GH][8];
            for (int i = 0; i < 8; i++) {
                k[i] = token_row(kc, half, table, shift, t + i, dim);
                for (int h = 0; h < gh; h++) acc[h][i] = _mm256_setzero_ps();
            }
            for (int d = 0; d < dim; d += 8)
                for (int i = 0; i < 8; i++) {
                    const __m256 kv = load8(k[i], d, half);
                    for (int h = 0; h < gh; h++)
                        acc[h][i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (size_t)h * dim + d), kv, acc[h][i]);
                }
            for (int h = 0; h < gh; h++)
                _mm256_storeu_ps(sc + h * sc_stride + t, _mm256_mul_ps(hsum8x8(acc[h]), _mm256_set1_ps(scale)));
        }
#endif
    float buf[dim];
    for (; t < ctx; t++) {
        const float *k = row_f32(token_row(kc, half, table, shift, t, dim), half, dim, buf);
        for (int h = 0; h < gh; h++) sc[h * sc_stride + t] = dot_f32(q + (size_t)h * dim, k, dim) * scale;
    }
}

#ifdef KAON_AVX2
/* exp(x) for x <= 0 in eight lanes: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its Taylor
 * series to r^6, times 2^n. Relative error at most 2.3e-7 over [-87, 0] (about 2 ulp, checked
 * against double exp); below -87 it gives exp(-87) ~ 1.6e-38, nothing beside the top score's 1. */
static inline __m256 exp8_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);  /* ln 2, split for exactness */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
    __m256 p = _mm256_set1_ps(1.f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}
#endif

/* sc[t] = softmax(sc)[t] over t < ctx. */
static void softmax(float *sc, int ctx) {
    float top = -INFINITY, total = 0.f;
    int t = 0;
#ifdef KAON_AVX2
    __m256 vtop = _mm256_set1_ps(-INFINITY);
    for (; t + 8 <= ctx; t += 8) vtop = _mm256_max_ps(vtop, _mm256_loadu_ps(sc + t));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(vtop), _mm256_extractf128_ps(vtop, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    top = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
#endif
    for (; t < ctx; t++) top = sc[t] > top ? sc[t] : top;
    t = 0;
#ifdef KAON_AVX2
    const __m256 vt = _mm256_set1_ps(top);
    __m256 sum = _mm256_setzero_ps();
    for (; t + 8 <= ctx; t += 8) {
        const __m256 e = exp8_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(sc + t), vt));
        _mm256_storeu_ps(sc + t, e);
        sum = _mm256_add_ps(sum, e);
    }
    if (t < ctx) {  /* the last few through the same exp, so every weight is computed alike */
        float tail[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (int i = 0; t + i < ctx; i++) tail[i] = sc[t + i] - top;
        _mm256_storeu_ps(tail, exp8_nonpositive(_mm256_loadu_ps(tail)));
        for (; t < ctx; t++) { sc[t] = tail[t % 8]; total += sc[t]; }
    }
    total += hsum8(sum);
#else
    for (; t < ctx; t++) { sc[t] = expf(sc[t] - top); total += sc[t]; }
#endif
    const float inv = 1.f / total;
    for (t = 0; t < ctx; t++) sc[t] *= inv;
}

/* o_h = sum_t p_h[t] * v_t over first <= t < ctx for gh (<= GH) heads (p_h p_stride apart, o_h dim apart). Sixty-four
 * outputs at a time stay in registers across the whole context (the rest, if head_dim is not a
 * multiple of 64, through axpy in memory). */
static inline __attribute__((always_inline)) void attention_values(const float *p, size_t p_stride, int gh,
                                                                   const void *vc, int half, const int64_t *table,
                                                                   int shift, int dim, int first, int ctx,
                                                                   float *o) {
    int c0 = 0;
#ifdef KAON_AVX2
    for (; c0 + 64 <= dim; c0 += 64) {
        __m256 acc[GH][8];
        for (int h = 0; h < gh; h++)
            for (int j = 0; j < 8; j++) acc[h][j] = _mm256_setzero_ps();
        for (int t = first; t < ctx; t++) {
            const void *v = token_row(vc, half, table, shift, t, dim);
            for (int j = 0; j < 8; j++) {
                const __m256 vv = load8(v, c0 + 8 * j, half);
                for (int h = 0; h < gh; h++)
                    acc[h][j] = _mm256_fmadd_ps(_mm256_set1_ps(p[h * p_stride + t]), vv, acc[h][j]);
            }
        }
        for (int h = 0; h < gh; h++)
            for (int j = 0; j < 8; j++) _mm256_storeu_ps(o + (size_t)h * dim + c0 + 8 * j, acc[h][j]);
    }
#endif
    if (c0 < dim) {
        float buf[dim];
        for (int h = 0; h < gh; h++) memset(o + (size_t)h * dim + c0, 0, sizeof(float) * (dim - c0));
        for (int t = first; t < ctx; t++) {
            const float *v = row_f32(token_row(vc, half, table, shift, t, dim), half, dim, buf);
            for (int h = 0; h < gh; h++) axpy(o + (size_t)h * dim + c0, p[h * p_stride + t], v + c0, dim - c0);
        }
    }
}

/* The query heads [h0, h0 + gh) of one sequence, which share one key/value head. */
static inline __attribute__((always_inline)) void attend(const AttentionJob *job, int r, int h0, int gh, int half) {
    const Model *md = job->md;
    const int heads = md->num_heads, dim = md->head_dim, bs = md->block_size, shift = __builtin_ctz(bs);
    const int group = heads / md->num_kv_heads, ctx = (int)job->context_lens[r], window = job->layer->window;
    /* A windowed layer's row sees its newest `window` keys: the same loops from the window's first key, so a
     * row's sums still depend on its own context only (and a layer without one runs from 0, as before). */
    const int first = window > 0 && ctx > window ? ctx - window : 0;
    const size_t max_ctx = (size_t)job->max_blocks * bs, kv_offset = (size_t)(h0 / group) * md->num_blocks * bs * dim;
    const int64_t *table = job->tables + (size_t)r * job->max_blocks;
    const float *q = job->qkv + (size_t)r * job->qkv_width + (size_t)h0 * dim;
    float *sc = job->scores + ((size_t)r * heads + h0) * max_ctx;
    const size_t kv_bytes = kv_offset * (half ? sizeof(uint16_t) : sizeof(float));
    attention_scores(q, gh, (const char *)job->layer->k_cache + kv_bytes, half, table, shift, dim, first, ctx,
                     md->scale, sc, max_ctx);
    if (md->softcap > 0.f) {  /* Gemma 2: each score capped alone, as torch caps them (scaled, then / cap) */
        const float cap = md->softcap;
        for (int h = 0; h < gh; h++)
            for (int t = first; t < ctx; t++) sc[h * max_ctx + t] = cap * tanhf(sc[h * max_ctx + t] / cap);
    }
    for (int h = 0; h < gh; h++) softmax(sc + h * max_ctx + first, ctx - first);
    attention_values(sc, max_ctx, gh, (const char *)job->layer->v_cache + kv_bytes, half, table, shift, dim, first,
                     ctx, job->out + ((size_t)r * heads + h0) * dim);
}

/* attend for gh (<= GH) heads, with the head count a constant in each copy of the loops. */
static inline __attribute__((always_inline)) void attend_group(const AttentionJob *job, int r, int h0, int gh,
                                                               int half) {
    switch (gh) {
        case 1: attend(job, r, h0, 1, half); break;
        case 2: attend(job, r, h0, 2, half); break;
        default: attend(job, r, h0, GH, half); break;
    }
}

/* One query token per sequence against its paged context; a task is one (sequence, key/value
 * head) pair and its query heads. scores: room for rows * num_heads * max_context floats. */
static void attention_chunk(const void *arg, int begin, int end) {
    const AttentionJob *job = arg;
    const int kv_heads = job->md->num_kv_heads, group = job->md->num_heads / kv_heads;
    for (int task = begin; task < end; task++) {
        const int r = task / kv_heads, h_end = (task % kv_heads + 1) * group;
        for (int h0 = (task % kv_heads) * group; h0 < h_end; h0 += GH) {
            const int gh = h_end - h0 < GH ? h_end - h0 : GH;
            if (job->md->kv_half == FMT_F16)  /* each cache type its own copies too */
                attend_group(job, r, h0, gh, FMT_F16);
            else if (job->md->kv_half == FMT_BF16)
                attend_group(job, r, h0, gh, FMT_BF16);
            else
                attend_group(job, r, h0, gh, FMT_F32);
        }
    }
}

/* Which rows carry an adapter, and which slot each: rows[i] for i < count, ordered by slot so
 * that the rows of one adapter follow each other (its weights read once from memory, then from
 * cache). slots: [rows of the step], -1 for the base model. */
typedef struct {
    const int64_t *slots, *rows;
    int count;
} LoraRows;

typedef struct {
    const Lora *lora;
    const LoraRows *rows;
    int k, n;
    const float *x;
    float *y;
} LoraJob;

/* The rows of one adapter go through its weights together, up to LORA_M at a time: each weight
 * loaded serves all of them (one adapter over a whole batch is a small matrix product, not
 * LORA_M matrix-vector ones). */
#define LORA_M 4

/* a_row . x over n, a_row stored in fmt (widened as loaded): dot_f32's order, so F32 gives its bits. */
static inline __attribute__((always_inline)) float dot_fmt(const void *a, size_t at, const int fmt, const float *x,
                                                           int n) {
    if (fmt == FMT_F32) return dot_f32((const float *)a + at, x, n);
    int i = 0; float sum = 0.f;
#ifdef KAON_AVX2
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps(),
           acc3 = _mm256_setzero_ps();
    for (; i + 32 <= n; i += 32) {
        acc0 = _mm256_fmadd_ps(load8(a, at + i, fmt), _mm256_loadu_ps(x + i), acc0);
        acc1 = _mm256_fmadd_ps(load8(a, at + i + 8, fmt), _mm256_loadu_ps(x + i + 8), acc1);
        acc2 = _mm256_fmadd_ps(load8(a, at + i + 16, fmt), _mm256_loadu_ps(x + i + 16), acc2);
        acc3 = _mm256_fmadd_ps(load8(a, at + i + 24, fmt), _mm256_loadu_ps(x + i + 24), acc3);
    }
    for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(load8(a, at + i, fmt), _mm256_loadu_ps(x + i), acc0);
    sum = hsum8(_mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3)));
#endif
    for (; i < n; i++) sum += load1(a, at + i, fmt) * x[i];
    return sum;
}

/* out[m][j] = a_j . x_m for the `rows` rows of a ([rows, k] from element `at`, stored in fmt) and M
 * activation rows (`xs`): four rows of a at a time. */
static inline __attribute__((always_inline)) void shrink(const void *a, size_t at, const int fmt, int rows,
                                                         const float *const *xs, const int M, int k,
                                                         float (*out)[LORA_M]) {
    int j = 0;
#ifdef KAON_AVX2
    for (; j + 4 <= rows; j += 4) {
        const size_t a0 = at + (size_t)j * k;
        __m256 acc[LORA_M][4];
        for (int m = 0; m < M; m++) for (int c = 0; c < 4; c++) acc[m][c] = _mm256_setzero_ps();
        int i = 0;
        for (; i + 8 <= k; i += 8) {
            __m256 av[4];
            for (int c = 0; c < 4; c++) av[c] = load8(a, a0 + (size_t)c * k + i, fmt);
            for (int m = 0; m < M; m++) {
                const __m256 xv = _mm256_loadu_ps(xs[m] + i);
                for (int c = 0; c < 4; c++) acc[m][c] = _mm256_fmadd_ps(av[c], xv, acc[m][c]);
            }
        }
        for (int m = 0; m < M; m++)
            for (int c = 0; c < 4; c++) {
                float sum = hsum8(acc[m][c]);
                for (int t = i; t < k; t++) sum += load1(a, a0 + (size_t)c * k + t, fmt) * xs[m][t];
                out[j + c][m] = sum;
            }
    }
#endif
    for (; j < rows; j++)
        for (int m = 0; m < M; m++) out[j][m] = dot_fmt(a, at + (size_t)j * k, fmt, xs[m], k);
}

/* ys[m][c] += sum_j s[j][m] * b[j, c] for c < n, b (stored in fmt) from element `at`, its rows `stride`
 * apart: eight outputs of each activation row held in registers over the whole rank, so each y is read
 * and written once. */
static inline __attribute__((always_inline)) void expand(const void *b, size_t at, const int fmt, size_t stride,
                                                         int rank, const float (*s)[LORA_M], float *const *ys,
                                                         const int M, int n) {
    int c = 0;
#ifdef KAON_AVX2
    for (; c + 8 <= n; c += 8) {
        __m256 acc[LORA_M];
        for (int m = 0; m < M; m++) acc[m] = _mm256_loadu_ps(ys[m] + c);
        for (int j = 0; j < rank; j++) {
            const __m256 bv = load8(b, at + j * stride + c, fmt);
            for (int m = 0; m < M; m++) acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(s[j][m]), bv, acc[m]);
        }
        for (int m = 0; m < M; m++) _mm256_storeu_ps(ys[m] + c, acc[m]);
    }
#endif
    for (; c < n; c++)
        for (int m = 0; m < M; m++) {
            float sum = ys[m][c];
            for (int j = 0; j < rank; j++) sum = madd1(s[j][m], load1(b, at + j * stride + c, fmt), sum);
            ys[m][c] = sum;
        }
}

/* M rows of one slot through one projection's adapter, part by part over the slot's own ranks. */
static inline __attribute__((always_inline)) void lora_rows(const Lora *l, int64_t slot, const float *const *xs,
                                                            float *const *ys, const int M, const int fmt, int k,
                                                            int n, float (*shrunk)[LORA_M]) {
    for (int p = 0, offset = 0; p < l->parts; offset += l->sizes[p], p++) {
        const int used = l->ranks[slot * l->parts + p];
        const size_t first = (size_t)slot * l->parts * l->rank + (size_t)p * l->rank;
        float *yp[LORA_M];
        for (int m = 0; m < M; m++) yp[m] = ys[m] + offset;
        shrink(l->a, first * k, fmt, used, xs, M, k, shrunk);
        expand(l->b, first * n + offset, fmt, (size_t)n, used, (const float (*)[LORA_M])shrunk, yp, M, l->sizes[p]);
    }
}

/* One copy of lora_rows per row count and slot format (each a constant inside it). */
#define LORA_ROWS_M(FMT)                                                                   \
    switch (m) {                                                                          \
        case 1: lora_rows(l, slot, xs, ys, 1, FMT, k, n, shrunk); break;                  \
        case 2: lora_rows(l, slot, xs, ys, 2, FMT, k, n, shrunk); break;                  \
        case 3: lora_rows(l, slot, xs, ys, 3, FMT, k, n, shrunk); break;                  \
        default: lora_rows(l, slot, xs, ys, LORA_M, FMT, k, n, shrunk); break;            \
    }

/* y[r] += (x[r] @ A[slot].T) @ B[slot] for the listed rows [begin, end): BGMV's shrink and
 * expand, the rows of one slot (side by side in the list) up to LORA_M at a time. */
static void lora_chunk(const void *arg, int begin, int end) {
    const LoraJob *job = arg;
    const Lora *l = job->lora;
    const int k = job->k, n = job->n;
    float shrunk[l->rank > 0 ? l->rank : 1][LORA_M];
    for (int i = begin; i < end;) {
        const int64_t slot = job->rows->slots[job->rows->rows[i]];
        const float *xs[LORA_M];
        float *ys[LORA_M];
        int m = 0;
        for (; m < LORA_M && i < end && job->rows->slots[job->rows->rows[i]] == slot; m++, i++) {
            xs[m] = job->x + (size_t)job->rows->rows[i] * k;
            ys[m] = job->y + (size_t)job->rows->rows[i] * n;
        }
        if (l->fmt == FMT_F16) {
            LORA_ROWS_M(FMT_F16)
        } else if (l->fmt == FMT_BF16) {
            LORA_ROWS_M(FMT_BF16)
        } else {
            LORA_ROWS_M(FMT_F32)
        }
    }
}

/* A projection's output y [rows, n] gets each adapter row's LoRA term (nothing without slots). */
static void add_lora(const Lora *l, const LoraRows *rows, int k, int n, const float *x, float *y, int threads) {
    if (l->a == NULL || rows->count == 0) return;
    LoraJob job = {l, rows, k, n, x, y};
    parallel_for(rows->count, threads, lora_chunk, &job);
}

/* ---- mixture of experts (Mixtral, Qwen3-MoE: layers/moe.py) ---------------------------------------
 *
 * Each row alone, as kernels/moe_ref.py's route and moe_ref compute it: the router's logits in float32
 * (router: float32 [E, hidden]), their softmax in float32 (torch's: the max subtracted, exp, times one over
 * the sum), the top_k experts by probability (ties: the lower index first; torch.topk does not define its
 * choice), divided by their sum when renormalize; then each chosen expert's gate|up [2W, hidden], SwiGLU
 * and down [hidden, W] through kaon_linear, the k outputs weighted and summed in the chosen order.
 * The rows that chose an expert go through its two projections together (its weights read once a step,
 * not once a row): every kernel's result for a row does not depend on the other rows (the alone-vs-batched
 * tests), so a row's numbers do not depend on which rows share its experts, or its step. */
typedef struct Experts {
    int32_t num_experts, top_k, renormalize, width;
    Linear router;
    const Linear *gate_up, *down;  /* [num_experts] each: any kind kaon_linear reads */
} Experts;

/* Floats (4-byte slots) of scratch space experts_mlp needs for `rows` rows. */
static size_t experts_floats(const Experts *e, int rows, int hidden) {
    const size_t E = e->num_experts, k = e->top_k, w = e->width;
    return (size_t)rows * (E + 3 * k + 2 * (size_t)hidden + 3 * w + k * hidden) + 16;
}

/* One row's routing: probs [E] (the logits in, overwritten) -> ids [k], weights [k]. */
static void route_row(float *probs, int E, int k, int renormalize, int32_t *ids, float *weights) {
    float top = probs[0];
    for (int e = 1; e < E; e++) top = probs[e] > top ? probs[e] : top;
    float sum = 0.f;
    for (int e = 0; e < E; e++) { probs[e] = expf(probs[e] - top); sum += probs[e]; }
    const float inv = 1.f / sum;
    for (int e = 0; e < E; e++) probs[e] *= inv;
    for (int j = 0; j < k; j++) {
        int best = -1;  /* the first unchosen expert at least (k <= E), NaN probabilities included */
        for (int e = 0; e < E; e++)
            if (probs[e] != -INFINITY && (best < 0 || probs[e] > probs[best])) best = e;
        ids[j] = best;
        weights[j] = probs[best];
        probs[best] = -INFINITY;  /* chosen (a probability is never -inf) */
    }
    if (renormalize) {
        float total = 0.f;
        for (int j = 0; j < k; j++) total += weights[j];
        for (int j = 0; j < k; j++) weights[j] = weights[j] / total;
    }
}

/* out [rows, hidden] = the experts' weighted sum for x [rows, hidden] (see above). */
static void experts_mlp(const Experts *ex, int rows, int hidden, const float *x, float *out, float *work,
                        void *linear_work, int threads) {
    const int E = ex->num_experts, k = ex->top_k, W = ex->width;
    float *logits = work, *weights = logits + (size_t)rows * E;
    int32_t *ids = (int32_t *)(weights + (size_t)rows * k), *members = ids + (size_t)rows * k;
    float *xin = (float *)(members + (size_t)rows * k), *gu = xin + (size_t)rows * hidden;
    float *act = gu + (size_t)rows * 2 * W, *y = act + (size_t)rows * W, *slots = y + (size_t)rows * hidden;
    kaon_linear(&ex->router, rows, x, logits, linear_work, threads);
    for (int r = 0; r < rows; r++)
        route_row(logits + (size_t)r * E, E, k, ex->renormalize, ids + (size_t)r * k, weights + (size_t)r * k);
    for (int e = 0; e < E; e++) {
        int count = 0;  /* the (row, slot)s that chose e, in row order; their rows gathered in xin */
        for (int i = 0; i < rows * k; i++)
            if (ids[i] == e) {
                members[count] = i;
                memcpy(xin + (size_t)count++ * hidden, x + (size_t)(i / k) * hidden, sizeof(float) * hidden);
            }
        if (count == 0) continue;
        kaon_linear(&ex->gate_up[e], count, xin, gu, linear_work, threads);
        for (int c = 0; c < count; c++) {
            const float *g = gu + (size_t)c * 2 * W, *u = g + W;
            float *a = act + (size_t)c * W;
            for (int i = 0; i < W; i++) a[i] = silu(g[i]) * u[i];
        }
        kaon_linear(&ex->down[e], count, act, y, linear_work, threads);
        for (int c = 0; c < count; c++)
            memcpy(slots + (size_t)members[c] * hidden, y + (size_t)c * hidden, sizeof(float) * hidden);
    }
    for (int r = 0; r < rows; r++) {  /* the chosen order, one rounding per product and per sum */
        const float *w = weights + (size_t)r * k, *s = slots + (size_t)r * k * hidden;
        float *o = out + (size_t)r * hidden;
        for (int i = 0; i < hidden; i++) o[i] = w[0] * s[i];
        for (int j = 1; j < k; j++)
            for (int i = 0; i < hidden; i++) o[i] = o[i] + w[j] * s[(size_t)j * hidden + i];
    }
}

/* Floats of scratch space kaon_decode needs for `rows` sequences of up to max_blocks blocks:
 * normed and proj [hidden], qkv, attention out [heads * dim], gate_up [2 I], act [I] per row,
 * the attention scores, then kaon_linear's quantized activations. */
size_t kaon_decode_workspace(const Model *md, int rows, int max_blocks) {
    size_t h = md->hidden, inter = md->intermediate, attn = (size_t)md->num_heads * md->head_dim;
    size_t qkv = attn + 2 * (size_t)md->num_kv_heads * md->head_dim;
    /* each projection's input width: the widest's room, and a narrower width's where it is not whole blocks
     * (its zero-padded copy, kaon_linear_workspace) */
    size_t linear_room = 0;
    const size_t inputs[3] = {h, inter, attn};
    for (int i = 0; i < 3; i++) {
        const size_t need = kaon_linear_workspace((int)inputs[i], rows);
        if (need > linear_room) linear_room = need;
    }
    size_t per_row = 2 * h + qkv + attn + 3 * inter + attn / md->head_dim * max_blocks * md->block_size;
    size_t experts = 0;  /* the widest MoE layer's scratch (experts_mlp), after the scores */
    for (int li = 0; li < md->num_layers; li++) {
        const Experts *e = md->layers[li].experts;
        if (!e) continue;
        const size_t need = experts_floats(e, rows, md->hidden);
        if (need > experts) experts = need;
        const size_t need_linear = kaon_linear_workspace(e->width, rows);
        if (need_linear > linear_room) linear_room = need_linear;
    }
    return rows * per_row + experts + linear_room / sizeof(float) + 16;
}

/* The rows' partial sums of a row-parallel projection (o, down) summed over the ranks, before anything
 * reads them (the residual add, Gemma 2's post norms); 0 when the collective failed. The pool's workers
 * may sleep meanwhile: the other ranks, not this step, are what the wait is for. */
static int sum_over_ranks(const Model *md, float *x, int rows) {
    if (md->sum_ranks == NULL) return 1;
    atomic_store(&pool.hold, 0);
    const int ok = md->sum_ranks(x, (int64_t)rows * md->hidden) == 0;
    atomic_store(&pool.hold, 1);
    return ok;
}

/* x [rows, hidden]: the embedded tokens in (a later pipeline stage: the residual stream the one before handed
 * on), the final norm's output out (final_norm NULL: the residual stream after the last layer). Each row is one
 * sequence's newest token at positions[r]; its key and value go to slots[r] of the pool.
 * LoRA: lora_slots[r] is row r's adapter slot (-1: the base model), lora_rows the rows with
 * one, ordered by slot (lora_count of them; 0 and NULLs: no adapters in this step). */
void kaon_decode(const Model *md, int rows, float *x, const int64_t *positions, const int64_t *slots,
                 const int64_t *tables, int max_blocks, const int64_t *context_lens, const int64_t *lora_slots,
                 const int64_t *lora_rows, int lora_count, float *work, int threads) {
    const LoraRows adapters = {lora_slots, lora_rows, lora_count};
    const int hidden = md->hidden, dim = md->head_dim, heads = md->num_heads, kv_heads = md->num_kv_heads;
    const int qkv_width = (heads + 2 * kv_heads) * dim, inter = md->intermediate;
    const int rotated = md->rotary_dim ? md->rotary_dim : dim, half = rotated / 2;
    const int bs = md->block_size;
    const size_t head_stride = (size_t)md->num_blocks * bs * dim;
    float *normed = work, *qkv = normed + (size_t)rows * hidden, *attn = qkv + (size_t)rows * qkv_width;
    float *gate_up = attn + (size_t)rows * heads * dim, *act = gate_up + (size_t)rows * 2 * inter;
    float *proj = act + (size_t)rows * inter, *scores = proj + (size_t)rows * hidden;
    float *experts_work = scores + (size_t)rows * heads * max_blocks * bs;
    size_t experts_room = 0;  /* (kaon_decode_workspace: the widest MoE layer's) */
    for (int li = 0; li < md->num_layers; li++)
        if (md->layers[li].experts) {
            const size_t need = experts_floats(md->layers[li].experts, rows, hidden);
            experts_room = need > experts_room ? need : experts_room;
        }
    void *linear_work = experts_work + experts_room;
    atomic_store(&pool.hold, 1);
    int li = 0;
    for (; li < md->num_layers; li++) {
        const Layer *L = md->layers + li;
        rms_norm(x, L->input_norm, md->eps, rows, hidden, normed);
        kaon_linear(&L->qkv, rows, normed, qkv, linear_work, threads);
        add_lora(&L->lora[LORA_QKV], &adapters, hidden, qkv_width, normed, qkv, threads);
        for (int r = 0; r < rows; r++) {
            float *t = qkv + (size_t)r * qkv_width;
            const float *c = md->cos + (size_t)positions[r] * half, *s = md->sin + (size_t)positions[r] * half;
            if (L->q_norm) {  /* each head alone (in place: a head's sum is taken before it is written) */
                rms_norm(t, L->q_norm, md->eps, heads, dim, t);
                rms_norm(t + (size_t)heads * dim, L->k_norm, md->eps, kv_heads, dim, t + (size_t)heads * dim);
            }
            rotary(t, heads + kv_heads, dim, rotated, c, s);  /* q and k heads sit side by side */
            const int64_t slot = slots[r];
            if (slot < 0) continue;  /* padding: nothing to store */
            for (int h = 0; h < kv_heads; h++) {
                const size_t at = h * head_stride + (size_t)slot * dim;
                store_row(L->k_cache, md->kv_half, at, t + (size_t)(heads + h) * dim, dim);
                store_row(L->v_cache, md->kv_half, at, t + (size_t)(heads + kv_heads + h) * dim, dim);
            }
        }
        AttentionJob job = {md, L, qkv, qkv_width, max_blocks, tables, context_lens, scores, attn};
        parallel_for(rows * md->num_kv_heads, threads, attention_chunk, &job);
        kaon_linear(&L->o, rows, attn, proj, linear_work, threads);
        add_lora(&L->lora[LORA_O], &adapters, heads * dim, hidden, attn, proj, threads);
        if (!sum_over_ranks(md, proj, rows)) break;
        if (L->pre_ff_norm) {  /* Gemma 2: attention's output normalised (in place, row by row) before it joins */
            rms_norm(proj, L->post_norm, md->eps, rows, hidden, proj);
            for (size_t i = 0; i < (size_t)rows * hidden; i++) x[i] += proj[i];
            rms_norm(x, L->pre_ff_norm, md->eps, rows, hidden, normed);
        } else {
            for (size_t i = 0; i < (size_t)rows * hidden; i++) x[i] += proj[i];
            rms_norm(x, L->post_norm, md->eps, rows, hidden, normed);
        }
        if (L->experts) {  /* a mixture-of-experts layer: its output in proj, joined as the dense MLP's */
            experts_mlp(L->experts, rows, hidden, normed, proj, experts_work, linear_work, threads);
            if (!sum_over_ranks(md, proj, rows)) break;  /* each rank's share of every expert's width */
            if (L->post_ff_norm) rms_norm(proj, L->post_ff_norm, md->eps, rows, hidden, proj);
            for (size_t i = 0; i < (size_t)rows * hidden; i++) x[i] += proj[i];
            continue;
        }
        kaon_linear(&L->gate_up, rows, normed, gate_up, linear_work, threads);
        add_lora(&L->lora[LORA_GATE_UP], &adapters, hidden, 2 * inter, normed, gate_up, threads);
        for (int r = 0; r < rows; r++) {
            const float *g = gate_up + (size_t)r * 2 * inter, *u = g + inter;
            float *a = act + (size_t)r * inter;
            if (md->act == ACT_GELU_TANH)
                for (int i = 0; i < inter; i++) a[i] = gelu_tanh(g[i]) * u[i];
            else
                for (int i = 0; i < inter; i++) a[i] = silu(g[i]) * u[i];
        }
        kaon_linear(&L->down, rows, act, proj, linear_work, threads);
        add_lora(&L->lora[LORA_DOWN], &adapters, inter, hidden, act, proj, threads);
        if (!sum_over_ranks(md, proj, rows)) break;
        if (L->post_ff_norm) rms_norm(proj, L->post_ff_norm, md->eps, rows, hidden, proj);  /* Gemma 2 */
        for (size_t i = 0; i < (size_t)rows * hidden; i++) x[i] += proj[i];
    }
    atomic_store(&pool.hold, 0);
    if (li < md->num_layers) return;  /* a collective failed: x is not the step's output */
    if (!md->final_norm) return;  /* a pipeline stage before the last: x is the residual stream it hands on */
    rms_norm(x, md->final_norm, md->eps, rows, hidden, normed);
    memcpy(x, normed, sizeof(float) * (size_t)rows * hidden);
}

/* ---- int4 (Q4_1) weights widened for prefill's dense GEMM --------------------------------
 *
 * A prefill chunk of many rows multiplies a dense copy of an int4 weight (kernels/quant_gemm_cpu.py
 * w4_dense_cpu), made on every call: keeping one per layer would undo the 4-bit memory saving.
 * Made by torch ops (unpack, cat, multiply, add, convert: five passes over the weight) it cost
 * more than the GEMM itself at 256-row chunks, one thread: ~20 ms against ~6 ms per SmolLM2
 * layer, the fixed cost per prefill step that made small chunks dear (bench/prefill_steps.py).
 * Here one pass per group. The numbers are torch's, bit for bit: w = q * scale + min with the
 * product and the sum each rounded to float32 (no fused multiply-add: -std=c11 keeps GCC from
 * contracting), then rounded to bfloat16 to nearest even as .to(torch.bfloat16) does
 * (float_to_bf16), or kept as float32 where the CPU has no bfloat16 GEMM. */
typedef struct {
    const uint8_t *packed;  /* [n, k / 2]: byte j of a group holds element j low, j + group / 2 high */
    const uint16_t *scales, *mins;  /* float16 [n, k / group] */
    int k, group, bf16;
    void *out;  /* [n, k]: bfloat16 (bf16) or float32 */
} WidenJob;

static inline void widen_store(void *out, size_t at, float w, int bf16) {
    if (bf16) ((uint16_t *)out)[at] = float_to_bf16(w);
    else ((float *)out)[at] = w;
}

#ifdef KAON_AVX2
/* Eight elements q (as int32) * scale + min, stored at out + at. */
static inline void widen8(__m256i q, __m256 scale, __m256 min, void *out, size_t at, int bf16) {
    const __m256 w = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q), scale), min);
    if (!bf16) { _mm256_storeu_ps((float *)out + at, w); return; }
    const __m256i x = _mm256_castps_si256(w);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(x, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    /* NaN (none in a finite checkpoint): keep it a NaN as float_to_bf16 does */
    const __m256 nan = _mm256_cmp_ps(w, w, _CMP_UNORD_Q);
    r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(0x40)),
                           _mm256_castps_si256(nan));
    const __m128i packed16 = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128((__m128i *)((uint16_t *)out + at), packed16);
}
#endif

static void widen_rows(const void *arg, int begin, int end) {
    const WidenJob *job = arg;
    const int k = job->k, group = job->group, half = group / 2, groups = k / group;
    for (int row = begin; row < end; row++) {
        const uint8_t *p = job->packed + (size_t)row * (k / 2);
        for (int g = 0; g < groups; g++) {
            const float scale = half_to_float(job->scales[(size_t)row * groups + g]);
            const float min = half_to_float(job->mins[(size_t)row * groups + g]);
            const uint8_t *bytes = p + (size_t)g * half;
            const size_t at = (size_t)row * k + (size_t)g * group;
            int j = 0;
#ifdef KAON_AVX2
            const __m256 vs = _mm256_set1_ps(scale), vm = _mm256_set1_ps(min);
            for (; j + 8 <= half; j += 8) {
                const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(bytes + j)));
                widen8(_mm256_and_si256(b, _mm256_set1_epi32(0xf)), vs, vm, job->out, at + j, job->bf16);
                widen8(_mm256_srli_epi32(b, 4), vs, vm, job->out, at + half + j, job->bf16);
            }
#endif
            for (; j < half; j++) {
                widen_store(job->out, at + j, (float)(bytes[j] & 0xf) * scale + min, job->bf16);
                widen_store(job->out, at + half + j, (float)(bytes[j] >> 4) * scale + min, job->bf16);
            }
        }
    }
}

/* out [n, k] = the dequantized weight, in bfloat16 (bf16 != 0) or float32, on `threads` threads. */
void kaon_widen_q4_1(const uint8_t *packed, const uint16_t *scales, const uint16_t *mins, int n, int k, int group,
                     int bf16, void *out, int threads) {
    WidenJob job = {packed, scales, mins, k, group, bf16, out};
    parallel_for(n, threads, widen_rows, &job);
}

/* ---- float64, each row alone (issue 49 §2) ----
 * A float64 model on CPU (the tests' exactness oracle against transformers' float64) runs torch's path with these for
 * its projections, its vocabulary head and its attention (layers/rows_alone.py). Every output of a row is summed in
 * one order fixed by the weight's shape (and, for attention, the row's own context), whatever the number of rows, the
 * thread count or the tile: so a row's numbers do not depend on the rows beside it, as torch's float64 GEMMs' do (their
 * blocking moves with the row count). Each product is an explicit fma() in its lane, and the lanes meet in one fixed
 * order (C11 without fast-math: no reassociation, no contraction), so the AVX2 and the plain C code give the same bits.
 * Nothing above is used or changed. */
#define F64_LANES 4

static inline double f64_lanes_sum(const double *a) { return (a[0] + a[1]) + (a[2] + a[3]); }

/* y[r][c] = x_r . w_c (+ bias[c]) for R <= 2 rows of x (stride xs) and C <= 4 rows of w (stride ws), k long: lane l
 * of an output sums the products k = l, l + 4, ... in order, the lanes meet as f64_lanes_sum, then the tail k % 4 */
static inline __attribute__((always_inline)) void tile_f64(const double *x, size_t xs, const double *w, size_t ws,
                                                          int k, int R, int C, const double *bias, double *y, size_t ys) {
    double lanes[2][4][F64_LANES];
    int t = 0;
#ifdef KAON_AVX2
    __m256d acc[2][4];
    for (int r = 0; r < R; r++) for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_pd();
    for (; t + F64_LANES <= k; t += F64_LANES) {
        __m256d xv[2], wv[4];
        for (int r = 0; r < R; r++) xv[r] = _mm256_loadu_pd(x + r * xs + t);
        for (int c = 0; c < C; c++) wv[c] = _mm256_loadu_pd(w + c * ws + t);
        for (int r = 0; r < R; r++) for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_pd(xv[r], wv[c], acc[r][c]);
    }
    for (int r = 0; r < R; r++) for (int c = 0; c < C; c++) _mm256_storeu_pd(lanes[r][c], acc[r][c]);
#else
    for (int r = 0; r < R; r++) for (int c = 0; c < C; c++) for (int l = 0; l < F64_LANES; l++) lanes[r][c][l] = 0;
    for (; t + F64_LANES <= k; t += F64_LANES)
        for (int r = 0; r < R; r++) for (int c = 0; c < C; c++) for (int l = 0; l < F64_LANES; l++)
            lanes[r][c][l] = fma(x[r * xs + t + l], w[c * ws + t + l], lanes[r][c][l]);
#endif
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            double s = f64_lanes_sum(lanes[r][c]);
            for (int i = t; i < k; i++) s = fma(x[r * xs + i], w[c * ws + i], s);
            y[r * ys + c] = bias ? s + bias[c] : s;
        }
}

static void tile_f64_any(const double *x, size_t xs, const double *w, size_t ws, int k, int R, int C,
                         const double *bias, double *y, size_t ys) {
#define F64_CASE(r, c) case (r) * 8 + (c): tile_f64(x, xs, w, ws, k, r, c, bias, y, ys); return;
    switch (R * 8 + C) {
        F64_CASE(1, 1) F64_CASE(1, 2) F64_CASE(1, 3) F64_CASE(1, 4)
        F64_CASE(2, 1) F64_CASE(2, 2) F64_CASE(2, 3) F64_CASE(2, 4)
    }
#undef F64_CASE
}

typedef struct {
    const double *x, *w, *bias;
    double *y;
    int rows, n, k, transposed;
} LinearF64Job;

#define F64_COLS 4    /* outputs per tile of an [n, k] weight: the chunks parallel_for hands out */
#define F64_T_COLS 16 /* outputs per tile of a [k, n] weight */

/* outputs [F64_COLS * begin, F64_COLS * end) of every row, an [n, k] weight: each output's lanes as tile_f64 sums them */
static void linear_f64_chunk(const void *ctx, int begin, int end) {
    const LinearF64Job *job = ctx;
    const int n = job->n, k = job->k;
    for (int c0 = begin * F64_COLS; c0 < end * F64_COLS && c0 < n; c0 += F64_COLS) {
        const int C = n - c0 < F64_COLS ? n - c0 : F64_COLS;
        for (int r0 = 0; r0 < job->rows; r0 += 2) {  /* the tile's weights stay in cache across the rows */
            const int R = job->rows - r0 < 2 ? job->rows - r0 : 2;
            tile_f64_any(job->x + (size_t)r0 * k, k, job->w + (size_t)c0 * k, k, k, R, C,
                         job->bias ? job->bias + c0 : NULL, job->y + (size_t)r0 * n + c0, n);
        }
    }
}

/* a [k, n] weight (the vocabulary head's [hidden, vocab]): each output sums its products k = 0, 1, ... in order */
static void linear_f64_t_chunk(const void *ctx, int begin, int end) {
    const LinearF64Job *job = ctx;
    const int n = job->n, k = job->k;
    for (int c0 = begin * F64_T_COLS; c0 < end * F64_T_COLS && c0 < n; c0 += F64_T_COLS) {
        const int C = n - c0 < F64_T_COLS ? n - c0 : F64_T_COLS;
        for (int r = 0; r < job->rows; r++) {
            const double *x = job->x + (size_t)r * k;
            double *y = job->y + (size_t)r * n + c0;
            int c = 0;
#ifdef KAON_AVX2
            if (C == F64_T_COLS) {
                __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
                for (int t = 0; t < k; t++) {
                    const __m256d xv = _mm256_set1_pd(x[t]);
                    const double *w = job->w + (size_t)t * n + c0;
                    for (int v = 0; v < 4; v++) acc[v] = _mm256_fmadd_pd(xv, _mm256_loadu_pd(w + 4 * v), acc[v]);
                }
                for (int v = 0; v < 4; v++) _mm256_storeu_pd(y + 4 * v, acc[v]);
                c = C;
            }
#endif
            for (; c < C; c++) {
                double s = 0;
                for (int t = 0; t < k; t++) s = fma(x[t], job->w[(size_t)t * n + c0 + c], s);
                y[c] = s;
            }
            if (job->bias)
                for (c = 0; c < C; c++) y[c] += job->bias[c0 + c];
        }
    }
}

/* y [rows, n] = x [rows, k] @ w.T (+ bias), w [n, k]; transposed: w [k, n]. All float64, contiguous. */
void kaon_linear_f64(const double *x, const double *w, const double *bias, double *y, int rows, int n, int k,
                     int transposed, int threads) {
    LinearF64Job job = {x, w, bias, y, rows, n, k, transposed};
    if (rows <= 0 || n <= 0) return;
    if (transposed)
        parallel_for((n + F64_T_COLS - 1) / F64_T_COLS, threads, linear_f64_t_chunk, &job);
    else
        parallel_for((n + F64_COLS - 1) / F64_COLS, threads, linear_f64_chunk, &job);
}

typedef struct {
    const double *q, *k_cache, *v_cache;
    const int64_t *tables, *lens;
    int heads, kv_heads, dim, num_blocks, block_size, max_blocks, window;
    double scale, softcap;
    double *out, *work;
} AttentionF64Job;

/* (row, head) pairs [begin, end): the query against its own context in the paged cache, as decode attention computes
 * it (torch's decode_attention_ref): scores q . k * scale (soft-capped), softmax, then the probabilities times the
 * values summed in key order. Only the row's own context length and window decide the order. */
static void attention_f64_chunk(const void *ctx, int begin, int end) {
    const AttentionF64Job *job = ctx;
    const int dim = job->dim, bs = job->block_size, group = job->heads / job->kv_heads;
    for (int task = begin; task < end; task++) {
        const int row = task / job->heads, head = task % job->heads, kvh = head / group;
        const int64_t len = job->lens[row];
        const int64_t first = job->window > 0 && len > job->window ? len - job->window : 0;
        const double *q = job->q + (size_t)task * dim;
        const int64_t *table = job->tables + (size_t)row * job->max_blocks;
        double *scores = job->work + (size_t)task * job->max_blocks * bs;
        double *out = job->out + (size_t)task * dim;
        double most = -INFINITY, sum = 0;
        for (int64_t j = first; j < len; j++) {
            const double *key = job->k_cache + (((size_t)kvh * job->num_blocks + table[j / bs]) * bs + j % bs) * dim;
            double s;
            tile_f64(q, 0, key, 0, dim, 1, 1, NULL, &s, 0);
            s *= job->scale;
            if (job->softcap > 0) s = tanh(s / job->softcap) * job->softcap;
            scores[j] = s;
            most = s > most ? s : most;
        }
        for (int64_t j = first; j < len; j++) {
            scores[j] = exp(scores[j] - most);
            sum += scores[j];
        }
        for (int d = 0; d < dim; d++) out[d] = 0;
        for (int64_t j = first; j < len; j++) {
            const double p = scores[j] / sum;
            const double *value = job->v_cache + (((size_t)kvh * job->num_blocks + table[j / bs]) * bs + j % bs) * dim;
            for (int d = 0; d < dim; d++) out[d] = fma(p, value[d], out[d]);
        }
    }
}

/* out [rows, heads, dim] = each row's query q [rows, heads, dim] against its context in the float64 cache
 * [kv_heads, num_blocks, block_size, dim]: tables [rows, max_blocks], lens [rows] (the keys it sees, itself
 * included), window (keys a query sees, itself included; 0: all), softcap (0: none); work: room for
 * rows * heads * max_blocks * block_size doubles. */
void kaon_attention_f64(const double *q, const double *k_cache, const double *v_cache, const int64_t *tables,
                        const int64_t *lens, int rows, int heads, int kv_heads, int dim, int num_blocks, int block_size,
                        int max_blocks, int window, double scale, double softcap, double *out, double *work,
                        int threads) {
    AttentionF64Job job = {q, k_cache, v_cache, tables, lens, heads, kv_heads, dim, num_blocks, block_size, max_blocks,
                           window, scale, softcap, out, work};
    parallel_for(rows * heads, threads, attention_f64_chunk, &job);
}
