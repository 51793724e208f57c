/* Gated DeltaNet's two sequence ops for a CPU engine (Qwen3-Next, Qwen3.5/3.6): the depthwise
 * causal conv1d over each sequence's new tokens with its state, and the gated delta rule token
 * by token, both over a flat varlen batch, each sequence's state in its pool slot.
 *
 * Why: their references (causal_conv1d.py, gated_delta.py) run torch ops per token: the delta
 * rule ~10 ops a token a layer (a 4096-token prompt of the bench-shaped Qwen3-Next: ~2.6 s of
 * its ~4.6 s prefill), the conv one oneDNN convolution a sequence (~150 us at one token). Here
 * each (sequence, value head)'s state [Dk, Dv] stays in a thread's L1/L2 for all its tokens.
 *
 * Formats (fmt): 0 bf16, 1 fp16, 2 float32 (cpu_dot.h's load_as / round_to).
 *
 * ft_causal_conv1d: x [T, C] (row stride xs) in fmt, weight [C, W] float32, state [S, C, W-1]
 * in fmt (oldest first), slots / cu / has per sequence; y_t = act(sum_j w_j x_{t-(W-1)+j}) in
 * float32, rounded once to fmt (as the reference's float32 conv1d and silu); the slot keeps the
 * sequence's last W-1 inputs (zeros before its first token where has is 0).
 *
 * ft_gated_delta: q, k [T, Hk, Dk] and v [T, Hv, Dv] in fmt (row strides qs, ks, vs; heads
 * contiguous), g [T, Hv] float32, beta [T, Hv] in bfmt, state pool [S, Hv, Dk, Dv] float32;
 * per token and value head h (key head h / (Hv / Hk)), in float32:
 *     q, k = l2norm(q), l2norm(k) (when l2norm: x / sqrt(sum x^2 + 1e-6)); q = q * scale
 *     S = S exp(g);  S = S + k^T (beta (v - k S));  o = q S
 * o [T, Hv, Dv] rounded to fmt. Both return 0, -1 out of memory, -2 a slot or offset out of
 * range, -3 a slot named twice (two sequences' work items would share a state row), -4 (the
 * conv) a width outside 2..16.
 */
#include "cpu_dot.h"

#define CONV_BLOCK 256          /* channels a conv work item */

static int check_seqs(const int32_t *slots, const int32_t *cu, int64_t n_seq, int64_t n_slots,
                      int64_t t_count) {
    for (int64_t i = 0; i < n_seq; i++) {
        if (slots[i] < 0 || slots[i] >= n_slots || cu[i] < 0 || cu[i + 1] < cu[i]
            || cu[i + 1] > t_count)
            return -2;
        for (int64_t j = 0; j < i; j++)     /* (a step's few sequences: n^2 is nothing) */
            if (slots[j] == slots[i])
                return -3;
    }
    return 0;
}

int ft_causal_conv1d(const void *x, int fmt, int64_t t_count, int64_t c, int64_t xs,
                     const float *w, int64_t width, void *state, int64_t n_slots,
                     const int32_t *slots, const int32_t *cu, const uint8_t *has, int64_t n_seq,
                     int silu, int threads, void *y) {
    if (width < 2 || width > 16)
        return -4;
    const int rc = check_seqs(slots, cu, n_seq, n_slots, t_count);
    if (rc)
        return rc;
    const int64_t h = width - 1, blocks = (c + CONV_BLOCK - 1) / CONV_BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t item = 0; item < n_seq * blocks; item++) {
        const int64_t i = item / blocks, c0 = item % blocks * CONV_BLOCK;
        const int64_t cn = c - c0 < CONV_BLOCK ? c - c0 : CONV_BLOCK;
        float hist[16][CONV_BLOCK];          /* hist[j][ch]: input t - (W-1) + j, oldest first */
        const int64_t base = (int64_t)slots[i] * c * h;
        for (int64_t ch = 0; ch < cn; ch++)
            for (int64_t j = 0; j < h; j++)
                hist[j][ch] = has[i] ? load_as(state, base + (c0 + ch) * h + j, fmt) : 0.f;
        for (int64_t t = cu[i]; t < cu[i + 1]; t++) {
            float cur[CONV_BLOCK], acc[CONV_BLOCK];
            for (int64_t ch = 0; ch < cn; ch++)
                cur[ch] = load_as(x, t * xs + c0 + ch, fmt);
            for (int64_t ch = 0; ch < cn; ch++) {
                float s = 0.f;
                for (int64_t j = 0; j < h; j++)
                    s += w[(c0 + ch) * width + j] * hist[j][ch];
                acc[ch] = s + w[(c0 + ch) * width + h] * cur[ch];
            }
            if (silu)
                for (int64_t ch = 0; ch < cn; ch++)
                    acc[ch] = acc[ch] / (1.f + expf(-acc[ch]));
            for (int64_t ch = 0; ch < cn; ch++)
                store_as(y, t * c + c0 + ch, round_to(acc[ch], fmt), fmt);
            for (int64_t j = 0; j + 1 < h; j++)
                memcpy(hist[j], hist[j + 1], cn * sizeof(float));
            memcpy(hist[h - 1], cur, cn * sizeof(float));
        }
        for (int64_t ch = 0; ch < cn; ch++)
            for (int64_t j = 0; j < h; j++)
                store_as(state, base + (c0 + ch) * h + j, round_to(hist[j][ch], fmt), fmt);
    }
    return 0;
}

/* One token of the rule on a state s [Dk, Dv] (float32, in place), q and k [Dk] prepared:
 *   S = S decay;  pred = k S;  delta = b (v - pred);  S = S + k^T delta;  o = q S
 * v [Dv] float32 (delta may be v itself: each is read before it is written); pred, o [Dv]. */
static inline void rule_step(float *s, const float *qf, const float *kf, const float *v,
                             float decay, float b, int64_t dk, int64_t dv, float *pred,
                             float *delta, float *o) {
    for (int64_t e = 0; e < dv; e++)
        pred[e] = 0.f;
    for (int64_t d = 0; d < dk; d++) {              /* S = S exp(g), and k S, a row at a time */
        float *row = s + d * dv;
        const float kd = kf[d];
        for (int64_t e = 0; e < dv; e++) {
            row[e] *= decay;
            pred[e] += row[e] * kd;
        }
    }
    for (int64_t e = 0; e < dv; e++) {
        delta[e] = b * (v[e] - pred[e]);
        o[e] = 0.f;
    }
    for (int64_t d = 0; d < dk; d++) {              /* S = S + k^T delta, and q S */
        float *row = s + d * dv;
        const float kd = kf[d], qd = qf[d];
        for (int64_t e = 0; e < dv; e++) {
            row[e] += kd * delta[e];
            o[e] += row[e] * qd;
        }
    }
}

/* x [n] (fmt, at p) -> out float32, l2-normed when asked, times mul. */
static inline void load_head(const void *p, int64_t at, int64_t n, int fmt, int l2norm,
                             float mul, float *out) {
    float ss = 0.f;
    for (int64_t d = 0; d < n; d++) {
        out[d] = load_as(p, at + d, fmt);
        ss += out[d] * out[d];
    }
    const float f = (l2norm ? 1.f / sqrtf(ss + 1e-6f) : 1.f);
    for (int64_t d = 0; d < n; d++)
        out[d] = out[d] * f * mul;
}

int ft_gated_delta(const void *q, const void *k, const void *v, int fmt, int64_t t_count,
                   int64_t qs, int64_t ks, int64_t vs, const float *g, const void *beta,
                   int bfmt, float *pool, int64_t n_slots, const int32_t *slots,
                   const int32_t *cu, const uint8_t *has, int64_t n_seq, int64_t hk, int64_t hv,
                   int64_t dk, int64_t dv, float scale, int l2norm, int threads, void *out) {
    if (hk <= 0 || hv % hk)
        return -2;
    const int rc = check_seqs(slots, cu, n_seq, n_slots, t_count);
    if (rc)
        return rc;
    const int64_t r = hv / hk;
    int bad = 0;
#pragma omp parallel num_threads(threads)
    {
        float *buf = malloc((dk * dv + 2 * dk + 3 * dv) * sizeof(float));
        if (!buf)
            __atomic_store_n(&bad, 1, __ATOMIC_RELAXED);
#pragma omp barrier
        if (!__atomic_load_n(&bad, __ATOMIC_RELAXED)) {
            float *s = buf, *qf = s + dk * dv, *kf = qf + dk, *pred = kf + dk, *delta = pred + dv,
                  *o = delta + dv;
#pragma omp for schedule(dynamic)
            for (int64_t item = 0; item < n_seq * hv; item++) {
                const int64_t i = item / hv, h = item % hv, kh = h / r;
                float *slot = pool + ((int64_t)slots[i] * hv + h) * dk * dv;
                if (has[i])
                    memcpy(s, slot, dk * dv * sizeof(float));
                else
                    memset(s, 0, dk * dv * sizeof(float));
                for (int64_t t = cu[i]; t < cu[i + 1]; t++) {
                    load_head(q, t * qs + kh * dk, dk, fmt, l2norm, scale, qf);
                    load_head(k, t * ks + kh * dk, dk, fmt, l2norm, 1.f, kf);
                    const float decay = expf(g[t * hv + h]), b = load_as(beta, t * hv + h, bfmt);
                    for (int64_t e = 0; e < dv; e++)
                        delta[e] = load_as(v, t * vs + h * dv + e, fmt);
                    rule_step(s, qf, kf, delta, decay, b, dk, dv, pred, delta, o);
                    for (int64_t e = 0; e < dv; e++)
                        store_as(out, (t * hv + h) * dv + e, round_to(o[e], fmt), fmt);
                }
                memcpy(slot, s, dk * dv * sizeof(float));
            }
        }
        free(buf);
    }
    return bad ? -1 : 0;
}

/* A decode step of a whole Gated DeltaNet layer between its two projections, in one call:
 * each sequence's one new token through the conv's update, the gates, the delta rule and the
 * gated RMSNorm. A CPU engine's decode step ran these as ~25 torch ops and two native calls a
 * layer (a bench-shaped Qwen3-Next: 9 such layers, ~10 of its ~25 ms a token in dispatch).
 *
 * proj [B, ps] in fmt: the input projections' output as the checkpoint lays it out; lay[12]
 * says where (elements within a row): for key head kh and its j-th value head (Hv / Hk of
 * them), q at lay[0] + kh lay[1], k at lay[2] + kh lay[3], v at lay[4] + kh lay[5] + j Dv, z
 * at lay[6] + kh lay[7] + j Dv, b at lay[8] + kh lay[9] + j, a at lay[10] + kh lay[11] + j
 * (Qwen3.5's split projections and Qwen3-Next's per-key-head groups alike).
 * conv_w [C, W] float32 and the conv pool [S, C, W-1] in fmt over channels [q | k | v] (C =
 * 2 Hk Dk + Hv Dv); the state pool [S, Hv, Dk, Dv] float32; slots [B]; has [B] (0: the
 * sequence's first token, its slot's state and conv inputs taken as zeros); decay_a [Hv] float32
 * (-exp(A_log)), dt_bias [Hv] float32, norm_w [Dv] in fmt. Per token, in float32:
 *   x = conv([q|k|v] with the slot's last W-1 inputs), silu, rounded to fmt (the conv's);
 *   q, k = l2norm(q) scale, l2norm(k); g = decay_a softplus(a + dt_bias) (x > 20: x, as
 *   torch's); beta = sigmoid(b) rounded to fmt; the rule as ft_gated_delta's, o rounded;
 *   out = round(round(norm_w round(o rsqrt(mean(o^2) + eps))) silu(z))  (HF's gated norm).
 * out [B, Hv Dv] in fmt. Work items: (sequence, key head), each its Hv / Hk value heads'
 * states updated in place in the pool. Returns ft_gated_delta's codes, -4 a conv width
 * outside 2..16. */
int ft_gdn_decode(const void *proj, int fmt, int64_t b_count, int64_t ps, const int64_t *lay,
                  const float *conv_w, int64_t width, void *conv_pool, float *pool,
                  int64_t n_slots, const int32_t *slots, const uint8_t *has,
                  const float *decay_a, const float *dt_bias, const void *norm_w, float eps,
                  int64_t hk, int64_t hv, int64_t dk, int64_t dv, float scale, int threads,
                  void *out) {
    if (width < 2 || width > 16)
        return -4;
    if (hk <= 0 || hv % hk)
        return -2;
    for (int64_t i = 0; i < b_count; i++) {
        if (slots[i] < 0 || slots[i] >= n_slots)
            return -2;
        for (int64_t j = 0; j < i; j++)
            if (slots[j] == slots[i])
                return -3;
    }
    const int64_t r = hv / hk, c = 2 * hk * dk + hv * dv, h = width - 1;
    int bad = 0;
#pragma omp parallel num_threads(threads)
    {
        float *buf = malloc((2 * dk + r * dv + 3 * dv) * sizeof(float));
        if (!buf)
            __atomic_store_n(&bad, 1, __ATOMIC_RELAXED);
#pragma omp barrier
        if (!__atomic_load_n(&bad, __ATOMIC_RELAXED)) {
            float *qf = buf, *kf = qf + dk, *vf_ = kf + dk, *pred = vf_ + r * dv,
                  *delta = pred + dv, *o = delta + dv;
#pragma omp for schedule(dynamic)
            for (int64_t item = 0; item < b_count * hk; item++) {
                const int64_t i = item / hk, kh = item % hk;
                const uint8_t *row = (const uint8_t *)proj
                                     + i * ps * (fmt == 2 ? 4 : 2);     /* (fmt's bytes) */
                const void *p = row;
                /* the conv over this key head's channels: q, k, then its value heads' v */
                const int64_t n_ch[3] = {dk, dk, r * dv};
                const int64_t src[3] = {lay[0] + kh * lay[1], lay[2] + kh * lay[3],
                                        lay[4] + kh * lay[5]};
                const int64_t chan[3] = {kh * dk, hk * dk + kh * dk, 2 * hk * dk + kh * r * dv};
                float *dst[3] = {qf, kf, vf_};
                for (int part = 0; part < 3; part++)
                    for (int64_t e = 0; e < n_ch[part]; e++) {
                        const int64_t ch = chan[part] + e;
                        const float *w = conv_w + ch * width;
                        const int64_t at = ((int64_t)slots[i] * c + ch) * h;
                        const float cur = load_as(p, src[part] + e, fmt);
                        if (!has[i])
                            for (int64_t j = 0; j < h; j++)
                                store_as(conv_pool, at + j, 0.f, fmt);
                        float s = 0.f;
                        for (int64_t j = 0; j < h; j++)
                            s += w[j] * load_as(conv_pool, at + j, fmt);
                        for (int64_t j = 0; j + 1 < h; j++)
                            store_as(conv_pool, at + j, load_as(conv_pool, at + j + 1, fmt), fmt);
                        store_as(conv_pool, at + h - 1, cur, fmt);
                        const float acc = s + w[h] * cur;
                        dst[part][e] = round_to(acc / (1.f + expf(-acc)), fmt);
                    }
                float qs = 0.f, ks = 0.f;
                for (int64_t d = 0; d < dk; d++) {
                    qs += qf[d] * qf[d];
                    ks += kf[d] * kf[d];
                }
                const float qn = 1.f / sqrtf(qs + 1e-6f), kn = 1.f / sqrtf(ks + 1e-6f);
                for (int64_t d = 0; d < dk; d++) {
                    qf[d] = qf[d] * qn * scale;
                    kf[d] = kf[d] * kn;
                }
                for (int64_t j = 0; j < r; j++) {
                    const int64_t hh = kh * r + j;
                    const float x = load_as(p, lay[10] + kh * lay[11] + j, fmt) + dt_bias[hh];
                    const float decay = expf(decay_a[hh] * (x > 20.f ? x : log1pf(expf(x))));
                    const float bl = load_as(p, lay[8] + kh * lay[9] + j, fmt);
                    const float b = round_to(1.f / (1.f + expf(-bl)), fmt);
                    float *s = pool + ((int64_t)slots[i] * hv + hh) * dk * dv;
                    if (!has[i])
                        memset(s, 0, dk * dv * sizeof(float));
                    rule_step(s, qf, kf, vf_ + j * dv, decay, b, dk, dv, pred, delta, o);
                    /* the gated RMSNorm of this head's o */
                    float ss = 0.f;
                    for (int64_t e = 0; e < dv; e++) {
                        o[e] = round_to(o[e], fmt);
                        ss += o[e] * o[e];
                    }
                    const float rstd = 1.f / sqrtf(ss / (float)dv + eps);
                    const int64_t z0 = lay[6] + kh * lay[7] + j * dv;
                    for (int64_t e = 0; e < dv; e++) {
                        const float n = round_to(load_as(norm_w, e, fmt)
                                                 * round_to(o[e] * rstd, fmt), fmt);
                        const float z = load_as(p, z0 + e, fmt);
                        store_as(out, (i * hv + hh) * dv + e,
                                 round_to(n * (z / (1.f + expf(-z))), fmt), fmt);
                    }
                }
            }
        }
        free(buf);
    }
    return bad ? -1 : 0;
}
