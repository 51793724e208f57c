/* A fixed list of the native kernels' calls replayed in one call (cpu_program.py builds it):
 * a CPU engine's decode step is ~8 kernel calls a layer, and through ctypes and the Python
 * around them each cost 10-15 us beyond its work (a 12-layer model of negligible weights
 * stepped in 1.7 ms); from one list they cost the kernel's own fork and join.
 *
 * Each op holds its kernel's arguments in that kernel's order, less the ones the run gives:
 * the row count t (tokens, or sequences for attention) and the thread count; ints in a[]
 * (pointers as integers), floats in f[]. The buffers are the program's, sized for its most
 * rows; cpu_program.py checks them when it builds an op, and t against them at each run.
 * Returns 0, or the first failing kernel's code with its op's index in *failed.
 */
#include "cpu_kernels.h"
#include <time.h>

enum { OP_RMS_NORM = 0, OP_LINEAR = 1, OP_ATTN = 2, OP_TOPK = 3, OP_MOE = 4, OP_GDN = 5,
       OP_SILU_MUL = 6, OP_SIGMOID_GATE = 7, OP_ADD_GATED = 8, OP_TOPK_BIASED = 9,
       OP_QKV_WHOLE = 10, OP_MLA = 11, OP_EMBED = 12,
       OP_WIDEN = 13 };
#define OP_INTS 32

struct ft_op {
    int64_t kind;
    int64_t a[OP_INTS];
    float f[4];
};

#define P(i) ((void *)(intptr_t)a[i])

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

/* ns: NULL, or each op's wall time added to ns[i] (ft_run_timed: a step's profile by op). */
static int run_ops(const struct ft_op *ops, int64_t n, int64_t t, int threads, int64_t *failed,
                   double *ns) {
    for (int64_t i = 0; i < n; i++) {
        const double start = ns ? now_ns() : 0.;
        const int64_t *a = ops[i].a;
        const float *f = ops[i].f;
        int rc = 0;
        switch (ops[i].kind) {
        case OP_RMS_NORM:   /* x, residual, w, d, fmt, out, res_out; eps */
            ft_rms_norm(P(0), P(1), P(2), f[0], t, a[3], (int)a[4], P(5), P(6), threads);
            break;
        case OP_LINEAR:     /* x, xfmt, w, wfmt, scales, bn, bk, bias, n, k, out, ofmt */
            rc = ft_linear(P(0), (int)a[1], t, P(2), (int)a[3], P(4), a[5], a[6], P(7), a[8],
                           a[9], P(10), (int)a[11], threads);
            break;
        case OP_ATTN:       /* ft_attn_decode's order; eps, scale */
            rc = ft_attn_decode(P(0), (int)a[1], t, a[2], a[3], a[4], P(5), P(6), f[0], P(7),
                                a[8], a[9], (int)a[10], (int)a[11], P(12), P(13), P(14),
                                (int)a[15], a[16], a[17], P(18), P(19), a[20], P(21), a[22], P(23),
                                f[1], threads, P(24), P(25));
            break;
        case OP_TOPK:       /* logits, fmt, e, k, renorm, weights, ids, wfmt */
            ft_topk_softmax(P(0), (int)a[1], t, a[2], a[3], (int)a[4], P(5), P(6), (int)a[7]);
            break;
        case OP_TOPK_BIASED:    /* logits, fmt, e, k, softmax, bias, n_group, topk_group,
                                 * renorm, weights, ids, wfmt; scale */
            ft_topk_biased(P(0), (int)a[1], t, a[2], a[3], (int)a[4], P(5), a[6], a[7],
                           (int)a[8], f[0], P(9), P(10), (int)a[11]);
            break;
        case OP_QKV_WHOLE:  /* qkv, fmt, w, nq, nk, wq, wk; eps, clip */
            ft_qkv_whole(P(0), (int)a[1], t, a[2], a[3], a[4], P(5), P(6), f[0], f[1], threads);
            break;
        case OP_MLA:        /* ft_mla_decode's order; eps, scale */
            rc = ft_mla_decode(P(0), P(1), (int)a[2], t, a[3], a[4], a[5], a[6], a[7], P(8), f[0],
                               P(9), a[10], (int)a[11], P(12), P(13), (int)a[14], a[15], a[16],
                               P(17), P(18), a[19], P(20), P(21), f[1], threads, P(22), P(23));
            break;
        case OP_MOE: {      /* ft_moe's order, scratch for act then acc; alpha, limit */
            float *act = P(20), *acc = act + t * a[6] * a[17];     /* [t k, I], then [t, D] */
            rc = ft_moe(P(0), (int)a[1], P(2), P(3), a[4], P(5), t, a[6], P(7), P(8), P(9),
                        P(10), a[11], a[12], P(13), P(14), a[15], a[16], a[17], (int)a[18],
                        (int)a[19], f[0], f[1], threads, act, acc, P(21), (int)a[22]);
            break;
        }
        case OP_GDN:        /* ft_gdn_decode's order; eps, scale */
            rc = ft_gdn_decode(P(0), (int)a[1], t, a[2], P(3), P(4), a[5], P(6), P(7), a[8],
                               P(9), P(10), P(11), P(12), P(13), f[0], a[14], a[15], a[16], a[17],
                               f[1], threads, P(18));
            break;
        case OP_SILU_MUL:   /* x, fmt, n, xs, out */
            ft_silu_mul(P(0), (int)a[1], t, a[2], a[3], P(4), threads);
            break;
        case OP_SIGMOID_GATE:   /* o, g, fmt, heads, dh, gs, ghs */
            ft_sigmoid_gate(P(0), P(1), (int)a[2], t, a[3], a[4], a[5], a[6], threads);
            break;
        case OP_ADD_GATED:  /* h, y, gl, gls, fmt, d */
            ft_add_gated(P(0), P(1), P(2), a[3], (int)a[4], t, a[5], threads);
            break;
        case OP_EMBED:      /* table, v, row_bytes, ids, out */
            rc = ft_embed(P(0), a[1], a[2], P(3), t, P(4));
            break;
        case OP_WIDEN:      /* x, fmt, n, out */
            ft_widen(P(0), (int)a[1], t, a[2], P(3), threads);
            break;
        default:
            rc = -4;
        }
        if (ns)
            ns[i] += now_ns() - start;
        if (rc) {
            *failed = i;
            return rc;
        }
    }
    return 0;
}

int ft_run(const void *list, int64_t n, int64_t t, int threads, int64_t *failed) {
    return run_ops(list, n, t, threads, failed, NULL);
}

int ft_run_timed(const void *list, int64_t n, int64_t t, int threads, int64_t *failed,
                 double *ns) {
    return run_ops(list, n, t, threads, failed, ns);
}
