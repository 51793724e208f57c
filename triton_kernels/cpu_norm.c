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

void ft_rms_norm(const uint16_t *x, const uint16_t *residual, const uint16_t *w, float eps,
                 int64_t t_count, int64_t d, int fmt, uint16_t *out, uint16_t *res_out,
                 float *scratch) {
    for (int64_t t = 0; t < t_count; t++) {
        const uint16_t *xr = x + t * d;
        float ss = 0.f;
        for (int64_t j = 0; j < d; j++) {
            float s = scalar_w(xr + j, fmt);
            if (residual) {
                s = round_to(s + scalar_w(residual + t * d + j, fmt), fmt);
                store_as(res_out, t * d + j, s, fmt);
            }
            scratch[j] = s;
            ss += s * s;
        }
        float rstd = 1.f / sqrtf(ss / (float)d + eps);
        for (int64_t j = 0; j < d; j++)
            store_as(out, t * d + j,
                     round_to(scalar_w(w + j, fmt) * round_to(scratch[j] * rstd, fmt), fmt), fmt);
    }
}
