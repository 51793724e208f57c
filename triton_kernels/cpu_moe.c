/* One MoE layer's routed experts on the CPU, in one call: every used expert's gate/up
 * product, its activation, its down product and the weighted sum, on all of OpenMP's threads.
 *
 * Built at first use by cpu_native.py (cc -O3 -march=native -fopenmp) and called through
 * ctypes. It links libgomp by soname, so in a process that has imported torch it runs on
 * torch's own OpenMP pool (the same workers, the same thread count: torch.set_num_threads).
 *
 * Why (cpu_native.py has the figures): a decode step's experts are hundreds of small
 * matrix-vector products; torch runs each on one thread with a few us of dispatch. Here each
 * weight row is read once for all the tokens routed to its expert, and the rows of the layer's
 * used experts are shared among the threads.
 *
 * Shapes (P = T * k (token, expert) pairs, S slots in the banks, D hidden, I expert width):
 *   x [T, D] in xfmt (0 bf16, 1 fp16, 2 f32), ids [T, k] i64 (expert ids; slot_map [n_map]
 *   i64 maps them to slots, or NULL),
 *   wts [T, k] f32, w13 [S, 2I, D] and w2 [S, D, I] (fmt: 0 bf16, 1 fp16, 3 fp8 e4m3, 4 and
 *   5 int4 [.., K/2] bytes), rows [0, I) of w13 the gate and [I, 2I) the up; fp8: s13 [S,
 *   ceil(2I/bn), ceil(D/bk)] and s2 [S, ceil(D/bn), ceil(I/bk)] f32, the scale of each (bn, bk)
 *   block (x is scaled per block instead of the weights: a row block's x once for its rows), or
 *   with (bn, bk) (1, 0) s13 [S, 2I] and s2 [S, D], each row's own (a checkpoint's channel
 *   scales, applied to the row's sums); int4: s13 [S, 2I, D/G, 2] and s2 [S, D, I/G, 2] f32,
 *   each row's (scale, -zero * scale) per group of G = bk columns (a power of two from 32), or
 *   (fmt 5) s13 [S, 2I, D/G] and s2 [S, D, I/G] bf16 scales, zero point 8; else NULL;
 *   b13 [S, 2I] and b2 [S, D] f32 or NULL;
 *   act [P, I] f32 and acc [T, D] f32 scratch; out [T, D] in ofmt (as xfmt; rounded once);
 *   threads: the team (the caller's torch thread count).
 * Each output element is summed in one fixed order (the k experts of a token by slot, each
 * dot product over K in vector lanes then across them, or, in the GEMM form an expert takes
 * from GEMM_TOKENS tokens, over K one after another), whatever the thread count.
 */
#include "cpu_heads.h"

static inline float activate(float g, float u, int kind, float alpha, float limit) {
    if (kind == 0)                          /* silu(gate) * up */
        return g / (1.f + expf(-g)) * u;
    g = fminf(g, limit);                    /* gpt-oss: clamped, (up + 1) * gate * sigmoid(alpha gate) */
    u = fminf(fmaxf(u, -limit), limit);
    return (u + 1.f) * (g / (1.f + expf(-alpha * g)));
}

/* activate's, VW lanes at a time (vexp: ~1 ulp of expf). */
static inline vf activate_v(vf g, vf u, int kind, float alpha, float limit) {
    if (kind == 0)
        return g / (1.f + vexp(-g)) * u;
    const vf lim = (vf){0} + limit;
    g = vsel(g > lim, lim, g);
    u = vsel(u > lim, lim, vsel(u < -lim, -lim, u));
    return (u + 1.f) * (g / (1.f + vexp(-alpha * g)));
}

/* The GEMM form, for an expert that many tokens meet in a call (a prefill chunk's: ~64 a
 * used expert at 512 tokens of top-8 of 64): tokens across a vector's lanes, TOKENS_B at a
 * time, OUTER_R weight rows widened to float32 once and broadcast (cpu_dot.h's outer_pass,
 * 2 OUTER_R FMAs a step, no horizontal sums), against x^T [k][tokens] (up) and the
 * activations stored transposed by the up phase (down). The 4-token dot tiles widen each
 * weight again for each 4 tokens and sum each dot across lanes: ~half of the FMA pipes'
 * rate on the 2-core EPYC; this, ~65-70% of it (the bench layer at 2048 tokens, 2 threads:
 * 98-100 -> 136-144 GFLOP/s). 16-bit, fp8 and int4 banks, each panel's rows decoded once as
 * the reference decodes them (widen_panel). */
#define GEMM_TOKENS 16                      /* an expert's tokens from which it takes it */
#define TOKENS_B (OUTER_V * VW)

static inline int64_t gemm_tokens(int64_t n) { return (n + TOKENS_B - 1) / TOKENS_B * TOKENS_B; }

/* Whether an expert of n tokens takes the GEMM form: from GEMM_TOKENS, where its blocks'
 * padding costs less than its ~1.35x the tiles' rate (17 tokens in 2 blocks of 16 would). */
static inline int gemm_expert(int fmt, int64_t n) {
    return (fmt == 0 || fmt == 1 || fmt == FT_E4M3 || is_int4(fmt)) && n >= GEMM_TOKENS
        && 10 * gemm_tokens(n) <= 13 * n;
}

/* One expert's weight [N, K] as the GEMM form reads it: 16-bit rows; e4m3 bytes with their
 * scales (block (bn, bk): [ceil(N / bn), cb] float32; bk 0: one a row); or int4 nibbles
 * [N, K / 2] with each row's cb group scales (fmt's, groups of 2^gshift). */
struct expert_rows {
    const void *w;
    int fmt;
    const void *scales;
    int64_t k, bn, bk, cb;
    int gshift;
};

/* 2 VW int4 weights of one group in order (load_int4's even and odd ones interleaved). */
static inline void int4_values(const uint8_t *p, float s, float m, float *dst) {
    vf lo, hi;
    load_int4(p, s, m, &lo, &hi);
#if VW == 16
    const vf a = __builtin_shufflevector(lo, hi, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22,
                                         7, 23);
    const vf b = __builtin_shufflevector(lo, hi, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29,
                                         14, 30, 15, 31);
#else
    const vf a = __builtin_shufflevector(lo, hi, 0, 8, 1, 9, 2, 10, 3, 11);
    const vf b = __builtin_shufflevector(lo, hi, 4, 12, 5, 13, 6, 14, 7, 15);
#endif
    memcpy(dst, &a, sizeof a);
    memcpy(dst + VW, &b, sizeof b);
}

/* An e4m3 byte's value, exactly (its bits in float16's places hold 1/256 of it; e4m3fn's nan
 * 0x7f reads 480, as the dot tiles read it). */
static inline float e4m3_value(uint8_t b) {
    const uint16_t h = (uint16_t)(((b & 0x80u) << 8) | ((b & 0x7fu) << 7));
    _Float16 v;
    memcpy(&v, &h, sizeof v);
    return (float)v * 256.f;
}

/* VW e4m3 bytes' values in order, exactly (the dot tiles' FT_F8L decode gives another
 * order). */
static inline vf e4m3_values(const uint8_t *p) { return e4m3_f16_places(p) * 256.f; }

/* Rows row .. row + nr - 1 of an expert's weight widened to float32 (fp8: times their
 * scales, one rounding, as the reference decodes them) into dst [OUTER_R][k], rows past nr
 * zeros. */
static void widen_panel(const struct expert_rows *e, int64_t row, int nr, float *dst) {
    const int64_t k = e->k;
    for (int r = 0; r < OUTER_R; r++) {
        float *d = dst + r * k;
        if (r >= nr) {
            memset(d, 0, k * sizeof *d);
            continue;
        }
        if (is_int4(e->fmt)) {      /* (groups of 2 VW and more: the kernel's checks) */
            const uint8_t *src = row_at(e->w, row + r, k, e->fmt);
            const void *gs = int4_row_scales(e->scales, row + r, e->cb, e->fmt);
            for (int64_t j = 0; j < k; j += 2 * VW) {
                float sc, m;
                int4_sm(gs, j >> e->gshift, e->fmt, &sc, &m);
                int4_values(src + j / 2, sc, m, d + j);
            }
            continue;
        }
        if (e->fmt == FT_E4M3) {
            const uint8_t *src = (const uint8_t *)e->w + (row + r) * k;
            const int64_t step = e->bk ? e->bk : k;
            for (int64_t k0 = 0; k0 < k; k0 += step) {
                const int64_t k1 = k0 + step < k ? k0 + step : k;
                const float *scales = e->scales;
                const float sc = e->bk ? scales[(row + r) / e->bn * e->cb + k0 / e->bk]
                                       : scales[row + r];
                int64_t j = k0;
                for (; j + VW <= k1; j += VW) {
                    const vf f = e4m3_values(src + j) * sc;
                    memcpy(d + j, &f, sizeof f);
                }
                for (; j < k1; j++)
                    d[j] = e4m3_value(src[j]) * sc;
            }
            continue;
        }
        const uint16_t *src = (const uint16_t *)e->w + (row + r) * k;
        int64_t j = 0;
        for (; j + VW <= k; j += VW) {
            const vf f = load_w(src + j, e->fmt);
            memcpy(d + j, &f, sizeof f);
        }
        for (; j < k; j++)
            d[j] = scalar_w(src + j, e->fmt);
    }
}

/* The up phase's rows i0..i1 of expert s (w13s: its [2I, D] rows) for its n tokens (x^T
 * xt [np / TOKENS_B][d][TOKENS_B], zeros past n): act_t [np / TOKENS_B][I][TOKENS_B] of the
 * activations, transposed the same way. */
static void gemm_up(const struct expert_rows *w13s, const float *b13s, const float *xt,
                    int64_t np, int64_t d, int64_t width, int64_t i0, int64_t i1, int kind,
                    float alpha, float limit, float *panel, float *act_t) {
    float *wg = panel, *wu = panel + OUTER_R * d;
    float g[OUTER_R * TOKENS_B] __attribute__((aligned(64)));
    float u[OUTER_R * TOKENS_B] __attribute__((aligned(64)));
    for (int64_t i = i0; i < i1; i += OUTER_R) {
        const int nr = i1 - i < OUTER_R ? (int)(i1 - i) : OUTER_R;
        widen_panel(w13s, i, nr, wg);
        widen_panel(w13s, width + i, nr, wu);
        for (int64_t t0 = 0; t0 < np; t0 += TOKENS_B) {
            outer_pass(wg, d, 1, xt + t0 * d, TOKENS_B, d, g, TOKENS_B, NULL);
            outer_pass(wu, d, 1, xt + t0 * d, TOKENS_B, d, u, TOKENS_B, NULL);
            for (int r = 0; r < nr; r++)
                for (int v = 0; v < OUTER_V; v++) {
                    vf gv, uv;
                    memcpy(&gv, g + r * TOKENS_B + v * VW, sizeof gv);
                    memcpy(&uv, u + r * TOKENS_B + v * VW, sizeof uv);
                    if (b13s) {
                        gv += b13s[i + r];
                        uv += b13s[width + i + r];
                    }
                    const vf a = activate_v(gv, uv, kind, alpha, limit);
                    memcpy(act_t + t0 * width + (i + r) * TOKENS_B + v * VW, &a, sizeof a);
                }
        }
    }
}

/* The down phase's output rows r0..r1 for expert s (w2s: its [D, I] rows; b2s its bias or
 * NULL) over its n tokens (mine: their pairs; act_t as gemm_up leaves it): each token's
 * weighted sums added into its row of acc [T, D]. */
static void gemm_down(const struct expert_rows *w2s, const float *b2s, const float *act_t,
                      int64_t n, const int64_t *mine, int64_t k_count,
                      const float *wts, int64_t d, int64_t width, int64_t r0, int64_t r1,
                      float *panel, float *acc) {
    float res[OUTER_R * TOKENS_B] __attribute__((aligned(64)));
    for (int64_t r = r0; r < r1; r += OUTER_R) {
        const int nr = r1 - r < OUTER_R ? (int)(r1 - r) : OUTER_R;
        widen_panel(w2s, r, nr, panel);
        for (int64_t t0 = 0; t0 < n; t0 += TOKENS_B) {
            outer_pass(panel, width, 1, act_t + t0 * width, TOKENS_B, width, res, TOKENS_B,
                       NULL);
            for (int64_t t = t0; t < n && t < t0 + TOKENS_B; t++) {
                float *sum = acc + (mine[t] / k_count) * d + r;
                const float wt = wts[mine[t]];
                for (int q = 0; q < nr; q++)
                    sum[q] += wt * (res[q * TOKENS_B + t - t0] + (b2s ? b2s[r + q] : 0.f));
            }
        }
    }
}

int ft_moe(const void *x, int xfmt, const int64_t *ids, const int64_t *slot_map, int64_t n_map,
           const float *wts,
           int64_t t_count, int64_t k_count, const void *w13, const void *w2,
           const void *s13, const void *s2, int64_t bn, int64_t bk,
           const float *b13, const float *b2, int64_t slots, int64_t d, int64_t width,
           int fmt, int kind, float alpha, float limit, int threads, float *act, float *acc,
           void *out, int ofmt) {
    /* fp8: the scales of row block rb and column block cb of an expert's w13 and w2 (row
     * scales, bk 0: one a row, see fp8_rows) */
    const int64_t rb13 = (2 * width + bn - 1) / bn, cb13 = bk ? (d + bk - 1) / bk : 1;
    const int64_t rb2 = (d + bn - 1) / bn, cb2 = bk ? (width + bk - 1) / bk : 1;
    /* int4: the group's log2 (bk = G) */
    const int gshift = is_int4(fmt) ? __builtin_ctzll((unsigned long long)bk) : 0;
    if ((is_int4(fmt) && (bk < 2 * VW || (bk & (bk - 1)) || d % bk || width % bk))
        || fmt == FT_INT8 || (fmt == FT_E4M3 && (!s13 || !s2)))
        return -3;                          /* (int8: the native GEMV's alone) */
    /* int4 in a prepared form where the CPU has one (cpu_dot.h's i4x: 16-bit activations
     * rounded to int16 per group, AVX512-VNNI's byte products or AVX2's pair products) */
    const int i4x = is_int4(fmt) && i4x_takes(d, gshift, xfmt) && i4x_takes(width, gshift, 0);
    const int64_t pairs = t_count * k_count;
    /* The pairs by slot (counting sort, stable: a slot's pairs in (token, k) order). */
    int64_t *start = calloc(slots + 1, sizeof *start);
    int64_t *order = malloc((pairs ? pairs : 1) * sizeof *order);
    int64_t *used = malloc((slots ? slots : 1) * sizeof *used);
    if (!start || !order || !used) {
        free(start), free(order), free(used);
        return -1;
    }
    for (int64_t p = 0; p < pairs; p++) {
        if (slot_map && (ids[p] < 0 || ids[p] >= n_map)) {
            free(start), free(order), free(used);
            return -2;
        }
        int64_t s = slot_map ? slot_map[ids[p]] : ids[p];
        if (s < 0 || s >= slots) {
            free(start), free(order), free(used);
            return -2;
        }
        start[s + 1]++;
    }
    int64_t n_used = 0;
    for (int64_t s = 0; s < slots; s++) {
        if (start[s + 1])
            used[n_used++] = s;
        start[s + 1] += start[s];
    }
    {
        int64_t *fill = malloc((slots ? slots : 1) * sizeof *fill);
        if (!fill) {
            free(start), free(order), free(used);
            return -1;
        }
        memcpy(fill, start, slots * sizeof *fill);
        for (int64_t p = 0; p < pairs; p++) {
            int64_t s = slot_map ? slot_map[ids[p]] : ids[p];
            order[fill[s]++] = p;
        }
        free(fill);
    }
    /* x widened to float32 (wide), in the weight format's order (xp: paired_fmt's);
     * i4x: x and the activations in its form (xb and x2, actb and a2) instead. */
    const int64_t gx = i4x ? 2 * (d >> gshift) : 0, ga = i4x ? 2 * (width >> gshift) : 0;
    const int64_t tc = t_count ? t_count : 1, pc = pairs ? pairs : 1;
    const int64_t copies = paired_fmt(fmt) && !i4x ? 2 : 1;        /* wide, and xp apart */
    float *wide = malloc(copies * tc * d * sizeof *wide
                         + (i4x ? tc * gx + pc * ga : 0) * sizeof *wide
                         + (i4x ? (tc * d + pc * width) * sizeof(uint16_t) : 0));
    float *xp = copies == 2 ? wide + t_count * d : wide;
    float *x2 = wide + copies * tc * d, *a2 = x2 + tc * gx;
    uint16_t *xb = (uint16_t *)(a2 + pc * ga), *actb = xb + tc * d;
    if (!wide) {
        free(start), free(order), free(used);
        return -1;
    }
    /* The most loaded experts first: the items are taken in order, so the big ones do not
     * come last and leave a thread idle at the barrier (a prefill chunk's routing is
     * skewed). Insertion sort, stable: n_used is at most the slots. */
    for (int64_t a = 1; a < n_used; a++) {
        int64_t s = used[a], n = start[s + 1] - start[s], b = a;
        for (; b > 0 && start[used[b - 1] + 1] - start[used[b - 1]] < n; b--)
            used[b] = used[b - 1];
        used[b] = s;
    }
    /* The GEMM form's experts: each one's transposed activations (gemm_up's) in act_t from
     * t_at[s] on; xt_most: the largest x^T a thread builds. */
    int64_t *t_at = malloc((slots ? slots : 1) * sizeof *t_at), t_total = 0, xt_most = 0;
    if (!t_at) {
        free(wide), free(start), free(order), free(used);
        return -1;
    }
    for (int64_t u = 0; u < n_used; u++) {
        const int64_t s = used[u], n = start[s + 1] - start[s];
        t_at[s] = t_total;
        if (gemm_expert(fmt, n)) {
            t_total += width * gemm_tokens(n);      /* (a multiple of 16 floats: aligned) */
            xt_most = d * gemm_tokens(n) > xt_most ? d * gemm_tokens(n) : xt_most;
        }
    }
    /* and each thread's x^T and widened rows after them */
    const int64_t own_floats = (xt_most + 2 * OUTER_R * (d > width ? d : width) + 15) / 16 * 16;
    float *act_t = t_total ? aligned_alloc(64, (t_total + threads * own_floats) * sizeof(float))
                           : NULL;
    if (t_total && !act_t) {
        free(t_at), free(wide), free(start), free(order), free(used);
        return -1;
    }
    /* Rows per item: long streams, but 4 items a thread or more to share out. */
    const int64_t up_rows = item_rows(n_used * width, threads);
    const int64_t down_rows = item_rows(d, threads);
    const int64_t i_blocks = (width + up_rows - 1) / up_rows, d_blocks = (d + down_rows - 1) / down_rows;
    int64_t next_up = 0, next_down = 0;     /* work items taken (shared counters) */
    int failed = 0, team = 0;               /* fp8: threads without scratch, of the team */

#pragma omp parallel num_threads(threads)
    {
        /* fp8: this thread's x and activations scaled by a row block's column scales, and
         * on FT_F8H those in float16 (fp8_rows) */
        const int scaled_x = fmt == FT_E4M3 && bk;     /* (row scales: on the sums) */
        const int f8h = FT_F8H && fmt == FT_E4M3;
        float *xsc = scaled_x ? malloc(MAXT * (d > width ? d : width) * sizeof *xsc) : NULL;
        _Float16 *xh = f8h ? malloc(MAXT * (d > width ? d : width) * sizeof *xh) : NULL;
        float xinv[MAXT];
        /* A thread without them takes no items (the others take them all). */
        const int idle = (scaled_x && !xsc) || (f8h && !xh);
        /* fp8 on FT_F8L: an item's rows of an expert with many tokens decoded once to bf16
         * words (dec, taken at the first such item: a call without one allocates nothing),
         * each pass then a bf16 tile on them (f8l_decodes). Without the scratch, every pass
         * decodes (the same products, summed in another order of chains). */
        uint16_t *dec = NULL;
        int dec_tried = 0;
        /* the GEMM form's x^T and widened rows */
        float *xt = act_t ? act_t + t_total + omp_get_thread_num() * own_floats : NULL;
        float *panel = xt ? xt + xt_most : NULL;
        const int64_t dec_words = 2 * up_rows * d > down_rows * width ? 2 * up_rows * d
                                                                     : down_rows * width;
        if (idle)
            __atomic_fetch_add(&failed, 1, __ATOMIC_RELAXED);
#pragma omp single nowait
        team = omp_get_num_threads();
        widen_rows(x, xfmt, t_count, d, fmt, wide, xp, gshift, i4x ? xb : NULL, x2);
        /* the down phase's x as permute_row gives x (fp8 on FT_F8L: times 2^64) */
        const float xunit = fmt == FT_E4M3 ? E4M3_XUNIT : 1.f;
        /* Up: item = (used expert, up_rows gate rows and their up rows). */
        for (;;) {
            int64_t item = idle ? n_used * i_blocks : __atomic_fetch_add(&next_up, 1, __ATOMIC_RELAXED);
            if (item >= n_used * i_blocks)
                break;
            int64_t s = used[item / i_blocks], i0 = (item % i_blocks) * up_rows;
            int64_t i1 = i0 + up_rows < width ? i0 + up_rows : width;
            const int64_t *mine = order + start[s];
            int64_t n = start[s + 1] - start[s];
            if (gemm_expert(fmt, n)) {
                const int64_t np = gemm_tokens(n);
                /* x^T in blocks of TOKENS_B tokens, [np / TOKENS_B][d][TOKENS_B]: each
                 * block's loads one stream (strided over [d][np], each a line of its own) */
                for (int64_t t0 = 0; t0 < np; t0 += TOKENS_B) {
                    const float *src[TOKENS_B];
                    for (int t = 0; t < TOKENS_B; t++)
                        src[t] = t0 + t < n ? wide + (mine[t0 + t] / k_count) * d : NULL;
                    float *dst = xt + t0 * d;
                    for (int64_t k = 0; k < d; k++)
                        for (int t = 0; t < TOKENS_B; t++)
                            dst[k * TOKENS_B + t] = src[t] ? src[t][k] : 0.f;
                }
                const struct expert_rows rows = {
                    row_at(w13, s * 2 * width, d, fmt), fmt,
                    fmt == FT_E4M3 ? (const float *)s13 + s * rb13 * cb13
                    : is_int4(fmt) ? int4_row_scales(s13, s * 2 * width, cb13, fmt) : NULL,
                    d, bn, bk, cb13, gshift};
                gemm_up(&rows, b13 ? b13 + s * 2 * width : NULL, xt, np, d, width, i0, i1, kind,
                        alpha, limit, panel, act_t + t_at[s]);
                continue;
            }
            /* The gate rows, then the up rows: one sequential stream at a time (two rows
             * read side by side, 2 * I rows apart, halved the cold bandwidth). */
            for (int64_t t0 = 0; t0 < n; t0 += MAXT) {
                int nt = n - t0 < MAXT ? (int)(n - t0) : MAXT;
                const float *xs[MAXT], *xs2[MAXT];
                const uint16_t *xsb[MAXT];
                for (int t = 0; t < nt; t++) {
                    xs[t] = xp + (mine[t0 + t] / k_count) * d;
                    xsb[t] = xb + (mine[t0 + t] / k_count) * d;
                    xs2[t] = x2 + (mine[t0 + t] / k_count) * gx;
                }
                float g[ROWS][MAXT], u[ROWS][MAXT];
                const int decoded = f8l_decodes(fmt, n, d)
                                    && f8l_scratch(&dec, &dec_tried, dec_words);
                for (int half = 0; half < 2; half++) {
                    float (*res)[MAXT] = half ? u : g;
                    int64_t block = -1;             /* fp8: the row block xsc is scaled for */
                    const float *xv[MAXT];
                    for (int t = 0; t < nt; t++)
                        xv[t] = xs[t];
                    for (int64_t i = i0; i < i1;) {
                        int64_t row = half * width + i;           /* the expert's w13 row */
                        int nr = tile_at(i, i1, MAXR);
                        if (fmt == FT_E4M3)
                            nr = fp8_rows(row, nr, bn, bk, &block, xs, xv, nt, xsc, xh, xinv,
                                          d, (const float *)s13 + s * rb13 * cb13, cb13);
                        const void *w[MAXR];
                        const void *gs[MAXR];
                        for (int r = 0; r < nr; r++) {
                            w[r] = row_at(w13, s * 2 * width + row + r, d, fmt);
                            gs[r] = is_int4(fmt) ? int4_row_scales(s13, s * 2 * width + row + r,
                                                                   cb13, fmt) : NULL;
                        }
                        if (decoded)
                            f8l_rows(w, nr, dec + (half * up_rows + i - i0) * d, d, t0 == 0);
                        if (i4x)
                            i4x_dots(w, gs, gshift, xsb, xs2, d, nr, nt, fmt, res[i - i0]);
                        else if (f8h)
                            f8h_dots(w, xh, xinv, d, nr, nt, t0 == 0, res[i - i0]);
                        else if (decoded)
                            dots(w, gs, gshift, xv, (int)d, nr, nt, 0, 0, res[i - i0]);
                        else
                            dots(w, gs, gshift, xv, (int)d, nr, nt, fmt, t0 == 0,
                                 res[i - i0]);
                        if (fmt == FT_E4M3)     /* row scales, and E4M3_SUM: on the sums */
                            for (int r = 0; r < nr; r++) {
                                const float sc = row_scale(fmt, (const float *)s13 + s * 2 * width,
                                                           bk, row + r);
                                for (int t = 0; t < nt; t++)
                                    res[i - i0 + r][t] *= sc;
                            }
                        i += nr;
                    }
                }
                for (int64_t i = i0; i < i1; i++)
                    for (int t = 0; t < nt; t++) {
                        float gi = g[i - i0][t], ui = u[i - i0][t];
                        if (b13) {
                            gi += b13[s * 2 * width + i];
                            ui += b13[s * 2 * width + width + i];
                        }
                        act[mine[t0 + t] * width + (i4x ? i : paired_index(i, width, fmt))] =
                            activate(gi, ui, kind, alpha, limit) * xunit;
                    }
            }
        }
#pragma omp barrier
        if (i4x) {                  /* (the GEMM form's experts: their act_t as it is) */
#pragma omp for schedule(static)
            for (int64_t p = 0; p < pairs; p++) {
                const int64_t s = slot_map ? slot_map[ids[p]] : ids[p];
                if (!gemm_expert(fmt, start[s + 1] - start[s]))
                    i4x_prepare(act + p * width, width, gshift, fmt, actb + p * width,
                                a2 + p * ga);
            }
        }
        /* Down: item = down_rows output rows of every token, summed over its experts by slot. */
        for (;;) {
            int64_t item = idle ? d_blocks : __atomic_fetch_add(&next_down, 1, __ATOMIC_RELAXED);
            if (item >= d_blocks)
                break;
            int64_t r0 = item * down_rows, r1 = r0 + down_rows < d ? r0 + down_rows : d;
            for (int64_t t = 0; t < t_count; t++)
                memset(acc + t * d + r0, 0, (r1 - r0) * sizeof *acc);
            for (int64_t u = 0; u < n_used; u++) {
                int64_t s = used[u];
                const int64_t *mine = order + start[s];
                int64_t n = start[s + 1] - start[s];
                if (gemm_expert(fmt, n)) {
                    const struct expert_rows rows = {
                        row_at(w2, s * d, width, fmt), fmt,
                        fmt == FT_E4M3 ? (const float *)s2 + s * rb2 * cb2
                        : is_int4(fmt) ? int4_row_scales(s2, s * d, cb2, fmt) : NULL,
                        width, bn, bk, cb2, gshift};
                    gemm_down(&rows, b2 ? b2 + s * d : NULL, act_t + t_at[s], n, mine, k_count,
                              wts, d, width, r0, r1, panel, acc);
                    continue;
                }
                for (int64_t t0 = 0; t0 < n; t0 += MAXT) {
                    int nt = n - t0 < MAXT ? (int)(n - t0) : MAXT;
                    const float *hs[MAXT], *hv[MAXT], *hs2[MAXT];
                    const uint16_t *hsb[MAXT];
                    float *sum[MAXT], wt[MAXT];     /* each token's output row and weight */
                    for (int t = 0; t < nt; t++) {
                        hv[t] = hs[t] = act + mine[t0 + t] * width;
                        hsb[t] = actb + mine[t0 + t] * width;
                        hs2[t] = a2 + mine[t0 + t] * ga;
                        sum[t] = acc + (mine[t0 + t] / k_count) * d;
                        wt[t] = wts[mine[t0 + t]];
                    }
                    const int decoded = f8l_decodes(fmt, n, width)
                                        && f8l_scratch(&dec, &dec_tried, dec_words);
                    int64_t block = -1;             /* fp8: the row block xsc is scaled for */
                    for (int64_t r = r0; r < r1;) {
                        int nr = tile_at(r, r1, MAXR);
                        if (fmt == FT_E4M3)
                            nr = fp8_rows(r, nr, bn, bk, &block, hs, hv, nt, xsc, xh, xinv,
                                          width, (const float *)s2 + s * rb2 * cb2, cb2);
                        const void *w[MAXR];
                        const void *gs[MAXR];
                        for (int q = 0; q < nr; q++) {
                            w[q] = row_at(w2, s * d + r + q, width, fmt);
                            gs[q] = is_int4(fmt) ? int4_row_scales(s2, s * d + r + q, cb2, fmt)
                                                 : NULL;
                        }
                        if (decoded)
                            f8l_rows(w, nr, dec + (r - r0) * width, width, t0 == 0);
                        float res[MAXR * MAXT];
                        if (i4x)
                            i4x_dots(w, gs, gshift, hsb, hs2, width, nr, nt, fmt, res);
                        else if (f8h)
                            f8h_dots(w, xh, xinv, width, nr, nt, t0 == 0, res);
                        else if (decoded)
                            dots(w, gs, gshift, hv, (int)width, nr, nt, 0, 0, res);
                        else
                            dots(w, gs, gshift, hv, (int)width, nr, nt, fmt, t0 == 0, res);
                        /* (the row's scale and bias, each token's row and weight, out of the
                         * loop: a prefill chunk's down phase spent as long here, a division
                         * and products an element, as in its dot products) */
                        for (int q = 0; q < nr; q++) {
                            const float sc = fmt == FT_E4M3
                                ? row_scale(fmt, (const float *)s2 + s * d, bk, r + q) : 1.f;
                            const float bias = b2 ? b2[s * d + r + q] : 0.f;
                            for (int t = 0; t < nt; t++)
                                sum[t][r + q] += wt[t] * (res[q * MAXT + t] * sc + bias);
                        }
                        r += nr;
                    }
                }
            }
            for (int64_t t = 0; t < t_count; t++)
                for (int64_t r = r0; r < r1; r++)
                    store_as(out, t * d + r, round_to(acc[t * d + r], ofmt), ofmt);
        }
        free(xsc);
        free(xh);
        free(dec);
    }
    free(act_t), free(t_at);
    free(wide);
    free(start), free(order), free(used);
    return failed && failed == team ? -1 : 0;
}

/* Experts of an int4 bank decoded to bf16, for a prefill chunk's AMX products: out[i] =
 * expert idx[i] of q [E, N, K/2] with its group scales gs in fmt (FT_INT4: pairs [E, N, K/G,
 * 2] float32; FT_INT4S: [E, N, K/G] bf16; W = q s + m, the reference's float32 value),
 * rounded to bf16 (nearest even) in element order. G a power of two from 2 * VW. Rows shared
 * among the threads. */
void ft_int4_decode(const uint8_t *q, const void *gs, int fmt, const int64_t *idx,
                    int64_t n_idx, int64_t n, int64_t k, int64_t g, uint16_t *out, int threads) {
    const int gshift = __builtin_ctzll((unsigned long long)g);
    const int64_t rows = n_idx * n;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t e = idx[r / n], row = e * n + r % n;
        const uint8_t *src = q + row * (k / 2);
        const void *scales = int4_row_scales(gs, row, k >> gshift, fmt);
        uint16_t *dst = out + r * k;
        int64_t j = 0;
        for (; j + 2 * VW <= k; j += 2 * VW) {
            vf lo, hi;                              /* elements j + 2i and j + 2i + 1 */
            float s, m;
            int4_sm(scales, j >> gshift, fmt, &s, &m);
            load_int4(src + j / 2, s, m, &lo, &hi);
            vu32 a, b;
            memcpy(&a, &lo, sizeof a);
            memcpy(&b, &hi, sizeof b);
            a += 0x7fffu + ((a >> 16) & 1u);        /* nearest even; the values are finite */
            b += 0x7fffu + ((b >> 16) & 1u);
            vu32 both = (a >> 16) | (b & 0xffff0000u);     /* one lane: elements 2i, 2i + 1 */
            memcpy(dst + j, &both, sizeof both);
        }
        for (; j < k; j++) {
            float f = scalar_int4(src, j, scales, gshift, fmt);
            uint32_t u;
            memcpy(&u, &f, sizeof u);
            u += 0x7fffu + ((u >> 16) & 1u);
            dst[j] = (uint16_t)(u >> 16);
        }
    }
}
