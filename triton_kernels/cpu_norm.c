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

static inline float to_dtype(float f, int fmt) {
    if (fmt == 1)
        return (float)(_Float16)f;
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        u |= 0x00400000u;
    else
        u += 0x7fffu + ((u >> 16) & 1u);
    u &= 0xffff0000u;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline void put(uint16_t *p, float f, int fmt) {     /* f: already in the dtype */
    if (fmt == 1) {
        _Float16 h = (_Float16)f;
        memcpy(p, &h, sizeof h);
    } else {
        uint32_t u;
        memcpy(&u, &f, sizeof u);
        *p = (uint16_t)(u >> 16);
    }
}

void ft_rms_norm(const uint16_t *x, const uint16_t *residual, const uint16_t *w, float eps,
                 int64_t t_count, int64_t d, int fmt, uint16_t *out, uint16_t *res_out,
                 float *scratch) {
    for (int64_t t = 0; t < t_count; t++) {
        const uint16_t *xr = x + t * d;
        float ss = 0.f;
        for (int64_t j = 0; j < d; j++) {
            float s = scalar_w(xr + j, fmt);
            if (residual) {
                s = to_dtype(s + scalar_w(residual + t * d + j, fmt), fmt);
                put(res_out + t * d + j, s, fmt);
            }
            scratch[j] = s;
            ss += s * s;
        }
        float rstd = 1.f / sqrtf(ss / (float)d + eps);
        for (int64_t j = 0; j < d; j++)
            put(out + t * d + j,
                to_dtype(scalar_w(w + j, fmt) * to_dtype(scratch[j] * rstd, fmt), fmt), fmt);
    }
}
