/* The native library's entry points, declared once: every file that defines one includes
 * this (through cpu_dot.h), so a definition that drifts from its declaration fails to
 * compile instead of linking against cpu_program.c's calls with the wrong arguments. */
#ifndef FT_CPU_KERNELS_H
#define FT_CPU_KERNELS_H
#include <stdint.h>

int ft_linear(const void *x, int xfmt, int64_t t_count, const void *w, int wfmt,
              const void *scales, int64_t bn, int64_t bk, const float *bias, int64_t n,
              int64_t k, void *out, int ofmt, int threads);
int ft_attn_decode(const void *qkv, int fmt, int64_t b_count, int64_t hq, int64_t hk,
                   int64_t dh, const float *q_norm, const float *k_norm, float eps,
                   const float *cos_sin, int64_t n_pos, int64_t r, int interleaved,
                   int gated, const int64_t *pos, void *k_cache, void *v_cache, int cfmt, int64_t nb,
                   int64_t bs, const int64_t *slots, const int32_t *tables, int64_t max_blocks,
                   const int32_t *lens, int64_t window, const float *sinks, float scale,
                   int threads, float *q_scratch, void *out);
int ft_moe(const void *x, int xfmt, const int64_t *ids, const int64_t *slot_map, int64_t n_map,
           const float *wts, int64_t t_count, int64_t k_count, const void *w13, const void *w2,
           const void *s13, const void *s2, int64_t bn, int64_t bk, const float *b13,
           const float *b2, int64_t slots, int64_t d, int64_t width, int fmt, int kind,
           float alpha, float limit, int threads, float *act, float *acc, void *out, int ofmt);
void ft_rms_norm(const uint16_t *x, const uint16_t *residual, const uint16_t *w, float eps,
                 int64_t t_count, int64_t d, int fmt, uint16_t *out, uint16_t *res_out,
                 int threads);
void ft_topk_softmax(const void *logits, int fmt, int64_t t_count, int64_t e_count,
                     int64_t k, int renorm, float *weights, int64_t *ids, int wfmt);
void ft_topk_biased(const void *logits, int fmt, int64_t t_count, int64_t e_count, int64_t k,
                    int softmax, const float *bias, int64_t n_group, int64_t topk_group,
                    int renorm, float scale, float *weights, int64_t *ids, int wfmt);
void ft_int4_decode(const uint8_t *q, const void *gs, int fmt, const int64_t *idx,
                    int64_t n_idx, int64_t n, int64_t k, int64_t g, uint16_t *out, int threads);
int64_t ft_moe_amx_scratch(int64_t t_count, int64_t k_count, int64_t slots, int64_t d,
                           int64_t width);
int ft_moe_amx(const uint16_t *x, const int64_t *ids, const int64_t *slot_map, int64_t n_map,
               const float *wts, int64_t t_count, int64_t k_count, const void *w13,
               const void *w2, const void *s13, const void *s2, int fmt, int64_t bn, int64_t bk,
               const uint16_t *b13, const uint16_t *b2, int64_t slots, int64_t d,
               int64_t width, int kind, float alpha, float limit, int threads, void *scratch,
               uint16_t *out);
int ft_gdn_decode(const void *proj, int fmt, int64_t b_count, int64_t ps, const int64_t *lay,
                  const float *conv_w, int64_t width, void *conv_pool, float *pool,
                  int64_t n_slots, const int32_t *slots, const uint8_t *has,
                  const float *decay_a, const float *dt_bias, const void *norm_w, float eps,
                  int64_t hk, int64_t hv, int64_t dk, int64_t dv, float scale, int threads,
                  void *out);
void ft_silu_mul(const void *x, int fmt, int64_t t_count, int64_t n, int64_t xs, void *out,
                 int threads);
void ft_sigmoid_gate(void *o, const void *g, int fmt, int64_t t_count, int64_t heads,
                     int64_t dh, int64_t gs, int64_t ghs, int threads);
void ft_add_gated(void *h, const void *y, const void *gl, int64_t gls, int fmt,
                  int64_t t_count, int64_t d, int threads);
void ft_widen(const void *x, int fmt, int64_t t_count, int64_t n, float *out,
              int threads);
int ft_embed(const void *table, int64_t v, int64_t row_bytes, const int64_t *ids,
             int64_t t_count, void *out);
void ft_qkv_whole(void *qkv, int fmt, int64_t t_count, int64_t w, int64_t nq, int64_t nk,
                  const uint16_t *wq, const uint16_t *wk, float eps, float clip, int threads);
int ft_mla_decode(const void *q, const void *kv, int fmt, int64_t b_count, int64_t h,
                  int64_t n, int64_t r, int64_t l, int64_t v, const uint16_t *kv_norm,
                  float eps, const float *cos_sin, int64_t n_pos, int interleaved,
                  const int64_t *pos, void *cache, int cfmt, int64_t nb, int64_t bs,
                  const int64_t *slots, const int32_t *tables, int64_t max_blocks,
                  const int32_t *lens, const void *w_kvb, float scale, int threads,
                  float *scratch, void *out);
int64_t ft_attn_flash_scratch(const int32_t *cu, const int32_t *lens, int64_t b_count,
                              int64_t min_q, int64_t hk, int64_t dk, int64_t dv,
                              int64_t window, int threads, int64_t pack_cap);
int ft_attn_flash(const void *q, const void *k_cache, const void *v_cache, int fmt, int64_t nb,
                  int64_t ksb, int64_t kss, int64_t ksh, int64_t vsb, int64_t vss, int64_t vsh,
                  const int32_t *tables, int64_t tstride, const int32_t *cu,
                  const int32_t *lens, int64_t b_count, int64_t min_q, int64_t hq, int64_t hk,
                  int64_t dk, int64_t dv, int64_t bs, float scale, int64_t window,
                  const float *sinks, int threads, void *scratch, int64_t scratch_bytes,
                  int64_t pack_cap, void *out);
int ft_run(const void *ops, int64_t n, int64_t t, int threads, int64_t *failed);
int ft_run_timed(const void *ops, int64_t n, int64_t t, int threads, int64_t *failed,
                 double *ns);

#endif
