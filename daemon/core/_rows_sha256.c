/* SHA-256 on the x86 SHA extensions (SHA-NI), for the content keys of the prefix cache.
 *
 * hashlib's sha256(data).digest() costs ~330 ns for a block's key (32 + 128 bytes), of which
 * ~100 ns is the hash: the rest is a new OpenSSL context and two Python objects. Here a key
 * costs the hash and one bytes object, and the compiled loops (_rows_keys.c) call it with no
 * input bytes object at all. Where the CPU lacks the extensions (cpuid, at import) the module
 * says so (`SHA256_NATIVE` False) and `ContentKeys` keeps hashlib: no slower portable copy.
 * The tests compare it with hashlib at every length across the padding's edges.
 */
#include "_rows.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>

/* The 64 round constants (FIPS 180-4, 4.2.2). */
static const uint32_t ROUND_K[64] __attribute__((aligned(16))) = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

/* Whether the CPU has the instructions compress() uses; asked once (cpuid traps to the
 * hypervisor in a VM: microseconds). */
int sha256_native(void) {
    static int native = -1;
    unsigned a, b, c, d;
    if (native < 0)
        native = __get_cpuid(1, &a, &b, &c, &d) && (c & bit_SSSE3) && (c & bit_SSE4_1) &&
                 __get_cpuid_count(7, 0, &a, &b, &c, &d) && (b & bit_SHA);
    return native;
}

/* Hash `blocks` 64-byte blocks into `state` (a..h). The instructions keep the state as two
 * vectors, ABEF and CDGH; each sha256rnds2 does two rounds, so four words take two. */
__attribute__((target("sha,sse4.1,ssse3")))
static void compress(uint32_t state[8], const uint8_t *data, size_t blocks) {
    const __m128i swap = _mm_set_epi64x(0x0c0d0e0f08090a0bLL, 0x0405060700010203LL);
    __m128i dcba = _mm_loadu_si128((const __m128i *)state);
    __m128i hgfe = _mm_loadu_si128((const __m128i *)(state + 4));
    __m128i cdab = _mm_shuffle_epi32(dcba, 0xB1), efgh = _mm_shuffle_epi32(hgfe, 0x1B);
    __m128i abef = _mm_alignr_epi8(cdab, efgh, 8), cdgh = _mm_blend_epi16(efgh, cdab, 0xF0);
    for (; blocks--; data += 64) {
        __m128i abef_in = abef, cdgh_in = cdgh, w[4];
        for (int i = 0; i < 16; i++) {  /* words 4i .. 4i + 3, kept in w[i % 4] */
            __m128i *word = &w[i % 4];
            if (i < 4) {  /* the block's own words, big-endian */
                *word = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(data + 16 * i)), swap);
            } else {  /* W[t] = s1(W[t-2]) + W[t-7] + s0(W[t-15]) + W[t-16] */
                __m128i back7 = _mm_alignr_epi8(w[(i - 1) % 4], w[(i - 2) % 4], 4);
                *word = _mm_sha256msg2_epu32(
                    _mm_add_epi32(_mm_sha256msg1_epu32(*word, w[(i - 3) % 4]), back7),
                    w[(i - 1) % 4]);
            }
            __m128i wk = _mm_add_epi32(*word, _mm_load_si128((const __m128i *)(ROUND_K + 4 * i)));
            cdgh = _mm_sha256rnds2_epu32(cdgh, abef, wk);  /* rounds 4i, 4i + 1 */
            abef = _mm_sha256rnds2_epu32(abef, cdgh, _mm_shuffle_epi32(wk, 0x0E));
        }
        abef = _mm_add_epi32(abef, abef_in);
        cdgh = _mm_add_epi32(cdgh, cdgh_in);
    }
    __m128i feba = _mm_shuffle_epi32(abef, 0x1B), dchg = _mm_shuffle_epi32(cdgh, 0xB1);
    _mm_storeu_si128((__m128i *)state, _mm_blend_epi16(feba, dchg, 0xF0));
    _mm_storeu_si128((__m128i *)(state + 4), _mm_alignr_epi8(dchg, feba, 8));
}
#else
int sha256_native(void) { return 0; }
static void compress(uint32_t state[8], const uint8_t *data, size_t blocks) {
    (void)state, (void)data, (void)blocks;  /* never called: sha256_native() is 0 */
}
#endif

void sha256_init(Sha256 *s) {
    static const uint32_t initial[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                        0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    memcpy(s->state, initial, sizeof initial);
    s->used = 0;
    s->bytes = 0;
}

void sha256_update(Sha256 *s, const void *data, size_t n) {
    const uint8_t *p = data;
    s->bytes += n;
    if (s->used) {  /* top up the pending block first */
        size_t take = n < 64 - s->used ? n : 64 - s->used;
        memcpy(s->pending + s->used, p, take);
        s->used += take, p += take, n -= take;
        if (s->used < 64) return;
        compress(s->state, s->pending, 1);
        s->used = 0;
    }
    compress(s->state, p, n / 64);
    memcpy(s->pending, p + n / 64 * 64, n % 64);
    s->used = n % 64;
}

void sha256_final(Sha256 *s, uint8_t out[32]) {
    uint64_t bits = s->bytes * 8;
    s->pending[s->used++] = 0x80;  /* then zeros, then the length in bits, big-endian */
    if (s->used > 56) {
        memset(s->pending + s->used, 0, 64 - s->used);
        compress(s->state, s->pending, 1);
        s->used = 0;
    }
    memset(s->pending + s->used, 0, 56 - s->used);
    for (int i = 0; i < 8; i++) s->pending[56 + i] = (uint8_t)(bits >> (56 - 8 * i));
    compress(s->state, s->pending, 1);
    for (int i = 0; i < 32; i++) out[i] = (uint8_t)(s->state[i / 4] >> (24 - 8 * (i % 4)));
}

/* sha256(data) -> bytes
 *
 * The SHA-256 digest of a bytes-like `data`; RuntimeError where the CPU lacks the extensions
 * (SHA256_NATIVE). */
PyObject *sha256(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer view;
    uint8_t out[32];
    Sha256 s;
    if (!expect_args("sha256", nargs, 1)) return NULL;
    if (!sha256_native()) {
        PyErr_SetString(PyExc_RuntimeError, "sha256: this CPU has no SHA extensions");
        return NULL;
    }
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) return NULL;
    sha256_init(&s);
    sha256_update(&s, view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    sha256_final(&s, out);
    return PyBytes_FromStringAndSize((const char *)out, 32);
}
