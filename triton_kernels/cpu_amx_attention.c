/* A step's causal attention over the paged KV cache on AMX's bf16 tiles, for a CPU engine's
 * prefill chunks (min_q 2: the caller keeps a step's single-token rows on its decode path):
 * GQA, a sliding window, sinks.
 *
 * Why: torch's path (paged_attention_reference: SDPA's CPU flash attention on gathered keys)
 * ran at ~210-340 GFLOP/s on a 2-core Xeon, and 55% of a 4096-token prefill of the bench
 * model; with gpt-oss's sinks it spells the softmax out in torch ops (~20 GFLOP/s). Here both products
 * run on tiles and the online softmax in AVX-512: 790-1000 GFLOP/s on the same box (2.8-4x
 * torch's on a whole 4096-token prompt, 1.4-1.9x on a 512-token chunk over the rest of one,
 * where torch's kernel is at its best; `python bench/cpu_attention.py`).
 *
 * A work item is 32 "columns" of one sequence and kv head: (query, head of the kv head's
 * group) pairs, query-major, so a GQA group's heads share every key and value tile, and a
 * decode row (one query) fills G of them. Both products are computed transposed:
 *   S^T [keys, cols] = K Q^T: an A tile is 16 keys x 32 dims read from the cache as they lie
 *     (16 keys of one block; rows Hk * Dk apart), a B tile 16 dim pairs x 16 columns of q,
 *     packed once per item (a 16 x 16 32-bit transpose);
 *   O^T [Dv, cols] += V^T P^T: an A tile is 16 value dims x 32 keys, from a copy of the
 *     sequence's V transposed once per (sequence, kv head) in phase 1, a B tile the
 *     probabilities of 32 keys x 16 columns in pairs, written by the softmax.
 * With keys as rows, the softmax's reductions run down the rows (one vector op a key, no
 * horizontal sums) and its rescaling of O^T multiplies each row by a vector of columns.
 *
 * Numerics as torch's CPU flash attention and paged_attention_triton: scores in float32 (bf16
 * products), an online softmax over blocks of 64 keys in float32 (in the log2 domain: one
 * fused multiply-subtract and a 2^x a score), the probabilities rounded to bf16 for the value
 * product (unnormalized, e^(s - running max)), its sums in float32, the output acc / l
 * rounded once. Block edges differ from torch's, so the bf16 probabilities
 * differ in the last bits where a running max changes; outputs agree within a bf16 step or
 * two, as any two flash attentions do.
 *
 * Shapes: q [T, Hq, Dk] bf16 (contiguous; sequence b's queries are rows cu[b]..cu[b+1]-1 at
 * positions lens[b] - n_q .. lens[b] - 1, their keys already in the cache); k_cache [NB, BS,
 * Hk, Dk] and v_cache [NB, BS, Hk, Dv] bf16 with the given element strides (block, slot,
 * head; the last dim contiguous); tables [B, M] int32 (row stride tstride); window 0 (none)
 * or W: a query at p sees keys p - W < j <= p; sinks [Hq] f32 or NULL; out [T, Hq, Dv] bf16.
 * Dk a multiple of 32 up to 256, Dv of 16 up to 256, BS of 16, Hq of Hk. Sequences of fewer
 * than min_q new tokens are skipped (their rows of out untouched).
 * Returns 0; -1 no AMX here (built without it, or the kernel denied the tile state), -2 a
 * block id outside the cache, -3 shapes it does not take, -4 scratch too small.
 */
#include "cpu_amx.h"
#include "cpu_prefill.h"

#define COLS 32              /* columns (query, head) of a work item: 2 B tiles */
#define KEYS 64              /* keys of a softmax block: 4 key tiles */
#define TILE_BYTES 1024

/* A pair's V^T copy: its keys from the first any of its queries sees (aligned down to 32) to
 * its end, in 32-key chunks of Dv / 16 A tiles. */
static int64_t pack_first(int64_t n_q, int64_t len, int64_t window) {
    return prefill_first(n_q, len, window) & ~31;
}

static int64_t pack_chunks(int64_t n_q, int64_t len, int64_t window) {
    return (len - pack_first(n_q, len, window) + 31) / 32;
}

struct amx_shape {
    int64_t dv, window;
};

static void pair_plan(int64_t n_q, int64_t len, const void *shape, struct prefill_pair *p) {
    const struct amx_shape *f = shape;
    p->first = pack_first(n_q, len, f->window);
    p->units = pack_chunks(n_q, len, f->window);
    p->bytes = p->units * (f->dv / 16) * TILE_BYTES;
}

/* A thread's own buffers: packed q, S^T, P^T, O^T. */
static int64_t thread_bytes(int64_t dk, int64_t dv) {
    return (dk / 32) * 2 * TILE_BYTES + 2 * KEYS * 16 * 4 + 4 * TILE_BYTES
        + (dv / 16) * 2 * TILE_BYTES;
}

int64_t ft_attn_amx_scratch(const int32_t *cu, const int32_t *lens, int64_t b_count,
                            int64_t min_q, int64_t hk, int64_t dk, int64_t dv, int64_t window,
                            int threads, int64_t pack_cap) {
    const struct amx_shape f = {dv, window};
    return prefill_scratch(cu, lens, b_count, min_q, hk, threads, thread_bytes(dk, dv), pack_cap,
                           pair_plan, &f);
}

#if FT_AMX

struct attn {
    const uint16_t *q, *kc, *vc;
    const int32_t *tables, *cu, *lens;
    const float *sinks;
    uint16_t *out;
    int64_t hq, hk, dk, dv, bs, tstride, window;
    int64_t ksb, kss, ksh, vsb, vss, vsh;       /* cache strides (elements) */
    float scale;
};

static inline const uint16_t *key_row(const struct attn *a, int64_t b, int64_t h, int64_t j) {
    const int64_t block = a->tables[b * a->tstride + j / a->bs];
    return a->kc + block * a->ksb + (j % a->bs) * a->kss + h * a->ksh;
}

static inline const uint16_t *value_row(const struct attn *a, int64_t b, int64_t h, int64_t j) {
    const int64_t block = a->tables[b * a->tstride + j / a->bs];
    return a->vc + block * a->vsb + (j % a->bs) * a->vss + h * a->vsh;
}

/* Phase 1: chunk ch (keys first + 32 ch ..) of a pair's V^T (its copy, from first, a multiple
 * of 32): for each 16 value dims, an A tile [16 dims, 32 keys]; keys past the sequence's end
 * are zeros (a probability 0 times a stale value would still be a nan where the value is
 * one). */
static void pack_values(const void *at, const struct prefill_pair *p, int64_t ch) {
    const struct attn *a = at;
    const int64_t len = a->lens[p->b], j0 = p->first + 32 * ch, dt_count = a->dv / 16;
    for (int64_t dt = 0; dt < dt_count; dt++) {
        __m512 r[16];
        for (int i = 0; i < 16; i++) {          /* r[i] lane d: keys 2i, 2i+1 of dim d */
            const int64_t je = j0 + 2 * i, jo = je + 1;
            const __m256i ve = je < len ? _mm256_loadu_si256(
                (const __m256i *)(value_row(a, p->b, p->h, je) + 16 * dt)) : _mm256_setzero_si256();
            const __m256i vo = jo < len ? _mm256_loadu_si256(
                (const __m256i *)(value_row(a, p->b, p->h, jo) + 16 * dt)) : _mm256_setzero_si256();
            r[i] = _mm512_castsi512_ps(_mm512_or_si512(
                _mm512_cvtepu16_epi32(ve), _mm512_slli_epi32(_mm512_cvtepu16_epi32(vo), 16)));
        }
        transpose16(r);                          /* r[d]: dim d's 32 keys */
        uint16_t *tile = (uint16_t *)p->copy + (ch * dt_count + dt) * (TILE_BYTES / 2);
        for (int d = 0; d < 16; d++)
            _mm512_store_ps((float *)(tile + 32 * d), r[d]);
    }
}

/* Phase 2: work item rb of a pair: columns 32 rb .. of its (query, head) pairs. */
static void attend(const void *at, const struct prefill_pair *p, int64_t rb, uint8_t *mine) {
    const struct attn *a = at;
    const int64_t g_count = a->hq / a->hk, b = p->b, h = p->h;
    const int64_t n_q = a->cu[b + 1] - a->cu[b], len = a->lens[b], p0 = len - n_q;
    const int64_t c0 = rb * COLS, n_cols = n_q * g_count - c0 < COLS ? n_q * g_count - c0 : COLS;
    const int64_t dc_count = a->dk / 32, dt_count = a->dv / 16;
    uint16_t *qp = (uint16_t *)mine;                                    /* [dc][ct] B tiles */
    float *s = (float *)(mine + dc_count * 2 * TILE_BYTES);             /* [ct][KEYS][16] */
    uint16_t *pt = (uint16_t *)((uint8_t *)s + 2 * KEYS * 16 * 4);      /* [chunk][ct] B tiles */
    float *o = (float *)((uint8_t *)pt + 4 * TILE_BYTES);               /* [dt][ct] C tiles */

    /* Columns past the item's end repeat its last one's position (their q is zero, their
     * output unused), so no column is without a visible key. */
    int32_t pos[COLS] __attribute__((aligned(64)));
    int64_t row[COLS], head[COLS];
    for (int c = 0; c < COLS; c++) {
        const int64_t r = c0 + (c < n_cols ? c : n_cols - 1);
        row[c] = a->cu[b] + r / g_count;
        head[c] = h * g_count + r % g_count;
        pos[c] = (int32_t)(p0 + r / g_count);
    }
    for (int64_t dc = 0; dc < dc_count; dc++)
        for (int ct = 0; ct < 2; ct++) {
            __m512 v[16];
            for (int n = 0; n < 16; n++) {
                const int c = 16 * ct + n;
                v[n] = c < n_cols ? _mm512_loadu_ps(a->q + (row[c] * a->hq + head[c]) * a->dk
                                                    + 32 * dc) : _mm512_setzero_ps();
            }
            transpose16(v);                      /* v[pair]: the 16 columns' dims 2i, 2i+1 */
            for (int i = 0; i < 16; i++)
                _mm512_store_ps((float *)(qp + (dc * 2 + ct) * 512 + 32 * i), v[i]);
        }
    memset(o, 0, dt_count * 2 * TILE_BYTES);

    const int64_t pos_min = pos[0], pos_max = pos[COLS - 1], w = a->window;
    const int64_t k_end = pos_max + 1;
    const int64_t k_start = (w && pos_min - w + 1 > 0 ? pos_min - w + 1 : 0) & ~31;
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
    const __m512 scale = _mm512_set1_ps(a->scale * 1.4426950408889634f);     /* log2(e) */
    const __m512i pair_idx = _mm512_set_epi16(
        31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
        23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512 m[2] = {neg_inf, neg_inf}, l[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    __m512i posv[2] = {_mm512_load_si512(pos), _mm512_load_si512(pos + 16)};

    for (int64_t j0 = k_start; j0 < k_end; j0 += KEYS) {
        const int64_t nt = ((k_end - j0 < KEYS ? k_end - j0 : KEYS) + 15) / 16;   /* key tiles */
        const int64_t rows = nt * 16, chunks = (nt + 1) / 2;
        /* S^T = K Q^T, 32 keys (two A tiles) by 32 columns (two B tiles) at a time */
        for (int64_t kt = 0; kt < nt; kt += 2) {
            const int two = kt + 1 < nt;
            const uint16_t *k0 = key_row(a, b, h, j0 + 16 * kt);
            const uint16_t *k1 = two ? key_row(a, b, h, j0 + 16 * kt + 16) : k0;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t dc = 0; dc < dc_count; dc++) {
                _tile_loadd(4, k0 + 32 * dc, a->kss * 2);
                _tile_loadd(6, qp + dc * 2 * 512, 64);
                _tile_loadd(7, qp + (dc * 2 + 1) * 512, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                if (two) {
                    _tile_loadd(5, k1 + 32 * dc, a->kss * 2);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, s + 16 * kt * 16, 64);
            _tile_stored(1, s + (KEYS + 16 * kt) * 16, 64);
            if (two) {
                _tile_stored(2, s + 16 * (kt + 1) * 16, 64);
                _tile_stored(3, s + (KEYS + 16 * (kt + 1)) * 16, 64);
            }
        }
        /* Every key of the block visible to every column: no masks. Scores stay as the
         * products gave them; the softmax runs in the log2 domain, x = s scale log2(e) - m
         * (one rounding), m the running max of x (the scale is positive: max first, then
         * scaled, is the same float). */
        const int full = j0 + rows - 1 <= pos_min && (!w || j0 > pos_max - w);
        for (int ct = 0; ct < 2; ct++) {
            float *sc = s + ct * KEYS * 16;
            __m512 mx = neg_inf;
            if (full)
                for (int64_t j = 0; j < rows; j++)
                    mx = _mm512_max_ps(mx, _mm512_load_ps(sc + 16 * j));
            else
                for (int64_t j = 0; j < rows; j++) {
                    const __m512i jv = _mm512_set1_epi32((int32_t)(j0 + j));
                    __mmask16 ok = _mm512_cmple_epi32_mask(jv, posv[ct]);
                    if (w)
                        ok &= _mm512_cmpgt_epi32_mask(jv, _mm512_sub_epi32(
                            posv[ct], _mm512_set1_epi32((int32_t)w)));
                    const __m512 v = _mm512_mask_mov_ps(neg_inf, ok, _mm512_load_ps(sc + 16 * j));
                    _mm512_store_ps(sc + 16 * j, v);
                    mx = _mm512_max_ps(mx, v);
                }
            const __m512 m_new = _mm512_max_ps(m[ct], _mm512_mul_ps(mx, scale));
            const __mmask16 up = _mm512_cmp_ps_mask(m_new, m[ct], _CMP_GT_OQ);
            if (up) {          /* rescale l and O^T's columns whose running max rose */
                const __m512 alpha = _mm512_mask_mov_ps(
                    _mm512_set1_ps(1.f), up, exp2_16(_mm512_sub_ps(m[ct], m_new)));
                l[ct] = _mm512_mul_ps(l[ct], alpha);
                for (int64_t dt = 0; dt < dt_count; dt++) {
                    float *ot = o + (dt * 2 + ct) * 256;
                    for (int d = 0; d < 16; d++)
                        _mm512_store_ps(ot + 16 * d, _mm512_mul_ps(_mm512_load_ps(ot + 16 * d),
                                                                   alpha));
                }
                m[ct] = m_new;
            }
            /* a column with no visible key yet keeps m = -inf: subtract 0 there */
            const __m512 m_safe = _mm512_mask_mov_ps(
                m[ct], _mm512_cmp_ps_mask(m[ct], neg_inf, _CMP_EQ_OQ), _mm512_setzero_ps());
            __m512 sum = _mm512_setzero_ps();
            for (int64_t j = 0; j < chunks * 32; j += 2) {
                __m512 pe = _mm512_setzero_ps(), po = _mm512_setzero_ps();
                if (j < rows) {
                    const __m512 se = _mm512_load_ps(sc + 16 * j);
                    const __m512 so = _mm512_load_ps(sc + 16 * (j + 1));
                    pe = exp2_16(_mm512_fmsub_ps(se, scale, m_safe));
                    po = exp2_16(_mm512_fmsub_ps(so, scale, m_safe));
                    if (!full) {         /* masked keys exactly 0 */
                        pe = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(se, neg_inf, _CMP_NEQ_OQ), pe);
                        po = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(so, neg_inf, _CMP_NEQ_OQ), po);
                    }
                    sum = _mm512_add_ps(sum, _mm512_add_ps(pe, po));
                }
                /* keys j, j + 1 as one row of pairs: [e0 o0 e1 o1 ...] in bf16 */
                const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(po, pe);
                _mm512_store_si512(pt + ((j / 32) * 2 + ct) * 512 + 32 * ((j % 32) / 2),
                                   _mm512_permutexvar_epi16(pair_idx, both));
            }
            l[ct] = _mm512_add_ps(l[ct], sum);
        }
        /* O^T += V^T P^T: the block's P^T tiles stay in 4-7 across the value dims */
        const uint16_t *vt = (const uint16_t *)p->copy + ((j0 - p->first) / 32) * dt_count * 512;
        _tile_loadd(4, pt, 64);
        _tile_loadd(5, pt + 512, 64);
        if (chunks == 2) {
            _tile_loadd(6, pt + 2 * 512, 64);
            _tile_loadd(7, pt + 3 * 512, 64);
        }
        for (int64_t dt = 0; dt < dt_count; dt++) {
            float *ot = o + dt * 2 * 256;
            _tile_loadd(0, ot, 64);
            _tile_loadd(1, ot + 256, 64);
            _tile_loadd(2, vt + dt * 512, 64);
            _tile_dpbf16ps(0, 2, 4);
            _tile_dpbf16ps(1, 2, 5);
            if (chunks == 2) {
                _tile_loadd(3, vt + (dt_count + dt) * 512, 64);
                _tile_dpbf16ps(0, 3, 6);
                _tile_dpbf16ps(1, 3, 7);
            }
            _tile_stored(0, ot, 64);
            _tile_stored(1, ot + 256, 64);
        }
    }

    /* out = O / l, with each head's sink logit joining l (2^(sink log2(e) - m)), rounded once */
    float div[COLS] __attribute__((aligned(64)));
    for (int ct = 0; ct < 2; ct++) {
        __m512 lt = l[ct];
        if (a->sinks) {
            float sk[16] __attribute__((aligned(64)));
            for (int n = 0; n < 16; n++)
                sk[n] = a->sinks[head[16 * ct + n]];
            lt = _mm512_add_ps(lt, exp2_16(_mm512_fmsub_ps(
                _mm512_load_ps(sk), _mm512_set1_ps(1.4426950408889634f), m[ct])));
        }
        _mm512_store_ps(div + 16 * ct, lt);
    }
    for (int64_t dt = 0; dt < dt_count; dt++)
        for (int ct = 0; ct < 2; ct++) {
            __m512 v[16];
            const float *ot = o + (dt * 2 + ct) * 256;
            for (int d = 0; d < 16; d++)
                v[d] = _mm512_load_ps(ot + 16 * d);
            transpose16(v);                      /* v[n]: column n's 16 dims */
            for (int n = 0; n < 16 && 16 * ct + n < n_cols; n++) {
                const int c = 16 * ct + n;
                const __m512 y = _mm512_div_ps(v[n], _mm512_set1_ps(div[c]));
                _mm256_storeu_si256((__m256i *)(a->out + (row[c] * a->hq + head[c]) * a->dv
                                                + 16 * dt), (__m256i)_mm512_cvtneps_pbh(y));
            }
        }
}

static void release_tiles(void) { _tile_release(); }

#endif

int ft_attn_amx(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                int64_t nb, int64_t ksb, int64_t kss, int64_t ksh, int64_t vsb, int64_t vss,
                int64_t vsh, const int32_t *tables, int64_t tstride, const int32_t *cu,
                const int32_t *lens, int64_t b_count, int64_t min_q, int64_t hq, int64_t hk,
                int64_t dk,
                int64_t dv, int64_t bs, float scale, int64_t window, const float *sinks,
                int threads, void *scratch, int64_t scratch_bytes, int64_t pack_cap,
                uint16_t *out) {
#if !FT_AMX
    return -1;            /* no AMX-BF16 in this build: the caller takes the vector kernel */
#else
    if (dk <= 0 || dk % 32 || dk > 256 || dv <= 0 || dv % 16 || dv > 256 || bs <= 0 || bs % 16
            || hk <= 0 || hq % hk || window < 0)
        return -3;
    const int rc = prefill_check(cu, lens, b_count, tables, tstride, nb, bs);
    if (rc)
        return rc;
    if (threads < 1)
        threads = 1;
    if (scratch_bytes < ft_attn_amx_scratch(cu, lens, b_count, min_q, hk, dk, dv, window,
                                            threads, pack_cap))
        return -4;
    if (!amx_permitted())
        return -1;
    const struct attn a = {q, k_cache, v_cache, tables, cu, lens, sinks, out, hq, hk, dk, dv,
                           bs, tstride, window, ksb, kss, ksh, vsb, vss, vsh, scale};
    const struct amx_shape f = {dv, window};
    const int64_t pairs = b_count * hk;
    struct prefill_pair *pr = prefill_pairs(cu, lens, b_count, min_q, hk, hq / hk, COLS,
                                            pair_plan, &f);
    if (!pr)
        return -4;
    uint8_t *base = (uint8_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    const struct prefill_ops ops = {pack_values, attend, load_tiles, release_tiles};
    prefill_run(&a, &ops, pr, pairs, base, thread_bytes(dk, dv),
                base + threads * thread_bytes(dk, dv), pack_cap, threads);
    free(pr);
    return 0;
#endif
}
