/* What the two prefill attentions share (cpu_amx_attention.c on AMX tiles, cpu_flash_attention.c
 * in vector registers): the checks of a call's offsets and tables, the room their copies take,
 * and the two-phase run over (sequence, kv head) pairs.
 *
 * Each kernel copies every pair's keys and/or values once a call into a layout of its own
 * (phase 1, in "units" of keys), then runs its work items, blocks of (query, head) columns of
 * one pair, over the copies (phase 2). Pairs go in groups whose copies fit pack_cap bytes
 * together (a pair alone always fits): each group is copied, then its items run, so a long
 * context's copies need not all be in memory at once.
 */
#ifndef FT_CPU_PREFILL_H
#define FT_CPU_PREFILL_H
#include "cpu_dot.h"

/* 0 where every sequence's new tokens fit its context (-3 where not) and every table entry
 * of its context names a block of the cache's nb (-2 where not). */
static inline int prefill_check(const int32_t *cu, const int32_t *lens, int64_t b_count,
                                const int32_t *tables, int64_t tstride, int64_t nb, int64_t bs) {
    for (int64_t b = 0; b < b_count; b++) {
        const int64_t n_q = cu[b + 1] - cu[b];
        if (n_q < 0 || lens[b] < n_q)
            return -3;
        for (int64_t i = 0; i < (lens[b] + bs - 1) / bs; i++)
            if (i >= tstride || tables[b * tstride + i] < 0 || tables[b * tstride + i] >= nb)
                return -2;
    }
    return 0;
}

/* The first key a chunk of n_q new tokens at the end of a context of len sees (window 0:
 * none). */
static inline int64_t prefill_first(int64_t n_q, int64_t len, int64_t window) {
    return window && len - n_q - window + 1 > 0 ? len - n_q - window + 1 : 0;
}

/* A (sequence, kv head) pair: its copies' units (phase 1's items) and bytes, from key first
 * on; its phase 2 items, item0 .. item0 + items - 1 of its group; where its copies lie. */
struct prefill_pair {
    int64_t b, h, first, units, bytes, item0, items;
    uint8_t *copy;
};

/* A kernel's copies of a pair whose context of len keys ends in n_q new tokens: p's first,
 * units and bytes (shape: the kernel's constants). */
typedef void (*prefill_plan)(int64_t n_q, int64_t len, const void *shape,
                             struct prefill_pair *p);

/* A call's scratch: each thread's own bytes, and room for the copies of as many pairs at
 * once as pack_cap holds (at least the largest pair's). */
static inline int64_t prefill_scratch(const int32_t *cu, const int32_t *lens, int64_t b_count,
                                      int64_t min_q, int64_t hk, int threads,
                                      int64_t thread_bytes, int64_t pack_cap,
                                      prefill_plan plan, const void *shape) {
    int64_t total = 0, most = 0;
    for (int64_t b = 0; b < b_count; b++) {
        if (cu[b + 1] - cu[b] < min_q)
            continue;
        struct prefill_pair p;
        plan(cu[b + 1] - cu[b], lens[b], shape, &p);
        total += p.bytes * hk;
        most = p.bytes > most ? p.bytes : most;
    }
    const int64_t packs = total < pack_cap ? total : pack_cap;
    return (threads < 1 ? 1 : threads) * thread_bytes + (packs > most ? packs : most) + 64;
}

/* A call's pairs [B * Hk] (NULL: no memory): each as plan says, its items of cols columns of
 * its g_count heads a query; a sequence of fewer than min_q new tokens copies and runs
 * nothing. */
static inline struct prefill_pair *prefill_pairs(const int32_t *cu, const int32_t *lens,
                                                 int64_t b_count, int64_t min_q, int64_t hk,
                                                 int64_t g_count, int64_t cols,
                                                 prefill_plan plan, const void *shape) {
    const int64_t pairs = b_count * hk;
    struct prefill_pair *pr = malloc((pairs > 0 ? pairs : 1) * sizeof *pr);
    for (int64_t i = 0; pr && i < pairs; i++) {
        const int64_t b = i / hk, n_q = cu[b + 1] - cu[b];
        pr[i] = (struct prefill_pair){b, i % hk, 0, 0, 0, 0, 0, NULL};
        if (n_q >= min_q) {
            plan(n_q, lens[b], shape, &pr[i]);
            pr[i].items = (n_q * g_count + cols - 1) / cols;
        }
    }
    return pr;
}

/* What a kernel runs: copy unit u of a pair; its item i (counted from the pair's first);
 * around each thread's part, enter and leave (AMX's tile state; or NULL). */
struct prefill_ops {
    void (*pack)(const void *a, const struct prefill_pair *p, int64_t u);
    void (*attend)(const void *a, const struct prefill_pair *p, int64_t i, uint8_t *mine);
    void (*enter)(void), (*leave)(void);
};

/* Both phases over pairs pr [pairs] (prefill_pairs'): copies
 * at packs, each thread's own thread_bytes at base (64-byte aligned). */
static inline void prefill_run(const void *a, const struct prefill_ops *ops,
                               struct prefill_pair *pr, int64_t pairs, uint8_t *base,
                               int64_t thread_bytes, uint8_t *packs, int64_t pack_cap,
                               int threads) {
    int64_t g0 = 0;
#pragma omp parallel num_threads(threads)
    {
        if (ops->enter)
            ops->enter();
        uint8_t *mine = base + omp_get_thread_num() * thread_bytes;
        int64_t start = 0;
        while (start < pairs) {
            int64_t end = start, used = 0, items = 0, units = 0;
            while (end < pairs) {
                if (end > start && used + pr[end].bytes > pack_cap)
                    break;
                used += pr[end].bytes, end++;
            }
#pragma omp barrier
#pragma omp single
            {
                int64_t at = 0;
                for (int64_t i = start; i < end; i++) {
                    pr[i].copy = packs + at;
                    at += pr[i].bytes;
                    pr[i].item0 = items;
                    items += pr[i].items;
                }
                g0 = items;
            }                                    /* (a barrier) */
            items = g0;
            for (int64_t i = start; i < end; i++)
                units += pr[i].units;
#pragma omp for schedule(static)
            for (int64_t c = 0; c < units; c++) {
                int64_t i = start, rest = c;
                while (rest >= pr[i].units)
                    rest -= pr[i++].units;
                ops->pack(a, &pr[i], rest);
            }
            /* later items of a sequence see more keys: handed out first */
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < items; it++) {
                int64_t i = start;
                while (it >= pr[i].item0 + pr[i].items)
                    i++;
                ops->attend(a, &pr[i], pr[i].items - 1 - (it - pr[i].item0), mine);
            }
            start = end;
        }
        if (ops->leave)
            ops->leave();
    }
}

#endif  /* FT_CPU_PREFILL_H */
