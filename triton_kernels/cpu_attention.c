/* One attention layer's decode step on the CPU, in one call: each sequence's one new token
 * through q/k RMSNorm per head, RoPE, the K/V write into the paged cache, and attention over
 * its cached keys (a sliding window, per-head sinks), on all of OpenMP's threads.
 *
 * A kv head's q heads (GQA) share one pass over its keys and values, each row read and widened
 * once for them (16 q heads of 64 over 4 kv heads, 2-core Xeon: 1024 keys 155 -> 131 us).
 *
 * Built with cpu_moe.c into one library (cpu_native.py). Why: torch spells this step as ~40
 * small ops a layer (the norms' six, rope's slices and casts, the block gather, the float32
 * widening, SDPA), each a few us of dispatch on a CPU: ~0.4 ms a layer, a fifth of a
 * batch-1 decode step, for well under 0.05 ms of arithmetic.
 *
 * Shapes (B sequences of one query each; Hq, Hk heads of Dh; R rotary dims <= Dh):
 *   qkv [B, (Hq + 2 Hk) Dh] in fmt (q heads, then k, then v: the fused projection's output;
 *   gated: [B, (2 Hq + 2 Hk) Dh], each q head followed by its output gate's Dh, which the
 *   caller applies after: ft_sigmoid_gate);
 *   q_norm, k_norm [Dh] f32 (the scale, offset applied) or NULL; cos_sin [P, R] f32 (cos of
 *   the R/2 pairs, then sin); pos [B] i64; k_cache, v_cache [NB, BS, Hk, Dh] in cfmt; slots
 *   [B] i64 (block * BS + offset: the new token's; -1 writes nothing); tables [B, M] i32;
 *   lens [B] i32 (keys after this step); sinks [Hq] f32 or NULL; out [B, Hq Dh] in fmt;
 *   q_scratch: B Hq Dh f32. Every block id, slot and position is checked first (-2).
 *   Formats: 0 bf16, 1 fp16, 2 f32. window 0: none; else key j is seen iff len - window <= j.
 * q and k are normed and rotated in float32 and rounded once to the model's dtype (HF rounds
 * after each op: the bits differ in the last place); scores, softmax and the value sums in
 * float32, rounded once.
 */
#include "cpu_amx.h"
#include "cpu_heads.h"

/* p[i] in fmt, rounded to it first. */
static inline void st(void *p, int64_t i, float f, int fmt) {
    store_as(p, i, round_to(f, fmt), fmt);
}

/* Step 2 without AMX. A work item is one sequence's split of its keys (split_count) for a
 * run of its kv heads (all of them where the splits alone give the threads work): a batch
 * of one long context still gives every thread items (with an item a (sequence, kv head),
 * a model of 4 kv heads kept 4 threads busy however many the machine had), and a key's row
 * of all the run's kv heads is read whole, in order, not a kv head's slice of each row in
 * a strided stream of its own. Its units: (kv head, chunk of up to GMAX q heads) pairs,
 * each with its scores and sums. One layer's call, 16 q heads over 4 kv heads of 64, on the
 * 2-core EPYC, against the item a (sequence, kv head) with its scores head-major: 8192
 * keys 1.0 -> 0.55 ms, 32768 4.2 -> 3.0 (its K/V from DRAM: ~11 GB/s of the 25 that
 * two threads' plain streams reach, as a copy of the loops with next to no arithmetic). */
struct head_run {
    const void *k_cache, *v_cache;
    const int64_t *rows;                    /* [n] its first kv head's rows of the keys */
    int64_t n, dh, width;                   /* width: the elements of a row it reads */
    int cfmt;
    float scale;
};

struct head_unit {
    const float *q;                         /* [nh, dh] float32, normed and rotated */
    vf *qp;                                 /* q, pack_heads' */
    int64_t off;                            /* its kv head's row from the run's first */
    int nh;
    const float *sinks;                     /* [nh]: the whole softmax here; or NULL */
    float *scores, *h;                      /* [n, nh] scratch; out [nh, dh] unnormalized */
    float m[GMAX], l[GMAX];
};

/* The unit's scores q.k * scale of keys j0..j1-1 into its scores [n, NH] (key-major). NH
 * a constant at each call: the heads' loops unrolled, their sums in registers. */
static inline __attribute__((always_inline)) void
unit_scores(const struct head_run *a, const struct head_unit *u, const int NH, int64_t j0,
            int64_t j1, const int fmt) {
    const int KB = NH <= 4 ? 8 / NH : 1;    /* keys a dots_keys: NH * KB sums at once */
    const void *k = (const char *)a->k_cache + u->off * (fmt == 2 ? 4 : 2);
    int64_t j = j0;
    for (; j + KB <= j1; j += KB)
        dots_keys(u->q, u->qp, NH, KB, k, a->rows + j, a->dh, fmt, a->scale, u->scores + j * NH);
    for (; j < j1; j++)
        dots_keys(u->q, u->qp, NH, 1, k, a->rows + j, a->dh, fmt, a->scale, u->scores + j * NH);
}

/* The unit's softmax numerators over its scores [n, nh] in place, e^(s - m): m [nh] the
 * largest of each head's scores (or its sink's logit, where larger) and l [nh] their sums
 * (with the sink's e^(sink - m)). VW lanes at a time over the key-major scores: lane e of
 * vector v is head (v VW + e) % nh, a pattern repeating every `period` vectors; each of
 * the period's vectors its own pass, its max and sum in a register. */
static void softmax_keys(float *sc, int64_t n, int nh, const float *sinks, float *m, float *l) {
    const int64_t total = n * nh, whole = total / VW * VW;
    int period = 1;
    while (period * VW % nh)
        period++;
    for (int g = 0; g < nh; g++)
        m[g] = sinks ? sinks[g] : -INFINITY;
    for (int k = 0; k < period; k++) {
        vf vm = (vf){0} - INFINITY;
        for (int64_t i = k * VW; i < whole; i += period * VW) {
            vf x;
            memcpy(&x, sc + i, sizeof x);
            const vi32 gt = x > vm;
            vi32 xa, xb;
            memcpy(&xa, &x, sizeof xa);
            memcpy(&xb, &vm, sizeof xb);
            xa = (xa & gt) | (xb & ~gt);
            memcpy(&vm, &xa, sizeof xa);
        }
        for (int e = 0; e < VW; e++)
            m[(k * VW + e) % nh] = vm[e] > m[(k * VW + e) % nh] ? vm[e] : m[(k * VW + e) % nh];
    }
    for (int64_t t = whole; t < total; t++)
        m[t % nh] = sc[t] > m[t % nh] ? sc[t] : m[t % nh];
    for (int g = 0; g < nh; g++)
        l[g] = sinks ? expf(sinks[g] - m[g]) : 0.f;
    for (int k = 0; k < period; k++) {
        vf vm, vs = (vf){0};
        for (int e = 0; e < VW; e++)
            vm[e] = m[(k * VW + e) % nh];
        for (int64_t i = k * VW; i < whole; i += period * VW) {
            vf x;
            memcpy(&x, sc + i, sizeof x);
            x = vexp(x - vm);
            memcpy(sc + i, &x, sizeof x);
            vs += x;
        }
        for (int e = 0; e < VW; e++)
            l[(k * VW + e) % nh] += vs[e];
    }
    for (int64_t t = whole; t < total; t++)
        l[t % nh] += sc[t] = expf(sc[t] - m[t % nh]);
}

/* h += the unit's probabilities . values of keys j0..j0+nb-1. */
static inline __attribute__((always_inline)) void
unit_values(const struct head_run *a, struct head_unit *u, const int NH, int64_t j0,
            int64_t nb, const int fmt) {
    const void *v = (const char *)a->v_cache + u->off * (fmt == 2 ? 4 : 2);
    add_scaled_block(u->h, u->scores + j0 * NH, 1, NH, v, a->rows + j0, nb, a->dh, fmt, NH);
}

/* A switch on a unit's head count, each case the call with that count a constant. */
#define BY_HEADS(nh, call)                                                                  \
    switch (nh) {                                                                           \
    case 1: call(1); break;                                                                 \
    case 2: call(2); break;                                                                 \
    case 3: call(3); break;                                                                 \
    case 4: call(4); break;                                                                 \
    case 5: call(5); break;                                                                 \
    case 6: call(6); break;                                                                 \
    case 7: call(7); break;                                                                 \
    default: call(GMAX); break;                                                             \
    }

#define KEY_BLOCK 16        /* keys a pass over the units (their rows' lines in L1 between) */
/* Rows up to this many keys ahead are asked into L1 as each pass reads its keys (pf: fewer
 * where rows are long): a paged cache's blocks lie where the allocator put them, and a
 * block of 16 keys is too short a stream for the hardware's prefetch to learn. (Whole rows
 * in order, the hardware's alone kept up on contiguous blocks; a kv head's slice of each
 * row, without these, ran at ~10x its K/V stream's time on a 2-core EPYC.) */
#define PF_KEYS 8
#define VBLOCK 32          /* values a pass over the units (their rows' lines in L1 between) */

/* The cache's rows (the run's width) of the keys a pass will read after j0..j1-1 asked
 * into L1: PF_BYTES' worth ahead, 1 to PF_KEYS rows (4 or 8 kv heads of 128 dims are 1-2
 * KB a row: 8 rows ahead would ask for more lines than L1 has room or misses in flight for). */
static inline __attribute__((always_inline)) void
ask_rows(const struct head_run *a, const void *cache, int64_t j0, int64_t j1, const int fmt) {
    const int64_t size = fmt == 2 ? 4 : 2, bytes = a->width * size;
    const int64_t pf = PF_BYTES / bytes < 1 ? 1 : PF_BYTES / bytes > PF_KEYS ? PF_KEYS
                                                                         : PF_BYTES / bytes;
    for (int64_t j = j0 + pf; j < j1 + pf && j < a->n; j++)
        for (int64_t b = 0; b < bytes; b += 64)
            __builtin_prefetch((const char *)cache + a->rows[j] * size + b, 0, 3);
}

/* A work item's units over its keys: each unit's scores, their softmax's numerators
 * e^(s - m) (m the largest score, or the sink's logit where that is larger), their sum l
 * (with the sink's e^(sink - m)) and h = sum_j e^(s_j - m) v_j. The cache's format fmt a
 * constant at each call (attend): its loads' branches out of the loops. */
static inline __attribute__((always_inline)) void
attend_units(const struct head_run *a, struct head_unit *units, int64_t n_units, const int fmt) {
    const int64_t n = a->n, dh = a->dh;
    /* The scores, KEY_BLOCK keys at a time for all the units, the rows asked for ahead:
     * DRAM sees the keys' rows in order, each read whole. */
    for (int64_t j0 = 0; j0 < n; j0 += KEY_BLOCK) {
        const int64_t j1 = j0 + KEY_BLOCK < n ? j0 + KEY_BLOCK : n;
        ask_rows(a, a->k_cache, j0, j1, fmt);
        for (int64_t i = 0; i < n_units; i++) {
#define SCORES(NH) unit_scores(a, &units[i], NH, j0, j1, fmt)
            BY_HEADS(units[i].nh, SCORES)
#undef SCORES
        }
    }
    for (int64_t i = 0; i < n_units; i++) {
        struct head_unit *u = &units[i];
        softmax_keys(u->scores, n, u->nh, u->sinks, u->m, u->l);
        for (int64_t e = 0; e < u->nh * dh; e++)
            u->h[e] = 0.f;
    }
    /* The values the same way, VBLOCK keys at a time, the heads' sums of a slice of dh in
     * registers across them (add_scaled_block; per key, every head's sums were loaded and
     * stored). The values asked into L2 during the scores' pass were evicted by the keys
     * (an item's keys and values, 512 KB, fill an EPYC's L2) and read again strided. */
    for (int64_t j0 = 0; j0 < n; j0 += VBLOCK) {
        const int64_t nb = n - j0 < VBLOCK ? n - j0 : VBLOCK;
        ask_rows(a, a->v_cache, j0, j0 + nb, fmt);
        for (int64_t i = 0; i < n_units; i++) {
#define VALUES(NH) unit_values(a, &units[i], NH, j0, nb, fmt)
            BY_HEADS(units[i].nh, VALUES)
#undef VALUES
        }
    }
}

static void attend(const struct head_run *a, struct head_unit *units, int64_t n_units) {
    switch (a->cfmt) {
    case 0: attend_units(a, units, n_units, 0); break;
    case 1: attend_units(a, units, n_units, 1); break;
    default: attend_units(a, units, n_units, 2); break;
    }
}

/* A context of n keys is split into this many runs of keys, of about SPLIT_MIN keys or
 * more: at most SPLIT_MOST, so a batch's partial sums stay small. It depends on the
 * context alone: a sequence's bits do not depend on the threads or the batch. */
#define SPLIT_MIN 512
#define SPLIT_MOST 64
static inline int64_t split_count(int64_t n) {
    const int64_t s = (n + SPLIT_MIN - 1) / SPLIT_MIN;
    return s < SPLIT_MOST ? s : SPLIT_MOST;
}

/* A sequence of len keys after this step, seen from key *first on (a window's), in *splits
 * runs of *size keys (the last one shorter). */
static inline void seq_splits(int64_t len, int64_t window, int64_t *first, int64_t *splits,
                              int64_t *size) {
    *first = window > 0 && len > window ? len - window : 0;
    *splits = split_count(len - *first);
    *size = (len - *first + *splits - 1) / *splits;
}

/* A work item of step 2 (either path): its sequence, kv head, q heads h0..h0+nh-1 and keys
 * k0..k1-1; part: its partial softmax where the sequence's keys are split (m [16], l [16],
 * O [nh, dh], joined by decode_join), else NULL. */
struct split_item {
    int64_t b, kv, h0, nh, k0, k1;
    float *part;
};

/* A (sequence, kv head, q head chunk)'s units (n, `stride` apart) joined: out = sum_s
 * e^(m_s - M) O_s / (sum_s e^(m_s - M) l_s + e^(sink - M)), M the largest of the m_s and
 * the sink. */
static void decode_join(const struct split_item *its, int64_t n, int64_t stride, int64_t dh,
                        int64_t hq, const float *sinks, void *out, int fmt) {
    const int64_t b = its[0].b, h0 = its[0].h0, nh = its[0].nh;
    for (int64_t g = 0; g < nh; g++) {
        float big = sinks ? sinks[h0 + g] : -INFINITY;
        for (int64_t s = 0; s < n; s++)
            big = its[s * stride].part[g] > big ? its[s * stride].part[g] : big;
        float denom = sinks ? expf(sinks[h0 + g] - big) : 0.f, w[n];
        for (int64_t s = 0; s < n; s++) {
            w[s] = expf(its[s * stride].part[g] - big);
            denom += w[s] * its[s * stride].part[16 + g];
        }
        for (int64_t d = 0; d < dh; d++) {
            float o = 0.f;
            for (int64_t s = 0; s < n; s++)
                o += w[s] * its[s * stride].part[32 + g * dh + d];
            st(out, (b * hq + h0 + g) * dh + d, o / denom, fmt);
        }
    }
}

/* A sequence takes the tiles from this many keys (its window's), the loop below them. In a
 * decode program, whose weights' stream between two layers' steps leaves their keys, code
 * and scratch cold, the loop took 16.7 / 30.1 / 48.4 / 95.8 us a layer where the tiles
 * took 21.5 / 36.8 / 67.7 / 88.3 (INT4 bench model, batch 1, 2-core Xeon: contexts from
 * 16, 200, 450 and 900 keys and the 100 after each; warm and alone, the tiles win from
 * ~256). Chosen per sequence, on its own keys: its bits do not depend on its batch. */
#define AMX_DECODE_KEYS 768

#if FT_AMX
/* Step 2 on AMX tiles, where the step is bf16 (q rounded to bf16 in step 1, a bf16 cache)
 * and the cache's blocks hold whole 16-key tiles. The scalar loop above spent ~100
 * instructions a key and kv head on its dots' horizontal sums, scalar exps and reloaded
 * sums: a 16k-token context decoded at ~4 GB/s of K/V on a 2-core Xeon. Here a unit is one
 * sequence, kv head, up to 16 of its q heads and up to SPLIT_KEYS keys:
 *   scores S^T [keys, heads] = K Q^T on tiles (an A tile 16 keys x 32 dims as the cache holds
 *     them, a B tile q's 16 dim pairs x 16 heads): bf16 x bf16 products summed in float32,
 *     as the loop's float32 dot of the same values, in another order;
 *   the softmax down the key rows in float32 (a vector of heads a key), partial over the
 *     unit's keys: its max m, its sum l and O = sum e^(s - m) v in float32 (v widened, 4 heads
 *     x 64 dims of sums in registers a pass);
 * and a (sequence, kv head, q heads)'s units are joined by their maxes, the sink's logit
 * joining the denominator. A work item is a split's units of a run of kv heads (all of them
 * where there are splits enough for the threads), tile by tile: the 16 keys' slots are read
 * whole and in order, not a head's slice at a time. The splits depend on the context alone,
 * so the bits do not depend on the thread count. */
#define SPLIT_KEYS 512
#define HEADS_AMX 16

static inline __attribute__((always_inline)) void pv_pass(
        const struct split_item *it, int gn, int dn, int64_t g0, int64_t d0, int64_t dh,
        int64_t hk, const uint16_t *v_cache, int64_t bs, const int32_t *table, const float *sc,
        int64_t t0, float *part) {
    __m512 acc[4][4];
    for (int g = 0; g < 4; g++)
        for (int d = 0; d < 4; d++)
            acc[g][d] = _mm512_setzero_ps();
    for (int64_t j = it->k0; j < it->k1; j++) {
        const uint16_t *v = v_cache + key_row(table, j, bs, hk, it->kv, dh) + d0;
        const float *p = sc + (j - t0) * 16 + g0;
        __m512 vv[4];
        for (int d = 0; d < dn; d++)
            vv[d] = widen_bf16(_mm256_loadu_si256((const __m256i *)(v + 16 * d)));
        for (int g = 0; g < gn; g++) {
            const __m512 pg = _mm512_set1_ps(p[g]);
            for (int d = 0; d < dn; d++)
                acc[g][d] = _mm512_fmadd_ps(pg, vv[d], acc[g][d]);
        }
    }
    for (int g = 0; g < gn; g++)
        for (int d = 0; d < dn; d++)
            _mm512_storeu_ps(part + 32 + (g0 + g) * dh + d0 + 16 * d, acc[g][d]);
}

/* q's B tiles for a unit: [dc] 16 dim pairs x 16 heads (heads past nh zero). */
static void pack_q(const struct split_item *it, const float *q_scratch, int64_t hq, int64_t dh,
                   uint16_t *qp) {
    for (int64_t dc = 0; dc < dh / 32; dc++) {
        __m512 v[16];
        for (int g = 0; g < 16; g++) {
            if (g < it->nh) {
                const float *q = q_scratch + (it->b * hq + it->h0 + g) * dh + 32 * dc;
                v[g] = (__m512)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + 16),
                                                   _mm512_loadu_ps(q));
            } else {
                v[g] = _mm512_setzero_ps();
            }
        }
        transpose16(v);
        for (int i = 0; i < 16; i++)
            _mm512_store_ps((float *)(qp + dc * 512 + 32 * i), v[i]);
    }
}

/* A unit's softmax and value sums, its scores sc [keys from t0, 16] in place. */
static void finish_unit(const struct split_item *it, int64_t dh, int64_t hk,
                        const uint16_t *v_cache, int64_t bs, const int32_t *table, float scale,
                        float *sc) {
    const int64_t t0 = it->k0 & ~(int64_t)15, rows = (it->k1 - t0 + 15) / 16 * 16;
    /* scaled (one rounding, as the loop's s * scale), keys outside [k0, k1) -inf */
    const __m512 vscale = _mm512_set1_ps(scale), neg_inf = _mm512_set1_ps(-INFINITY);
    __m512 m = neg_inf;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t j = t0 + r;
        __m512 x = _mm512_mul_ps(_mm512_load_ps(sc + 16 * r), vscale);
        if (j < it->k0 || j >= it->k1)
            x = neg_inf;
        _mm512_store_ps(sc + 16 * r, x);
        m = _mm512_max_ps(m, x);
    }
    __m512 l = _mm512_setzero_ps();
    for (int64_t r = it->k0 - t0; r < it->k1 - t0; r++) {
        const __m512 p = exp16(_mm512_sub_ps(_mm512_load_ps(sc + 16 * r), m));
        _mm512_store_ps(sc + 16 * r, p);
        l = _mm512_add_ps(l, p);
    }
    float *part = it->part;
    _mm512_storeu_ps(part, m);
    _mm512_storeu_ps(part + 16, l);
    /* O [nh, dh] = sum_j p_j v_j: 4 heads x 64 dims of sums in registers a pass */
    for (int64_t g0 = 0; g0 < it->nh; g0 += 4) {
        const int gn = it->nh - g0 < 4 ? (int)(it->nh - g0) : 4;
        for (int64_t d0 = 0; d0 < dh; d0 += 64) {
            const int dn = dh - d0 < 64 ? (int)((dh - d0) / 16) : 4;
            if (gn == 4 && dn == 4)          /* (constant bounds: the sums stay in registers) */
                pv_pass(it, 4, 4, g0, d0, dh, hk, v_cache, bs, table, sc, t0, part);
            else
                pv_pass(it, gn, dn, g0, d0, dh, hk, v_cache, bs, table, sc, t0, part);
        }
    }
}

/* A work item: units its[0..n) of one sequence and split (the same keys), kv heads in order
 * with their q head chunks; sc holds n units' scores, qp their q tiles. */
static void decode_units(const struct split_item *its, int64_t n, const float *q_scratch,
                         int64_t hq, int64_t hk, int64_t dh, const uint16_t *k_cache,
                         const uint16_t *v_cache, int64_t bs, const int32_t *table, float scale,
                         float *sc, uint16_t *qp) {
    const int64_t dc_count = dh / 32, k0 = its[0].k0, k1 = its[0].k1, t0 = k0 & ~(int64_t)15;
    const int64_t sc_floats = (SPLIT_KEYS + 32) * 16, kstride = hk * dh * 2;
    const int64_t kv0 = its[0].kv, kv1 = its[n - 1].kv + 1;
    for (int64_t u = 0; u < n; u++)
        pack_q(&its[u], q_scratch, hq, dh, qp + u * dc_count * 512);
    for (int64_t j = t0; j < k1; j += 16) {
        const int64_t slot = (int64_t)table[j / bs] * bs + j % bs;
        /* Asked for ahead: the keys two tiles on (into L1) and this tile's values (into L2,
         * for the value passes after the scores), the item's heads' lines of 16 slots. A
         * head's slice of a tile is 16 rows strided by the other heads', scattered by the
         * block table: the hardware's prefetch alone left a thread waiting on each. */
        const int64_t jn = j + 32 < k1 ? j + 32 : -1;
        const int64_t next = jn < 0 ? -1 : (int64_t)table[jn / bs] * bs + jn % bs;
        for (int r = 0; r < 16; r++)
            for (int64_t line = kv0 * dh * 2; line < kv1 * dh * 2; line += 64) {
                if (next >= 0)
                    _mm_prefetch((const char *)k_cache + (next + r) * kstride + line,
                                 _MM_HINT_T0);
                _mm_prefetch((const char *)v_cache + (slot + r) * kstride + line, _MM_HINT_T1);
            }
        for (int64_t u = 0; u < n; u++) {
            const uint16_t *k = k_cache + (slot * hk + its[u].kv) * dh;
            const uint16_t *q = qp + u * dc_count * 512;
            _tile_zero(0);
            for (int64_t dc = 0; dc < dc_count; dc++) {
                _tile_loadd(4, k + 32 * dc, kstride);
                _tile_loadd(6, q + dc * 512, 64);
                _tile_dpbf16ps(0, 4, 6);
            }
            _tile_stored(0, sc + u * sc_floats + (j - t0) * 16, 64);
        }
    }
    for (int64_t u = 0; u < n; u++)
        finish_unit(&its[u], dh, hk, v_cache, bs, table, scale, sc + u * sc_floats);
}

#endif

/* Whether a step in fmt over a cache in cfmt, heads of dh, blocks of bs takes AMX's tiles
 * (decode_units) here: bf16 both, dh a multiple of 32 up to 256, bs of 16, a build and CPU
 * with AMX-BF16 whose tile state the kernel grants. */
int ft_attn_decode_tiles(int fmt, int cfmt, int64_t dh, int64_t bs) {
#if FT_AMX
    return fmt == 0 && cfmt == 0 && dh % 32 == 0 && dh <= 256 && bs % 16 == 0
        && amx_permitted();
#else
    (void)fmt, (void)cfmt, (void)dh, (void)bs;
    return 0;
#endif
}

int ft_attn_decode(const void *qkv, int fmt, int64_t b_count, int64_t hq, int64_t hk,
                   int64_t dh, const float *q_norm, const float *k_norm, float eps,
                   const float *cos_sin, int64_t n_pos, int64_t r, int interleaved,
                   int gated, const int64_t *pos, void *k_cache, void *v_cache, int cfmt, int64_t nb,
                   int64_t bs, const int64_t *slots, const int32_t *tables, int64_t max_blocks,
                   const int32_t *lens, int64_t window, const float *sinks, float scale,
                   int threads, float *q_scratch, void *out) {
    const int64_t qw = gated ? 2 * dh : dh, width = hq * qw + 2 * hk * dh;
    const int64_t longest = decode_indices(b_count, lens, pos, n_pos, slots, tables, max_blocks,
                                           nb, bs);
    if (longest < 0)
        return -2;
    /* Step 2 takes a kv head's q heads GMAX at a time (a chunk: each key and value row
     * read and widened once for all of them, not once a q head). */
    const int64_t group = hq / hk, chunk = group < GMAX ? group : GMAX;
    int bad = 0;
#if FT_AMX
    /* Step 2 on AMX (decode_units), where it applies. Units in (sequence, split, kv head,
     * q head chunk) order; work items a split's units of `per` kv heads; each (sequence,
     * kv head, chunk)'s units joined after, splits_b of them, `per_split` apart. */
    const int tiles = ft_attn_decode_tiles(fmt, cfmt, dh, bs);
    const int64_t hchunks = (group + HEADS_AMX - 1) / HEADS_AMX, per_split = hk * hchunks;
    int64_t n_units = 0, n_splits = 0;
    for (int64_t b = 0; tiles && b < b_count; b++) {
        const int64_t first = window > 0 && lens[b] > window ? lens[b] - window : 0;
        if (lens[b] - first >= AMX_DECODE_KEYS)
            n_splits += (lens[b] - (first & ~(int64_t)15) + SPLIT_KEYS - 1) / SPLIT_KEYS;
    }
    const int amx = n_splits > 0;           /* some sequence takes the tiles */
    n_units = n_splits * per_split;
    const int64_t per = n_splits >= threads ? hk : 1;       /* kv heads a work item */
    struct split_item *items = amx ? malloc((n_units + 1) * sizeof *items) : NULL;
    int64_t *split_at = amx ? malloc((b_count + 1) * sizeof *split_at) : NULL;
    const int64_t part_floats = 32 + (group < HEADS_AMX ? group : HEADS_AMX) * dh;
    float *parts = amx ? malloc((n_units + 1) * part_floats * sizeof *parts) : NULL;
    if (amx && (!items || !split_at || !parts)) {
        free(items), free(split_at), free(parts);
        return -1;
    }
    for (int64_t b = 0, i = 0, sp = 0; amx && b < b_count; b++) {
        const int64_t first = window > 0 && lens[b] > window ? lens[b] - window : 0;
        split_at[b] = sp;
        for (int64_t k0 = first & ~(int64_t)15;
             lens[b] - first >= AMX_DECODE_KEYS && k0 < lens[b]; k0 += SPLIT_KEYS, sp++)
            for (int64_t kv = 0; kv < hk; kv++)
                for (int64_t hc = 0; hc < hchunks; hc++, i++)
                    items[i] = (struct split_item){
                        b, kv, kv * group + hc * HEADS_AMX,
                        group - hc * HEADS_AMX < HEADS_AMX ? group - hc * HEADS_AMX : HEADS_AMX,
                        k0 > first ? k0 : first,
                        k0 + SPLIT_KEYS < lens[b] ? k0 + SPLIT_KEYS : lens[b],
                        parts + i * part_floats};
        split_at[b + 1] = sp;
    }
    const int64_t sc_bytes = per * hchunks * ((SPLIT_KEYS + 32) * 16 + (dh / 32) * 512) * 4;
#else
    const int tiles = 0;
#endif
    /* Step 2 without AMX (attend_units): units in (sequence, split, kv head, q head chunk)
     * order, a sequence's from unit_at[b], a split sequence's joined after, `per_split_g`
     * apart; a work item `per` kv heads' units of a split. most_keys: the longest split. */
    const int64_t chunks = (group + chunk - 1) / chunk, per_split_g = hk * chunks;
    const int64_t part_g = 32 + chunk * dh;
    int64_t n_g = 0, n_parts = 0, most_keys = 1, splits_all = 0;
    for (int64_t b = 0; b < b_count; b++) {
        int64_t first, splits, size;
        seq_splits(lens[b], window, &first, &splits, &size);
        if (tiles && lens[b] - first >= AMX_DECODE_KEYS)
            continue;                       /* (the tiles') */
        n_g += splits * per_split_g;
        n_parts += splits > 1 ? splits * per_split_g : 0;
        most_keys = size > most_keys ? size : most_keys;
        splits_all += splits;
    }
    const int64_t per_g = splits_all >= threads ? hk : 1, units_w = per_g * chunks;
    struct split_item *g_units = malloc((n_g + 1) * sizeof *g_units);
    int64_t *unit_at = malloc((b_count + 1) * sizeof *unit_at);
    float *g_parts = malloc((n_parts + 1) * part_g * sizeof *g_parts);
    if (!g_units || !unit_at || !g_parts) {
        free(g_units), free(unit_at), free(g_parts);
#if FT_AMX
        free(items), free(split_at), free(parts);
#endif
        return -1;
    }
    for (int64_t b = 0, i = 0, p = 0; b < b_count; b++) {
        int64_t first, splits, size;
        seq_splits(lens[b], window, &first, &splits, &size);
        unit_at[b] = i;
        for (int64_t s = 0; !(tiles && lens[b] - first >= AMX_DECODE_KEYS) && s < splits; s++)
            for (int64_t kv = 0; kv < hk; kv++)
                for (int64_t c = 0; c < chunks; c++, i++) {
                    const int64_t h0 = kv * group + c * chunk;
                    const int64_t k0 = first + s * size;
                    g_units[i] = (struct split_item){
                        b, kv, h0, h0 + chunk <= (kv + 1) * group ? chunk : (kv + 1) * group - h0,
                        k0, k0 + size < lens[b] ? k0 + size : lens[b],
                        splits > 1 ? g_parts + p++ * part_g : NULL};
                }
        unit_at[b + 1] = i;
    }
#pragma omp parallel num_threads(threads)
    {
        float *h = malloc(units_w * chunk * dh * sizeof *h);   /* (step 1's too) */
#if FT_AMX
        /* the tiles' scores and q tiles, or the loop's scores: the larger, both may run */
        const int64_t loop_bytes = units_w * chunk * most_keys * (int64_t)sizeof(float);
        float *scores = aligned_alloc(64, ((amx && sc_bytes > loop_bytes ? sc_bytes : loop_bytes)
                                           + 63) / 64 * 64);
#else
        float *scores = malloc(units_w * chunk * most_keys * sizeof *scores);
#endif
        int64_t *rows = malloc(most_keys * sizeof *rows);
        struct head_unit *units = malloc(units_w * sizeof *units);
        vf *qps = aligned_alloc(64, (units_w * chunk * (dh / VW) + 1) * sizeof *qps);
        if (!h || !scores || !rows || !units || !qps)
            __atomic_store_n(&bad, 1, __ATOMIC_RELAXED);
#pragma omp barrier
        if (!__atomic_load_n(&bad, __ATOMIC_RELAXED)) {
            /* 1. Per (sequence, head): q normed and rotated into the scratch; k normed,
             *    rotated and v, as they are, into the cache slot of the new token. */
#pragma omp for schedule(static)
            for (int64_t item = 0; item < b_count * (hq + hk); item++) {
                int64_t b = item / (hq + hk), head = item % (hq + hk);
                const float *cs = cos_sin + pos[b] * r;
                int64_t base = b * width + (head < hq ? head * qw : hq * qw + (head - hq) * dh);
                for (int64_t d = 0; d < dh; d++)
                    h[d] = load_as(qkv, base + d, fmt);
                if (head < hq) {
                    norm_rope(h, dh, q_norm, eps, cs, r, interleaved);
                    for (int64_t d = 0; d < dh; d++)
                        q_scratch[(b * hq + head) * dh + d] = round_to(h[d], fmt);
                } else if (slots[b] >= 0) {
                    int64_t kv = head - hq;
                    norm_rope(h, dh, k_norm, eps, cs, r, interleaved);
                    int64_t at = (slots[b] * hk + kv) * dh;
                    int64_t vbase = b * width + hq * qw + (hk + kv) * dh;
                    for (int64_t d = 0; d < dh; d++) {
                        st(k_cache, at + d, round_to(h[d], fmt), cfmt);
                        st(v_cache, at + d, load_as(qkv, vbase + d, fmt), cfmt);
                    }
                }
            }                               /* (the for's implicit barrier) */
            /* 2. Per split of a sequence's keys (the window's) and chunk of a kv head's q
             *    heads: softmax(q.k * scale) . v, partial where the keys are split, the splits
             *    joined by their maxes, a sink's logit joining the softmax without a value. */
#if FT_AMX
            if (amx) {
                load_tiles();
                uint16_t *qp = (uint16_t *)(scores + per * hchunks * (SPLIT_KEYS + 32) * 16);
                const int64_t per_item = per * hchunks, blocks = hk / per;
#pragma omp for schedule(dynamic)
                for (int64_t w = 0; w < n_splits * blocks; w++) {
                    const struct split_item *its = items + w * per_item;
                    decode_units(its, per_item, q_scratch, hq, hk, dh,
                                 (const uint16_t *)k_cache, (const uint16_t *)v_cache, bs,
                                 tables + its->b * max_blocks, scale, scores, qp);
                }
#pragma omp for schedule(static)
                for (int64_t g = 0; g < b_count * per_split; g++) {
                    const int64_t b = g / per_split, first = split_at[b] * per_split + g % per_split;
                    if (split_at[b + 1] > split_at[b])      /* (else the loop's sequence) */
                        decode_join(items + first, split_at[b + 1] - split_at[b], per_split, dh,
                                    hq, sinks, out, fmt);
                }
                _tile_release();
            }
#endif
            /* The loop's sequences (all of them without AMX): each work item's keys through
             * attend_units, each unit's sums to out where the keys are all its sequence's,
             * else to its partial; then the splits joined. */
#pragma omp for schedule(dynamic)
            for (int64_t w = 0; w < n_g / units_w; w++) {
                const struct split_item *its = g_units + w * units_w;
                key_rows(tables + its->b * max_blocks, its->k0, its->k1, bs, hk, its->kv, dh,
                         rows);
                const struct head_run run = {k_cache, v_cache, rows, its->k1 - its->k0, dh,
                                             per_g * dh, cfmt, scale};
                for (int64_t i = 0; i < units_w; i++) {
                    const struct split_item *it = &its[i];
                    units[i] = (struct head_unit){
                        q_scratch + (it->b * hq + it->h0) * dh, qps + i * chunk * (dh / VW),
                        (it->kv - its->kv) * dh, (int)it->nh,
                        sinks && !it->part ? sinks + it->h0 : NULL,
                        scores + i * chunk * most_keys,
                        it->part ? it->part + 32 : h + i * chunk * dh, {0}, {0}};
                    pack_heads(units[i].q, it->nh, dh, units[i].qp);
                }
                attend(&run, units, units_w);
                for (int64_t i = 0; i < units_w; i++) {
                    const struct split_item *it = &its[i];
                    const struct head_unit *u = &units[i];
                    for (int64_t g = 0; g < it->nh; g++) {
                        if (it->part) {
                            it->part[g] = u->m[g], it->part[16 + g] = u->l[g];
                            continue;
                        }
                        for (int64_t d = 0; d < dh; d++)
                            st(out, (it->b * hq + it->h0 + g) * dh + d, u->h[g * dh + d] / u->l[g],
                               fmt);
                    }
                }
            }
#pragma omp for schedule(static)
            for (int64_t g = 0; g < b_count * per_split_g; g++) {
                const int64_t b = g / per_split_g, first = unit_at[b] + g % per_split_g;
                const int64_t splits = (unit_at[b + 1] - unit_at[b]) / per_split_g;
                if (splits > 1)
                    decode_join(g_units + first, splits, per_split_g, dh, hq, sinks, out, fmt);
            }
        }
        free(h);
        free(scores);
        free(rows);
        free(units);
        free(qps);
    }
    free(g_units), free(unit_at), free(g_parts);
#if FT_AMX
    free(items), free(split_at), free(parts);
#endif
    return bad ? -1 : 0;
}
