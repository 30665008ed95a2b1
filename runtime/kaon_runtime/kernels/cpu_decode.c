/* A whole decode step of a Llama-family decoder on CPU, in one call: no per-op dispatch.
 *
 * Why hand-written: at batch 1 a torch decode step of SmolLM2-135M spends more time in its
 * thousands of small ops and in Python (~17 ms) than in its matrix products (~9 ms); llama.cpp
 * runs one fused graph per token in C. This file does the same for kaon's own layouts: every
 * layer's norms, projections, rotary, KV-cache write, paged attention and SwiGLU, then the
 * final norm (the embedding lookup and the vocabulary head stay in torch).
 *
 * Projections read their weights as stored:
 *   F32   float32 [N, K]
 *   INT8  int8 [N, K] with one float32 scale per output row (kaon's int8)
 *   Q4_1  uint8 [N, K/2] with float16 scales and mins per group of 32 (kaon's int4 = GGUF Q4_1;
 *         byte j of a group holds element j low and element j + 16 high)
 * The narrow ones multiply activations quantized to int8 in blocks of 32 (one float scale per
 * block), so the inner loop is an integer dot product (AVX2 maddubs), as llama.cpp's Q8_1
 * activations do. The float path is plain float32 FMA.
 *
 * Threads: OpenMP, sharing torch's runtime (the library links the libgomp torch loaded), so
 * torch.set_num_threads applies. Built with -march=native; without AVX2 scalar loops run.
 * References: tests/test_cpu_decode.py compares each kernel and the whole step with torch.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KAON_AVX2 1
#endif

#define QBLOCK 32

enum { KIND_F32 = 0, KIND_INT8 = 1, KIND_Q4_1 = 2 };

typedef struct {
    int32_t kind, n, k;
    const void *w;          /* see the kinds above */
    const float *scales;    /* INT8: [n] */
    const uint16_t *d, *m;  /* Q4_1: float16 [n, k/32] scales and mins */
    const float *bias;      /* [n] or NULL */
} Linear;

typedef struct {
    Linear qkv, o, gate_up, down;
    const float *input_norm, *post_norm;
    float *k_cache, *v_cache;  /* [kv_heads, num_blocks, block_size, head_dim] */
} Layer;

typedef struct {
    int32_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size, num_blocks;
    float eps, scale;
    const float *final_norm;
    const float *cos, *sin;  /* [positions, head_dim / 2] */
    const Layer *layers;
} Model;

/* ---- small helpers ------------------------------------------------------------------ */

static float half_to_float(uint16_t h) {
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

#ifdef KAON_AVX2
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

/* y += a * x */
static void axpy(float *y, float a, const float *x, int n) {
    int i = 0;
#ifdef KAON_AVX2
    __m256 va = _mm256_set1_ps(a);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
    for (; i < n; i++) y[i] += a * x[i];
}

/* ---- activations quantized in blocks of 32: x ~ d[b] * q[b*32 + i]; s[b] = d[b] * sum(q) --- */

void kaon_quantize_q8(const float *x, int k, int8_t *q, float *d, float *s) {
    for (int b = 0; b < k / QBLOCK; b++) {
        const float *xb = x + b * QBLOCK;
        float amax = 0.f;
        for (int i = 0; i < QBLOCK; i++) amax = fmaxf(amax, fabsf(xb[i]));
        float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        int sum = 0;
        for (int i = 0; i < QBLOCK; i++) {
            int v = (int)nearbyintf(xb[i] * inv);
            q[b * QBLOCK + i] = (int8_t)v;
            sum += v;
        }
        d[b] = scale;
        s[b] = scale * (float)sum;
    }
}

#ifdef KAON_AVX2
/* 32 signed int8 products summed into 8 int32 lanes (maddubs wants one unsigned operand). */
static inline __m256 dot_i8_block(__m256i w, __m256i x) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
}

/* unsigned 4-bit weights (0..15) against signed int8: maddubs takes them as they are. */
static inline __m256 dot_u4_block(const uint8_t *packed, __m256i x) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m128i raw = _mm_loadu_si128((const __m128i *)packed), low = _mm_set1_epi8(0x0f);
    __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low), _mm_and_si128(raw, low));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones));
}
#endif

static float row_int8(const int8_t *w, const int8_t *q, const float *d, int k) {
    int blocks = k / QBLOCK;
#ifdef KAON_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        __m256 p = dot_i8_block(_mm256_loadu_si256((const __m256i *)(w + b * QBLOCK)),
                                _mm256_loadu_si256((const __m256i *)(q + b * QBLOCK)));
        acc = _mm256_fmadd_ps(p, _mm256_set1_ps(d[b]), acc);
    }
    return hsum8(acc);
#else
    float sum = 0.f;
    for (int b = 0; b < blocks; b++) {
        int dot = 0;
        for (int i = 0; i < QBLOCK; i++) dot += w[b * QBLOCK + i] * q[b * QBLOCK + i];
        sum += d[b] * (float)dot;
    }
    return sum;
#endif
}

static float row_q4_1(const uint8_t *w, const uint16_t *wd, const uint16_t *wm, const int8_t *q,
                      const float *d, const float *s, int k) {
    int blocks = k / QBLOCK;
    float mins = 0.f;
#ifdef KAON_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        __m256 p = dot_u4_block(w + b * QBLOCK / 2, _mm256_loadu_si256((const __m256i *)(q + b * QBLOCK)));
        acc = _mm256_fmadd_ps(p, _mm256_set1_ps(half_to_float(wd[b]) * d[b]), acc);
        mins += half_to_float(wm[b]) * s[b];
    }
    return hsum8(acc) + mins;
#else
    float sum = 0.f;
    for (int b = 0; b < blocks; b++) {
        const uint8_t *wb = w + b * QBLOCK / 2;
        const int8_t *qb = q + b * QBLOCK;
        int dot = 0;
        for (int i = 0; i < QBLOCK / 2; i++) dot += (wb[i] & 0xf) * qb[i] + (wb[i] >> 4) * qb[i + QBLOCK / 2];
        sum += half_to_float(wd[b]) * d[b] * (float)dot;
        mins += half_to_float(wm[b]) * s[b];
    }
    return sum + mins;
#endif
}

/* y [rows, n] = x [rows, k] @ W.T (+ bias), on `threads` threads (torch's count, passed in: OpenMP's
 * default is per calling thread). work: room for kaon_linear_workspace(k, rows) bytes. */
size_t kaon_linear_workspace(int k, int rows) {
    return (size_t)rows * ((size_t)k + 2 * sizeof(float) * (k / QBLOCK)) + 64;
}

void kaon_linear(const Linear *l, int rows, const float *x, float *y, void *work, int threads) {
    const int n = l->n, k = l->k, blocks = k / QBLOCK;
    int8_t *q = (int8_t *)work;
    float *d = (float *)(q + (size_t)rows * k + (-(size_t)rows * k & 3)), *s = d + (size_t)rows * blocks;
    if (l->kind != KIND_F32)
        for (int r = 0; r < rows; r++)
            kaon_quantize_q8(x + (size_t)r * k, k, q + (size_t)r * k, d + (size_t)r * blocks, s + (size_t)r * blocks);
    /* Each thread takes whole output rows and reuses one weight row for every activation row. */
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int j = 0; j < n; j++) {
        for (int r = 0; r < rows; r++) {
            float v;
            if (l->kind == KIND_F32) {
                v = dot_f32((const float *)l->w + (size_t)j * k, x + (size_t)r * k, k);
            } else if (l->kind == KIND_INT8) {
                v = l->scales[j] * row_int8((const int8_t *)l->w + (size_t)j * k, q + (size_t)r * k,
                                            d + (size_t)r * blocks, k);
            } else {
                v = row_q4_1((const uint8_t *)l->w + (size_t)j * k / 2, l->d + (size_t)j * blocks,
                             l->m + (size_t)j * blocks, q + (size_t)r * k, d + (size_t)r * blocks,
                             s + (size_t)r * blocks, k);
            }
            y[(size_t)r * n + j] = l->bias ? v + l->bias[j] : v;
        }
    }
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

/* HF's split-halves rotary on `heads` heads of one token, in place. */
static void rotary(float *x, int heads, int dim, const float *cos, const float *sin) {
    int half = dim / 2;
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

/* One query token per sequence against its paged context; a task is one (sequence, query
 * head) pair. scores: room for rows * num_heads * max_context floats. */
static void decode_attention(const Model *md, const Layer *layer, int rows, const float *qkv, int qkv_width,
                             const int64_t *tables, int max_blocks, const int64_t *context_lens, float *scores,
                             float *out, int threads) {
    const int heads = md->num_heads, dim = md->head_dim, bs = md->block_size;
    const int group = heads / md->num_kv_heads, max_ctx = max_blocks * bs;
    const size_t head_stride = (size_t)md->num_blocks * bs * dim;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int task = 0; task < rows * heads; task++) {
        const int r = task / heads, qh = task % heads, ctx = (int)context_lens[r];
        const int64_t *table = tables + (size_t)r * max_blocks;
        const float *kc = layer->k_cache + (qh / group) * head_stride, *vc = layer->v_cache + (qh / group) * head_stride;
        const float *q = qkv + (size_t)r * qkv_width + (size_t)qh * dim;
        float *sc = scores + (size_t)task * max_ctx, top = -INFINITY, total = 0.f;
        for (int t = 0; t < ctx; t++) {
            sc[t] = dot_f32(q, kc + ((size_t)table[t / bs] * bs + t % bs) * dim, dim) * md->scale;
            top = fmaxf(top, sc[t]);
        }
        for (int t = 0; t < ctx; t++) { sc[t] = expf(sc[t] - top); total += sc[t]; }
        float *o = out + (size_t)task * dim;
        memset(o, 0, sizeof(float) * dim);
        for (int t = 0; t < ctx; t++)
            axpy(o, sc[t] / total, vc + ((size_t)table[t / bs] * bs + t % bs) * dim, dim);
    }
}

/* Floats of scratch space kaon_decode needs for `rows` sequences of up to max_blocks blocks:
 * normed and proj [hidden], qkv, attention out [heads * dim], gate_up [2 I], act [I] per row,
 * the attention scores, then kaon_linear's quantized activations. */
size_t kaon_decode_workspace(const Model *md, int rows, int max_blocks) {
    size_t h = md->hidden, inter = md->intermediate, attn = (size_t)md->num_heads * md->head_dim;
    size_t qkv = attn + 2 * (size_t)md->num_kv_heads * md->head_dim;
    size_t widest = h > inter ? h : inter;
    if (attn > widest) widest = attn;
    size_t per_row = 2 * h + qkv + attn + 3 * inter + attn / md->head_dim * max_blocks * md->block_size;
    return rows * per_row + kaon_linear_workspace((int)widest, rows) / sizeof(float) + 16;
}

/* x [rows, hidden]: the embedded tokens in, the final norm's output out. Each row is one
 * sequence's newest token at positions[r]; its key and value go to slots[r] of the pool. */
void kaon_decode(const Model *md, int rows, float *x, const int64_t *positions, const int64_t *slots,
                 const int64_t *tables, int max_blocks, const int64_t *context_lens, float *work, int threads) {
    const int hidden = md->hidden, dim = md->head_dim, heads = md->num_heads, kv_heads = md->num_kv_heads;
    const int qkv_width = (heads + 2 * kv_heads) * dim, inter = md->intermediate, half = dim / 2;
    const int bs = md->block_size;
    const size_t head_stride = (size_t)md->num_blocks * bs * dim;
    float *normed = work, *qkv = normed + (size_t)rows * hidden, *attn = qkv + (size_t)rows * qkv_width;
    float *gate_up = attn + (size_t)rows * heads * dim, *act = gate_up + (size_t)rows * 2 * inter;
    float *proj = act + (size_t)rows * inter, *scores = proj + (size_t)rows * hidden;
    void *linear_work = scores + (size_t)rows * heads * max_blocks * bs;
    for (int li = 0; li < md->num_layers; li++) {
        const Layer *L = md->layers + li;
        rms_norm(x, L->input_norm, md->eps, rows, hidden, normed);
        kaon_linear(&L->qkv, rows, normed, qkv, linear_work, threads);
        for (int r = 0; r < rows; r++) {
            float *t = qkv + (size_t)r * qkv_width;
            const float *c = md->cos + (size_t)positions[r] * half, *s = md->sin + (size_t)positions[r] * half;
            rotary(t, heads + kv_heads, dim, c, s);  /* q and k heads sit side by side */
            const int64_t slot = slots[r];
            if (slot < 0) continue;  /* padding: nothing to store */
            for (int h = 0; h < kv_heads; h++) {
                memcpy(L->k_cache + h * head_stride + (size_t)slot * dim, t + (size_t)(heads + h) * dim,
                       sizeof(float) * dim);
                memcpy(L->v_cache + h * head_stride + (size_t)slot * dim,
                       t + (size_t)(heads + kv_heads + h) * dim, sizeof(float) * dim);
            }
        }
        decode_attention(md, L, rows, qkv, qkv_width, tables, max_blocks, context_lens, scores, attn, threads);
        kaon_linear(&L->o, rows, attn, proj, linear_work, threads);
        for (size_t i = 0; i < (size_t)rows * hidden; i++) x[i] += proj[i];
        rms_norm(x, L->post_norm, md->eps, rows, hidden, normed);
        kaon_linear(&L->gate_up, rows, normed, gate_up, linear_work, threads);
        for (int r = 0; r < rows; r++) {
            const float *g = gate_up + (size_t)r * 2 * inter, *u = g + inter;
            for (int i = 0; i < inter; i++) act[(size_t)r * inter + i] = silu(g[i]) * u[i];
        }
        kaon_linear(&L->down, rows, act, proj, linear_work, threads);
        for (size_t i = 0; i < (size_t)rows * hidden; i++) x[i] += proj[i];
    }
    rms_norm(x, md->final_norm, md->eps, rows, hidden, normed);
    memcpy(x, normed, sizeof(float) * (size_t)rows * hidden);
}
