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
// multiply-adds against x quantized to int8 per run of 16 columns; see its section. The
// AVX-512 VNNI path does the same sums a whole block at a time and gives the AVX2 path's
// bits; it runs where the CPU has VNNI but not BF16 (native/int4.py, best_isa).
//
// Row independence: each output element is summed in an order fixed by the layout alone
// (nibble by nibble, chunk by chunk, then group by group; the AVX2 path's integer group sums
// are exact in any order), never by the number of rows, the tile or the thread, so a row of
// an 8-row call is bit-identical to the same row computed alone. Scalar code is built with
// -ffp-contract=off so the compiler cannot fuse it differently per tile.
//
// The other kernels of the same shared library have files of their own (native/build.py lists
// them; common.h holds what they share). This one also holds what the library has once: its
// ABI version and source hash, which int4.py checks when it loads it, and the per-thread
// scratch buffer (miniapp_scratch_bytes).

#include "common.h"

#ifndef MINIAPP_SOURCE_HASH
#define MINIAPP_SOURCE_HASH "unknown"
#endif

namespace {

constexpr int kAbiVersion = 11;
constexpr int kBlockRows = 16;  // output rows per block: one AVX-512 fp32 lane each
constexpr int kChunkCols = 8;   // input columns per chunk: 4 nibbles x 2 adjacent columns
constexpr int kChunkBytes = 64;  // 16 rows x 8 columns x 4 bits
constexpr int kNibbles = 4;  // nibbles per 16-bit word
constexpr int kScaleBytes = 2 * kBlockRows;  // one bf16 per row of the block
constexpr int kCodeOffset = 8;  // w = (code - 8) * scale + zero
constexpr int kGateRows = kBlockRows / 2;  // SiLU-gated blocks: 8 gate rows, then 8 up rows
// Below this many multiply-adds a second thread costs more to wake than it saves.
constexpr int64_t kMinParallelMacs = 1 << 16;

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
  // Added to W x before the epilogue (LoRA updates, lora.cpp), or null: [m, ld_pre], the
  // gated outputs' gate terms at 0..n-1 and their up terms at n..2n-1.
  const float* pre;
  int64_t ld_pre;
  const uint16_t* xb;  // x rounded to bf16 [m, k] (AVX-512 path)
  const float* xsum;   // per row of x, per group: the sum of its bf16 values (AVX-512 path)
  const int8_t* xq;    // x quantized to int8 per run of columns, permuted (AVX2 path)
  const float* dx;     // per row of x, per run: the int8 step (AVX2 path)
  const float* dx_sum;  // per row of x, per group: sum over its runs of step * sum of q
  const int32_t* q_sum;  // per row of x, per run: the sum of q (AVX2 path)
  // The VNNI path's copies of the above, rows interleaved: run (or group) major, so that a
  // tile's rows sit at fixed offsets from one pointer.
  const int8_t* xq_runs;      // [run][row][run columns]
  const float* dx_runs;       // [run][row]
  const int32_t* offset_runs;  // [run][row]: 8 times the sum of q (the codes' offset)
  const float* dx_sum_groups;  // [group][row]
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
    const float* pre = p.pre ? p.pre + (m0 + r) * p.ld_pre : nullptr;
    if (p.epilogue == kSiluMul) {
      const int64_t first = block * kGateRows;
      const int64_t count = p.n - first < kGateRows ? p.n - first : kGateRows;
      __m256 gate = _mm256_loadu_ps(t), up = _mm256_loadu_ps(t + kGateRows);
      if (pre) {
        alignas(32) float terms[2 * kGateRows];
        for (int i = 0; i < 2 * kGateRows; ++i) terms[i] = -0.0f;
        memcpy(terms, pre + first, count * sizeof(float));
        memcpy(terms + kGateRows, pre + p.n + first, count * sizeof(float));
        gate = _mm256_add_ps(gate, _mm256_load_ps(terms));
        up = _mm256_add_ps(up, _mm256_load_ps(terms + kGateRows));
      }
      alignas(32) float gated[kGateRows];
      _mm256_store_ps(gated, silu_mul_avx2(gate, up));
      memcpy(out + first, gated, count * sizeof(float));
    } else {
      const int64_t first = block * kBlockRows;
      const int64_t count = p.n - first < kBlockRows ? p.n - first : kBlockRows;
      if (pre) {
        for (int64_t i = 0; i < count; ++i) out[first + i] = t[i] + pre[first + i];
      } else {
        memcpy(out + first, t, count * sizeof(float));
      }
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
// `extra`: bytes more to hold past the arrays, for the VNNI path's copies (`p_extra`).
TARGET_AVX2 bool prepare_x_avx2(Problem& p, const void* x, int64_t ldx, int x_type,
                                size_t extra = 0, void** p_extra = nullptr) {
  constexpr int kLanes = 8;
  const int64_t run = run_cols(p.group);
  const int64_t n_runs = p.k / run, runs_per_group = p.group / run;
  const int64_t per_run = p.m * n_runs, per_group = p.m * p.n_groups;
  size_t bytes = per_run * (sizeof(float) + sizeof(int32_t)) + per_group * sizeof(float) +
                 p.k * sizeof(float) + p.m * p.k;
  bytes = (bytes + 63) / 64 * 64;
  float* dx = static_cast<float*>(scratch_bytes(bytes + extra));
  if (dx && p_extra) *p_extra = reinterpret_cast<uint8_t*>(dx) + bytes;
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

// ------------------------------------------------------------------ AVX-512 VNNI path

// The AVX2 path's integer dot products, a whole block at a time: vpdpbusd multiplies 4
// unsigned codes by 4 int8 x and adds them into one 32-bit lane, so the 16 rows of a block
// fill one register and a chunk takes two instructions a row of x (the AVX2 path: four, for
// half the rows). x is prepared as for the AVX2 path (prepare_x_avx2), and every step after
// the exact integer sums is the AVX2 path's, lane for lane, so the two give the same bits.
// Twice the multiply-adds an instruction of the BF16 path's dot product, on the same bytes:
// what pays when several rows share a pass (batched decode, verification, prompts).
constexpr int kVnniMaxTile = 12;  // 12 int32 + 12 fp32 accumulators, codes and constants

// x as the AVX2 path prepares it, then copied with its rows interleaved (see Problem).
TARGET_AVX512_VNNI bool prepare_x_vnni(Problem& p, const void* x, int64_t ldx, int x_type) {
  const int64_t run = run_cols(p.group), n_runs = p.k / run;
  const size_t extra = p.m * p.k + p.m * n_runs * (sizeof(float) + sizeof(int32_t)) +
                       p.m * p.n_groups * sizeof(float);
  void* copies = nullptr;
  if (!prepare_x_avx2(p, x, ldx, x_type, extra, &copies)) return false;
  float* dx_runs = static_cast<float*>(copies);
  int32_t* offset_runs = reinterpret_cast<int32_t*>(dx_runs + p.m * n_runs);
  float* dx_sum_groups = reinterpret_cast<float*>(offset_runs + p.m * n_runs);
  int8_t* xq_runs = reinterpret_cast<int8_t*>(dx_sum_groups + p.m * p.n_groups);
  for (int64_t row = 0; row < p.m; ++row) {
    for (int64_t u = 0; u < n_runs; ++u) {
      memcpy(xq_runs + (u * p.m + row) * run, p.xq + row * p.k + u * run, run);
      dx_runs[u * p.m + row] = p.dx[row * n_runs + u];
      offset_runs[u * p.m + row] = kCodeOffset * p.q_sum[row * n_runs + u];
    }
    for (int64_t g = 0; g < p.n_groups; ++g) {
      dx_sum_groups[g * p.m + row] = p.dx_sum[row * p.n_groups + g];
    }
  }
  p.xq_runs = xq_runs;
  p.dx_runs = dx_runs;
  p.offset_runs = offset_runs;
  p.dx_sum_groups = dx_sum_groups;
  return true;
}

TARGET_AVX512_VNNI __m512 widen_bf16_vnni(const uint16_t* at) {
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

template <int MT>
TARGET_AVX512_VNNI void tile_vnni(const Problem& p, int64_t block, int64_t m0, float* tile) {
  const __m512i low_nibbles = _mm512_set1_epi8(0x0f);
  const uint8_t* base = p.packed + block * p.n_groups * p.group_bytes;
  const int64_t run = run_cols(p.group), chunks_per_run = run / kChunkCols;
  const int64_t runs_per_group = p.group / run;
  for (int r = 0; r < MT; ++r) _mm512_storeu_ps(tile + r * kBlockRows, _mm512_setzero_ps());
  for (int64_t g = 0; g < p.n_groups; ++g) {
    const uint8_t* codes = base + g * p.group_bytes;
    __m512 dot_x[MT];
    for (int r = 0; r < MT; ++r) dot_x[r] = _mm512_setzero_ps();
    for (int64_t u = 0; u < runs_per_group; ++u) {
      const int64_t at = (g * runs_per_group + u) * p.m + m0;  // this run's row m0
      const int8_t* xr = p.xq_runs + at * run;  // row r's columns at xr + r * run
      __m512i dot[MT];  // 32-bit: each lane one row's sum of codes times x over the run
      for (int r = 0; r < MT; ++r) dot[r] = _mm512_setzero_si512();
      for (int64_t c = 0; c < chunks_per_run; ++c) {
        const uint8_t* chunk = codes + (u * chunks_per_run + c) * kChunkBytes;
        _mm_prefetch(reinterpret_cast<const char*>(chunk) + kPrefetchBytes, _MM_HINT_T0);
        __m512i words = _mm512_loadu_si512(chunk);
        // Lane r's 4 bytes of codes: columns 0 4 1 5 (low nibbles), 2 6 3 7 (high ones).
        __m512i near = _mm512_and_si512(words, low_nibbles);
        __m512i far = _mm512_and_si512(_mm512_srli_epi16(words, 4), low_nibbles);
        for (int r = 0; r < MT; ++r) {
          const int8_t* xc = xr + r * run + c * kChunkCols;
          int32_t near_x, far_x;
          memcpy(&near_x, xc, sizeof near_x);
          memcpy(&far_x, xc + 4, sizeof far_x);
          dot[r] = _mm512_dpbusd_epi32(dot[r], near, _mm512_set1_epi32(near_x));
          dot[r] = _mm512_dpbusd_epi32(dot[r], far, _mm512_set1_epi32(far_x));
        }
      }
      for (int r = 0; r < MT; ++r) {
        __m512i centred = _mm512_sub_epi32(dot[r], _mm512_set1_epi32(p.offset_runs[at + r]));
        dot_x[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(centred), _mm512_set1_ps(p.dx_runs[at + r]), dot_x[r]);
      }
    }
    const uint16_t* scales = reinterpret_cast<const uint16_t*>(codes + p.group / kChunkCols * kChunkBytes);
    const __m512 scale = widen_bf16_vnni(scales), zero = widen_bf16_vnni(scales + kBlockRows);
    const float* dx_sum = p.dx_sum_groups + g * p.m + m0;
    for (int r = 0; r < MT; ++r) {
      float* total = tile + r * kBlockRows;
      __m512 sum = _mm512_fmadd_ps(dot_x[r], scale, _mm512_loadu_ps(total));
      _mm512_storeu_ps(total, _mm512_fmadd_ps(zero, _mm512_set1_ps(dx_sum[r]), sum));
    }
  }
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
const TileFn kVnniTiles[kVnniMaxTile + 1] = {
    nullptr,       tile_vnni<1>, tile_vnni<2>,  tile_vnni<3>,  tile_vnni<4>,  tile_vnni<5>,
    tile_vnni<6>,  tile_vnni<7>, tile_vnni<8>,  tile_vnni<9>,  tile_vnni<10>, tile_vnni<11>,
    tile_vnni<12>};
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

}  // namespace

extern "C" {

int miniapp_native_abi(void) { return kAbiVersion; }

const char* miniapp_native_source_hash(void) { return MINIAPP_SOURCE_HASH; }

// Whether this CPU runs the given path (kIsaAvx512Vnni = 3, kIsaAvx512 = 2, kIsaAvx2 = 1).
int miniapp_int4_cpu_has(int isa) { return cpu_has(isa) ? 1 : 0; }

// A packed weight, described once (Python keeps one per weight and passes its address).
struct GgmlWeight;  // ggml_dot.cpp
int miniapp_ggml_gemm_pre(const GgmlWeight* w, const void* x, int64_t ldx, int x_type,
                          int64_t m, float* y, const float* pre, int64_t ld_pre, int threads);

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
// hold 8 gate rows then 8 up rows and y gets silu(gate) * up. `pre` (or null): terms added
// to W x before the epilogue, [m, ld_pre]: n of them, or 2n with kSiluMul (gate, then up).
// Returns 0, or -1 for arguments it does not take (nothing is written then).
int miniapp_int4_gemm_pre(const Int4Weight* w, const void* x, int64_t ldx, int x_type,
                          int64_t m, float* y, const float* pre, int64_t ld_pre, int threads) {
  if (w->ggml) return miniapp_ggml_gemm_pre(w->ggml, x, ldx, x_type, m, y, pre, ld_pre, threads);
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
  p.pre = pre;
  p.ld_pre = ld_pre;
  if (pre && ld_pre < (epilogue == kSiluMul ? 2 * n : n)) return -1;
  const bool avx512 = isa == kIsaAvx512;
  const bool prepared = avx512                   ? prepare_x_avx512(p, x, ldx, x_type)
                        : isa == kIsaAvx512Vnni ? prepare_x_vnni(p, x, ldx, x_type)
                                                : prepare_x_avx2(p, x, ldx, x_type);
  if (!prepared) return -1;
  const Path path = avx512                   ? Path{kAvx512Tiles, kMaxTile}
                    : isa == kIsaAvx512Vnni ? Path{kVnniTiles, kVnniMaxTile}
                                            : Path{kAvx2Tiles, kAvx2MaxTile};
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

// The GEMM without pre terms.
int miniapp_int4_gemm(const Int4Weight* w, const void* x, int64_t ldx, int x_type, int64_t m,
                      float* y, int threads) {
  return miniapp_int4_gemm_pre(w, x, ldx, x_type, m, y, nullptr, 0, threads);
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
