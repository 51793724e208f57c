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

/* The routers with a selection bias, sigmoid scores or groups (GLM-4.x, MiniMax-M2, ERNIE-4.5,
 * DeepSeek-V3's), for a CPU engine's rows in one call: biased_topk_reference's meaning.
 *
 * logits [T, E] in fmt -> weights [T, k] f32 and ids [T, k] i64. In float32: scores =
 * sigmoid(logits), or softmax over E (softmax 1); choice = scores + bias (bias [E] f32 or
 * NULL); with n_group > 1 groups of E / n_group experts, each group scored by its top two
 * choices' sum (its one choice where a group holds one), all but the topk_group best masked
 * out; ids the k best choices, largest first (the lower id first among equal ones, groups
 * too); weights the chosen experts' scores, divided by their sum + 1e-20 (renorm), times
 * scale; wfmt as ft_topk_softmax's. */
void ft_topk_biased(const void *logits, int fmt, int64_t t_count, int64_t e_count, int64_t k,
                    int softmax, const float *bias, int64_t n_group, int64_t topk_group,
                    int renorm, float scale, float *weights, int64_t *ids, int wfmt) {
    float score[e_count], choice[e_count];
    const int64_t gsize = e_count / n_group;
    for (int64_t t = 0; t < t_count; t++) {
        float m = -INFINITY, sum = 0.f;
        for (int64_t e = 0; e < e_count; e++) {
            const float x = load_as(logits, t * e_count + e, fmt);
            score[e] = softmax ? x : 1.f / (1.f + expf(-x));
            m = x > m ? x : m;
        }
        if (softmax) {
            for (int64_t e = 0; e < e_count; e++)
                sum += score[e] = expf(score[e] - m);
            for (int64_t e = 0; e < e_count; e++)
                score[e] /= sum;
        }
        for (int64_t e = 0; e < e_count; e++)
            choice[e] = bias ? score[e] + bias[e] : score[e];
        if (n_group > 1) {
            float gscore[n_group];
            uint8_t keep[n_group];
            for (int64_t g = 0; g < n_group; g++) {
                float a = -INFINITY, b = -INFINITY;     /* the group's best two */
                for (int64_t s = 0; s < gsize; s++) {
                    const float v = choice[g * gsize + s];
                    if (v > a) {
                        b = a;
                        a = v;
                    } else if (v > b) {
                        b = v;
                    }
                }
                gscore[g] = gsize == 1 ? a : a + b;
                keep[g] = 0;
            }
            for (int64_t j = 0; j < topk_group; j++) {
                int64_t best = -1;
                for (int64_t g = 0; g < n_group; g++)
                    if (!keep[g] && (best < 0 || gscore[g] > gscore[best]))
                        best = g;
                keep[best] = 1;
            }
            for (int64_t e = 0; e < e_count; e++)
                if (!keep[e / gsize])
                    choice[e] = -INFINITY;
        }
        float *w = weights + t * k;
        int64_t *id = ids + t * k;
        float kept = 0.f;
        for (int64_t j = 0; j < k; j++) {
            int64_t best = -1;
            for (int64_t e = 0; e < e_count; e++) {
                int taken = 0;
                for (int64_t q = 0; q < j; q++)
                    taken |= id[q] == e;
                if (!taken && (best < 0 || choice[e] > choice[best]))
                    best = e;
            }
            id[j] = best;
            w[j] = score[best];
            kept += w[j];
        }
        for (int64_t j = 0; j < k; j++)
            w[j] = round_to((renorm ? w[j] / (kept + 1e-20f) : w[j]) * scale, wfmt);
    }
}
