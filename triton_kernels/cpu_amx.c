/* A prefill chunk's routed experts on AMX's bf16 tiles, in one call: every used expert's
 * gate/up product, its activation, its down product and the weighted sum, with the roundings
 * of HF's loop in bf16 (each product's output, the bias add, the activation, the weighting
 * and each add of a token's experts, in expert id order, round to bf16).
 *
 * Why: torch's path for these chunks (fused_moe._moe_grouped_torch) runs one oneDNN product
 * per expert and projection, each repacking its weights and opening a parallel region (a
 * 512-token prefill of 12 layers of 64 experts: ~1500 of them), and a dozen elementwise ops
 * over [P, D] between them. Here: the layer's three phases (pack x; gate/up and activation;
 * down, weighting and each token's sum) in one parallel region, the weights read as they
 * lie: the bench layer's 512-token chunk (64 experts of [512, 1024] and [1024, 256], top-8,
 * 2-core Xeon) 10-12 ms against 36 (bench/cpu_moe.py --tokens 512). There, cold, the weights
 * stream at ~10 GB/s: each tile load of 16 rows waits on its lines (tile registers are not
 * renamed, so the next load cannot start early), and software prefetch of the next chunk or
 * the next item's rows, or copying them in first, ran slower.
 *
 * The products are computed transposed, C^T = W X^T: an A tile is 16 weight rows x 32
 * columns as the bank holds them ([N, K] row-major, a 64-byte line a row: nothing repacked,
 * the decode kernel reads the same bytes), a B tile 16 column pairs x 16 tokens of x in
 * AMX's pair layout, which phase 1 packs once per expert (a chunk's x is P x D; its experts'
 * weights S x 3 x I x D). C tiles come out as rows by tokens: the activation runs on them as
 * they are, and the down product's are transposed (16 x 16 in registers) into token rows and
 * added into the output there: a thread owns a block of output rows and adds every expert's
 * share into it in expert id order (HF's order), so no [P, D] of per-pair outputs is kept.
 *
 * Shapes (P = T * k (token, expert) pairs, S slots, D hidden, I expert width, both multiples
 * of 32): x [T, D] bf16; ids [T, k] i64 expert ids (slot_map [n_map] i64 maps them to slots,
 * or NULL); wts [T, k] f32; w13 [S, 2I, D], rows [0, I) the gate and [I, 2I) the up, and
 * w2 [S, D, I] in fmt: 0 bf16 (read as they lie); 3 e4m3 bytes with float32 block scales
 * s13 [S, ceil(2I/bn), ceil(D/bk)] and s2 [S, ceil(D/bn), ceil(I/bk)] (bk a multiple of 32);
 * 4 and 5 int4 nibbles [.., K/2] with cpu_dot.h's group scales, bk = G (a power of two from
 * 32 dividing D and I). A quantized bank's 32 rows of a work item are decoded whole, a row
 * after another (sequential streams, 1.1-1.2x faster than a K chunk at a time), into a
 * thread's L2 buffer, once for all the expert's tokens, each weight as its reference decodes
 * it (the value in float32, rounded once to bf16): the bits of this kernel on the decoded
 * bf16 bank. b13 [S, 2I] and b2 [S, D] bf16 or NULL; kind 0 silu(gate) * up, 1 gpt-oss's
 * clamped (up + 1) * gate * sigmoid(alpha gate); scratch of ft_moe_amx_scratch(T, k, S, D, I)
 * bytes; out [T, D] bf16.
 * Returns 0; -1 no AMX here (built without it, or the kernel denied the tile state), -2 an
 * id or slot out of range, -3 shapes or formats it does not take (or a slot map sending two
 * routed ids to one slot), -4 out of memory.
 * Each output's bits are the same whatever the thread count: every dot product is one
 * chain of tile products over K in order, every other step elementwise.
 */
#include "cpu_amx.h"

int64_t ft_moe_amx_scratch(int64_t t_count, int64_t k_count, int64_t slots, int64_t d,
                           int64_t width) {
    const int64_t pairs = t_count * k_count;
    const int64_t rows = pairs + 15 * (slots < pairs ? slots : pairs);   /* padded to 16s */
    return rows * (d + width) * 2 + 2 * 64;
}

#if FT_AMX
/* Tiles 0-3 C, 4-5 A (weights: 16 rows x 32 bf16), 6-7 B (16 pairs x 16 tokens x 2 bf16). */
#define KC_BLOCKS 8              /* column blocks of a K chunk (256 columns) */
#define TILE 512                    /* bf16 elements of a B tile: 16 pairs x 16 tokens x 2 */

static inline float bf16_at(const uint16_t *p, int64_t i) {
    uint32_t u = (uint32_t)p[i] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* The activation of 16 tokens' gate and up (bf16 values in f32), rounded as _activate. */
static inline __m512 activate16(__m512 g, __m512 u, int kind, float alpha, float limit) {
    const __m512 one = _mm512_set1_ps(1.f);
    if (kind == 0) {                     /* silu(gate), rounded, times up, rounded */
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
        const __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, e));
        return round_bf16(_mm512_mul_ps(round_bf16(s), u));
    }
    g = _mm512_min_ps(g, _mm512_set1_ps(limit));
    u = _mm512_max_ps(_mm512_min_ps(u, _mm512_set1_ps(limit)), _mm512_set1_ps(-limit));
    const __m512 ag = _mm512_mul_ps(_mm512_set1_ps(alpha), g);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), ag));
    const __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, e));
    return round_bf16(_mm512_mul_ps(_mm512_mul_ps(_mm512_add_ps(u, one), g), sig));
}

/* Per used expert: its slot, its first sorted pair, its rows and where its packed x and
 * activations start (in elements; 16-row blocks). */
struct expert {
    int64_t slot, first, n, xp, ap;
};

/* A bank's weights [S, n, k] as the products read them: bf16 as they lie (fmt 0), or
 * decoded 32 whole rows at a time into a thread's buffer (fmt 3: e4m3 bytes with float32 block
 * scales s [S, ceil(n/bn), ceil(k/bk)]; 4 and 5: int4 nibbles [S, n, k/2] with cpu_dot.h's
 * group scales, bk = G = 1 << gshift). */
struct bank {
    const void *w, *s;
    int fmt, gshift;
    int64_t n, k, bn, bk;
};

/* 16 weights (f32) to bf16 nearest even, as ft_int4_decode and torch's copy round finite ones. */
static inline __m512i round_bits(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
}

/* Rows [r, r + 16) of expert slot e, columns [c0, c0 + cols) (32s) -> dst, rows ld elements
 * apart, in bf16 as the bank's reference decodes them: the value in float32, rounded once
 * (ft_int4_decode's; NativeBank.decoded's copy of dequantize_reference's e4m3 * scale). */
static void decode_rows(const struct bank *b, int64_t e, int64_t r, int64_t c0, int64_t cols,
                        uint16_t *dst, int64_t ld) {
    /* e4m3: each 32 columns' scale block (no division per row: bk is a runtime value) */
    int64_t rb = 1, cb = 1;
    if (b->fmt == FT_E4M3)
        rb = (b->n + b->bn - 1) / b->bn, cb = (b->k + b->bk - 1) / b->bk;
    for (int i = 0; i < 16; i++) {
        const int64_t row = e * b->n + r + i;
        uint16_t *out = dst + i * ld;
        if (b->fmt == FT_E4M3) {
            const uint8_t *src = (const uint8_t *)b->w + row * b->k;
            const float *srow = (const float *)b->s + (e * rb + (r + i) / b->bn) * cb;
            int64_t blk = c0 / b->bk, next = (blk + 1) * b->bk;  /* (no division a segment) */
            for (int64_t j = c0; j < c0 + cols; j += 32) {
                vf lo, hi;                  /* elements j..j+15, j+16..j+31, at 1/E4M3_UNIT */
                if (j >= next)
                    blk++, next += b->bk;
                load_e4m3(src + j, &lo, &hi);
                const __m512 s = _mm512_set1_ps(srow[blk] * E4M3_UNIT);
                __m512 l, h;
                memcpy(&l, &lo, sizeof l);
                memcpy(&h, &hi, sizeof h);
                _mm512_storeu_si512(out + j - c0, (__m512i)_mm512_cvtne2ps_pbh(
                    _mm512_mul_ps(h, s), _mm512_mul_ps(l, s)));
            }
        } else {
            /* Each group's 16 values as a table (q * s + m for q = 0..15, rounded as
             * ft_int4_decode rounds load_int4's), then one 16-bit permute a 32 weights:
             * half the instructions of decoding each weight. */
            const uint8_t *src = (const uint8_t *)b->w + row * (b->k / 2);
            const void *scales = int4_row_scales(b->s, row, b->k >> b->gshift, b->fmt);
            const __m512 q16 = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            __m512i table = _mm512_setzero_si512();
            int64_t group = -1;
            for (int64_t j = c0; j < c0 + cols; j += 32) {
                if (j >> b->gshift != group) {
                    float s, m;
                    group = j >> b->gshift;
                    int4_sm(scales, group, b->fmt, &s, &m);
                    const __m512 v = _mm512_fmadd_ps(q16, _mm512_set1_ps(s), _mm512_set1_ps(m));
                    table = _mm512_castsi256_si512(_mm512_cvtepi32_epi16(
                        _mm512_srli_epi32(round_bits(v), 16)));
                }
                /* 16 bytes -> 16 words of (low nibble, high nibble): elements j + 2i, + 1 */
                const __m512i b32 = _mm512_cvtepu8_epi32(
                    _mm_loadu_si128((const __m128i *)(src + j / 2)));
                const __m512i idx = _mm512_ternarylogic_epi32(
                    _mm512_and_si512(b32, _mm512_set1_epi32(15)),
                    _mm512_slli_epi32(b32, 12), _mm512_set1_epi32(0xf0000), 0xf8);
                _mm512_storeu_si512(out + j - c0, _mm512_permutexvar_epi16(idx, table));
            }
        }
    }
}

/* c[t][0] = rows [r0, r0 + 16) of expert slot e of the bank x token block t, c[t][1] = rows
 * [r1, r1 + 16) x the same, for the tb_count token blocks of b (kb_count B tiles each, back
 * to back): each one chain of tile products over the kb_count column blocks, in order.
 * K in chunks of KC_BLOCKS: a chunk's 32 rows (16 KB) stay in L1 for every token block, the
 * partial sums parked in c (exactly: float32 out and back); a quantized bank's 32 rows are
 * decoded whole into abuf (32 x K bf16) first, once for all the token blocks. */
static inline void products(const struct bank *wb, int64_t e, int64_t r0, int64_t r1,
                            const uint16_t *b, int64_t kb_count, int64_t tb_count,
                            float (*c)[2][16][16], uint16_t *abuf) {
    const uint16_t *a0base, *a1base;
    int64_t lda;
    if (wb->fmt == 0) {
        a0base = (const uint16_t *)wb->w + (e * wb->n + r0) * wb->k;
        a1base = (const uint16_t *)wb->w + (e * wb->n + r1) * wb->k;
        lda = wb->k * 2;
    } else {            /* the 32 rows whole, a row after another: sequential streams */
        decode_rows(wb, e, r0, 0, kb_count * 32, abuf, kb_count * 32);
        decode_rows(wb, e, r1, 0, kb_count * 32, abuf + 16 * kb_count * 32, kb_count * 32);
        a0base = abuf, a1base = abuf + 16 * kb_count * 32, lda = kb_count * 32 * 2;
    }
    for (int64_t k0 = 0; k0 < kb_count; k0 += KC_BLOCKS) {
        const int64_t k1 = k0 + KC_BLOCKS < kb_count ? k0 + KC_BLOCKS : kb_count;
        const uint16_t *a0 = a0base + k0 * 32, *a1 = a1base + k0 * 32;
        for (int64_t tb = 0; tb < tb_count; tb += 2) {
            const int two = tb + 1 < tb_count;
            const uint16_t *b0 = b + tb * kb_count * TILE, *b1 = b0 + kb_count * TILE;
            if (k0 == 0) {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
            } else {
                _tile_loadd(0, c[tb][0], 64);
                _tile_loadd(2, c[tb][1], 64);
                if (two) {
                    _tile_loadd(1, c[tb + 1][0], 64);
                    _tile_loadd(3, c[tb + 1][1], 64);
                }
            }
            for (int64_t kb = k0; kb < k1; kb++) {
                _tile_loadd(4, a0 + (kb - k0) * 32, lda);
                _tile_loadd(5, a1 + (kb - k0) * 32, lda);
                _tile_loadd(6, b0 + kb * TILE, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(2, 5, 6);
                if (two) {
                    _tile_loadd(7, b1 + kb * TILE, 64);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, c[tb][0], 64);
            _tile_stored(2, c[tb][1], 64);
            if (two) {
                _tile_stored(1, c[tb + 1][0], 64);
                _tile_stored(3, c[tb + 1][1], 64);
            }
        }
    }
}

/* Phase 1: one 16-token block of an expert's x into B tiles (pairs x tokens), all K. */
static void pack_x(const uint16_t *x, int64_t d, const int64_t *order, int64_t k_count,
                   const struct expert *e, int64_t tb, uint16_t *xp) {
    const int64_t kb_count = d / 32;
    const uint16_t *row[16];
    for (int i = 0; i < 16; i++) {
        int64_t r = tb * 16 + i;
        row[i] = r < e->n ? x + order[e->first + r] / k_count * d : NULL;
    }
    uint16_t *dst = xp + e->xp + tb * kb_count * TILE;
    for (int64_t kb = 0; kb < kb_count; kb++, dst += TILE) {
        __m512 v[16];
        for (int i = 0; i < 16; i++)        /* token i's 16 column pairs */
            v[i] = row[i] ? _mm512_loadu_ps(row[i] + kb * 32) : _mm512_setzero_ps();
        transpose16(v);                     /* -> pair j's 16 tokens */
        for (int j = 0; j < 16; j++)
            _mm512_storeu_ps(dst + j * 32, v[j]);
    }
}

/* Phase 2: gate rows [r0, r0 + 16) and their up rows of an expert, all its tokens, through
 * the activation into the down product's B tiles. */
static void gate_up(const struct bank *w13, const uint16_t *b13, int64_t d, int64_t width,
                    const struct expert *e, int64_t r0, int kind, float alpha, float limit,
                    const uint16_t *xp, uint16_t *ap, float (*c)[2][16][16], uint16_t *abuf) {
    const int64_t kb_count = d / 32, tb_count = (e->n + 15) / 16, ka_count = width / 32;
    products(w13, e->slot, r0, width + r0, xp + e->xp, kb_count, tb_count, c, abuf);
    for (int64_t tb = 0; tb < tb_count; tb++) {
        /* rows r0 + 2j and + 1 of the activation: one row of 16 pair-words of a B tile */
        uint16_t *dst = ap + e->ap + (tb * ka_count + r0 / 32) * TILE + (r0 % 32) / 2 * 32;
        for (int j = 0; j < 8; j++) {
            __m512 a[2];
            for (int s = 0; s < 2; s++) {
                const int n = 2 * j + s;
                __m512 g = round_bf16(_mm512_load_ps(c[tb][0][n]));
                __m512 u = round_bf16(_mm512_load_ps(c[tb][1][n]));
                if (b13) {
                    g = round_bf16(_mm512_add_ps(g, _mm512_set1_ps(
                        bf16_at(b13, e->slot * 2 * width + r0 + n))));
                    u = round_bf16(_mm512_add_ps(u, _mm512_set1_ps(
                        bf16_at(b13, e->slot * 2 * width + width + r0 + n))));
                }
                a[s] = activate16(g, u, kind, alpha, limit);
            }
            const __m512i lo = _mm512_srli_epi32(_mm512_castps_si512(a[0]), 16);
            const __m512i hi = _mm512_castps_si512(a[1]);     /* low halves are zero */
            _mm512_storeu_si512(dst + j * 32, _mm512_or_si512(lo, hi));
        }
    }
}

/* Phase 3: down rows [r0, r0 + 32) of an expert, all its tokens, weighted and rounded, each
 * added into its token's output row (rounding after the add). The caller runs a row block's
 * experts in id order on one thread: each output element gets its token's experts added one
 * at a time in id order from zero, as the loop's index_add_ into zeros. */
static void down(const struct bank *w2, const uint16_t *b2, int64_t d, int64_t width,
                 const struct expert *e, int64_t r0, const int64_t *order, int64_t k_count,
                 const float *wts, const uint16_t *ap, uint16_t *out, float (*c)[2][16][16],
                 uint16_t *abuf) {
    const int64_t ka_count = width / 32, tb_count = (e->n + 15) / 16;
    products(w2, e->slot, r0, r0 + 16, ap + e->ap, ka_count, tb_count, c, abuf);
    for (int64_t tb = 0; tb < tb_count; tb++) {
        const int64_t r = tb * 16, n_t = e->n - r < 16 ? e->n - r : 16;
        /* the 16 tokens' routing weights in bf16 (0 past the expert's rows) */
        float wv[16] __attribute__((aligned(64)));
        for (int t = 0; t < 16; t++)
            wv[t] = t < n_t ? wts[order[e->first + r + t]] : 0.f;
        const __m512 wb = round_bf16(_mm512_load_ps(wv));
        for (int half = 0; half < 2; half++) {          /* rows r0 + 16 half + n */
            __m512 v[16];
            for (int n = 0; n < 16; n++) {
                __m512 y = round_bf16(_mm512_load_ps(c[tb][half][n]));
                if (b2)
                    y = round_bf16(_mm512_add_ps(y, _mm512_set1_ps(
                        bf16_at(b2, e->slot * d + r0 + 16 * half + n))));
                v[n] = round_bf16(_mm512_mul_ps(y, wb));
            }
            transpose16(v);                 /* -> token t's 16 rows */
            for (int t = 0; t < n_t; t++) {
                __m256i *o = (__m256i *)(out + order[e->first + r + t] / k_count * d + r0
                                         + 16 * half);
                _mm256_storeu_si256(o, narrow_bf16(round_bf16(_mm512_add_ps(
                    widen_bf16(_mm256_loadu_si256(o)), v[t]))));
            }
        }
    }
}

#endif

int ft_moe_amx(const uint16_t *x, const int64_t *ids, const int64_t *slot_map, int64_t n_map,
               const float *wts, int64_t t_count, int64_t k_count, const void *w13,
               const void *w2, const void *s13, const void *s2, int fmt, int64_t bn, int64_t bk,
               const uint16_t *b13, const uint16_t *b2, int64_t slots, int64_t d,
               int64_t width, int kind, float alpha, float limit, int threads, void *scratch,
               uint16_t *out) {
#if !FT_AMX
    return -1;            /* no AMX-BF16 in this build: the caller keeps torch's products */
#else
    if (d % 32 || width % 32 || d <= 0 || width <= 0 || k_count > 64 || !(fmt == 0
            || (fmt == FT_E4M3 && bn > 0 && bk > 0 && bk % 32 == 0)
            || (is_int4(fmt) && bk >= 32 && !(bk & (bk - 1)) && !(d % bk) && !(width % bk))))
        return -3;
    threads = threads > 0 ? threads : 1;   /* (num_threads(0) would be the default team) */
    /* gpt-oss's clamps at the limit as a bf16 tensor's clamp meets it: rounded to bf16 */
    limit = round_to(limit, 0);
    const int gshift = is_int4(fmt) ? __builtin_ctzll((unsigned long long)bk) : 0;
    const struct bank w13b = {w13, s13, fmt, gshift, 2 * width, d, bn, bk};
    const struct bank w2b = {w2, s2, fmt, gshift, d, width, bn, bk};
    if (!amx_permitted())
        return -1;
    const int64_t pairs = t_count * k_count;
    /* The pairs by slot (counting sort, stable: a slot's pairs in (token, k) order), and
     * each used slot's expert id: a slot map that sends two routed ids to one slot is
     * declined (the down phase adds by slot, in id order). */
    int64_t *start = calloc(slots + 1, sizeof *start);
    int64_t *slot_id = malloc((slots ? slots : 1) * sizeof *slot_id);
    int64_t *order = malloc((pairs ? pairs : 1) * sizeof *order);
    struct expert *used = malloc((slots ? slots : 1) * sizeof *used);
    int rc = !start || !slot_id || !order || !used ? -4 : 0;
    for (int64_t s = 0; s < slots && !rc; s++)
        slot_id[s] = -1;
    for (int64_t p = 0; p < pairs && !rc; p++) {
        if (slot_map && (ids[p] < 0 || ids[p] >= n_map)) {
            rc = -2;
            break;
        }
        const int64_t s = slot_map ? slot_map[ids[p]] : ids[p];
        if (s < 0 || s >= slots)
            rc = -2;
        else if (slot_id[s] >= 0 && slot_id[s] != ids[p])
            rc = -3;
        else
            start[s + 1]++, slot_id[s] = ids[p];
    }
    if (rc) {
        free(start), free(slot_id), free(order), free(used);
        return rc;
    }
    int64_t n_used = 0, xrows = 0;
    for (int64_t s = 0; s < slots; s++) {
        const int64_t n = start[s + 1];
        if (n) {
            used[n_used++] = (struct expert){s, start[s], n, xrows * d, xrows * width};
            xrows += (n + 15) / 16 * 16;
        }
        start[s + 1] += start[s];
    }
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t s = slot_map ? slot_map[ids[p]] : ids[p];
        order[start[s]++] = p;
    }
    /* scratch: packed x [xrows, D], packed activations [xrows, I] (64-aligned) */
    uintptr_t base = ((uintptr_t)scratch + 63) & ~(uintptr_t)63;
    uint16_t *xp = (uint16_t *)base;
    uint16_t *ap = (uint16_t *)(((uintptr_t)(xp + xrows * d) + 63) & ~(uintptr_t)63);
    /* Work items: phase 1 (expert, token block); 2 (expert, 16 gate rows); 3 (32 down
     * rows, every expert). */
    int64_t *blocks = malloc((xrows / 16 + 1) * 2 * sizeof *blocks);
    if (!blocks) {
        free(start), free(slot_id), free(order), free(used);
        return -4;
    }
    int64_t n_blocks = 0;
    for (int64_t u = 0; u < n_used; u++)
        for (int64_t tb = 0; tb * 16 < used[u].n; tb++)
            blocks[2 * n_blocks] = u, blocks[2 * n_blocks++ + 1] = tb;
    const int64_t g_items = n_used * (width / 16);
    /* phase 3's rows an item: long runs of each expert's rows (the weights stream
     * sequentially), but 4 items a thread or more */
    int64_t d_rows = 32;
    while (d_rows < 256 && d / (2 * d_rows) >= 4 * threads)
        d_rows *= 2;
    /* phase 3 takes the used experts in expert id order (slot_map may permute them) */
    int64_t *by_id = malloc((n_used ? n_used : 1) * sizeof *by_id);
    if (!by_id) {
        free(start), free(slot_id), free(order), free(used), free(blocks);
        return -4;
    }
    for (int64_t u = 0; u < n_used; u++) {          /* insertion sort: n_used <= slots */
        const int64_t id = slot_id[used[u].slot];
        int64_t v = u;
        for (; v > 0 && slot_id[used[by_id[v - 1]].slot] > id; v--)
            by_id[v] = by_id[v - 1];
        by_id[v] = u;
    }
    /* each thread's partial sums: the most token blocks an expert has, x 2 tiles */
    int64_t most = 0;
    for (int64_t u = 0; u < n_used; u++)
        most = used[u].n > most ? used[u].n : most;
    /* and a quantized bank's 32 decoded rows (abuf) */
    const int64_t a_elems = 32 * (d > width ? d : width);   /* 32 rows decoded (bf16) */
    const int64_t c_floats = (most + 15) / 16 * 2 * 256 + a_elems / 2;
    float *cbuf = aligned_alloc(64, threads * c_floats * sizeof *cbuf);
    if (!cbuf) {
        free(start), free(slot_id), free(order), free(used), free(blocks), free(by_id);
        return -4;
    }

#pragma omp parallel num_threads(threads)
    {
        load_tiles();
        float *mine = cbuf + omp_get_thread_num() * c_floats;
        uint16_t *abuf = (uint16_t *)(mine + c_floats - a_elems / 2);
        float (*c)[2][16][16] = (float (*)[2][16][16])mine;
#pragma omp for schedule(static) nowait
        for (int64_t t = 0; t < t_count; t++)           /* the sums start from zero */
            memset(out + t * d, 0, d * sizeof *out);
#pragma omp for schedule(dynamic)
        for (int64_t i = 0; i < n_blocks; i++)
            pack_x(x, d, order, k_count, &used[blocks[2 * i]], blocks[2 * i + 1], xp);
#pragma omp for schedule(dynamic)
        for (int64_t i = 0; i < g_items; i++)
            gate_up(&w13b, b13, d, width, &used[i / (width / 16)], i % (width / 16) * 16, kind,
                    alpha, limit, xp, ap, c, abuf);
#pragma omp for schedule(dynamic)
        for (int64_t r0 = 0; r0 < d; r0 += d_rows)      /* a row block: every expert, by id */
            for (int64_t u = 0; u < n_used; u++)
                for (int64_t r = r0; r < r0 + d_rows && r < d; r += 32)
                    down(&w2b, b2, d, width, &used[by_id[u]], r, order, k_count, wts, ap, out,
                         c, abuf);
        _tile_release();
    }
    free(start), free(slot_id), free(order), free(used), free(blocks), free(by_id), free(cbuf);
    return 0;
#endif
}

