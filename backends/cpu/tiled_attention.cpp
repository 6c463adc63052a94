// Exact causal attention of a blend's selected queries (scattered positions) over one layer's
// contiguous K/V, for x86 CPUs with AVX-512 BF16. Built on first use by cpu_kernels.py.
//
// Why: vLLM's CPU attention takes each run of consecutive selected positions as one request,
// so an isolated query reads the layer's keys alone, about 1.5x a full prefill's cost per
// query-key pair. Here queries are grouped in tiles of consecutive *selected* queries, whatever
// the gaps between them: one tile's rows (queries x the query heads of one KV head) read each
// key block once, with the two products in oneDNN's bf16 brgemm. The exact mask comes from
// each row's own position (keys after it get -inf), so gaps cost nothing but the few keys
// between a tile's first and last query. With a sliding window a row also masks the keys before
// its window, and a tile starts at the block holding its first query's window: a windowed
// layer reads about a window of keys per query, not the whole prompt.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using bf16 = at::BFloat16;
using Vec = at::vec::Vectorized<float>;
constexpr int64_t BLOCK_N = 256;  // keys per block
// A tile's last block is cut to the keys up to its last query, rounded up to this: a full
// block would compute and mask up to 255 keys more for every row (~20% of the work at 1k keys).
constexpr int64_t KEY_STEP = 32;

// bf16 pairs moved as one 32-bit word; may_alias: they are read from and written to bf16 storage
typedef uint32_t __attribute__((__may_alias__)) pair_t;
typedef uint16_t __attribute__((__may_alias__)) half_t;

// Rows 0..used-1 of k [T, Hkv, D] -> out[h][b]: one block of BLOCK_N keys of KV head h in VNNI
// layout [D/2][BLOCK_N][2] (pairs of dims side by side: the first product reduces over dims),
// that is a transpose of the block's [BLOCK_N][D/2] dim pairs; rows past `used` are zeros.
void pack_keys(const bf16* k, bf16* out, int64_t used, int64_t blocks, int64_t kv_heads,
               int64_t dim) {
  const int64_t pairs = dim / 2;
  at::parallel_for(0, kv_heads * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t job = begin; job < end; ++job) {
      const int64_t h = job / blocks, b = job % blocks;
      pair_t* dst = reinterpret_cast<pair_t*>(out + job * dim * BLOCK_N);
      for (int64_t j = 0; j < BLOCK_N; ++j) {
        const int64_t t = b * BLOCK_N + j;
        if (t < used) {
          const pair_t* row = reinterpret_cast<const pair_t*>(k + (t * kv_heads + h) * dim);
          for (int64_t i = 0; i < pairs; ++i) dst[i * BLOCK_N + j] = row[i];
        } else {
          for (int64_t i = 0; i < pairs; ++i) dst[i * BLOCK_N + j] = 0;
        }
      }
    }
  });
}

// Rows 0..used-1 of v [T, Hkv, D] -> out[h][b] in VNNI layout [BLOCK_N/2][D][2] (pairs of
// keys side by side: the second product reduces over keys), an interleave of row pairs.
void pack_values(const bf16* v, bf16* out, int64_t used, int64_t blocks, int64_t kv_heads,
                 int64_t dim) {
  const std::vector<uint16_t> zeros(dim, 0);
  at::parallel_for(0, kv_heads * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t job = begin; job < end; ++job) {
      const int64_t h = job / blocks, b = job % blocks;
      pair_t* dst = reinterpret_cast<pair_t*>(out + job * dim * BLOCK_N);
      auto row = [&](int64_t t) -> const half_t* {
        return t < used ? reinterpret_cast<const half_t*>(v + (t * kv_heads + h) * dim)
                        : zeros.data();
      };
      for (int64_t p = 0; p < BLOCK_N / 2; ++p) {
        const half_t* even = row(b * BLOCK_N + 2 * p);
        const half_t* odd = row(b * BLOCK_N + 2 * p + 1);
        pair_t* pair_row = dst + p * dim;
        for (int64_t d = 0; d < dim; ++d) pair_row[d] = uint32_t(even[d]) | (uint32_t(odd[d]) << 16);
      }
    }
  });
}

// Contiguous ranges of jobs, one per thread, of about equal cost (rows x keys read): the
// late tiles read many more keys than the early ones.
std::vector<int64_t> balanced_ranges(const std::vector<double>& cost, int64_t threads) {
  const int64_t jobs = static_cast<int64_t>(cost.size());
  double total = 0;
  for (double c : cost) total += c;
  std::vector<int64_t> bounds(threads + 1, jobs);
  bounds[0] = 0;
  double acc = 0;
  int64_t next = 1;
  for (int64_t j = 0; j < jobs && next < threads; ++j) {
    acc += cost[j];
    while (next < threads && acc >= total * next / threads) bounds[next++] = j + 1;
  }
  return bounds;
}

}  // namespace

// q [N, Hq, D] bf16 at sorted positions [N] (int64); k, v [T, Hkv, D] bf16, row t = position t.
// Returns [N, Hq, D] bf16: for each query, softmax(q k^T * scale) v over keys 0..its position
// (grouped-query heads: query head i reads KV head i / (Hq / Hkv)); with window > 0, over keys
// p - window + 1 .. p only (HF's and vLLM's sliding window). Softmax and accumulation in fp32;
// the probabilities are rounded to bf16 for the second product, as vLLM's kernel does.
torch::Tensor tiled_attention(torch::Tensor q, torch::Tensor positions, torch::Tensor k,
                              torch::Tensor v, double scale, int64_t tile_queries,
                              int64_t window) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16,
              "tiled_attention: q, k and v must be bfloat16");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(),
              "tiled_attention: q [N, Hq, D], k and v [T, Hkv, D] expected");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(),
              "tiled_attention: contiguous tensors expected");
  const int64_t num_q = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t num_keys = k.size(0), kv_heads = k.size(1);
  TORCH_CHECK(k.size(2) == dim && dim % 32 == 0, "tiled_attention: head dim must be a multiple of 32");
  TORCH_CHECK(heads % kv_heads == 0, "tiled_attention: query heads must be a multiple of KV heads");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == num_q, "tiled_attention: positions [N]");
  TORCH_CHECK(window >= 0, "tiled_attention: window must be >= 0 (0: none), got ", window);
  auto out = torch::empty_like(q);
  if (num_q == 0) return out;
  auto pos_tensor = positions.to(at::kLong).contiguous();
  const int64_t* pos = pos_tensor.data_ptr<int64_t>();
  for (int64_t i = 0; i < num_q; ++i) {
    TORCH_CHECK(pos[i] >= 0 && pos[i] < num_keys, "tiled_attention: position ", pos[i],
                " outside the ", num_keys, " keys");
    TORCH_CHECK(i == 0 || pos[i] > pos[i - 1], "tiled_attention: positions must increase");
  }
  const int64_t group = heads / kv_heads;
  const int64_t used = pos[num_q - 1] + 1;
  const int64_t blocks = (used + BLOCK_N - 1) / BLOCK_N;
  auto packed_k = torch::empty({kv_heads, blocks, dim * BLOCK_N}, k.options());
  auto packed_v = torch::empty({kv_heads, blocks, dim * BLOCK_N}, v.options());
  pack_keys(k.data_ptr<bf16>(), packed_k.data_ptr<bf16>(), used, blocks, kv_heads, dim);
  pack_values(v.data_ptr<bf16>(), packed_v.data_ptr<bf16>(), used, blocks, kv_heads, dim);

  // tiles of at most tile_queries queries, all about the same size: a short last tile leaves
  // a thread idle when there are few tiles (20 queries would make tiles of 16 and 4)
  const int64_t most = std::max<int64_t>(1, tile_queries);
  const int64_t tiles = (num_q + most - 1) / most;
  const int64_t tile = (num_q + tiles - 1) / tiles;
  std::vector<double> cost(tiles * kv_heads);
  for (int64_t j = 0; j < tiles * kv_heads; ++j) {
    const int64_t lo = (j / kv_heads) * tile, hi = std::min(num_q, lo + tile);
    const int64_t keys = pos[hi - 1] + 1 - (window > 0 ? std::max<int64_t>(0, pos[lo] - window + 1) : 0);
    cost[j] = double(hi - lo) * double(keys + KEY_STEP);
  }
  const int64_t threads = at::get_num_threads();
  const std::vector<int64_t> bounds = balanced_ranges(cost, threads);

  const bf16* q_data = q.data_ptr<bf16>();
  bf16* out_data = out.data_ptr<bf16>();
  const bf16* k_data = packed_k.data_ptr<bf16>();
  const bf16* v_data = packed_v.data_ptr<bf16>();
  const int64_t max_rows = tile * group;
  const float sc = static_cast<float>(scale);
  const float ninf = -std::numeric_limits<float>::infinity();
  constexpr int64_t W = Vec::size();
  static_assert(KEY_STEP % W == 0, "a cut block must be whole vectors");

  at::parallel_for(0, threads, 1, [&](int64_t first_thread, int64_t last_thread) {
    std::vector<bf16> rows_q(max_rows * dim);
    std::vector<float> scores(max_rows * BLOCK_N);
    std::vector<bf16> probs(max_rows * BLOCK_N);
    std::vector<float> acc(max_rows * dim);
    std::vector<float> run_max(max_rows), run_sum(max_rows);
    std::vector<int64_t> row_pos(max_rows);
    float lanes[W];
    for (int64_t th = first_thread; th < last_thread; ++th) {
      for (int64_t job = bounds[th]; job < bounds[th + 1]; ++job) {
        const int64_t h = job % kv_heads;
        const int64_t lo = (job / kv_heads) * tile, hi = std::min(num_q, lo + tile);
        const int64_t m = (hi - lo) * group;
        // row (i - lo) * group + g: query i, query head h * group + g
        for (int64_t i = lo; i < hi; ++i) {
          const bf16* src = q_data + (i * heads + h * group) * dim;
          std::copy(src, src + group * dim, rows_q.data() + (i - lo) * group * dim);
          std::fill_n(row_pos.data() + (i - lo) * group, group, pos[i]);
        }
        std::fill_n(acc.data(), m * dim, 0.f);
        std::fill_n(run_max.data(), m, ninf);
        std::fill_n(run_sum.data(), m, 0.f);
        const int64_t first_pos = pos[lo], last_pos = pos[hi - 1];
        // the block holding the first key any row of the tile sees
        const int64_t first_key = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
        for (int64_t n0 = first_key / BLOCK_N * BLOCK_N; n0 <= last_pos; n0 += BLOCK_N) {
          const int64_t b = n0 / BLOCK_N;
          // keys n0..n0+width-1 of this block: all of it, or up to the tile's last query
          const int64_t width =
              std::min(BLOCK_N, (last_pos - n0 + 1 + KEY_STEP - 1) / KEY_STEP * KEY_STEP);
          at::native::cpublas::brgemm(m, width, dim, dim, BLOCK_N, BLOCK_N, false,
                                      rows_q.data(), k_data + (h * blocks + b) * dim * BLOCK_N,
                                      scores.data());
          const bool masked = window > 0 || n0 + width - 1 > first_pos;
          for (int64_t r = 0; r < m; ++r) {
            float* row = scores.data() + r * BLOCK_N;
            bf16* prob = probs.data() + r * BLOCK_N;
            const int64_t visible =
                masked ? std::clamp<int64_t>(row_pos[r] - n0 + 1, 0, width) : width;
            // keys before the row's window: the first `hidden` of the block
            const int64_t hidden =
                window > 0 ? std::clamp<int64_t>(row_pos[r] - window + 1 - n0, 0, width) : 0;
            if (visible <= hidden) {  // every key of the block is outside this row's view
              std::fill_n(prob, width, bf16(0.f));
              continue;
            }
            std::fill(row, row + hidden, ninf);
            std::fill(row + visible, row + width, ninf);
            // online softmax: rescale what was summed so far to the new running maximum
            Vec vmax(ninf);
            for (int64_t c = 0; c < width; c += W) vmax = at::vec::maximum(vmax, Vec::loadu(row + c));
            vmax.store(lanes);
            const float block_max = *std::max_element(lanes, lanes + W) * sc;
            const float new_max = std::max(run_max[r], block_max);
            const float alpha = std::exp(run_max[r] - new_max);
            const Vec vscale(sc), vshift(new_max);
            Vec vsum(0.f);
            for (int64_t c = 0; c < width; c += W) {
              const Vec e = (Vec::loadu(row + c) * vscale - vshift).exp_u20();
              vsum = vsum + e;
              const __m256bh half = _mm512_cvtneps_pbh(__m512(e));
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(prob + c),
                                  reinterpret_cast<const __m256i&>(half));
            }
            vsum.store(lanes);
            float block_sum = 0.f;
            for (int64_t l = 0; l < W; ++l) block_sum += lanes[l];
            run_sum[r] = run_sum[r] * alpha + block_sum;
            run_max[r] = new_max;
            if (alpha != 1.f) {
              float* acc_row = acc.data() + r * dim;
              const Vec valpha(alpha);
              for (int64_t d = 0; d < dim; d += W) (Vec::loadu(acc_row + d) * valpha).store(acc_row + d);
            }
          }
          at::native::cpublas::brgemm(m, dim, width, BLOCK_N, dim, dim, true, probs.data(),
                                      v_data + (h * blocks + b) * dim * BLOCK_N, acc.data());
        }
        for (int64_t r = 0; r < m; ++r) {
          const int64_t i = lo + r / group, g = r % group;
          const float inv = 1.f / run_sum[r];
          bf16* dst = out_data + (i * heads + h * group + g) * dim;
          const float* acc_row = acc.data() + r * dim;
          for (int64_t d = 0; d < dim; ++d) dst[d] = bf16(acc_row[d] * inv);
        }
      }
    }
    at::native::cpublas::brgemm_release();
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("tiled_attention", &tiled_attention,
        "exact causal attention of queries at sorted positions over contiguous bf16 K/V, "
        "optionally within a sliding window");
}
