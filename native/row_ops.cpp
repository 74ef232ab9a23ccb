// Row operations of a decode step. A one-token step runs a norm twice and RoPE once a layer;
// in torch each is several small ops whose dispatch costs more than the arithmetic, so the
// CPU path calls these instead (engine/layers.py; references in plain torch: reference.py).
// Each row is computed alone, in an order fixed by its own values, and scalar code is built
// with -ffp-contract=off, so a row's result does not depend on the other rows of the call.

#include "common.h"

extern "C" {

// When `add` is given, x += add first (a block's output joining the residual stream); then
// out = x / sqrt(mean(x^2) + eps) * weight, for each of `rows` rows of `dim` values (row
// strides ldx, ld_add, ld_out floats). weight null: no weight. Returns 0, or -1 for shapes it
// does not take.
int miniapp_add_rms_norm(float* x, int64_t ldx, const float* add, int64_t ld_add,
                         const float* weight, int64_t rows, int64_t dim, float eps, float* out,
                         int64_t ld_out) {
  if (rows < 0 || dim <= 0) return -1;
  for (int64_t r = 0; r < rows; ++r) {
    float* row = x + r * ldx;
    if (add) {
      const float* delta = add + r * ld_add;
      for (int64_t i = 0; i < dim; ++i) row[i] += delta[i];
    }
    // Four double partial sums: no precision lost to a long fp32 chain, still pipelined.
    double sums[4] = {0.0, 0.0, 0.0, 0.0};
    int64_t i = 0;
    for (; i + 4 <= dim; i += 4) {
      for (int j = 0; j < 4; ++j) sums[j] += static_cast<double>(row[i + j]) * row[i + j];
    }
    for (; i < dim; ++i) sums[0] += static_cast<double>(row[i]) * row[i];
    const double mean = ((sums[0] + sums[1]) + (sums[2] + sums[3])) / static_cast<double>(dim);
    const float inverse = static_cast<float>(1.0 / sqrt(mean + static_cast<double>(eps)));
    float* normed = out + r * ld_out;
    if (weight) {
      for (int64_t j = 0; j < dim; ++j) normed[j] = row[j] * inverse * weight[j];
    } else {
      for (int64_t j = 0; j < dim; ++j) normed[j] = row[j] * inverse;
    }
  }
  return 0;
}

// The query and key norms of `tokens` rows of a fused Q|K|V projection (row stride ld
// floats: n_heads query heads, then kv_heads key heads, of head_dim each), in place: with
// `whole` 0 each head is RMS-normed alone with its weight [head_dim] (Qwen3, Gemma 3); with
// `whole` 1 all query heads are one vector, normed with q_weight [n_heads * head_dim], and all
// key heads another, with k_weight [kv_heads * head_dim] (OLMoE). The row norm above does
// the arithmetic. Returns 0, or -1 for shapes it does not take.
int miniapp_qk_norm(float* qkv, int64_t ld, int64_t tokens, int64_t n_heads, int64_t kv_heads,
                    int64_t head_dim, const float* q_weight, const float* k_weight, int whole,
                    float eps) {
  if (tokens < 0 || n_heads <= 0 || kv_heads <= 0 || head_dim <= 0) return -1;
  for (int64_t r = 0; r < tokens; ++r) {
    float* q = qkv + r * ld;
    float* k = q + n_heads * head_dim;
    if (whole) {
      miniapp_add_rms_norm(q, 0, nullptr, 0, q_weight, 1, n_heads * head_dim, eps, q, 0);
      miniapp_add_rms_norm(k, 0, nullptr, 0, k_weight, 1, kv_heads * head_dim, eps, k, 0);
    } else {
      miniapp_add_rms_norm(q, head_dim, nullptr, 0, q_weight, n_heads, head_dim, eps, q,
                           head_dim);
      miniapp_add_rms_norm(k, head_dim, nullptr, 0, k_weight, kv_heads, head_dim, eps, k,
                           head_dim);
    }
  }
  return 0;
}

// RoPE in place: each of `rows` rows of x (row stride ldx floats) holds `heads` heads of
// head_dim values one after another; every head of row r becomes x * cos[r] + partner(x) *
// signed_sin[r], with the tables fp32 [rows, head_dim] (contiguous) as engine/layers.py's
// Rope builds them (cos 1 and sin 0 past rotary_dim). Partners: (2i, 2i + 1) when
// `interleaved`, else (i, i + rotary_dim / 2). Returns 0, or -1 for shapes it does not take.
constexpr int64_t kMaxRopeHeadDim = 1024;  // the partner row's scratch

int miniapp_rope(float* x, int64_t ldx, int64_t rows, int64_t heads, int64_t head_dim,
                 int64_t rotary_dim, int interleaved, const float* cos_table,
                 const float* signed_sin) {
  if (rows < 0 || heads < 0 || rotary_dim % 2 || rotary_dim > head_dim ||
      head_dim > kMaxRopeHeadDim) {
    return -1;
  }
  const int64_t half = rotary_dim / 2;
  float partner[kMaxRopeHeadDim];
  for (int64_t r = 0; r < rows; ++r) {
    const float* c = cos_table + r * head_dim;
    const float* s = signed_sin + r * head_dim;
    for (int64_t h = 0; h < heads; ++h) {
      float* head = x + r * ldx + h * head_dim;
      for (int64_t i = 0; i < rotary_dim; ++i) {
        partner[i] = interleaved ? head[i ^ 1] : head[i < half ? i + half : i - half];
      }
      for (int64_t i = rotary_dim; i < head_dim; ++i) partner[i] = head[i];
      for (int64_t i = 0; i < head_dim; ++i) {
        const float rotated = head[i] * c[i];
        head[i] = rotated + partner[i] * s[i];
      }
    }
  }
  return 0;
}

}  // extern "C"
