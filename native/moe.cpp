// A mixture-of-experts feed-forward in one call: for each row of x, the k experts its router
// chose, each weighted, summed: y[r] = sum_j w[r, j] * down_e(silu(gate_e x[r]) * up_e x[r])
// with e = ids[r, j]. Each expert's gate|up and down are GGML weights (ggml_dot.cpp's
// GgmlWeight, gate|up with its SiLU epilogue), read as the file stores them.
//
// Grouped by expert: the rows of a call (a batched step, a verification's rows, a prompt
// chunk) that chose the same expert are gathered and multiplied together, so each chosen
// expert's weights are read once a call, however many rows chose it.
//
// Threads: with at least as many chosen experts as threads, each thread takes whole experts
// (a decode step's 8 of 64 go 4 and 4 on two cores), so no thread waits for another between
// an expert's two products; with fewer, the experts go one at a time, each split over the
// threads by outputs.
//
// Row independence: the GGML kernel gives a row the same bits whatever rows share its call,
// and each row sums its experts in its own choice order at the end, so a row's result never
// depends on the batch, the grouping or the thread (batched rows equal lone runs).
//
// The pure-torch reference is `moe.reference_moe` (tests compare against it).

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <vector>

struct GgmlWeight;  // ggml_dot.cpp

extern "C" int miniapp_ggml_gemm_pre(const GgmlWeight* w, const void* x, int64_t ldx, int x_type,
                                     int64_t m, float* y, const float* pre, int64_t ld_pre,
                                     int threads);

namespace {

constexpr int kFp32 = 0;  // x_type of miniapp_ggml_gemm_pre
// Below this many rows a call routes and combines on one thread.
constexpr int64_t kParallelRows = 16;

// Where each (row, choice) went once the choices are grouped by expert.
struct Grouping {
  std::vector<int64_t> start;  // [n_experts + 1]: each expert's first grouped position
  std::vector<int64_t> row_of;  // [m * k]: the row of x at each grouped position
  std::vector<int64_t> position;  // [m * k]: the grouped position of choice (r, j)
  std::vector<int32_t> active;  // experts chosen at least once, most rows first
};

// A counting sort of the choices by expert, rows ascending within an expert. False if an id
// is out of range.
bool group_by_expert(const int32_t* ids, int64_t m, int64_t k, int64_t n_experts, Grouping& g) {
  g.start.assign(n_experts + 1, 0);
  for (int64_t i = 0; i < m * k; ++i) {
    if (ids[i] < 0 || ids[i] >= n_experts) return false;
    ++g.start[ids[i] + 1];
  }
  for (int64_t e = 0; e < n_experts; ++e) g.start[e + 1] += g.start[e];
  std::vector<int64_t> next(g.start.begin(), g.start.end() - 1);
  g.row_of.resize(m * k);
  g.position.resize(m * k);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t at = next[ids[r * k + j]]++;
      g.row_of[at] = r;
      g.position[r * k + j] = at;
    }
  }
  g.active.clear();
  for (int64_t e = 0; e < n_experts; ++e) {
    if (g.start[e + 1] > g.start[e]) g.active.push_back(static_cast<int32_t>(e));
  }
  // Most rows first: with dynamic scheduling the big ones do not end up last.
  std::stable_sort(g.active.begin(), g.active.end(), [&](int32_t a, int32_t b) {
    return g.start[a + 1] - g.start[a] > g.start[b + 1] - g.start[b];
  });
  return true;
}

// llama.cpp clamps the sum of the chosen weights to the smallest normal fp16 before dividing.
constexpr float kMinWeightSum = 6.103515625e-5f;

// w . x in float64, in a fixed order (16 partial sums, then their sum, then the tail): the
// same for a row whatever else is routed with it, and vectorized (one long chain of
// dependent adds took ~150 us a row for 64 experts of 2048).
__attribute__((target("avx2"))) double dot_double(const float* w, const float* x, int64_t n) {
  __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(),
                    _mm256_setzero_pd()};
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) {
    for (int part = 0; part < 4; ++part) {
      const __m256d wd = _mm256_cvtps_pd(_mm_loadu_ps(w + c + 4 * part));
      const __m256d xd = _mm256_cvtps_pd(_mm_loadu_ps(x + c + 4 * part));
      acc[part] = _mm256_add_pd(acc[part], _mm256_mul_pd(wd, xd));
    }
  }
  const __m256d sum = _mm256_add_pd(_mm256_add_pd(acc[0], acc[1]), _mm256_add_pd(acc[2], acc[3]));
  double lanes[4];
  _mm256_storeu_pd(lanes, sum);
  double dot = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  for (; c < n; ++c) dot += static_cast<double>(w[c]) * x[c];
  return dot;
}

// Row r's choice: the router's logits (float64 dot products in a fixed order, rounded to
// fp32, so a row's logits never depend on its batch), their softmax in fp32 (as torch's
// and llama.cpp's: probabilities that round equal tie), the k most probable experts (ties
// to the lower id), their probabilities as weights, divided by their sum where
// `normalize`. False where no expert could be chosen (a NaN in x).
bool route_row(const float* router, int64_t n_experts, const float* x, int64_t dim, int64_t k,
               bool normalize, int32_t* ids, float* weights, float* probs) {
  float top = -INFINITY;
  for (int64_t e = 0; e < n_experts; ++e) {
    probs[e] = static_cast<float>(dot_double(router + e * dim, x, dim));
    top = std::max(top, probs[e]);
  }
  float total = 0.0f;
  for (int64_t e = 0; e < n_experts; ++e) total += probs[e] = expf(probs[e] - top);
  for (int64_t e = 0; e < n_experts; ++e) probs[e] /= total;
  float chosen = 0.0f;
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < n_experts; ++e) {
      if (probs[e] >= 0.0f && (best < 0 || probs[e] > probs[best])) best = e;
    }
    if (best < 0) return false;
    ids[j] = static_cast<int32_t>(best);
    weights[j] = probs[best];
    chosen += probs[best];
    probs[best] = -1.0f;  // taken
  }
  if (normalize) {
    const float sum = std::max(chosen, kMinWeightSum);
    for (int64_t j = 0; j < k; ++j) weights[j] /= sum;
  }
  return true;
}

}  // namespace

extern "C" {

// Each row's k experts and their weights (see route_row): router fp32 [n_experts, dim],
// x fp32 [m, dim] with row stride ldx; ids int32 [m, k] and weights fp32 [m, k] written.
// Returns 0, or -1 for arguments it does not take (or a row with no expert to choose).
int miniapp_moe_route(const float* router, int64_t n_experts, const float* x, int64_t ldx,
                      int64_t m, int64_t dim, int64_t k, int normalize, int32_t* ids,
                      float* weights, int threads) {
  if (n_experts <= 0 || k <= 0 || k > n_experts || dim <= 0 || m < 0 || ldx < dim) return -1;
  if (!__builtin_cpu_supports("avx2")) return -1;
  int failed = 0;
  const int team = m >= kParallelRows && threads > 1 ? threads : 1;
#pragma omp parallel num_threads(team)
  {
    std::vector<float> probs(n_experts);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m; ++r) {
      if (!route_row(router, n_experts, x + r * ldx, dim, k, normalize != 0, ids + r * k,
                     weights + r * k, probs.data())) {
#pragma omp atomic write
        failed = 1;
      }
    }
  }
  return failed ? -1 : 0;
}

// y [m, dim] = the weighted sum of each row's k chosen experts (see the top of this file).
// gate_up[e]: expert e's gate|up (n = ffn outputs, SiLU-gated); down[e]: its down (n = dim).
// x fp32 [m, dim] with row stride ldx; ids int32 [m, k] in 0..n_experts-1; weights fp32
// [m, k]. Returns 0, or -1 for arguments it does not take (y is then undefined).
int miniapp_moe_ffn(const GgmlWeight* const* gate_up, const GgmlWeight* const* down,
                    int64_t n_experts, int64_t ffn, const float* x, int64_t ldx, int64_t m,
                    int64_t dim, const int32_t* ids, const float* weights, int64_t k, float* y,
                    int threads) {
  if (n_experts <= 0 || ffn <= 0 || dim <= 0 || m < 0 || k <= 0 || ldx < dim) return -1;
  if (m == 0) return 0;
  Grouping g;
  if (!group_by_expert(ids, m, k, n_experts, g)) return -1;
  const int64_t total = m * k;
  // One row: every expert reads x itself. More: each expert's rows gathered side by side.
  std::vector<float> gathered;
  const float* xs = x;
  int64_t ld_xs = ldx;
  if (m > 1) {
    gathered.resize(total * dim);
    for (int64_t at = 0; at < total; ++at) {
      memcpy(&gathered[at * dim], x + g.row_of[at] * ldx, dim * sizeof(float));
    }
    xs = gathered.data();
    ld_xs = dim;
  }
  std::vector<float> hidden(total * ffn), out(total * dim);
  const int64_t n_active = static_cast<int64_t>(g.active.size());
  int failed = 0;
  const auto run = [&](int32_t e, int team) {
    const int64_t first = g.start[e], rows = g.start[e + 1] - first;
    const float* in = m > 1 ? xs + first * ld_xs : xs;
    float* h = &hidden[first * ffn];
    float* o = &out[first * dim];
    if (miniapp_ggml_gemm_pre(gate_up[e], in, ld_xs, kFp32, rows, h, nullptr, 0, team) != 0 ||
        miniapp_ggml_gemm_pre(down[e], h, ffn, kFp32, rows, o, nullptr, 0, team) != 0) {
#pragma omp atomic write
      failed = 1;
    }
  };
  if (threads > 1 && n_active >= threads) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t i = 0; i < n_active; ++i) run(g.active[i], 1);
  } else {
    for (int64_t i = 0; i < n_active; ++i) run(g.active[i], threads);
  }
  if (failed) return -1;
  const int team = m >= kParallelRows && threads > 1 ? threads : 1;
#pragma omp parallel for num_threads(team) schedule(static)
  for (int64_t r = 0; r < m; ++r) {
    float* yr = y + r * dim;
    for (int64_t j = 0; j < k; ++j) {
      const float w = weights[r * k + j];
      const float* o = &out[g.position[r * k + j] * dim];
      if (j == 0) {
        for (int64_t c = 0; c < dim; ++c) yr[c] = w * o[c];
      } else {
        for (int64_t c = 0; c < dim; ++c) yr[c] += w * o[c];
      }
    }
  }
  return 0;
}

}  // extern "C"
