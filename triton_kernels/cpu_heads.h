/* A few query heads against one key or value row at a time, and RoPE: what the two decode
 * attentions share (cpu_attention.c's over a paged K/V cache, cpu_mla.c's over MLA's latent
 * cache, which every head reads as its key and value). Included by both, static inline.
 */
#ifndef FT_CPU_HEADS_H
#define FT_CPU_HEADS_H
#include "cpu_dot.h"

/* exp of VW floats, ~1 ulp (1.2e-7 relative at most over [-103, 88.6], against libm's
 * expf): Cephes' expf polynomial on r = x - n ln2, ln2 in two parts, then p 2^n through the
 * exponent bits in two factors, so n from -150 to 128 stays in range. x is clamped to
 * [-104, 88.7]: exp(-104) rounds to 0, -inf too; a nan stays a nan. A softmax's exps one
 * score at a time through libm were a sixth of a long context's decode attention. */
typedef int32_t vi32 __attribute__((vector_size(VW * 4)));
static inline __attribute__((always_inline)) vf vexp(vf x) {
    vi32 xi, big, small;
    memcpy(&xi, &x, sizeof xi);
    big = x > 88.7f;                            /* (all ones where true) */
    small = x < -104.f;
    const vf hi_c = (vf){0} + 88.7f, lo_c = (vf){0} - 104.f;
    vi32 hc, lc;
    memcpy(&hc, &hi_c, sizeof hc);
    memcpy(&lc, &lo_c, sizeof lc);
    xi = (xi & ~(big | small)) | (hc & big) | (lc & small);
    memcpy(&x, &xi, sizeof x);
    const vf t = x * 1.44269504f;
    vf n;
#if VW == 16
    const __m512 tn = _mm512_roundscale_ps((__m512)t,
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    memcpy(&n, &tn, sizeof n);
#elif defined(__AVX__)
    const __m256 tn = _mm256_round_ps((__m256)t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    memcpy(&n, &tn, sizeof n);
#else
    for (int i = 0; i < VW; i++)
        n[i] = nearbyintf(t[i]);
#endif
    vf r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    vf p = (vf){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + (r + 1.f);
    const vi32 ni = __builtin_convertvector(n, vi32), half = ni / 2;
    const vi32 f1 = (half + 127) << 23, f2 = (ni - half + 127) << 23;
    vf a, b;
    memcpy(&a, &f1, sizeof a);
    memcpy(&b, &f2, sizeof b);
    return p * a * b;
}

/* Lane by lane: where m, a, else b; the larger of a and b. */
static inline __attribute__((always_inline)) vf vsel(vi32 m, vf a, vf b) {
    return (vf)(((vi32)a & m) | ((vi32)b & ~m));
}

static inline __attribute__((always_inline)) vf vmax(vf a, vf b) {
#if VW == 16
    return (vf)_mm512_max_ps((__m512)a, (__m512)b);
#elif defined(__AVX__)
    return (vf)_mm256_max_ps((__m256)a, (__m256)b);
#else
    return vsel(a > b, a, b);
#endif
}

/* 2^x, ~1e-7 relative (Cephes' exp2f polynomial on x - round(x), then 2^n in the exponent
 * bits); exactly 0 below -126, -inf too, so no value product meets a denormal (an Intel
 * core's assist). The softmax's x are at most ~0 (scores less their running max), a sink's
 * logit less it at most 127. ~15 ops a vector, vexp's ~25: cpu_flash_attention.c's
 * exps were a fifth of its call. */
static inline __attribute__((always_inline)) vf vexp2(vf x) {
    const vi32 live = x >= -126.f;
    x = vmax(x, (vf){0} - 126.f);
    vf n;
#if VW == 16
    n = (vf)_mm512_roundscale_ps((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#elif defined(__AVX__)
    n = (vf)_mm256_round_ps((__m256)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    for (int i = 0; i < VW; i++)
        n[i] = nearbyintf(x[i]);
#endif
    const vf f = x - n;
    vf p = (vf){0} + 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.f;
    const vi32 e = (__builtin_convertvector(n, vi32) + 127) << 23;
    return vsel(live, p * (vf)e, (vf){0});
}

/* p[j] = exp(p[j] - m) over n scores, VW at a time (vexp; libm's expf for the rest): their
 * sum. A softmax's numerators, m its largest score. */
static inline float exps_less(float *p, int64_t n, float m) {
    int64_t j = 0;
    vf vsum = {0};
    for (; j + VW <= n; j += VW) {
        vf e;
        memcpy(&e, p + j, sizeof e);
        e = vexp(e - m);
        memcpy(p + j, &e, sizeof e);
        vsum += e;
    }
    float sum = hsum(vsum);
    for (; j < n; j++)
        sum += p[j] = expf(p[j] - m);
    return sum;
}

/* VW values of p from element i on, widened to float32. */
static inline vf load_vec(const void *p, int64_t i, int fmt) {
    if (fmt == 2) {
        vf f;
        memcpy(&f, (const float *)p + i, sizeof f);
        return f;
    }
    return load_w((const uint16_t *)p + i, fmt);
}

#define GMAX 8      /* q heads a pass over a kv head's keys and values serves */

/* The element where key j's row of kv head kv starts in a paged cache [NB, BS, Hk, Dh]. */
static inline int64_t key_row(const int32_t *table, int64_t j, int64_t bs, int64_t hk,
                              int64_t kv, int64_t dh) {
    return (((int64_t)table[j / bs] * bs + j % bs) * hk + kv) * dh;
}

/* rows [k1 - k0]: where keys k0..k1-1's rows of kv head kv start (key_row's, a block at a
 * time: no division a key). */
static inline void key_rows(const int32_t *table, int64_t k0, int64_t k1, int64_t bs,
                            int64_t hk, int64_t kv, int64_t dh, int64_t *rows) {
    int64_t block = k0 / bs, off = k0 % bs;
    for (int64_t j = 0; j < k1 - k0; j++) {
        rows[j] = (((int64_t)table[block] * bs + off) * hk + kv) * dh;
        if (++off == bs)
            off = 0, block++;
    }
}

/* The lane sums of 8 vectors, r[i] = sum of a[i]'s lanes: a tree of in-register shuffles
 * and adds, 21 ops on AVX2 for all 8, where hsum one at a time is 6 each (a key's dots for 4
 * q heads spent a sixth of a long context's decode attention in their hsums). */
static inline __attribute__((always_inline)) void hsum8(const vf *a, float *r) {
    typedef float v8 __attribute__((vector_size(32)));
    v8 h[8];
    for (int i = 0; i < 8; i++) {
#if VW == 16
        h[i] = __builtin_shufflevector(a[i], a[i], 0, 1, 2, 3, 4, 5, 6, 7)
            + __builtin_shufflevector(a[i], a[i], 8, 9, 10, 11, 12, 13, 14, 15);
#else
        h[i] = a[i];
#endif
    }
    v8 x[4], y[2];
    for (int i = 0; i < 4; i++)     /* per 128-bit half: [a(2i) 0+2, 1+3, a(2i+1) 0+2, 1+3] */
        x[i] = __builtin_shufflevector(h[2 * i], h[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13)
            + __builtin_shufflevector(h[2 * i], h[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    for (int i = 0; i < 2; i++)     /* per half: the 4 vectors' sums of that half */
        y[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 2, 8, 10, 4, 6, 12, 14)
            + __builtin_shufflevector(x[2 * i], x[2 * i + 1], 1, 3, 9, 11, 5, 7, 13, 15);
    const v8 s = __builtin_shufflevector(y[0], y[1], 0, 1, 2, 3, 8, 9, 10, 11)
        + __builtin_shufflevector(y[0], y[1], 4, 5, 6, 7, 12, 13, 14, 15);
    memcpy(r, &s, sizeof s);
}

/* q [nh, dh] (float32) packed for dots_keys: qp [dh / VW][nh] vectors (the loads of a
 * vector of dh one base and constant offsets; from q's rows the heads' pointers spilled). */
static inline void pack_heads(const float *q, int64_t nh, int64_t dh, vf *qp) {
    for (int64_t d = 0; d + VW <= dh; d += VW)
        for (int64_t g = 0; g < nh; g++)
            memcpy(&qp[d / VW * nh + g], q + g * dh + d, sizeof(vf));
}

/* sc[c * nh + g] = (q_g . k_c) * scale for the nh q heads q [nh, dh] (float32; qp:
 * pack_heads') and KB keys k_c (in fmt, at elements at[c]) of one kv head, nh * KB <= 8:
 * each of a key's vectors widened once for all the heads, nh * KB independent sums (one
 * key's 4 were a chain of FMAs as long as dh's vectors, waited on), their lanes summed by
 * one hsum8, then the tail (one fixed order). Key-major: the sums are stored as hsum8 leaves
 * them (head-major, they were 8 scalar stores, a quarter of the scores' time). */
static inline __attribute__((always_inline)) void
dots_keys(const float *q, const vf *qp, const int nh, const int KB, const void *k,
          const int64_t *at, int64_t dh, const int fmt, float scale, float *sc) {
    vf acc[8];
    for (int i = 0; i < 8; i++)
        acc[i] = (vf){0};
    int64_t d = 0;
    for (; d + VW <= dh; d += VW, qp += nh) {
        vf kv[8];
        for (int c = 0; c < KB; c++)
            kv[c] = load_vec(k, at[c] + d, fmt);
        for (int g = 0; g < nh; g++)
            for (int c = 0; c < KB; c++)
                acc[c * nh + g] += qp[g] * kv[c];
    }
    float s[8];
    hsum8(acc, s);
    if (d < dh)                                 /* (dh not a multiple of VW) */
        for (int c = 0; c < KB; c++)
            for (int g = 0; g < nh; g++)
                for (int64_t e = d; e < dh; e++)
                    s[c * nh + g] += q[g * dh + e] * load_as(k, at[c] + e, fmt);
    for (int i = 0; i < KB * nh; i++)
        sc[i] = s[i] * scale;
}

/* sc[g * stride] = (q_g . k) * scale for the nh (<= GMAX) q heads q [nh, dh] (float32)
 * sharing key k (in fmt, at element `at`): each of k's vectors widened once for them all;
 * every dot in vector lanes, then across them, then the tail (one fixed order). */
static inline __attribute__((always_inline)) void
dots_heads(const float *q, int64_t nh, const void *k, int64_t at, int64_t dh, int fmt,
           float scale, float *sc, int64_t stride) {
    vf acc[GMAX];
    for (int64_t g = 0; g < nh; g++)
        acc[g] = (vf){0};
    int64_t d = 0;
    for (; d + VW <= dh; d += VW) {
        vf kv = load_vec(k, at + d, fmt);
        for (int64_t g = 0; g < nh; g++) {
            vf qv;
            memcpy(&qv, q + g * dh + d, sizeof qv);
            acc[g] += qv * kv;
        }
    }
    for (int64_t g = 0; g < nh; g++) {
        float s = hsum(acc[g]);
        for (int64_t e = d; e < dh; e++)
            s += q[g * dh + e] * load_as(k, at + e, fmt);
        sc[g * stride] = s * scale;
    }
}

/* h_g += p[g * stride] * v over dh for the nh q heads' sums h [nh, dh], v (in fmt, at
 * element `at`) widened once for them all. */
static inline __attribute__((always_inline)) void
add_scaled_heads(float *h, const float *p, int64_t stride, int64_t nh, const void *v, int64_t at,
                 int64_t dh, int fmt) {
    int64_t d = 0;
    for (; d + VW <= dh; d += VW) {
        vf vv = load_vec(v, at + d, fmt);
        for (int64_t g = 0; g < nh; g++) {
            vf hv;
            memcpy(&hv, h + g * dh + d, sizeof hv);
            hv += p[g * stride] * vv;
            memcpy(h + g * dh + d, &hv, sizeof hv);
        }
    }
    for (; d < dh; d++) {
        float vd = load_as(v, at + d, fmt);
        for (int64_t g = 0; g < nh; g++)
            h[g * dh + d] += p[g * stride] * vd;
    }
}

/* add_scaled_heads over n rows for NH heads (a constant, up to GMAX): h_g += sum_j
 * p[g * gs + j * js] v_j (head-major probabilities: js 1, gs their stride; key-major: gs 1,
 * js NH), v_j (in fmt) at element rows[j]. The heads' sums stay in registers across a block
 * of rows, a slice of RV vectors of dh at a time, the block's rows in cache between its
 * slices (the per-row form loads and stores every head's sums for every row:
 * most of MLA's long-context time); each element sums its rows in the same order with the
 * same fused multiply-adds, so the same bits. */
#define ROW_BLOCK 256                   /* rows a block: MLA's 1152-byte latents, ~300 KB */

/* One slice: dh's RV vectors from d on, over the block's rows. */
static inline __attribute__((always_inline)) void
scaled_slice(float *h, const float *p, int64_t gs, int64_t js, const void *v,
             const int64_t *rows, int64_t n, int64_t dh, int fmt, const int NH, const int RV,
             int64_t d) {
    vf acc[GMAX][4];
    for (int g = 0; g < NH; g++)
        for (int u = 0; u < RV; u++)
            memcpy(&acc[g][u], h + g * dh + d + u * VW, sizeof(vf));
    for (int64_t j = 0; j < n; j++) {
        vf vv[4];
        for (int u = 0; u < RV; u++)
            vv[u] = load_vec(v, rows[j] + d + u * VW, fmt);
        for (int g = 0; g < NH; g++) {
            const float pg = p[g * gs + j * js];
            for (int u = 0; u < RV; u++)
                acc[g][u] += pg * vv[u];
        }
    }
    for (int g = 0; g < NH; g++)
        for (int u = 0; u < RV; u++)
            memcpy(h + g * dh + d + u * VW, &acc[g][u], sizeof(vf));
}

static inline __attribute__((always_inline)) void
add_scaled_block(float *h, const float *p, int64_t gs, int64_t js, const void *v,
                 const int64_t *rows, int64_t n, int64_t dh, int fmt, const int NH) {
    /* RV: as many of a row's vectors a pass as leave the NH x RV sums, the row's vectors
     * and a broadcast in registers (16 with AVX2, 32 with AVX-512). With 4 heads' sums of
     * one vector a row, AVX2's FMAs were 4 chains, each waiting on its last. */
    const int RV = VW == 16 ? (NH <= 4 ? 4 : 2) : (NH <= 2 ? 4 : NH <= 4 ? 2 : 1);
    int64_t d = 0;
    for (; d + RV * VW <= dh; d += RV * VW)
        scaled_slice(h, p, gs, js, v, rows, n, dh, fmt, NH, RV, d);
    for (; d + VW <= dh; d += VW)
        scaled_slice(h, p, gs, js, v, rows, n, dh, fmt, NH, 1, d);
    for (int64_t j = 0; j < n; j++)             /* the rest of dh, under a vector */
        for (int64_t f = d; f < dh; f++) {
            const float vd = load_as(v, rows[j] + f, fmt);
            for (int g = 0; g < NH; g++)
                h[g * dh + f] += p[g * gs + j * js] * vd;
        }
}

static inline void add_scaled_rows(float *h, const float *p, int64_t stride, const void *v,
                                   const int64_t *rows, int64_t n, int64_t dh, int fmt) {
    for (int64_t j0 = 0; j0 < n; j0 += ROW_BLOCK)
        add_scaled_block(h, p + j0, stride, 1, v, rows + j0,
                         n - j0 < ROW_BLOCK ? n - j0 : ROW_BLOCK, dh, fmt, GMAX);
}

/* One head [dh] of a token: RMSNorm (when w), then RoPE over its first r dims, in float32. */
static inline void norm_rope(float *h, int64_t dh, const float *w, float eps, const float *cs,
                             int64_t r, int interleaved) {
    if (w) {
        float ss = 0.f;
        for (int64_t d = 0; d < dh; d++)
            ss += h[d] * h[d];
        float inv = 1.f / sqrtf(ss / (float)dh + eps);
        for (int64_t d = 0; d < dh; d++)
            h[d] = h[d] * inv * w[d];
    }
    int64_t half = r / 2;
    for (int64_t i = 0; i < half; i++) {
        int64_t a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + half;
        float c = cs[i], s = cs[half + i], x1 = h[a], x2 = h[b];
        h[a] = x1 * c - x2 * s;
        h[b] = x2 * c + x1 * s;
    }
}

/* A decode step's indices, every one checked before any is used: each sequence's length
 * (>= 1, within its table's M blocks), position (within the rope table's P rows), slot (-1
 * or within the cache's NB * BS) and the table's ids it reads (within NB). Returns the
 * longest length, or -1 where one is out of range. */
static inline int64_t decode_indices(int64_t b_count, const int32_t *lens, const int64_t *pos,
                                     int64_t n_pos, const int64_t *slots, const int32_t *tables,
                                     int64_t max_blocks, int64_t nb, int64_t bs) {
    int64_t longest = 1;
    for (int64_t b = 0; b < b_count; b++) {
        if (lens[b] < 1 || (lens[b] - 1) / bs >= max_blocks || pos[b] < 0 || pos[b] >= n_pos
            || slots[b] < -1 || slots[b] >= nb * bs)
            return -1;
        for (int64_t i = 0; i <= (lens[b] - 1) / bs; i++)
            if (tables[b * max_blocks + i] < 0 || tables[b * max_blocks + i] >= nb)
                return -1;
        longest = lens[b] > longest ? lens[b] : longest;
    }
    return longest;
}

#endif
