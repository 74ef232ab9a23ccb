// Small-batch int4 GEMM on the CPU: y[m, n] = sum_k x[m, k] * w[n, k] for a few rows of x,
// with w held as 4-bit codes and, per group of `group` input columns, a bf16 scale and zero:
// w = (code - 8) * scale + zero (the engine's int4 convention, see engine/quant.py).
//
// Why this exists: torch's CPU int4 matmul re-reads every weight for each row of x, so
// verifying 8 speculative drafts costs ~3x a decode step. Here each 4-bit block is decoded
// once per pass and multiplied into up to kMaxTile rows of x at once.
//
// Packed layout (built by miniapp.native.int4.pack): output rows in blocks of kBlockRows
// (padded with zero-weight rows). For each block, its groups follow one another, and each
// group is `group / kChunkCols` chunks of 64 bytes, then 16 bf16 scales, then 16 bf16 zeros.
// A chunk is 32 little-endian 16-bit words; word 2r + h holds, for row r of the block, the
// codes of columns 8c + h, 8c + 2 + h, 8c + 4 + h, 8c + 6 + h in its four nibbles (lowest
// first). One shift and one 16-bit table lookup turn a nibble position into 16 rows x 2
// adjacent columns of bf16 weights: exactly one AVX-512 BF16 dot product against a broadcast
// pair of x, with one output row per lane (no horizontal sums at all).
//
// The AVX2 path (no bf16 dot product there) reads the same layout with 8-bit integer
// multiply-adds against x quantized to int8 per run of 16 columns; see its section.
//
// Row independence: each output element is summed in an order fixed by the layout alone
// (nibble by nibble, chunk by chunk, then group by group; the AVX2 path's integer group sums
// are exact in any order), never by the number of rows, the tile or the thread, so a row of
// an 8-row call is bit-identical to the same row computed alone. Scalar code is built with
// -ffp-contract=off so the compiler cannot fuse it differently per tile.
//
// The same library holds the decode-shaped attention of the torch engine on the CPU
// (`miniapp_attend_rows`, section "Attention" below): a few query rows, each over its own
// keys, in an order that depends only on that row's keys; and the codecs of the KV cache's
// storage types it reads (section "KV storage").

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef MINIAPP_SOURCE_HASH
#define MINIAPP_SOURCE_HASH "unknown"
#endif

#define TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace {

constexpr int kAbiVersion = 9;
constexpr int kBlockRows = 16;  // output rows per block: one AVX-512 fp32 lane each
constexpr int kChunkCols = 8;   // input columns per chunk: 4 nibbles x 2 adjacent columns
constexpr int kChunkBytes = 64;  // 16 rows x 8 columns x 4 bits
constexpr int kNibbles = 4;  // nibbles per 16-bit word
constexpr int kScaleBytes = 2 * kBlockRows;  // one bf16 per row of the block
constexpr int kCodeOffset = 8;  // w = (code - 8) * scale + zero
constexpr int kGateRows = kBlockRows / 2;  // SiLU-gated blocks: 8 gate rows, then 8 up rows
// Below this many multiply-adds a second thread costs more to wake than it saves.
constexpr int64_t kMinParallelMacs = 1 << 16;

enum Isa { kIsaNone = 0, kIsaAvx2 = 1, kIsaAvx512 = 2 };
enum XType { kFloat32 = 0, kBFloat16 = 1 };
enum Epilogue { kStore = 0, kSiluMul = 1 };

struct Problem {
  const uint8_t* packed;
  int64_t n_blocks;
  int64_t k;
  int64_t group;
  int64_t n_groups;
  int64_t group_bytes;
  int64_t m;
  float* y;
  int64_t ldy;
  int64_t n;  // valid output columns (rows of w, or gated outputs with kSiluMul)
  int epilogue;
  const uint16_t* xb;  // x rounded to bf16 [m, k] (AVX-512 path)
  const float* xsum;   // per row of x, per group: the sum of its bf16 values (AVX-512 path)
  const int8_t* xq;    // x quantized to int8 per run of columns, permuted (AVX2 path)
  const float* dx;     // per row of x, per run: the int8 step (AVX2 path)
  const float* dx_sum;  // per row of x, per group: sum over its runs of step * sum of q
  const int32_t* q_sum;  // per row of x, per run: the sum of q (AVX2 path)
};

// ------------------------------------------------------------------ scratch for x

struct Scratch {
  void* ptr;
  size_t size;
};
// One buffer per calling thread, grown as needed and kept (a few hundred KB at most). The
// GGML kernels (ggml_dot.cpp) take theirs here too: a call holds it only while it runs.
thread_local Scratch scratch = {nullptr, 0};

}  // namespace

void* miniapp_scratch_bytes(size_t size) {
  if (size > scratch.size) {
    free(scratch.ptr);
    size_t rounded = (size + 63) / 64 * 64;
    scratch.ptr = aligned_alloc(64, rounded);
    scratch.size = scratch.ptr ? rounded : 0;
  }
  return scratch.ptr;
}

namespace {

void* scratch_bytes(size_t size) { return miniapp_scratch_bytes(size); }

// fp32 -> bf16, round to nearest even, as torch converts (NaN stays a quiet NaN).
constexpr uint32_t kBf16QuietNan = 0x7fc0;
constexpr uint32_t kRoundingBias = 0x7fff;

uint16_t to_bf16(float value) {
  uint32_t bits;
  memcpy(&bits, &value, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return kBf16QuietNan;
  bits += kRoundingBias + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

float from_bf16(uint16_t value) {
  uint32_t bits = static_cast<uint32_t>(value) << 16;
  float out;
  memcpy(&out, &bits, sizeof out);
  return out;
}

// Scalar tail of a row of fp32 x (columns from `col` on) rounded to bf16.
void round_tail(const float* x, int64_t col, int64_t k, uint16_t* xb) {
  for (; col < k; ++col) xb[col] = to_bf16(x[col]);
}

// ------------------------------------------------------------------ epilogues

// e^x for 8 lanes: 2^n * e^r with n = round(x / ln 2) and |r| <= ln 2 / 2, e^r by its Taylor
// series to degree 6 (truncation error below 2e-7, about one ulp). x is clamped so that
// 2^n stays a normal float: silu needs no more range than that.
constexpr float kExpMin = -87.0f, kExpMax = 88.0f;
constexpr float kLog2E = 1.44269504f;
constexpr float kLn2High = 0.693145752f, kLn2Low = 1.42860677e-6f;  // ln 2 = high + low
constexpr float kExpCoefficients[] = {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
constexpr int kFloatExponentBias = 127, kFloatMantissaBits = 23;

TARGET_AVX2 __m256 exp_avx2(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kExpMin)), _mm256_set1_ps(kExpMax));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2E)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2High), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Low), r);
  __m256 poly = _mm256_set1_ps(kExpCoefficients[0]);
  constexpr int kTerms = sizeof kExpCoefficients / sizeof kExpCoefficients[0];
  for (int i = 1; i < kTerms; ++i) poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(kExpCoefficients[i]));
  __m256i exponent = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(kFloatExponentBias));
  __m256 two_to_n = _mm256_castsi256_ps(_mm256_slli_epi32(exponent, kFloatMantissaBits));
  return _mm256_mul_ps(poly, two_to_n);
}

// silu(gate) * up = gate / (1 + e^-gate) * up, 8 lanes.
TARGET_AVX2 __m256 silu_mul_avx2(__m256 gate, __m256 up) {
  __m256 denominator = _mm256_add_ps(_mm256_set1_ps(1.0f), exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), gate)));
  return _mm256_mul_ps(_mm256_div_ps(gate, denominator), up);
}

// tile: [rows][kBlockRows] results of one block for `rows` rows of x starting at m0. The
// gated epilogue uses AVX2 (both paths have it), so both paths round it alike.
TARGET_AVX2 void finish_tile(const Problem& p, int64_t block, int64_t m0, int rows,
                             const float* tile) {
  for (int r = 0; r < rows; ++r) {
    const float* t = tile + r * kBlockRows;
    float* out = p.y + (m0 + r) * p.ldy;
    if (p.epilogue == kSiluMul) {
      const int64_t first = block * kGateRows;
      const int64_t count = p.n - first < kGateRows ? p.n - first : kGateRows;
      alignas(32) float gated[kGateRows];
      _mm256_store_ps(gated, silu_mul_avx2(_mm256_loadu_ps(t), _mm256_loadu_ps(t + kGateRows)));
      memcpy(out + first, gated, count * sizeof(float));
    } else {
      const int64_t first = block * kBlockRows;
      const int64_t count = p.n - first < kBlockRows ? p.n - first : kBlockRows;
      memcpy(out + first, t, count * sizeof(float));
    }
  }
}

// ------------------------------------------------------------------ AVX-512 BF16 path

TARGET_AVX512 __m512i to_bf16_avx512(__m512 values) {
  __m512i bits = _mm512_castps_si512(values);
  __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(kRoundingBias)));
  __mmask16 nan = _mm512_cmp_ps_mask(values, values, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(kBf16QuietNan << 16));
  return _mm512_srli_epi32(rounded, 16);
}

TARGET_AVX512 __m512 widen_bf16_avx512(const uint16_t* at) {
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// x as bf16 [m, k] and the sum of each group of it, in one order fixed per row.
TARGET_AVX512 bool prepare_x_avx512(Problem& p, const void* x, int64_t ldx, int x_type) {
  const size_t bytes = p.m * p.k * sizeof(uint16_t) + p.m * p.n_groups * sizeof(float);
  float* xsum = static_cast<float*>(scratch_bytes(bytes));
  if (!xsum) return false;
  uint16_t* xb = reinterpret_cast<uint16_t*>(xsum + p.m * p.n_groups);
  constexpr int kLanes = 16;
  for (int64_t row = 0; row < p.m; ++row) {
    uint16_t* out = xb + row * p.k;
    int64_t col = 0;
    if (x_type == kFloat32) {
      const float* in = static_cast<const float*>(x) + row * ldx;
      for (; col + kLanes <= p.k; col += kLanes) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + col),
                            _mm512_cvtepi32_epi16(to_bf16_avx512(_mm512_loadu_ps(in + col))));
      }
      round_tail(in, col, p.k, out);
    } else {
      memcpy(out, static_cast<const uint16_t*>(x) + row * ldx, p.k * sizeof(uint16_t));
    }
    for (int64_t g = 0; g < p.n_groups; ++g) {
      const uint16_t* values = out + g * p.group;
      float sum = 0.0f;
      int64_t i = 0;
      if (p.group % kLanes == 0) {
        __m512 acc = _mm512_setzero_ps();
        for (; i < p.group; i += kLanes) acc = _mm512_add_ps(acc, widen_bf16_avx512(values + i));
        sum = _mm512_reduce_add_ps(acc);
      }
      for (; i < p.group; ++i) sum += from_bf16(values[i]);
      xsum[row * p.n_groups + g] = sum;
    }
  }
  p.xb = xb;
  p.xsum = xsum;
  return true;
}

// bf16(c - 8) for every 4-bit code c. vpermw reads an index's low 5 bits, so the table
// repeats: a word shifted right by 4j then indexes by nibble j without masking.
TARGET_AVX512 __m512i code_table_avx512() {
  alignas(64) uint16_t table[32];
  for (int i = 0; i < 32; ++i) table[i] = to_bf16(static_cast<float>((i & 15) - kCodeOffset));
  return _mm512_load_si512(table);
}

TARGET_AVX512 __m512bh pair_of(const uint16_t* at) {
  int32_t bits;
  memcpy(&bits, at, sizeof bits);
  return (__m512bh)_mm512_set1_epi32(bits);
}

// Rows of x per pass over a block: the dot products of a row alternate between two
// accumulators (even and odd nibbles), so 12 rows take 24 of AVX-512's 32 registers, and
// verifying up to 11 drafts decodes each weight once (measured on a streamed 1536x576
// weight, 9 rows: 35 us as 5 + 4 rows, 27 us in one pass).
constexpr int kMaxTile = 12;
constexpr int kBlocksPerBatch = 4;  // blocks every tile of rows runs over while in cache
// Decode streams every weight from DRAM once; two cores alone do not keep enough reads in
// flight to reach the memory's bandwidth, so each stream is prefetched this far ahead
// (measured: 1-2 KB ahead took a cold 1536x576 matrix from ~27 us to ~17 us).
constexpr int kPrefetchBytes = 2048;

// One pass over a block for MT rows of x (from m0); writes tile[r][16]. Each block is one
// sequential stream: interleaving 2-4 blocks for more independent accumulators helped
// only when the weight was already in cache, and cost 10-20% when it streamed from memory.
template <int MT>
TARGET_AVX512 void tile_avx512(const Problem& p, int64_t block, int64_t m0, float* tile) {
  const __m512i table = code_table_avx512();
  const uint8_t* base = p.packed + block * p.n_groups * p.group_bytes;
  const int64_t chunks = p.group / kChunkCols;
  for (int r = 0; r < MT; ++r) _mm512_storeu_ps(tile + r * kBlockRows, _mm512_setzero_ps());
  for (int64_t g = 0; g < p.n_groups; ++g) {
    const uint8_t* codes = base + g * p.group_bytes;
    const uint16_t* xg = p.xb + m0 * p.k + g * p.group;
    __m512 even[MT], odd[MT];
    for (int r = 0; r < MT; ++r) even[r] = odd[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      const uint8_t* chunk = codes + c * kChunkBytes;
      _mm_prefetch(reinterpret_cast<const char*>(chunk) + kPrefetchBytes, _MM_HINT_T0);
      __m512i words = _mm512_loadu_si512(chunk);
      __m512bh w[kNibbles];
      for (int j = 0; j < kNibbles; ++j) {
        w[j] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4 * j), table);
      }
      for (int r = 0; r < MT; ++r) {
        const uint16_t* xc = xg + r * p.k + c * kChunkCols;
        even[r] = _mm512_dpbf16_ps(even[r], w[0], pair_of(xc));
        odd[r] = _mm512_dpbf16_ps(odd[r], w[1], pair_of(xc + 2));
        even[r] = _mm512_dpbf16_ps(even[r], w[2], pair_of(xc + 4));
        odd[r] = _mm512_dpbf16_ps(odd[r], w[3], pair_of(xc + 6));
      }
    }
    const uint16_t* scales = reinterpret_cast<const uint16_t*>(codes + chunks * kChunkBytes);
    __m512 scale = widen_bf16_avx512(scales);
    __m512 zero = widen_bf16_avx512(scales + kBlockRows);
    for (int r = 0; r < MT; ++r) {
      float* total = tile + r * kBlockRows;
      __m512 part = _mm512_add_ps(even[r], odd[r]);
      __m512 sum = _mm512_fmadd_ps(part, scale, _mm512_loadu_ps(total));
      __m512 xsum = _mm512_set1_ps(p.xsum[(m0 + r) * p.n_groups + g]);
      _mm512_storeu_ps(total, _mm512_fmadd_ps(zero, xsum, sum));
    }
  }
}

// ------------------------------------------------------------------ AVX2 path

// AVX2 has no bf16 dot product, and dequantizing to fp32 costs more than torch's own AVX2
// kernel. Instead x is quantized to int8 in runs of 16 columns (q = round(x / dx), dx =
// max |x| / 127, as llama.cpp quantizes activations for its q4 dot products), and vpmaddubsw
// multiplies the unsigned 4-bit codes by it exactly, 32 products an instruction. Its 16-bit
// lanes sum a row's two codes of one word; a run's two chunks of that stay far below 2^15,
// then vpmaddwd by ones widens each row's two words into one 32-bit lane, so 8 block rows
// fill a register and a run's integer dot product is exact. Runs of 16, not whole groups,
// share a step: a Q6_K group of 32 feeds 16 columns 16x and then 16 columns x (Q5 and Q8
// groups of 64: 32 and 32, see engine/quant.py), and one step over both would leave x only
// 4 of its 8 bits.
//
// x is stored permuted within each 8-column chunk as columns 0 4 1 5 2 6 3 7: a word's low
// byte of codes (word & 0x0f0f) holds columns h and h + 4, its high one (word >> 4 & 0x0f0f)
// columns h + 2 and h + 6, so one 4-byte broadcast of x lines up with every row's word pair.
constexpr int kAvx2Rows = 8;  // block rows per pass: one int32 lane each
constexpr int kAvx2MaxTile = 8;  // 8 16-bit accumulators + codes and constants in 16 registers
constexpr float kInt8Max = 127.0f;
constexpr int kRunCols = 16;  // columns per int8 step

// Columns per int8 step: 16, or 8 in a group of a multiple of 8 only.
int64_t run_cols(int64_t group) { return group % kRunCols == 0 ? kRunCols : kChunkCols; }

TARGET_AVX2 __m256 widen_bf16_avx2(const uint16_t* at) {
  __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

TARGET_AVX2 float max_lane_avx2(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

TARGET_AVX2 int32_t sum_lanes_avx2(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}

// Per row of x and run: q = round(x / dx) as int8 (round to nearest even, as torch.round),
// stored permuted (above), with dx and the sum of q per run; per group, the sum over its runs
// of dx times that sum (the zero term's input sum). A NaN anywhere in a run makes its dx
// NaN: NaN in, NaN out.
TARGET_AVX2 bool prepare_x_avx2(Problem& p, const void* x, int64_t ldx, int x_type) {
  constexpr int kLanes = 8;
  const int64_t run = run_cols(p.group);
  const int64_t n_runs = p.k / run, runs_per_group = p.group / run;
  const int64_t per_run = p.m * n_runs, per_group = p.m * p.n_groups;
  const size_t bytes = per_run * (sizeof(float) + sizeof(int32_t)) +
                       per_group * sizeof(float) + p.k * sizeof(float) + p.m * p.k;
  float* dx = static_cast<float*>(scratch_bytes(bytes));
  if (!dx) return false;
  int32_t* q_sum = reinterpret_cast<int32_t*>(dx + per_run);
  float* dx_sum = reinterpret_cast<float*>(q_sum + per_run);
  float* row = dx_sum + per_group;  // one row of x as fp32
  int8_t* xq = reinterpret_cast<int8_t*>(row + p.k);
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i chunk_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t r = 0; r < p.m; ++r) {
    const float* in = static_cast<const float*>(x) + r * ldx;
    if (x_type == kBFloat16) {
      for (int64_t col = 0; col < p.k; ++col) {
        row[col] = from_bf16(static_cast<const uint16_t*>(x)[r * ldx + col]);
      }
      in = row;
    }
    for (int64_t u = 0; u < n_runs; ++u) {
      const float* values = in + u * run;
      __m256 largest = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
      for (int64_t i = 0; i < run; i += kLanes) {
        __m256 v = _mm256_loadu_ps(values + i);
        largest = _mm256_max_ps(largest, _mm256_and_ps(v, magnitude));
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      }
      const bool has_nan = _mm256_movemask_ps(nan) != 0;
      const float step = has_nan ? NAN : max_lane_avx2(largest) / kInt8Max;
      const __m256 step_v = _mm256_set1_ps(step);
      __m256i sum = _mm256_setzero_si256();
      int8_t* out = xq + r * p.k + u * run;
      for (int64_t i = 0; i < run; i += kLanes) {
        __m256i q = _mm256_setzero_si256();
        if (step > 0.0f) {
          __m256 scaled = _mm256_div_ps(_mm256_loadu_ps(values + i), step_v);
          q = _mm256_cvtps_epi32(_mm256_round_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
        sum = _mm256_add_epi32(sum, q);
        q = _mm256_permutevar8x32_epi32(q, chunk_order);
        __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(out + i), _mm_packs_epi16(words, words));
      }
      const int64_t at = r * n_runs + u;
      dx[at] = step;
      q_sum[at] = sum_lanes_avx2(sum);
    }
    for (int64_t g = 0; g < p.n_groups; ++g) {
      float total = 0.0f;
      for (int64_t u = g * runs_per_group; u < (g + 1) * runs_per_group; ++u) {
        total += dx[r * n_runs + u] * static_cast<float>(q_sum[r * n_runs + u]);
      }
      dx_sum[r * p.n_groups + g] = total;
    }
  }
  p.xq = xq;
  p.dx = dx;
  p.dx_sum = dx_sum;
  p.q_sum = q_sum;
  return true;
}

template <int MT>
TARGET_AVX2 void half_avx2(const Problem& p, int64_t block, int64_t m0, int half, float* tile) {
  const __m256i low_nibbles = _mm256_set1_epi16(0x0f0f);
  const __m256i ones = _mm256_set1_epi16(1);
  const uint8_t* base = p.packed + block * p.n_groups * p.group_bytes;
  const int64_t run = run_cols(p.group), chunks_per_run = run / kChunkCols;
  const int64_t n_runs = p.k / run, runs_per_group = p.group / run;
  const int byte0 = half * kChunkBytes / 2;  // rows 0-7 in the chunk's first 32 bytes
  __m256 total[MT];
  for (int r = 0; r < MT; ++r) total[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < p.n_groups; ++g) {
    const uint8_t* codes = base + g * p.group_bytes;
    __m256 dot_x[MT];
    for (int r = 0; r < MT; ++r) dot_x[r] = _mm256_setzero_ps();
    for (int64_t u = 0; u < runs_per_group; ++u) {
      const int64_t first_col = g * p.group + u * run;
      __m256i dot[MT];  // 16-bit: each lane one row's two codes of a word, times x
      for (int r = 0; r < MT; ++r) dot[r] = _mm256_setzero_si256();
      for (int64_t c = 0; c < chunks_per_run; ++c) {
        const uint8_t* chunk = codes + (u * chunks_per_run + c) * kChunkBytes + byte0;
        _mm_prefetch(reinterpret_cast<const char*>(chunk) + kPrefetchBytes, _MM_HINT_T0);
        __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk));
        __m256i near = _mm256_and_si256(words, low_nibbles);  // columns h, h + 4
        __m256i far = _mm256_and_si256(_mm256_srli_epi16(words, 4), low_nibbles);  // h + 2, h + 6
        for (int r = 0; r < MT; ++r) {
          const int8_t* xc = p.xq + (m0 + r) * p.k + first_col + c * kChunkCols;
          int32_t near_x, far_x;
          memcpy(&near_x, xc, sizeof near_x);
          memcpy(&far_x, xc + 4, sizeof far_x);
          dot[r] = _mm256_add_epi16(dot[r], _mm256_maddubs_epi16(near, _mm256_set1_epi32(near_x)));
          dot[r] = _mm256_add_epi16(dot[r], _mm256_maddubs_epi16(far, _mm256_set1_epi32(far_x)));
        }
      }
      // sum (c - 8) q over the run, exact in int32 (|.| <= 15 * 127 * 16), and exact in fp32.
      for (int r = 0; r < MT; ++r) {
        const int64_t at = (m0 + r) * n_runs + g * runs_per_group + u;
        __m256i rows = _mm256_madd_epi16(dot[r], ones);
        __m256i centred = _mm256_sub_epi32(rows, _mm256_set1_epi32(kCodeOffset * p.q_sum[at]));
        dot_x[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(centred), _mm256_set1_ps(p.dx[at]), dot_x[r]);
      }
    }
    // sum ((c - 8) s + z) x = s sum_runs dx sum (c - 8) q + z sum_runs dx sum q: only these
    // fp32 steps round, in an order fixed per row.
    const uint16_t* scales = reinterpret_cast<const uint16_t*>(codes + p.group / kChunkCols * kChunkBytes);
    __m256 scale = widen_bf16_avx2(scales + half * kAvx2Rows);
    __m256 zero = widen_bf16_avx2(scales + kBlockRows + half * kAvx2Rows);
    for (int r = 0; r < MT; ++r) {
      total[r] = _mm256_fmadd_ps(dot_x[r], scale, total[r]);
      total[r] = _mm256_fmadd_ps(zero, _mm256_set1_ps(p.dx_sum[(m0 + r) * p.n_groups + g]), total[r]);
    }
  }
  for (int r = 0; r < MT; ++r) _mm256_storeu_ps(tile + r * kBlockRows + half * kAvx2Rows, total[r]);
}

template <int MT>
TARGET_AVX2 void tile_avx2(const Problem& p, int64_t block, int64_t m0, float* tile) {
  for (int half = 0; half < kBlockRows / kAvx2Rows; ++half) half_avx2<MT>(p, block, m0, half, tile);
}

// ------------------------------------------------------------------ dispatch

typedef void (*TileFn)(const Problem&, int64_t, int64_t, float*);

struct Path {
  const TileFn* tiles;  // tiles[rows] for 1..max_tile rows of x
  int max_tile;
};

const TileFn kAvx512Tiles[kMaxTile + 1] = {
    nullptr,         tile_avx512<1>, tile_avx512<2>,  tile_avx512<3>,  tile_avx512<4>,
    tile_avx512<5>,  tile_avx512<6>, tile_avx512<7>,  tile_avx512<8>,  tile_avx512<9>,
    tile_avx512<10>, tile_avx512<11>, tile_avx512<12>};
const TileFn kAvx2Tiles[kAvx2MaxTile + 1] = {
    nullptr,      tile_avx2<1>, tile_avx2<2>, tile_avx2<3>, tile_avx2<4>,
    tile_avx2<5>, tile_avx2<6>, tile_avx2<7>, tile_avx2<8>};

// Rows of x are split into equal tiles (16 rows: 8 + 8), each at most max_tile. Blocks are
// taken kBlocksPerBatch at a time, and every tile runs over them while they are in cache.
void run_blocks(const Problem& p, const Path& path, int64_t first, int64_t last) {
  alignas(64) float tile[kMaxTile * kBlockRows];
  const int64_t n_tiles = (p.m + path.max_tile - 1) / path.max_tile;
  for (int64_t start = first; start < last; start += kBlocksPerBatch) {
    const int64_t stop = start + kBlocksPerBatch < last ? start + kBlocksPerBatch : last;
    for (int64_t t = 0; t < n_tiles; ++t) {
      const int64_t m0 = p.m * t / n_tiles;
      const int rows = static_cast<int>(p.m * (t + 1) / n_tiles - m0);
      for (int64_t block = start; block < stop; ++block) {
        path.tiles[rows](p, block, m0, tile);
        finish_tile(p, block, m0, rows, tile);
      }
    }
  }
}

bool cpu_has(int isa) {
  __builtin_cpu_init();
  if (isa == kIsaAvx512) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  }
  if (isa == kIsaAvx2) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }
  return false;
}

}  // namespace

extern "C" {

int miniapp_native_abi(void) { return kAbiVersion; }

const char* miniapp_native_source_hash(void) { return MINIAPP_SOURCE_HASH; }

// Whether this CPU runs the given path (kIsaAvx512 = 2, kIsaAvx2 = 1).
int miniapp_int4_cpu_has(int isa) { return cpu_has(isa) ? 1 : 0; }

// A packed weight, described once (Python keeps one per weight and passes its address).
struct GgmlWeight;  // ggml_dot.cpp
int miniapp_ggml_gemm(const GgmlWeight* w, const void* x, int64_t ldx, int x_type, int64_t m,
                      float* y, int threads);

struct Int4Weight {
  const uint8_t* packed;
  int64_t n_blocks;
  int64_t k;
  int64_t group;
  int64_t n;  // outputs: rows of w, or gated outputs (half the rows) with kSiluMul
  int32_t epilogue;
  int32_t isa;
  // Not null: the weight is GGML blocks as the file stores them, and this kernel hands the
  // call to miniapp_ggml_gemm (so the fused layer runs either kind of weight).
  const GgmlWeight* ggml;
};

// y [m, n] (contiguous) for x [m, k] (fp32 or bf16, row stride ldx). With kSiluMul, blocks
// hold 8 gate rows then 8 up rows and y gets silu(gate) * up.
// Returns 0, or -1 for arguments it does not take (nothing is written then).
int miniapp_int4_gemm(const Int4Weight* w, const void* x, int64_t ldx, int x_type, int64_t m,
                      float* y, int threads) {
  if (w->ggml) return miniapp_ggml_gemm(w->ggml, x, ldx, x_type, m, y, threads);
  const int isa = w->isa, epilogue = w->epilogue;
  const int64_t n_blocks = w->n_blocks, k = w->k, group = w->group, n = w->n;
  if (!cpu_has(isa) || group <= 0 || group % kChunkCols || k % group || m < 0) return -1;
  if (x_type != kFloat32 && x_type != kBFloat16) return -1;
  if (epilogue != kStore && epilogue != kSiluMul) return -1;
  const int64_t rows_per_block = epilogue == kSiluMul ? kGateRows : kBlockRows;
  if (n > n_blocks * rows_per_block || n <= (n_blocks - 1) * rows_per_block) return -1;
  if (m == 0) return 0;
  Problem p = {};
  p.packed = w->packed;
  p.n_blocks = n_blocks;
  p.k = k;
  p.group = group;
  p.n_groups = k / group;
  p.group_bytes = kBlockRows * group / 2 + 2 * kScaleBytes;
  p.m = m;
  p.y = y;
  p.ldy = n;
  p.n = n;
  p.epilogue = epilogue;
  const bool avx512 = isa == kIsaAvx512;
  if (!(avx512 ? prepare_x_avx512(p, x, ldx, x_type) : prepare_x_avx2(p, x, ldx, x_type))) {
    return -1;
  }
  const Path path = avx512 ? Path{kAvx512Tiles, kMaxTile} : Path{kAvx2Tiles, kAvx2MaxTile};
  const int64_t macs = n_blocks * kBlockRows * k * m;
  if (threads > n_blocks) threads = static_cast<int>(n_blocks);
  if (threads <= 1 || macs < kMinParallelMacs) {
    run_blocks(p, path, 0, n_blocks);
    return 0;
  }
#pragma omp parallel num_threads(threads)
  {
    // Contiguous ranges of blocks: each thread streams its own part of the weight.
    const int64_t t = omp_get_thread_num(), count = omp_get_num_threads();
    run_blocks(p, path, n_blocks * t / count, n_blocks * (t + 1) / count);
  }
  return 0;
}

// Q4_0 / Q4_1 rows of a GGUF file straight into the packed layout (what
// miniapp.native.int4.pack gives for engine/quant.py's codes of those types): the codes keep
// their 4 bits, scale = d and zero = m + 8 d (Q4_1) or 0 (Q4_0, whose w = d (q - 8)), both
// rounded to bf16. rows[r] points at row r of the packed order (n_rows, a multiple of 16);
// null is a padding row, which decodes to zero. One pass over the bytes, no Python loop:
// loading a file's Q4 weights costs a copy, not a conversion. Returns 0, or -1 for a type or
// shape it does not take.
TARGET_AVX2 int miniapp_int4_pack_q4(const uint8_t* const* rows, int64_t n_rows, int64_t k, int ggml_type,
                         uint8_t* out, int threads) {
  constexpr int kQ4_0 = 2, kQ4_1 = 3, kGroup = 32;
  if ((ggml_type != kQ4_0 && ggml_type != kQ4_1) || k % kGroup || n_rows % kBlockRows) return -1;
  const int64_t block_bytes = ggml_type == kQ4_0 ? 18 : 20, quant_at = ggml_type == kQ4_0 ? 2 : 4;
  const int64_t n_groups = k / kGroup, n_blocks = n_rows / kBlockRows;
  const int64_t group_bytes = kBlockRows * kGroup / 2 + 2 * kScaleBytes;
#pragma omp parallel for num_threads(threads > 0 ? threads : 1) schedule(static)
  for (int64_t block = 0; block < n_blocks; ++block) {
    for (int64_t g = 0; g < n_groups; ++g) {
      uint8_t* group = out + (block * n_groups + g) * group_bytes;
      uint16_t* scales = reinterpret_cast<uint16_t*>(group + kBlockRows * kGroup / 2);
      uint16_t* zeros = scales + kBlockRows;
      for (int r = 0; r < kBlockRows; ++r) {
        const uint8_t* row = rows[block * kBlockRows + r];
        uint8_t codes[kGroup];
        float scale = 0.0f, zero = 0.0f;
        if (row) {
          const uint8_t* source = row + g * block_bytes;
          uint16_t half;
          memcpy(&half, source, 2);
          scale = _cvtsh_ss(half);
          if (ggml_type == kQ4_1) {
            memcpy(&half, source + 2, 2);
            zero = _cvtsh_ss(half) + 8.0f * scale;
          }
          for (int i = 0; i < kGroup / 2; ++i) {
            codes[i] = source[quant_at + i] & 0x0F;
            codes[i + kGroup / 2] = source[quant_at + i] >> 4;
          }
        } else {
          memset(codes, kCodeOffset, sizeof codes);
        }
        scales[r] = to_bf16(scale);
        zeros[r] = to_bf16(zero);
        // Column 8c + 2j + h of row r: nibble j of 16-bit word 2r + h of chunk c.
        for (int c = 0; c < kGroup / kChunkCols; ++c) {
          uint8_t* chunk = group + c * kChunkBytes;
          for (int h = 0; h < 2; ++h) {
            const uint8_t* col = codes + kChunkCols * c + h;
            chunk[2 * (2 * r + h)] = static_cast<uint8_t>(col[0] | col[2] << 4);
            chunk[2 * (2 * r + h) + 1] = static_cast<uint8_t>(col[4] | col[6] << 4);
          }
        }
      }
    }
  }
  return 0;
}

}  // extern "C"

namespace {

// ----------------------------------------------------------------------------- Attention
//
// softmax(q k^T * scale) v for a few query rows (decode steps, speculative verification),
// each row over its own visible keys: the first lengths[r] keys, or those its mask row
// marks. Keys and values are fp32 [kv_heads, tokens, head_dim] with rows of head_dim
// contiguous; query head h reads kv head h / (n_heads / kv_heads) (grouped-query attention).
//
// Why: torch's CPU attention runs a decode row at ~14 GB/s over an fp32 cache and, with
// grouped heads, reads each key once per query head. Here the query heads of a group share
// each key and value load, and long rows are split into independent parts that both
// threads stream. Over q8 and q4 keys a row's query is quantized to int8 blocks once (as
// llama.cpp dots a q8_0 query with its quantized caches) and scores are integer dot products
// of codes, scaled per block; q8 and q4 values are summed as codes times weight * scale. At
// 3000 keys that took a layer's q8 attention from about 660 to 340 us on one AVX2 thread.
//
// Row independence, as for the GEMM: a row's result depends only on its own scanned keys
// (lengths[r], or the mask row's length). The keys are cut into parts of kKeysPerPart in
// order; each part gives (max, sum of exp, sum of exp * v), merged in part order. No part
// boundary depends on the batch, the other rows or the thread count, so a row attended in a
// batch of 9 is bit-identical to the same row attended alone (which verification needs).

constexpr int64_t kKeysPerPart = 256;
constexpr int kMaxGroup = 16;  // query heads per kv head
constexpr int kMaxHeadDim = 512;
constexpr int64_t kMinParallelKeyMacs = 1 << 15;

// ---------------------------------------------------------------------------- KV storage
//
// One stored row per (kv head, token), as engine/kv_types.py lays it out: f32, f16 or bf16
// values; q8: head_dim int8 codes, then one f16 scale per block of 32 (x = code * scale);
// q4: head_dim / 2 bytes of codes (byte i of a block: value i in its low nibble, i + 16 in
// its high), then the blocks' f16 scales, then their f16 minimums (x = code * scale + min).
// Decoding is exact in fp32 (code * scale needs at most 19 bits), so the kernel, the codecs
// and the torch reference agree bit for bit on what a stored row holds.
//
// Quantized rows are stored rotated: x times a normalised Hadamard matrix (block-diagonal,
// blocks of the largest power of two dividing head_dim), as llama.cpp rotates its quantized
// caches. Keys and values have a few large channels; the rotation spreads them over the
// whole row, so a block's scale no longer follows its one outlier. It is orthogonal and its
// own inverse, so attention is unchanged when the queries are rotated alike and each output
// is rotated back (`attend` does both, per row).

enum KvType { kKvF32 = 0, kKvF16 = 1, kKvBf16 = 2, kKvQ8 = 3, kKvQ4 = 4, kKvQ4Tiles = 5 };
constexpr int64_t kKvBlock = 32;
// q4 tiles (keys only): 4-bit codes per channel over tiles of kTileRows tokens (KIVI's
// layout). Keys have a few channels that are large for every token; a scale and minimum per
// channel and tile follow them, where a block along the head dimension has to span them.
// A tile is kTileRows consecutive rows of one kv head, each as wide as a q4 row: the token's
// d / 2 bytes of codes (blocks of 32 channels, byte i holding channel i in its low nibble and
// i + 16 in its high, as q4), then d / 8 bytes: row r's share of the tile's side table, the
// f16 scales of channels 0..d-1 then their f16 minimums (4d bytes, spread over the 32 rows).
// Values x = code * scale + minimum, not rotated. Only complete tiles are stored this way:
// the cache keeps the newest, incomplete one in fp32 (queries see their own tile exactly).
constexpr int64_t kTileRows = 32;
constexpr float kF16Max = 65504.0f;

int64_t kv_row_bytes(int type, int64_t d) {
  switch (type) {
    case kKvF32: return 4 * d;
    case kKvF16:
    case kKvBf16: return 2 * d;
    case kKvQ8: return d + 2 * (d / kKvBlock);
    case kKvQ4:
    case kKvQ4Tiles: return d / 2 + 4 * (d / kKvBlock);
    default: return -1;
  }
}

bool kv_type_takes(int type, int64_t d) {
  if (kv_row_bytes(type, d) < 0 || d % 8 || d > kMaxHeadDim) return false;
  return type < kKvQ8 || d % kKvBlock == 0;
}

// Codec calls add kKvRotated to a type for rows stored rotated (the quantized types).
constexpr int kKvRotated = 8;
// q8 and q4 store codes in blocks of 32 with their scales: stored rotated, and the attention
// kernel dots such keys with an int8 query.
constexpr bool quantized_type(int type) { return type == kKvQ8 || type == kKvQ4; }
bool stored_rotated(int type) { return quantized_type(type); }

// x (d values) times the normalised Hadamard matrix, in place: butterflies of widening span,
// (a, b) -> (a + b, a - b), then one scale. The order is fixed, so the torch reference
// (engine/kv_codec.py) computes the same bits.
void rotate_row(float* x, int64_t d) {
  const int64_t size = d & -d;  // the largest power of two dividing d
  const float scale = 1.0f / sqrtf(static_cast<float>(size));
  for (int64_t start = 0; start < d; start += size) {
    float* block = x + start;
    for (int64_t span = 1; span < size; span *= 2) {
      for (int64_t i = 0; i < size; i += 2 * span) {
        for (int64_t j = i; j < i + span; ++j) {
          const float a = block[j], b = block[j + span];
          block[j] = a + b;
          block[j + span] = a - b;
        }
      }
    }
  }
  for (int64_t i = 0; i < d; ++i) x[i] *= scale;
}

TARGET_AVX2 inline float f16_at(const uint8_t* p) {
  uint16_t bits;
  memcpy(&bits, p, sizeof bits);
  return _cvtsh_ss(bits);
}

TARGET_AVX2 inline void put_f16(uint8_t* p, float x) {
  x = x > kF16Max ? kF16Max : (x < -kF16Max ? -kF16Max : x);
  const uint16_t bits = _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT);
  memcpy(p, &bits, sizeof bits);
}

// Values 8c..8c+7 of a stored row of d values, as fp32.
template <int T>
TARGET_AVX2 inline __m256 load8(const uint8_t* row, int64_t c, int64_t d) {
  if constexpr (T == kKvF32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + 8 * c);
  } else if constexpr (T == kKvF16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * c)));
  } else if constexpr (T == kKvBf16) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * c));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  } else if constexpr (T == kKvQ8) {
    const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8 * c));
    const __m256 values = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes));
    return _mm256_mul_ps(values, _mm256_set1_ps(f16_at(row + d + 2 * (c / 4))));
  } else {
    // Chunk c of the row is quarter c % 4 of block c / 4: the low nibbles of the block's
    // bytes 0-7 and 8-15, then their high nibbles.
    const int64_t block = c / 4, quarter = c % 4;
    const uint8_t* bytes = row + 16 * block + 8 * (quarter & 1);
    __m256i codes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
    if (quarter >= 2) codes = _mm256_srli_epi32(codes, 4);
    codes = _mm256_and_si256(codes, _mm256_set1_epi32(15));
    const uint8_t* tail = row + d / 2;
    const __m256 scale = _mm256_set1_ps(f16_at(tail + 2 * block));
    const __m256 low = _mm256_set1_ps(f16_at(tail + 2 * (d / kKvBlock + block)));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(codes), scale, low);
  }
}

// A whole stored row of d values as fp32 (unrotated), block by block: each block's scale
// (and minimum) is read once. The same values as load8, chunk for chunk.
template <int T>
TARGET_AVX2 inline void unpack_row(const uint8_t* row, int64_t d, float* out) {
  if constexpr (T == kKvQ8) {
    for (int64_t b = 0; b < d / kKvBlock; ++b) {
      const __m256 scale = _mm256_set1_ps(f16_at(row + d + 2 * b));
      const uint8_t* codes = row + kKvBlock * b;
      for (int64_t i = 0; i < kKvBlock; i += 8) {
        const __m128i eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i));
        const __m256 values = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight));
        _mm256_storeu_ps(out + kKvBlock * b + i, _mm256_mul_ps(values, scale));
      }
    }
  } else if constexpr (T == kKvQ4) {
    const uint8_t* tail = row + d / 2;
    const __m128i nibble = _mm_set1_epi8(15);
    for (int64_t b = 0; b < d / kKvBlock; ++b) {
      const __m256 scale = _mm256_set1_ps(f16_at(tail + 2 * b));
      const __m256 low = _mm256_set1_ps(f16_at(tail + 2 * (d / kKvBlock + b)));
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * b));
      const __m128i lows = _mm_and_si128(bytes, nibble);  // values 0-15 of the block
      const __m128i highs = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);  // 16-31
      const __m128i parts[4] = {lows, _mm_srli_si128(lows, 8), highs, _mm_srli_si128(highs, 8)};
      for (int i = 0; i < 4; ++i) {
        const __m256 codes = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i]));
        _mm256_storeu_ps(out + kKvBlock * b + 8 * i, _mm256_fmadd_ps(codes, scale, low));
      }
    }
  } else {
    for (int64_t c = 0; c < d / 8; ++c) _mm256_storeu_ps(out + 8 * c, load8<T>(row, c, d));
  }
}

template <int T>
TARGET_AVX2 void decode_row(const uint8_t* row, int64_t d, float* out, bool rotated) {
  unpack_row<T>(row, d, out);
  if (rotated) rotate_row(out, d);
}

// One row of d fp32 values (stride 1) into its stored form; blocks of 32 for q8 and q4,
// codes from the f16-rounded scale (and minimum), rounded half to even as torch.round does.
TARGET_AVX2 void encode_row(int type, const float* x, int64_t d, uint8_t* out, bool rotated) {
  if (type == kKvF32) {
    memcpy(out, x, sizeof(float) * d);
    return;
  }
  if (type == kKvF16) {
    for (int64_t i = 0; i < d; ++i) put_f16(out + 2 * i, x[i]);
    return;
  }
  if (type == kKvBf16) {  // round to nearest even, as torch converts
    for (int64_t i = 0; i < d; ++i) {
      uint32_t bits;
      memcpy(&bits, x + i, sizeof bits);
      const uint16_t top = static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
      memcpy(out + 2 * i, &top, sizeof top);
    }
    return;
  }
  float turned[kMaxHeadDim];
  if (rotated) {
    memcpy(turned, x, sizeof(float) * d);
    rotate_row(turned, d);
    x = turned;
  }
  const int64_t n_blocks = d / kKvBlock;
  for (int64_t b = 0; b < n_blocks; ++b) {
    const float* v = x + b * kKvBlock;
    if (type == kKvQ8) {
      float top = 0.0f;
      for (int64_t i = 0; i < kKvBlock; ++i) top = fabsf(v[i]) > top ? fabsf(v[i]) : top;
      put_f16(out + d + 2 * b, top / 127.0f);
      const float scale = f16_at(out + d + 2 * b);
      for (int64_t i = 0; i < kKvBlock; ++i) {
        float q = scale > 0.0f ? nearbyintf(v[i] / scale) : 0.0f;
        q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
        out[b * kKvBlock + i] = static_cast<uint8_t>(static_cast<int8_t>(q));
      }
      continue;
    }
    float low = v[0], high = v[0];
    for (int64_t i = 1; i < kKvBlock; ++i) {
      low = v[i] < low ? v[i] : low;
      high = v[i] > high ? v[i] : high;
    }
    uint8_t* tail = out + d / 2;
    put_f16(tail + 2 * (n_blocks + b), low);
    low = f16_at(tail + 2 * (n_blocks + b));
    put_f16(tail + 2 * b, (high - low) / 15.0f);
    const float scale = f16_at(tail + 2 * b);
    uint8_t codes[kKvBlock];
    for (int64_t i = 0; i < kKvBlock; ++i) {
      float q = scale > 0.0f ? nearbyintf((v[i] - low) / scale) : 0.0f;
      q = q > 15.0f ? 15.0f : (q < 0.0f ? 0.0f : q);
      codes[i] = static_cast<uint8_t>(q);
    }
    for (int64_t i = 0; i < kKvBlock / 2; ++i) {
      out[b * kKvBlock / 2 + i] = static_cast<uint8_t>(codes[i] | (codes[i + kKvBlock / 2] << 4));
    }
  }
}

// The side table of a stored tile (kTileRows rows of row_bytes, codes first): per channel c,
// its scale and minimum as fp32.
TARGET_AVX2 void tile_side(const uint8_t* tile, int64_t d, float* scales, float* lows) {
  const int64_t share = d / 8, row_bytes = d / 2 + share;  // bytes of the table a row holds
  alignas(32) uint8_t side[4 * kMaxHeadDim];
  // share = d / 8 is a multiple of 8 bytes (d is of 32s): fixed-size copies the compiler
  // turns into single moves (a memcpy call of a run-time size per row cost more than the rest).
  for (int64_t r = 0; r < kTileRows; ++r) {
    const uint8_t* from = tile + r * row_bytes + d / 2;
    for (int64_t b = 0; b < share; b += 8) memcpy(side + r * share + b, from + b, 8);
  }
  for (int64_t c = 0; c < d; c += 8) {
    const __m128i scale_bits = _mm_load_si128(reinterpret_cast<const __m128i*>(side + 2 * c));
    const __m128i low_bits = _mm_load_si128(reinterpret_cast<const __m128i*>(side + 2 * (d + c)));
    _mm256_storeu_ps(scales + c, _mm256_cvtph_ps(scale_bits));
    _mm256_storeu_ps(lows + c, _mm256_cvtph_ps(low_bits));
  }
}

// kTileRows rows of d fp32 values (token_stride floats apart) into one stored tile. Scales
// and minimums are rounded to f16 first and codes computed from the rounded ones (rounded
// half to even, as torch.round), as q4 rows do, so decoding is exact in fp32.
TARGET_AVX2 void encode_tile(const float* x, int64_t token_stride, int64_t d, uint8_t* tile) {
  const int64_t share = d / 8, row_bytes = d / 2 + share;
  uint8_t side[4 * kMaxHeadDim];
  for (int64_t c = 0; c < d; ++c) {
    float low = x[c], high = x[c];
    for (int64_t r = 1; r < kTileRows; ++r) {
      const float v = x[r * token_stride + c];
      low = v < low ? v : low;
      high = v > high ? v : high;
    }
    put_f16(side + 2 * (d + c), low);
    low = f16_at(side + 2 * (d + c));
    put_f16(side + 2 * c, (high - low) / 15.0f);
    const float scale = f16_at(side + 2 * c);
    for (int64_t r = 0; r < kTileRows; ++r) {
      float q = scale > 0.0f ? nearbyintf((x[r * token_stride + c] - low) / scale) : 0.0f;
      q = q > 15.0f ? 15.0f : (q < 0.0f ? 0.0f : q);
      const int64_t block = c / kKvBlock, i = c % kKvBlock;
      uint8_t* byte = tile + r * row_bytes + block * (kKvBlock / 2) + i % (kKvBlock / 2);
      const uint8_t code = static_cast<uint8_t>(q);
      *byte = i < kKvBlock / 2 ? static_cast<uint8_t>((*byte & 0xF0) | code)
                               : static_cast<uint8_t>((*byte & 0x0F) | (code << 4));
    }
  }
  for (int64_t r = 0; r < kTileRows; ++r) {
    memcpy(tile + r * row_bytes + d / 2, side + r * share, share);
  }
}

// A stored tile back into kTileRows rows of d fp32 values (contiguous).
TARGET_AVX2 void decode_tile(const uint8_t* tile, int64_t d, float* out) {
  const int64_t row_bytes = d / 2 + d / 8;
  float scales[kMaxHeadDim], lows[kMaxHeadDim];
  tile_side(tile, d, scales, lows);
  for (int64_t r = 0; r < kTileRows; ++r) {
    const uint8_t* row = tile + r * row_bytes;
    for (int64_t c = 0; c < d; ++c) {
      const int64_t block = c / kKvBlock, i = c % kKvBlock;
      const uint8_t byte = row[block * (kKvBlock / 2) + i % (kKvBlock / 2)];
      const int code = i < kKvBlock / 2 ? byte & 15 : byte >> 4;
      out[r * d + c] = fmaf(static_cast<float>(code), scales[c], lows[c]);
    }
  }
}

// -------------------------------------------------------------------- Attention, continued

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

struct AttendProblem {
  const float* q;
  const RowKeys* rows;  // one per query row
  int64_t n_heads, kv_heads, group, head_dim;
  float scale;
  float* out;
  // Rows over q8 or q4 keys: their (rotated) queries in blocks of 32 int8 codes, as llama.cpp
  // dots a q8_0 query with its quantized caches: [rows, n_heads, head_dim] codes, and per
  // block its step and the sum of its dequantized values (q4's minimums multiply it).
  const int8_t* q_codes;
  const float* q_steps;  // [rows, n_heads, head_dim / 32]
  const float* q_sums;   // [rows, n_heads, head_dim / 32]
};

struct AttendTask {
  int64_t row, kv_head, first, last;  // keys first..last-1 of the row's scan
  float* partial;  // group x (2 + head_dim): max, sum, then the unnormalised output
};

// exp(x) for x <= 0 (scores minus their maximum), Cephes-style: 2^n * e^r, |r| <= ln2/2,
// with a degree-5 polynomial for e^r (relative error ~2e-7). Below -87 it gives ~0.
TARGET_AVX2 inline __m256 exp_nonpositive(__m256 x) {
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  __m256 n = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, log2e), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                    _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

TARGET_AVX2 inline float sum8(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// A stored row's values as fp32: f32 rows are read where they are, the others unpacked.
template <int T>
TARGET_AVX2 inline const float* row_floats(const uint8_t* row, int64_t d, float* buffer) {
  if constexpr (T == kKvF32) {
    return reinterpret_cast<const float*>(row);
  } else {
    unpack_row<T>(row, d, buffer);
    return buffer;
  }
}

// A query row (d values, rotated) as blocks of 32 int8 codes, step = max |x| / 127 in fp32,
// rounded half to even: the same codes as native/reference.py's quantized_query.
TARGET_AVX2 void quantize_query(const float* x, int64_t d, int8_t* codes, float* steps,
                                float* sums) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256 limit = _mm256_set1_ps(127.0f);
  for (int64_t b = 0; b < d / kKvBlock; ++b) {
    const float* v = x + b * kKvBlock;
    __m256 top8 = _mm256_setzero_ps();
    for (int64_t i = 0; i < kKvBlock; i += 8) {
      top8 = _mm256_max_ps(top8, _mm256_and_ps(_mm256_loadu_ps(v + i), magnitude));
    }
    __m128 top4 = _mm_max_ps(_mm256_castps256_ps128(top8), _mm256_extractf128_ps(top8, 1));
    top4 = _mm_max_ps(top4, _mm_movehl_ps(top4, top4));
    top4 = _mm_max_ss(top4, _mm_movehdup_ps(top4));
    const float step = _mm_cvtss_f32(top4) / 127.0f;
    // round(x / step) half to even, as nearbyintf and torch.round; division as the scalar.
    const __m256 divisor = _mm256_set1_ps(step > 0.0f ? step : 1.0f);
    __m256i total8 = _mm256_setzero_si256();
    __m256i q[4];
    for (int i = 0; i < 4; ++i) {
      __m256 r = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(v + 8 * i), divisor),
                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      r = _mm256_max_ps(_mm256_min_ps(r, limit), _mm256_sub_ps(_mm256_setzero_ps(), limit));
      if (!(step > 0.0f)) r = _mm256_setzero_ps();
      q[i] = _mm256_cvtps_epi32(r);
      total8 = _mm256_add_epi32(total8, q[i]);
    }
    // 32 int32 codes (within int8) to bytes in order: the packs work per 128-bit lane, so
    // the result's 32-bit groups come out as 0 2 4 6 1 3 5 7 and are put back in order.
    const __m256i words = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                             _mm256_packs_epi32(q[2], q[3]));
    const __m256i ordered = _mm256_permutevar8x32_epi32(words, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + b * kKvBlock), ordered);
    alignas(32) int32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), total8);
    int32_t total = 0;
    for (int i = 0; i < 8; ++i) total += lanes[i];
    steps[b] = step;
    sums[b] = step * static_cast<float>(total);
  }
}

// The 32 codes of block b of a stored key row as bytes in value order: signed for q8,
// unsigned 0..15 for q4.
template <int T>
TARGET_AVX2 inline __m256i key_block_codes(const uint8_t* row, int64_t b) {
  if constexpr (T == kKvQ8) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + kKvBlock * b));
  } else {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * b));
    const __m128i nibble = _mm_set1_epi8(15);
    const __m128i lows = _mm_and_si128(bytes, nibble);  // values 0-15 of the block
    const __m128i highs = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);  // 16-31
    return _mm256_set_m128i(highs, lows);
  }
}

// Eight vectors' sums at once: lane j of the result is the sum of v[j]'s lanes.
TARGET_AVX2 inline __m256 sum8x8(const __m256* v) {
  const __m256 s01 = _mm256_hadd_ps(v[0], v[1]), s23 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 s45 = _mm256_hadd_ps(v[4], v[5]), s67 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 low = _mm256_hadd_ps(s01, s23), high = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20),
                       _mm256_permute2f128_ps(low, high, 0x31));
}

// Scores of n stored q8 or q4 key rows (keys[i] of k) against G quantized query heads (G = 0:
// g, known at run time only), in integers block by block: a block's 32 code products are
// summed exactly (int32), then scaled by the key's and the query's steps; q4 adds its
// minimum times the query block's sum. Keys at most 127 and 15 in size keep each pair of
// products within int16 (maddubs does not saturate). Eight keys' lane sums are reduced
// together.
template <int T, int G>
TARGET_AVX2 void integer_key_scores(const uint8_t* k, int64_t key_bytes, const int32_t* keys,
                                    int64_t n, int64_t d, int64_t group, const int8_t* q_codes,
                                    const float* q_steps, const float* q_sums, float scale,
                                    float (*scores)[kKeysPerPart + 8]) {
  const int64_t g = G ? G : group, blocks = d / kKvBlock;
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t tail = T == kKvQ8 ? d : d / 2;  // where a row's scales start
  __m256 lanes[kMaxGroup][8];
  float lows[kMaxGroup][8];
  for (int64_t first = 0; first < n; first += 8) {
    for (int64_t j = 0; j < 8; ++j) {
      __m256 acc[kMaxGroup];
      for (int64_t h = 0; h < g; ++h) {
        acc[h] = _mm256_setzero_ps();
        lows[h][j] = 0.0f;
      }
      if (first + j < n) {
        const uint8_t* row = k + keys[first + j] * key_bytes;
        for (int64_t b = 0; b < blocks; ++b) {
          const __m256i codes = key_block_codes<T>(row, b);
          // maddubs multiplies unsigned bytes by signed ones: q8 moves the key's sign onto
          // the query.
          const __m256i unsigned_codes = T == kKvQ8 ? _mm256_sign_epi8(codes, codes) : codes;
          const __m256 step = _mm256_set1_ps(f16_at(row + tail + 2 * b));
          const float low = T == kKvQ4 ? f16_at(row + tail + 2 * (blocks + b)) : 0.0f;
          for (int64_t h = 0; h < g; ++h) {
            __m256i q = _mm256_loadu_si256(
                reinterpret_cast<const __m256i*>(q_codes + h * d + kKvBlock * b));
            if constexpr (T == kKvQ8) q = _mm256_sign_epi8(q, codes);
            const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(unsigned_codes, q), ones);
            const __m256 both = _mm256_mul_ps(step, _mm256_set1_ps(q_steps[h * blocks + b]));
            acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), both, acc[h]);
            if constexpr (T == kKvQ4) lows[h][j] += low * q_sums[h * blocks + b];
          }
        }
      }
      for (int64_t h = 0; h < g; ++h) lanes[h][j] = acc[h];
    }
    for (int64_t h = 0; h < g; ++h) {
      __m256 sums = sum8x8(lanes[h]);
      if constexpr (T == kKvQ4) sums = _mm256_add_ps(sums, _mm256_loadu_ps(lows[h]));
      _mm256_storeu_ps(scores[h] + first, _mm256_mul_ps(sums, _mm256_set1_ps(scale)));
    }
  }
}

// The dot product of fp32 rows a and b of d values, in 8 lanes then summed.
TARGET_AVX2 inline float dot_floats(const float* a, const float* b, int64_t d) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t c = 0; c < d; c += 8) {
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + c), _mm256_loadu_ps(b + c), acc);
  }
  return sum8(acc);
}

// Scores of keys stored as q4 tiles (see RowKeys) for one kv head's g query heads q (fp32,
// unrotated). A tile's key is x = code * scale + minimum per channel, so q . x = (q * scale) .
// code + q . minimum: per tile, each head's q * scale is quantized to int8 blocks as a query
// over q8 keys is, and its keys' scores are integer dot products of codes, plus the constant.
// Lead and own-tile keys are fp32. Each key's score depends on its tile and the query only.
// G query heads (G = 0: group, known at run time only), as integer_key_scores.
template <int G>
TARGET_AVX2 void tiled_key_scores(const RowKeys& source, int64_t kv_head, const int32_t* keys,
                                  int64_t n, int64_t d, int64_t group, const float* q,
                                  float scale, float (*scores)[kKeysPerPart + 8]) {
  const int64_t g = G ? G : group;
  const int64_t blocks = d / kKvBlock, row_bytes = kv_row_bytes(kKvQ4Tiles, d);
  const uint8_t* k = source.k + kv_head * source.k_head_stride;
  const float* lead = source.lead + kv_head * source.lead_head_stride;
  const float* recent = source.recent + kv_head * source.recent_head_stride;
  const __m256i ones = _mm256_set1_epi16(1);
  alignas(32) int8_t codes[kMaxGroup][kMaxHeadDim];
  float steps[kMaxGroup][kMaxHeadDim / kKvBlock], sums[kMaxHeadDim / kKvBlock];
  float constant[kMaxGroup], side_scales[kMaxHeadDim], side_lows[kMaxHeadDim];
  alignas(32) float scaled[kMaxHeadDim];
  __m256 lanes[kMaxGroup][8];
  int64_t loaded = -1;  // the tile whose side table the query codes are for
  // The tile of key j, or -1 for an fp32 key (a lead row or a row of the query's own tile).
  auto tile_of = [&](int64_t j) -> int64_t {
    if (j < source.lead_rows) return -1;
    const int64_t tile = (j - source.lead_rows) / kTileRows;
    return tile == source.own_tile ? -1 : tile;
  };
  for (int64_t i = 0; i < n;) {
    const int64_t j = keys[i], tile = tile_of(j);
    if (tile < 0) {
      const float* exact = j < source.lead_rows ? lead + j * d
          : recent + ((source.own_tile % 2) * kTileRows + (j - source.lead_rows) % kTileRows) * d;
      for (int64_t h = 0; h < g; ++h) scores[h][i] = dot_floats(q + h * d, exact, d) * scale;
      ++i;
      continue;
    }
    if (tile != loaded) {
      tile_side(k + tile * kTileRows * row_bytes, d, side_scales, side_lows);
      for (int64_t h = 0; h < g; ++h) {
        const float* qh = q + h * d;
        __m256 total = _mm256_setzero_ps();
        for (int64_t c = 0; c < d; c += 8) {
          const __m256 qc = _mm256_loadu_ps(qh + c);
          _mm256_store_ps(scaled + c, _mm256_mul_ps(qc, _mm256_loadu_ps(side_scales + c)));
          total = _mm256_fmadd_ps(qc, _mm256_loadu_ps(side_lows + c), total);
        }
        constant[h] = sum8(total);
        quantize_query(scaled, d, codes[h], steps[h], sums);
      }
      loaded = tile;
    }
    // Up to 8 keys of this tile at once, their lane sums reduced together.
    int64_t run = 1;
    while (run < 8 && i + run < n && tile_of(keys[i + run]) == tile) ++run;
    for (int64_t r = 0; r < 8; ++r) {
      // Sums in registers, stored once (zeroing the lanes first cost a memset a run).
      __m256 acc[kMaxGroup];
      for (int64_t h = 0; h < g; ++h) acc[h] = _mm256_setzero_ps();
      if (r < run) {
        const uint8_t* row = k + (keys[i + r] - source.lead_rows) * row_bytes;
        for (int64_t b = 0; b < blocks; ++b) {
          const __m256i key = key_block_codes<kKvQ4>(row, b);
          for (int64_t h = 0; h < g; ++h) {
            const __m256i qb =
                _mm256_load_si256(reinterpret_cast<const __m256i*>(codes[h] + kKvBlock * b));
            const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(key, qb), ones);
            acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(steps[h][b]), acc[h]);
          }
        }
      }
      for (int64_t h = 0; h < g; ++h) lanes[h][r] = acc[h];
    }
    for (int64_t h = 0; h < g; ++h) {
      alignas(32) float total[8];
      _mm256_store_ps(total, sum8x8(lanes[h]));
      for (int64_t r = 0; r < run; ++r) scores[h][i + r] = (total[r] + constant[h]) * scale;
    }
    i += run;
  }
}

// Codes 8c..8c+7 of a stored q8 or q4 value row as fp32 (the block's scale not applied).
template <int T>
TARGET_AVX2 inline __m256 codes8(const uint8_t* row, int64_t c) {
  if constexpr (T == kKvQ8) {
    const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8 * c));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes));
  } else {
    const int64_t block = c / 4, quarter = c % 4;  // as load8 reads a q4 row
    const uint8_t* bytes = row + 16 * block + 8 * (quarter & 1);
    __m256i codes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
    if (quarter >= 2) codes = _mm256_srli_epi32(codes, 4);
    return _mm256_cvtepi32_ps(_mm256_and_si256(codes, _mm256_set1_epi32(15)));
  }
}

// The weighted sum of n stored q8 or q4 value rows (keys[i] of v) for G heads' weights (G =
// 0: g, known at run time only). Each key's weight times its block's scale multiplies the
// codes directly; q4's minimums add weight * minimum per block. A pass over the keys sums
// kSpan chunks of a block, G * kSpan sums held in registers.
template <int T, int G>
TARGET_AVX2 void sum_quantized_values(const uint8_t* v, int64_t value_bytes, const int32_t* keys,
                                      int64_t n, int64_t d, int64_t group,
                                      const float (*scores)[kKeysPerPart + 8], float* partial) {
  constexpr int64_t kSpan = G != 0 && G <= 3 ? 4 : 2;
  const int64_t g = G ? G : group, blocks = d / kKvBlock;
  const int64_t tail = T == kKvQ8 ? d : d / 2;  // where a row's scales start
  for (int64_t b = 0; b < blocks; ++b) {
    float lows[kMaxGroup] = {};
    for (int64_t first = 4 * b; first < 4 * b + 4; first += kSpan) {
      __m256 acc[kMaxGroup][kSpan];
      for (int64_t h = 0; h < g; ++h) {
        for (int64_t s = 0; s < kSpan; ++s) acc[h][s] = _mm256_setzero_ps();
      }
      for (int64_t i = 0; i < n; ++i) {
        const uint8_t* row = v + keys[i] * value_bytes;
        const __m256 step = _mm256_set1_ps(f16_at(row + tail + 2 * b));
        if (T == kKvQ4 && first == 4 * b) {
          const float low = f16_at(row + tail + 2 * (blocks + b));
          for (int64_t h = 0; h < g; ++h) lows[h] += scores[h][i] * low;
        }
        __m256 codes[kSpan];
        for (int64_t s = 0; s < kSpan; ++s) codes[s] = codes8<T>(row, first + s);
        for (int64_t h = 0; h < g; ++h) {
          const __m256 weight = _mm256_mul_ps(_mm256_set1_ps(scores[h][i]), step);
          for (int64_t s = 0; s < kSpan; ++s) acc[h][s] = _mm256_fmadd_ps(weight, codes[s], acc[h][s]);
        }
      }
      for (int64_t h = 0; h < g; ++h) {
        const __m256 low = _mm256_set1_ps(lows[h]);
        for (int64_t s = 0; s < kSpan; ++s) {
          _mm256_storeu_ps(partial + h * (2 + d) + 2 + 8 * (first + s), _mm256_add_ps(acc[h][s], low));
        }
      }
    }
  }
}

// One part of one row for one group of query heads, reading keys stored as TK and values
// stored as TV.
template <int TK, int TV>
TARGET_AVX2 void attend_part(const AttendProblem& p, const AttendTask& t) {
  const int64_t d = p.head_dim, g = p.group, chunks = d / 8;
  const RowKeys& source = p.rows[t.row];
  const int64_t key_bytes = kv_row_bytes(TK, d), value_bytes = kv_row_bytes(TV, d);
  const uint8_t* k = source.k + t.kv_head * source.k_head_stride;
  const uint8_t* v = source.v + t.kv_head * source.v_head_stride;
  const float* q = p.q + (t.row * p.n_heads + t.kv_head * g) * d;
  const uint8_t* mask = source.mask;
  int32_t keys[kKeysPerPart];
  int64_t n = 0;
  for (int64_t j = t.first; j < t.last; ++j) {
    if (!mask || mask[j]) keys[n++] = static_cast<int32_t>(j);
  }
  alignas(32) float scores[kMaxGroup][kKeysPerPart + 8];
  alignas(32) float unpacked[kMaxHeadDim];  // a stored key or value row as fp32
  if constexpr (TK == kKvQ4Tiles) {
    switch (g) {  // the models' usual groups, with their loops unrolled
      case 3: tiled_key_scores<3>(source, t.kv_head, keys, n, d, g, q, p.scale, scores); break;
      case 4: tiled_key_scores<4>(source, t.kv_head, keys, n, d, g, q, p.scale, scores); break;
      default: tiled_key_scores<0>(source, t.kv_head, keys, n, d, g, q, p.scale, scores);
    }
  } else if constexpr (quantized_type(TK)) {
    const int64_t first_head = t.row * p.n_heads + t.kv_head * g, blocks = d / kKvBlock;
    const int8_t* q_codes = p.q_codes + first_head * d;
    const float* q_steps = p.q_steps + first_head * blocks;
    const float* q_sums = p.q_sums + first_head * blocks;
#define MINIAPP_SCORES(G)                                                                  \
  integer_key_scores<TK, G>(k, key_bytes, keys, n, d, g, q_codes, q_steps, q_sums, p.scale, \
                            scores)
    switch (g) {  // the models' usual groups, with their loops unrolled
      case 3: MINIAPP_SCORES(3); break;
      case 4: MINIAPP_SCORES(4); break;
      default: MINIAPP_SCORES(0); break;
    }
#undef MINIAPP_SCORES
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const float* kj = row_floats<TK>(k + keys[i] * key_bytes, d, unpacked);
      __m256 acc[kMaxGroup];
      for (int64_t h = 0; h < g; ++h) acc[h] = _mm256_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c) {
        const __m256 kc = _mm256_loadu_ps(kj + 8 * c);
        for (int64_t h = 0; h < g; ++h) {
          acc[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * d + 8 * c), kc, acc[h]);
        }
      }
      for (int64_t h = 0; h < g; ++h) scores[h][i] = sum8(acc[h]) * p.scale;
    }
  }
  for (int64_t h = 0; h < g; ++h) {
    float* part = t.partial + h * (2 + d);
    float* sc = scores[h];
    float top = -INFINITY;
    for (int64_t i = 0; i < n; ++i) top = sc[i] > top ? sc[i] : top;
    const int64_t padded = (n + 7) / 8 * 8;
    for (int64_t i = n; i < padded; ++i) sc[i] = top;  // exp'd, then zeroed below
    __m256 total = _mm256_setzero_ps();
    const __m256 top8 = _mm256_set1_ps(top);
    for (int64_t i = 0; i < padded; i += 8) {
      __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_load_ps(sc + i), top8));
      _mm256_store_ps(sc + i, e);
    }
    for (int64_t i = n; i < padded; ++i) sc[i] = 0.0f;
    for (int64_t i = 0; i < padded; i += 8) total = _mm256_add_ps(total, _mm256_load_ps(sc + i));
    part[0] = top;
    part[1] = n ? sum8(total) : 0.0f;
  }
  if constexpr (quantized_type(TV)) {
    switch (g) {
      case 3: sum_quantized_values<TV, 3>(v, value_bytes, keys, n, d, g, scores, t.partial); break;
      case 4: sum_quantized_values<TV, 4>(v, value_bytes, keys, n, d, g, scores, t.partial); break;
      default: sum_quantized_values<TV, 0>(v, value_bytes, keys, n, d, g, scores, t.partial);
    }
    return;
  }
  // Values chunk by chunk, every key in order into registers: each output element sums the
  // same terms in the same order as one running sum per key would, without a round trip
  // through memory per key.
  for (int64_t c = 0; c < chunks; ++c) {
    __m256 acc[kMaxGroup];
    for (int64_t h = 0; h < g; ++h) acc[h] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; ++i) {
      const __m256 vc = load8<TV>(v + keys[i] * value_bytes, c, d);
      for (int64_t h = 0; h < g; ++h) {
        acc[h] = _mm256_fmadd_ps(_mm256_set1_ps(scores[h][i]), vc, acc[h]);
      }
    }
    for (int64_t h = 0; h < g; ++h) _mm256_storeu_ps(t.partial + h * (2 + d) + 2 + 8 * c, acc[h]);
  }
}

template <int TK>
void attend_part_with_keys(const AttendProblem& p, const AttendTask& t) {
  switch (p.rows[t.row].value_type) {
    case kKvF32: return attend_part<TK, kKvF32>(p, t);
    case kKvF16: return attend_part<TK, kKvF16>(p, t);
    case kKvBf16: return attend_part<TK, kKvBf16>(p, t);
    case kKvQ8: return attend_part<TK, kKvQ8>(p, t);
    default: return attend_part<TK, kKvQ4>(p, t);
  }
}

void attend_part_of_type(const AttendProblem& p, const AttendTask& t) {
  switch (p.rows[t.row].key_type) {
    case kKvF32: return attend_part_with_keys<kKvF32>(p, t);
    case kKvF16: return attend_part_with_keys<kKvF16>(p, t);
    case kKvBf16: return attend_part_with_keys<kKvBf16>(p, t);
    case kKvQ8: return attend_part_with_keys<kKvQ8>(p, t);
    case kKvQ4Tiles: return attend_part_with_keys<kKvQ4Tiles>(p, t);
    default: return attend_part_with_keys<kKvQ4>(p, t);
  }
}

// Parts of one row and kv head, merged in order into the output.
void merge_parts(const AttendProblem& p, int64_t row, int64_t kv_head, const float* parts,
                 int64_t n_parts) {
  const int64_t d = p.head_dim, g = p.group, stride = g * (2 + d);
  for (int64_t h = 0; h < g; ++h) {
    float top = -INFINITY;
    for (int64_t s = 0; s < n_parts; ++s) {
      const float m = parts[s * stride + h * (2 + d)];
      top = m > top ? m : top;
    }
    float* out = p.out + (row * p.n_heads + kv_head * g + h) * d;
    float total = 0.0f;
    for (int64_t c = 0; c < d; ++c) out[c] = 0.0f;
    for (int64_t s = 0; s < n_parts; ++s) {
      const float* part = parts + s * stride + h * (2 + d);
      if (part[1] == 0.0f) continue;  // no visible key in this part
      const float w = n_parts == 1 ? 1.0f : expf(part[0] - top);
      total += part[1] * w;
      for (int64_t c = 0; c < d; ++c) out[c] += part[2 + c] * w;
    }
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    for (int64_t c = 0; c < d; ++c) out[c] *= inv;
  }
}

// Attention of every query row over its own keys (see RowKeys), into out.
int attend(const float* q, const RowKeys* sources, int64_t rows, int64_t n_heads,
           int64_t kv_heads, int64_t head_dim, float scale, float* out, int threads) {
  if (!cpu_has(kIsaAvx2) || rows < 0 || kv_heads <= 0 || n_heads % kv_heads) return -1;
  if (head_dim % 8 || head_dim > kMaxHeadDim || n_heads / kv_heads > kMaxGroup) return -1;
  if (rows == 0) return 0;
  // Rows over rotated keys attend with rotated queries (a copy); outputs summed from rotated
  // values are rotated back below.
  float* rotated_q = nullptr;
  for (int64_t r = 0; r < rows; ++r) {
    if (!stored_rotated(sources[r].key_type)) continue;
    if (!rotated_q) {
      rotated_q = static_cast<float*>(malloc(sizeof(float) * rows * n_heads * head_dim));
      if (!rotated_q) return -1;
      memcpy(rotated_q, q, sizeof(float) * rows * n_heads * head_dim);
    }
    for (int64_t h = 0; h < n_heads; ++h) rotate_row(rotated_q + (r * n_heads + h) * head_dim, head_dim);
  }
  AttendProblem p = {rotated_q ? rotated_q : q, sources, n_heads, kv_heads,
                     n_heads / kv_heads, head_dim, scale, out, nullptr, nullptr, nullptr};
  // Tasks: every part of every row, for each kv head, in a fixed order.
  int64_t n_tasks = 0, key_macs = 0;
  int64_t* first_task = static_cast<int64_t*>(malloc(sizeof(int64_t) * (rows + 1)));
  if (!first_task) {
    free(rotated_q);
    return -1;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t scanned = sources[r].scanned;
    const RowKeys& s = sources[r];
    const bool tiles_ready = s.key_type != kKvQ4Tiles ||
                             ((s.lead || s.lead_rows == 0) && (s.recent || s.own_tile < 0));
    if (scanned < 0 || !kv_type_takes(s.key_type, head_dim) ||
        !kv_type_takes(s.value_type, head_dim) || s.value_type == kKvQ4Tiles || !tiles_ready) {
      free(first_task);
      free(rotated_q);
      return -1;
    }
    first_task[r] = n_tasks;
    n_tasks += kv_heads * ((scanned + kKeysPerPart - 1) / kKeysPerPart);
    key_macs += scanned * n_heads * head_dim;
  }
  first_task[rows] = n_tasks;
  const int64_t partial_floats = p.group * (2 + head_dim);
  float* partials = static_cast<float*>(malloc(sizeof(float) * partial_floats * (n_tasks + 1)));
  AttendTask* tasks = static_cast<AttendTask*>(malloc(sizeof(AttendTask) * (n_tasks + 1)));
  // Queries of rows over quantized keys, quantized once for every part that reads them.
  const int64_t query_blocks = rows * n_heads * (head_dim / kKvBlock);
  void* quantized = rotated_q ? malloc(rows * n_heads * head_dim + 2 * sizeof(float) * query_blocks)
                              : nullptr;
  if (!partials || !tasks || (rotated_q && !quantized)) {
    free(first_task);
    free(partials);
    free(tasks);
    free(rotated_q);
    free(quantized);
    return -1;
  }
  if (quantized) {
    float* steps = static_cast<float*>(quantized);
    p.q_steps = steps;
    p.q_sums = steps + query_blocks;
    p.q_codes = reinterpret_cast<const int8_t*>(steps + 2 * query_blocks);
    int8_t* codes = reinterpret_cast<int8_t*>(steps + 2 * query_blocks);
    const int64_t blocks = head_dim / kKvBlock;
    for (int64_t r = 0; r < rows; ++r) {
      if (!quantized_type(sources[r].key_type)) continue;
      for (int64_t h = 0; h < n_heads; ++h) {
        const int64_t at = r * n_heads + h;
        quantize_query(rotated_q + at * head_dim, head_dim, codes + at * head_dim,
                       steps + at * blocks, steps + query_blocks + at * blocks);
      }
    }
  }
  for (int64_t r = 0, i = 0; r < rows; ++r) {
    const int64_t scanned = sources[r].scanned;
    const int64_t parts = (scanned + kKeysPerPart - 1) / kKeysPerPart;
    for (int64_t h = 0; h < kv_heads; ++h) {
      for (int64_t s = 0; s < parts; ++s, ++i) {
        const int64_t last = (s + 1) * kKeysPerPart < scanned ? (s + 1) * kKeysPerPart : scanned;
        tasks[i] = {r, h, s * kKeysPerPart, last, partials + i * partial_floats};
      }
    }
  }
  if (threads > n_tasks) threads = static_cast<int>(n_tasks);
  if (threads <= 1 || key_macs < kMinParallelKeyMacs) {
    for (int64_t i = 0; i < n_tasks; ++i) attend_part_of_type(p, tasks[i]);
  } else {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n_tasks; ++i) attend_part_of_type(p, tasks[i]);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t parts_per_head = (first_task[r + 1] - first_task[r]) / kv_heads;
    for (int64_t h = 0; h < kv_heads; ++h) {
      if (parts_per_head == 0) {  // no keys: zeros, as an empty softmax gives nothing
        for (int64_t c = 0; c < p.group * head_dim; ++c) {
          out[(r * n_heads + h * p.group) * head_dim + c] = 0.0f;
        }
        continue;
      }
      const float* parts = partials + (first_task[r] + h * parts_per_head) * partial_floats;
      merge_parts(p, r, h, parts, parts_per_head);
    }
    if (stored_rotated(sources[r].value_type)) {
      for (int64_t h = 0; h < n_heads; ++h) rotate_row(out + (r * n_heads + h) * head_dim, head_dim);
    }
  }
  free(first_task);
  free(partials);
  free(tasks);
  free(rotated_q);
  free(quantized);
  return 0;
}

}  // namespace

extern "C" {

// out [rows, n_heads, head_dim] = attention of q [rows, n_heads, head_dim] (contiguous fp32)
// over k stored as key_type and v as value_type ([kv_heads, tokens] rows of head_dim values,
// rows contiguous, k_head_stride and v_head_stride bytes between heads). There are mask_keys
// keys: row r sees the keys its mask row marks (mask: [rows, mask_keys] bytes), else its
// first lengths[r], else all of them. Keys stored as q4 tiles come with their lead rows
// (lead_rows fp32 rows a kv head, lead_head_stride floats apart; they count among the keys),
// the fp32 rows of the newest tiles (`recent`, recent_head_stride floats between heads) and
// each row's own tile (own_tiles[r], -1: none); see RowKeys. Returns 0, or -1 for shapes it
// does not take.
int miniapp_attend_rows(const float* q, const uint8_t* k, const uint8_t* v, int key_type,
                        int value_type, int64_t k_head_stride, int64_t v_head_stride,
                        const int32_t* lengths, const uint8_t* mask,
                        int64_t mask_keys, int64_t rows, int64_t n_heads, int64_t kv_heads,
                        int64_t head_dim, float scale, const float* lead, int64_t lead_rows,
                        int64_t lead_head_stride, const float* recent,
                        int64_t recent_head_stride, const int32_t* own_tiles, float* out,
                        int threads) {
  if (rows <= 0) return rows == 0 ? 0 : -1;
  RowKeys* sources = static_cast<RowKeys*>(malloc(sizeof(RowKeys) * rows));
  if (!sources) return -1;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t scanned = lengths && !mask ? lengths[r] : mask_keys;
    if (scanned < 0 || scanned > mask_keys) {  // a row may not see past the keys given
      free(sources);
      return -1;
    }
    sources[r] = {k, v, k_head_stride, v_head_stride, scanned,
                  mask ? mask + r * mask_keys : nullptr, key_type, value_type,
                  lead, lead_rows, lead_head_stride, recent, recent_head_stride,
                  own_tiles ? own_tiles[r] : -1};
  }
  const int status = attend(q, sources, rows, n_heads, kv_heads, head_dim, scale, out, threads);
  free(sources);
  return status;
}

// The same, each row over its own sequence's keys (rows of a batch): k[r] stored as
// key_types[r], v[r] as value_types[r], with k_head_strides[r] and v_head_strides[r] bytes
// between heads, keys[r] of them (lead rows included), masks[r] (bytes [keys[r]]) or null for
// all visible. Rows over q4 tiles take their lead, recent rows and own tile from the arrays
// that follow (as miniapp_attend_rows; the arrays may be null when no row has tiled keys).
int miniapp_attend_sequences(const float* q, const uint8_t* const* k, const uint8_t* const* v,
                             const int32_t* key_types, const int32_t* value_types,
                             const int64_t* k_head_strides, const int64_t* v_head_strides,
                             const int64_t* keys, const uint8_t* const* masks, int64_t rows,
                             int64_t n_heads, int64_t kv_heads, int64_t head_dim, float scale,
                             const float* const* leads, const int64_t* lead_rows,
                             const int64_t* lead_head_strides, const float* const* recents,
                             const int64_t* recent_head_strides, const int32_t* own_tiles,
                             float* out, int threads) {
  if (rows <= 0) return rows == 0 ? 0 : -1;
  RowKeys* sources = static_cast<RowKeys*>(malloc(sizeof(RowKeys) * rows));
  if (!sources) return -1;
  for (int64_t r = 0; r < rows; ++r) {
    sources[r] = {k[r], v[r], k_head_strides[r], v_head_strides[r], keys[r],
                  masks ? masks[r] : nullptr, key_types[r], value_types[r]};
    if (key_types[r] == kKvQ4Tiles && leads && recents) {
      sources[r].lead = leads[r];
      sources[r].lead_rows = lead_rows[r];
      sources[r].lead_head_stride = lead_head_strides[r];
      sources[r].recent = recents[r];
      sources[r].recent_head_stride = recent_head_strides[r];
      sources[r].own_tile = own_tiles[r];
    }
  }
  const int status = attend(q, sources, rows, n_heads, kv_heads, head_dim, scale, out, threads);
  free(sources);
  return status;
}

// Stored rows out of fp32 ones: x [heads, tokens, head_dim] with head_stride and token_stride
// floats between rows (values contiguous) -> out [heads, tokens] rows of
// kv_row_bytes(kv_type, head_dim), contiguous; kv_type + kKvRotated rotates each row first
// (as the quantized types are stored). Returns 0, or -1 for a type it does not take.
int miniapp_kv_encode(int kv_type_code, const float* x, int64_t heads, int64_t tokens,
                      int64_t head_stride, int64_t token_stride, int64_t head_dim, uint8_t* out) {
  const int kv_type = kv_type_code & ~kKvRotated;
  const bool rotated = (kv_type_code & kKvRotated) && stored_rotated(kv_type);
  // Tiles are encoded and decoded a tile at a time (miniapp_kv_encode_tiles), never by row.
  if (!cpu_has(kIsaAvx2) || !kv_type_takes(kv_type, head_dim) || kv_type == kKvQ4Tiles ||
      heads < 0 || tokens < 0) {
    return -1;
  }
  const int64_t row_bytes = kv_row_bytes(kv_type, head_dim);
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t t = 0; t < tokens; ++t) {
      encode_row(kv_type, x + h * head_stride + t * token_stride, head_dim,
                 out + (h * tokens + t) * row_bytes, rotated);
    }
  }
  return 0;
}

// Stored q4 tiles out of fp32 rows: x [heads, tiles * kTileRows, head_dim] (head_stride and
// token_stride floats apart, values contiguous) -> `tiles` tiles a head, written in place at
// out (rows contiguous, out_head_stride bytes between heads). Returns 0, or -1.
int miniapp_kv_encode_tiles(const float* x, int64_t heads, int64_t tiles, int64_t head_stride,
                            int64_t token_stride, int64_t head_dim, uint8_t* out,
                            int64_t out_head_stride) {
  if (!cpu_has(kIsaAvx2) || !kv_type_takes(kKvQ4Tiles, head_dim) || heads < 0 || tiles < 0) {
    return -1;
  }
  const int64_t tile_bytes = kTileRows * kv_row_bytes(kKvQ4Tiles, head_dim);
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t t = 0; t < tiles; ++t) {
      encode_tile(x + h * head_stride + t * kTileRows * token_stride, token_stride, head_dim,
                  out + h * out_head_stride + t * tile_bytes);
    }
  }
  return 0;
}

// fp32 rows out of stored q4 tiles: `tiles` tiles a head (rows contiguous, head_stride bytes
// between heads) -> out [heads, tiles * kTileRows, head_dim] fp32, contiguous.
int miniapp_kv_decode_tiles(const uint8_t* stored, int64_t heads, int64_t tiles,
                            int64_t head_stride, int64_t head_dim, float* out) {
  if (!cpu_has(kIsaAvx2) || !kv_type_takes(kKvQ4Tiles, head_dim) || heads < 0 || tiles < 0) {
    return -1;
  }
  const int64_t tile_bytes = kTileRows * kv_row_bytes(kKvQ4Tiles, head_dim);
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t t = 0; t < tiles; ++t) {
      decode_tile(stored + h * head_stride + t * tile_bytes, head_dim,
                  out + ((h * tiles + t) * kTileRows) * head_dim);
    }
  }
  return 0;
}

// fp32 rows out of stored ones: rows [heads, tokens] stored as kv_type, head_stride bytes
// between heads (tokens contiguous) -> out [heads, tokens, head_dim] fp32, contiguous;
// kv_type + kKvRotated rotates each row back. Rows are independent: any thread count gives
// the same bits.
int miniapp_kv_decode(int kv_type_code, const uint8_t* stored, int64_t heads, int64_t tokens,
                      int64_t head_stride, int64_t head_dim, float* out, int threads) {
  const int kv_type = kv_type_code & ~kKvRotated;
  const bool rotated = (kv_type_code & kKvRotated) && stored_rotated(kv_type);
  // Tiles are encoded and decoded a tile at a time (miniapp_kv_encode_tiles), never by row.
  if (!cpu_has(kIsaAvx2) || !kv_type_takes(kv_type, head_dim) || kv_type == kKvQ4Tiles ||
      heads < 0 || tokens < 0) {
    return -1;
  }
  const int64_t row_bytes = kv_row_bytes(kv_type, head_dim), rows = heads * tokens;
  // A prompt chunk decodes a layer's whole cache: worth both threads past a few rows.
  if (rows * head_dim < kMinParallelKeyMacs) threads = 1;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t h = i / tokens, t = i % tokens;
    const uint8_t* row = stored + h * head_stride + t * row_bytes;
    float* into = out + i * head_dim;
    switch (kv_type) {
      case kKvF32: decode_row<kKvF32>(row, head_dim, into, rotated); break;
      case kKvF16: decode_row<kKvF16>(row, head_dim, into, rotated); break;
      case kKvBf16: decode_row<kKvBf16>(row, head_dim, into, rotated); break;
      case kKvQ8: decode_row<kKvQ8>(row, head_dim, into, rotated); break;
      default: decode_row<kKvQ4>(row, head_dim, into, rotated); break;
    }
  }
  return 0;
}


// ---------------------------------------------------------------------------------------
// Row operations of a decode step. A one-token step runs a norm twice and RoPE once a layer;
// in torch each is several small ops whose dispatch costs more than the arithmetic, so the
// CPU path calls these instead (engine/layers.py; references in plain torch: reference.py).
// Each row is computed alone, in an order fixed by its own values, and scalar code is built
// with -ffp-contract=off, so a row's result does not depend on the other rows of the call.

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


// ---------------------------------------------------------------------------------------
// One decoder layer's step for one token (or for a few consecutive tokens of one sequence,
// speculative verification), in one call. A pre-norm layer with a fused Q|K|V projection, a
// SiLU-gated feed-forward and no biases (SmolLM2 and the other llama-shaped models) runs
// eight native kernels a step; called one by one from Python, the calls and the torch ops
// between them cost about as much as the kernels. Here they run back to back: the same
// functions, on the same values, in the same order as the layer-by-layer path
// (engine/models/decoder.py), so the residual stream comes out bit for bit the same. Every
// kernel computes a row on its own, so a row of a several-token call equals that token's
// own decode step.

constexpr int64_t kMaxLayerRows = 64;  // rows a call takes (a batched step's, at most)

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
// signed_sin: the RoPE tables of every row, [rows, head_dim]. Returns 0, or -1 for a layer or
// step it does not take (x may then be partly updated: the caller raises).
int miniapp_decode_layer_batch(const DecodeLayerWeights* w, const DecodeLayerStep* steps,
                               int64_t n_steps, const float* cos, const float* signed_sin,
                               float* x, int threads) {
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
  const int64_t row_floats = 2 * w->dim + qkv_width + 2 * q_width + w->dim + w->ffn_dim;
  float* buffer = static_cast<float*>(malloc(sizeof(float) * m * row_floats));
  if (!buffer) return -1;
  float* normed = buffer;
  float* qkv = normed + m * w->dim;
  float* queries = qkv + m * qkv_width;
  float* attended = queries + m * q_width;
  float* projected = attended + m * q_width;
  float* gated = projected + m * w->dim;
  float* fed = gated + m * w->ffn_dim;
  int status = miniapp_add_rms_norm(x, w->dim, nullptr, 0, w->attn_norm, m, w->dim, w->eps,
                                    normed, w->dim);
  status = status ? status : miniapp_int4_gemm(w->qkv, normed, w->dim, kFloat32, m, qkv, threads);
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
  status = status ? status : miniapp_int4_gemm(w->out, attended, q_width, kFloat32, m, projected,
                                               threads);
  status = status ? status
                  : miniapp_add_rms_norm(x, w->dim, projected, w->dim, w->ffn_norm, m, w->dim,
                                         w->eps, normed, w->dim);
  status = status ? status : miniapp_int4_gemm(w->gate_up, normed, w->dim, kFloat32, m, gated,
                                               threads);
  status = status ? status : miniapp_int4_gemm(w->down, gated, w->ffn_dim, kFloat32, m, fed,
                                               threads);
  if (!status) {
    for (int64_t i = 0; i < m * w->dim; ++i) x[i] += fed[i];
  }
  free(buffer);
  return status;
}

// One sequence's rows (a decode step, or a verification's rows): the batch of one.
int miniapp_decode_layer(const DecodeLayerWeights* w, const DecodeLayerStep* s, float* x,
                         int threads) {
  return miniapp_decode_layer_batch(w, s, 1, s->cos, s->signed_sin, x, threads);
}

}  // extern "C"
