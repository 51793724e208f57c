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
 * Formats: w 0 bf16, 1 fp16; x and out 0 bf16, 1 fp16, 2 float32. Each output is one dot
 * product summed in a fixed order (vector lanes, then across them), plus the bias, rounded
 * once to out's format (nearest even): the same bits on any thread count.
 */
#include "cpu_dot.h"

int ft_linear(const void *x, int xfmt, int64_t t_count, const uint16_t *w, int wfmt,
              const float *bias, int64_t n, int64_t k, void *out, int ofmt, int threads) {
    /* x widened to float32 (wide), then each row in the weight format's order (paired_index). */
    float *wide = malloc(2 * (t_count ? t_count : 1) * k * sizeof *wide);
    if (!wide)
        return -1;
    float *xp = wfmt == 0 ? wide + t_count * k : wide;
    const int64_t rows = item_rows(n, threads);
    const int64_t items = (n + rows - 1) / rows;
    int64_t next = 0;                       /* work items taken (a shared counter) */

#pragma omp parallel num_threads(threads)
    {
        widen_rows(x, xfmt, t_count, k, wfmt, wide, xp);
        /* item = `rows` weight rows, for every token: one sequential stream (one row at a
         * time) below MAXT tokens, MAXR rows sharing each x load from there. */
        for (;;) {
            int64_t item = __atomic_fetch_add(&next, 1, __ATOMIC_RELAXED);
            if (item >= items)
                break;
            int64_t r0 = item * rows, r1 = r0 + rows < n ? r0 + rows : n;
            for (int64_t t0 = 0; t0 < t_count; t0 += MAXT) {
                int nt = t_count - t0 < MAXT ? (int)(t_count - t0) : MAXT;
                const float *xs[MAXT];
                for (int t = 0; t < nt; t++)
                    xs[t] = xp + (t0 + t) * k;
                const int together = nt >= MAXT ? MAXR : 1;
                for (int64_t r = r0; r < r1;) {
                    int nr = r + together <= r1 ? together : 1;
                    const void *ws[MAXR];
                    for (int q = 0; q < nr; q++)
                        ws[q] = w + (r + q) * k;
                    float res[MAXR * MAXT];
                    dots(ws, xs, (int)k, nr, nt, wfmt, res);
                    for (int q = 0; q < nr; q++)
                        for (int t = 0; t < nt; t++)
                            store_as(out, (t0 + t) * n + r + q,
                                     round_to(res[q * MAXT + t] + (bias ? bias[r + q] : 0.f), ofmt),
                                     ofmt);
                    r += nr;
                }
            }
        }
    }
    free(wide);
    return 0;
}
