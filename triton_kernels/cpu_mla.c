/* A multi-head latent attention layer's decode step on the CPU, in one call (DeepSeek-V3,
 * Kimi-K2, GLM-4.7-Flash): each sequence's one new token from its two projections' outputs
 * to the input of o_proj, in the absorbed form (mla.py says why decode takes it).
 *
 * Why: torch spelled this step as ~30 ops a layer (the latent's norm, two ropes and their
 * slices, the cache write, two batched products with kv_b_proj's halves, the reference's
 * gather, einsums, mask and softmax), a few us of dispatch each, and the gather copied the
 * sequence's whole latent context every layer.
 *
 * Shapes (B sequences; H heads; N no-rope and R rope dims of q and k; L the latent's width,
 * kv_lora_rank; V the value dims):
 *   q [B, H (N + R)] in fmt: q_b_proj's output (each head [nope | pe], pe not yet rotated);
 *   kv [B, L + R] in fmt: kv_a_proj_with_mqa's ([c_kv | k_pe], neither normed nor rotated);
 *   kv_norm [L] in fmt (kv_a_layernorm's scale), eps; cos_sin [P, R] f32, pos [B];
 *   cache [NB, BS, L + R] in cfmt (0 bf16, 1 fp16, 2 f32: the reference rounds a cache in
 *   another dtype than fmt's to it, so cpu_mla.py binds only a cache in fmt), slots [B]
 *   (-1 writes nothing),
 *   tables [B, M] i32, lens [B] i32 (keys after this step);
 *   w_kvb [H, N + V, L] in fmt: kv_b_proj's weight (per head W_UK [N, L], then W_UV [V, L]);
 *   scratch: B H (L + R) f32; out [B, H V] in fmt.
 * Each step rounded to fmt where the modules' reference rounds (mla.py's attend_absorbed):
 *   the latent: c_kv = ft_rms_norm's (the same bits), k_pe rotated in float32, rounded;
 *   q_pe rotated, rounded; q_abs = q_nope W_UK summed in float32, rounded;
 *   scores: q_abs . c_kv + q_pe . k_pe summed in float32 and rounded (the reference's einsum
 *   on 16-bit tensors), times scale in float32; softmax, each probability rounded
 *   (the reference's probs.to(q.dtype)); o_lat = sum p c_kv in float32, rounded;
 *   out = W_UV o_lat in float32, rounded.
 * Returns 0, -1 out of memory, -2 an index outside the cache, its table or the rope table.
 */
#include "cpu_heads.h"

int ft_mla_decode(const void *q, const void *kv, int fmt, int64_t b_count, int64_t h,
                  int64_t n, int64_t r, int64_t l, int64_t v, const uint16_t *kv_norm,
                  float eps, const float *cos_sin, int64_t n_pos, int interleaved,
                  const int64_t *pos, void *cache, int cfmt, int64_t nb, int64_t bs,
                  const int64_t *slots, const int32_t *tables, int64_t max_blocks,
                  const int32_t *lens, const void *w_kvb, float scale, int threads,
                  float *scratch, void *out) {
    const int64_t lr = l + r, qw = n + r;
    const int64_t longest = decode_indices(b_count, lens, pos, n_pos, slots, tables, max_blocks,
                                           nb, bs);
    if (longest < 0)
        return -2;
    const int64_t chunks = (h + GMAX - 1) / GMAX;
    int bad = 0;
#pragma omp parallel num_threads(threads)
    {
        float *acc = malloc((GMAX * (l > v ? l : v) + GMAX * longest + lr)
                            * sizeof(float));
        uint16_t *row = malloc(l * sizeof(uint16_t));
        int64_t *rows = malloc(longest * sizeof(int64_t));     /* a sequence's latent rows */
        if (!acc || !row || !rows)
            __atomic_store_n(&bad, 1, __ATOMIC_RELAXED);
#pragma omp barrier
        if (!__atomic_load_n(&bad, __ATOMIC_RELAXED)) {
            float *sc = acc + GMAX * (l > v ? l : v), *tmp = sc + GMAX * longest;
            /* 1. Per sequence, the new latent into its cache slot; per (sequence, head) the
             *    query in latent space: [q_nope W_UK | rotated q_pe] into the scratch. */
#pragma omp for schedule(static)
            for (int64_t item = 0; item < b_count * (h + 1); item++) {
                const int64_t b = item / (h + 1), hd = item % (h + 1) - 1;
                const float *cs = cos_sin + pos[b] * r;
                if (hd < 0) {
                    if (slots[b] < 0)
                        continue;
                    const uint16_t *x = (const uint16_t *)kv + b * lr;
                    ft_rms_norm(x, NULL, kv_norm, eps, 1, l, fmt, row, NULL, 1);
                    for (int64_t e = 0; e < r; e++)
                        tmp[e] = scalar_w(x + l + e, fmt);
                    norm_rope(tmp, r, NULL, 0.f, cs, r, interleaved);
                    const int64_t at = slots[b] * lr;
                    for (int64_t e = 0; e < l; e++)
                        store_as(cache, at + e, round_to(scalar_w(row + e, fmt), cfmt), cfmt);
                    for (int64_t e = 0; e < r; e++)
                        store_as(cache, at + l + e, round_to(round_to(tmp[e], fmt), cfmt), cfmt);
                    continue;
                }
                const int64_t qa = (b * h + hd) * qw;
                float *ql = scratch + (b * h + hd) * lr;
                for (int64_t e = 0; e < r; e++)
                    tmp[e] = load_as(q, qa + n + e, fmt);
                norm_rope(tmp, r, NULL, 0.f, cs, r, interleaved);
                for (int64_t e = 0; e < r; e++)
                    ql[l + e] = round_to(tmp[e], fmt);
                for (int64_t e = 0; e < l; e++)
                    acc[e] = 0.f;
                const uint16_t *wuk = (const uint16_t *)w_kvb + hd * (n + v) * l;
                for (int64_t d = 0; d < n; d++) {           /* rows of W_UK, scaled and added */
                    const float qd = load_as(q, qa + d, fmt);
                    int64_t e = 0;
                    for (; e + VW <= l; e += VW) {
                        vf a;
                        memcpy(&a, acc + e, sizeof a);
                        a += qd * load_w(wuk + d * l + e, fmt);
                        memcpy(acc + e, &a, sizeof a);
                    }
                    for (; e < l; e++)
                        acc[e] += qd * scalar_w(wuk + d * l + e, fmt);
                }
                for (int64_t e = 0; e < l; e++)
                    ql[e] = round_to(acc[e], fmt);
            }                               /* (the for's implicit barrier: latents written) */
            /* 2. Per (sequence, chunk of heads): softmax over the sequence's latents, the
             *    latent output, W_UV out of it. */
#pragma omp for schedule(dynamic)
            for (int64_t item = 0; item < b_count * chunks; item++) {
                const int64_t b = item / chunks, h0 = item % chunks * GMAX;
                const int64_t nh = h - h0 < GMAX ? h - h0 : GMAX, len = lens[b];
                const int32_t *table = tables + b * max_blocks;
                const float *qs = scratch + (b * h + h0) * lr;
                for (int64_t j = 0; j < len; j++) {
                    const int64_t at = ((int64_t)table[j / bs] * bs + j % bs) * lr;
                    if (nh == GMAX)     /* (a constant count: the heads' loops unrolled) */
                        dots_heads(qs, GMAX, cache, at, lr, cfmt, 1.f, sc + j, len);
                    else
                        dots_heads(qs, nh, cache, at, lr, cfmt, 1.f, sc + j, len);
                    for (int64_t g = 0; g < nh; g++)         /* (a 16-bit einsum's rounding) */
                        sc[g * len + j] = round_to(sc[g * len + j], fmt) * scale;
                }
                for (int64_t g = 0; g < nh; g++) {
                    float *p = sc + g * len, m = -INFINITY;
                    for (int64_t j = 0; j < len; j++)
                        m = p[j] > m ? p[j] : m;
                    const float sum = exps_less(p, len, m);
                    for (int64_t j = 0; j < len; j++)
                        p[j] = round_to(p[j] / sum, fmt);
                }
                for (int64_t i = 0; i < nh * l; i++)
                    acc[i] = 0.f;
                for (int64_t j = 0; j < len; j++)
                    rows[j] = ((int64_t)table[j / bs] * bs + j % bs) * lr;
                if (nh == GMAX)
                    add_scaled_rows(acc, sc, len, cache, rows, len, l, cfmt);
                else
                    for (int64_t j = 0; j < len; j++)
                        add_scaled_heads(acc, sc + j, len, nh, cache, rows[j], l, cfmt);
                for (int64_t g = 0; g < nh; g++) {
                    float *o = acc + g * l;
                    for (int64_t e = 0; e < l; e++)
                        o[e] = round_to(o[e], fmt);
                    const uint16_t *wuv = (const uint16_t *)w_kvb + ((h0 + g) * (n + v) + n) * l;
                    for (int64_t d = 0; d < v; d++) {           /* rows of W_UV . o_lat */
                        vf a = (vf){0};
                        int64_t e = 0;
                        for (; e + VW <= l; e += VW) {
                            vf ov;
                            memcpy(&ov, o + e, sizeof ov);
                            a += ov * load_w(wuv + d * l + e, fmt);
                        }
                        float s = hsum(a);
                        for (; e < l; e++)
                            s += o[e] * scalar_w(wuv + d * l + e, fmt);
                        store_as(out, (b * h + h0 + g) * v + d, round_to(s, fmt), fmt);
                    }
                }
            }
        }
        free(acc);
        free(row);
        free(rows);
    }
    return bad ? -1 : 0;
}
