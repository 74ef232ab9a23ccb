// What the kernel files of the one shared library (native/build.py compiles them together)
// share: the ISA target macros and the CPU check, and what one file calls in another (the
// fused layer of decode_layer.cpp runs the GEMM, the row operations and attention). Internal:
// Python sees only each file's extern "C" functions. ggml_dot.cpp stands alone; it takes only
// the scratch buffer of int4_gemm.cpp.

#pragma once

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define TARGET_AVX512_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
// Functions one file defines and another calls: hidden, so that they are neither exported
// from the library nor interposable (calls to them stay direct, as within one file).
#define MINIAPP_INTERNAL __attribute__((visibility("hidden")))

enum Isa { kIsaNone = 0, kIsaAvx2 = 1, kIsaAvx512 = 2, kIsaAvx512Vnni = 3 };
enum XType { kFloat32 = 0, kBFloat16 = 1 };

// Below this many key multiply-adds, attention (and decoding a cache) keeps to one thread.
constexpr int64_t kMinParallelKeyMacs = 1 << 15;

static inline bool cpu_has(int isa) {
  __builtin_cpu_init();
  if (isa == kIsaAvx512) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  }
  if (isa == kIsaAvx512Vnni) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
           cpu_has(kIsaAvx2);
  }
  if (isa == kIsaAvx2) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }
  return false;
}

// ------------------------------------------------------------ the int4 GEMM (int4_gemm.cpp)

extern "C" {

struct Int4Weight;  // a packed weight (int4_gemm.cpp)
int miniapp_int4_gemm(const Int4Weight* w, const void* x, int64_t ldx, int x_type, int64_t m,
                      float* y, int threads);
int miniapp_int4_gemm_pre(const Int4Weight* w, const void* x, int64_t ldx, int x_type,
                          int64_t m, float* y, const float* pre, int64_t ld_pre, int threads);

// ------------------------------------------------------------ LoRA updates (lora.cpp)

struct LoraCall;  // the adapters of a call's rows, for one layer
int miniapp_lora_delta(const LoraCall* call, int projection, const float* x, int64_t ldx,
                       int64_t k, int64_t m, float* delta, int64_t ld_delta, int64_t n_out,
                       int threads);
enum LoraProjection { kLoraQkv = 0, kLoraOut = 1, kLoraGateUp = 2, kLoraDown = 3 };

// ------------------------------------------------------- row operations (row_ops.cpp)

int miniapp_add_rms_norm(float* x, int64_t ldx, const float* add, int64_t ld_add,
                         const float* weight, int64_t rows, int64_t dim, float eps, float* out,
                         int64_t ld_out);
int miniapp_rope(float* x, int64_t ldx, int64_t rows, int64_t heads, int64_t head_dim,
                 int64_t rotary_dim, int interleaved, const float* cos_table,
                 const float* signed_sin);
int miniapp_qk_norm(float* qkv, int64_t ld, int64_t tokens, int64_t n_heads, int64_t kv_heads,
                    int64_t head_dim, const float* q_weight, const float* k_weight, int whole,
                    float eps);

// ------------------------------------------------------- mixtures of experts (moe.cpp)

struct GgmlWeight;  // a weight in GGML's blocks (ggml_dot.cpp)
int miniapp_moe_route(const float* router, int64_t n_experts, const float* x, int64_t ldx,
                      int64_t m, int64_t dim, int64_t k, int normalize, int32_t* ids,
                      float* weights, int threads);
int miniapp_moe_ffn(const GgmlWeight* const* gate_up, const GgmlWeight* const* down,
                    int64_t n_experts, int64_t ffn, const float* x, int64_t ldx, int64_t m,
                    int64_t dim, const int32_t* ids, const float* weights, int64_t k, float* y,
                    int threads);

}  // extern "C"

// ------------------------------------------------------------ attention (attention.cpp)

// Where one query row's keys are: its own k and v (rows of different sequences of a batch
// read different caches), each stored as its own KvType (keys are the more sensitive to
// quantization, so a cache may keep them in more bits than its values), the keys it scans,
// and the mask over them (null: all visible).
struct RowKeys {
  const uint8_t* k;
  const uint8_t* v;
  int64_t k_head_stride, v_head_stride;  // bytes between kv heads in k, in v
  int64_t scanned;  // keys 0..scanned-1
  const uint8_t* mask;  // [scanned] or null
  int key_type, value_type;
  // Keys stored as q4 tiles: key j < lead_rows is fp32 row j of `lead` (a rotating cache's
  // sinks), key lead_rows + i is row i of the tiles in k, except in tile `own_tile` (the
  // query's own, incomplete one), whose rows are fp32 in `recent`: tile t's row i at
  // (t % 2) * kTileRows + i. Strides between kv heads in floats.
  const float* lead = nullptr;
  int64_t lead_rows = 0, lead_head_stride = 0;
  const float* recent = nullptr;
  int64_t recent_head_stride = 0, own_tile = -1;
};

// Attention of every query row over its own keys (see RowKeys), into out.
MINIAPP_INTERNAL int attend(const float* q, const RowKeys* sources, int64_t rows,
                            int64_t n_heads, int64_t kv_heads, int64_t head_dim, float scale,
                            float* out, int threads);
