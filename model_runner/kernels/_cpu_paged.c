/* store_kv on the CPU, in place in the pool, and the module _cpu_paged (model_runner/kernels/).
 *
 *     store_kv:  key/value [T, H_kv, D] -> the cache rows of slot_mapping [T] int64 (-1: none)
 *
 * _cpu_paged.h says what the files share; the attention (decode, prefill) is in
 * _cpu_paged_attention.c. Every slot is checked before anything is written.
 */
#include <stdlib.h>

#include "_cpu_paged.h"

/* fp8 e4m3fn: the largest finite value; store_kv saturates to it (paged_checks.FP8_MAX). */
#define FP8_MAX 448.0f

float fp8_to_f32[256];

/* ---- fp8 ------------------------------------------------------------------------------- */

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

/* Whether the loops run their AVX2+FMA copy (set at import, read_kernels_setting). */
static int avx2;

int use_avx2(void) { return avx2; }

/* PAGEDKV_CPU_KERNELS: unset, "" or "auto" runs the AVX2+FMA copy where the CPU has AVX2, FMA
 * and F16C; "portable" runs the portable copy everywhere (the tests run both); anything else is
 * a ValueError naming it, so the import fails rather than ignore it. */
static int read_kernels_setting(void) {
    const char *setting = getenv("PAGEDKV_CPU_KERNELS");
    if (!setting || !*setting || !strcmp(setting, "auto")) {
        avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
               && __builtin_cpu_supports("f16c");
        return 0;
    }
    if (!strcmp(setting, "portable")) {
        avx2 = 0;
        return 0;
    }
    PyErr_Format(PyExc_ValueError, "PAGEDKV_CPU_KERNELS=%s: expected 'auto' or 'portable'",
                 setting);
    return -1;
}

/* vectorized(): whether the loops run their AVX2+FMA copy here. */
static PyObject *py_vectorized(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyBool_FromLong(use_avx2());
}

static PyMethodDef methods[] = {
    {"decode", py_decode, METH_VARARGS, "Paged decode attention (see cpu_paged.py)."},
    {"prefill", py_prefill, METH_VARARGS, "Paged prefill attention (see cpu_paged.py)."},
    {"store_kv", py_store_kv, METH_VARARGS, "Write K/V rows into their slots (cpu_paged.py)."},
    {"vectorized", py_vectorized, METH_NOARGS, "Whether the AVX2+FMA loops run here."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_cpu_paged",
    .m_doc = "Paged attention and store_kv on the CPU (cpu_paged.py wraps them).",
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
    if (read_kernels_setting() < 0) return NULL;
    fill_fp8_table();
    return PyModule_Create(&module);
}
