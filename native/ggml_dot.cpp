#ifndef MINIAPP_GGML_KERNELS
// Small-batch GEMM straight on GGML's quantized blocks: y[m, n] = sum_k x[m, k] * w[n, k] for
// a few rows of x, with w read as the GGUF file stores it (memory-mapped), or for Q4_K, Q6_K,
// Q5_0 and Q8_0 in the same bytes with each 8 rows interleaved (a native copy at load).
//
// Why this exists: the int4 kernel of int4_gemm.cpp needs its own layout, so a file's
// weights were converted at load (seconds per GB, a second copy while it ran), and codes wider
// than 4 bits were held as two 4-bit planes: Q6_K at 10 bits a weight instead of 6.56, Q5_0
// at 9 instead of 5.5. A decode step is memory-bound, so bytes read are time. Here every type
// is read at its own width, and a weight row is decoded once for up to kTile rows of x.
//
// How: as llama.cpp's CPU dot products do, x is quantized to int8 per row (per block of 32
// with an fp32 step for the 32-weight types, per super-block of 256 with sums of each 16
// codes for the K types), and each block's dot product is exact integer arithmetic
// (unsigned weight codes times signed x codes: `vpdpbusd` with AVX-512 VNNI, `vpmaddubsw`
// then `vpmaddwd` on AVX2; the two paths are this file's kernels compiled twice). The K types
// fold their 6- or 8-bit sub-block scales in as integers too, so a super-block costs one
// float multiply-add per row of x. The offsets (Q4_1 and Q5_1's minimum, the K types' mins,
// Q6_K's -32) are applied through the sums of x's codes.
//
// Interleaved groups: with one row a call, each 32 codes meet x in one 8-lane vector whose
// lanes are then summed, and a sub-block's scale is applied per row of x by shuffles and a
// multiply. With 8 rows side by side (4 codes of each row in each 32-bit lane), a broadcast of
// 4 codes of x meets all 8 rows in one instruction and every lane sums into its own row: no
// horizontal sums, one scale multiply per 256 products. The kernel then does 1.3-3.5x the
// work per second for a prompt or a few rows of decoding (Q6_K, whose codes cost more to
// unpack, about even); the layouts are documented beside `interleave_q4_k` and its siblings.
//
// Row independence: every output element sums its blocks in column order, each row of x with
// its own quantization, so a row's result never depends on the other rows, the tile or the
// thread (bit-identical rows across batching and verification, as the int4 kernel gives).
//
// The pure-torch reference is `reference.ggml_matmul` (tests compare against it).

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void* miniapp_scratch_bytes(size_t size);  // int4_gemm.cpp: the calling thread's buffer

namespace {

// GGML type ids (gguf's GGMLQuantizationType).
enum GgmlType {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14,
  // Ours, not the file's: Q4_K with each 8 rows interleaved (`interleave_q4_k`), same bytes.
  kQ4_Kx8 = 112, kQ6_Kx8 = 114, kQ5_0x8 = 106, kQ8_0x8 = 108,  // the same for these
};
constexpr int64_t kGroupRows = 8;  // rows of an interleaved group
constexpr int64_t kGroupBlockBytes = kGroupRows * 144;  // a Q4_K super-block of the 8 rows
constexpr int64_t kGroupBlockBytes6 = kGroupRows * 210;  // the same for Q6_K
constexpr int kMaxParts = 4;
constexpr int kMaxTile = 8;  // the most rows of x a kernel takes at once
enum Isa { kIsaAuto = 0, kIsaAvx2 = 1, kIsaAvx512 = 2 };
constexpr int64_t kSmallBlock = 32;  // Q4_0 .. Q8_0
constexpr int64_t kSuperBlock = 256;  // the K types
constexpr int64_t kMinParallelBytes = 1 << 16;  // below this, a second thread costs more
enum Epilogue { kStore = 0, kSiluMul = 1 };

struct GgmlPart {
  const uint8_t* data;  // rows of blocks, row_bytes apart
  int64_t rows;
  int64_t row_bytes;
  int32_t type;
  int32_t reserved;
};

}  // namespace

// Up to kMaxParts weights sharing one input, stacked by rows (Q|K|V), or with kSiluMul a
// gate and an up weight of equal rows: y = silu(gate x + bias) * (up x + bias).
struct GgmlWeight {
  GgmlPart parts[kMaxParts];
  int64_t n_parts;
  int64_t k;
  int64_t n;  // outputs: all rows, or the gate's rows with kSiluMul
  const float* bias;  // one per row of the stacked parts, or null
  int32_t epilogue;
  int32_t isa;  // kIsaAvx2 or kIsaAvx512 to force a path; else the best this CPU has
};

namespace {

typedef void (*RowFn)(const uint8_t*, const struct QuantizedX&, int64_t, float*);
// The same for an interleaved group of 8 rows: out[t * 8 + r].
typedef void (*GroupFn)(const uint8_t*, const struct QuantizedX&, int64_t, float*);

// ------------------------------------------------------------------ x, quantized per row

struct QuantizedX {
  int64_t m, k;
  const int8_t* q32;  // [m, k]: per 32 columns, round(x / d), d = max |x| / 127
  const float* d32;   // [m, k / 32]
  const float* s32;   // [m, k / 32]: d * (sum of the block's codes), for the minimums
  const int8_t* q256;  // [m, k]: the same per 256 columns (K types)
  const float* d256;   // [m, k / 256]
  const int16_t* sum16;  // [m, k / 16]: sums of each 16 codes of q256
  const int16_t* sum32;  // [m, k / 32]: sums of each 32 codes of q256
};

float bf16_to_float(uint16_t value) {
  uint32_t bits = static_cast<uint32_t>(value) << 16;
  float out;
  memcpy(&out, &bits, sizeof out);
  return out;
}

#define QUANTIZE_TARGET __attribute__((target("avx2,fma,f16c")))

QUANTIZE_TARGET inline int32_t sum_lanes(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

// Codes of `count` values (a multiple of 32) with one step d = max |x| / 127: round(x / d),
// to nearest even (as the reference rounds), and the sum of each 16 codes. Every machine the
// GGML kernels run on has AVX2 (they refuse to run otherwise).
QUANTIZE_TARGET void quantize_block(const float* x, int64_t count, int8_t* q, float* step,
                                    int32_t* sums16) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 most = _mm256_setzero_ps();
  for (int64_t i = 0; i < count; i += 8) {
    most = _mm256_max_ps(most, _mm256_and_ps(_mm256_loadu_ps(x + i), magnitude));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(most), _mm256_extractf128_ps(most, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float d = _mm_cvtss_f32(m4) / 127.0f;
  const __m256 inverse = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t i = 0; i < count; i += 32) {
    __m256i codes[4];
    for (int j = 0; j < 4; ++j) {
      codes[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * j), inverse));
    }
    sums16[i / 16] = sum_lanes(_mm256_add_epi32(codes[0], codes[1]));
    sums16[i / 16 + 1] = sum_lanes(_mm256_add_epi32(codes[2], codes[3]));
    // Packing interleaves 128-bit lanes; the permutation puts the bytes back in order.
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(codes[0], codes[1]),
                                             _mm256_packs_epi32(codes[2], codes[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i),
                        _mm256_permutevar8x32_epi32(bytes, order));
  }
  *step = d;
}

// Row r of x (fp32 [k]) in the layouts the weight's types need.
void quantize_row(const float* xr, int64_t r, int64_t k, bool small, bool super,
                  int8_t* q32, float* d32, float* s32, int8_t* q256, float* d256,
                  int16_t* sum16, int16_t* sum32) {
  int32_t sums[kSuperBlock / 16];
  if (small) {
    for (int64_t b = 0; b < k / kSmallBlock; ++b) {
      const int64_t at = r * (k / kSmallBlock) + b;
      quantize_block(xr + b * kSmallBlock, kSmallBlock, q32 + r * k + b * kSmallBlock,
                     &d32[at], sums);
      s32[at] = d32[at] * static_cast<float>(sums[0] + sums[1]);
    }
  }
  if (super) {
    for (int64_t b = 0; b < k / kSuperBlock; ++b) {
      quantize_block(xr + b * kSuperBlock, kSuperBlock, q256 + r * k + b * kSuperBlock,
                     &d256[r * (k / kSuperBlock) + b], sums);
      int16_t* row16 = sum16 + r * (k / 16) + b * 16;
      int16_t* row32 = sum32 + r * (k / 32) + b * 8;
      for (int j = 0; j < kSuperBlock / 16; ++j) row16[j] = static_cast<int16_t>(sums[j]);
      for (int j = 0; j < kSuperBlock / 32; ++j) {
        row32[j] = static_cast<int16_t>(sums[2 * j] + sums[2 * j + 1]);
      }
    }
  }
}

bool quantize_x(const void* x, int64_t ldx, int x_type, int64_t m, int64_t k, bool small,
                bool super, int threads, QuantizedX& out) {
  const size_t codes = static_cast<size_t>(m * k);
  const size_t blocks32 = static_cast<size_t>(m * (k / kSmallBlock));
  const size_t blocks256 = super ? static_cast<size_t>(m * (k / kSuperBlock)) : 0;
  const size_t sums16 = super ? static_cast<size_t>(m * (k / 16)) : 0;
  const size_t sums32 = sums16 / 2;
  const size_t widened_floats = x_type != 0 ? codes : 0;  // bf16 x as fp32
  const size_t bytes =
      2 * codes + 4 * (2 * blocks32 + blocks256 + widened_floats) + 2 * (sums16 + sums32) + 256;
  uint8_t* base = static_cast<uint8_t*>(miniapp_scratch_bytes(bytes));
  if (!base) return false;
  int8_t* q32 = reinterpret_cast<int8_t*>(base);
  int8_t* q256 = q32 + codes;
  float* d32 = reinterpret_cast<float*>(base + (2 * codes + 63) / 64 * 64);
  float* s32 = d32 + blocks32;
  float* d256 = s32 + blocks32;
  float* widened = d256 + blocks256;
  int16_t* sum16 = reinterpret_cast<int16_t*>(widened + widened_floats);
  int16_t* sum32 = sum16 + sums16;
  // Rows are independent: a long prompt's are shared between the threads.
  const int team = m * k >= (1 << 16) && threads > 1 ? threads : 1;
#pragma omp parallel for num_threads(team) schedule(static)
  for (int64_t r = 0; r < m; ++r) {
    const float* xr;
    if (x_type == 0) {
      xr = static_cast<const float*>(x) + r * ldx;
    } else {
      const uint16_t* xb = static_cast<const uint16_t*>(x) + r * ldx;
      float* row = widened + r * k;
      for (int64_t c = 0; c < k; ++c) row[c] = bf16_to_float(xb[c]);
      xr = row;
    }
    quantize_row(xr, r, k, small, super, q32, d32, s32, q256, d256, sum16, sum32);
  }
  out = {m, k, q32, d32, s32, q256, d256, sum16, sum32};
  return true;
}

// Q4_K / Q5_K: the 8 six-bit scales and the 8 six-bit minimums packed in 12 bytes, as 8
// bytes each. Bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7;
// bytes 4-7 the same for the minimums; bytes 8-11 the low 4 bits of scales 4-7 (low
// nibbles) and of minimums 4-7 (high nibbles).
inline void k_scales(const uint8_t* p, uint64_t* scales, uint64_t* mins) {
  uint32_t a, b, c;
  memcpy(&a, p, 4);
  memcpy(&b, p + 4, 4);
  memcpy(&c, p + 8, 4);
  const uint32_t six = 0x3F3F3F3Fu, four = 0x0F0F0F0Fu, top = 0x30303030u;
  const uint32_t scales_hi = (c & four) | ((a >> 2) & top);
  const uint32_t mins_hi = ((c >> 4) & four) | ((b >> 2) & top);
  *scales = (a & six) | (static_cast<uint64_t>(scales_hi) << 32);
  *mins = (b & six) | (static_cast<uint64_t>(mins_hi) << 32);
}

bool super_type(int type) {
  return type == kQ4_K || type == kQ5_K || type == kQ6_K || type == kQ4_Kx8 || type == kQ6_Kx8;
}

bool interleaved(int type) {
  return type == kQ4_Kx8 || type == kQ6_Kx8 || type == kQ5_0x8 || type == kQ8_0x8;
}

// The interleaved layout of a file type, or 0 where it has none.
int interleaved_type(int type) {
  switch (type) {
    case kQ4_K: return kQ4_Kx8;
    case kQ6_K: return kQ6_Kx8;
    case kQ5_0: return kQ5_0x8;
    case kQ8_0: return kQ8_0x8;
    default: return 0;
  }
}

int64_t block_bytes(int type) {
  switch (type) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ5_0: return 22;
    case kQ5_1: return 24;
    case kQ8_0: return 34;
    case kQ4_K: return 144;
    case kQ4_Kx8: return 144;  // per row, as in the file
    case kQ6_Kx8: return 210;
    case kQ5_0x8: return 22;
    case kQ8_0x8: return 34;
    case kQ5_K: return 176;
    case kQ6_K: return 210;
    default: return 0;
  }
}

// The kernels of one instruction set: rows of x per tile, and the function for a tile.
struct Kernels {
  int tile;
  RowFn (*select)(int type, int rows);
  int group_tile;  // rows of x per call of a group kernel
  GroupFn (*group)(int type, int rows);
};

// Row `row` of a part times rows m0..m0+rows-1 of x, into tile[0..rows-1].
inline void weight_tile(const Kernels& kernels, const GgmlPart& part, int64_t row,
                        const QuantizedX& x, int64_t m0, int rows, float* tile) {
  kernels.select(part.type, rows)(part.data + row * part.row_bytes, x, m0, tile);
}

inline float silu(float g) { return g / (1.0f + expf(-g)); }

// The part holding stacked row i, and i's row within it.
inline const GgmlPart& part_of(const GgmlWeight& w, int64_t& i) {
  int64_t p = 0;
  while (p + 1 < w.n_parts && i >= w.parts[p].rows) i -= w.parts[p++].rows;
  return w.parts[p];
}

// Outputs first..last-1 of y [m, ldy]. Weight rows go kRowGroup at a time: each tile of x
// runs over the group while its rows are in cache (long prompts re-read x from cache, not
// the weights from memory). An interleaved part goes 8 rows per call; `first` and `last`
// then fall on its group boundaries (the caller splits work in multiples of 8).
void run_outputs(const Kernels& kernels, const GgmlWeight& w, const QuantizedX& x, float* y,
                 int64_t ldy, int64_t first, int64_t last, const float* pre, int64_t ld_pre) {
  constexpr int64_t kRowGroup = 32;
  const bool gated = w.epilogue == kSiluMul;
  float tile[kMaxTile * kGroupRows], up[kMaxTile * kGroupRows];
  for (int64_t i0 = first; i0 < last; i0 += kRowGroup) {
    const int64_t i1 = i0 + kRowGroup < last ? i0 + kRowGroup : last;
    // Tiles of x as wide as the kernels of the group's first part take; a row group holds
    // one part when that part is interleaved (parts and groups both start at multiples of 8).
    int64_t first_local = i0;
    const GgmlPart& first_part = gated ? w.parts[0] : part_of(w, first_local);
    // Tiles as even as they can be (5 rows as 3 + 2, not 4 + 1: a lone row pays a whole
    // decode of the weights for itself).
    const int64_t widest = interleaved(first_part.type) ? kernels.group_tile : kernels.tile;
    const int64_t tiles = (x.m + widest - 1) / widest;
    const int64_t width = (x.m + tiles - 1) / tiles;
    for (int64_t m0 = 0; m0 < x.m; m0 += width) {
      const int rows = static_cast<int>(x.m - m0 < width ? x.m - m0 : width);
      for (int64_t i = i0; i < i1;) {
        int64_t local = i;
        const GgmlPart& part = gated ? w.parts[0] : part_of(w, local);
        const bool group = interleaved(part.type);
        const int64_t count = group ? kGroupRows : 1;  // weight rows per call
        const int call_rows = static_cast<int>(
            group ? (rows < kernels.group_tile ? rows : kernels.group_tile)
                  : (rows < kernels.tile ? rows : kernels.tile));
        for (int64_t t0 = 0; t0 < rows; t0 += call_rows) {
          const int n_rows = static_cast<int>(rows - t0 < call_rows ? rows - t0 : call_rows);
          const auto call = [&](const GgmlPart& p, float* out) {
            if (group) {
              kernels.group(p.type, n_rows)(p.data + local * p.row_bytes, x, m0 + t0, out);
            } else {
              weight_tile(kernels, p, local, x, m0 + t0, n_rows, out);
            }
          };
          call(part, tile);
          if (gated) call(w.parts[1], up);
          for (int t = 0; t < n_rows; ++t) {
            for (int64_t r = 0; r < count; ++r) {
              float value = tile[t * count + r];
              const float* terms = pre ? pre + (m0 + t0 + t) * ld_pre : nullptr;
              if (w.bias) value += w.bias[i + r];
              if (terms) value += terms[i + r];
              if (gated) {
                float u = up[t * count + r];
                if (w.bias) u += w.bias[w.parts[0].rows + i + r];
                if (terms) u += terms[w.n + i + r];
                value = silu(value) * u;
              }
              y[(m0 + t0 + t) * ldy + i + r] = value;
            }
          }
        }
        i += count;
      }
    }
  }
}

// Super-block b of 8 Q4_K rows (`block` is row 0's, the next row_bytes on) as one block of
// 1152 bytes: the rows' d (f16 [8]) and dmin (f16 [8]); their scales and minimums (6 bits,
// 128 values v = 8 j + r of sub-block j and row r): 32 bytes of the scales' low 4 bits
// (value v in byte v % 32, nibble v / 32), the same for the minimums, and 32 bytes of the
// high 2 bits (byte p: scale p, scale p + 32, minimum p, minimum p + 32); then the codes, each
// 4 bytes of a row's 128 with the 8 rows' side by side.
void interleave_q4_k(const uint8_t* block, int64_t row_bytes, uint8_t* out) {
  uint8_t scales[64], mins[64];
  for (int64_t r = 0; r < kGroupRows; ++r) {
    const uint8_t* row = block + r * row_bytes;
    memcpy(out + 2 * r, row, 2);
    memcpy(out + 16 + 2 * r, row + 2, 2);
    uint64_t packed_scales, packed_mins;
    k_scales(row + 4, &packed_scales, &packed_mins);
    for (int j = 0; j < 8; ++j) {
      scales[8 * j + r] = static_cast<uint8_t>(packed_scales >> (8 * j));
      mins[8 * j + r] = static_cast<uint8_t>(packed_mins >> (8 * j));
    }
    for (int q = 0; q < 32; ++q) memcpy(out + 128 + 32 * q + 4 * r, row + 16 + 4 * q, 4);
  }
  for (int p = 0; p < 32; ++p) {
    out[32 + p] = static_cast<uint8_t>((scales[p] & 15) | (scales[p + 32] & 15) << 4);
    out[64 + p] = static_cast<uint8_t>((mins[p] & 15) | (mins[p + 32] & 15) << 4);
    out[96 + p] = static_cast<uint8_t>(scales[p] >> 4 | (scales[p + 32] >> 4) << 2 |
                                       (mins[p] >> 4) << 4 | (mins[p + 32] >> 4) << 6);
  }
}

// The same for Q6_K, 1680 bytes: d (f16 [8]), the scales (int8 [16 sub-blocks][8 rows]),
// then per half h and step s (0-7) 96 bytes: the 8 rows' 4 bytes of ql at 64 h + 4 s, of ql
// at 64 h + 32 + 4 s, and of qh at 32 h + 4 s (the codes of weights 128 h + 4 s + 32 i).
void interleave_q6_k(const uint8_t* block, int64_t row_bytes, uint8_t* out) {
  for (int64_t r = 0; r < kGroupRows; ++r) {
    const uint8_t* row = block + r * row_bytes;
    memcpy(out + 2 * r, row + 208, 2);
    for (int j = 0; j < 16; ++j) out[16 + 8 * j + r] = row[192 + j];
    for (int half = 0; half < 2; ++half) {
      for (int step = 0; step < 8; ++step) {
        uint8_t* units = out + 144 + (8 * half + step) * 96 + 4 * r;
        memcpy(units, row + 64 * half + 4 * step, 4);
        memcpy(units + 32, row + 64 * half + 32 + 4 * step, 4);
        memcpy(units + 64, row + 128 + 32 * half + 4 * step, 4);
      }
    }
  }
}

// The same for Q8_0 (272 bytes: d (f16 [8]), then per 4 codes the 8 rows' side by side) and
// Q5_0 (176 bytes: d; the fifth bits, 4 bytes a row, byte s holding those of codes 4 s .. 4 s + 3
// in its low 4 bits and of 16 + 4 s .. 16 + 4 s + 3 in its high 4; then per 4 bytes of the
// packed codes the 8 rows' side by side).
void interleave_q_0(int type, const uint8_t* block, int64_t row_bytes, uint8_t* out) {
  for (int64_t r = 0; r < kGroupRows; ++r) {
    const uint8_t* row = block + r * row_bytes;
    memcpy(out + 2 * r, row, 2);
    if (type == kQ8_0) {
      for (int s = 0; s < 8; ++s) memcpy(out + 16 + 32 * s + 4 * r, row + 2 + 4 * s, 4);
      continue;
    }
    uint32_t bits;
    memcpy(&bits, row + 2, 4);
    for (int s = 0; s < 4; ++s) {
      out[16 + 4 * r + s] =
          static_cast<uint8_t>((bits >> (4 * s) & 15) | (bits >> (16 + 4 * s) & 15) << 4);
      memcpy(out + 48 + 32 * s + 4 * r, row + 6 + 4 * s, 4);
    }
  }
}

// Read once: every call checks them.
bool cpu_has_avx2() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }();
  return has;
}

bool cpu_has_avx512() {
  static const bool has = [] {
    __builtin_cpu_init();
    return cpu_has_avx2() && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512vnni");
  }();
  return has;
}

}  // namespace

// The same kernels compiled twice: for AVX2 (16 vector registers, tiles of 4 rows of x) and
// for AVX-512 with VNNI (32 registers, so tiles of 8 rows keep their sums in registers; and
// vpdpbusd, one instruction for vpmaddubsw + vpmaddwd). Both sum exact integers per block, but
// they apply the offsets differently, so the two paths agree to rounding, not bit for bit.
#define MINIAPP_GGML_KERNELS
#define GGML_TARGET __attribute__((target("avx2,fma,f16c")))
#define GGML_ISA avx2
#define GGML_TILE 4
#define GGML_GROUP_TILE 2
#define GGML_VNNI 0
#include "ggml_dot.cpp"
#undef GGML_TARGET
#undef GGML_ISA
#undef GGML_TILE
#undef GGML_GROUP_TILE
#undef GGML_VNNI
#define GGML_TARGET \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
#define GGML_ISA avx512
#define GGML_TILE 8
#define GGML_GROUP_TILE 4
#define GGML_VNNI 1
#include "ggml_dot.cpp"

namespace {

constexpr Kernels kAvx2Kernels = {avx2::kTile, avx2::tile_function, avx2::kGroupTile,
                                   avx2::group_function};
constexpr Kernels kAvx512Kernels = {avx512::kTile, avx512::tile_function, avx512::kGroupTile,
                                     avx512::group_function};

}  // namespace

extern "C" {

// Whether this CPU runs the GGML block kernels on the given path (1 AVX2, 2 AVX-512).
int miniapp_ggml_cpu_has(int isa) {
  return isa == kIsaAvx512 ? cpu_has_avx512() : isa == kIsaAvx2 ? cpu_has_avx2() : 0;
}

// Rows [rows, k] of Q4_K or Q6_K (rows a multiple of 8) rewritten as groups of 8 rows
// interleaved, in the same number of bytes (see interleave_q4_k and interleave_q6_k).
// Returns the type id of the result, or -1 for a type or shape without this layout.
int miniapp_ggml_interleave(int type, const uint8_t* src, int64_t rows, int64_t k, uint8_t* dst,
                            int threads) {
  const int target = interleaved_type(type);
  const int64_t block = super_type(type) ? kSuperBlock : kSmallBlock;
  if (!target || rows % kGroupRows || k <= 0 || k % block) return -1;
  const int64_t nb = k / block, bytes = block_bytes(type), row_bytes = nb * bytes;
  const int64_t groups = rows / kGroupRows;
#pragma omp parallel for num_threads(threads > 0 ? threads : 1) schedule(static)
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* rows_in = src + g * kGroupRows * row_bytes;
    uint8_t* group = dst + g * kGroupRows * row_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* in = rows_in + b * bytes;
      uint8_t* out = group + b * kGroupRows * bytes;
      switch (type) {
        case kQ4_K: interleave_q4_k(in, row_bytes, out); break;
        case kQ6_K: interleave_q6_k(in, row_bytes, out); break;
        default: interleave_q_0(type, in, row_bytes, out); break;
      }
    }
  }
  return target;
}

// y [m, w->n] (contiguous) for x [m, k] (fp32 or bf16: x_type 0 or 1, row stride ldx).
// `pre` (or null): terms added to W x (+ bias) before the epilogue, [m, ld_pre]: n of them,
// or 2n with kSiluMul (gate, then up). Returns 0, or -1 for arguments it does not take
// (nothing is written then).
int miniapp_ggml_gemm_pre(const GgmlWeight* w, const void* x, int64_t ldx, int x_type,
                          int64_t m, float* y, const float* pre, int64_t ld_pre, int threads) {
  if (!cpu_has_avx2() || m < 0 || (x_type != 0 && x_type != 1)) return -1;
  if (w->isa == kIsaAvx512 && !cpu_has_avx512()) return -1;
  if (w->n_parts < 1 || w->n_parts > kMaxParts || w->k <= 0) return -1;
  if (w->epilogue != kStore && w->epilogue != kSiluMul) return -1;
  bool small = false, super = false;
  int64_t rows = 0, bytes = 0;
  for (int64_t p = 0; p < w->n_parts; ++p) {
    const GgmlPart& part = w->parts[p];
    const int64_t block = super_type(part.type) ? kSuperBlock : kSmallBlock;
    if (block_bytes(part.type) == 0 || w->k % block) return -1;
    if (part.row_bytes != w->k / block * block_bytes(part.type)) return -1;
    // An interleaved part holds whole groups and starts on a group boundary.
    if (interleaved(part.type) && (part.rows % kGroupRows || rows % kGroupRows)) return -1;
    (super_type(part.type) ? super : small) = true;
    rows += part.rows;
    bytes += part.rows * part.row_bytes;
  }
  if (w->epilogue == kSiluMul &&
      (w->n_parts != 2 || w->parts[0].rows != w->parts[1].rows || w->n != w->parts[0].rows ||
       interleaved(w->parts[0].type) != interleaved(w->parts[1].type))) {
    return -1;
  }
  if (w->epilogue == kStore && w->n != rows) return -1;
  if (pre && ld_pre < (w->epilogue == kSiluMul ? 2 * w->n : w->n)) return -1;
  if (m == 0) return 0;
  const Kernels& kernels =
      w->isa == kIsaAvx2 || !cpu_has_avx512() ? kAvx2Kernels : kAvx512Kernels;
  QuantizedX qx;
  if (!quantize_x(x, ldx, x_type, m, w->k, small, super, threads, qx)) return -1;
  const int64_t n = w->n;
  if (threads > n) threads = static_cast<int>(n);
  if (threads <= 1 || bytes < kMinParallelBytes) {
    run_outputs(kernels, *w, qx, y, n, 0, n, pre, ld_pre);
    return 0;
  }
#pragma omp parallel num_threads(threads)
  {
    // Contiguous ranges of outputs: each thread streams its own part of the weight.
    const int64_t t = omp_get_thread_num(), count = omp_get_num_threads();
    // Split on multiples of 8 rows, so that no interleaved group is cut.
    const auto bound = [&](int64_t i) { return i == count ? n : n * i / count / kGroupRows * kGroupRows; };
    run_outputs(kernels, *w, qx, y, n, bound(t), bound(t + 1), pre, ld_pre);
  }
  return 0;
}

int miniapp_ggml_gemm(const GgmlWeight* w, const void* x, int64_t ldx, int x_type, int64_t m,
                      float* y, int threads) {
  return miniapp_ggml_gemm_pre(w, x, ldx, x_type, m, y, nullptr, 0, threads);
}

}  // extern "C"

#else  // MINIAPP_GGML_KERNELS: the kernels, once per instruction set

namespace {
namespace GGML_ISA {

constexpr int kTile = GGML_TILE;  // rows of x that share one decode of a weight row
constexpr int kGroupTile = GGML_GROUP_TILE;  // the same for an interleaved group

// ------------------------------------------------------------------ block helpers

GGML_TARGET inline float f16_at(const uint8_t* p) {
  uint16_t h;
  memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

GGML_TARGET inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

GGML_TARGET inline __m256i load32(const void* p) {
  return _mm256_loadu_si256(static_cast<const __m256i*>(p));
}

// Unsigned codes times signed x codes, summed in 8 lanes of 4 products each (codes below
// 128 on AVX2, whose vpmaddubsw saturates a pair at 2^15; any byte with VNNI).
GGML_TARGET inline __m256i dot_unsigned(__m256i codes, __m256i x) {
#if GGML_VNNI
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), codes, x);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(codes, x), _mm256_set1_epi16(1));
#endif
}

// The same with each 16-bit pair sum weighted by `scales` (int16 lanes).
GGML_TARGET inline __m256i dot_scaled(__m256i codes, __m256i x, __m256i scales) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(codes, x), scales);
}

// Signed weights: |w| times x with w's sign.
GGML_TARGET inline __m256i dot_signed(__m256i w, __m256i x) {
  return dot_unsigned(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}

// 32 bits -> 32 bytes of 0x10 (bit set) or 0 (the fifth bit of Q5_0/Q5_1 codes).
GGML_TARGET inline __m256i fifth_bits(const uint8_t* p) {
  uint32_t bits;
  memcpy(&bits, p, 4);
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL));
  const __m256i masks = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, masks), masks);
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

// 16 bytes of packed nibbles -> 32 codes: the low nibbles, then the high ones.
GGML_TARGET inline __m256i nibbles(const uint8_t* p) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

// Word j of an 8-word vector, in all 16 lanes (both halves hold the 8 words).
GGML_TARGET inline __m256i word_everywhere(__m256i words, int j) {
  const __m256i index = _mm256_set1_epi16(static_cast<int16_t>((2 * j + 1) << 8 | 2 * j));
  return _mm256_shuffle_epi8(words, index);
}

// ------------------------------------------------------------------ one weight row, MT rows

// Each returns, per row t of the tile, that row of x times the weight row.

// Q8_0 (w = d q, q signed), Q4_0 (w = d (q - 8)) and Q5_0 (w = d (q - 16), the fifth bits
// first). With VNNI the codes stay unsigned (Q8_0's biased by 128) and the offset comes off
// through x's block sums; without it, |w| meets x with w's sign (vpmaddubsw takes unsigned
// bytes up to 127 per pair without saturating, which Q8_0's biased codes would pass).
template <int MT, int kType>
GGML_TARGET void row_q_0(const uint8_t* w, const QuantizedX& x, int64_t m0, float* out) {
  const int64_t nb = x.k / kSmallBlock;
  constexpr int64_t kBytes = kType == kQ8_0 ? 34 : kType == kQ5_0 ? 22 : 18;
  constexpr int kOffsetCode = kType == kQ8_0 ? 128 : kType == kQ5_0 ? 16 : 8;
  [[maybe_unused]] constexpr float kOffset = static_cast<float>(kOffsetCode);
  __m256 acc[MT];
  float offsets[MT];
  for (int t = 0; t < MT; ++t) acc[t] = _mm256_setzero_ps(), offsets[t] = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* block = w + b * kBytes;
    const float d = f16_at(block);
    __m256i codes;  // unsigned: value + offset
    if (kType == kQ8_0) {
      codes = _mm256_xor_si256(load32(block + 2), _mm256_set1_epi8(static_cast<char>(0x80)));
    } else if (kType == kQ5_0) {
      codes = _mm256_or_si256(nibbles(block + 6), fifth_bits(block + 2));
    } else {
      codes = nibbles(block + 2);
    }
#if !GGML_VNNI
    // Q8_0's 128 wraps to -128 as a byte: subtracting it adds 128, which undoes the bias.
    const __m256i signed_codes =
        _mm256_sub_epi8(codes, _mm256_set1_epi8(static_cast<char>(kOffsetCode)));
#endif
    for (int t = 0; t < MT; ++t) {
      const int64_t at = (m0 + t) * nb + b;
      const __m256i xq = load32(x.q32 + at * kSmallBlock);
#if GGML_VNNI
      const __m256i dot = dot_unsigned(codes, xq);
      offsets[t] += kOffset * d * x.s32[at];
#else
      const __m256i dot = dot_signed(signed_codes, xq);
#endif
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * x.d32[at]), acc[t]);
    }
  }
  for (int t = 0; t < MT; ++t) out[t] = hsum(acc[t]) - offsets[t];
}

// Q4_1 and Q5_1: w = d q + m.
template <int MT, bool kFive>
GGML_TARGET void row_q_1(const uint8_t* w, const QuantizedX& x, int64_t m0, float* out) {
  const int64_t nb = x.k / kSmallBlock;
  constexpr int64_t kBytes = kFive ? 24 : 20;
  __m256 acc[MT];
  float mins[MT];
  for (int t = 0; t < MT; ++t) acc[t] = _mm256_setzero_ps(), mins[t] = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* block = w + b * kBytes;
    const float d = f16_at(block), minimum = f16_at(block + 2);
    const __m256i codes =
        kFive ? _mm256_or_si256(nibbles(block + 8), fifth_bits(block + 4)) : nibbles(block + 4);
    for (int t = 0; t < MT; ++t) {
      const int64_t at = (m0 + t) * nb + b;
      const __m256i dot = dot_unsigned(codes, load32(x.q32 + at * kSmallBlock));
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * x.d32[at]), acc[t]);
      mins[t] += minimum * x.s32[at];
    }
  }
  for (int t = 0; t < MT; ++t) out[t] = hsum(acc[t]) + mins[t];
}

#if GGML_VNNI
// Byte indices that put, in each 128-bit half, words a, a, a, a, b, b, b, b of an 8-word
// vector: the weights of vpmaddwd over sums packed from two dot products. Plain data (no
// vector code runs when the library loads, on any CPU).
struct WordPick {
  alignas(32) uint8_t bytes[32];
};

constexpr WordPick pick_words(int low_a, int low_b, int high_a, int high_b) {
  WordPick pick = {};
  const int words[4] = {low_a, low_b, high_a, high_b};
  for (int i = 0; i < 16; ++i) {
    const int word = words[2 * (i / 8) + (i % 8) / 4];
    pick.bytes[2 * i] = static_cast<uint8_t>(2 * word);
    pick.bytes[2 * i + 1] = static_cast<uint8_t>(2 * word + 1);
  }
  return pick;
}

// Q4_K/Q5_K chunk c: its lo sums (sub-block 2c) then its hi sums (2c + 1), in both halves.
constexpr WordPick kPairPick[4] = {pick_words(0, 1, 0, 1), pick_words(2, 3, 2, 3),
                                   pick_words(4, 5, 4, 5), pick_words(6, 7, 6, 7)};
// Q6_K chunks i, i + 1 packed: the low halves hold sub-blocks 2i and 2i + 2, the high
// halves 2i + 1 and 2i + 3.
constexpr WordPick kSixPick[2] = {pick_words(0, 2, 1, 3), pick_words(4, 6, 5, 7)};
#endif

// Q4_K and Q5_K: per sub-block j of 32, w = d sc_j q - dmin m_j.
template <int MT, bool kFive>
GGML_TARGET void row_q_k(const uint8_t* w, const QuantizedX& x, int64_t m0, float* out) {
  const int64_t nb = x.k / kSuperBlock;
  constexpr int64_t kBytes = kFive ? 176 : 144;
  const __m256i low4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
  __m256 acc[MT];
  __m128 mins[MT];
  for (int t = 0; t < MT; ++t) acc[t] = _mm256_setzero_ps(), mins[t] = _mm_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* block = w + b * kBytes;
    const float d = f16_at(block), dmin = f16_at(block + 2);
    uint64_t packed_scales, packed_mins;
    k_scales(block + 4, &packed_scales, &packed_mins);
    const __m128i scales8 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<int64_t>(packed_scales)));
    const __m128i mins8 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<int64_t>(packed_mins)));
    const __m256i scales = _mm256_broadcastsi128_si256(scales8);
    const uint8_t* qs = block + (kFive ? 48 : 16);
    __m256i high = kFive ? load32(block + 16) : _mm256_setzero_si256();
    __m256i sums[MT];
    for (int t = 0; t < MT; ++t) sums[t] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      const __m256i packed = load32(qs + 32 * c);
      __m256i lo = _mm256_and_si256(packed, low4);
      __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
      if (kFive) {
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(high, one), 4));
        hi = _mm256_or_si256(
            hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 1), one), 4));
        high = _mm256_srli_epi16(high, 2);
      }
#if GGML_VNNI
      // Each lane's sum of 4 products fits 16 bits (4 * 31 * 127): the lo and hi sums are
      // packed side by side and weighted by their scales in one vpmaddwd.
      const __m256i pair_scales = _mm256_shuffle_epi8(scales, load32(kPairPick[c].bytes));
      for (int t = 0; t < MT; ++t) {
        const int8_t* xq = x.q256 + (m0 + t) * x.k + b * kSuperBlock + 64 * c;
        const __m256i both = _mm256_packs_epi32(dot_unsigned(lo, load32(xq)),
                                                dot_unsigned(hi, load32(xq + 32)));
        sums[t] = _mm256_add_epi32(sums[t], _mm256_madd_epi16(both, pair_scales));
      }
#else
      const __m256i scale_lo = word_everywhere(scales, 2 * c);
      const __m256i scale_hi = word_everywhere(scales, 2 * c + 1);
      for (int t = 0; t < MT; ++t) {
        const int8_t* xq = x.q256 + (m0 + t) * x.k + b * kSuperBlock + 64 * c;
        sums[t] = _mm256_add_epi32(sums[t], dot_scaled(lo, load32(xq), scale_lo));
        sums[t] = _mm256_add_epi32(sums[t], dot_scaled(hi, load32(xq + 32), scale_hi));
      }
#endif
    }
    for (int t = 0; t < MT; ++t) {
      const int64_t row = m0 + t;
      const float dx = x.d256[row * nb + b];
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[t]), _mm256_set1_ps(d * dx), acc[t]);
      const __m128i s32 = _mm_loadu_si128(
          reinterpret_cast<const __m128i*>(x.sum32 + row * (x.k / 32) + b * 8));
      mins[t] = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm_madd_epi16(mins8, s32)),
                             _mm_set1_ps(dmin * dx), mins[t]);
    }
  }
  for (int t = 0; t < MT; ++t) {
    __m128 m4 = _mm_add_ps(mins[t], _mm_movehl_ps(mins[t], mins[t]));
    m4 = _mm_add_ss(m4, _mm_movehdup_ps(m4));
    out[t] = hsum(acc[t]) - _mm_cvtss_f32(m4);
  }
}

// Q6_K: per sub-block j of 16, w = d sc_j (q - 32), q of 6 bits (4 in ql, 2 in qh).
template <int MT>
GGML_TARGET void row_q6_k(const uint8_t* w, const QuantizedX& x, int64_t m0, float* out) {
  const int64_t nb = x.k / kSuperBlock;
  const __m256i low4 = _mm256_set1_epi8(0x0F), low2 = _mm256_set1_epi8(3);
  // Chunk i of a half spans sub-blocks 2i (its low 16 codes) and 2i + 1: the low 128 bits of
  // its scale vector broadcast word 2i, the high 128 bits word 2i + 1.
#if GGML_VNNI
  const __m256i pick[2] = {load32(kSixPick[0].bytes), load32(kSixPick[1].bytes)};
#else
  __m256i pick[4];
  for (int i = 0; i < 4; ++i) {
    pick[i] = _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>((4 * i + 3) << 8 | (4 * i + 2))),
                               _mm_set1_epi16(static_cast<int16_t>((4 * i + 1) << 8 | 4 * i)));
  }
#endif
  __m256 acc[MT];
  for (int t = 0; t < MT; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* block = w + b * 210;
    const float d = f16_at(block + 208);
    const __m256i scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(block + 192)));
    __m256i sums[MT];
    for (int t = 0; t < MT; ++t) sums[t] = _mm256_setzero_si256();
    for (int half = 0; half < 2; ++half) {
      const uint8_t* ql = block + 64 * half;
      const __m256i ql0 = load32(ql), ql1 = load32(ql + 32), qh = load32(block + 128 + 32 * half);
      // The half's 8 scales in both 128-bit halves.
      const __m256i half_scales = half ? _mm256_permute2x128_si256(scales16, scales16, 0x11)
                                       : _mm256_permute2x128_si256(scales16, scales16, 0x00);
      __m256i codes[4];
      codes[0] = _mm256_or_si256(_mm256_and_si256(ql0, low4),
                                 _mm256_slli_epi16(_mm256_and_si256(qh, low2), 4));
      codes[1] = _mm256_or_si256(
          _mm256_and_si256(ql1, low4),
          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), low2), 4));
      codes[2] = _mm256_or_si256(
          _mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4),
          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), low2), 4));
      codes[3] = _mm256_or_si256(
          _mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), low2), 4));
#if GGML_VNNI
      // Chunks i and i + 1 (sub-blocks 2i .. 2i + 3): a lane's sum of 4 products fits 16 bits
      // (4 * 63 * 127), so the two chunks' sums are packed and weighted in one vpmaddwd.
      for (int i = 0; i < 4; i += 2) {
        const __m256i scale = _mm256_shuffle_epi8(half_scales, pick[i / 2]);
        for (int t = 0; t < MT; ++t) {
          const int8_t* xq = x.q256 + (m0 + t) * x.k + b * kSuperBlock + 128 * half + 32 * i;
          const __m256i both = _mm256_packs_epi32(dot_unsigned(codes[i], load32(xq)),
                                                  dot_unsigned(codes[i + 1], load32(xq + 32)));
          sums[t] = _mm256_add_epi32(sums[t], _mm256_madd_epi16(both, scale));
        }
      }
#else
      for (int i = 0; i < 4; ++i) {
        const __m256i scale = _mm256_shuffle_epi8(half_scales, pick[i]);
        for (int t = 0; t < MT; ++t) {
          const int8_t* xq = x.q256 + (m0 + t) * x.k + b * kSuperBlock + 128 * half + 32 * i;
          sums[t] = _mm256_add_epi32(sums[t], dot_scaled(codes[i], load32(xq), scale));
        }
      }
#endif
    }
    for (int t = 0; t < MT; ++t) {
      const int64_t row = m0 + t;
      // The codes' offset of 32, in integers: sum_j sc_j * 32 * (x's sum over sub-block j).
      const __m256i s16 = load32(x.sum16 + row * (x.k / 16) + b * 16);
      const __m256i offset = _mm256_slli_epi32(_mm256_madd_epi16(scales16, s16), 5);
      const __m256 step = _mm256_set1_ps(d * x.d256[row * nb + b]);
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(sums[t], offset)), step, acc[t]);
    }
  }
  for (int t = 0; t < MT; ++t) out[t] = hsum(acc[t]);
}


// ------------------------------------------------------------------ Q4_K, 8 rows interleaved

// Eight weight rows at once (the layout `interleave_q4_k` writes): each 32-bit lane of a
// vector holds 4 codes of one row, so a broadcast of 4 codes of x meets all 8 rows in one
// instruction and the lanes sum straight into that row's total. No horizontal sums, no
// packing: per 32 products, one vpdpbusd (VNNI) or vpmaddubsw and a 16-bit add (AVX2), and
// a sub-block's scale costs one multiply for 256 products. The result of each of the 8 rows
// sums its super-blocks in column order, whatever the other rows of x: rows stay independent.

// A super-block's scales and minimums for the 8 rows, unpacked once for the tile of x.
struct GroupScales {
  alignas(32) int32_t scale[8][8];  // [sub-block][row], for vpmulld (VNNI)
  alignas(32) int16_t scale16[8][16];  // [sub-block][row, twice], for vpmaddwd (AVX2)
  alignas(32) int16_t min_pairs[4][16];  // [pair of sub-blocks][row: min 2p, min 2p + 1]
};

// 6-bit values from their low 4 bits (low nibbles of `low`) and high 2 (low bits of `high`).
GGML_TARGET inline __m256i six(__m256i low, __m256i high) {
  return _mm256_or_si256(_mm256_and_si256(low, _mm256_set1_epi8(0x0F)),
                         _mm256_slli_epi16(_mm256_and_si256(high, _mm256_set1_epi8(0x03)), 4));
}

GGML_TARGET inline void unpack_group_scales(const uint8_t* block, GroupScales& out) {
  const __m256i scale_low = load32(block + 32), min_low = load32(block + 64);
  const __m256i high = load32(block + 96);
  // Values v = 8 j + r: the first vector holds sub-blocks 0-3, the second 4-7.
  alignas(32) uint8_t scales[64], mins[64];
  _mm256_store_si256(reinterpret_cast<__m256i*>(scales), six(scale_low, high));
  _mm256_store_si256(reinterpret_cast<__m256i*>(scales + 32),
                     six(_mm256_srli_epi16(scale_low, 4), _mm256_srli_epi16(high, 2)));
  _mm256_store_si256(reinterpret_cast<__m256i*>(mins), six(min_low, _mm256_srli_epi16(high, 4)));
  _mm256_store_si256(reinterpret_cast<__m256i*>(mins + 32),
                     six(_mm256_srli_epi16(min_low, 4), _mm256_srli_epi16(high, 6)));
  for (int j = 0; j < 8; ++j) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(scales + 8 * j));
#if GGML_VNNI
    _mm256_store_si256(reinterpret_cast<__m256i*>(out.scale[j]), _mm256_cvtepu8_epi32(bytes));
#else
    _mm256_store_si256(reinterpret_cast<__m256i*>(out.scale16[j]),
                       _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(bytes, bytes)));
#endif
  }
  for (int p = 0; p < 4; ++p) {
    const __m128i even = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(mins + 16 * p));
    const __m128i odd = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(mins + 16 * p + 8));
    _mm256_store_si256(reinterpret_cast<__m256i*>(out.min_pairs[p]),
                       _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(even, odd)));
  }
}

GGML_TARGET inline __m256i load_aligned(const void* p) {
  return _mm256_load_si256(static_cast<const __m256i*>(p));
}

GGML_TARGET inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Independent sums a row of x splits its products over: with one or two rows, one running
// sum would wait on each vpdpbusd's latency (4-5 cycles) and read about 35 GB/s; integer sums
// fold back exactly, so the result is the same bits whatever the split.
template <int MT>
constexpr int chains() {
  return GGML_VNNI ? (MT == 1 ? 4 : MT == 2 ? 2 : 1) : 1;
}

template <int kChains>
GGML_TARGET inline __m256i fold_chains(const __m256i* sums) {
  __m256i total = sums[0];
  for (int chain = 1; chain < kChains; ++chain) total = _mm256_add_epi32(total, sums[chain]);
  return total;
}

// Rows m0..m0+MT-1 of x times the 8 rows of one group: out[t * 8 + r].
template <int MT>
GGML_TARGET void group_q4_k(const uint8_t* group, const QuantizedX& x, int64_t m0, float* out) {
  constexpr int kChains = chains<MT>();
  const int64_t nb = x.k / kSuperBlock;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 acc[MT];
  for (int t = 0; t < MT; ++t) acc[t] = _mm256_setzero_ps();
  GroupScales scales;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* block = group + b * kGroupBlockBytes;
    unpack_group_scales(block, scales);
    const uint8_t* qs = block + 128;
    const int8_t* xb[MT];
    for (int t = 0; t < MT; ++t) xb[t] = x.q256 + (m0 + t) * x.k + b * kSuperBlock;
    __m256i total[MT];
    for (int t = 0; t < MT; ++t) total[t] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      __m256i lo_sum[MT][kChains], hi_sum[MT][kChains];
      for (int t = 0; t < MT; ++t) {
        for (int chain = 0; chain < kChains; ++chain) {
          lo_sum[t][chain] = hi_sum[t][chain] = _mm256_setzero_si256();
        }
      }
      for (int step = 0; step < 8; ++step) {
        const __m256i packed = load32(qs + (8 * c + step) * 32);
        const __m256i lo = _mm256_and_si256(packed, low4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
        const int chain = step % kChains;
        for (int t = 0; t < MT; ++t) {
          const int8_t* xq = xb[t] + 64 * c + 4 * step;
#if GGML_VNNI
          lo_sum[t][chain] = _mm256_dpbusd_epi32(lo_sum[t][chain], lo, broadcast4(xq));
          hi_sum[t][chain] = _mm256_dpbusd_epi32(hi_sum[t][chain], hi, broadcast4(xq + 32));
#else
          // 16-bit sums: 8 steps of 2 products of at most 15 * 127 stay below 2^15.
          lo_sum[t][0] = _mm256_add_epi16(lo_sum[t][0], _mm256_maddubs_epi16(lo, broadcast4(xq)));
          hi_sum[t][0] =
              _mm256_add_epi16(hi_sum[t][0], _mm256_maddubs_epi16(hi, broadcast4(xq + 32)));
#endif
        }
      }
      for (int t = 0; t < MT; ++t) {
        lo_sum[t][0] = fold_chains<kChains>(lo_sum[t]);
        hi_sum[t][0] = fold_chains<kChains>(hi_sum[t]);
      }
      for (int t = 0; t < MT; ++t) {
#if GGML_VNNI
        total[t] = _mm256_add_epi32(
            total[t], _mm256_add_epi32(
                          _mm256_mullo_epi32(lo_sum[t][0], load_aligned(scales.scale[2 * c])),
                          _mm256_mullo_epi32(hi_sum[t][0], load_aligned(scales.scale[2 * c + 1]))));
#else
        total[t] = _mm256_add_epi32(
            total[t],
            _mm256_add_epi32(_mm256_madd_epi16(lo_sum[t][0], load_aligned(scales.scale16[2 * c])),
                             _mm256_madd_epi16(hi_sum[t][0], load_aligned(scales.scale16[2 * c + 1]))));
#endif
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block)));
    const __m256 dmin =
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 16)));
    for (int t = 0; t < MT; ++t) {
      const int64_t row = m0 + t;
      // The minimums: sum_j min_j * (x's codes summed over sub-block j), two j at a time.
      const int16_t* sums = x.sum32 + row * (x.k / 32) + b * 8;
      __m256i mins = _mm256_setzero_si256();
      for (int p = 0; p < 4; ++p) {
        int32_t pair;
        memcpy(&pair, sums + 2 * p, 4);
#if GGML_VNNI
        mins = _mm256_dpwssd_epi32(mins, load_aligned(scales.min_pairs[p]), _mm256_set1_epi32(pair));
#else
        mins = _mm256_add_epi32(
            mins, _mm256_madd_epi16(load_aligned(scales.min_pairs[p]), _mm256_set1_epi32(pair)));
#endif
      }
      const __m256 dx = _mm256_set1_ps(x.d256[row * nb + b]);
      const __m256 value = _mm256_fmsub_ps(_mm256_cvtepi32_ps(total[t]), d,
                                           _mm256_mul_ps(_mm256_cvtepi32_ps(mins), dmin));
      acc[t] = _mm256_fmadd_ps(value, dx, acc[t]);
    }
  }
  for (int t = 0; t < MT; ++t) _mm256_storeu_ps(out + 8 * t, acc[t]);
}

// Q6_K, 8 rows interleaved (`interleave_q6_k`): per sub-block of 16, w = d sc_j (q - 32).
struct GroupScales6 {
  alignas(32) int32_t scale[16][8];  // [sub-block][row] (VNNI)
  alignas(32) int16_t scale16[16][16];  // [sub-block][row, twice] (AVX2)
  alignas(32) int16_t pairs[8][16];  // [pair of sub-blocks][row: scale 2p, scale 2p + 1]
};

GGML_TARGET inline void unpack_group_scales6(const uint8_t* block, GroupScales6& out) {
  const uint8_t* scales = block + 16;  // int8 [16][8]
  for (int j = 0; j < 16; ++j) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(scales + 8 * j));
#if GGML_VNNI
    _mm256_store_si256(reinterpret_cast<__m256i*>(out.scale[j]), _mm256_cvtepi8_epi32(bytes));
#else
    _mm256_store_si256(reinterpret_cast<__m256i*>(out.scale16[j]),
                       _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(bytes, bytes)));
#endif
  }
  for (int p = 0; p < 8; ++p) {
    const __m128i even = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(scales + 16 * p));
    const __m128i odd = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(scales + 16 * p + 8));
    _mm256_store_si256(reinterpret_cast<__m256i*>(out.pairs[p]),
                       _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(even, odd)));
  }
}

template <int MT>
GGML_TARGET void group_q6_k(const uint8_t* group, const QuantizedX& x, int64_t m0, float* out) {
  const int64_t nb = x.k / kSuperBlock;
  const __m256i low4 = _mm256_set1_epi8(0x0F), low2 = _mm256_set1_epi8(3);
  __m256 acc[MT];
  for (int t = 0; t < MT; ++t) acc[t] = _mm256_setzero_ps();
  GroupScales6 scales;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* block = group + b * kGroupBlockBytes6;
    unpack_group_scales6(block, scales);
    const int8_t* xb[MT];
    for (int t = 0; t < MT; ++t) xb[t] = x.q256 + (m0 + t) * x.k + b * kSuperBlock;
    __m256i total[MT];
    for (int t = 0; t < MT; ++t) total[t] = _mm256_setzero_si256();
    for (int half = 0; half < 2; ++half) {
      // Steps 4 g .. 4 g + 3 of a half cover sub-blocks 8 half + 2 i + g of its 4 codes i;
      // codes 0 and 1 (the low nibbles) go first, then 2 and 3, for fewer live registers.
      for (int g = 0; g < 2; ++g) {
        for (int pass = 0; pass < 2; ++pass) {
          __m256i sums[MT][2];
          for (int t = 0; t < MT; ++t) sums[t][0] = sums[t][1] = _mm256_setzero_si256();
          for (int s = 4 * g; s < 4 * g + 4; ++s) {
            const uint8_t* units = block + 144 + (8 * half + s) * 96;
            __m256i ql0 = load32(units), ql1 = load32(units + 32), qh = load32(units + 64);
            if (pass) {
              ql0 = _mm256_srli_epi16(ql0, 4), ql1 = _mm256_srli_epi16(ql1, 4);
              qh = _mm256_srli_epi16(qh, 4);
            }
            __m256i codes[2];
            codes[0] = _mm256_or_si256(_mm256_and_si256(ql0, low4),
                                       _mm256_slli_epi16(_mm256_and_si256(qh, low2), 4));
            codes[1] = _mm256_or_si256(
                _mm256_and_si256(ql1, low4),
                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), low2), 4));
            for (int t = 0; t < MT; ++t) {
              const int8_t* xq = xb[t] + 128 * half + 64 * pass + 4 * s;
              for (int i = 0; i < 2; ++i) {
#if GGML_VNNI
                sums[t][i] = _mm256_dpbusd_epi32(sums[t][i], codes[i], broadcast4(xq + 32 * i));
#else
                // 16-bit sums: 2 steps of 2 products of at most 63 * 127 stay below 2^15.
                sums[t][i] = _mm256_add_epi16(
                    sums[t][i], _mm256_maddubs_epi16(codes[i], broadcast4(xq + 32 * i)));
#endif
              }
            }
#if !GGML_VNNI
            if (s % 2 == 1) {  // the 16-bit sums are full: weight them and start again
              for (int t = 0; t < MT; ++t) {
                for (int i = 0; i < 2; ++i) {
                  const int16_t* scale = scales.scale16[8 * half + 4 * pass + 2 * i + g];
                  total[t] = _mm256_add_epi32(total[t],
                                              _mm256_madd_epi16(sums[t][i], load_aligned(scale)));
                  sums[t][i] = _mm256_setzero_si256();
                }
              }
            }
#endif
          }
#if GGML_VNNI
          for (int t = 0; t < MT; ++t) {
            for (int i = 0; i < 2; ++i) {
              const int32_t* scale = scales.scale[8 * half + 4 * pass + 2 * i + g];
              total[t] = _mm256_add_epi32(total[t],
                                          _mm256_mullo_epi32(sums[t][i], load_aligned(scale)));
            }
          }
#endif
        }
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block)));
    for (int t = 0; t < MT; ++t) {
      const int64_t row = m0 + t;
      // The codes' offset of 32: 32 sum_j sc_j (x's codes summed over sub-block j).
      const int16_t* sums16 = x.sum16 + row * (x.k / 16) + b * 16;
      __m256i offset = _mm256_setzero_si256();
      for (int p = 0; p < 8; ++p) {
        int32_t pair;
        memcpy(&pair, sums16 + 2 * p, 4);
#if GGML_VNNI
        offset = _mm256_dpwssd_epi32(offset, load_aligned(scales.pairs[p]), _mm256_set1_epi32(pair));
#else
        offset = _mm256_add_epi32(
            offset, _mm256_madd_epi16(load_aligned(scales.pairs[p]), _mm256_set1_epi32(pair)));
#endif
      }
      const __m256i exact = _mm256_sub_epi32(total[t], _mm256_slli_epi32(offset, 5));
      const __m256 step = _mm256_mul_ps(d, _mm256_set1_ps(x.d256[row * nb + b]));
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), step, acc[t]);
    }
  }
  for (int t = 0; t < MT; ++t) _mm256_storeu_ps(out + 8 * t, acc[t]);
}

// Q8_0 and Q5_0, 8 rows interleaved (`interleave_q8_0`, `interleave_q5_0`): per block of 32,
// w = d q (Q8_0, signed codes) or d (q - 16) (Q5_0, 5-bit codes). VNNI multiplies unsigned
// codes (Q8_0's biased by 128) and takes the offset off through x's block sums; AVX2 meets
// Q8_0's |w| with x carrying w's sign, as the row kernels do.
template <int MT, int kType>
GGML_TARGET void group_q_0(const uint8_t* group, const QuantizedX& x, int64_t m0, float* out) {
  const int64_t nb = x.k / kSmallBlock;
  constexpr bool kEight = kType == kQ8_0x8;
  constexpr bool kTwoChains = chains<MT>() > 1;
  constexpr int64_t kBytes = kGroupRows * (kEight ? 34 : 22);
  constexpr float kOffset = kEight ? 128.0f : 16.0f;
  const __m256i low4 = _mm256_set1_epi8(0x0F), fifth = _mm256_set1_epi8(0x10);
  // Q5_0: byte i of lane r takes bit i (low codes) or 4 + i (high codes) of byte s of the
  // lane's fifth bits; the shuffles spread byte s over the lane.
  const __m256i bit_low = _mm256_set1_epi32(0x08040201);
  const __m256i bit_high = _mm256_set1_epi32(static_cast<int32_t>(0x80402010u));
  const __m256i lane_bytes = _mm256_setr_epi32(0, 0x04040404, 0x08080808, 0x0C0C0C0C, 0,
                                               0x04040404, 0x08080808, 0x0C0C0C0C);
  __m256 acc[MT], offsets[MT];
  for (int t = 0; t < MT; ++t) acc[t] = offsets[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* block = group + b * kBytes;
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block)));
    __m256i sums[MT], more[MT];  // more: a second running sum (see chains)
    for (int t = 0; t < MT; ++t) sums[t] = more[t] = _mm256_setzero_si256();
    if (kEight) {
      for (int s = 0; s < 8; ++s) {
        const __m256i codes = load32(block + 16 + 32 * s);
#if GGML_VNNI
        const __m256i biased = _mm256_xor_si256(codes, _mm256_set1_epi8(static_cast<char>(0x80)));
#else
        const __m256i magnitude = _mm256_sign_epi8(codes, codes);
#endif
        for (int t = 0; t < MT; ++t) {
          const __m256i xq = broadcast4(x.q32 + (m0 + t) * x.k + b * kSmallBlock + 4 * s);
#if GGML_VNNI
          if (kTwoChains && s % 2) {
            more[t] = _mm256_dpbusd_epi32(more[t], biased, xq);
          } else {
            sums[t] = _mm256_dpbusd_epi32(sums[t], biased, xq);
          }
#else
          sums[t] = _mm256_add_epi32(
              sums[t], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(xq, codes)),
                                         _mm256_set1_epi16(1)));
#endif
        }
      }
    } else {
      const __m256i high_bits = load32(block + 16);
#if !GGML_VNNI
      __m256i low16[MT], high16[MT];
      for (int t = 0; t < MT; ++t) low16[t] = high16[t] = _mm256_setzero_si256();
#endif
      for (int s = 0; s < 4; ++s) {
        const __m256i spread = _mm256_shuffle_epi8(
            high_bits, _mm256_add_epi8(lane_bytes, _mm256_set1_epi8(static_cast<char>(s))));
        const __m256i packed = load32(block + 48 + 32 * s);
        const __m256i lo = _mm256_or_si256(
            _mm256_and_si256(packed, low4),
            _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit_low), bit_low), fifth));
        const __m256i hi = _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4),
            _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit_high), bit_high), fifth));
        for (int t = 0; t < MT; ++t) {
          const int8_t* xq = x.q32 + (m0 + t) * x.k + b * kSmallBlock + 4 * s;
#if GGML_VNNI
          sums[t] = _mm256_dpbusd_epi32(sums[t], lo, broadcast4(xq));
          more[t] = _mm256_dpbusd_epi32(more[t], hi, broadcast4(xq + 16));
#else
          // 16-bit sums, the low and high codes apart: 4 steps of 2 products of at most
          // 31 * 127 each stay below 2^15 (both in one sum could reach 63,000 and wrap).
          low16[t] = _mm256_add_epi16(low16[t], _mm256_maddubs_epi16(lo, broadcast4(xq)));
          high16[t] = _mm256_add_epi16(high16[t], _mm256_maddubs_epi16(hi, broadcast4(xq + 16)));
#endif
        }
      }
#if !GGML_VNNI
      for (int t = 0; t < MT; ++t) {
        const __m256i ones = _mm256_set1_epi16(1);
        sums[t] = _mm256_madd_epi16(low16[t], ones);
        more[t] = _mm256_madd_epi16(high16[t], ones);
      }
#endif
    }
    for (int t = 0; t < MT; ++t) {
      const int64_t at = (m0 + t) * nb + b;
      sums[t] = _mm256_add_epi32(sums[t], more[t]);
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[t]), _mm256_mul_ps(d, _mm256_set1_ps(x.d32[at])),
                               acc[t]);
#if GGML_VNNI
      offsets[t] = _mm256_fmadd_ps(d, _mm256_set1_ps(x.s32[at]), offsets[t]);
#else
      if (!kEight) offsets[t] = _mm256_fmadd_ps(d, _mm256_set1_ps(x.s32[at]), offsets[t]);
#endif
    }
  }
  for (int t = 0; t < MT; ++t) {
    _mm256_storeu_ps(out + 8 * t, _mm256_fnmadd_ps(offsets[t], _mm256_set1_ps(kOffset), acc[t]));
  }
}

template <int MT>
RowFn row_function(int type) {
  switch (type) {
    case kQ4_0: return row_q_0<MT, kQ4_0>;
    case kQ5_0: return row_q_0<MT, kQ5_0>;
    case kQ4_1: return row_q_1<MT, false>;
    case kQ5_1: return row_q_1<MT, true>;
    case kQ8_0: return row_q_0<MT, kQ8_0>;
    case kQ4_K: return row_q_k<MT, false>;
    case kQ5_K: return row_q_k<MT, true>;
    case kQ6_K: return row_q6_k<MT>;
    default: return nullptr;
  }
}

RowFn tile_function(int type, int rows) {
  if (rows > kTile) rows = kTile;
  switch (rows) {
    case 1: return row_function<1>(type);
    case 2: return row_function<2>(type);
    case 3: return row_function<3>(type);
    case 4: return row_function<4>(type);
    case 5: return row_function<5>(type);
    case 6: return row_function<6>(type);
    case 7: return row_function<7>(type);
    default: return row_function<8>(type);
  }
}

template <int MT>
GroupFn group_kernel(int type) {
  switch (type) {
    case kQ4_Kx8: return group_q4_k<MT>;
    case kQ6_Kx8: return group_q6_k<MT>;
    case kQ8_0x8: return group_q_0<MT, kQ8_0x8>;
    case kQ5_0x8: return group_q_0<MT, kQ5_0x8>;
    default: return nullptr;
  }
}

GroupFn group_function(int type, int rows) {
  switch (rows < kGroupTile ? rows : kGroupTile) {
    case 1: return group_kernel<1>(type);
#if GGML_GROUP_TILE > 2
    case 2: return group_kernel<2>(type);
    case 3: return group_kernel<3>(type);
#endif
    default: return group_kernel<kGroupTile>(type);
  }
}

}  // namespace GGML_ISA
}  // namespace

#endif  // MINIAPP_GGML_KERNELS
