/* A step's causal attention over the paged KV cache in vector registers (AVX2 or AVX-512,
 * no AMX), for a CPU engine's prefill chunks (min_q 2: the caller keeps a step's single-token
 * rows on its decode path): GQA, a sliding window, sinks; bf16, fp16 or float32 caches.
 *
 * Why: torch's path (paged_attention_reference: SDPA's CPU flash attention on the gathered
 * keys) takes an explicit mask, so it computes every query against every key it gathered, the
 * keys after a query's too: a whole prompt's chunk costs twice its causal products, and its
 * kernel runs ~110-120 GFLOP/s on the 2-core EPYC (AVX2): ~50 of causal products on a whole
 * prompt, ~40% of a 4096-token prefill of the bench model. Here only the keys a block of
 * queries can see are visited, the masks only on the blocks across the diagonal or the
 * window's edge: 130-160 GFLOP/s of causal products on the same machine (Zen 3's two FMA
 * pipes: ~200), 2.3-2.8x torch on whole prompts (bench/cpu_attention.py).
 *
 * cpu_amx_attention.c's plan on vectors: a work item is COLS "columns" of one sequence and kv
 * head, (query, head of the kv head's group) pairs, query-major, so a GQA group's heads share
 * every key and value. Both products are computed transposed, columns across a vector's lanes:
 *   S^T [keys, cols] = K Q^T, KR keys x CV column vectors of sums in registers, each key's
 *     element broadcast against a vector of Q^T [dk, COLS] (packed once per item, float32);
 *   O^T [Dv, cols] += V^T P^T, DR value dims x CV column vectors in registers, each value's
 *     element broadcast against a vector of P^T (both cpu_dot.h's outer_pass).
 * Keys and values are read from float32 copies of each (sequence, kv head)'s rows, made once
 * per call in phase 1 (a pair's keys in groups of KR, each group's dims one after another, so
 * a score pass reads one stream; its values DR dims at a time, each a stream of keys): a
 * broadcast from float32 is one load, from bf16 four ops.
 * With keys as rows, the softmax's reductions run down the rows (no horizontal sums), and its
 * rescaling of O^T multiplies each row by a vector of columns, folded into the value pass.
 *
 * Numerics: scores, the online softmax over blocks of KEYS keys (in the log2 domain:
 * cpu_heads.h's vexp2) and the value sums in float32, the probabilities unrounded, the output
 * acc / l rounded once. torch's flash kernel rounds its probabilities to the inputs' dtype: this is
 * the closer of the two to exact attention.
 *
 * Shapes: q [T, Hq, Dk] in fmt (0 bf16, 1 fp16, 2 float32; contiguous; sequence b's queries
 * are rows cu[b]..cu[b+1]-1 at positions lens[b] - n_q .. lens[b] - 1, their keys already in
 * the cache); k_cache [NB, BS, Hk, Dk] and v_cache [NB, BS, Hk, Dv] in fmt with the given
 * element strides (block, slot, head; the last dim contiguous); tables [B, M] int32 (row
 * stride tstride); window 0 (none) or W: a query at p sees keys p - W < j <= p; sinks [Hq]
 * f32 or NULL; out [T, Hq, Dv] in fmt. Dk and Dv up to 256. Sequences of fewer than min_q new
 * tokens are skipped (their rows of out untouched).
 * Returns 0; -2 a block id outside the cache, -3 shapes it does not take, -4 scratch too
 * small.
 */
#include "cpu_heads.h"
#include "cpu_prefill.h"

#define KR OUTER_R   /* keys of a score pass (cpu_dot.h's outer_pass: OUTER_R x 2 vectors) */
#define DR OUTER_R   /* value dims of a value pass */
#define CV OUTER_V   /* column vectors of an item */
#define COLS (CV * VW)
#define KEYS 48      /* keys of a softmax block: whole score passes */

static int64_t round_dims(int64_t d) { return (d + DR - 1) / DR * DR; }

/* What a pair's copies' size follows: dk, dv and the window. */
struct flash_shape {
    int64_t dk, dv, window;
};

/* Keys of a pair's copies: from the first any of its queries sees to its end, rounded up to
 * whole KEYS blocks (zeros past the end). */
static int64_t pack_rows(int64_t n_q, int64_t len, int64_t window) {
    return (len - prefill_first(n_q, len, window) + KEYS - 1) / KEYS * KEYS;
}

static void pair_plan(int64_t n_q, int64_t len, const void *shape, struct prefill_pair *p) {
    const struct flash_shape *f = shape;
    const int64_t rows = pack_rows(n_q, len, f->window);
    p->first = prefill_first(n_q, len, f->window);
    p->units = rows / KEYS;
    p->bytes = rows * (f->dk + round_dims(f->dv)) * 4;
}

/* A thread's own buffers: Q^T [dk][COLS], S^T / P^T [KEYS][COLS], O^T [dvp][COLS]. */
static int64_t thread_floats(int64_t dk, int64_t dv) {
    return (dk + KEYS + round_dims(dv)) * COLS;
}

int64_t ft_attn_flash_scratch(const int32_t *cu, const int32_t *lens, int64_t b_count,
                              int64_t min_q, int64_t hk, int64_t dk, int64_t dv,
                              int64_t window, int threads, int64_t pack_cap) {
    const struct flash_shape f = {dk, dv, window};
    return prefill_scratch(cu, lens, b_count, min_q, hk, threads, thread_floats(dk, dv) * 4,
                           pack_cap, pair_plan, &f);
}

struct flash {
    const void *q, *kc, *vc;
    const int32_t *tables, *cu, *lens;
    const float *sinks;
    void *out;
    int64_t hq, hk, dk, dv, dvp, bs, tstride, window;
    int64_t ksb, kss, ksh, vsb, vss, vsh;       /* cache strides (elements) */
    float scale;
    int fmt;
};

/* A pair's float32 copies, from key p->first on, rows = units * KEYS of them: keys rows / KR
 * groups of [dk][KR], then values dvp / DR passes of [rows][DR]. */
static inline float *key_copy(const struct prefill_pair *p) { return (float *)p->copy; }

static inline float *value_copy(const struct flash *a, const struct prefill_pair *p) {
    return (float *)p->copy + p->units * KEYS * a->dk;
}

/* Phase 1: keys first + KEYS ch .. of a pair into its copies (zeros past the sequence's end:
 * a probability 0 times a stale nan would still be a nan). */
static void pack_block(const void *at, const struct prefill_pair *p, int64_t ch) {
    const struct flash *a = at;
    const int64_t len = a->lens[p->b], dk = a->dk, dv = a->dv, dvp = a->dvp;
    const int64_t rows = p->units * KEYS;
    const int64_t size = a->fmt == 2 ? 4 : 2;
    for (int64_t i = 0; i < KEYS; i++) {
        const int64_t r = ch * KEYS + i, j = p->first + r;
        float *kd = key_copy(p) + (r / KR) * dk * KR + r % KR;
        float *vd = value_copy(a, p) + r * DR;
        if (j >= len) {
            for (int64_t d = 0; d < dk; d++)
                kd[d * KR] = 0.f;
            for (int64_t d = 0; d < dvp; d++)
                vd[(d / DR) * rows * DR + d % DR] = 0.f;
            continue;
        }
        const int64_t block = a->tables[p->b * a->tstride + j / a->bs], slot = j % a->bs;
        const char *k = (const char *)a->kc
            + (block * a->ksb + slot * a->kss + p->h * a->ksh) * size;
        const char *v = (const char *)a->vc
            + (block * a->vsb + slot * a->vss + p->h * a->vsh) * size;
        for (int64_t d = 0; d < dk; d++)
            kd[d * KR] = load_as(k, d, a->fmt);
        for (int64_t d = 0; d < dvp; d++)
            vd[(d / DR) * rows * DR + d % DR] = d < dv ? load_as(v, d, a->fmt) : 0.f;
    }
}

/* Phase 2: work item rb of a pair: columns COLS rb .. of its (query, head) pairs. */
static void attend(const void *at, const struct prefill_pair *p, int64_t rb, uint8_t *scratch) {
    const struct flash *a = at;
    const int64_t g_count = a->hq / a->hk, b = p->b, h = p->h;
    const int64_t n_q = a->cu[b + 1] - a->cu[b], len = a->lens[b], p0 = len - n_q;
    const int64_t c0 = rb * COLS, n_cols = n_q * g_count - c0 < COLS ? n_q * g_count - c0 : COLS;
    const int64_t dk = a->dk, dvp = a->dvp, w = a->window;
    float *qt = (float *)scratch, *s = qt + dk * COLS, *o = s + KEYS * COLS;

    /* Columns past the item's end repeat its last one's position (their q is zero, their
     * output unused), so no column is without a visible key. */
    int32_t pos[COLS] __attribute__((aligned(64)));
    int64_t row[COLS], head[COLS];
    for (int c = 0; c < COLS; c++) {
        const int64_t r = c0 + (c < n_cols ? c : n_cols - 1);
        row[c] = a->cu[b] + r / g_count;
        head[c] = h * g_count + r % g_count;
        pos[c] = (int32_t)(p0 + r / g_count);
        for (int64_t d = 0; d < dk; d++)
            qt[d * COLS + c] = c < n_cols ? load_as(a->q, (row[c] * a->hq + head[c]) * dk + d,
                                                    a->fmt) : 0.f;
    }
    memset(o, 0, dvp * COLS * sizeof *o);

    const int64_t pos_min = pos[0], pos_max = pos[COLS - 1], k_end = pos_max + 1;
    int64_t k_start = w && pos_min - w + 1 > p->first ? pos_min - w + 1 : p->first;
    k_start = p->first + (k_start - p->first) / KR * KR;       /* a whole group of the copy */
    const vf neg_inf = (vf){0} - INFINITY, scale = (vf){0} + a->scale * 1.4426950408889634f;
    vf m[CV], l[CV];
    vi32 posv[CV];
    for (int c = 0; c < CV; c++) {
        m[c] = neg_inf, l[c] = (vf){0};
        memcpy(&posv[c], pos + c * VW, sizeof posv[c]);
    }
    for (int64_t j0 = k_start; j0 < k_end; j0 += KEYS) {
        const int64_t n = k_end - j0 < KEYS ? k_end - j0 : KEYS, groups = (n + KR - 1) / KR;
        const float *kg = key_copy(p) + (j0 - p->first) / KR * dk * KR;
        for (int64_t g = 0; g < groups; g++)
            outer_pass(kg + g * dk * KR, 1, KR, qt, COLS, dk, s + g * KR * COLS, COLS, NULL);
        /* Every key of the block visible to every column: no masks. The softmax runs in the
         * log2 domain on x = s scale log2(e) - m (one rounding), m the running max of
         * s scale log2(e); a masked key's -inf gives 2^x = 0. */
        const int full = j0 + n - 1 <= pos_min && (!w || j0 > pos_max - w);
        vf alpha[CV];
        for (int c = 0; c < CV; c++) {
            vf mx = neg_inf;
            for (int64_t j = 0; j < n; j++) {
                vf v;
                memcpy(&v, s + j * COLS + c * VW, sizeof v);
                if (!full) {
                    const vi32 jv = (vi32){0} + (int32_t)(j0 + j);
                    vi32 ok = jv <= posv[c];
                    if (w)
                        ok &= jv > posv[c] - (int32_t)w;
                    v = vsel(ok, v, neg_inf);
                    memcpy(s + j * COLS + c * VW, &v, sizeof v);
                }
                mx = vmax(mx, v);
            }
            const vf m_new = vmax(m[c], mx * scale);
            /* a column with no visible key yet keeps m = -inf: subtract 0 there */
            const vf m_safe = vsel(m_new != neg_inf, m_new, (vf){0});
            alpha[c] = vexp2(m[c] - m_safe);
            m[c] = m_new;
            vf sum = {0};
            for (int64_t j = 0; j < n; j++) {
                vf v;
                memcpy(&v, s + j * COLS + c * VW, sizeof v);
                const vf e = vexp2(v * scale - m_safe);
                memcpy(s + j * COLS + c * VW, &e, sizeof e);
                sum += e;
            }
            l[c] = l[c] * alpha[c] + sum;
        }
        const float *vd = value_copy(a, p) + (j0 - p->first) * DR;
        for (int64_t d0 = 0; d0 < dvp; d0 += DR)
            outer_pass(vd + d0 * p->units * KEYS, 1, DR, s, COLS, n, o + d0 * COLS, COLS, alpha);
    }

    /* out = O / l, with each head's sink logit joining l (2^(sink log2(e) - m)), rounded
     * once */
    float div[COLS] __attribute__((aligned(64)));
    for (int c = 0; c < CV; c++) {
        vf lt = l[c];
        if (a->sinks) {
            vf sk;
            for (int e = 0; e < VW; e++)
                sk[e] = a->sinks[head[c * VW + e]];
            lt += vexp2(sk * 1.4426950408889634f - m[c]);
        }
        memcpy(div + c * VW, &lt, sizeof lt);
    }
    for (int c = 0; c < n_cols; c++) {
        const float inv = 1.f / div[c];
        for (int64_t d = 0; d < a->dv; d++)
            store_as(a->out, (row[c] * a->hq + head[c]) * a->dv + d,
                     round_to(o[d * COLS + c] * inv, a->fmt), a->fmt);
    }
}

int ft_attn_flash(const void *q, const void *k_cache, const void *v_cache, int fmt, int64_t nb,
                  int64_t ksb, int64_t kss, int64_t ksh, int64_t vsb, int64_t vss, int64_t vsh,
                  const int32_t *tables, int64_t tstride, const int32_t *cu,
                  const int32_t *lens, int64_t b_count, int64_t min_q, int64_t hq, int64_t hk,
                  int64_t dk, int64_t dv, int64_t bs, float scale, int64_t window,
                  const float *sinks, int threads, void *scratch, int64_t scratch_bytes,
                  int64_t pack_cap, void *out) {
    if (dk <= 0 || dk > 256 || dv <= 0 || dv > 256 || bs <= 0 || hk <= 0 || hq % hk
            || window < 0 || fmt < 0 || fmt > 2)
        return -3;
    const int rc = prefill_check(cu, lens, b_count, tables, tstride, nb, bs);
    if (rc)
        return rc;
    if (threads < 1)
        threads = 1;
    if (scratch_bytes < ft_attn_flash_scratch(cu, lens, b_count, min_q, hk, dk, dv, window,
                                              threads, pack_cap))
        return -4;
    const struct flash a = {q, k_cache, v_cache, tables, cu, lens, sinks, out, hq, hk, dk, dv,
                            round_dims(dv), bs, tstride, window, ksb, kss, ksh, vsb, vss, vsh,
                            scale, fmt};
    const struct flash_shape f = {dk, dv, window};
    const int64_t pairs = b_count * hk;
    struct prefill_pair *pr = prefill_pairs(cu, lens, b_count, min_q, hk, hq / hk, COLS,
                                            pair_plan, &f);
    if (!pr)
        return -4;
    uint8_t *base = (uint8_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    const int64_t mine = thread_floats(dk, dv) * 4;
    const struct prefill_ops ops = {pack_block, attend, NULL, NULL};
    prefill_run(&a, &ops, pr, pairs, base, mine, base + threads * mine, pack_cap, threads);
    free(pr);
    return 0;
}
