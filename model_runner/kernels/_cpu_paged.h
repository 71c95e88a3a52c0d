/* What the CPU backend's C files share (model_runner/kernels/_cpu_paged*.c): the cache's
 * layout, element conversions to fp32, the 8-lane row type and the checks' conventions.
 *
 *     k/v_cache:  [num_blocks, block_size, H_kv, D]  fp32, fp16, bf16 or fp8 e4m3
 *
 * The files: _cpu_paged.c (store_kv, the module), _cpu_paged_attention.c (decode and prefill
 * attention: one kernel, a decode is a prefill of one query per sequence). The Python wrapper
 * (cpu_paged.py) checks the tensors' dtypes, devices, shapes and strides and passes their
 * addresses (data_ptr), shapes and strides in elements; the values (block ids, slots, lengths,
 * query offsets) are checked in C, all of them before anything is read through them or written.
 *
 * The hot helpers are always inlined into two copies of each loop: one compiled for AVX2+FMA
 * (+F16C), one for any x86-64; use_avx2() picks. Row math uses GCC's vector extension (8 fp32
 * lanes), which each copy lowers to its own instructions. Built with hidden visibility: only
 * PyInit__cpu_paged leaves the shared object.
 */
#ifndef PAGEDKV_CPU_PAGED_H
#define PAGEDKV_CPU_PAGED_H

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
/* Lanes of the row vectors. */
#define LANES 8

typedef float v8f __attribute__((vector_size(LANES * sizeof(float))));
typedef int v8i __attribute__((vector_size(LANES * sizeof(int))));

/* fp8 e4m3fn -> fp32 for each of the 256 bytes, filled at import (_cpu_paged.c). */
extern float fp8_to_f32[256];

/* Whether the loops run their AVX2+FMA copy: the CPU has it and PAGEDKV_CPU_KERNELS did not
 * ask for the portable one (read at import, _cpu_paged.c). */
int use_avx2(void);

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

/* ---- the cache ------------------------------------------------------------------------- */

typedef struct {
    const char *k, *v;       /* the caches' first elements */
    int dtype;               /* DT_*, both caches */
    int64_t elem;            /* bytes per element */
    int64_t stride_b, stride_s, stride_h;  /* elements per block, slot, head (K and V alike) */
    int64_t num_blocks, block_size, num_kv_heads, head_dim;
} Cache;

HOT const char *cache_row(const Cache *c, const char *base, int64_t block, int64_t slot,
                          int64_t head) {
    return base + (block * c->stride_b + slot * c->stride_s + head * c->stride_h) * c->elem;
}

HOT int64_t elem_size(int dtype) {
    return dtype == DT_F32 ? 4 : dtype == DT_F8 ? 1 : 2;
}

/* The cache argument: (k, v, dtype, stride_b, stride_s, stride_h, num_blocks, block_size,
 * num_kv_heads, head_dim), cpu_paged.CacheArgs. */
#define CACHE_FORMAT "(KKiLLLLLLL)"
#define CACHE_FIELDS(c, k, v) &k, &v, &(c).dtype, &(c).stride_b, &(c).stride_s, &(c).stride_h, \
    &(c).num_blocks, &(c).block_size, &(c).num_kv_heads, &(c).head_dim

HOT void set_cache(Cache *c, unsigned long long k, unsigned long long v) {
    c->k = (const char *)(uintptr_t)k;
    c->v = (const char *)(uintptr_t)v;
    c->elem = elem_size(c->dtype);
}

/* ---- entry points of _cpu_paged_attention.c -------------------------------------------- */

PyObject *py_decode(PyObject *self, PyObject *args);
PyObject *py_prefill(PyObject *self, PyObject *args);

#endif
