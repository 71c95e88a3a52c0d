/* Paged decode attention and store_kv on the CPU, in place in the pool (model_runner/kernels/).
 *
 *     query:         [S, H_q, D] fp32            (the wrapper converts other dtypes)
 *     k/v_cache:     [num_blocks, block_size, H_kv, D]  fp32, fp16, bf16 or fp8 e4m3
 *     block_tables:  [S, max_blocks] int32       seq_lens: [S] int32
 *     -> out:        [S, H_q, D] fp32
 *     store_kv:      key/value [T, H_kv, D] -> the cache rows of slot_mapping [T] int64
 *
 * Plain C against Python.h: the Python wrapper (cpu_paged.py) checks the tensors' dtypes,
 * devices, shapes and strides and passes their addresses (data_ptr), shapes and strides in
 * elements. The values (block ids, slots, lengths) are checked here, all of them before
 * anything is read through them or written, so a bad one is a ValueError that changes nothing.
 * The loops run without the GIL: the runner's event loop goes on beside the forward thread.
 *
 * Decode, per (sequence, KV head): the G = H_q / H_kv query heads of the GQA group are G rows
 * against the same K/V rows, read through the block table where they lie (no gather), block
 * by block with an online softmax in fp32 (flash-decoding's recurrence):
 *     s_t   = q . k_t * scale            (softcap c > 0: s_t = c * tanh(s_t / c))
 *     m'    = max(m, max_t s_t)          the running max over the positions seen so far
 *     l     = l * exp(m - m') + sum_t exp(s_t - m')
 *     acc   = acc * exp(m - m') + sum_t exp(s_t - m') * v_t
 *     out   = acc / l
 * over the positions (seq_len - W, seq_len - 1] with a sliding window W, else [0, seq_len).
 *
 * The hot helpers are always inlined into two copies of each loop: one compiled for AVX2+FMA
 * (+F16C), one for any x86-64; the CPU picks at run time (__builtin_cpu_supports). Row math
 * uses GCC's vector extension (8 fp32 lanes), which each copy lowers to its own instructions.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* a * b + c in one FMA where the copy has it (-std=c11 turns contraction off), and selects
 * and float-int conversions in loops without branches (nothing here reads the FP exception
 * flags); no -ffast-math: NaN, infinities and the order of additions stay as written. */
#pragma GCC optimize("fp-contract=fast", "no-trapping-math")
/* The 8-lane helpers take and return vectors, which the portable copy's ABI would pass in
 * memory; they are always inlined, so no such call exists. */
#pragma GCC diagnostic ignored "-Wpsabi"

#define HOT static inline __attribute__((always_inline))
#define AVX2 __attribute__((target("avx2,fma,f16c")))

/* Cache dtypes, as the wrapper numbers them (cpu_paged.DTYPE_CODES). */
enum { DT_F32 = 0, DT_F16 = 1, DT_BF16 = 2, DT_F8 = 3 };
/* fp8 e4m3fn: the largest finite value; store_kv saturates to it (paged_checks.FP8_MAX). */
#define FP8_MAX 448.0f
/* Lanes of the row vectors. */
#define LANES 8

typedef float v8f __attribute__((vector_size(LANES * sizeof(float))));

/* fp8 e4m3fn -> fp32 for each of the 256 bytes, filled at import. */
static float fp8_to_f32[256];

/* ---- scalar conversions ---------------------------------------------------------------- */

HOT float bits_f32(uint32_t w) { float f; memcpy(&f, &w, 4); return f; }
HOT uint32_t f32_bits(float f) { uint32_t w; memcpy(&w, &f, 4); return w; }

/* bf16 is fp32's upper half. */
HOT float bf16_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

/* fp16 -> fp32 exactly, subnormals, inf and NaN included, without branches (the FP16
 * library's trick): move the exponent and mantissa into fp32's places and rescale by
 * 2^-112 (the bias difference); a subnormal is rebuilt as (0.5 + m / 2^11) - 0.5. */
HOT float f16_f32(uint16_t h) {
    uint32_t w = (uint32_t)h << 16, sign = w & 0x80000000u, two_w = w + w;
    float normal = bits_f32((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    float subnormal = bits_f32((two_w >> 17) | (126u << 23)) - 0.5f;
    uint32_t is_subnormal = 0u - (uint32_t)(two_w < (1u << 27));  /* all ones or zero */
    return bits_f32(sign | (f32_bits(subnormal) & is_subnormal)
                    | (f32_bits(normal) & ~is_subnormal));
}

/* fp32 -> fp8 e4m3fn, rounded to nearest even, torch's conversion (c10 Float8_e4m3fn):
 * a magnitude of 480 or more (or NaN) is NaN 0x7f; below 2^-6 (subnormal) the float add of
 * 2^14 rounds the mantissa into the low bits; else rebias the exponent (127 -> 7) and round
 * the 20 dropped mantissa bits to even. store_kv clamps to +-448 first, so only NaN is NaN. */
HOT uint8_t f32_fp8(float f) {
    uint32_t bits = f32_bits(f), sign = bits & 0x80000000u, mag = bits ^ sign;
    uint8_t out;
    if (mag >= (1087u << 20)) {
        out = 0x7f;
    } else if (mag < (121u << 23)) {
        out = (uint8_t)(f32_bits(bits_f32(mag) + bits_f32(141u << 23)) - (141u << 23));
    } else {
        mag += ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + ((mag >> 20) & 1u);
        out = (uint8_t)(mag >> 20);
    }
    return out | (uint8_t)(sign >> 24);
}

/* e^x for x <= 0 (a score minus the running max), in arithmetic the loops vectorize (expf is a
 * call per element): x = n ln2 + r with n an integer and |r| <= ln2 / 2 (Cody-Waite: ln2 in
 * two parts, so n ln2 loses no bits), e^r by its Taylor series to r^7 (relative error below
 * 1e-8, under fp32's half ulp), times 2^n built in the exponent bits. Below -87 (n < -126,
 * subnormal) it is 0, as is e^-inf. */
HOT float exp_nonpositive(float x) {
    const float round_magic = 12582912.0f;  /* 1.5 * 2^23: adding it rounds to an integer */
    float in_range = (float)(x >= -87.0f);    /* 0 for -inf (and NaN, which stays NaN) */
    x = x < -87.0f ? -87.0f : x;              /* no branch: the loops stay vectorized */
    float n = (x * 1.44269504f + round_magic) - round_magic;
    float r = x - n * 0.693145752f - n * 1.42860677e-6f;
    float p = 1.0f / 5040;
    p = p * r + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    return p * bits_f32((uint32_t)((int32_t)n + 127) << 23) * in_range;
}

/* ---- rows: D contiguous elements ------------------------------------------------------- */

HOT v8f load8(const float *p) { v8f v; memcpy(&v, p, sizeof v); return v; }

/* A cache row as fp32: the row itself for an fp32 cache, else converted into `tmp`. */
HOT const float *row_f32(const char *src, int dtype, int64_t n, float *tmp) {
    if (dtype == DT_F32) return (const float *)src;
    const uint16_t *h = (const uint16_t *)src;
    const uint8_t *b = (const uint8_t *)src;
    if (dtype == DT_BF16) for (int64_t d = 0; d < n; d++) tmp[d] = bf16_f32(h[d]);
    else if (dtype == DT_F16) for (int64_t d = 0; d < n; d++) tmp[d] = f16_f32(h[d]);
    else for (int64_t d = 0; d < n; d++) tmp[d] = fp8_to_f32[b[d]];
    return tmp;
}

/* out[j] = sum of a[j]'s lanes, for 8 vectors at once: three rounds of pairwise sums (a
 * transpose folded into the adds), instead of 8 separate horizontal sums. */
typedef int v8i __attribute__((vector_size(LANES * sizeof(int))));
HOT v8f pair_sums(const v8f *x, const v8f *y) {  /* x0+x1, x2+x3, y0+y1, y2+y3, x4+x5, ... */
    return __builtin_shuffle(*x, *y, (v8i){0, 2, 8, 10, 4, 6, 12, 14})
           + __builtin_shuffle(*x, *y, (v8i){1, 3, 9, 11, 5, 7, 13, 15});
}
HOT v8f lane_sums(const v8f *a) {
    v8f pairs[4] = {pair_sums(&a[0], &a[1]), pair_sums(&a[2], &a[3]), pair_sums(&a[4], &a[5]),
                    pair_sums(&a[6], &a[7])};
    v8f low = pair_sums(&pairs[0], &pairs[1]);   /* a0..a3's sums over lanes 0-3, then 4-7 */
    v8f high = pair_sums(&pairs[2], &pairs[3]);  /* the same of a4..a7 */
    return __builtin_shuffle(low, high, (v8i){0, 1, 2, 3, 8, 9, 10, 11})
           + __builtin_shuffle(low, high, (v8i){4, 5, 6, 7, 12, 13, 14, 15});
}

/* ---- decode attention ------------------------------------------------------------------ */

/* Positions scored at once: one lane_sums. */
#define TOKENS 8

typedef struct {
    const char *k, *v;       /* the caches' first elements */
    int dtype;               /* DT_*, both caches */
    int64_t elem;            /* bytes per element */
    int64_t stride_b, stride_s, stride_h;  /* elements per block, slot, head (K and V alike) */
    int64_t num_blocks, block_size, num_kv_heads, head_dim;
} Cache;

typedef struct {
    Cache cache;
    const float *q;          /* [S, H_q, D] fp32 */
    float *out;              /* [S, H_q, D] fp32, contiguous */
    const int32_t *tables;   /* [S, max_blocks] */
    const int32_t *lens;     /* [S] */
    int64_t num_seqs, num_q_heads, table_width;
    int64_t stride_qs, stride_qh, stride_ts, stride_tb, stride_l;
    float scale, cap;        /* cap 0: no softcap */
    int64_t window;          /* 0: none */
} Decode;

/* Scratch of one call, reused by every (sequence, KV head): G running maxes and sums, G
 * accumulator rows [G, D], a block's scores [G, B + TOKENS], a block's K and V rows as fp32
 * [B, D] each (when the cache holds another dtype), and a zero row (past a block's last
 * position, so that TOKENS positions are always scored together). */
typedef struct { float *m, *l, *acc, *scores, *keys, *values, *zero; } Scratch;

/* Rows [t0, t1) of a block, fp32: where row t lies (rows + t * stride). */
typedef struct { const float *rows; int64_t stride; } Rows;

HOT const char *cache_row(const Cache *c, const char *base, int64_t block, int64_t slot,
                          int64_t head) {
    return base + (block * c->stride_b + slot * c->stride_s + head * c->stride_h) * c->elem;
}

/* The block's rows of KV head `head` as fp32: in place for an fp32 cache, else converted into
 * `tmp` (only rows [t0, t1)). */
HOT Rows block_rows(const Cache *c, const char *base, int64_t block, int64_t head, int64_t t0,
                    int64_t t1, float *tmp) {
    if (c->dtype == DT_F32)
        return (Rows){(const float *)cache_row(c, base, block, 0, head), c->stride_s};
    for (int64_t t = t0; t < t1; t++)
        row_f32(cache_row(c, base, block, t, head), c->dtype, c->head_dim, tmp + t * c->head_dim);
    return (Rows){tmp, c->head_dim};
}

/* s_t = q . k_t * scale (then c * tanh(s_t / c) with a softcap) for positions [t0, t1) of the
 * block, TOKENS at a time: LANES partial sums per position over D, then lane_sums.
 * Positions past t1 read the zero row; their scores land past t1 and are never used. */
HOT void block_scores(const Decode *a, const float *q, Rows k, int64_t t0, int64_t t1,
                      float *scores, const float *zero) {
    int64_t dim = a->cache.head_dim;
    for (int64_t t = t0; t < t1; t += TOKENS) {
        const float *row[TOKENS];
        v8f acc[TOKENS] = {{0}};
        for (int j = 0; j < TOKENS; j++) row[j] = t + j < t1 ? k.rows + (t + j) * k.stride : zero;
        int64_t d = 0;
        for (; d + LANES <= dim; d += LANES) {
            v8f qd = load8(q + d);
            for (int j = 0; j < TOKENS; j++) acc[j] += qd * load8(row[j] + d);
        }
        v8f s = lane_sums(acc);
        for (; d < dim; d++)  /* the tail of a D that is no multiple of LANES */
            for (int j = 0; j < TOKENS; j++) s[j] += q[d] * row[j][d];
        s *= a->scale;
        for (int j = 0; j < TOKENS; j++) scores[t + j] = s[j];
    }
    if (a->cap > 0.0f)
        for (int64_t t = t0; t < t1; t++) scores[t] = a->cap * tanhf(scores[t] / a->cap);
}

/* Online softmax over the block for one query row: m' = max(m, max_t s_t); the scores
 * become p_t = exp(s_t - m'); l = l * exp(m - m') + sum_t p_t; returns exp(m - m'), the
 * factor acc must be rescaled by (0 on the first block: m = -inf). */
HOT float block_softmax(float *scores, int64_t t0, int64_t t1, float *m, float *l) {
    float m_new = *m, sum = 0.0f;
    for (int64_t t = t0; t < t1; t++) m_new = scores[t] > m_new ? scores[t] : m_new;
    for (int64_t t = t0; t < t1; t++) scores[t] = exp_nonpositive(scores[t] - m_new);
    for (int64_t t = t0; t < t1; t++) sum += scores[t];
    float alpha = exp_nonpositive(*m - m_new);
    *l = *l * alpha + sum;
    *m = m_new;
    return alpha;
}

/* acc = acc * alpha + sum_t p_t * v_t over positions [t0, t1), CHAINS x LANES columns at a
 * time: their sums stay in registers across the positions, CHAINS independent FMA chains. */
#define CHAINS 4
HOT void block_values(float *acc, float alpha, const float *p, Rows v, int64_t t0, int64_t t1,
                      int64_t dim) {
    int64_t d = 0;
    for (; d + CHAINS * LANES <= dim; d += CHAINS * LANES) {
        v8f sum[CHAINS];
        for (int i = 0; i < CHAINS; i++) sum[i] = load8(acc + d + i * LANES) * alpha;
        for (int64_t t = t0; t < t1; t++)
            for (int i = 0; i < CHAINS; i++)
                sum[i] += load8(v.rows + t * v.stride + d + i * LANES) * p[t];
        memcpy(acc + d, sum, sizeof sum);
    }
    for (; d + LANES <= dim; d += LANES) {  /* one chain: what is left of a D like 80 */
        v8f sum = load8(acc + d) * alpha;
        for (int64_t t = t0; t < t1; t++) sum += load8(v.rows + t * v.stride + d) * p[t];
        memcpy(acc + d, &sum, sizeof sum);
    }
    for (; d < dim; d++) {  /* the tail of a D that is no multiple of LANES */
        float sum = acc[d] * alpha;
        for (int64_t t = t0; t < t1; t++) sum += v.rows[t * v.stride + d] * p[t];
        acc[d] = sum;
    }
}

/* One sequence's GQA group of KV head `head` (query heads head * G .. head * G + G - 1),
 * block by block from the block of the window's first position. */
HOT void attend_group(const Decode *a, int64_t seq, int64_t head, Scratch *w) {
    const Cache *c = &a->cache;
    int64_t group = a->num_q_heads / c->num_kv_heads, bs = c->block_size, dim = c->head_dim;
    int64_t len = a->lens[seq * a->stride_l];
    int64_t first = a->window && len > a->window ? len - a->window : 0;
    const float *q = a->q + seq * a->stride_qs + head * group * a->stride_qh;
    for (int64_t g = 0; g < group; g++) {
        w->m[g] = -INFINITY;
        w->l[g] = 0.0f;
        memset(w->acc + g * dim, 0, (size_t)dim * sizeof(float));
    }
    for (int64_t b = first / bs; b * bs < len; b++) {
        int64_t block = a->tables[seq * a->stride_ts + b * a->stride_tb];
        int64_t t0 = first > b * bs ? first - b * bs : 0;
        int64_t t1 = len - b * bs < bs ? len - b * bs : bs;
        Rows k = block_rows(c, c->k, block, head, t0, t1, w->keys);
        Rows v = block_rows(c, c->v, block, head, t0, t1, w->values);
        for (int64_t g = 0; g < group; g++) {
            float *scores = w->scores + g * (bs + TOKENS);
            block_scores(a, q + g * a->stride_qh, k, t0, t1, scores, w->zero);
            float alpha = block_softmax(scores, t0, t1, w->m + g, w->l + g);
            block_values(w->acc + g * dim, alpha, scores, v, t0, t1, dim);
        }
    }
    float *out = a->out + (seq * a->num_q_heads + head * group) * dim;
    for (int64_t g = 0; g < group; g++)  /* l > 0: the newest position is always seen */
        for (int64_t d = 0; d < dim; d++) out[g * dim + d] = w->acc[g * dim + d] / w->l[g];
}

HOT void decode_all(const Decode *a, Scratch *w) {
    for (int64_t seq = 0; seq < a->num_seqs; seq++)
        for (int64_t head = 0; head < a->cache.num_kv_heads; head++)
            attend_group(a, seq, head, w);
}

AVX2 static void decode_avx2(const Decode *a, Scratch *w) { decode_all(a, w); }
static void decode_portable(const Decode *a, Scratch *w) { decode_all(a, w); }

/* ---- store_kv -------------------------------------------------------------------------- */

typedef struct {
    Cache cache;
    const char *key, *value;   /* [T, H_kv, D] */
    int src_dtype;             /* DT_*: the cache's, or any but fp8 over an fp8 cache */
    int64_t src_elem;
    int64_t num_tokens, stride_kt, stride_kh, stride_vt, stride_vh;
    const int64_t *slots;      /* [T]; -1: padding, writes nothing */
    int64_t stride_slot;
} Store;

/* One row into the cache: a copy, or for an fp8 cache clamp to +-FP8_MAX and round to e4m3. */
HOT void store_row(const Store *a, const char *src, char *dst, float *tmp) {
    const Cache *c = &a->cache;
    if (c->dtype != DT_F8) {
        memcpy(dst, src, (size_t)(c->head_dim * c->elem));
        return;
    }
    const float *x = row_f32(src, a->src_dtype, c->head_dim, tmp);
    for (int64_t d = 0; d < c->head_dim; d++) {
        float v = x[d] < -FP8_MAX ? -FP8_MAX : (x[d] > FP8_MAX ? FP8_MAX : x[d]);
        ((uint8_t *)dst)[d] = f32_fp8(x[d] != x[d] ? x[d] : v);  /* NaN stays NaN */
    }
}

HOT void store_all(const Store *a, float *tmp) {
    const Cache *c = &a->cache;
    for (int64_t t = 0; t < a->num_tokens; t++) {
        int64_t slot = a->slots[t * a->stride_slot];
        if (slot < 0) continue;
        int64_t block = slot / c->block_size, offset = slot % c->block_size;
        for (int64_t h = 0; h < c->num_kv_heads; h++) {
            int64_t kt = t * a->stride_kt + h * a->stride_kh;
            int64_t vt = t * a->stride_vt + h * a->stride_vh;
            store_row(a, a->key + kt * a->src_elem, (char *)cache_row(c, c->k, block, offset, h),
                      tmp);
            store_row(a, a->value + vt * a->src_elem,
                      (char *)cache_row(c, c->v, block, offset, h), tmp);
        }
    }
}

AVX2 static void store_avx2(const Store *a, float *tmp) { store_all(a, tmp); }
static void store_portable(const Store *a, float *tmp) { store_all(a, tmp); }

/* ---- checks (with the GIL, before any loop) -------------------------------------------- */

static int64_t elem_size(int dtype) {
    return dtype == DT_F32 ? 4 : dtype == DT_F8 ? 1 : 2;
}

/* ValueError unless every length is in [1, capacity] and every block a sequence uses (every
 * table entry before blocks_for(seq_len)) is a block of the pool. */
static int check_tables(const Decode *a) {
    const Cache *c = &a->cache;
    int64_t capacity = a->table_width * c->block_size;
    for (int64_t seq = 0; seq < a->num_seqs; seq++) {
        int64_t len = a->lens[seq * a->stride_l];
        if (len < 1 || len > capacity) {
            PyErr_Format(PyExc_ValueError, "seq_lens[%lld] = %lld: must be in [1, %lld] "
                         "(block_tables width x block_size)", (long long)seq, (long long)len,
                         (long long)capacity);
            return -1;
        }
        for (int64_t b = 0; b * c->block_size < len; b++) {
            int64_t block = a->tables[seq * a->stride_ts + b * a->stride_tb];
            if (block < 0 || block >= c->num_blocks) {
                PyErr_Format(PyExc_ValueError, "block_tables[%lld, %lld] = %lld: a block in "
                             "use must be in [0, %lld)", (long long)seq, (long long)b,
                             (long long)block, (long long)c->num_blocks);
                return -1;
            }
        }
    }
    return 0;
}

/* ValueError unless every slot is -1 (padding) or a slot of the pool. */
static int check_slots(const Store *a) {
    int64_t num_slots = a->cache.num_blocks * a->cache.block_size;
    for (int64_t t = 0; t < a->num_tokens; t++) {
        int64_t slot = a->slots[t * a->stride_slot];
        if (slot < -1 || slot >= num_slots) {
            PyErr_Format(PyExc_ValueError, "slot_mapping[%lld] = %lld: must be -1 or in "
                         "[0, %lld)", (long long)t, (long long)slot, (long long)num_slots);
            return -1;
        }
    }
    return 0;
}

/* ---- Python entry points --------------------------------------------------------------- */

static int use_avx2(void) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
           && __builtin_cpu_supports("f16c");
}

/* The cache argument: (k, v, dtype, stride_b, stride_s, stride_h, num_blocks, block_size,
 * num_kv_heads, head_dim), cpu_paged.CacheArgs. */
#define CACHE_FORMAT "(KKiLLLLLLL)"
#define CACHE_FIELDS(c, k, v) &k, &v, &(c).dtype, &(c).stride_b, &(c).stride_s, &(c).stride_h, \
    &(c).num_blocks, &(c).block_size, &(c).num_kv_heads, &(c).head_dim

static void set_cache(Cache *c, unsigned long long k, unsigned long long v) {
    c->k = (const char *)(uintptr_t)k;
    c->v = (const char *)(uintptr_t)v;
    c->elem = elem_size(c->dtype);
}

/* decode(cache, q, out, tables, lens, num_seqs, num_q_heads, table_width, stride_qs,
 *        stride_qh, stride_ts, stride_tb, stride_l, scale, cap, window) */
static PyObject *py_decode(PyObject *self, PyObject *args) {
    (void)self;
    Decode a;
    unsigned long long k, v, q, out, tables, lens;
    double scale, cap;
    if (!PyArg_ParseTuple(args, CACHE_FORMAT "KKKKLLLLLLLLddL:decode", CACHE_FIELDS(a.cache, k, v),
                          &q, &out, &tables, &lens, &a.num_seqs, &a.num_q_heads, &a.table_width,
                          &a.stride_qs, &a.stride_qh, &a.stride_ts, &a.stride_tb, &a.stride_l,
                          &scale, &cap, &a.window))
        return NULL;
    set_cache(&a.cache, k, v);
    a.q = (const float *)(uintptr_t)q;
    a.out = (float *)(uintptr_t)out;
    a.tables = (const int32_t *)(uintptr_t)tables;
    a.lens = (const int32_t *)(uintptr_t)lens;
    a.scale = (float)scale;
    a.cap = (float)cap;
    if (check_tables(&a) < 0) return NULL;
    int64_t group = a.num_q_heads / a.cache.num_kv_heads, dim = a.cache.head_dim;
    int64_t bs = a.cache.block_size, sizes[7] = {group, group, group * dim, group * (bs + TOKENS),
                                                  bs * dim, bs * dim, dim};
    float *buffer = PyMem_RawCalloc((size_t)(sizes[0] + sizes[1] + sizes[2] + sizes[3] + sizes[4]
                                             + sizes[5] + sizes[6]), sizeof(float));
    if (!buffer) return PyErr_NoMemory();
    float *parts[7];
    for (int i = 0, at = 0; i < 7; at += sizes[i], i++) parts[i] = buffer + at;
    Scratch w = {parts[0], parts[1], parts[2], parts[3], parts[4], parts[5], parts[6]};
    Py_BEGIN_ALLOW_THREADS
    if (use_avx2()) decode_avx2(&a, &w);
    else decode_portable(&a, &w);
    Py_END_ALLOW_THREADS
    PyMem_RawFree(buffer);
    Py_RETURN_NONE;
}

/* store_kv(cache, key, value, src_dtype, num_tokens, stride_kt, stride_kh, stride_vt,
 *          stride_vh, slots, stride_slot) */
static PyObject *py_store_kv(PyObject *self, PyObject *args) {
    (void)self;
    Store a;
    unsigned long long k, v, key, value, slots;
    if (!PyArg_ParseTuple(args, CACHE_FORMAT "KKiLLLLLKL:store_kv", CACHE_FIELDS(a.cache, k, v),
                          &key, &value, &a.src_dtype, &a.num_tokens, &a.stride_kt, &a.stride_kh,
                          &a.stride_vt, &a.stride_vh, &slots, &a.stride_slot))
        return NULL;
    set_cache(&a.cache, k, v);
    a.key = (const char *)(uintptr_t)key;
    a.value = (const char *)(uintptr_t)value;
    a.slots = (const int64_t *)(uintptr_t)slots;
    a.src_elem = elem_size(a.src_dtype);
    if (check_slots(&a) < 0) return NULL;
    float *tmp = PyMem_RawMalloc((size_t)a.cache.head_dim * sizeof(float));
    if (!tmp) return PyErr_NoMemory();
    Py_BEGIN_ALLOW_THREADS
    if (use_avx2()) store_avx2(&a, tmp);
    else store_portable(&a, tmp);
    Py_END_ALLOW_THREADS
    PyMem_RawFree(tmp);
    Py_RETURN_NONE;
}

/* vectorized(): whether the loops run their AVX2+FMA copy on this CPU. */
static PyObject *py_vectorized(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyBool_FromLong(use_avx2());
}

static PyMethodDef methods[] = {
    {"decode", py_decode, METH_VARARGS, "Paged decode attention (see cpu_paged.py)."},
    {"store_kv", py_store_kv, METH_VARARGS, "Write K/V rows into their slots (cpu_paged.py)."},
    {"vectorized", py_vectorized, METH_NOARGS, "Whether the AVX2+FMA loops run here."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_cpu_paged",
    .m_doc = "Paged decode attention and store_kv on the CPU (cpu_paged.py wraps them).",
    .m_size = -1, .m_methods = methods};

/* e4m3fn byte -> fp32: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is
 * subnormal (m * 2^-9); 0x7f and 0xff are NaN (no infinities). */
static void fill_fp8_table(void) {
    for (int byte = 0; byte < 256; byte++) {
        int exponent = (byte >> 3) & 15, mantissa = byte & 7;
        float magnitude = exponent == 0 ? ldexpf((float)mantissa, -9)
                                        : ldexpf(1.0f + mantissa / 8.0f, exponent - 7);
        if ((byte & 0x7f) == 0x7f) magnitude = NAN;
        fp8_to_f32[byte] = byte & 0x80 ? -magnitude : magnitude;
    }
}

PyMODINIT_FUNC PyInit__cpu_paged(void) {
    fill_fp8_table();
    return PyModule_Create(&module);
}
