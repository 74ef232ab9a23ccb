// Decode-shaped attention of the torch engine on the CPU (`miniapp_attend_rows`,
// `miniapp_attend_sequences`, and `attend` for the fused layer): a few query rows, each over
// its own keys, in an order that depends only on that row's keys, reading the KV cache's
// storage types in place (kv_codec.h).
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

#include "kv_codec.h"

namespace {

constexpr int64_t kKeysPerPart = 256;
constexpr int kMaxGroup = 16;  // query heads per kv head

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

}  // namespace

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

}  // extern "C"
