/* What the CPU's native kernels share (cpu_moe.c: a MoE layer's experts; cpu_linear.c: a
 * dense projection; the others' loads and roundings): weight rows widened in registers and
 * their dot products with float32 activations, a tile of rows by tokens at a time.
 *
 * Weight formats (fmt): 0 bf16, 1 fp16, 3 fp8 e4m3 (the raw bytes; their block scales are
 * the caller's: it scales x, or a row's sums), 4 and 5 int4 (unsigned nibbles, element 2i low
 * and 2i + 1 high, with per-row group scales gs: 4 float32 (scale, -zero * scale) pairs, 5 one
 * bf16 scale a group, zero point 8: a symmetric checkpoint's own scales, a quarter of the
 * bytes), 6 int8 (signed bytes; a row's scale is the caller's, on its sums).
 * VW: float32 lanes of a vector (16 with AVX-512).
 */
#ifndef FT_CPU_DOT_H
#define FT_CPU_DOT_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu_kernels.h"

#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
#define MAXT 4      /* tokens of one expert per pass over a weight row (in registers) */
#define MAXR 4      /* weight rows per call (one tile; below MAXT tokens one after another) */
#define ROWS 128    /* most weight rows per work item: a long sequential stream per item
                     * (16 rows, 32 KB: 15 GB/s cold on 2 threads; 128 rows: 27) */

typedef float vf __attribute__((vector_size(VW * 4)));
typedef uint16_t vu16 __attribute__((vector_size(VW * 2)));
typedef uint32_t vu32 __attribute__((vector_size(VW * 4)));
typedef _Float16 vh __attribute__((vector_size(VW * 2)));
typedef uint8_t vu8 __attribute__((vector_size(VW)));

#define FT_E4M3 3
#define FT_INT4 4
#define FT_INT4S 5
#define FT_INT8 6

static inline int is_int4(int fmt) { return fmt == FT_INT4 || fmt == FT_INT4S; }
/* Whether fmt's weights are one byte each (else 2, or int4's half). */
static inline int byte_fmt(int fmt) { return fmt == FT_E4M3 || fmt == FT_INT8; }

/* Group g's (s, m) of an int4 row's scales (W = q * s + m). */
static inline __attribute__((always_inline)) void int4_sm(const void *gs, int64_t g, int fmt,
                                                          float *s, float *m) {
    if (fmt == FT_INT4) {
        *s = ((const float *)gs)[2 * g];
        *m = ((const float *)gs)[2 * g + 1];
    } else {
        uint32_t u = (uint32_t)((const uint16_t *)gs)[g] << 16;
        memcpy(s, &u, sizeof *s);
        *m = -8.f * *s;
    }
}

/* Row `row`'s scales within an int4 weight's, `groups` a row. */
static inline const void *int4_row_scales(const void *gs, int64_t row, int64_t groups, int fmt) {
    return (const char *)gs + row * groups * (fmt == FT_INT4 ? 8 : 2);
}
/* Each weight row's bytes this far ahead are asked into L2 as a tile reads it (prefetcht2):
 * a thread's one sequential stream otherwise keeps too few lines in flight to reach DRAM
 * speed. A MoE layer's experts, cold (bench/cpu_moe.py's shape, 2-core Xeon): batch 1 bf16
 * 0.68 -> 0.59 ms, fp8 0.57 -> 0.39; 8 tokens 3.6 -> 2.9 and 2.9 -> 2.0. (prefetchnta lost
 * 1.4x; 4 and 8 KB ahead ran alike, 1 KB half the gain.) */
#define PF_BYTES 4096

/* e4m3 rows on AVX2 (FT_F8L): a 32-byte block decoded to bfloat16 words in registers, no
 * conversion instruction, two ways (the old path below, AVX2's form of it: ~8 vector ops a
 * 16 weights, 6 of them converts and shuffles, bound an fp8 layer at half the speed bf16
 * streamed at on the 2-core EPYC).
 *
 * FT_F8L_SHIFT, where the FMAs take float32 denormals at full speed (AMD Zen: an FMA chain on
 * all-denormal weights ran as fast as on normal ones here): each byte's bits moved into a
 * bfloat16's places. In a 16-bit word holding the byte s eeee mmm in its high half, an
 * arithmetic shift right by 4 leaves s on bits 15-11 and eeee mmm on 10-4; & 0x87f0 clears
 * 14-11 and 3-0: the bfloat16 with sign s, exponent field 0000 eeee and mantissa mmm 0000,
 * the byte's value times 2^-120 (the biases are 7 and 127) exactly, its subnormals (e = 0:
 * m 2^-9) as float32 denormals. A word's low byte is moved up first (a shift left by 8).
 * 5 ops give a block's 32 words (9 with the widening to float32), against 14 and a branch
 * through the tables. The products must not be denormal too: x carries E4M3_XUNIT = 2^64
 * (permute_row, the MoE activations) and the sums E4M3_SUM = 2^56 (row_scale), so a product
 * is denormal only where |w x| < 2^-70. The vectors hold, per block, dword i's bytes 4i,
 * 4i + 2, 4i + 1, 4i + 3 (f8l_source). Figures (2-core EPYC, interleaved runs): one MoE
 * layer at one token (bench/cpu_moe.py) 0.32-0.35 -> 0.29-0.31 ms, 2 tokens 0.59-0.61 ->
 * 0.51-0.53, 8 tokens 1.84-1.91 -> 1.65-1.86; the FP8 bench model's decode step (int8 head)
 * at batch 1 7.16-7.28 -> 6.51-6.66 ms, at batch 8 41.1-42.3 -> 37.6-38.9.
 * (Intel's cores take a microcode assist on some denormal operands; not measured here, so
 * they keep the tables. -DFT_F8L_TABLES takes the tables anywhere.)
 *
 * Else through byte tables: for a normal e4m3 byte (value 2^(e - 7) (1 + m/8)) the bfloat16
 * of the same value has exponent e + 120: its high byte (s and the exponent's top 7 bits) is
 * s * 128 + (e >> 1) + 60, a function of the byte's high nibble (s and e's top three bits)
 * alone, and its low byte (the exponent's last bit, 7 mantissa bits) is (e & 1) * 128 + m *
 * 16, a function of the low nibble alone: one vpshufb each. Bytes with e = 0 (zero and the
 * subnormals m 2^-9, three binades) have no such split: a block holding one takes two more
 * tables on its low nibble, blended in. That is rare in a checkpoint (|w| under 2^-6 of a
 * 448 full scale: ~1e-4 of normally distributed weights). An unpack interleaves the two bytes
 * into bfloat16 words: exact values. ~14 ops a 32; one row of 1024, one token, in L2 on one
 * core: 11.1 -> 14.0 G weights/s against the old path. The vectors hold, per block, lane L's
 * bytes 16L + 2d + {0, 1} + {0, 8} (d 0..3).
 *
 * x meets the vectors in their order (paired_index); the words widen to float32 as bf16 rows'
 * do (a shift, a mask). e4m3fn's nan, 0x7f, reads as 480 (checkpoints hold none). */
#if VW == 8 && defined(__AVX2__)
#define FT_F8L 1
#else
#define FT_F8L 0
#endif
#if FT_F8L && !defined(FT_F8L_TABLES) \
    && (defined(__znver1__) || defined(__znver2__) || defined(__znver3__))
#define FT_F8L_SHIFT 1
#else
#define FT_F8L_SHIFT 0
#endif

#if FT_F8L_SHIFT
#define E4M3_XUNIT 0x1p64f     /* x's factor (2^64 * 2^56 = 2^120, the weights' 1/unit) */
#define E4M3_UNIT 1.f          /* scale_row's */
#define E4M3_SUM 0x1p56f       /* the sums' (row_scale) */
/* The bf16 words of a 32-byte block at 2^-120 of their values: *w0 the bytes 4i (even
 * words) and 4i + 2 (odd), *w1 the bytes 4i + 1 and 4i + 3. */
static inline __attribute__((always_inline)) void e4m3_f8l_words(const uint8_t *p, __m256i *w0,
                                                                 __m256i *w1) {
    const __m256i b = _mm256_loadu_si256((const __m256i *)p);
    const __m256i keep = _mm256_set1_epi16((short)0x87f0);
    *w0 = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(b, 8), 4), keep);
    *w1 = _mm256_and_si256(_mm256_srai_epi16(b, 4), keep);
}

#elif FT_F8L
#define E4M3_XUNIT 1.f         /* exact values */
#define E4M3_UNIT 1.f
#define E4M3_SUM 1.f
/* The bf16 words of a 32-byte block: *w0 then *w1, 16 each (unpacked from the two tables'
 * bytes, so a lane's words are its bytes 16L + {0..7} interleaved with 16L + {8..15}). */
static inline __attribute__((always_inline)) void e4m3_f8l_words(const uint8_t *p, __m256i *w0,
                                                                 __m256i *w1) {
    /* high byte by the high nibble, low byte by the low nibble; then, for e = 0, both by
     * the low nibble (0mmm; the sign is the byte's own): each table twice, a lane's */
#define T16(...) __VA_ARGS__, __VA_ARGS__
    static const uint8_t tab[4][32] __attribute__((aligned(32))) = {
        {T16(60, 61, 62, 63, 64, 65, 66, 67, 188, 189, 190, 191, 192, 193, 194, 195)},
        {T16(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240)},
        {T16(0, 0x3b, 0x3b, 0x3b, 0x3c, 0x3c, 0x3c, 0x3c, 0, 0, 0, 0, 0, 0, 0, 0)},
        {T16(0, 0, 0x80, 0xc0, 0, 0x20, 0x40, 0x60, 0, 0, 0, 0, 0, 0, 0, 0)}};
#undef T16
    const __m256i b = _mm256_loadu_si256((const __m256i *)p);
    const __m256i nib = _mm256_set1_epi8(0x0f);
    const __m256i lo = _mm256_and_si256(b, nib);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), nib);
    __m256i H = _mm256_shuffle_epi8(_mm256_load_si256((const __m256i *)tab[0]), hi);
    __m256i L = _mm256_shuffle_epi8(_mm256_load_si256((const __m256i *)tab[1]), lo);
    const __m256i z = _mm256_cmpeq_epi8(_mm256_and_si256(b, _mm256_set1_epi8(0x78)),
                                        _mm256_setzero_si256());
    if (__builtin_expect(_mm256_movemask_epi8(z) != 0, 0)) {     /* (vptest: 0.94x) */
        const __m256i hs = _mm256_or_si256(
            _mm256_shuffle_epi8(_mm256_load_si256((const __m256i *)tab[2]), lo),
            _mm256_and_si256(b, _mm256_set1_epi8((char)0x80)));
        H = _mm256_blendv_epi8(H, hs, z);
        const __m256i ls = _mm256_shuffle_epi8(_mm256_load_si256((const __m256i *)tab[3]), lo);
        L = _mm256_blendv_epi8(L, ls, z);
    }
    *w0 = _mm256_unpacklo_epi8(L, H);
    *w1 = _mm256_unpackhi_epi8(L, H);
}
#endif

/* The byte of a 32-byte block that its vector v's element i holds (e4m3_f8l_words' order),
 * and the place v * 8 + i of the block's byte e. */
#if FT_F8L_SHIFT
static inline int f8l_source(int v, int i) { return 4 * i + ((v & 1) << 1 | v >> 1); }
static inline int f8l_place(int e) { return ((e & 1) << 1 | (e & 3) >> 1) * 8 + e / 4; }
#else                           /* (the tables'; unused where FT_F8L is 0) */
static inline int f8l_source(int v, int i) { return i / 4 * 16 + v / 2 * 8 + i % 4 * 2 + v % 2; }
static inline int f8l_place(int e) {
    return (2 * (e % 16 / 8) + (e & 1)) * 8 + e / 16 * 4 + e % 8 / 2;
}
#endif

/* VW e4m3 bytes widened to float32 in order, at 1/256 of their values, exactly: each byte
 * sign-extended to 16 bits and shifted left by 7 puts its sign on float16's (bit 15, and a
 * copy on bit 14, cleared), its exponent and mantissa on float16's lowest exponent and
 * mantissa bits: value / 2^8 (the biases are 7 and 15; e4m3's subnormals land on float16's),
 * widened by vcvtph2ps. e4m3fn's nan, 0x7f, reads as 480 / 256. */
static inline __attribute__((always_inline)) vf e4m3_f16_places(const uint8_t *p) {
    typedef int8_t vi8 __attribute__((vector_size(VW)));
    typedef int16_t vi16 __attribute__((vector_size(VW * 2)));
    vi8 b;
    memcpy(&b, p, sizeof b);
    const vi16 h = (__builtin_convertvector(b, vi16) << 7) & (int16_t)0xbfff;
    vf f;
#if VW == 16
    const __m512 v = _mm512_cvtph_ps((__m256i)h);
    memcpy(&f, &v, sizeof f);
#elif defined(__F16C__)
    const __m256 v = _mm256_cvtph_ps((__m128i)h);
    memcpy(&f, &v, sizeof f);
#else
    vh hv;
    memcpy(&hv, &h, sizeof hv);
    f = __builtin_convertvector(hv, vf);
#endif
    return f;
}

#if FT_F8L
/* A block's four float32 vectors (words: even then odd of *w0, then of *w1). */
static inline __attribute__((always_inline)) void load_e4m3_f8l(const uint8_t *p, vf f[4]) {
    __m256i w0, w1;
    e4m3_f8l_words(p, &w0, &w1);
    const __m256i odd = _mm256_set1_epi32((int)0xffff0000u);
    const __m256i v[4] = {_mm256_slli_epi32(w0, 16), _mm256_and_si256(w0, odd),
                          _mm256_slli_epi32(w1, 16), _mm256_and_si256(w1, odd)};
    memcpy(f, v, sizeof v);
}

/* A row of k (a multiple of 32) e4m3 bytes as bf16 words, each 32-byte block's as
 * e4m3_f8l_words gives them: a bf16 row in that order meets the same x (paired_index's
 * FT_F8L order) with the same products, as 2 * VW blocks of the bf16 tile (its even words
 * are a block's first vector, its odd ones the second). A row that many tokens pass over is
 * decoded once into these (cpu_moe.c: f8l_decodes) instead of at every pass. */
static inline void e4m3_f8l_row(const uint8_t *src, uint16_t *dst, int64_t k) {
    for (int64_t j = 0; j < k; j += 32) {
        __m256i w0, w1;
        e4m3_f8l_words(src + j, &w0, &w1);
        _mm256_storeu_si256((__m256i *)(dst + j), w0);
        _mm256_storeu_si256((__m256i *)(dst + j + 16), w1);
    }
}
#else
/* Elsewhere (AVX-512; no AVX2), e4m3 weights widened to float32 at 1/E4M3_UNIT of their
 * value, exactly: the byte sign-extended to 16 bits and shifted left by 7 puts its sign on
 * float16's (bit 15, and a copy on bit 14, cleared), its exponent and mantissa on float16's
 * lowest exponent and mantissa bits: value / 2^8 (the biases are 7 and 15; e4m3's
 * subnormals land on float16's), widened by vcvtph2ps. The caller's x carries the 2^8
 * (scale_row), so no multiply here.
 * Two ALU ops per 2 * VW weights: the older form (two shifts, two ands and an or per VW,
 * then a multiply) bound the kernel at ~4 G weights/s a core, under DRAM speed. (Through
 * float32's places instead, a subnormal e4m3 weight is a float32 denormal, and each multiply
 * that meets one takes a microcode assist: a layer ran 5x slower.) e4m3fn's nan, 0x7f,
 * reads as 480 (FT_F8L's too): checkpoints hold none. On AVX2, before FT_F8L: 16 bytes
 * sign-extended at once (vpmovsxbw), a shift, a mask, an extract and two converts. */
#define E4M3_XUNIT 1.f
#define E4M3_UNIT 256.f
#define E4M3_SUM 1.f

/* (FT_F8L's alone: f8l_decodes is 0 here, so nothing calls it) */
static inline void e4m3_f8l_row(const uint8_t *src, uint16_t *dst, int64_t k) {
    (void)src, (void)dst, (void)k;
}

static inline __attribute__((always_inline)) void load_e4m3(const uint8_t *p, vf *lo, vf *hi) {
#if VW == 16 && defined(__AVX512BW__)
    __m512i h = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p));
    h = _mm512_and_si512(_mm512_slli_epi16(h, 7), _mm512_set1_epi16((short)0xbfff));
    __m512 a = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
    __m512 b = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
    memcpy(lo, &a, sizeof *lo);
    memcpy(hi, &b, sizeof *hi);
#elif VW == 16                  /* AVX-512F without BW (Xeon Phi): 16-bit lanes in halves */
    for (int half = 0; half < 2; half++) {
        __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + half * VW)));
        h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16((short)0xbfff));
        __m512 v = _mm512_cvtph_ps(h);
        memcpy(half ? hi : lo, &v, sizeof *lo);
    }
#else
    *lo = e4m3_f16_places(p);
    *hi = e4m3_f16_places(p + VW);
#endif
}
#endif

/* One e4m3 byte as the vector loads give it: FT_F8L_SHIFT's at 2^-120 of its value, else
 * at 1/E4M3_UNIT (load_e4m3's; the tables' exact). */
static inline float scalar_e4m3(uint8_t b) {
#if FT_F8L_SHIFT
    const uint32_t u = ((uint32_t)(b & 0x80u) << 24) | ((uint32_t)(b & 0x7fu) << 20);
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
#else
    uint16_t h = (uint16_t)(((b & 0x80u) << 8) | ((b & 0x7fu) << 7));
    _Float16 v;
    memcpy(&v, &h, sizeof v);
    return (float)v * (256.f / E4M3_UNIT);    /* float16's places hold 1/256 of it */
#endif
}

/* VW int8 weights widened to float32 (a sign-extend and a convert; on AVX2 8 bytes into a
 * ymm: vpmovsxbd from memory, vcvtdq2ps). */
static inline __attribute__((always_inline)) vf load_int8(const int8_t *p) {
    vf f;
#if VW == 16
    __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    memcpy(&f, &v, sizeof f);
#elif defined(__AVX2__)
    __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    memcpy(&f, &v, sizeof f);
#else
    typedef int8_t vi8 __attribute__((vector_size(VW)));
    vi8 b;
    memcpy(&b, p, sizeof b);
    f = __builtin_convertvector(b, vf);
#endif
    return f;
}

/* 2 * VW int4 weights (VW bytes: element 2i in byte i's low nibble, 2i + 1 in its high one)
 * of one group, decoded exactly as the reference does, W = (q - z) * s, as q * s + m with
 * m = -z * s (the pair the caller keeps per group: gs): lo the even elements, hi the odd
 * ones, the paired order of bf16 rows (paired_index). */
static inline __attribute__((always_inline)) void load_int4(const uint8_t *p, float s, float m,
                                                            vf *lo, vf *hi) {
    /* (signed lanes: the nibbles are 0..15, and AVX2 has no unsigned convert, which GCC
     * spells in six ops; nor a byte-to-lane extend from a vector type, which it spells byte
     * by byte through general registers: an INT4 layer ran at 0.6x torch's int4 GEMM) */
    typedef int32_t vi32 __attribute__((vector_size(VW * 4)));
    vi32 v;
#if VW == 16
    __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    memcpy(&v, &w, sizeof v);
#elif defined(__AVX2__)
    __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    memcpy(&v, &w, sizeof v);
#else
    vu8 b;
    memcpy(&b, p, sizeof b);
    v = __builtin_convertvector(b, vi32);
#endif
    *lo = __builtin_convertvector(v & 15, vf) * s + m;
    *hi = __builtin_convertvector(v >> 4, vf) * s + m;
}

static inline float scalar_int4(const uint8_t *row, int64_t j, const void *gs, int gshift,
                               int fmt) {
    uint8_t b = row[j >> 1];
    float s, m;
    int4_sm(gs, j >> gshift, fmt, &s, &m);
    return (float)((j & 1) ? b >> 4 : b & 15) * s + m;
}

/* Row `row` of a weight of rows of k elements in fmt. */
static inline const void *row_at(const void *base, int64_t row, int64_t k, int fmt) {
    return (const char *)base + (is_int4(fmt) ? row * k / 2 : row * k * (byte_fmt(fmt) ? 1 : 2));
}

/* Whether fmt's rows meet x in an order of their own (paired_index). */
static inline int paired_fmt(int fmt) {
    return fmt == 0 || is_int4(fmt) || (FT_F8L && fmt == FT_E4M3);
}

static inline __attribute__((always_inline)) vf load_w(const uint16_t *p, const int fmt) {
    if (fmt == 0) {                        /* bf16: the high half of a float32 */
        vf f;
#if VW == 8 && defined(__AVX2__)
        /* one zero-extend from memory (GCC's vector conversion: two halves and an insert) */
        __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
        memcpy(&f, &w, sizeof f);
#else
        vu16 h;
        memcpy(&h, p, sizeof h);
        vu32 w = __builtin_convertvector(h, vu32) << 16;
        memcpy(&f, &w, sizeof f);
#endif
        return f;
    }
    /* fp16: vcvtph2ps on the whole vector (GCC converts a _Float16 vector one lane at a
     * time without AVX512-FP16: 6x slower). */
    vf f;
#if VW == 16
    __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    memcpy(&f, &v, sizeof f);
#elif defined(__F16C__)
    __m256 v = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    memcpy(&f, &v, sizeof f);
#else
    vh h;
    memcpy(&h, p, sizeof h);
    f = __builtin_convertvector(h, vf);
#endif
    return f;
}

static inline __attribute__((always_inline)) float scalar_w(const uint16_t *p, const int fmt) {
    if (fmt == 0) {
        uint32_t u = (uint32_t)*p << 16;
        float f;
        memcpy(&f, &u, sizeof f);
        return f;
    }
    _Float16 h;
    memcpy(&h, p, sizeof h);
    return (float)h;
}

/* Activations and outputs in fmt 0 bf16, 1 fp16, 2 float32. round_to: f at fmt's precision,
 * nearest even (a nan stays a quiet nan); store_as: a value already at that precision. */
static inline float round_to(float f, int fmt) {
    if (fmt == 2)
        return f;
    if (fmt == 1)
        return (float)(_Float16)f;
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        u |= 0x00400000u;
    else
        u += 0x7fffu + ((u >> 16) & 1u);
    u &= 0xffff0000u;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline void store_as(void *p, int64_t i, float f, int fmt) {
    if (fmt == 2) {
        ((float *)p)[i] = f;
    } else if (fmt == 1) {
        _Float16 h = (_Float16)f;
        memcpy((uint16_t *)p + i, &h, sizeof h);
    } else {
        uint32_t u;
        memcpy(&u, &f, sizeof u);
        ((uint16_t *)p)[i] = (uint16_t)(u >> 16);
    }
}

static inline float load_as(const void *p, int64_t i, int fmt) {
    if (fmt == 2)
        return ((const float *)p)[i];
    return scalar_w((const uint16_t *)p + i, fmt);
}

static inline __attribute__((always_inline)) float hsum(vf v) {
    /* Halves added in registers (a loop over lanes goes through the stack: it cost more
     * than a 1024-long dot product's FMAs). */
#if VW == 16
    typedef float v8 __attribute__((vector_size(32)));
    v8 h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    typedef float v8 __attribute__((vector_size(32)));
    v8 h = v;
#endif
    typedef float v4 __attribute__((vector_size(16)));
    v4 q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
    q += __builtin_shufflevector(q, q, 2, 3, 0, 1);
    q += __builtin_shufflevector(q, q, 1, 0, 3, 2);
    return q[0];
}

/* bf16 rows are read 2 * VW weights at a time as VW 32-bit lanes, each holding weights
 * (2i, 2i + 1): lane << 16 is weight 2i as a float32, lane & 0xffff0000 weight 2i + 1. Two
 * ALU ops widen 2 * VW weights (a zero-extend and shift widen VW, and cost 3 ops on
 * AVX-512: it was the kernel's bound). So the vectors they meet are "paired": per block of
 * 2 * VW elements, the even ones then the odd ones (paired_index); a row's elements past its
 * last whole block stay in order. int4 rows are paired too (a byte's two nibbles), and
 * FT_F8L's e4m3 rows have their own order in blocks of 32 (load_e4m3_f8l's); fp16 rows and,
 * elsewhere, fp8 ones (vcvtph2ps) meet vectors in plain order. */
static inline int64_t paired_index(int64_t j, int64_t k, int fmt) {
    if (FT_F8L && fmt == FT_E4M3) {     /* load_e4m3_f8l's 4 vectors of a 32-byte block */
        int64_t block = j / 32, e = j % 32;
        if ((block + 1) * 32 > k)
            return j;
        return block * 32 + f8l_place((int)e);
    }
    int64_t block = j / (2 * VW), r = j % (2 * VW);
    if (!paired_fmt(fmt) || (block + 1) * 2 * VW > k)
        return j;
    return block * 2 * VW + (r & 1) * VW + r / 2;
}

/* dst = x * its block's scale * E4M3_UNIT, column j's scale srow[j / bk]: an fp8 row
 * block's x (load_e4m3's weights are 1/E4M3_UNIT of theirs; FT_F8L_SHIFT's x carries its
 * unit from permute_row). */
static inline void scale_row(const float *x, float *dst, int64_t k, const float *srow,
                             int64_t bk) {
    if (FT_F8L && bk < k && bk % 32) {  /* a 32-block of x (paired_index) crosses blocks */
        for (int64_t j = 0; j < k; j++) {
            const int64_t at = paired_index(j, k, FT_E4M3);
            dst[at] = x[at] * srow[j / bk] * E4M3_UNIT;
        }
        return;
    }
    for (int64_t c0 = 0; c0 < k; c0 += bk) {         /* a block at a time: no division */
        const float sc = srow[c0 / bk] * E4M3_UNIT;
        const int64_t c1 = c0 + bk < k ? c0 + bk : k;
        for (int64_t j = c0; j < c1; j++)
            dst[j] = x[j] * sc;
    }
}

/* One 2 * VW block of the tile at column j: the NR rows' weights widened once (lo: the
 * block's first VW lanes, hi: the rest), each multiplied into the NT tokens' accumulators
 * lo_acc and hi_acc (the same array where the halves share one chain). */
static inline __attribute__((always_inline)) void
tile_block(const void *const *w, const float *gsc, const float *gm, const float *const *x,
           const int j, const int NR, const int NT, const int fmt, vf (*lo_acc)[MAXT],
           vf (*hi_acc)[MAXT]) {
    vf xl[MAXT], xh[MAXT];
    #pragma GCC unroll 4
    for (int t = 0; t < NT; t++) {
        memcpy(&xl[t], x[t] + j, sizeof(vf));
        memcpy(&xh[t], x[t] + j + VW, sizeof(vf));
        /* Held in registers for the NR rows: GCC would fold each use into an FMA's
         * memory operand, NR loads of it instead of one (loads were the bound: 4 rows
         * by 4 tokens 48 -> 104 GFLOP/s a core; one row is faster folded). */
#if defined(__AVX__)
        if (NR > 1)
            __asm__("" : "+v"(xl[t]), "+v"(xh[t]));
#endif
    }
    #pragma GCC unroll 4
    for (int r = 0; r < NR; r++) {
        vf lo, hi;
        __builtin_prefetch((const char *)w[r] + (is_int4(fmt) ? j / 2 : j * (byte_fmt(fmt) ? 1 : 2)) + PF_BYTES, 0, 1);
        if (fmt == 0) {
            vu32 lanes;
            memcpy(&lanes, (const uint16_t *)w[r] + j, sizeof lanes);
            vu32 a = lanes << 16, b = lanes & 0xffff0000u;
            memcpy(&lo, &a, sizeof lo);
            memcpy(&hi, &b, sizeof hi);
        } else if (fmt == FT_E4M3) {
#if !FT_F8L                             /* (FT_F8L: tile_f8l's) */
            load_e4m3((const uint8_t *)w[r] + j, &lo, &hi);
#endif
        } else if (is_int4(fmt)) {
            load_int4((const uint8_t *)w[r] + j / 2, gsc[r], gm[r], &lo, &hi);
        } else if (fmt == FT_INT8) {
            lo = load_int8((const int8_t *)w[r] + j);
            hi = load_int8((const int8_t *)w[r] + j + VW);
        } else {
            lo = load_w((const uint16_t *)w[r] + j, 1);
            hi = load_w((const uint16_t *)w[r] + j + VW, 1);
        }
        #pragma GCC unroll 4
        for (int t = 0; t < NT; t++) {
            lo_acc[r][t] += lo * xl[t];
            hi_acc[r][t] += hi * xh[t];
        }
    }
}

#if FT_F8L
/* tile_block for e4m3 rows on FT_F8L: a block of 32 weights, each row's four vectors
 * (load_e4m3_f8l) over the `chains` accumulator chains of its tokens. x is read from memory,
 * an FMA operand each: 4 vectors a token held for the rows would outgrow AVX2's 16
 * registers, as 4 rows' accumulators for 4 tokens do beside the decode's (dots splits
 * those tiles in two). */
static inline __attribute__((always_inline)) void
tile_f8l(const void *const *w, const float *const *x, const int j, const int NR, const int NT,
         vf (*acc)[MAXR][MAXT], const int chains) {
    #pragma GCC unroll 4
    for (int r = 0; r < NR; r++) {
        vf f[4];
        __builtin_prefetch((const char *)w[r] + j + PF_BYTES, 0, 1);
        load_e4m3_f8l((const uint8_t *)w[r] + j, f);
        #pragma GCC unroll 4
        for (int t = 0; t < NT; t++)
            #pragma GCC unroll 4
            for (int v = 0; v < 4; v++) {
                vf xv;
                memcpy(&xv, x[t] + j + v * VW, sizeof xv);
                acc[v % chains][r][t] += f[v] * xv;
            }
    }
}
#endif

/* res[r * MAXT + t] = w[r] . x[t] over k, for NR weight rows and NT tokens (x in the row
 * format's order, see paired_index): each weight vector widened once for the NT tokens.
 * Constant NR, NT and fmt: unrolled, in registers. The FMA's latency (4 cycles) wants 8 or
 * more independent accumulator chains: where NR * NT >= 8 the tile's own (the even and odd
 * halves share one: 16 of AVX-512's 32 registers); from 4, two a tile entry (the halves);
 * below, four (two blocks an iteration). (One row by one token on two chains: 4 cycles a
 * block, the batch-1 decode's bound with its weights in cache; on four, ~0.6x that.) */
static inline __attribute__((always_inline)) void
dot_tile(const void *const *w, const void *const *gs, const int gshift, const float *const *x,
         const int k, const int NR, const int NT, const int fmt, float *res) {
    const int C = NR * NT >= 8 ? 1 : 2;    /* chains a block */
    const int U = NR * NT >= 4 ? 1 : 2;    /* blocks an iteration */
    /* FT_F8L's e4m3 tiles: ~8 accumulators, what the registers leave beside its tables */
    const int CH = FT_F8L && fmt == FT_E4M3 ? (NR * NT >= 6 ? 1 : NR * NT >= 3 ? 2 : 4)
                                            : C * U;
    vf acc[4][MAXR][MAXT];                 /* [chain][row][token] */
    #pragma GCC unroll 4
    for (int c = 0; c < CH; c++)
        #pragma GCC unroll 4
        for (int r = 0; r < NR; r++)
            #pragma GCC unroll 4
            for (int t = 0; t < NT; t++)
                acc[c][r][t] = (vf){0};
    /* int4: the rows' group (scale, offset), read as a block starts a group (groups are
     * whole blocks, 2^gshift >= 2 * VW), not at every block: on AVX2 a block is 16 weights
     * of groups of 32-128, and the scalar reads and broadcasts were a fifth of its ops */
    float gsc[MAXR] = {0}, gm[MAXR] = {0};
    const int gmask = is_int4(fmt) ? (1 << gshift) - 1 : 0;
#define GROUP_AT(jj)                                                            \
    if (is_int4(fmt) && !((jj) & gmask))                                        \
        for (int r = 0; r < NR; r++)                                            \
            int4_sm(gs[r], (jj) >> gshift, fmt, &gsc[r], &gm[r]);
    int j = 0;
#if FT_F8L
    if (fmt == FT_E4M3)
        for (; j + 32 <= k; j += 32)
            tile_f8l(w, x, j, NR, NT, acc, CH);
    else
#endif
    if (U == 2)
        for (; j + 4 * VW <= k; j += 4 * VW) {
            GROUP_AT(j)
            tile_block(w, gsc, gm, x, j, NR, NT, fmt, acc[0], acc[C - 1]);
            GROUP_AT(j + 2 * VW)
            tile_block(w, gsc, gm, x, j + 2 * VW, NR, NT, fmt, acc[C], acc[2 * C - 1]);
        }
    for (; !(FT_F8L && fmt == FT_E4M3) && j + 2 * VW <= k; j += 2 * VW) {
        GROUP_AT(j)
        tile_block(w, gsc, gm, x, j, NR, NT, fmt, acc[0], acc[C - 1]);
    }
#undef GROUP_AT
    #pragma GCC unroll 4
    for (int r = 0; r < NR; r++)
        #pragma GCC unroll 4
        for (int t = 0; t < NT; t++) {
            vf sum = acc[0][r][t];
            #pragma GCC unroll 4
            for (int c = 1; c < CH; c++)
                sum += acc[c][r][t];
            float s = hsum(sum);
            for (int q = j; q < k; q++)
                s += (fmt == FT_E4M3 ? scalar_e4m3(((const uint8_t *)w[r])[q])
                      : is_int4(fmt) ? scalar_int4((const uint8_t *)w[r], q, gs[r], gshift, fmt)
                      : fmt == FT_INT8 ? (float)((const int8_t *)w[r])[q]
                                       : scalar_w((const uint16_t *)w[r] + q, fmt)) * x[t][q];
            res[r * MAXT + t] = s;
        }
}

/* The tile for one row (w[0]) and nt (1..MAXT) tokens at run time: one specialised body per
 * count. */
static inline void row_dots(const void *const *w, const void *const *gs, int gshift,
                            const float *const *x, int k, int nt, int fmt, float *res) {
#define CASE(T)                                                                 \
    if (nt == T) {                                                              \
        if (fmt == 0) dot_tile(w, gs, gshift, x, k, 1, T, 0, res);              \
        else if (fmt == 1) dot_tile(w, gs, gshift, x, k, 1, T, 1, res);         \
        else if (fmt == FT_E4M3) dot_tile(w, gs, gshift, x, k, 1, T, FT_E4M3, res); \
        else if (fmt == FT_INT4) dot_tile(w, gs, gshift, x, k, 1, T, FT_INT4, res); \
        else if (fmt == FT_INT8) dot_tile(w, gs, gshift, x, k, 1, T, FT_INT8, res); \
        else dot_tile(w, gs, gshift, x, k, 1, T, FT_INT4S, res);                \
        return;                                                                 \
    }
    CASE(1) CASE(2) CASE(3) CASE(4)
#undef CASE
}

/* The tile for nr (1 or MAXR) rows and nt (1..MAXT) tokens at run time: one specialised
 * body per shape. int4: gs[r] row r's scales (int4_sm's), a group of 2^gshift columns each
 * (NULL for the other formats).
 * cold (the first pass of tokens over these rows, which streams them from memory; later
 * passes, MAXT tokens on, find them in cache): MAXR rows run one after another, a 1-row
 * tile each, so each row is read as one sequential stream. A tile's rows side by side are
 * MAXR streams: 1.1-1.4x faster in L2, they ran slower streamed cold (the bench model's
 * batch-1 steps: bf16 12.7-13.4 -> 15.2-17.6 ms, fp8 11.3-11.7 -> 12.1-12.5; one core's
 * 1-token tiles: 0.6-0.8x for bf16 rows of 128 and 256, 0.85x for fp8 rows of 1024 and
 * 2048; 4 tokens on 2 threads: bf16 rows of 1024 36-38 against 54-59 G weight-tokens/s
 * one after another, fp8 39-47 against 58-61, and the bench models' 4-sequence decode step
 * bf16 27.2-27.9 ms against 25.8-27.6, FP8 21.6-22.0 against 20.1-20.5, prefill the same).
 * The call's own cost (its dispatch, the caller's loop) is shared by MAXR rows: one core,
 * fp8 rows of 256 in L2 10.1 -> 12.5 G weights/s, of 1024 cold 13.2 -> 13.2-14.2.
 * FT_F8L's fp8 rows of 256 or fewer at one token are the exception: its 4-row tile runs
 * them 1.2-1.35x faster, cold too (9.7 -> 13.1; the bench model's down rows), as it runs
 * any fp8 1-token tail of MAXT tokens or more (rows in cache: two 2-row tiles ran
 * 0.84-0.85x). */
static inline void dots(const void *const *w, const void *const *gs, int gshift,
                        const float *const *x, int k, int nr, int nt, int fmt, int cold,
                        float *res) {
    const int short_f8l = FT_F8L && fmt == FT_E4M3 && nt == 1 && k <= 256;
    if (nr == 1 || (cold && !short_f8l)) {
        for (int h = 0; h < nr; h++)
            row_dots(w + h, gs + h, gshift, x, k, nt, fmt, res + h * MAXT);
        return;
    }
#if FT_F8L
    if (fmt == FT_E4M3 && nt > 1) {     /* 2-4 tokens: two tiles of 2 rows (tile_f8l) */
        for (int h = 0; h < MAXR; h += 2) {
            if (nt == 2) dot_tile(w + h, gs, gshift, x, k, 2, 2, FT_E4M3, res + h * MAXT);
            else if (nt == 3) dot_tile(w + h, gs, gshift, x, k, 2, 3, FT_E4M3, res + h * MAXT);
            else dot_tile(w + h, gs, gshift, x, k, 2, 4, FT_E4M3, res + h * MAXT);
        }
        return;
    }
#endif
#define CASE(T)                                                                 \
    if (nt == T) {                                                              \
        if (fmt == 0) dot_tile(w, gs, gshift, x, k, MAXR, T, 0, res);           \
        else if (fmt == 1) dot_tile(w, gs, gshift, x, k, MAXR, T, 1, res);      \
        else if (fmt == FT_E4M3) dot_tile(w, gs, gshift, x, k, MAXR, T, FT_E4M3, res); \
        else if (fmt == FT_INT4) dot_tile(w, gs, gshift, x, k, MAXR, T, FT_INT4, res); \
        else if (fmt == FT_INT8) dot_tile(w, gs, gshift, x, k, MAXR, T, FT_INT8, res); \
        else dot_tile(w, gs, gshift, x, k, MAXR, T, FT_INT4S, res);             \
        return;                                                                 \
    }
    CASE(1) CASE(2) CASE(3) CASE(4)
#undef CASE
}

/* INT4 rows against int16 activations through AVX2's pair products (vpmaddwd), where the
 * CPU has AVX2 and no AVX-512, and groups are whole blocks of I4W_BLOCK. load_int4's
 * widening (an extend, two shifts or masks, two converts, two FMAs to form W and two to meet
 * x: ~9 ops a 16 weights) bound the 2-core EPYC's INT4 decode at ~40% of DRAM speed. Here
 * each group's x is rounded to int16 once per token (i4x_prepare: sx = max |x| / 32767 of
 * the group, xq = round(x / sx)), and a block of 32 weights is one zero-extend of its 16
 * bytes to 16 words (byte i: element 2i in the low nibble, 2i + 1 the high), a mask and a
 * shift, and per token two vpmaddwd and two adds, summed exactly in int32 over the group
 * (a lane sums G / 8 products of at most 15 * 32767: < 2^31 for groups G up to 2^15,
 * i4x_takes' limit); then per group, with W = q s + m and X = sx sum xq the group's sum of
 * the rounded x,
 *     sum_j W_j x_j = s (sx sum_j q_j xq_j) + m X
 * in vector lanes: s (sx u + c) with c = -X in each of the 8 lanes where m = -8 s
 * (FT_INT4S), else s (sx u) + m (X / 8) (u: the int32 lanes converted): two or three FMAs a
 * group, its scales broadcast from memory, no scalar chain. So the sums are W . (sx xq): x's
 * rounding is the only change from the float32 path, and it is taken for 16-bit x only (a
 * float32 model keeps that path's sums): |x - sx xq| <= max |x| / 65534 of its group, a
 * 256th of a bf16 ulp of the group's largest element (llama.cpp's q8 activations round to
 * max |x| / 254 per 32). Tried and not kept (2026-12-08, an AVX2 build run on the Sapphire
 * Rapids, one core, rows in L2): i4v's byte split through vpmaddubsw (x's l and h bytes in
 * blocks of 64, g32's two groups scaled in one vector: 17 ops a 64 weights against 24) ran
 * 1.1-1.2x at one token but 0.87x at four, its 6 multiplies a 64 weights against these 4;
 * Zen 3 unmeasured. */
#if VW == 8 && defined(__AVX2__) && defined(__FMA__)
#define FT_I4W 1
#else
#define FT_I4W 0
#endif
/* AVX-512's form of the same products (i4v, below), where the CPU has AVX512-VNNI */
#if VW == 16 && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define FT_I4V 1
#else
#define FT_I4V 0
#endif
#define I4W_BLOCK 32
#define I4W_ONE 32767.f

#if FT_I4W || FT_I4V
/* x's int16 unit for a group of g elements (g a multiple of 8): 32767 / max |x| (0 for an
 * all-zero group, or one below float32's reach of it, ~1e-34), *amax its max |x|, *finite
 * whether it holds no nan or inf (their c is then a nan). */
static inline float i16_unit(const float *x, int64_t g, float *amax_out, int *finite) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 vmax = _mm256_setzero_ps(), vsum = _mm256_setzero_ps();
    for (int64_t e = 0; e < g; e += 8) {
        const __m256 v = _mm256_loadu_ps(x + e);
        vmax = _mm256_max_ps(_mm256_andnot_ps(sign, v), vmax);   /* (a nan: ignored) */
        vsum = _mm256_add_ps(vsum, v);                          /* (for nan and inf) */
    }
    float lanes[8], amax = 0.f;
    _mm256_storeu_ps(lanes, vmax);
    for (int l = 0; l < 8; l++)
        amax = lanes[l] > amax ? lanes[l] : amax;
    _mm256_storeu_ps(lanes, vsum);
    float sum = 0.f;
    for (int l = 0; l < 8; l++)
        sum += lanes[l];
    *finite = amax <= 3.4e38f && sum == sum;
    float inv = *finite && amax > 0.f ? I4W_ONE / amax : 0.f;
    if (!(inv <= 3.4e38f))
        inv = 0.f;
    *amax_out = amax;
    return inv;
}

/* 32 elements of x at the unit inv -> q [32] (nearest even, within +-32767) */
static inline void i16_block(const float *x, float inv, int32_t *q) {
    const __m256 sign = _mm256_set1_ps(-0.f), top = _mm256_set1_ps(I4W_ONE);
    const __m256 vinv = _mm256_set1_ps(inv);
    for (int v = 0; v < I4W_BLOCK / 8; v++) {
        __m256 f = _mm256_mul_ps(_mm256_loadu_ps(x + 8 * v), vinv);
        f = _mm256_min_ps(_mm256_max_ps(f, _mm256_xor_ps(top, sign)), top);
        _mm256_storeu_si256((__m256i *)(q + 8 * v), _mm256_cvtps_epi32(f));
    }
}
#endif

#if FT_I4W
/* Group gi (columns j0 .. j0 + 2^gshift) of NR int4 rows against NT tokens in i4w's form,
 * added into acc (and, SPLIT, FT_INT4's m X into cor: its own chain). */
static inline __attribute__((always_inline)) void
i4w_group(const void *const *w, const void *const *gs, const int gshift, const int16_t *const *xq,
          const float *const *x2, const int64_t j0, const int NR, const int NT, const int FMT,
          const int SPLIT, __m256 (*acc)[MAXT], __m256 (*cor)[MAXT]) {
    const __m256i low = _mm256_set1_epi16(15);
    const int64_t gi = j0 >> gshift;
    __m256i isum[MAXR][MAXT];
    #pragma GCC unroll 4
    for (int r = 0; r < NR; r++)
        #pragma GCC unroll 4
        for (int t = 0; t < NT; t++)
            isum[r][t] = _mm256_setzero_si256();
    for (int64_t j = j0; j < j0 + ((int64_t)1 << gshift); j += I4W_BLOCK) {
        #pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            const uint8_t *p = (const uint8_t *)w[r] + j / 2;
            __builtin_prefetch(p + PF_BYTES, 0, 1);
            __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
            __m256i lo = _mm256_and_si256(v, low), hi = _mm256_srli_epi16(v, 4);
            #pragma GCC unroll 4
            for (int t = 0; t < NT; t++)
                isum[r][t] = _mm256_add_epi32(
                    isum[r][t],
                    _mm256_add_epi32(
                        _mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)(xq[t] + j))),
                        _mm256_madd_epi16(hi, _mm256_loadu_si256(
                                                  (const __m256i *)(xq[t] + j + I4W_BLOCK / 2)))));
        }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < NR; r++) {
        __m256 sv, mv = _mm256_setzero_ps();
        if (FMT == FT_INT4) {
            sv = _mm256_broadcast_ss((const float *)gs[r] + 2 * gi);
            mv = _mm256_broadcast_ss((const float *)gs[r] + 2 * gi + 1);
        } else {
            /* bf16, the high half of a float32: the word broadcast from memory and each
             * lane's low copy cleared (two ops; a scalar load, move, broadcast and shift
             * took four, and at g32 the kernel ran 0.89x) */
            sv = _mm256_castsi256_ps(_mm256_and_si256(
                _mm256_set1_epi16((short)((const uint16_t *)gs[r])[gi]),
                _mm256_set1_epi32((int)0xffff0000u)));
        }
        #pragma GCC unroll 4
        for (int t = 0; t < NT; t++) {
            const __m256 u = _mm256_cvtepi32_ps(isum[r][t]);
            const __m256 sx = _mm256_broadcast_ss(x2[t] + 2 * gi);
            const __m256 c = _mm256_broadcast_ss(x2[t] + 2 * gi + 1);
            if (FMT == FT_INT4S) {
                acc[r][t] = _mm256_fmadd_ps(_mm256_fmadd_ps(u, sx, c), sv, acc[r][t]);
            } else {
                acc[r][t] = _mm256_fmadd_ps(_mm256_mul_ps(u, sx), sv, acc[r][t]);
                if (SPLIT)
                    cor[r][t] = _mm256_fmadd_ps(c, mv, cor[r][t]);
                else
                    acc[r][t] = _mm256_fmadd_ps(c, mv, acc[r][t]);
            }
        }
    }
}

/* res[r * MAXT + t] = w[r] . x[t] for NR int4 rows in FMT (gs[r]: their scales) and NT
 * tokens in i4w's form (xq[t], x2[t]), groups of 2^gshift >= I4W_BLOCK. Below 4 rows by
 * tokens, two groups an iteration on two float chains (and FT_INT4's offsets on two more): a
 * g32 group is ~12 ops, under the FMAs' latency. */
static inline __attribute__((always_inline)) void
i4w_tile(const void *const *w, const void *const *gs, const int gshift, const int16_t *const *xq,
         const float *const *x2, const int64_t k, const int NR, const int NT, const int FMT,
         float *res) {
    const int64_t g = (int64_t)1 << gshift;
    const int C = NR * NT >= 4 ? 1 : 2;           /* groups an iteration, float chains */
    __m256 acc[2][MAXR][MAXT], cor[2][MAXR][MAXT];
    #pragma GCC unroll 4
    for (int r = 0; r < NR; r++)
        #pragma GCC unroll 4
        for (int t = 0; t < NT; t++)
            acc[0][r][t] = acc[1][r][t] = cor[0][r][t] = cor[1][r][t] = _mm256_setzero_ps();
    int64_t j0 = 0;
    if (C == 2)
        for (; j0 + 2 * g <= k; j0 += 2 * g) {
            i4w_group(w, gs, gshift, xq, x2, j0, NR, NT, FMT, 1, acc[0], cor[0]);
            i4w_group(w, gs, gshift, xq, x2, j0 + g, NR, NT, FMT, 1, acc[1], cor[1]);
        }
    for (; j0 < k; j0 += g)
        i4w_group(w, gs, gshift, xq, x2, j0, NR, NT, FMT, C == 2, acc[0], cor[0]);
    #pragma GCC unroll 4
    for (int r = 0; r < NR; r++)
        #pragma GCC unroll 4
        for (int t = 0; t < NT; t++) {
            vf sum;
            __m256 a = C == 2 ? _mm256_add_ps(_mm256_add_ps(acc[0][r][t], acc[1][r][t]),
                                              _mm256_add_ps(cor[0][r][t], cor[1][r][t]))
                              : acc[0][r][t];
            memcpy(&sum, &a, sizeof sum);
            res[r * MAXT + t] = hsum(sum);
        }
}
#endif

/* INT4 rows against int16 activations through AVX512-VNNI's byte products (vpdpbusd), where
 * the CPU has them: i4w's rounding of x (the same xq, sx and sums W . (sx xq)), a block of 128
 * weights a vector. AVX512-BF16's pair products on x as bf16 (each nibble unpacked beside 0x43
 * as the word 128 + q: four unpacks and four vdpbf16ps a 128) ran 1024-long g32 rows in L2
 * at 22.6 G weights/s a core on the 2-core Sapphire Rapids, this form at 38 (4-row tiles).
 * Each xq splits into a signed high byte and an unsigned low one, xq = 256 h + l, and a
 * block's 64 bytes of nibbles are its even elements (the low nibbles, masked) and its odd
 * ones (shifted, masked): vpdpbusd takes an unsigned operand and a signed one, so
 * l (unsigned) meets q (as signed: 0..15) and q (unsigned) meets h (signed), and each int32
 * lane j sums the 8 elements 8j .. 8j + 7 of the block: L = sum q l, H = sum q h, exactly
 * (|H| <= 8 * 15 * 128), and u = 256 H + L = sum q xq, as i4w's int32 sums. Per block, in
 * lanes: s (sx u + c), and FT_INT4's m c apart, with each lane's group's s (and m), sx and c
 * (a group's G / 8 lanes over its blocks carry c = -8 X / (G / 8) for FT_INT4S, X / (G / 8)
 * for FT_INT4: summed, its m X). x in bytes (i4x_prepare), per block of n elements (128, or
 * a row's last 32, 64 or 96): l of the evens, l of the odds, h of the evens, h of the odds,
 * n / 2 bytes each.
 * Not faster (measured one core, rows in L2 and from DRAM, 2026-12-08): AMX-INT8 with 16
 * rows' nibbles as A tiles (masked and shifted into a 2 KB buffer, 32 64-byte stores a 16 x
 * 128 tile) and x's balanced bytes as B (a group's columns apart; C stored, its columns
 * gathered, each group scaled): g32 12.9 GB/s of nibbles against this form's 19.9, g128 14.2
 * against 19.1. The stores alone ran at 37, the per-chunk C readout and scale transposes
 * halved that, and the tile loads behind the stores cost the rest. This form is issue-bound
 * (~13 vector ops a 128 weights a row, 2 ports for 512-bit ops); cold it streams at ~9 GB/s a
 * core against a plain read's 13: compute and DRAM only partly overlap, as for FP8. */
#define I4V_BLOCK 128

#if FT_I4V
/* Each lane's group within a block of 128 (lane j holds elements 8j .. 8j + 7). */
static inline __m512i i4v_lane_groups(int g) {
    return g == 32 ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)
         : g == 64 ? _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1)
                   : _mm512_setzero_si512();
}

/* A block's group scales of an int4 row in fmt (`groups` of them, from group g0) in each
 * lane: s its group's s, and for FT_INT4 m its m. */
static inline __attribute__((always_inline)) void
i4v_scales(const void *gs, int64_t g0, int groups, int gshift, int fmt, __m512 *s, __m512 *m) {
    const __m512i lane = i4v_lane_groups(1 << gshift);
    if (fmt == FT_INT4) {               /* (s, m) float pairs */
        const __m512 sm = _mm512_maskz_loadu_ps((__mmask16)((1u << (2 * groups)) - 1),
                                                (const float *)gs + 2 * g0);
        const __m512i pair = _mm512_add_epi32(lane, lane);
        *s = _mm512_permutexvar_ps(pair, sm);
        *m = _mm512_permutexvar_ps(_mm512_add_epi32(pair, _mm512_set1_epi32(1)), sm);
    } else {
        /* each lane's bf16 moved into its high half, the low half cleared: one permute */
        __m128i h = _mm_maskz_loadu_epi16((__mmask8)((1u << groups) - 1),
                                          (const uint16_t *)gs + g0);
        *s = _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(
            (__mmask32)0xaaaaaaaau, _mm512_slli_epi32(lane, 16), _mm512_zextsi128_si512(h)));
        *m = _mm512_setzero_ps();
    }
}

/* A block's odd elements: each byte's high nibble, in one GFNI affine op (a bit matrix that
 * moves bits 4-7 to 0-3) where the CPU has it, else a shift and a mask. With the sums' one
 * chain (i4v_tile) ~13 vector ops a row's block of 128 instead of ~16: a core's g32 rows in
 * L2 17.2-17.7 -> 19.2-19.6 GB/s of nibbles, from DRAM 8.7-9.1 -> 8.8-9.4 (2026-12-08). */
static inline __attribute__((always_inline)) __m512i i4v_high_nibbles(__m512i v) {
#if defined(__GFNI__)
    return _mm512_gf2p8affine_epi64_epi8(v, _mm512_set1_epi64(0x1020408000000000ll), 0);
#else
    return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0f));
#endif
}

/* res[r * MAXT + t] = w[r] . x[t] for NR int4 rows in FMT (gs[r]: their scales) and NT
 * tokens in i4v's form (xb[t], x2[t]), k a multiple of 32, groups of 2^gshift >= 32. */
static inline __attribute__((always_inline)) void
i4v_tile(const void *const *w, const void *const *gs, const int gshift, const uint8_t *const *xb,
         const float *const *x2, const int64_t k, const int NR, const int NT, const int FMT,
         float *res) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    const int g = 1 << gshift;
    /* each lane's (sx, c) in x2's pairs: floats 2 group and 2 group + 1 */
    const __m512i lane = _mm512_add_epi32(i4v_lane_groups(g), i4v_lane_groups(g));
    const __m512i lane_c = _mm512_add_epi32(lane, _mm512_set1_epi32(1));
    __m512 acc[MAXR][MAXT], cor[MAXR][MAXT];
    #pragma GCC unroll 4
    for (int r = 0; r < NR; r++)
        #pragma GCC unroll 4
        for (int t = 0; t < NT; t++)
            acc[r][t] = cor[r][t] = _mm512_setzero_ps();
    for (int64_t j = 0; j < k; j += I4V_BLOCK) {
        const int64_t n = k - j < I4V_BLOCK ? k - j : I4V_BLOCK, half = n / 2;
        const __mmask64 bytes = n == I4V_BLOCK ? ~(__mmask64)0 : ((__mmask64)1 << half) - 1;
        const __mmask16 lanes = (__mmask16)((1u << (n / 8)) - 1);
        const int groups = g >= I4V_BLOCK ? 1 : (int)(n >> gshift);
        __m512 sx[MAXT], c[MAXT];
        #pragma GCC unroll 4
        for (int t = 0; t < NT; t++) {
            const float *p2 = x2[t] + 2 * (j >> gshift);
            if (g >= I4V_BLOCK) {
                sx[t] = _mm512_set1_ps(p2[0]);
                c[t] = _mm512_set1_ps(p2[1]);
            } else {
                const __mmask16 floats = (__mmask16)((1u << (2 * groups)) - 1);
                const __m512 pair = _mm512_maskz_loadu_ps(floats, p2);
                sx[t] = _mm512_permutexvar_ps(lane, pair);
                c[t] = _mm512_maskz_permutexvar_ps(lanes, lane_c, pair);
            }
        }
        #pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            const uint8_t *p = (const uint8_t *)w[r] + j / 2;
            __builtin_prefetch(p + PF_BYTES, 0, 1);
            const __m512i v = _mm512_maskz_loadu_epi8(bytes, p);
            const __m512i lo = _mm512_and_si512(v, low);
            const __m512i hi = i4v_high_nibbles(v);
            __m512 s, m;
            i4v_scales(gs[r], j >> gshift, groups, gshift, FMT, &s, &m);
            #pragma GCC unroll 4
            for (int t = 0; t < NT; t++) {
                const uint8_t *xp = xb[t] + 2 * j;
                const __m512i le = _mm512_maskz_loadu_epi8(bytes, xp);
                const __m512i lo_ = _mm512_maskz_loadu_epi8(bytes, xp + half);
                const __m512i he = _mm512_maskz_loadu_epi8(bytes, xp + 2 * half);
                const __m512i ho = _mm512_maskz_loadu_epi8(bytes, xp + 3 * half);
                /* H first, then L summed onto 256 H: one chain, no second zero or add */
                __m512i u32 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, he);
                u32 = _mm512_slli_epi32(_mm512_dpbusd_epi32(u32, hi, ho), 8);
                u32 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(u32, le, lo), lo_, hi);
                const __m512 u = _mm512_cvtepi32_ps(u32);
                if (FMT == FT_INT4S) {
                    acc[r][t] = _mm512_fmadd_ps(_mm512_fmadd_ps(u, sx[t], c[t]), s, acc[r][t]);
                } else {
                    acc[r][t] = _mm512_fmadd_ps(_mm512_mul_ps(u, sx[t]), s, acc[r][t]);
                    cor[r][t] = _mm512_fmadd_ps(c[t], m, cor[r][t]);
                }
            }
        }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < NR; r++)
        #pragma GCC unroll 4
        for (int t = 0; t < NT; t++)
            res[r * MAXT + t] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][t], cor[r][t]));
}
#endif

/* int4 rows against x in a prepared form (int16 per group: i4v's bytes with AVX512-VNNI, else
 * i4w's words with AVX2), where i4x_takes: 16-bit x, K whole blocks of 32, groups of 2^gshift
 * (32 to 2^15). */
static inline int i4x_takes(int64_t k, int gshift, int xfmt) {
    return (FT_I4V || FT_I4W) && xfmt != 2 && (1 << gshift) >= I4W_BLOCK && gshift <= 15
           && k % I4W_BLOCK == 0;
}

/* One row of x (float32, k elements, a multiple of 32) in the prepared form: xb (k 16-bit
 * words' room) and x2 [2 * k / G], per group (sx, c): xq's unit and the offset's lanes, from
 * X = sx sum xq (exact in int32), c = -8 X / lanes for FT_INT4S's m = -8 s, else X / lanes,
 * where a group's sums sit in `lanes` vector lanes (i4w: its 8; i4v: G / 8 over its
 * blocks). xq in the form's order: i4w's words, per block of 32 the even elements, then the
 * odd ones (they meet the low nibbles' words, then the high ones'); i4v's bytes (above). A
 * group whose largest |x| is below float32's reach of 32767 / |x| (~1e-34) rounds to zeros.
 * A nan or inf in x gives a nan c, so the row's sums are nan. */
static inline void i4x_prepare(const float *x, int64_t k, int gshift, int fmt, uint16_t *xb,
                               float *x2) {
#if FT_I4V || FT_I4W
    const int64_t g = (int64_t)1 << gshift;
    const float lanes = FT_I4V ? (float)(g / 8) : 8.f;
    for (int64_t g0 = 0; g0 < k; g0 += g) {
        float amax;
        int finite;
        const float inv = i16_unit(x + g0, g, &amax, &finite);
        int32_t qsum = 0;
        for (int64_t b = g0; b < g0 + g; b += I4W_BLOCK) {
            int32_t q[I4W_BLOCK];
            i16_block(x + b, inv, q);
#if FT_I4V
            const int64_t j = b - b % I4V_BLOCK, in = b - j;                /* its block */
            const int64_t half = (k - j < I4V_BLOCK ? k - j : I4V_BLOCK) / 2;
            uint8_t *o = (uint8_t *)xb + 2 * j + in / 2;
#endif
            for (int i = 0; i < I4W_BLOCK / 2; i++) {
                const int32_t e = q[2 * i], d = q[2 * i + 1];
#if FT_I4V
                o[i] = (uint8_t)(e & 255);
                o[half + i] = (uint8_t)(d & 255);
                o[2 * half + i] = (uint8_t)(int8_t)(e >> 8);
                o[3 * half + i] = (uint8_t)(int8_t)(d >> 8);
#else
                ((int16_t *)xb)[b + i] = (int16_t)e;
                ((int16_t *)xb)[b + I4W_BLOCK / 2 + i] = (int16_t)d;
#endif
                qsum += e + d;
            }
        }
        const float sx = amax / I4W_ONE, xs = sx * (float)qsum;
        const float c = fmt == FT_INT4S ? -8.f * xs / lanes : xs / lanes;
        x2[2 * (g0 >> gshift)] = sx;
        x2[2 * (g0 >> gshift) + 1] = finite ? c : NAN;
    }
#else
    (void)x, (void)k, (void)gshift, (void)fmt, (void)xb, (void)x2;
#endif
}

/* The prepared tile for nr (1 or MAXR) rows and nt (1..MAXT) tokens at run time (dots'
 * shapes). */
static inline void i4x_dots(const void *const *w, const void *const *gs, int gshift,
                            const uint16_t *const *xb, const float *const *x2, int64_t k, int nr,
                            int nt, int fmt, float *res) {
#if FT_I4V || FT_I4W
    /* The common group sizes at compile time (i4w: a group's blocks unrolled, no loop). One
     * token: 4 rows at a time (x read once for them, one call and one loop for 4 rows, i4w:
     * a g32 row in L2, best of 6 runs, K 256 15.0 -> 21.8 G weights/s a core, K 1024 20.9 ->
     * 27.6); more tokens: one row at a time (the products are the cost wherever tokens share
     * a row's nibbles, and 4 rows' int32 and float32 sums outgrow the registers: i4w's 2
     * tokens on 4 rows ran 0.76x at K 1024). */
#if FT_I4V
#define I4X_TILE i4v_tile
    typedef uint8_t word;                   /* x's prepared form: i4v's bytes, i4w's words */
#else
#define I4X_TILE i4w_tile
    typedef int16_t word;
#endif
#define TILE(R, T, F)                                                                       \
    if (T == 1 && R == MAXR) do {                                                           \
        const word *const *xq = (const word *const *)xb;                                    \
        if (gshift == 5) I4X_TILE(w, gs, 5, xq, x2, k, R, 1, F, res);                      \
        else if (gshift == 7) I4X_TILE(w, gs, 7, xq, x2, k, R, 1, F, res);                 \
        else I4X_TILE(w, gs, gshift, xq, x2, k, R, 1, F, res);                              \
    } while (0); else                                                                       \
    for (int r = 0; r < R; r++) do {                                                        \
        const word *const *xq = (const word *const *)xb;                                    \
        const void *const *wr = w + r, *const *gr = gs + r;                                 \
        float *out = res + r * MAXT;                                                        \
        if (gshift == 5) I4X_TILE(wr, gr, 5, xq, x2, k, 1, T, F, out);                     \
        else if (gshift == 7) I4X_TILE(wr, gr, 7, xq, x2, k, 1, T, F, out);                \
        else I4X_TILE(wr, gr, gshift, xq, x2, k, 1, T, F, out);                             \
    } while (0)
#endif
#if FT_I4V || FT_I4W
#define CASE(R, T)                                                                  \
    if (nr == R && nt == T) {                                                       \
        if (fmt == FT_INT4) TILE(R, T, FT_INT4);                                    \
        else TILE(R, T, FT_INT4S);                                                  \
        return;                                                                     \
    }
    CASE(1, 1) CASE(1, 2) CASE(1, 3) CASE(1, 4)
    CASE(4, 1) CASE(4, 2) CASE(4, 3) CASE(4, 4)
#undef CASE
#undef TILE
#undef I4X_TILE
#else
    (void)w, (void)gs, (void)gshift, (void)xb, (void)x2, (void)k, (void)nr, (void)nt, (void)fmt,
        (void)res;
#endif
}

/* e4m3 rows against float16 activations through AVX512-FP16's products (FT_F8H: Sapphire
 * Rapids on). Elsewhere on AVX-512 a block of 32 bytes is a sign-extend, a shift, a mask,
 * two float32 conversions (two ops each) and two FMAs a token: the decode, not DRAM, bound
 * a batch-1 MoE layer. Here the same three ops put the 32 bytes on float16's places (value
 * / 2^8, load_e4m3's) and one vfmadd231ph a token meets them with x in float16. One core of
 * a 2-core Sapphire Rapids, rows in L2, G weights/s: rows of 1024 one at a time 18.3 ->
 * 32.5-35.4, in 4-row tiles 19.2 -> 41; rows of 256 16.3 -> 26, 17.1 -> 29.4. The bench
 * FP8 model (bench/cpu.py --quant fp8, two interleaved pairs): batch 1 107-109 -> 120 tok/s,
 * 8 195-198 -> 209, 16 271-287 -> 310-314; its MoE and attention products now stream their
 * bytes at 23-27 GB/s, as bf16's do (a plain read with 4 KB prefetches: 29).
 * x is rounded once per row block (f8h_prepare): x sigma to float16 with sigma a power of
 * two that puts max |x| in [1024, 2048); a lane sums at most 16 products (F8H_SPAN weights
 * of a row) in float16, at most 16 * 1.875 * 2048 = 61440 (float16's largest: 65504; 1.875
 * is e4m3fn's nan code's 480 / 256), before they are widened and summed in float32. So each
 * x is rounded to 11 bits (float16's: 2^-11 relative at most, 8x finer than bf16's;
 * llama.cpp's q8_0 rounds them to max |x| / 254 per 32) and each product-add to 11 bits;
 * the rows' own e4m3 rounding is 2^-4. Tried and not kept (2026-12-08): 64 bytes read as 32
 * words, the odd bytes by an arithmetic shift and a mask, the even ones a byte shuffle
 * first (5 ops a 64 weights against 6, x's blocks of 64 stored evens then odds): rows in L2
 * ~1.07x, the FP8 bench model's batch-1 program unchanged (four interleaved pairs). */
#if VW == 16 && defined(__AVX512FP16__) && defined(__AVX512BW__)
#define FT_F8H 1
#else
#define FT_F8H 0
#endif
#define F8H_SPAN 512

/* One row of x (k float32: the block's scales applied) as float16 at sigma times its value
 * into dst [k]; returns 1 / sigma. An all-zero row, or one with an inf (or a nan as its
 * largest), takes sigma 2^11: its sums are then what float arithmetic makes of those. */
static inline float f8h_prepare(const float *x, int64_t k, _Float16 *dst) {
#if FT_F8H
    __m512 vmax = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= k; j += 16)
        vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(x + j)));
    float amax = _mm512_reduce_max_ps(vmax);
    for (; j < k; j++)
        amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
    int e = 0;                                  /* amax < 2^e */
    if (amax > 0.f && isfinite(amax))
        frexpf(amax, &e);
    e = e < -100 ? -100 : e;                    /* (sigma within float32's reach) */
    const float sigma = ldexpf(1.f, 11 - e);
    const __m512 s = _mm512_set1_ps(sigma);
    for (j = 0; j + 16 <= k; j += 16)
        _mm256_storeu_si256((__m256i *)(dst + j),
                            _mm512_cvtps_ph(_mm512_mul_ps(_mm512_loadu_ps(x + j), s),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    for (; j < k; j++)
        dst[j] = (_Float16)(x[j] * sigma);
    return ldexpf(1.f, e - 11);
#else
    (void)x, (void)k, (void)dst;
    return 1.f;
#endif
}

#if FT_F8H
/* 32 e4m3 bytes (the first n of them: the rest zeros) on float16's places */
static inline __attribute__((always_inline)) __m512h f8h_weights(const uint8_t *p, int n) {
    const __m256i b = n == 32 ? _mm256_loadu_si256((const __m256i *)p)
                              : _mm256_maskz_loadu_epi8((__mmask32)((1u << n) - 1), p);
    const __m512i h = _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(b), 7),
                                       _mm512_set1_epi16((short)0xbfff));
    return _mm512_castsi512_ph(h);
}

static inline __attribute__((always_inline)) __m512h f8h_x(const _Float16 *p, int n) {
    return n == 32 ? _mm512_loadu_ph(p)
                   : _mm512_castsi512_ph(_mm512_maskz_loadu_epi16((__mmask32)((1u << n) - 1), p));
}

/* res[r * MAXT + t] = w[r] . xh[t k ..] over k (each sum at sigma times its value) for NR
 * rows and NT tokens: each weight vector decoded once for the NT tokens, into NR * NT
 * float16 chains (CH a pair where that is under 4: the FMA's latency), widened into float32
 * every F8H_SPAN weights. */
static inline __attribute__((always_inline)) void
f8h_tile(const void *const *w, const _Float16 *xh, const int64_t k, const int NR, const int NT,
         float *res) {
    const int CH = NR * NT >= 4 ? 1 : NR * NT >= 2 ? 2 : 4;
    __m512 sum[MAXR][MAXT];
    #pragma GCC unroll 4
    for (int r = 0; r < NR; r++)
        #pragma GCC unroll 4
        for (int t = 0; t < NT; t++)
            sum[r][t] = _mm512_setzero_ps();
    for (int64_t j0 = 0; j0 < k; j0 += F8H_SPAN) {
        const int64_t j1 = j0 + F8H_SPAN < k ? j0 + F8H_SPAN : k;
        __m512h acc[4][MAXR][MAXT];
        #pragma GCC unroll 4
        for (int c = 0; c < CH; c++)
            #pragma GCC unroll 4
            for (int r = 0; r < NR; r++)
                #pragma GCC unroll 4
                for (int t = 0; t < NT; t++)
                    acc[c][r][t] = _mm512_setzero_ph();
#define F8H_STEP(J, C, N)                                                               \
        do {                                                                            \
            __m512h xv[MAXT];                                                           \
            _Pragma("GCC unroll 4")                                                     \
            for (int t = 0; t < NT; t++)                                                \
                xv[t] = f8h_x(xh + t * k + (J), (N));                                   \
            _Pragma("GCC unroll 4")                                                     \
            for (int r = 0; r < NR; r++) {                                              \
                if (!((J) & 63))                                                        \
                    __builtin_prefetch((const char *)w[r] + (J) + PF_BYTES, 0, 1);      \
                const __m512h wv = f8h_weights((const uint8_t *)w[r] + (J), (N));       \
                _Pragma("GCC unroll 4")                                                 \
                for (int t = 0; t < NT; t++)                                            \
                    acc[C][r][t] = _mm512_fmadd_ph(wv, xv[t], acc[C][r][t]);            \
            }                                                                           \
        } while (0)
        int64_t j = j0;
        for (; j + 32 * CH <= j1; j += 32 * CH)
            #pragma GCC unroll 4
            for (int c = 0; c < CH; c++)
                F8H_STEP(j + 32 * c, c, 32);
        for (; j + 32 <= j1; j += 32)
            F8H_STEP(j, 0, 32);
        if (j < j1)
            F8H_STEP(j, 0, (int)(j1 - j));
#undef F8H_STEP
        #pragma GCC unroll 4
        for (int r = 0; r < NR; r++)
            #pragma GCC unroll 4
            for (int t = 0; t < NT; t++) {
                __m512h a = acc[0][r][t];
                #pragma GCC unroll 4
                for (int c = 1; c < CH; c++)
                    a = _mm512_add_ph(a, acc[c][r][t]);
                const __m512i ai = _mm512_castph_si512(a);
                sum[r][t] = _mm512_add_ps(sum[r][t],
                    _mm512_add_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(ai)),
                                  _mm512_cvtph_ps(_mm512_extracti64x4_epi64(ai, 1))));
            }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < NR; r++)
        #pragma GCC unroll 4
        for (int t = 0; t < NT; t++)
            res[r * MAXT + t] = _mm512_reduce_add_ps(sum[r][t]);
}
#endif

/* dots for e4m3 rows against x prepared by f8h_prepare (token t's at xh + t k, its 1 / sigma
 * xinv[t]): the same sums, in float32, and dots' policy (cold: the rows one at a time), rows
 * of 256 or fewer excepted as FT_F8L's are: the 4-row tile, cold too (the bench FP8 model's
 * down rows; its batch-1 decode 1.01-1.05x in six interleaved pairs). */
static inline void f8h_dots(const void *const *w, const _Float16 *xh, const float *xinv,
                            int64_t k, int nr, int nt, int cold, float *res) {
#if FT_F8H
#define CASE(T)                                                                 \
    if (nt == T) {                                                              \
        if (nr == 1 || (cold && k > 256))                                     \
            for (int h = 0; h < nr; h++)                                        \
                f8h_tile(w + h, xh, k, 1, T, res + h * MAXT);                   \
        else                                                                    \
            f8h_tile(w, xh, k, MAXR, T, res);                                   \
    }
    CASE(1) CASE(2) CASE(3) CASE(4)
#undef CASE
    for (int r = 0; r < nr; r++)
        for (int t = 0; t < nt; t++)
            res[r * MAXT + t] *= xinv[t];
#else
    (void)w, (void)xh, (void)xinv, (void)k, (void)nr, (void)nt, (void)cold, (void)res;
#endif
}

/* One row of x in fmt's order (paired_index): evens then odds of each 2 * VW block, or
 * FT_F8L's e4m3 order of each 32. */
static inline void permute_row(const float *src, float *dst, int64_t k, int fmt) {
    int64_t j = 0;
    if (FT_F8L && fmt == FT_E4M3) {     /* paired_index's, a block at a time */
        for (; j + 32 <= k; j += 32)
            for (int v = 0; v < 4; v++)
                for (int i = 0; i < 8; i++)
                    dst[j + v * 8 + i] = src[j + f8l_source(v, i)] * E4M3_XUNIT;
        for (; j < k; j++)
            dst[j] = src[j] * E4M3_XUNIT;
        return;
    }
    for (; j + 2 * VW <= k; j += 2 * VW)
        for (int q = 0; q < VW; q++) {
            dst[j + q] = src[j + 2 * q];
            dst[j + VW + q] = src[j + 2 * q + 1];
        }
    for (; j < k; j++)
        dst[j] = src[j];
}

/* Within a parallel region, shared among its threads: x [T, K] in xfmt widened to float32
 * (wide), and for bf16, int4 and FT_F8L's e4m3 weights each row in their order into xp
 * (paired_fmt; xp == wide for the others), or, given xb, in i4x's form instead (xb [T, K],
 * x2 [T, 2K / 2^gshift]: i4x_prepare's). Ends with the worksharing loop's barrier. */
static inline void widen_rows(const void *x, int xfmt, int64_t t_count, int64_t k, int wfmt,
                              float *wide, float *xp, int gshift, uint16_t *xb, float *x2) {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < t_count; t++) {
        for (int64_t j = 0; j < k; j++)
            wide[t * k + j] = load_as(x, t * k + j, xfmt);
        if (xb)
            i4x_prepare(wide + t * k, k, gshift, wfmt, xb + t * k, x2 + t * 2 * (k >> gshift));
        else if (paired_fmt(wfmt))
            permute_row(wide + t * k, xp + t * k, k, wfmt);
    }
}

/* fp8: a tile of nr weight rows from `row` kept within one row block of bn rows (else one
 * row), and xv the nt tokens' xs scaled by that block's column scales (scales [row blocks,
 * cb] of this expert), rescaled into xsc [MAXT, k] when the block changes (*block: the
 * block xv holds). Returns the tile's rows.
 * Row scales (bk 0, bn 1: a checkpoint's channel scales, one a row) are not applied to x,
 * which would be rescaled at every row, but to each row's sum (row_scale): the tile
 * meets xv = xs as it is.
 * Given xh (FT_F8H: [MAXT, k]), xv is also rounded there for f8h_dots (f8h_prepare; xinv
 * [MAXT]), once a block (row scales: once). */
static inline int fp8_rows(int64_t row, int nr, int64_t bn, int64_t bk, int64_t *block,
                           const float *const *xs, const float **xv, int nt, float *xsc,
                           _Float16 *xh, float *xinv, int64_t k, const float *scales,
                           int64_t cb) {
    if (bk && (row + nr - 1) / bn != row / bn)
        nr = 1;
    const int64_t b = bk ? row / bn : 0;
    if (b != *block && (bk || xh)) {
        *block = b;
        for (int t = 0; t < nt; t++) {
            if (bk) {
                scale_row(xs[t], xsc + t * k, k, scales + b * cb, bk);
                xv[t] = xsc + t * k;
            }
            if (xh)
                xinv[t] = f8h_prepare(xv[t], k, xh + t * k);
        }
    }
    return nr;
}

/* What row `row`'s sum of a weight in fmt is multiplied by: an fp8 one's with row scales
 * (bk 0) and an int8 one's, its scale (scales [rows]; load_e4m3's weights are 1/E4M3_UNIT of
 * theirs), and any fp8 one's by E4M3_SUM (FT_F8L_SHIFT's 2^56); else 1 (fp8_rows scaled x;
 * the other formats carry their own). */
static inline float row_scale(int fmt, const float *scales, int64_t bk, int64_t row) {
    return fmt == FT_INT8 ? scales[row]
           : fmt == FT_E4M3 ? (bk ? 1.f : scales[row] * E4M3_UNIT) * E4M3_SUM : 1.f;
}

/* Whether fp8 rows of k that n tokens meet are decoded once to bf16 words (e4m3_f8l_row)
 * rather than at every pass of MAXT tokens: on FT_F8L, k whole 32-byte blocks, more than one
 * pass. Then the passes run the bf16 tile, 4 rows by MAXT tokens, FMA-bound, where the e4m3
 * tile's decode shares the registers (two 2-row tiles) and is redone at each pass. */
static inline int f8l_decodes(int fmt, int64_t n, int64_t k) {
    return FT_F8L && fmt == FT_E4M3 && n > MAXT && k % 32 == 0;
}

/* A tile's nr rows w[] pointed at their decoded words in dst (a row each, k apart), decoded
 * there on the first pass (f8l_decodes). */
static inline void f8l_rows(const void **w, int nr, uint16_t *dst, int64_t k, int first) {
    for (int r = 0; r < nr; r++) {
        if (first)
            e4m3_f8l_row(w[r], dst + r * k, k);
        w[r] = dst + r * k;
    }
}

/* A thread's scratch for decoded rows (f8l_decodes), allocated at its first use (one try):
 * whether it has one. */
static inline int f8l_scratch(uint16_t **dec, int *tried, int64_t words) {
    if (!*tried) {
        *tried = 1;
        *dec = malloc(words * sizeof **dec);
    }
    return *dec != NULL;
}

/* The rows of the tile at row r (of a weight's rows, items ending at r1): `together` where
 * r is a multiple of it and the tile ends within the item, else 1. The tiles fall on the
 * rows' own multiples, not on an item's start: items start at multiples of 16 but where
 * depends on the thread count, and an fp8 tile that would straddle a row block runs its rows
 * one at a time (fp8_rows), which moves the tiles after it (row blocks of 10: other bits on
 * 2 threads than on 1). Each row summed by one tile shape: the same bits on any count. */
static inline int tile_at(int64_t r, int64_t r1, int together) {
    return r % together == 0 && r + together <= r1 ? together : 1;
}

/* c [OUTER_R][OUTER_V VW] (rows cs apart) = (alpha ? c alpha : 0) + the sum over steps s of
 * a(r, s) b[s] (b's rows bs apart), a(r, s) = a[r ra + s sa]: OUTER_R x OUTER_V vectors of
 * sums in registers, each step OUTER_R broadcasts against OUTER_V vectors, 2 OUTER_R FMAs a
 * step. b and c vector-aligned. The loops over rows and vectors unrolled whole, so the sums
 * stay in registers (else GCC kept them on the stack: a third of the speed). A product
 * whose other operand is read many times: cpu_flash_attention.c's scores and values,
 * cpu_moe.c's experts of many tokens (tokens across the lanes). */
#if VW == 16
#define OUTER_R 12      /* 24 of 32 zmm */
#else
#define OUTER_R 6       /* 12 of 16 ymm; with 2 vectors of b and a broadcast, 15 */
#endif
#define OUTER_V 2
static inline __attribute__((always_inline)) void
outer_pass(const float *a, int64_t ra, int64_t sa, const float *b, int64_t bs, int64_t steps,
           float *c, int64_t cs, const vf *alpha) {
    vf acc[OUTER_R][OUTER_V];
#pragma GCC unroll 16
    for (int r = 0; r < OUTER_R; r++)
#pragma GCC unroll 4
        for (int v = 0; v < OUTER_V; v++)
            acc[r][v] = alpha ? ((const vf *)(c + r * cs))[v] * alpha[v] : (vf){0};
    for (int64_t s = 0; s < steps; s++) {
        const vf *bv = (const vf *)(b + s * bs);
#pragma GCC unroll 16
        for (int r = 0; r < OUTER_R; r++) {
            const float e = a[r * ra + s * sa];
#pragma GCC unroll 4
            for (int v = 0; v < OUTER_V; v++)
                acc[r][v] += e * bv[v];
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < OUTER_R; r++)
#pragma GCC unroll 4
        for (int v = 0; v < OUTER_V; v++)
            ((vf *)(c + r * cs))[v] = acc[r][v];
}

static inline int64_t item_rows(int64_t rows, int64_t threads) {
    int64_t r = rows / (4 * threads) / 16 * 16;
    return r < 16 ? 16 : r > ROWS ? ROWS : r;
}

#endif
