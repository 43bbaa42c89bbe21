// Native CPU kernels for gnncompile's P and E primitives.
//
// spmm:   out[v, h, :] = sum_{e in row v} w[e, h] * x[col[e], h, :]     (CSR by destination)
// sddmm:  w[e, h]      = <a[row(e), h, :], b[col[e], h, :]>
//
// Why a kernel of our own: SpMM on this class of machine is bound by the random row reads of x,
// not by DRAM bandwidth (see PERF_NOTES.md). Two things buy locality:
//   * feature tiling: the columns of x are processed in tiles whose |V| x tile slab fits in the
//     last-level cache, so repeated reads of a hub's row hit in cache;
//   * load balance by edges: rows are cut into blocks of equal nnz (not equal rows), so power-law
//     graphs keep both threads busy.
// Indices are int32 when |V| < 2^31 (half the index traffic of int64). Accumulation is in
// registers/L1 per destination row; every output row is written exactly once (no atomics, no
// zero-fill pass), and the kernel is deterministic (fixed summation order per row).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <vector>

namespace {

// Row blocks with roughly equal work (edges + rows), computed once per call: O(blocks log V).
std::vector<int64_t> balanced_row_blocks(const int64_t* indptr, int64_t rows, int64_t nblocks) {
  std::vector<int64_t> bounds(nblocks + 1, rows);
  bounds[0] = 0;
  const int64_t total = indptr[rows] + rows;
  for (int64_t b = 1; b < nblocks; ++b) {
    const int64_t target = total * b / nblocks;
    // smallest r with indptr[r] + r >= target
    int64_t lo = bounds[b - 1], hi = rows;
    while (lo < hi) {
      int64_t mid = (lo + hi) / 2;
      if (indptr[mid] + mid < target) lo = mid + 1; else hi = mid;
    }
    bounds[b] = lo;
  }
  return bounds;
}

template <typename scalar_t, typename index_t, int TILE>
inline void spmm_row_tile(const int64_t* indptr, const index_t* col, const scalar_t* w, int64_t wstride,
                          const scalar_t* x, int64_t ld, scalar_t* out_row, int64_t r, int64_t c0, int64_t width) {
  // width <= TILE; accumulate in a local buffer the compiler keeps in vector registers.
  scalar_t acc[TILE];
  for (int64_t c = 0; c < width; ++c) acc[c] = 0;
  const int64_t beg = indptr[r], end = indptr[r + 1];
  for (int64_t e = beg; e < end; ++e) {
    if (e + 4 < end) __builtin_prefetch(x + (int64_t)col[e + 4] * ld + c0, 0, 0);
    const scalar_t* xr = x + (int64_t)col[e] * ld + c0;
    const scalar_t we = w ? w[e * wstride] : scalar_t(1);
#pragma omp simd
    for (int64_t c = 0; c < width; ++c) acc[c] += we * xr[c];
  }
  for (int64_t c = 0; c < width; ++c) out_row[c] = acc[c];
}

template <typename scalar_t, typename index_t, int W>
inline void spmm_row_fixed(const int64_t* indptr, const index_t* col, const scalar_t* w, int64_t wstride,
                           const scalar_t* x, int64_t ld, scalar_t* out_row, int64_t r, int64_t c0) {
  scalar_t acc[W] = {};
  const int64_t beg = indptr[r], end = indptr[r + 1];
  for (int64_t e = beg; e < end; ++e) {
    if (e + 4 < end) __builtin_prefetch(x + (int64_t)col[e + 4] * ld + c0, 0, 0);
    const scalar_t* xr = x + (int64_t)col[e] * ld + c0;
    const scalar_t we = w ? w[e * wstride] : scalar_t(1);
#pragma omp simd
    for (int c = 0; c < W; ++c) acc[c] += we * xr[c];
  }
#pragma omp simd
  for (int c = 0; c < W; ++c) out_row[c] = acc[c];
}

template <typename scalar_t, typename index_t>
void spmm_impl(const int64_t* indptr, const index_t* col, const scalar_t* w, int64_t heads,
               const scalar_t* x, scalar_t* out, int64_t rows, int64_t n_src, int64_t head_dim,
               int64_t tile) {
  constexpr int TILE = 64;  // max columns accumulated at once (registers / L1)
  const int64_t ld = heads * head_dim;
  const int64_t threads = at::get_num_threads();
  const int64_t nblocks = std::max<int64_t>(1, std::min<int64_t>(rows, threads * 16));
  std::vector<int64_t> bounds = balanced_row_blocks(indptr, rows, nblocks);
  // Outer loop over cache tiles of the feature dimension (within one head for multi-head
  // weights, since each head has its own edge weights).
  for (int64_t h = 0; h < heads; ++h) {
    const scalar_t* wh = w ? w + h : nullptr;
    for (int64_t t0 = 0; t0 < head_dim; t0 += tile) {
      const int64_t t1 = std::min(head_dim, t0 + tile);
      at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) {
          for (int64_t r = bounds[b]; r < bounds[b + 1]; ++r) {
            scalar_t* orow = out + r * ld + h * head_dim;
            for (int64_t c0 = t0; c0 < t1; c0 += TILE) {
              const int64_t width = std::min<int64_t>(TILE, t1 - c0);
              const int64_t xc = h * head_dim + c0;
              // Exact-width instantiations let the compiler fully unroll the common widths.
              switch (width) {
                case 8: spmm_row_fixed<scalar_t, index_t, 8>(indptr, col, wh, heads, x, ld, orow + c0, r, xc); break;
                case 16: spmm_row_fixed<scalar_t, index_t, 16>(indptr, col, wh, heads, x, ld, orow + c0, r, xc); break;
                case 32: spmm_row_fixed<scalar_t, index_t, 32>(indptr, col, wh, heads, x, ld, orow + c0, r, xc); break;
                case 64: spmm_row_fixed<scalar_t, index_t, 64>(indptr, col, wh, heads, x, ld, orow + c0, r, xc); break;
                default: spmm_row_tile<scalar_t, index_t, TILE>(indptr, col, wh, heads, x, ld, orow + c0, r, xc, width);
              }
            }
          }
        }
      });
    }
  }
}

template <typename scalar_t, typename index_t>
void sddmm_impl(const int64_t* indptr, const index_t* col, const scalar_t* a, const scalar_t* b,
                scalar_t* w, int64_t rows, int64_t heads, int64_t head_dim) {
  const int64_t ld = heads * head_dim;
  const int64_t threads = at::get_num_threads();
  const int64_t nblocks = std::max<int64_t>(1, std::min<int64_t>(rows, threads * 16));
  std::vector<int64_t> bounds = balanced_row_blocks(indptr, rows, nblocks);
  at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      for (int64_t r = bounds[blk]; r < bounds[blk + 1]; ++r) {
        const scalar_t* ar = a + r * ld;
        for (int64_t e = indptr[r]; e < indptr[r + 1]; ++e) {
          if (e + 4 < indptr[r + 1]) __builtin_prefetch(b + (int64_t)col[e + 4] * ld, 0, 0);
          const scalar_t* br = b + (int64_t)col[e] * ld;
          for (int64_t h = 0; h < heads; ++h) {
            scalar_t s = 0;
#pragma omp simd reduction(+ : s)
            for (int64_t c = 0; c < head_dim; ++c) s += ar[h * head_dim + c] * br[h * head_dim + c];
            w[e * heads + h] = s;
          }
        }
      }
    }
  });
}

void check_csr(const torch::Tensor& indptr, const torch::Tensor& col) {
  TORCH_CHECK(indptr.device().is_cpu() && col.device().is_cpu(), "native kernels run on CPU tensors");
  TORCH_CHECK(indptr.scalar_type() == torch::kInt64 && indptr.is_contiguous(), "indptr must be contiguous int64");
  TORCH_CHECK((col.scalar_type() == torch::kInt32 || col.scalar_type() == torch::kInt64) && col.is_contiguous(),
              "indices must be contiguous int32 or int64");
}

}  // namespace

// x: [n_src, heads * head_dim] contiguous; weights: [E] (heads == 1) or [E, heads] or empty.
torch::Tensor spmm(torch::Tensor indptr, torch::Tensor col, torch::optional<torch::Tensor> weights,
                   torch::Tensor x, int64_t heads, int64_t tile) {
  check_csr(indptr, col);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous 2-d tensor");
  TORCH_CHECK(x.size(1) % heads == 0, "feature dim must be divisible by heads");
  const int64_t rows = indptr.size(0) - 1;
  const int64_t head_dim = x.size(1) / heads;
  auto out = torch::empty({rows, x.size(1)}, x.options());
  if (rows == 0 || x.size(1) == 0) return out;
  const bool has_w = weights.has_value() && weights->defined();
  if (has_w) {
    TORCH_CHECK(weights->is_contiguous() && weights->scalar_type() == x.scalar_type(),
                "weights must be contiguous with the dtype of x");
    TORCH_CHECK(weights->numel() == col.numel() * heads, "weights must have E * heads entries");
  }
  if (tile <= 0) tile = head_dim;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "gnncompile_spmm", [&] {
    const scalar_t* wp = has_w ? weights->data_ptr<scalar_t>() : nullptr;
    if (col.scalar_type() == torch::kInt32)
      spmm_impl<scalar_t, int32_t>(indptr.data_ptr<int64_t>(), col.data_ptr<int32_t>(), wp, heads,
                                   x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, x.size(0), head_dim, tile);
    else
      spmm_impl<scalar_t, int64_t>(indptr.data_ptr<int64_t>(), col.data_ptr<int64_t>(), wp, heads,
                                   x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, x.size(0), head_dim, tile);
  });
  return out;
}

// a: [rows, heads*head_dim] (destination side), b: [n_src, heads*head_dim]; returns [E, heads].
torch::Tensor sddmm(torch::Tensor indptr, torch::Tensor col, torch::Tensor a, torch::Tensor b, int64_t heads) {
  check_csr(indptr, col);
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous() && a.scalar_type() == b.scalar_type(), "a, b: contiguous, same dtype");
  TORCH_CHECK(a.size(1) == b.size(1) && a.size(1) % heads == 0, "a, b: equal feature dims divisible by heads");
  const int64_t rows = indptr.size(0) - 1;
  auto w = torch::empty({col.numel(), heads}, a.options());
  if (col.numel() == 0) return w;
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "gnncompile_sddmm", [&] {
    if (col.scalar_type() == torch::kInt32)
      sddmm_impl<scalar_t, int32_t>(indptr.data_ptr<int64_t>(), col.data_ptr<int32_t>(), a.data_ptr<scalar_t>(),
                                    b.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), rows, heads, a.size(1) / heads);
    else
      sddmm_impl<scalar_t, int64_t>(indptr.data_ptr<int64_t>(), col.data_ptr<int64_t>(), a.data_ptr<scalar_t>(),
                                    b.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), rows, heads, a.size(1) / heads);
  });
  return w;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("spmm", &spmm, "CSR SpMM with optional (multi-head) edge weights and feature tiling");
  m.def("sddmm", &sddmm, "per-edge (multi-head) dot products over CSR");
}
