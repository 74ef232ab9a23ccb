// LoRA updates of a projection, applied unmerged for the rows of a call that carry adapters:
// the rows of one batch may each run with their own adapters, or none. For each adapter
// the call uses, its A and B are read once for all of its rows (the gathered low-rank
// product of Punica's BGMV): u = A x per row, then delta += s B u. B is kept in blocks of
// 32 outputs, each [rank][32], so that B u sums whole vectors of outputs, rank by rank, with
// no horizontal sums (a rank is 8 to 64 values: too short for a dot product to pay).
//
// The delta goes to the GEMM as its `pre` term, added to W x before the epilogue: a gated
// feed-forward needs silu(gate + delta_gate) * (up + delta_up), which no sum after the
// epilogue can give. Rows without an adapter get -0.0, which leaves every value bit for bit
// as it was (x + -0.0 == x, signed zeros included). Every row is computed on its own, in its
// own adapters' order, whatever else the call holds: a row comes out the same alone or in a
// batch, through the fused layer or layer by layer.

#include "common.h"

extern "C" {

constexpr int kMaxLoraParts = 3;  // Q, K and V of a fused projection; gate and up
constexpr int kLoraProjections = 4;  // Q|K|V, the output projection, gate|up, down
constexpr int64_t kOutBlock = 32;  // outputs of a block of B (lora.py's OUT_BLOCK)
enum LoraType { kLoraF32 = 0, kLoraBF16 = 1, kLoraF16 = 2 };

// One adapter's update of one projection: u = A x, then each part p adds
// factor[p] * B_p u[rank_offset[p] .. + part_rank[p]] to outputs out_offset[p] .. + out_count[p].
struct LoraUpdate {
  const void* a;  // [rank, k] (the parts' A stacked), or null: the adapter leaves it alone
  int64_t rank, k;
  int32_t type;  // of A and B alike (LoraType)
  int32_t n_parts;
  // B in blocks of kOutBlock outputs: [ceil(out_count / kOutBlock)][part_rank][kOutBlock]
  // each, a block's rows past out_count zero.
  const void* b[kMaxLoraParts];
  int64_t out_offset[kMaxLoraParts], out_count[kMaxLoraParts];
  int64_t rank_offset[kMaxLoraParts], part_rank[kMaxLoraParts];
  float factor[kMaxLoraParts];  // alpha / rank of the part, or 1 without an alpha
};

// The rows of a call that run with one adapter at one scale, as their j-th adapter (groups
// come in order of j, so every row adds its adapters' updates in its own order).
struct LoraGroup {
  const LoraUpdate* updates;  // the adapter's, [layers][kLoraProjections]
  float scale;
  int32_t position;  // j: groups of one position hold different rows
  const int64_t* rows;  // indices of the call's rows
  int64_t n_rows;
};

struct LoraCall {
  const LoraGroup* groups;
  int64_t n_groups;
  int64_t layer;
};

}  // extern "C"

namespace {

// Below this many bytes of A and B a second thread costs more than it saves.
constexpr int64_t kMinParallelLoraBytes = 1 << 17;
constexpr int64_t kMinParallelLoraMacs = 1 << 18;
// From this many rows of a group per thread, threads take rows (each its own, whole, each
// thread reading all of A and B: a prompt chunk, where the sums outweigh the bytes); below
// it, they take ranks and outputs of every row (a batch's decode rows: each byte read once).
constexpr int64_t kRowsPerThread = 16;

inline int64_t type_bytes(int type) { return type == kLoraF32 ? 4 : 2; }

// How far ahead of its reads a stream of A asks for its lines (prefetches past the end of
// a tensor are harmless: they never fault).
constexpr int64_t kPrefetchBytes = 1024;

TARGET_AVX2 inline __m256 load8(const void* w, int type, int64_t i) {
  if (type == kLoraF32) return _mm256_loadu_ps(static_cast<const float*>(w) + i);
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(
      static_cast<const uint16_t*>(w) + i));
  if (type == kLoraF16) return _mm256_cvtph_ps(half);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

TARGET_AVX2 inline float load1(const void* w, int type, int64_t i) {
  if (type == kLoraF32) return static_cast<const float*>(w)[i];
  const uint16_t bits = static_cast<const uint16_t*>(w)[i];
  if (type == kLoraF16) return _cvtsh_ss(bits);
  uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  memcpy(&value, &wide, sizeof value);
  return value;
}

// Four 8-lane sums (s[q] holding columns 32c + 8q ..), added in one fixed order.
TARGET_AVX2 inline float reduce(const __m256 s[4]) {
  __m256 sum = _mm256_add_ps(_mm256_add_ps(s[0], s[1]), _mm256_add_ps(s[2], s[3]));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sum);
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
         ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

// w[0..n) . x[0..n), w of `type`: four 8-lane sums, added in one fixed order.
TARGET_AVX2 float dot(const void* w, int type, const float* x, int64_t n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  int64_t i = 0;
  const char* ahead = static_cast<const char*>(w) + kPrefetchBytes;
  const int64_t step = 32 * type_bytes(type);
  for (; i + 32 <= n; i += 32, ahead += step) {
    _mm_prefetch(ahead, _MM_HINT_T0);
    if (step > 64) _mm_prefetch(ahead + 64, _MM_HINT_T0);
    s0 = _mm256_fmadd_ps(load8(w, type, i), _mm256_loadu_ps(x + i), s0);
    s1 = _mm256_fmadd_ps(load8(w, type, i + 8), _mm256_loadu_ps(x + i + 8), s1);
    s2 = _mm256_fmadd_ps(load8(w, type, i + 16), _mm256_loadu_ps(x + i + 16), s2);
    s3 = _mm256_fmadd_ps(load8(w, type, i + 24), _mm256_loadu_ps(x + i + 24), s3);
  }
  for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(load8(w, type, i), _mm256_loadu_ps(x + i), s0);
  const __m256 sums[4] = {s0, s1, s2, s3};
  float total = reduce(sums);
  for (; i < n; ++i) total += load1(w, type, i) * x[i];
  return total;
}

TARGET_AVX2 void down_project_tile(const LoraUpdate& up, const LoraGroup& g, const float* x,
                                   int64_t ldx, float* u, int64_t r0, int64_t r1, int64_t i0,
                                   int64_t i1) {
  const int64_t row_bytes = up.k * type_bytes(up.type), k = up.k;
  for (int64_t r = r0; r < r1; ++r) {
    const void* a = static_cast<const uint8_t*>(up.a) + r * row_bytes;
    int64_t i = i0;
    for (; i + 4 <= i1 && k % 32 == 0; i += 4) {
      const float* xs[4];
      for (int j = 0; j < 4; ++j) xs[j] = x + g.rows[i + j] * ldx;
      __m256 s[4][4];
      for (int j = 0; j < 4; ++j) {
        for (int q = 0; q < 4; ++q) s[j][q] = _mm256_setzero_ps();
      }
      for (int64_t c = 0; c < k; c += 32) {
        _mm_prefetch(static_cast<const char*>(a) + c * type_bytes(up.type) + kPrefetchBytes,
                     _MM_HINT_T0);
        for (int q = 0; q < 4; ++q) {
          const __m256 w = load8(a, up.type, c + 8 * q);
          for (int j = 0; j < 4; ++j) {
            s[j][q] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xs[j] + c + 8 * q), s[j][q]);
          }
        }
      }
      for (int j = 0; j < 4; ++j) u[(i + j) * up.rank + r] = reduce(s[j]);
    }
    for (; i < i1; ++i) u[i * up.rank + r] = dot(a, up.type, x + g.rows[i] * ldx, k);
  }
}

// u[i][r] = A[r] . x[rows[i]] for r in [r0, r1) and the group's rows i in [i0, i1), a tile of
// rows at a time (their x stays in cache while A's rows pass). Up to four rows share each
// converted chunk of A; every row's sum runs in the same order as `dot` (a row alone gives
// the same bits).
TARGET_AVX2 void down_project(const LoraUpdate& up, const LoraGroup& g, const float* x, int64_t ldx,
                              float* u, int64_t r0, int64_t r1, int64_t i0, int64_t i1) {
  constexpr int64_t kTileRows = 32;
  for (int64_t t0 = i0; t0 < i1; t0 += kTileRows) {
    down_project_tile(up, g, x, ldx, u, r0, r1, t0, t0 + kTileRows < i1 ? t0 + kTileRows : i1);
  }
}

// delta[rows[i]][out_offset + o] += s_p * sum over r of B_p[o][r] u[i][rank_offset + r], for the
// outputs [o0, o1) of all parts together (numbered in part order) and the group's rows i in
// [i0, i1). B comes in blocks of kOutBlock outputs, each [rank][kOutBlock] (see LoraUpdate):
// a block is one contiguous read (the data comes from memory, evicted by the base weights
// since the last step, and a plain stream is what the hardware prefetches best), and its
// sums stay in registers while the ranks go by, each sum adding its terms in the order of r.
TARGET_AVX2 void up_project(const LoraUpdate& up, const LoraGroup& g, const float* u, float* delta,
                            int64_t ld_delta, int64_t o0, int64_t o1, int64_t i0, int64_t i1) {
  int64_t first = 0;  // the part's first output in the numbering
  for (int p = 0; p < up.n_parts; ++p) {
    const int64_t count = up.out_count[p], rank = up.part_rank[p];
    const int64_t lo = (o0 > first ? o0 : first) - first;
    const int64_t hi = (o1 < first + count ? o1 : first + count) - first;
    first += count;
    if (lo >= hi) continue;
    const float scale = g.scale * up.factor[p];
    const int64_t block_bytes = rank * kOutBlock * type_bytes(up.type);
    for (int64_t b = lo / kOutBlock; b * kOutBlock < hi; ++b) {
      const void* block = static_cast<const uint8_t*>(up.b[p]) + b * block_bytes;
      for (int64_t at = 0; at < block_bytes; at += 64) {  // a block further on, on its way
        _mm_prefetch(static_cast<const char*>(block) + kPrefetchBytes + at, _MM_HINT_T0);
      }
      const int64_t from = b * kOutBlock > lo ? b * kOutBlock : lo;
      const int64_t to = (b + 1) * kOutBlock < hi ? (b + 1) * kOutBlock : hi;
      for (int64_t i = i0; i < i1; ++i) {
        const float* ui = u + i * up.rank + up.rank_offset[p];
        __m256 sum[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                         _mm256_setzero_ps()};
        for (int64_t r = 0; r < rank; ++r) {
          const __m256 ur = _mm256_set1_ps(ui[r]);
          for (int q = 0; q < 4; ++q) {
            sum[q] = _mm256_fmadd_ps(ur, load8(block, up.type, r * kOutBlock + 8 * q), sum[q]);
          }
        }
        alignas(32) float sums[kOutBlock];
        for (int q = 0; q < 4; ++q) {
          _mm256_store_ps(sums + 8 * q, _mm256_mul_ps(_mm256_set1_ps(scale), sum[q]));
        }
        float* out = delta + g.rows[i] * ld_delta + up.out_offset[p];
        for (int64_t o = from; o < to; ++o) out[o] += sums[o - b * kOutBlock];
      }
    }
  }
}

int64_t update_outputs(const LoraUpdate& up) {
  int64_t n = 0;
  for (int p = 0; p < up.n_parts; ++p) n += up.out_count[p];
  return n;
}

bool update_fits(const LoraUpdate& up, int64_t k, int64_t n_out) {
  if (up.k != k || up.rank < 1 || up.n_parts < 1 || up.n_parts > kMaxLoraParts) return false;
  if (up.type != kLoraF32 && up.type != kLoraBF16 && up.type != kLoraF16) return false;
  for (int p = 0; p < up.n_parts; ++p) {
    if (!up.b[p] || up.out_offset[p] < 0 || up.out_offset[p] + up.out_count[p] > n_out) return false;
    if (up.rank_offset[p] < 0 || up.rank_offset[p] + up.part_rank[p] > up.rank) return false;
  }
  return true;
}

// One group's update of the projection, on up to `threads` threads (u: its own scratch).
void run_group(const LoraGroup& g, const LoraCall* call, int projection, const float* x,
               int64_t ldx, float* u, float* delta, int64_t ld_delta, int threads) {
  const LoraUpdate& up = g.updates[call->layer * kLoraProjections + projection];
  if (!up.a || g.n_rows == 0) return;
  const int64_t outputs = update_outputs(up);
  const int64_t bytes = (up.rank * up.k + outputs * up.rank) * type_bytes(up.type);
  const int64_t n = g.n_rows, macs = n * up.rank * (up.k + outputs);
  const int team = bytes < kMinParallelLoraBytes && macs < kMinParallelLoraMacs ? 1 : threads;
  if (team <= 1) {
    down_project(up, g, x, ldx, u, 0, up.rank, 0, n);
    up_project(up, g, u, delta, ld_delta, 0, outputs, 0, n);
  } else if (n >= kRowsPerThread * team) {
#pragma omp parallel num_threads(team)
    {
      const int64_t t = omp_get_thread_num(), count = omp_get_num_threads();
      const int64_t i0 = n * t / count, i1 = n * (t + 1) / count;
      down_project(up, g, x, ldx, u, 0, up.rank, i0, i1);
      up_project(up, g, u, delta, ld_delta, 0, outputs, i0, i1);
    }
  } else {
#pragma omp parallel num_threads(team)
    {
      const int64_t t = omp_get_thread_num(), count = omp_get_num_threads();
      down_project(up, g, x, ldx, u, up.rank * t / count, up.rank * (t + 1) / count, 0, n);
#pragma omp barrier
      // Whole blocks of B to each thread (parts hold whole blocks where their outputs are
      // multiples of kOutBlock, as every model's are).
      const auto split = [&](int64_t c) {
        return c == count ? outputs : outputs * c / count / kOutBlock * kOutBlock;
      };
      up_project(up, g, u, delta, ld_delta, split(t), split(t + 1), 0, n);
    }
  }
}

}  // namespace

extern "C" {

// delta [m, n_out] (row stride ld_delta) for x [m, k] (fp32, row stride ldx): every row's
// adapters' updates of projection `projection` (0 Q|K|V, 1 output, 2 gate|up, 3 down) of
// the call's layer, and -0.0 where a row has none. Returns 1 if any row has an update, 0 if
// none does (delta is then all -0.0 and the GEMM may go without it), -1 for arguments it
// does not take.
int miniapp_lora_delta(const LoraCall* call, int projection, const float* x, int64_t ldx,
                       int64_t k, int64_t m, float* delta, int64_t ld_delta, int64_t n_out,
                       int threads) {
  if (!cpu_has(kIsaAvx2) || projection < 0 || projection >= kLoraProjections) return -1;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t o = 0; o < n_out; ++o) delta[i * ld_delta + o] = -0.0f;
  }
  int64_t max_work = 0;
  bool any = false;
  for (int64_t j = 0; j < call->n_groups; ++j) {
    const LoraGroup& g = call->groups[j];
    const LoraUpdate& up = g.updates[call->layer * kLoraProjections + projection];
    if (!up.a || g.n_rows == 0) continue;
    if (!update_fits(up, k, n_out)) return -1;
    for (int64_t i = 0; i < g.n_rows; ++i) {
      if (g.rows[i] < 0 || g.rows[i] >= m) return -1;
    }
    const int64_t work = g.n_rows * up.rank;
    max_work = work > max_work ? work : max_work;
    any = true;
  }
  if (!any) return 0;
  float* u = static_cast<float*>(malloc(sizeof(float) * max_work * call->n_groups));
  if (!u) return -1;
  for (int64_t first = 0; first < call->n_groups;) {
    // A wave: the groups of one position, each on rows of its own.
    int64_t last = first + 1;
    while (last < call->n_groups && call->groups[last].position == call->groups[first].position) {
      ++last;
    }
    if (last - first > 1 && threads > 1) {  // several adapters: one to each thread
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
      for (int64_t j = first; j < last; ++j) {
        run_group(call->groups[j], call, projection, x, ldx, u + j * max_work, delta, ld_delta,
                  1);
      }
    } else {
      for (int64_t j = first; j < last; ++j) {
        run_group(call->groups[j], call, projection, x, ldx, u + j * max_work, delta, ld_delta,
                  threads);
      }
    }
    first = last;
  }
  free(u);
  return 1;
}

}  // extern "C"
