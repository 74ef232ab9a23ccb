// The codecs of the KV cache's storage types (layouts in kv_codec.h): fp32 rows into their
// stored form (f16, bf16, q8, q4, and q4 tiles for keys) and back, for the engine's cache
// (engine/kv/codec.py, through native/attention.py). Decoding is exact in fp32, so these, the
// attention kernel and the torch reference agree bit for bit on what a stored row holds.

#include "kv_codec.h"

namespace {

constexpr float kF16Max = 65504.0f;

// Codec calls add kKvRotated to a type for rows stored rotated (the quantized types).
constexpr int kKvRotated = 8;

TARGET_AVX2 inline void put_f16(uint8_t* p, float x) {
  x = x > kF16Max ? kF16Max : (x < -kF16Max ? -kF16Max : x);
  const uint16_t bits = _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT);
  memcpy(p, &bits, sizeof bits);
}

template <int T>
TARGET_AVX2 void decode_row(const uint8_t* row, int64_t d, float* out, bool rotated) {
  unpack_row<T>(row, d, out);
  if (rotated) rotate_row(out, d);
}

}  // namespace

// ------------------------------------------------- shared with other files (see kv_codec.h)

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

namespace {

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

}  // namespace

extern "C" {

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

}  // extern "C"
