/* Paged attention on the CPU, in place in the pool: decode and prefill are one kernel.
 *
 *     query:             [T, H_q, D] fp32           (the wrapper converts other dtypes)
 *     k/v_cache:         [num_blocks, block_size, H_kv, D]  (_cpu_paged.h)
 *     block_tables:      [S, max_blocks] int32      seq_lens: [S] int32, the chunk included
 *     query_start_loc:   [S + 1] int32: sequence s's chunk is query rows [qsl[s], qsl[s + 1])
 *                        (a decode has none: one query per sequence, T = S)
 *     -> out:            [T, H_q, D] fp32
 *
 * Query row i of sequence s's chunk (q_len rows) sits at position p = seq_len - q_len + i and
 * attends to the positions <= p (the last W of them with a sliding window W); the chunk's own
 * K/V are already in the cache (store_kv). Per (sequence, KV head): the chunk's rows of the
 * G = H_q / H_kv query heads of the GQA group, against the sequence's blocks read through its
 * block table where they lie (no gather), block by block (each block's K/V rows converted to
 * fp32 once for every row), with an online softmax per row in fp32 (flash attention's
 * recurrence):
 *     s_t   = q . k_t * scale            (softcap c > 0: s_t = c * tanh(s_t / c))
 *     m'    = max(m, max_t s_t)          the running max over the positions seen so far
 *     l     = l * exp(m - m') + sum_t exp(s_t - m')
 *     acc   = acc * exp(m - m') + sum_t exp(s_t - m') * v_t
 *     out   = acc / l
 * The loops run without the GIL: the runner's event loop goes on beside the forward thread.
 */
#include "_cpu_paged.h"

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

/* ---- attention ------------------------------------------------------------------------- */

/* Positions scored at once: one lane_sums. */
#define TOKENS 8

typedef struct {
    Cache cache;
    const float *q;          /* [T, H_q, D] fp32 */
    float *out;              /* [T, H_q, D] fp32, contiguous */
    const int32_t *tables;   /* [S, max_blocks] */
    const int32_t *lens;     /* [S] */
    const int32_t *starts;   /* [S + 1] query_start_loc; NULL: a decode (row s is sequence s's) */
    int64_t num_seqs, num_tokens, num_q_heads, table_width;
    int64_t stride_qt, stride_qh, stride_ts, stride_tb, stride_l, stride_starts;
    float scale, cap;        /* cap 0: no softcap */
    int64_t window;          /* 0: none */
} Attend;

/* Scratch of one call, reused by every (sequence, KV head), R = the longest chunk x G rows:
 * R running maxes and sums, R accumulator rows [R, D], one row's scores over a block
 * [B + TOKENS], a block's K and V rows as fp32 [B, D] each (when the cache holds another
 * dtype), and a zero row (past a row's last position, so that TOKENS positions are always
 * scored together). */
typedef struct { float *m, *l, *acc, *scores, *keys, *values, *zero; } Scratch;

/* Rows of a block, fp32: where row t lies (rows + t * stride). */
typedef struct { const float *rows; int64_t stride; } Rows;

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
HOT void block_scores(const Attend *a, const float *q, Rows k, int64_t t0, int64_t t1,
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

/* The lanes of positions [t, t + LANES) before t1: all ones, else zero. */
HOT v8i lanes_before(int64_t t, int64_t t1) {
    const v8i lane = {0, 1, 2, 3, 4, 5, 6, 7};
    return lane < (v8i){0} + (int)(t1 - t);
}

/* a's lanes where mask is all ones, b's elsewhere (pointers: GCC notes every vector parameter
 * of the portable copy, whose ABI would pass it in memory). */
HOT v8f select8(const v8i *mask, const v8f *a, const v8f *b) {
    return (v8f)(((v8i)*a & *mask) | ((v8i)*b & ~*mask));
}

/* Online softmax over the block for one query row: m' = max(m, max_t s_t); the scores
 * become p_t = exp(s_t - m'); l = l * exp(m - m') + sum_t p_t; returns exp(m - m'), the
 * factor acc must be rescaled by (0 on the row's first block: m = -inf). The max and the sum
 * run LANES positions at a time (scores has room for them past t1, block_scores); a NaN score
 * never wins the max, as in a scalar `s > m ? s : m`. */
HOT float block_softmax(float *scores, int64_t t0, int64_t t1, float *m, float *l) {
    v8f maxes = (v8f){0} - INFINITY, sums = {0};
    for (int64_t t = t0; t < t1; t += LANES) {
        v8f s = load8(scores + t);
        v8i wins = lanes_before(t, t1) & (s > maxes);
        maxes = select8(&wins, &s, &maxes);
    }
    float m_new = *m, sum = 0.0f;
    for (int j = 0; j < LANES; j++) m_new = maxes[j] > m_new ? maxes[j] : m_new;
    for (int64_t t = t0; t < t1; t++) scores[t] = exp_nonpositive(scores[t] - m_new);
    for (int64_t t = t0; t < t1; t += LANES) {
        v8f p = load8(scores + t), zero = {0};
        v8i in = lanes_before(t, t1);
        sums += select8(&in, &p, &zero);
    }
    for (int j = 0; j < LANES; j++) sum += sums[j];
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

/* A sequence's chunk: query rows [start, start + len). */
typedef struct { int64_t start, len; } Chunk;

HOT Chunk chunk_of(const Attend *a, int64_t seq) {
    if (!a->starts) return (Chunk){seq, 1};
    int64_t start = a->starts[seq * a->stride_starts];
    return (Chunk){start, a->starts[(seq + 1) * a->stride_starts] - start};
}

/* The first position query row i of a chunk sees (its window's start, else 0). */
HOT int64_t window_start(const Attend *a, int64_t pos) {
    return a->window && pos + 1 > a->window ? pos + 1 - a->window : 0;
}

/* One sequence's chunk against KV head `head` (query heads head * G .. head * G + G - 1),
 * block by block from the block of the first row's window start: in each block, row i scores
 * the positions its window and its own position allow; accumulator row i * G + g. */
HOT void attend_group(const Attend *a, int64_t seq, int64_t head, Scratch *w) {
    const Cache *c = &a->cache;
    int64_t group = a->num_q_heads / c->num_kv_heads, bs = c->block_size, dim = c->head_dim;
    int64_t len = a->lens[seq * a->stride_l];
    Chunk chunk = chunk_of(a, seq);
    int64_t pos0 = len - chunk.len, first = window_start(a, pos0);  /* row 0's position */
    for (int64_t r = 0; r < chunk.len * group; r++) {
        w->m[r] = -INFINITY;
        w->l[r] = 0.0f;
        memset(w->acc + r * dim, 0, (size_t)dim * sizeof(float));
    }
    for (int64_t b = first / bs; b * bs < len; b++) {
        int64_t block = a->tables[seq * a->stride_ts + b * a->stride_tb], base = b * bs;
        int64_t t0 = first > base ? first - base : 0;
        int64_t t1 = len - base < bs ? len - base : bs;
        Rows k = block_rows(c, c->k, block, head, t0, t1, w->keys);
        Rows v = block_rows(c, c->v, block, head, t0, t1, w->values);
        /* rows before the block's first position see none of it; later rows' windows start
         * later, and once one starts past the block so do all that follow */
        for (int64_t i = base > pos0 ? base - pos0 : 0; i < chunk.len; i++) {
            int64_t from = window_start(a, pos0 + i) - base, to = pos0 + i + 1 - base;
            if (from >= bs) break;
            int64_t r0 = from > 0 ? from : 0, r1 = to < t1 ? to : t1;
            for (int64_t g = 0; g < group; g++) {
                int64_t row = i * group + g;
                const float *q = a->q + (chunk.start + i) * a->stride_qt
                                 + (head * group + g) * a->stride_qh;
                block_scores(a, q, k, r0, r1, w->scores, w->zero);
                float alpha = block_softmax(w->scores, r0, r1, w->m + row, w->l + row);
                block_values(w->acc + row * dim, alpha, w->scores, v, r0, r1, dim);
            }
        }
    }
    for (int64_t i = 0; i < chunk.len; i++) {  /* l > 0: every row sees its own position */
        float *out = a->out + ((chunk.start + i) * a->num_q_heads + head * group) * dim;
        for (int64_t g = 0; g < group; g++)
            for (int64_t d = 0; d < dim; d++)
                out[g * dim + d] = w->acc[(i * group + g) * dim + d] / w->l[i * group + g];
    }
}

HOT void attend_all(const Attend *a, Scratch *w) {
    for (int64_t seq = 0; seq < a->num_seqs; seq++)
        for (int64_t head = 0; head < a->cache.num_kv_heads; head++)
            attend_group(a, seq, head, w);
}

AVX2 static void attend_avx2(const Attend *a, Scratch *w) { attend_all(a, w); }
static void attend_portable(const Attend *a, Scratch *w) { attend_all(a, w); }

/* ---- checks (with the GIL, before any loop) -------------------------------------------- */

/* ValueError unless every length is in [1, capacity] and every block a sequence uses (every
 * table entry before blocks_for(seq_len)) is a block of the pool. */
static int check_tables(const Attend *a) {
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

/* The longest chunk, after a ValueError unless query_start_loc runs from 0 to T and every
 * chunk is 1 to seq_len rows long (checked after the lengths); -1 on error. */
static int64_t check_starts(const Attend *a) {
    if (!a->starts) return 1;
    int64_t first = a->starts[0], last = a->starts[a->num_seqs * a->stride_starts], longest = 0;
    if (first != 0 || last != a->num_tokens) {
        PyErr_Format(PyExc_ValueError, "query_start_loc must run from 0 to T=%lld, got %lld to "
                     "%lld", (long long)a->num_tokens, (long long)first, (long long)last);
        return -1;
    }
    for (int64_t seq = 0; seq < a->num_seqs; seq++) {
        int64_t q_len = chunk_of(a, seq).len, len = a->lens[seq * a->stride_l];
        if (q_len < 1 || q_len > len) {
            PyErr_Format(PyExc_ValueError, "query_start_loc[%lld:%lld] gives a chunk of %lld "
                         "rows: must be in [1, seq_lens[%lld] = %lld]", (long long)seq,
                         (long long)seq + 2, (long long)q_len, (long long)seq, (long long)len);
            return -1;
        }
        longest = q_len > longest ? q_len : longest;
    }
    return longest;
}

/* ---- Python entry points --------------------------------------------------------------- */

/* Check every value, then attend without the GIL; NULL with an exception on a bad value. */
static PyObject *run(Attend *a, unsigned long long q, unsigned long long out,
                     unsigned long long tables, unsigned long long lens, double scale,
                     double cap) {
    a->q = (const float *)(uintptr_t)q;
    a->out = (float *)(uintptr_t)out;
    a->tables = (const int32_t *)(uintptr_t)tables;
    a->lens = (const int32_t *)(uintptr_t)lens;
    a->scale = (float)scale;
    a->cap = (float)cap;
    if (check_tables(a) < 0) return NULL;
    int64_t longest = check_starts(a);
    if (longest < 0) return NULL;
    int64_t rows = longest * (a->num_q_heads / a->cache.num_kv_heads), dim = a->cache.head_dim;
    int64_t bs = a->cache.block_size, sizes[7] = {rows, rows, rows * dim, bs + TOKENS, bs * dim,
                                                  bs * dim, dim};
    float *buffer = PyMem_RawCalloc((size_t)(sizes[0] + sizes[1] + sizes[2] + sizes[3] + sizes[4]
                                             + sizes[5] + sizes[6]), sizeof(float));
    if (!buffer) return PyErr_NoMemory();
    float *parts[7];
    for (int i = 0, at = 0; i < 7; at += sizes[i], i++) parts[i] = buffer + at;
    Scratch w = {parts[0], parts[1], parts[2], parts[3], parts[4], parts[5], parts[6]};
    Py_BEGIN_ALLOW_THREADS
    if (use_avx2()) attend_avx2(a, &w);
    else attend_portable(a, &w);
    Py_END_ALLOW_THREADS
    PyMem_RawFree(buffer);
    Py_RETURN_NONE;
}

/* decode(cache, q, out, tables, lens, num_seqs, num_q_heads, table_width, stride_qs,
 *        stride_qh, stride_ts, stride_tb, stride_l, scale, cap, window) */
PyObject *py_decode(PyObject *self, PyObject *args) {
    (void)self;
    Attend a = {.starts = NULL, .stride_starts = 0};
    unsigned long long k, v, q, out, tables, lens;
    double scale, cap;
    if (!PyArg_ParseTuple(args, CACHE_FORMAT "KKKKLLLLLLLLddL:decode", CACHE_FIELDS(a.cache, k, v),
                          &q, &out, &tables, &lens, &a.num_seqs, &a.num_q_heads, &a.table_width,
                          &a.stride_qt, &a.stride_qh, &a.stride_ts, &a.stride_tb, &a.stride_l,
                          &scale, &cap, &a.window))
        return NULL;
    set_cache(&a.cache, k, v);
    a.num_tokens = a.num_seqs;
    return run(&a, q, out, tables, lens, scale, cap);
}

/* prefill(cache, q, out, tables, lens, starts, num_seqs, num_tokens, num_q_heads, table_width,
 *         stride_qt, stride_qh, stride_ts, stride_tb, stride_l, stride_starts, scale, cap,
 *         window) */
PyObject *py_prefill(PyObject *self, PyObject *args) {
    (void)self;
    Attend a;
    unsigned long long k, v, q, out, tables, lens, starts;
    double scale, cap;
    if (!PyArg_ParseTuple(args, CACHE_FORMAT "KKKKKLLLLLLLLLLddL:prefill",
                          CACHE_FIELDS(a.cache, k, v), &q, &out, &tables, &lens, &starts,
                          &a.num_seqs, &a.num_tokens, &a.num_q_heads, &a.table_width,
                          &a.stride_qt, &a.stride_qh, &a.stride_ts, &a.stride_tb, &a.stride_l,
                          &a.stride_starts, &scale, &cap, &a.window))
        return NULL;
    set_cache(&a.cache, k, v);
    a.starts = (const int32_t *)(uintptr_t)starts;
    return run(&a, q, out, tables, lens, scale, cap);
}
