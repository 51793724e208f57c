/* RMSNorm with the residual add fused, for a CPU engine's 16-bit rows, in one call.
 *
 * Built with cpu_moe.c into one library (cpu_native.py). Why: torch's CPU rms_norm is six ops
 * (pow, mean, add, rsqrt, mul, the cast) plus the weight's multiply and the residual's add:
 * ~33 us a call on a 2-core Xeon, 49 calls in a batch-1 decode step of the bench model.
 *
 * x, residual (or NULL), out, res_out [T, D] and w [D], all in fmt (0 bf16, 1 fp16). HF's
 * arithmetic, each step rounded to the dtype as HF rounds it: s = x + residual (the next
 * residual), h = s * rsqrt(mean(s^2) + eps) in float32, out = w * h. The mean is summed in
 * another order than torch's, so a rounding can differ in the last place.
 */
#include "cpu_dot.h"

/* VW float32 values rounded to fmt's precision, nearest even (a nan stays a nan), stored as
 * 16-bit at dst; returns the rounded values as float32. */
static inline vf round_store(uint16_t *dst, vf f, int fmt) {
    if (fmt == 1) {
        vf r;
#if VW == 16
        __m512 v;
        memcpy(&v, &f, sizeof v);
        __m256i h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm256_storeu_si256((__m256i *)dst, h);
        __m512 back = _mm512_cvtph_ps(h);
        memcpy(&r, &back, sizeof r);
#else
        for (int i = 0; i < VW; i++) {
            r[i] = round_to(f[i], 1);
            store_as(dst, i, r[i], 1);
        }
#endif
        return r;
    }
    vu32 u;
    memcpy(&u, &f, sizeof u);
    vu32 nan = (u & 0x7fffffffu) > 0x7f800000u;            /* all ones where f is a nan */
    vu32 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    u = (nan & (u | 0x00400000u)) | (~nan & rounded);
    vu16 h = __builtin_convertvector(u >> 16, vu16);
    memcpy(dst, &h, sizeof h);
    vf r;
    memcpy(&r, &u, sizeof r);
    return r;
}

void ft_rms_norm(const uint16_t *x, const uint16_t *residual, const uint16_t *w, float eps,
                 int64_t t_count, int64_t d, int fmt, uint16_t *out, uint16_t *res_out,
                 int threads) {
    /* Rows among the threads where there are enough of them (a prefill chunk's). */
#pragma omp parallel for num_threads(threads) schedule(static) if (t_count >= 32)
    for (int64_t t = 0; t < t_count; t++) {
        const uint16_t *xr = x + t * d;
        vf acc = (vf){0};
        int64_t j = 0;
        for (; j + VW <= d; j += VW) {
            vf s = load_w(xr + j, fmt);
            if (residual)
                s = round_store(res_out + t * d + j, s + load_w(residual + t * d + j, fmt), fmt);
            acc += s * s;
        }
        float ss = hsum(acc);
        for (; j < d; j++) {
            float s = scalar_w(xr + j, fmt);
            if (residual) {
                s = round_to(s + scalar_w(residual + t * d + j, fmt), fmt);
                store_as(res_out, t * d + j, s, fmt);
            }
            ss += s * s;
        }
        float rstd = 1.f / sqrtf(ss / (float)d + eps);
        const uint16_t *sr = residual ? res_out + t * d : xr;     /* s, in the dtype */
        uint16_t tmp[VW];
        for (j = 0; j + VW <= d; j += VW)
            round_store(out + t * d + j,
                        load_w(w + j, fmt) * round_store(tmp, load_w(sr + j, fmt) * rstd, fmt),
                        fmt);
        for (; j < d; j++)
            store_as(out, t * d + j,
                     round_to(scalar_w(w + j, fmt) * round_to(scalar_w(sr + j, fmt) * rstd, fmt),
                              fmt), fmt);
    }
}
