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

/* Step 2's loop for one (sequence, kv head, chunk of NH q heads): the scores q.k * scale
 * of every key (the window's) into scores [NH, n], their softmax (a sink's logit joining the
 * denominator, denom [NH]), and h [NH, dh] = sum_j p_j v_j, unnormalized. NH a constant at
 * each call (the heads' loops unrolled, their sums in registers: with the count at run time
 * its loops' compares and branches were a sixth of a long context's time). */
struct head_run {
    const float *q;                         /* [NH, dh] float32, normed and rotated */
    const void *k_cache, *v_cache;
    const int32_t *table;
    int64_t bs, hk, kv, dh;
    int cfmt;
    int64_t first, len;                     /* the keys: first .. len - 1 */
    float scale;
    const float *sinks;                     /* the chunk's [NH] or NULL */
    float *scores, *h;
};

static inline __attribute__((always_inline)) void
attend_heads(const struct head_run *a, const int NH, float *denom) {
    const int64_t n = a->len - a->first, dh = a->dh;
    for (int64_t j = a->first; j < a->len; j++) {
        if (j + PF_KEYS < a->len)
            prefetch_row(a->k_cache, key_row(a->table, j + PF_KEYS, a->bs, a->hk, a->kv, dh),
                         dh, a->cfmt);
        dots_heads(a->q, NH, a->k_cache, key_row(a->table, j, a->bs, a->hk, a->kv, dh), dh,
                   a->cfmt, a->scale, a->scores + (j - a->first), n);
    }
    for (int g = 0; g < NH; g++) {
        float *sc = a->scores + g * n;
        float m = a->sinks ? a->sinks[g] : -INFINITY;
        for (int64_t j = 0; j < n; j++)
            m = sc[j] > m ? sc[j] : m;
        denom[g] = (a->sinks ? expf(a->sinks[g] - m) : 0.f) + exps_less(sc, n, m);
    }
    for (int64_t i = 0; i < NH * dh; i++)
        a->h[i] = 0.f;
    /* the values a block of keys at a time, the heads' sums of a slice of dh in registers
     * across the block (add_scaled_block; per key, every head's sums were loaded and stored) */
    for (int64_t j0 = a->first; j0 < a->len; j0 += ROW_BLOCK) {
        const int64_t nb = a->len - j0 < ROW_BLOCK ? a->len - j0 : ROW_BLOCK;
        int64_t rows[ROW_BLOCK];
        for (int64_t j = 0; j < nb; j++) {
            rows[j] = key_row(a->table, j0 + j, a->bs, a->hk, a->kv, dh);
            prefetch_row(a->v_cache, rows[j], dh, a->cfmt);
        }
        add_scaled_block(a->h, a->scores + (j0 - a->first), n, a->v_cache, rows, nb, dh,
                         a->cfmt, NH);
    }
}

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

struct split_item {
    int64_t b, kv, h0, nh, k0, k1;       /* its q heads h0..h0+nh-1, keys k0..k1-1 */
    float *part;                         /* m [16], l [16], O [nh, dh] */
};

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
    const int amx = ft_attn_decode_tiles(fmt, cfmt, dh, bs);
    const int64_t hchunks = (group + HEADS_AMX - 1) / HEADS_AMX, per_split = hk * hchunks;
    int64_t n_units = 0, n_splits = 0;
    for (int64_t b = 0; amx && b < b_count; b++) {
        const int64_t first = window > 0 && lens[b] > window ? lens[b] - window : 0;
        n_splits += (lens[b] - (first & ~(int64_t)15) + SPLIT_KEYS - 1) / SPLIT_KEYS;
    }
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
        for (int64_t k0 = first & ~(int64_t)15; k0 < lens[b]; k0 += SPLIT_KEYS, sp++)
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
    const int amx = 0;
#endif
#pragma omp parallel num_threads(threads)
    {
        float *h = malloc(chunk * dh * sizeof *h);             /* (step 1's too) */
#if FT_AMX
        float *scores = amx ? aligned_alloc(64, sc_bytes) : malloc(chunk * longest * sizeof *scores);
#else
        float *scores = malloc(chunk * longest * sizeof *scores);
#endif
        if (!h || !scores)
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
            /* 2. Per (sequence, kv head, chunk of its q heads): softmax(q.k * scale) . v over
             *    the keys (the window's), a sink's logit joining the softmax without a value. */
            const int64_t chunks = amx ? 0 : (group + chunk - 1) / chunk;
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
                    decode_join(items + first, split_at[b + 1] - split_at[b], per_split, dh, hq,
                                sinks, out, fmt);
                }
                _tile_release();
            }
#endif
#pragma omp for schedule(static)
            for (int64_t item = 0; item < b_count * hk * chunks; item++) {
                int64_t b = item / (hk * chunks), kv = item / chunks % hk;
                int64_t h0 = kv * group + item % chunks * chunk;       /* its first q head */
                int64_t nh = h0 + chunk <= (kv + 1) * group ? chunk : (kv + 1) * group - h0;
                int64_t len = lens[b], first = window > 0 && len > window ? len - window : 0;
                struct head_run run = {q_scratch + (b * hq + h0) * dh, k_cache, v_cache,
                                       tables + b * max_blocks, bs, hk, kv, dh, cfmt, first,
                                       len, scale, sinks ? sinks + h0 : NULL, scores, h};
                float denom[GMAX];
                switch (nh) {       /* the head count a constant: its loops unrolled */
                case 1: attend_heads(&run, 1, denom); break;
                case 2: attend_heads(&run, 2, denom); break;
                case 3: attend_heads(&run, 3, denom); break;
                case 4: attend_heads(&run, 4, denom); break;
                case 5: attend_heads(&run, 5, denom); break;
                case 6: attend_heads(&run, 6, denom); break;
                case 7: attend_heads(&run, 7, denom); break;
                default: attend_heads(&run, GMAX, denom); break;
                }
                for (int64_t g = 0; g < nh; g++)
                    for (int64_t d = 0; d < dh; d++)
                        st(out, (b * hq + h0 + g) * dh + d, h[g * dh + d] / denom[g], fmt);
            }
        }
        free(h);
        free(scores);
    }
#if FT_AMX
    free(items), free(split_at), free(parts);
#endif
    return bad ? -1 : 0;
}
