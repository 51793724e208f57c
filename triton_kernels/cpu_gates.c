/* The small elementwise steps between a CPU engine's products, each in one call: SwiGLU
 * (dense MLPs and shared experts), the attention output's sigmoid gate (Qwen3-Next/3.5),
 * a shared expert's gated add to the routed experts' output, and the embedding's rows a
 * decode program starts from and its logits' widening to float32 it ends with. Each was two to four torch ops
 * (a few us of dispatch each for a few thousand flops), and as native calls a decode
 * program (cpu_program.c) records them with the products around them.
 *
 * Formats (fmt): 0 bf16, 1 fp16, 2 float32. Each step is rounded to fmt where torch's ops
 * on fmt tensors round (HF's modules): silu(g), its product with u, sigmoid(x), the scaled
 * term, the sum.
 */
#include "cpu_dot.h"

static inline float silu(float x) { return x / (1.f + expf(-x)); }
static inline float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

/* out [T, N] = round(round(silu(g)) u) for x [T, xs] rows holding g at columns [0, N) and
 * u at [N, 2N) (a fused gate/up product's output). */
void ft_silu_mul(const void *x, int fmt, int64_t t_count, int64_t n, int64_t xs, void *out,
                 int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (t_count >= 32)
    for (int64_t t = 0; t < t_count; t++)
        for (int64_t e = 0; e < n; e++) {
            const float g = round_to(silu(load_as(x, t * xs + e, fmt)), fmt);
            store_as(out, t * n + e, round_to(g * load_as(x, t * xs + n + e, fmt), fmt), fmt);
        }
}

/* o [T, H Dh] = round(o round(sigmoid(gate))), head h's gate at g[t gs + h ghs, + Dh) (the
 * q projection's output, each head's gate after its q). */
void ft_sigmoid_gate(void *o, const void *g, int fmt, int64_t t_count, int64_t heads,
                     int64_t dh, int64_t gs, int64_t ghs, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (t_count >= 32)
    for (int64_t t = 0; t < t_count; t++)
        for (int64_t hd = 0; hd < heads; hd++)
            for (int64_t d = 0; d < dh; d++) {
                const int64_t i = (t * heads + hd) * dh + d;
                const float s = round_to(sigmoid(load_as(g, t * gs + hd * ghs + d, fmt)), fmt);
                store_as(o, i, round_to(load_as(o, i, fmt) * s, fmt), fmt);
            }
}

/* h [T, D] = round(h + round(s_t y)), y [T, D]; s_t = round(sigmoid(gl[t gls])) (a shared
 * expert's gate logit), or 1 where gl is NULL (the sum alone). */
void ft_add_gated(void *h, const void *y, const void *gl, int64_t gls, int fmt,
                  int64_t t_count, int64_t d, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (t_count >= 32)
    for (int64_t t = 0; t < t_count; t++) {
        const float s = gl ? round_to(sigmoid(load_as(gl, t * gls, fmt)), fmt) : 1.f;
        for (int64_t e = 0; e < d; e++) {
            const float term = gl ? round_to(s * load_as(y, t * d + e, fmt), fmt)
                                  : load_as(y, t * d + e, fmt);
            store_as(h, t * d + e, round_to(load_as(h, t * d + e, fmt) + term, fmt), fmt);
        }
    }
}

/* In place on rows qkv [T, W] (W >= nq + 2 nk): q = [0, nq) normed across its heads by wq, k
 * = [nq, nq + nk) by wk (ft_rms_norm's arithmetic, row by row: the same bits), where wq is
 * not NULL (OLMoE, MiniMax-M2); then q, k and v = [nq + nk, nq + 2 nk) clamped to
 * [-clip, clip] where clip > 0 (OLMoE; the limit rounded to fmt first, as torch's clamp
 * of a 16-bit tensor rounds it). Both in fmt 0 or 1. */
void ft_qkv_whole(void *qkv, int fmt, int64_t t_count, int64_t w, int64_t nq, int64_t nk,
                  const uint16_t *wq, const uint16_t *wk, float eps, float clip, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (t_count >= 32)
    for (int64_t t = 0; t < t_count; t++) {
        uint16_t *row = (uint16_t *)qkv + t * w;
        if (wq) {
            ft_rms_norm(row, NULL, wq, eps, 1, nq, fmt, row, NULL, 1);
            ft_rms_norm(row + nq, NULL, wk, eps, 1, nk, fmt, row + nq, NULL, 1);
        }
        if (clip > 0.f) {
            const float c = round_to(clip, fmt);
            for (int64_t e = 0; e < nq + 2 * nk; e++) {
                const float v = scalar_w(row + e, fmt);
                store_as(row, e, v > c ? c : v < -c ? -c : v, fmt);
            }
        }
    }
}

/* out [T, D] = table[ids[t]] (16-bit rows of `row_bytes`), the embedding's gather at the head
 * of a decode program: the step's token ids go in as data, as a CUDA graph's do, so the host
 * runs no gather of its own between steps. Returns -2, before writing a row, where an id is
 * outside [0, v). */
int ft_embed(const void *table, int64_t v, int64_t row_bytes, const int64_t *ids,
             int64_t t_count, void *out) {
    for (int64_t t = 0; t < t_count; t++)
        if (ids[t] < 0 || ids[t] >= v)
            return -2;
    for (int64_t t = 0; t < t_count; t++)
        memcpy((char *)out + t * row_bytes, (const char *)table + ids[t] * row_bytes,
               row_bytes);
    return 0;
}

/* out [T, N] float32 = x [T, N] (fmt 0 or 1) widened, as torch's .float() of the 16-bit
 * logits: the program ends with the sampler's input, so the host runs no torch op on it. */
void ft_widen(const void *x, int fmt, int64_t t_count, int64_t n, float *out, int threads) {
    const int64_t count = t_count * n, part = 4096;   /* 16 KB of float32 a thread's turn */
#pragma omp parallel for num_threads(threads) schedule(static) if (count >= 4 * part)
    for (int64_t e0 = 0; e0 < count; e0 += part) {
        const int64_t e1 = e0 + part < count ? e0 + part : count;
        if (fmt == 0) {                     /* bf16: its bits above 16 zero bits */
            const uint16_t *src = x;
            uint32_t *bits = (uint32_t *)out;
            for (int64_t e = e0; e < e1; e++)
                bits[e] = (uint32_t)src[e] << 16;
        } else {
            const _Float16 *src = x;
            for (int64_t e = e0; e < e1; e++)
                out[e] = (float)src[e];
        }
    }
}
