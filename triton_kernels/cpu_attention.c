/* One attention layer's decode step on the CPU, in one call: each sequence's one new token
 * through q/k RMSNorm per head, RoPE, the K/V write into the paged cache, and attention over
 * its cached keys (a sliding window, per-head sinks), on all of OpenMP's threads.
 *
 * A kv head's q heads (GQA) share one pass over its keys and values, each row read and widened
 * once for them (16 q heads of 64 over 4 kv heads, 2-core Xeon: 1024 keys 155 -> 131 us).
 *
 * Built with cpu_moe.c into one library (cpu_native.py). Why: torch spells this step as ~40
 * small ops a layer (the norms' six, rope's slices and casts, the block gather, the float32
 * widening, SDPA), each a few us of dispatch on a CPU: ~0.4 ms a layer, a fifth of a
 * batch-1 decode step, for well under 0.05 ms of arithmetic.
 *
 * Shapes (B sequences of one query each; Hq, Hk heads of Dh; R rotary dims <= Dh):
 *   qkv [B, (Hq + 2 Hk) Dh] in fmt (q heads, then k, then v: the fused projection's output);
 *   q_norm, k_norm [Dh] f32 (the scale, offset applied) or NULL; cos_sin [P, R] f32 (cos of
 *   the R/2 pairs, then sin); pos [B] i64; k_cache, v_cache [NB, BS, Hk, Dh] in cfmt; slots
 *   [B] i64 (block * BS + offset: the new token's; -1 writes nothing); tables [B, M] i32;
 *   lens [B] i32 (keys after this step); sinks [Hq] f32 or NULL; out [B, Hq Dh] in fmt;
 *   q_scratch: B Hq Dh f32. Every block id, slot and position is checked first (-2).
 *   Formats: 0 bf16, 1 fp16, 2 f32. window 0: none; else key j is seen iff len - window <= j.
 * q and k are normed and rotated in float32 and rounded once to the model's dtype (HF rounds
 * after each op: the bits differ in the last place); scores, softmax and the value sums in
 * float32, rounded once.
 */
#include "cpu_dot.h"

/* p[i] in fmt, rounded to it first. */
static inline void st(void *p, int64_t i, float f, int fmt) {
    store_as(p, i, round_to(f, fmt), fmt);
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

/* sc[g * stride] = (q_g . k) * scale for the nh (<= GMAX) q heads q [nh, dh] (float32)
 * sharing key k (in fmt, at element `at`): each of k's vectors widened once for them all;
 * every dot in vector lanes, then across them, then the tail (one fixed order). */
static inline void dots_heads(const float *q, int64_t nh, const void *k, int64_t at,
                              int64_t dh, int fmt, float scale, float *sc, int64_t stride) {
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
static inline void add_scaled_heads(float *h, const float *p, int64_t stride, int64_t nh,
                                    const void *v, int64_t at, int64_t dh, int fmt) {
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

/* One head [dh] of a token: RMSNorm (when w), then RoPE over its first r dims, in float32. */
static void norm_rope(float *h, int64_t dh, const float *w, float eps, const float *cs,
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

int ft_attn_decode(const void *qkv, int fmt, int64_t b_count, int64_t hq, int64_t hk,
                   int64_t dh, const float *q_norm, const float *k_norm, float eps,
                   const float *cos_sin, int64_t n_pos, int64_t r, int interleaved,
                   const int64_t *pos, void *k_cache, void *v_cache, int cfmt, int64_t nb,
                   int64_t bs, const int64_t *slots, const int32_t *tables, int64_t max_blocks,
                   const int32_t *lens, int64_t window, const float *sinks, float scale,
                   int threads, float *q_scratch, void *out) {
    const int64_t width = (hq + 2 * hk) * dh;
    int64_t longest = 1;
    for (int64_t b = 0; b < b_count; b++) {       /* every index checked before any is used */
        if (lens[b] < 1 || (lens[b] - 1) / bs >= max_blocks || pos[b] < 0 || pos[b] >= n_pos
            || slots[b] < -1 || slots[b] >= nb * bs)
            return -2;
        for (int64_t i = 0; i <= (lens[b] - 1) / bs; i++)
            if (tables[b * max_blocks + i] < 0 || tables[b * max_blocks + i] >= nb)
                return -2;
        longest = lens[b] > longest ? lens[b] : longest;
    }
    /* Step 2 takes a kv head's q heads GMAX at a time (a chunk: each key and value row
     * read and widened once for all of them, not once a q head). */
    const int64_t group = hq / hk, chunk = group < GMAX ? group : GMAX;
    int bad = 0;
#pragma omp parallel num_threads(threads)
    {
        float *h = malloc(chunk * dh * sizeof *h);
        float *scores = malloc(chunk * longest * sizeof *scores);
        if (!h || !scores)
            __atomic_store_n(&bad, 1, __ATOMIC_RELAXED);
#pragma omp barrier
        if (!__atomic_load_n(&bad, __ATOMIC_RELAXED)) {
            /* 1. Per (sequence, head): q normed and rotated into the scratch; k normed,
             *    rotated and v, as they are, into the cache slot of the new token. */
#pragma omp for schedule(static)
            for (int64_t item = 0; item < b_count * (hq + hk); item++) {
                int64_t b = item / (hq + hk), head = item % (hq + hk);
                const float *cs = cos_sin + pos[b] * r;
                int64_t base = b * width + head * dh;
                for (int64_t d = 0; d < dh; d++)
                    h[d] = load_as(qkv, base + d, fmt);
                if (head < hq) {
                    norm_rope(h, dh, q_norm, eps, cs, r, interleaved);
                    for (int64_t d = 0; d < dh; d++)
                        q_scratch[(b * hq + head) * dh + d] = round_to(h[d], fmt);
                } else if (slots[b] >= 0) {
                    int64_t kv = head - hq;
                    norm_rope(h, dh, k_norm, eps, cs, r, interleaved);
                    int64_t at = (slots[b] * hk + kv) * dh;
                    int64_t vbase = b * width + (hq + hk + kv) * dh;
                    for (int64_t d = 0; d < dh; d++) {
                        st(k_cache, at + d, round_to(h[d], fmt), cfmt);
                        st(v_cache, at + d, load_as(qkv, vbase + d, fmt), cfmt);
                    }
                }
            }                               /* (the for's implicit barrier) */
            /* 2. Per (sequence, kv head, chunk of its q heads): softmax(q.k * scale) . v over
             *    the keys (the window's), a sink's logit joining the softmax without a value. */
            const int64_t chunks = (group + chunk - 1) / chunk;
#pragma omp for schedule(static)
            for (int64_t item = 0; item < b_count * hk * chunks; item++) {
                int64_t b = item / (hk * chunks), kv = item / chunks % hk;
                int64_t h0 = kv * group + item % chunks * chunk;       /* its first q head */
                int64_t nh = h0 + chunk <= (kv + 1) * group ? chunk : (kv + 1) * group - h0;
                int64_t len = lens[b], first = window > 0 && len > window ? len - window : 0;
                int64_t n = len - first;
                const float *q = q_scratch + (b * hq + h0) * dh;
                const int32_t *table = tables + b * max_blocks;
                for (int64_t j = first; j < len; j++) {
                    int64_t at = (((int64_t)table[j / bs] * bs + j % bs) * hk + kv) * dh;
                    dots_heads(q, nh, k_cache, at, dh, cfmt, scale, scores + (j - first), n);
                }
                float denom[GMAX];
                for (int64_t g = 0; g < nh; g++) {
                    float *sc = scores + g * n;
                    float m = sinks ? sinks[h0 + g] : -INFINITY;
                    for (int64_t j = 0; j < n; j++)
                        m = sc[j] > m ? sc[j] : m;
                    float sum = sinks ? expf(sinks[h0 + g] - m) : 0.f;
                    for (int64_t j = 0; j < n; j++) {
                        float pj = expf(sc[j] - m);
                        sc[j] = pj;
                        sum += pj;
                    }
                    denom[g] = sum;
                }
                for (int64_t i = 0; i < nh * dh; i++)
                    h[i] = 0.f;
                for (int64_t j = first; j < len; j++) {
                    int64_t at = (((int64_t)table[j / bs] * bs + j % bs) * hk + kv) * dh;
                    add_scaled_heads(h, scores + (j - first), n, nh, v_cache, at, dh, cfmt);
                }
                for (int64_t g = 0; g < nh; g++)
                    for (int64_t d = 0; d < dh; d++)
                        st(out, (b * hq + h0 + g) * dh + d, h[g * dh + d] / denom[g], fmt);
            }
        }
        free(h);
        free(scores);
    }
    return bad ? -1 : 0;
}
