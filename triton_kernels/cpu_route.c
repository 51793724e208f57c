/* A MoE router's softmax -> top-k (-> renormalise) for a CPU engine's rows, in one call.
 *
 * Built with cpu_moe.c into one library (cpu_native.py). Why: torch spells it as softmax,
 * topk and (renormalising) a sum and a divide, ~5 us of dispatch each, every MoE layer of
 * every step, for a few hundred flops.
 *
 * logits [T, E] in fmt (0 bf16, 1 fp16, 2 f32) -> weights [T, k] f32 and ids [T, k] i64,
 * largest first (the lower id first among equal ones). softmax in float32 over all E, as
 * topk_softmax_reference; renorm: the k weights divided by their sum; wfmt 0 or 1: each
 * weight then rounded to bf16 or fp16 (the families that cast them to the model's dtype),
 * 2: kept in float32.
 */
#include "cpu_dot.h"

void ft_topk_softmax(const void *logits, int fmt, int64_t t_count, int64_t e_count,
                     int64_t k, int renorm, float *weights, int64_t *ids, int wfmt) {
    for (int64_t t = 0; t < t_count; t++) {
        float m = -INFINITY;
        for (int64_t e = 0; e < e_count; e++) {
            float v = load_as(logits, t * e_count + e, fmt);
            m = v > m ? v : m;
        }
        float sum = 0.f;
        for (int64_t e = 0; e < e_count; e++)
            sum += expf(load_as(logits, t * e_count + e, fmt) - m);
        float *w = weights + t * k;
        int64_t *id = ids + t * k;
        float kept = 0.f;
        for (int64_t j = 0; j < k; j++) {        /* k rounds of the largest not yet taken */
            int64_t best = -1;
            float bv = -INFINITY;
            for (int64_t e = 0; e < e_count; e++) {
                int taken = 0;
                for (int64_t q = 0; q < j; q++)
                    taken |= id[q] == e;
                float v = load_as(logits, t * e_count + e, fmt);
                if (!taken && (best < 0 || v > bv)) {
                    best = e;
                    bv = v;
                }
            }
            id[j] = best;
            w[j] = expf(bv - m) / sum;
            kept += w[j];
        }
        if (renorm)
            for (int64_t j = 0; j < k; j++)
                w[j] /= kept;
        for (int64_t j = 0; j < k; j++)
            w[j] = round_to(w[j], wfmt);
    }
}
