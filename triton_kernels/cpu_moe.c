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
 *   x [T, D] f32, ids [T, k] i64 (expert ids; slot_map [n_map] i64 maps them to slots, or NULL),
 *   wts [T, k] f32, w13 [S, 2I, D] and w2 [S, D, I] 16-bit (fmt: 0 bf16, 1 fp16), rows
 *   [0, I) of w13 the gate and [I, 2I) the up; b13 [S, 2I] and b2 [S, D] f32 or NULL;
 *   act [P, I] f32 scratch; out [T, D] f32; threads: the team (the caller's torch thread count).
 * Each output element is summed in one fixed order (the k experts of a token by slot, each
 * dot product over K in vector lanes then across them), whatever the thread count.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
#define MAXT 4      /* tokens of one expert per pass over a weight row (in registers) */
#define MAXR 4      /* weight rows per pass, where an expert has MAXT tokens or more */
#define ROWS 128    /* most weight rows per work item: a long sequential stream per item
                     * (16 rows, 32 KB: 15 GB/s cold on 2 threads; 128 rows: 27) */

typedef float vf __attribute__((vector_size(VW * 4)));
typedef uint16_t vu16 __attribute__((vector_size(VW * 2)));
typedef uint32_t vu32 __attribute__((vector_size(VW * 4)));
typedef _Float16 vh __attribute__((vector_size(VW * 2)));

static inline __attribute__((always_inline)) vf load_w(const uint16_t *p, const int fmt) {
    if (fmt == 0) {                        /* bf16: the high half of a float32 */
        vu16 h;
        memcpy(&h, p, sizeof h);
        vu32 w = __builtin_convertvector(h, vu32) << 16;
        vf f;
        memcpy(&f, &w, sizeof f);
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
 * last whole block stay in order. fp16 rows (vcvtph2ps) meet vectors in plain order. */
static inline int64_t paired_index(int64_t j, int64_t k, int fmt) {
    int64_t block = j / (2 * VW), r = j % (2 * VW);
    if (fmt != 0 || (block + 1) * 2 * VW > k)
        return j;
    return block * 2 * VW + (r & 1) * VW + r / 2;
}

/* res[r * MAXT + t] = w[r] . x[t] over k, for NR weight rows and NT tokens (x in the row
 * format's order, see paired_index): each weight vector widened once for the NT tokens.
 * Constant NR, NT and fmt: unrolled, in registers. Where NR * NT >= 8 the even and odd
 * halves share one accumulator (enough chains to hide the FMA's latency, and 16 of
 * AVX-512's 32 registers); below, two. */
static inline __attribute__((always_inline)) void
dot_tile(const uint16_t *const *w, const float *const *x, const int k, const int NR,
         const int NT, const int fmt, float *res) {
    const int C = NR * NT >= 8 ? 1 : 2;
    vf acc[2][MAXR][MAXT];                 /* [chain][row][token] */
    #pragma GCC unroll 4
    for (int c = 0; c < C; c++)
        #pragma GCC unroll 4
        for (int r = 0; r < NR; r++)
            #pragma GCC unroll 4
            for (int t = 0; t < NT; t++)
                acc[c][r][t] = (vf){0};
    int j = 0;
    for (; j + 2 * VW <= k; j += 2 * VW) {
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
            if (fmt == 0) {
                vu32 lanes;
                memcpy(&lanes, w[r] + j, sizeof lanes);
                vu32 a = lanes << 16, b = lanes & 0xffff0000u;
                memcpy(&lo, &a, sizeof lo);
                memcpy(&hi, &b, sizeof hi);
            } else {
                lo = load_w(w[r] + j, 1);
                hi = load_w(w[r] + j + VW, 1);
            }
            #pragma GCC unroll 4
            for (int t = 0; t < NT; t++) {
                acc[0][r][t] += lo * xl[t];
                acc[C - 1][r][t] += hi * xh[t];
            }
        }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < NR; r++)
        #pragma GCC unroll 4
        for (int t = 0; t < NT; t++) {
            float s = hsum(C == 1 ? acc[0][r][t] : acc[0][r][t] + acc[1][r][t]);
            for (int q = j; q < k; q++)
                s += scalar_w(w[r] + q, fmt) * x[t][q];
            res[r * MAXT + t] = s;
        }
}

/* The tile for nr (1 or MAXR) rows and nt (1..MAXT) tokens at run time: one specialised
 * body per shape. */
static void dots(const uint16_t *const *w, const float *const *x, int k, int nr, int nt,
                 int fmt, float *res) {
#define CASE(R, T)                                              \
    if (nr == R && nt == T) {                                   \
        if (fmt == 0) dot_tile(w, x, k, R, T, 0, res);          \
        else dot_tile(w, x, k, R, T, 1, res);                   \
        return;                                                 \
    }
    CASE(1, 1) CASE(1, 2) CASE(1, 3) CASE(1, 4)
    CASE(4, 1) CASE(4, 2) CASE(4, 3) CASE(4, 4)
#undef CASE
}

/* Rows read together for an expert with n tokens: one at a time (one sequential stream, the
 * DRAM-bound decode) below MAXT tokens, MAXR from there (the weights are in cache for the
 * token blocks after the first: compute-bound, and MAXR rows share each x load). */
static inline int rows_together(int64_t n) { return n >= MAXT ? MAXR : 1; }

static inline float activate(float g, float u, int kind, float alpha, float limit) {
    if (kind == 0)                          /* silu(gate) * up */
        return g / (1.f + expf(-g)) * u;
    g = fminf(g, limit);                    /* gpt-oss: clamped, (up + 1) * gate * sigmoid(alpha gate) */
    u = fminf(fmaxf(u, -limit), limit);
    return (u + 1.f) * (g / (1.f + expf(-alpha * g)));
}

/* One row of x in paired order (paired_index): evens then odds of each 2 * VW block. */
static void permute_row(const float *src, float *dst, int64_t k) {
    int64_t j = 0;
    for (; j + 2 * VW <= k; j += 2 * VW)
        for (int q = 0; q < VW; q++) {
            dst[j + q] = src[j + 2 * q];
            dst[j + VW + q] = src[j + 2 * q + 1];
        }
    for (; j < k; j++)
        dst[j] = src[j];
}

static int64_t item_rows(int64_t rows, int64_t threads) {
    int64_t r = rows / (4 * threads) / 16 * 16;
    return r < 16 ? 16 : r > ROWS ? ROWS : r;
}

int ft_moe(const float *x, const int64_t *ids, const int64_t *slot_map, int64_t n_map,
           const float *wts,
           int64_t t_count, int64_t k_count, const uint16_t *w13, const uint16_t *w2,
           const float *b13, const float *b2, int64_t slots, int64_t d, int64_t width,
           int fmt, int kind, float alpha, float limit, int threads, float *act, float *out) {
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
    /* x's rows in the order the weight rows are read (paired_index). */
    float *xp = fmt == 0 ? malloc((t_count ? t_count : 1) * d * sizeof *xp) : (float *)x;
    if (!xp) {
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
    /* Rows per item: long streams, but 4 items a thread or more to share out. */
    const int64_t up_rows = item_rows(n_used * width, threads);
    const int64_t down_rows = item_rows(d, threads);
    const int64_t i_blocks = (width + up_rows - 1) / up_rows, d_blocks = (d + down_rows - 1) / down_rows;
    int64_t next_up = 0, next_down = 0;     /* work items taken (shared counters) */

#pragma omp parallel num_threads(threads)
    {
        if (fmt == 0) {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < t_count; t++)
                permute_row(x + t * d, xp + t * d, d);
        }                                   /* (the for's implicit barrier) */
        /* Up: item = (used expert, up_rows gate rows and their up rows). */
        for (;;) {
            int64_t item = __atomic_fetch_add(&next_up, 1, __ATOMIC_RELAXED);
            if (item >= n_used * i_blocks)
                break;
            int64_t s = used[item / i_blocks], i0 = (item % i_blocks) * up_rows;
            int64_t i1 = i0 + up_rows < width ? i0 + up_rows : width;
            const int64_t *mine = order + start[s];
            int64_t n = start[s + 1] - start[s];
            /* The gate rows, then the up rows: one sequential stream at a time (two rows
             * read side by side, 2 * I rows apart, halved the cold bandwidth). */
            for (int64_t t0 = 0; t0 < n; t0 += MAXT) {
                int nt = n - t0 < MAXT ? (int)(n - t0) : MAXT;
                const float *xs[MAXT];
                for (int t = 0; t < nt; t++)
                    xs[t] = xp + (mine[t0 + t] / k_count) * d;
                float g[ROWS][MAXT], u[ROWS][MAXT];
                const int together = rows_together(n);
                for (int half = 0; half < 2; half++) {
                    float (*res)[MAXT] = half ? u : g;
                    for (int64_t i = i0; i < i1;) {
                        int nr = i + together <= i1 ? together : 1;
                        const uint16_t *w[MAXR];
                        for (int r = 0; r < nr; r++)
                            w[r] = w13 + (s * 2 * width + half * width + i + r) * d;
                        dots(w, xs, (int)d, nr, nt, fmt, res[i - i0]);
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
                        act[mine[t0 + t] * width + paired_index(i, width, fmt)] =
                            activate(gi, ui, kind, alpha, limit);
                    }
            }
        }
#pragma omp barrier
        /* Down: item = down_rows output rows of every token, summed over its experts by slot. */
        for (;;) {
            int64_t item = __atomic_fetch_add(&next_down, 1, __ATOMIC_RELAXED);
            if (item >= d_blocks)
                break;
            int64_t r0 = item * down_rows, r1 = r0 + down_rows < d ? r0 + down_rows : d;
            for (int64_t t = 0; t < t_count; t++)
                memset(out + t * d + r0, 0, (r1 - r0) * sizeof *out);
            for (int64_t u = 0; u < n_used; u++) {
                int64_t s = used[u];
                const int64_t *mine = order + start[s];
                int64_t n = start[s + 1] - start[s];
                for (int64_t t0 = 0; t0 < n; t0 += MAXT) {
                    int nt = n - t0 < MAXT ? (int)(n - t0) : MAXT;
                    const float *hs[MAXT];
                    for (int t = 0; t < nt; t++)
                        hs[t] = act + mine[t0 + t] * width;
                    const int together = rows_together(n);
                    for (int64_t r = r0; r < r1;) {
                        int nr = r + together <= r1 ? together : 1;
                        const uint16_t *w[MAXR];
                        for (int q = 0; q < nr; q++)
                            w[q] = w2 + (s * d + r + q) * width;
                        float res[MAXR * MAXT];
                        dots(w, hs, (int)width, nr, nt, fmt, res);
                        for (int q = 0; q < nr; q++)
                            for (int t = 0; t < nt; t++) {
                                int64_t p = mine[t0 + t];
                                float h = res[q * MAXT + t] + (b2 ? b2[s * d + r + q] : 0.f);
                                out[(p / k_count) * d + r + q] += wts[p] * h;
                            }
                        r += nr;
                    }
                }
            }
        }
    }
    if (xp != x)
        free(xp);
    free(start), free(order), free(used);
    return 0;
}
