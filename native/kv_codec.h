// The KV cache's storage types, as the engine's cache holds them: their row layouts, the
// rotation of quantized rows, and what attention.cpp and kv_codec.cpp share to read and write
// them (attention reads stored rows in place, never dequantized into a copy first). The
// codecs themselves, and their extern "C" functions, are in kv_codec.cpp.

#pragma once

#include "common.h"

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

constexpr int kMaxHeadDim = 512;

static inline int64_t kv_row_bytes(int type, int64_t d) {
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

static inline bool kv_type_takes(int type, int64_t d) {
  if (kv_row_bytes(type, d) < 0 || d % 8 || d > kMaxHeadDim) return false;
  return type < kKvQ8 || d % kKvBlock == 0;
}

// q8 and q4 store codes in blocks of 32 with their scales: stored rotated, and the attention
// kernel dots such keys with an int8 query.
static constexpr bool quantized_type(int type) { return type == kKvQ8 || type == kKvQ4; }
static inline bool stored_rotated(int type) { return quantized_type(type); }

TARGET_AVX2 static inline float f16_at(const uint8_t* p) {
  uint16_t bits;
  memcpy(&bits, p, sizeof bits);
  return _cvtsh_ss(bits);
}

// Values 8c..8c+7 of a stored row of d values, as fp32.
template <int T>
TARGET_AVX2 static inline __m256 load8(const uint8_t* row, int64_t c, int64_t d) {
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
TARGET_AVX2 static inline void unpack_row(const uint8_t* row, int64_t d, float* out) {
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

// Defined in kv_codec.cpp and used by the other files too: attention.cpp rotates its queries
// and outputs and reads q4 tiles' side tables, decode_layer.cpp stores its new keys and values.
MINIAPP_INTERNAL void rotate_row(float* x, int64_t d);
MINIAPP_INTERNAL TARGET_AVX2 void encode_row(int type, const float* x, int64_t d, uint8_t* out,
                                             bool rotated);
MINIAPP_INTERNAL TARGET_AVX2 void tile_side(const uint8_t* tile, int64_t d, float* scales,
                                            float* lows);
