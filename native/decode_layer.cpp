// One decoder layer's step for one token (or for a few consecutive tokens of one sequence,
// speculative verification), in one call. A pre-norm layer with a fused Q|K|V projection, a
// SiLU-gated feed-forward and no biases (SmolLM2 and the other llama-shaped models) runs
// eight native kernels a step; called one by one from Python, the calls and the torch ops
// between them cost about as much as the kernels. Here they run back to back: the same
// functions, on the same values, in the same order as the layer-by-layer path
// (engine/models/decoder.py), so the residual stream comes out bit for bit the same. Every
// kernel computes a row on its own, so a row of a several-token call equals that token's
// own decode step. Query and key norms (Qwen3's per head, OLMoE's over all heads) and a
// mixture of experts in place of the feed-forward (its router and experts, moe.cpp) run
// here too, by the same kernels the layer-by-layer path calls.

#include "kv_codec.h"

extern "C" {

constexpr int64_t kMaxLayerRows = 64;  // rows a call takes (a batched step's, at most)

// A mixture of experts' feed-forward (moe.cpp): each row's k of n_experts experts.
struct MoeLayer {
  const GgmlWeight* const* gate_up;  // [n_experts], SiLU-gated
  const GgmlWeight* const* down;
  int64_t n_experts, ffn, k;
  const float* router;  // fp32 [n_experts, dim]
  int32_t normalize;  // the chosen weights divided by their sum
  int32_t* ids;  // [kMaxLayerRows, k]: the call's choices, written (the engine reads them)
  float* weights;  // [kMaxLayerRows, k]: their weights, scratch
};

struct DecodeLayerWeights {
  const Int4Weight* qkv;
  const Int4Weight* out;
  const Int4Weight* gate_up;  // gated: silu(gate) * up
  const Int4Weight* down;
  const float* attn_norm;
  const float* ffn_norm;
  float eps;
  float scale;  // of the attention scores
  int64_t dim, n_heads, kv_heads, head_dim, rotary_dim, ffn_dim;
  int32_t interleaved;  // RoPE pairs (2i, 2i + 1), else (i, i + rotary_dim / 2)
  // Query and key norms after the Q|K|V projection (miniapp_qk_norm); q_norm null: none.
  const float* q_norm;
  const float* k_norm;
  int32_t qk_norm_whole;
  const MoeLayer* moe;  // or null: gate_up and down are the feed-forward
};

struct DecodeLayerStep {
  const float* cos;  // RoPE tables of the tokens' positions, [rows, head_dim] each
  const float* signed_sin;
  uint8_t* key_slot;  // where the first token's key row goes, kv head 0 (heads
  uint8_t* value_slot;  // key_head_stride apart, tokens slot_row_stride apart)
  const uint8_t* keys;  // the keys the tokens attend, kv head 0 (their own included)
  const uint8_t* values;
  int64_t key_head_stride, value_head_stride;  // bytes, in the storage and the keys alike
  int64_t n_keys;  // keys the last token sees; token r sees the first n_keys - (rows - 1 - r)
  const uint8_t* mask;  // [n_keys], or null: every key visible (one token only)
  int32_t key_type, value_type;
  // Keys stored as q4 tiles (see RowKeys; one token only): the key slot is then an fp32 row
  // of `recent` (heads recent_head_stride floats apart), and n_keys counts the lead rows too.
  const float* lead;
  int64_t lead_rows, lead_head_stride;
  const float* recent;
  int64_t recent_head_stride, own_tile;
  int64_t rows;  // tokens in this call, consecutive positions of one sequence
  int64_t key_slot_row_stride, value_slot_row_stride;  // bytes between the tokens' slots
};

// x fp32 [rows, dim], the residual stream entering the layer, updated in place: the rows of
// `n_steps` sequences, steps[i].rows each, in order (continuous batching: each sequence's
// rows write into and attend its own cache, and every matmul takes all rows at once). cos and
// signed_sin: the RoPE tables of every row, [rows, head_dim]. `lora` (or null): the rows'
// LoRA adapters (lora.cpp), each projection's update added before its epilogue, as the
// layer-by-layer path adds it. Returns 0, or -1 for a layer or step it does not take (x may
// then be partly updated: the caller raises).
int miniapp_decode_layer_batch(const DecodeLayerWeights* w, const DecodeLayerStep* steps,
                               int64_t n_steps, const float* cos, const float* signed_sin,
                               float* x, const LoraCall* lora, int threads) {
  const int64_t d = w->head_dim, q_width = w->n_heads * d;
  const int64_t qkv_width = (w->n_heads + 2 * w->kv_heads) * d;
  int64_t m = 0;
  for (int64_t i = 0; i < n_steps; ++i) {
    const DecodeLayerStep* s = steps + i;
    if (!kv_type_takes(s->key_type, d) || !kv_type_takes(s->value_type, d)) return -1;
    if (s->value_type == kKvQ4Tiles) return -1;
    const bool tiled = s->key_type == kKvQ4Tiles;
    if (tiled && (!s->recent || (s->lead_rows && !s->lead))) return -1;
    if (s->rows < 1 || s->n_keys < s->rows) return -1;
    // Several rows of one sequence: unmasked prefixes of one storage.
    if (s->rows > 1 && (tiled || s->mask)) return -1;
    m += s->rows;
  }
  if (m < 1 || m > kMaxLayerRows) return -1;
  // Per row: the normed input, Q|K|V, the queries alone (attention reads them contiguous),
  // attention's output, its projection, the gated feed-forward and its output.
  // With adapters, their updates too (as wide as the widest projection's outputs).
  int64_t delta_width = qkv_width > 2 * w->ffn_dim ? qkv_width : 2 * w->ffn_dim;
  delta_width = delta_width > w->dim ? delta_width : w->dim;
  const int64_t row_floats = 2 * w->dim + qkv_width + 2 * q_width + w->dim + w->ffn_dim +
                             (lora ? delta_width : 0);
  float* buffer = static_cast<float*>(malloc(sizeof(float) * m * row_floats));
  if (!buffer) return -1;
  float* normed = buffer;
  float* qkv = normed + m * w->dim;
  float* queries = qkv + m * qkv_width;
  float* attended = queries + m * q_width;
  float* projected = attended + m * q_width;
  float* gated = projected + m * w->dim;
  float* fed = gated + m * w->ffn_dim;
  float* delta = lora ? fed + m * w->dim : nullptr;
  // W x for x [m, k] into y, plus the rows' adapters' updates of `projection`.
  const auto project = [&](const Int4Weight* weight, int projection, const float* in, int64_t k,
                           int64_t n_out, float* y) {
    const float* pre = nullptr;
    if (lora) {
      const int has = miniapp_lora_delta(lora, projection, in, k, k, m, delta, n_out, n_out,
                                         threads);
      if (has < 0) return -1;
      pre = has ? delta : nullptr;
    }
    return miniapp_int4_gemm_pre(weight, in, k, kFloat32, m, y, pre, n_out, threads);
  };
  int status = miniapp_add_rms_norm(x, w->dim, nullptr, 0, w->attn_norm, m, w->dim, w->eps,
                                    normed, w->dim);
  status = status ? status : project(w->qkv, kLoraQkv, normed, w->dim, qkv_width, qkv);
  if (!status && w->q_norm) {
    status = miniapp_qk_norm(qkv, qkv_width, m, w->n_heads, w->kv_heads, d, w->q_norm,
                             w->k_norm, w->qk_norm_whole, w->eps);
  }
  status = status ? status
                  : miniapp_rope(qkv, qkv_width, m, w->n_heads + w->kv_heads, d, w->rotary_dim,
                                 w->interleaved, cos, signed_sin);
  if (!status) {
    RowKeys sources[kMaxLayerRows];
    int64_t at = 0;  // the first row of the step
    for (int64_t i = 0; i < n_steps; ++i) {
      const DecodeLayerStep* s = steps + i;
      const bool tiled = s->key_type == kKvQ4Tiles;
      // A tiled key goes into its fp32 row of `recent`; the caller encodes a tile it completes.
      const int key_slot_type = tiled ? kKvF32 : s->key_type;
      const int64_t key_slot_stride = tiled ? 4 * s->recent_head_stride : s->key_head_stride;
      for (int64_t r = 0; r < s->rows; ++r) {
        const float* row = qkv + (at + r) * qkv_width;
        for (int64_t h = 0; h < w->kv_heads; ++h) {
          encode_row(key_slot_type, row + (w->n_heads + h) * d, d,
                     s->key_slot + h * key_slot_stride + r * s->key_slot_row_stride,
                     stored_rotated(key_slot_type));
          encode_row(s->value_type, row + (w->n_heads + w->kv_heads + h) * d, d,
                     s->value_slot + h * s->value_head_stride + r * s->value_slot_row_stride,
                     stored_rotated(s->value_type));
        }
        memcpy(queries + (at + r) * q_width, row, sizeof(float) * q_width);
        sources[at + r] = {s->keys, s->values, s->key_head_stride, s->value_head_stride,
                           s->n_keys - (s->rows - 1 - r), s->mask, s->key_type, s->value_type,
                           s->lead, s->lead_rows, s->lead_head_stride, s->recent,
                           s->recent_head_stride, tiled ? s->own_tile : -1};
      }
      at += s->rows;
    }
    status = attend(queries, sources, m, w->n_heads, w->kv_heads, d, w->scale, attended,
                    threads);
  }
  status = status ? status : project(w->out, kLoraOut, attended, q_width, w->dim, projected);
  status = status ? status
                  : miniapp_add_rms_norm(x, w->dim, projected, w->dim, w->ffn_norm, m, w->dim,
                                         w->eps, normed, w->dim);
  if (w->moe) {
    const MoeLayer* e = w->moe;
    status = status ? status
                    : miniapp_moe_route(e->router, e->n_experts, normed, w->dim, m, w->dim, e->k,
                                        e->normalize, e->ids, e->weights, threads);
    status = status ? status
                    : miniapp_moe_ffn(e->gate_up, e->down, e->n_experts, e->ffn, normed, w->dim,
                                      m, w->dim, e->ids, e->weights, e->k, fed, threads);
  } else {
    status = status ? status
                    : project(w->gate_up, kLoraGateUp, normed, w->dim, 2 * w->ffn_dim, gated);
    status = status ? status : project(w->down, kLoraDown, gated, w->ffn_dim, w->dim, fed);
  }
  if (!status) {
    for (int64_t i = 0; i < m * w->dim; ++i) x[i] += fed[i];
  }
  free(buffer);
  return status;
}

// One sequence's rows (a decode step, or a verification's rows): the batch of one.
int miniapp_decode_layer(const DecodeLayerWeights* w, const DecodeLayerStep* s, float* x,
                         const LoraCall* lora, int threads) {
  return miniapp_decode_layer_batch(w, s, 1, s->cos, s->signed_sin, x, lora, threads);
}

}  // extern "C"
