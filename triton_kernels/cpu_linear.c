/* A dense projection on the CPU for a few rows (decode): out [T, N] = x [T, K] @ w [N, K]^T
 * (+ bias [N]), the 16-bit weight read as it is, on all of OpenMP's threads.
 *
 * Built with cpu_moe.c into one library (cpu_native.py) and called through ctypes on torch's
 * OpenMP pool. Why: at one row a projection is a stream of its weight's bytes; torch's bf16
 * product reads it at 13-16 GB/s and FBGEMM's fp16 one at 19-21 (a 2-core Xeon, [1024, 1024]
 * to [32768, 1024]), and each costs two dtype copies of x and y beside it. Here the weight
 * rows are shared among the threads in long sequential items (cpu_dot.h's tiles), x is
 * widened once inside the call and y written in its dtype.
 *
 * Formats: w 0 bf16, 1 fp16, 3 fp8 e4m3 (scales [ceil(N/bn), ceil(K/bk)] f32, the scale of
 * each (bn, bk) block, applied to x per row block as cpu_moe.c does; or (bn, bk) (1, 0):
 * scales [N], a row's own, applied to its sum), 6 int8 (scales [N], (bn, bk) (1, 0): the
 * same), 4 and 5 int4 ([N, K/2]
 * nibbles; scales [N, K/G, 2] f32, each group's (scale, -zero * scale), or 5: [N, K/G] bf16,
 * zero point 8; G = bk a power of two from 2 * VW dividing K); else scales NULL; x and out
 * 0 bf16, 1 fp16, 2 float32. Each output is one dot product summed in a fixed order (vector
 * lanes, then across them), plus the bias, rounded once to out's format (nearest even): the
 * same bits on any thread count.
 */
#include "cpu_dot.h"

int ft_linear(const void *x, int xfmt, int64_t t_count, const void *w, int wfmt,
              const void *scales, int64_t bn, int64_t bk,
              const float *bias, int64_t n, int64_t k, void *out, int ofmt, int threads) {
    const int gshift = is_int4(wfmt) ? __builtin_ctzll((unsigned long long)bk) : 0;
    if ((is_int4(wfmt) && (bk < 2 * VW || (bk & (bk - 1)) || k % bk))
        || (byte_fmt(wfmt) && !scales) || (wfmt == FT_INT8 && (bn != 1 || bk)))
        return -3;
    /* x widened to float32 (wide), then each row in the weight format's order (paired_index);
     * int4 in a prepared form where the CPU has one instead (cpu_dot.h's i4x: xb, x2). */
    const int i4x = is_int4(wfmt) && i4x_takes(k, gshift, xfmt);
    const int64_t tc = t_count ? t_count : 1, gx = i4x ? 2 * (k >> gshift) : 0;
    const int64_t copies = paired_fmt(wfmt) && !i4x ? 2 : 1;       /* wide, and xp apart */
    float *wide = malloc(copies * tc * k * sizeof *wide + tc * gx * sizeof *wide
                         + (i4x ? tc * k * sizeof(uint16_t) : 0));
    if (!wide)
        return -1;
    float *xp = copies == 2 ? wide + t_count * k : wide;
    float *x2 = wide + copies * tc * k;
    uint16_t *xb = (uint16_t *)(x2 + tc * gx);
    const int64_t rows = item_rows(n, threads);
    const int64_t items = (n + rows - 1) / rows;
    /* fp8: column blocks of a row block's scales (row scales: none, see fp8_rows) */
    const int64_t cb = bk ? (k + bk - 1) / bk : 0;
    int64_t next = 0;                       /* work items taken (a shared counter) */
    int failed = 0, team = 0;               /* fp8: threads without scratch, of the team */

#pragma omp parallel num_threads(threads)
    {
        /* fp8: this thread's x scaled by a row block's column scales, and on FT_F8H that
         * in float16 (fp8_rows) */
        const int scaled_x = wfmt == FT_E4M3 && bk, f8h = FT_F8H && wfmt == FT_E4M3;
        float *xsc = scaled_x ? malloc(MAXT * k * sizeof *xsc) : NULL;
        _Float16 *xh = f8h ? malloc(MAXT * k * sizeof *xh) : NULL;
        float xinv[MAXT];
        const int idle = (scaled_x && !xsc) || (f8h && !xh);
        if (idle)
            __atomic_fetch_add(&failed, 1, __ATOMIC_RELAXED);
#pragma omp single nowait
        team = omp_get_num_threads();
        widen_rows(x, xfmt, t_count, k, wfmt, wide, xp, gshift, i4x ? xb : NULL, x2);
        /* item = `rows` weight rows, for every token, MAXR of them at a time */
        for (;;) {
            /* a thread without its scratch takes no items (the others take them all) */
            int64_t item = idle ? items : __atomic_fetch_add(&next, 1, __ATOMIC_RELAXED);
            if (item >= items)
                break;
            int64_t r0 = item * rows, r1 = r0 + rows < n ? r0 + rows : n;
            for (int64_t t0 = 0; t0 < t_count; t0 += MAXT) {
                int nt = t_count - t0 < MAXT ? (int)(t_count - t0) : MAXT;
                const float *xs[MAXT], *xs2[MAXT];
                const uint16_t *xsb[MAXT];
                for (int t = 0; t < nt; t++) {
                    xs[t] = xp + (t0 + t) * k;
                    xsb[t] = xb + (t0 + t) * k;
                    xs2[t] = x2 + (t0 + t) * gx;
                }
                int64_t block = -1;                 /* fp8: the row block xsc is scaled for */
                const float *xv[MAXT];
                for (int t = 0; t < nt; t++)
                    xv[t] = xs[t];
                for (int64_t r = r0; r < r1;) {
                    int nr = tile_at(r, r1, MAXR);
                    if (wfmt == FT_E4M3)
                        nr = fp8_rows(r, nr, bn, bk, &block, xs, xv, nt, xsc, xh, xinv, k, scales,
                                      cb);
                    const void *ws[MAXR];
                    const void *gs[MAXR];
                    for (int q = 0; q < nr; q++) {
                        ws[q] = row_at(w, r + q, k, wfmt);
                        gs[q] = is_int4(wfmt) ? int4_row_scales(scales, r + q, k >> gshift, wfmt)
                                              : NULL;
                    }
                    float res[MAXR * MAXT];
                    if (i4x)
                        i4x_dots(ws, gs, gshift, xsb, xs2, k, nr, nt, wfmt, res);
                    else if (f8h)
                        f8h_dots(ws, xh, xinv, k, nr, nt, t0 == 0, res);
                    else
                        dots(ws, gs, gshift, xv, (int)k, nr, nt, wfmt, t0 == 0, res);
                    for (int q = 0; q < nr; q++) {
                        const float sc = row_scale(wfmt, scales, bk, r + q);
                        for (int t = 0; t < nt; t++)
                            store_as(out, (t0 + t) * n + r + q,
                                     round_to(res[q * MAXT + t] * sc + (bias ? bias[r + q] : 0.f),
                                              ofmt), ofmt);
                    }
                    r += nr;
                }
            }
        }
        free(xsc);
        free(xh);
    }
    free(wide);
    return failed && failed == team ? -1 : 0;
}

/* How the int4 products meet 16-bit activations on this build (cpu_dot.h's i4x): 0 widened
 * to float32 as they are, 2 rounded to int16 per group (AVX512-VNNI's i4v, AVX2's i4w). */
int ft_int4_activations(void) { return FT_I4V || FT_I4W ? 2 : 0; }

/* How this build widens e4m3 weights (cpu_dot.h): 0 through float16 (vcvtph2ps, or the
 * compiler's conversion), 1 AVX2's byte tables (FT_F8L), 2 AVX2's shifts (FT_F8L_SHIFT), 3
 * float16 products with float16 activations at decode's few rows (FT_F8H, AVX512-FP16). */
int ft_e4m3_decode(void) { return FT_F8H ? 3 : FT_F8L_SHIFT ? 2 : FT_F8L ? 1 : 0; }
