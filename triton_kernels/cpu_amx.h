/* What the AMX kernels share (cpu_amx.c: a prefill chunk's experts; cpu_amx_attention.c: a
 * prefill step's attention; cpu_attention.c: a decode step's scores): FT_AMX (whether this build has AMX-BF16 and the AVX-512 it
 * uses), the tile state's request and configuration, bf16 widening and rounding, vector
 * exp and 2^x, and a 16 x 16 32-bit transpose. */
#ifndef FT_CPU_AMX_H
#define FT_CPU_AMX_H
#include "cpu_dot.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__) \
    && defined(__AVX512BF16__)
#define FT_AMX 1
#else
#define FT_AMX 0
#endif

#if FT_AMX
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Linux hands a process AMX's 8 KB of tile state only on request (once; any thread). */
static int amx_permitted(void) {
    static int state;               /* 0 unasked, 1 granted, -1 denied */
    int s = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (!s) {
        s = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
        __atomic_store_n(&state, s, __ATOMIC_RELEASE);
    }
    return s == 1;
}

/* Every tile 16 rows of 64 bytes: an A tile 16 rows x 32 bf16, a B tile 16 pairs x 16
 * columns x 2 bf16 (AMX's pair layout), a C tile 16 rows x 16 columns f32. */
struct tilecfg {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

static void load_tiles(void) {
    struct tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++)
        cfg.colsb[i] = 64, cfg.rows[i] = 16;
    /* (not GCC 12's _tile_loadconfig: its asm names only the config's first 8 bytes as
     * read, so the stores of colsb and rows were dropped as dead and ldtilecfg met stack
     * garbage: a general-protection fault, SIGSEGV, at the first AMX call) */
    __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
}

static inline __m512 widen_bf16(__m256i h) {          /* 16 bf16 -> f32 */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* f32 -> bf16 nearest even, as a f32 (AVX512-BF16's conversion: as AMX's products, it
 * takes a subnormal for zero; a nan stays a quiet nan). */
static inline __m512 round_bf16(__m512 v) {
    return widen_bf16((__m256i)_mm512_cvtneps_pbh(v));
}

static inline __m256i narrow_bf16(__m512 v) {         /* 16 f32 already at bf16 -> bf16 */
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16));
}

/* exp, ~2 ulp (Cephes' expf polynomial on x - n ln2, then x 2^n); exp(-inf) 0, exp(inf) inf. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-104.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}

/* 2^x, ~1e-7 relative (a degree-5 polynomial on x - round(x), as Cephes' exp2f); x below
 * -127 (-inf too) gives 2^-127, which the bf16 conversion takes for zero; from 128 inf. */
static inline __m512 exp2_16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-127.f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
    return _mm512_scalef_ps(_mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f)), n);
}

/* 16 x 16 32-bit transpose in registers: r[i] lane j -> r[j] lane i. */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    }
}

#endif  /* FT_AMX */
#endif  /* FT_CPU_AMX_H */
