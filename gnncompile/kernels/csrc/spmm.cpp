// Native CPU kernels for gnncompile's P and E primitives.
//
// spmm:   out[v, h, :] = rs[v] * sum_{e in row v} w[e, h] * cs[col[e]] * x[col[e], h, :]
//         (CSR by destination; the optional per-vertex scales rs, cs carry degree normalizations,
//         so a normalized product needs no per-edge array)
// spmm_t: the transposed product (diag(rs) A diag(cs))^T x from the same CSR, by scattering
//         (both optionally plus self-loop terms: entry i of the factors `loop` sits at (row0 + i,
//         col0 + i), adding loop[i] * x[col0 + i] into out[row0 + i], or, transposed,
//         loop[i] * x[row0 + i] into out[col0 + i]; unscaled; one pass instead of two more)
// sddmm:  w[e, h]      = <a[row(e), h, :], b[col[e], h, :]>
// segment_sum, scatter_sum, edge_softmax_step: reductions of edge tensors over rows / columns
// attention_scores, attention_backward: GAT's LeakyReLU scores and softmax over each row's edges, fused
// keep_times: x * (keep ? 1/(1-p) : 0), a dropout applied from its kept mask
// dropout_mask: 0 or 1/(1-p) per element of chosen rows of a tensor, from Philox4x32-10 keyed by a
//         seed and counted by the element's flat index (any rows, in parallel, thread-count independent)
//
// SpMM on this class of machine is bound by the latency of the random row reads of x, not by DRAM
// bandwidth (see PERF_NOTES.md). What the kernels do about it:
//   * one pass over a row's edges reads each x row once, whole: the accumulator of a window of up
//     to 1 KiB of features (256 fp32, 128 fp64) lives in vector registers, and a multi-head row is
//     read once for all heads (head-inner loop) instead of once per head;
//   * software prefetch of the x rows `pf` edges ahead, across row boundaries (most rows of a
//     power-law graph have fewer edges than the prefetch distance), covering every cache line of
//     the window; the distance keeps a fixed number of lines in flight whatever the row width;
//   * rows are cut into blocks of equal work (edges + rows), handed to the threads dynamically;
//     a block walks its rows once per feature window, so prefetches target the window being
//     accumulated;
//   * int32 column indices when |V| < 2^31 (half the index traffic of int64) and an unweighted
//     instantiation that reads no edge values;
//   * outputs of 32 MiB and more are advised to use transparent huge pages before their first
//     write: their 4 KiB first-touch page faults otherwise cost ~40% of a d = 256 product;
//   * SDDMM reduces short heads with a pairwise tree instead of one serial FMA chain.
// Built with -ffp-contract=off: a multiply-add is fused where the source says std::fma and nowhere
// else, so a product's self-loop term (loop * x, then added) rounds as torch's separate ops do.
// Every output element of spmm is written exactly once (no atomics, no zero-fill pass) and the summation
// order per output element is fixed (edge order), so results are deterministic and independent
// of the thread count. Build with -fopenmp (kernels/__init__.py does): without it ATen's
// parallel_for and the simd pragmas silently run serial code.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>
#ifdef __linux__
#include <sys/mman.h>
#endif

namespace {

constexpr int64_t kLine = 64;
// Cache lines of x kept in flight per thread by software prefetch (12 KiB: a quarter of L1).
// Measured on the 2-vCPU Zen machine (RMAT 100k/2M, d = 16/64/256): 48 lines left 30-50% on the
// table, 128-256 are within noise of each other, 384+ thrash L1 at d = 64.
constexpr int64_t kLinesInFlight = 192;
// Longest prefetch distance in edges (reached for rows of one cache line).
constexpr int64_t kMaxPrefetchEdges = 256;
// Row blocks per thread: enough for dynamic scheduling to absorb a thread losing its core.
constexpr int64_t kBlocksPerThread = 16;
// Widest accumulator kept in registers: 1 KiB = 16 zmm registers.
constexpr int64_t kMaxWindowBytes = 1024;

template <int N>
using Int = std::integral_constant<int, N>;

// Row blocks with roughly equal work (edges + rows): O(blocks log V).
std::vector<int64_t> balanced_row_blocks(const int64_t* indptr, int64_t rows, int64_t nblocks) {
  std::vector<int64_t> bounds(nblocks + 1, rows);
  bounds[0] = 0;
  const int64_t total = indptr[rows] + rows;
  for (int64_t b = 1; b < nblocks; ++b) {
    const int64_t target = total * b / nblocks;
    int64_t lo = bounds[b - 1], hi = rows;  // smallest r with indptr[r] + r >= target
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (indptr[mid] + mid < target) lo = mid + 1; else hi = mid;
    }
    bounds[b] = lo;
  }
  return bounds;
}

std::vector<int64_t> row_blocks(const int64_t* indptr, int64_t rows) {
  const int64_t threads = at::get_num_threads();
  const int64_t nblocks = std::max<int64_t>(1, std::min<int64_t>(rows, threads * kBlocksPerThread));
  return balanced_row_blocks(indptr, rows, nblocks);
}

// Run body(block) for every block, blocks handed out dynamically: a thread that loses its core
// for a while (shared machines) does not hold up the others. Which thread runs a block does not
// change any result.
template <typename F>
void for_each_block(int64_t nblocks, const F& body) {
  const int threads = (int)std::min<int64_t>(at::get_num_threads(), nblocks);
  if (threads <= 1 || at::in_parallel_region()) {
    for (int64_t b = 0; b < nblocks; ++b) body(b);
    return;
  }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t b = 0; b < nblocks; ++b) body(b);
}

// Prefetch distance in edges for rows of `bytes` bytes.
inline int64_t prefetch_distance(int64_t bytes) {
  const int64_t lines = std::max<int64_t>(1, (bytes + kLine - 1) / kLine);
  return std::clamp<int64_t>(kLinesInFlight / lines, 2, kMaxPrefetchEdges);
}

// Prefetch every cache line of [p, p + bytes).
inline void prefetch_span(const void* p, int64_t bytes) {
  const uintptr_t first = reinterpret_cast<uintptr_t>(p) & ~uintptr_t(kLine - 1);
  const uintptr_t last = reinterpret_cast<uintptr_t>(p) + bytes - 1;
  for (uintptr_t q = first; q <= last; q += kLine) __builtin_prefetch(reinterpret_cast<const void*>(q), 0, 3);
}

// One feature window of the SpMM: columns [c0, c0 + G*C) of x, i.e. G heads of width C starting at
// head h0 (single-head products use G = 1 and any C). C == 0 means "width known only at run time".
struct Window {
  int64_t c0, width, groups, h0;
};

enum Mode { kUnweighted = 0, kScalar = 1, kHeads = 2 };

// Accumulate one window of one row. `x` and `out` point at the window's first column; `w` at the
// weight of (edge 0, head h0), `wstride` apart per edge. kHeads: `groups` heads of width C.
// `cs` (may be null): a per-column (source) scale multiplying every edge's weight; `rs`: the row's
// (destination's) scale, applied once to the finished sums (1 leaves them as they are). `lf` (may be
// null): the row's self-loop factor of the window's first head (group g's at lf[g * lstep]), times
// `xl` (the loop's row of x at the window's first column), added to the scaled sums.
// MASKED (single-head modes): the window is `width_rt` < C columns wide; the accumulator keeps the
// compile-time width C (in registers) and stores only the first `width_rt` columns. Source rows
// below `safe_rows` are read C wide (the extra lanes read the next columns of x, whatever they
// hold, and are never stored: a masked load per element is 2-4x slower); the last rows of x,
// whose C-wide read would pass its end, load only the first `width_rt` columns.
template <typename scalar_t, typename index_t, int C, int MODE, int G = 0, bool MASKED = false>
inline void spmm_window_row(const index_t* __restrict col, const scalar_t* __restrict w, int64_t wstride,
                            const scalar_t* __restrict cs, scalar_t rs,
                            const scalar_t* __restrict x, int64_t ld, scalar_t* __restrict out,
                            int64_t beg, int64_t end, int64_t nnz, int64_t pf, int64_t width_rt, int64_t groups_rt,
                            int64_t safe_rows, const scalar_t* __restrict lf, int64_t lstep,
                            const scalar_t* __restrict xl) {
  static_assert(!MASKED || (C > 0 && MODE != kHeads), "masked windows are single-head, compile-time width");
  constexpr int64_t kMax = kMaxWindowBytes / sizeof(scalar_t);
  const int64_t width = C ? C : width_rt;  // per head
  const int64_t groups = G ? G : groups_rt;
  const int64_t total = MODE == kHeads ? width * groups : width;
  const int64_t bytes = (MASKED ? width_rt : total) * (int64_t)sizeof(scalar_t);
  alignas(64) scalar_t acc[C == 0 || (MODE == kHeads && G == 0) ? kMax : (MODE == kHeads ? C * G : C)];
#pragma omp simd
  for (int64_t c = 0; c < total; ++c) acc[c] = 0;
  for (int64_t e = beg; e < end; ++e) {
    if (e + pf < nnz) prefetch_span(x + (int64_t)col[e + pf] * ld, bytes);
    const scalar_t* xr = x + (int64_t)col[e] * ld;
    if constexpr (MASKED && MODE == kUnweighted) {
      if ((int64_t)col[e] < safe_rows) {
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) acc[c] += xr[c];
      } else {
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) acc[c] += c < width_rt ? xr[c] : scalar_t(0);
      }
    } else if constexpr (MASKED) {
      const scalar_t we = (w ? w[e * wstride] : scalar_t(1)) * (cs ? cs[col[e]] : scalar_t(1));
      if ((int64_t)col[e] < safe_rows) {
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) acc[c] = std::fma(we, xr[c], acc[c]);
      } else {
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) acc[c] = std::fma(we, c < width_rt ? xr[c] : scalar_t(0), acc[c]);
      }
    } else if constexpr (MODE == kUnweighted) {
#pragma omp simd
      for (int64_t c = 0; c < total; ++c) acc[c] += xr[c];
    } else if constexpr (MODE == kScalar) {
      const scalar_t we = (w ? w[e * wstride] : scalar_t(1)) * (cs ? cs[col[e]] : scalar_t(1));
#pragma omp simd
      for (int64_t c = 0; c < total; ++c) acc[c] = std::fma(we, xr[c], acc[c]);
    } else {
      const scalar_t* we = w + e * wstride;
      const scalar_t se = cs ? cs[col[e]] : scalar_t(1);
      for (int64_t g = 0; g < groups; ++g) {
        const scalar_t wg = we[g] * se;
        scalar_t* ag = acc + g * width;
        const scalar_t* xg = xr + g * width;
#pragma omp simd
        for (int64_t c = 0; c < width; ++c) ag[c] = std::fma(wg, xg[c], ag[c]);
      }
    }
  }
  const int64_t stored = MASKED ? width_rt : total;
  if (lf == nullptr) {
#pragma omp simd
    for (int64_t c = 0; c < stored; ++c) out[c] = acc[c] * rs;
  } else if constexpr (MODE == kHeads) {
    for (int64_t g = 0; g < groups; ++g) {
      const scalar_t f = lf[g * lstep];
      const int64_t o = g * width;
#pragma omp simd
      for (int64_t c = 0; c < width; ++c) out[o + c] = acc[o + c] * rs + f * xl[o + c];
    }
  } else {
    const scalar_t f = lf[0];
#pragma omp simd
    for (int64_t c = 0; c < stored; ++c) out[c] = acc[c] * rs + f * xl[c];
  }
}

// Self-loop factors of a product: entry i (of `n`, `per_row` factors each: 1, or one per head) at
// (row0 + i, col0 + i); `f` null: none.
template <typename scalar_t>
struct Loops {
  const scalar_t* f = nullptr;
  int64_t per_row = 1, row0 = 0, col0 = 0, n = 0;
};

// The compile-time accumulator width of a single-head window `width` columns wide: the smallest
// dispatched power of two that holds it (`width` itself when it is one).
inline int64_t padded_width(int64_t width) {
  int64_t p = 1;
  while (p < width) p *= 2;
  return p;
}

template <typename F>
inline void dispatch_width(int64_t width, F&& f) {
  switch (width) {
    case 1: f(Int<1>{}); break;
    case 2: f(Int<2>{}); break;
    case 4: f(Int<4>{}); break;
    case 8: f(Int<8>{}); break;
    case 16: f(Int<16>{}); break;
    case 32: f(Int<32>{}); break;
    case 64: f(Int<64>{}); break;
    case 128: f(Int<128>{}); break;
    case 256: f(Int<256>{}); break;
    default: f(Int<0>{});
  }
}

// Common multi-head shapes (heads per window x head width) get compile-time loops; others run
// with run-time bounds.
template <typename F>
inline void dispatch_heads(int64_t width, int64_t groups, F&& f) {
  auto by_groups = [&](auto c) {
    constexpr int C = decltype(c)::value;
    if constexpr (C >= 4 && C <= 64) {
      switch (groups) {
        case 2: f(c, Int<2>{}); return;
        case 4: f(c, Int<4>{}); return;
        case 8: f(c, Int<8>{}); return;
        default: break;
      }
    }
    f(c, Int<0>{});
  };
  dispatch_width(width, by_groups);
}

// Split `cols` columns starting at c0 into register-sized windows of one head (G = 1): full windows
// of `max_cols` (a power of two) and one narrower last window, which runs masked in the accumulator
// of the next power of two (one pass over the row's edges for any width up to `max_cols`: splitting
// width 7 into 4 + 3 walked the edges twice and took twice as long as width 8).
void single_windows(std::vector<Window>& out, int64_t c0, int64_t cols, int64_t h0, int64_t max_cols) {
  while (cols > 0) {
    const int64_t wdt = std::min(cols, max_cols);
    out.push_back({c0, wdt, 1, h0});
    c0 += wdt;
    cols -= wdt;
  }
}

template <typename scalar_t, typename index_t>
void spmm_impl(const int64_t* indptr, const index_t* col, const scalar_t* w, int64_t heads,
               const scalar_t* rscale, const scalar_t* cscale,
               const scalar_t* x, int64_t src_rows, scalar_t* out, int64_t rows, int64_t head_dim, int64_t tile,
               Loops<scalar_t> loops) {
  const int64_t ld = heads * head_dim;
  const int64_t nnz = indptr[rows];
  const int64_t max_cols = kMaxWindowBytes / (int64_t)sizeof(scalar_t);
  const std::vector<int64_t> bounds = row_blocks(indptr, rows);
  const int64_t nblocks = (int64_t)bounds.size() - 1;
  // Feature tiles (phases): each is one parallel pass over all rows; within a tile the windows.
  // (per-head loop factors of a product without edges, whose weights may have no storage, keep the head windows)
  const bool multi = heads > 1 && (w != nullptr || loops.per_row > 1);
  const int64_t unit = multi ? head_dim : 1;  // tiles never split a head of multi-head weights
  const int64_t tile_cols = tile > 0 ? std::max(unit, (tile + unit - 1) / unit * unit) : ld;
  for (int64_t t0 = 0; t0 < ld; t0 += tile_cols) {
    const int64_t t1 = std::min(ld, t0 + tile_cols);
    std::vector<Window> windows;
    if (!multi) {
      single_windows(windows, t0, t1 - t0, 0, max_cols);
    } else if (head_dim <= max_cols) {
      const int64_t per = std::max<int64_t>(1, max_cols / head_dim);
      for (int64_t h = t0 / head_dim; h < t1 / head_dim; h += per) {
        const int64_t g = std::min(per, t1 / head_dim - h);
        windows.push_back({h * head_dim, head_dim, g, h});
      }
    } else {
      for (int64_t h = t0 / head_dim; h < t1 / head_dim; ++h) single_windows(windows, h * head_dim, head_dim, h, max_cols);
    }
    for_each_block(nblocks, [&](int64_t b) {
      {
        const int64_t r0 = bounds[b], r1 = bounds[b + 1];
        for (const Window& win : windows) {
          const scalar_t* wh = w ? w + win.h0 : nullptr;
          const int64_t pf = prefetch_distance(win.width * win.groups * (int64_t)sizeof(scalar_t));
          auto run = [&](auto width_c, auto mode_c, auto groups_c, auto masked_c) {
            constexpr int C = decltype(width_c)::value;
            constexpr int M = decltype(mode_c)::value;
            constexpr int G = decltype(groups_c)::value;
            constexpr bool K = decltype(masked_c)::value;
            // the source rows whose C-wide read from column c0 stays inside x (masked windows)
            const int64_t span = win.c0 + (K ? C : 0);
            const int64_t safe = src_rows * ld >= span ? (src_rows * ld - span) / ld + 1 : 0;
            const int64_t lstep = loops.per_row > 1 ? 1 : 0;
            for (int64_t r = r0; r < r1; ++r) {
              const int64_t i = r - loops.row0;
              const bool looped = loops.f != nullptr && i >= 0 && i < loops.n;
              spmm_window_row<scalar_t, index_t, C, M, G, K>(
                  col, wh, heads, cscale, rscale ? rscale[r] : scalar_t(1), x + win.c0, ld, out + r * ld + win.c0,
                  indptr[r], indptr[r + 1], nnz, pf, win.width, win.groups, safe,
                  looped ? loops.f + i * loops.per_row + lstep * win.h0 : nullptr, lstep,
                  looped ? x + (loops.col0 + i) * ld + win.c0 : nullptr);
            }
          };
          // a single-head window of any width runs at the compile-time width that holds it
          auto single = [&](auto mode_c) {
            const int64_t padded = padded_width(win.width);
            dispatch_width(padded, [&](auto c) {
              constexpr int C = decltype(c)::value;
              if constexpr (C == 0)
                run(c, mode_c, Int<1>{}, std::false_type{});
              else if (padded == win.width)
                run(c, mode_c, Int<1>{}, std::false_type{});
              else
                run(c, mode_c, Int<1>{}, std::true_type{});
            });
          };
          if (win.groups > 1)
            dispatch_heads(win.width, win.groups, [&](auto c, auto g) { run(c, Int<kHeads>{}, g, std::false_type{}); });
          else if (w == nullptr && cscale == nullptr)
            single(Int<kUnweighted>{});
          else
            single(Int<kScalar>{});
        }
      }
    });
  }
}

// Transposed product by scattering (push): out[u] = cs[u] * sum_{e: col[e] = u} w[e, h] * rs[row(e)] * x[row(e)],
// i.e. (diag(rs) A diag(cs))^T x read from A's own CSR, so a backward needs no transposed copy of a
// directed graph. Part p of the output rows [bounds[p], bounds[p+1]) belongs to one thread, which
// walks every edge in CSR order and accumulates the edges whose column falls in its part: no atomics,
// and each output row sums its edges in edge order whatever the thread count (the order a pull
// over a stably transposed CSR uses, so both give the same floating-point result).
template <typename scalar_t, typename index_t, int C, int MODE>
inline void push_row(const index_t* __restrict col, const scalar_t* __restrict w, int64_t heads,
                     scalar_t rs, const scalar_t* __restrict xr, scalar_t* __restrict out, int64_t ld,
                     int64_t beg, int64_t end, int64_t nnz, int64_t pf, int64_t lo, int64_t hi,
                     int64_t head_dim_rt) {
  const int64_t width = C ? C : ld;
  const int64_t bytes = ld * (int64_t)sizeof(scalar_t);
  for (int64_t e = beg; e < end; ++e) {
    if (e + pf < nnz) {
      const int64_t ahead = (int64_t)col[e + pf];
      if (ahead >= lo && ahead < hi) prefetch_span(out + ahead * ld, bytes);
    }
    const int64_t u = (int64_t)col[e];
    if (u < lo || u >= hi) continue;
    scalar_t* __restrict o = out + u * ld;
    if constexpr (MODE == kUnweighted) {
#pragma omp simd
      for (int64_t c = 0; c < width; ++c) o[c] = std::fma(rs, xr[c], o[c]);
    } else if constexpr (MODE == kScalar) {
      const scalar_t we = w[e] * rs;
#pragma omp simd
      for (int64_t c = 0; c < width; ++c) o[c] = std::fma(we, xr[c], o[c]);
    } else {
      const scalar_t* we = w + e * heads;
      for (int64_t h = 0; h < heads; ++h) {
        const scalar_t wh = we[h] * rs;
        scalar_t* oh = o + h * head_dim_rt;
        const scalar_t* xh = xr + h * head_dim_rt;
#pragma omp simd
        for (int64_t c = 0; c < head_dim_rt; ++c) oh[c] = std::fma(wh, xh[c], oh[c]);
      }
    }
  }
}

template <typename scalar_t, typename index_t>
void spmm_t_impl(const int64_t* indptr, const index_t* col, const scalar_t* w, int64_t heads,
                 const scalar_t* rscale, const scalar_t* cscale, const scalar_t* x, scalar_t* out,
                 int64_t rows, int64_t head_dim, const int64_t* bounds, int64_t nparts, Loops<scalar_t> loops) {
  const int64_t ld = heads * head_dim;
  const int64_t nnz = indptr[rows];
  const int64_t pf = prefetch_distance(ld * (int64_t)sizeof(scalar_t));
  for_each_block(nparts, [&](int64_t p) {
    const int64_t lo = bounds[p], hi = bounds[p + 1];
    if (hi <= lo) return;
    std::fill(out + lo * ld, out + hi * ld, scalar_t(0));
    auto run = [&](auto width_c, auto mode_c) {
      constexpr int C = decltype(width_c)::value;
      constexpr int M = decltype(mode_c)::value;
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t beg = indptr[r], end = indptr[r + 1];
        if (beg == end) continue;
        push_row<scalar_t, index_t, C, M>(col, w, heads, rscale ? rscale[r] : scalar_t(1), x + r * ld, out, ld,
                                          beg, end, nnz, pf, lo, hi, head_dim);
      }
    };
    if (w == nullptr)
      dispatch_width(ld, [&](auto c) { run(c, Int<kUnweighted>{}); });
    else if (heads == 1)
      dispatch_width(ld, [&](auto c) { run(c, Int<kScalar>{}); });
    else
      run(Int<0>{}, Int<kHeads>{});
    if (cscale) {
      for (int64_t u = lo; u < hi; ++u) {
        const scalar_t s = cscale[u];
        scalar_t* o = out + u * ld;
#pragma omp simd
        for (int64_t c = 0; c < ld; ++c) o[c] *= s;
      }
    }
    if (loops.f != nullptr) {  // the self loops of this part's columns: out[col0 + i] += loop[i] * x[row0 + i]
      const int64_t u0 = std::max(lo, loops.col0), u1 = std::min(hi, loops.col0 + loops.n);
      const int64_t hd = loops.per_row > 1 ? head_dim : ld;
      for (int64_t u = u0; u < u1; ++u) {
        const int64_t i = u - loops.col0;
        const scalar_t* xr = x + (loops.row0 + i) * ld;
        scalar_t* o = out + u * ld;
        for (int64_t h = 0; h < loops.per_row; ++h) {
          const scalar_t f = loops.f[i * loops.per_row + h];
#pragma omp simd
          for (int64_t c = h * hd; c < (h + 1) * hd; ++c) o[c] += f * xr[c];
        }
      }
    }
  });
}

// <a, b> over `width` (== C when C > 0) elements. Short compile-time widths use a pairwise tree on
// a vector of products (a simd reduction of 8 elements would be one serial chain of FMAs).
template <typename scalar_t, int C>
inline scalar_t dot(const scalar_t* __restrict a, const scalar_t* __restrict b, int64_t width) {
  if constexpr (C > 0 && C <= 16) {
    scalar_t p[C];
#pragma omp simd
    for (int c = 0; c < C; ++c) p[c] = a[c] * b[c];
    for (int half = C / 2; half > 0; half /= 2)
#pragma omp simd
      for (int c = 0; c < half; ++c) p[c] += p[c + half];
    return p[0];
  } else {
    const int64_t n = C ? C : width;
    scalar_t s = 0;
#pragma omp simd reduction(+ : s)
    for (int64_t c = 0; c < n; ++c) s = std::fma(a[c], b[c], s);
    return s;
  }
}

// Per-edge dot products of one row: `a` row in L1/registers, b rows prefetched across rows.
template <typename scalar_t, typename index_t, int C>
inline void sddmm_row(const index_t* __restrict col, const scalar_t* __restrict ar, const scalar_t* __restrict b,
                      scalar_t* __restrict w, int64_t beg, int64_t end, int64_t nnz, int64_t pf, int64_t heads,
                      int64_t width_rt) {
  const int64_t width = C ? C : width_rt;
  const int64_t ld = heads * width;
  const int64_t bytes = ld * (int64_t)sizeof(scalar_t);
  for (int64_t e = beg; e < end; ++e) {
    if (e + pf < nnz) prefetch_span(b + (int64_t)col[e + pf] * ld, bytes);
    const scalar_t* br = b + (int64_t)col[e] * ld;
    for (int64_t h = 0; h < heads; ++h) w[e * heads + h] = dot<scalar_t, C>(ar + h * width, br + h * width, width);
  }
}

template <typename scalar_t, typename index_t>
void sddmm_impl(const int64_t* indptr, const index_t* col, const scalar_t* a, const scalar_t* b,
                scalar_t* w, int64_t rows, int64_t heads, int64_t head_dim) {
  const int64_t ld = heads * head_dim;
  const int64_t nnz = indptr[rows];
  const std::vector<int64_t> bounds = row_blocks(indptr, rows);
  const int64_t nblocks = (int64_t)bounds.size() - 1;
  const int64_t pf = prefetch_distance(ld * (int64_t)sizeof(scalar_t));
  for_each_block(nblocks, [&](int64_t blk) {
    {
      dispatch_width(head_dim, [&](auto c) {
        constexpr int C = decltype(c)::value;
        for (int64_t r = bounds[blk]; r < bounds[blk + 1]; ++r)
          sddmm_row<scalar_t, index_t, C>(col, a + r * ld, b, w, indptr[r], indptr[r + 1], nnz, pf, heads, head_dim);
      });
    }
  });
}

void check_csr(const torch::Tensor& indptr, const torch::Tensor& col) {
  TORCH_CHECK(indptr.device().is_cpu() && col.device().is_cpu(), "native kernels run on CPU tensors");
  TORCH_CHECK(indptr.scalar_type() == torch::kInt64 && indptr.is_contiguous() && indptr.dim() == 1 && indptr.numel() >= 1,
              "indptr must be a contiguous 1-d int64 tensor with rows + 1 entries");
  TORCH_CHECK((col.scalar_type() == torch::kInt32 || col.scalar_type() == torch::kInt64) && col.is_contiguous(),
              "indices must be contiguous int32 or int64");
  TORCH_CHECK(indptr[-1].item<int64_t>() == col.numel(), "indptr[-1] must equal the number of indices");
}

// Whether optional edge weights are given; if so they must be contiguous, of x's dtype, E * heads entries.
bool check_weights(const torch::optional<torch::Tensor>& weights, const torch::Tensor& x, int64_t nnz, int64_t heads) {
  const bool has = weights.has_value() && weights->defined();
  if (has) {
    TORCH_CHECK(weights->is_contiguous() && weights->scalar_type() == x.scalar_type(),
                "weights must be contiguous with the dtype of x");
    TORCH_CHECK(weights->numel() == nnz * heads, "weights must have E * heads entries");
  }
  return has;
}

// Whether an optional per-vertex scale is given; if so it must be contiguous, of x's dtype, n entries.
bool check_scale(const torch::optional<torch::Tensor>& scale, const torch::Tensor& x, int64_t n, const char* name) {
  const bool has = scale.has_value() && scale->defined();
  if (has)
    TORCH_CHECK(scale->is_contiguous() && scale->scalar_type() == x.scalar_type() && scale->numel() == n, name,
                " must be contiguous with the dtype of x and ", n, " entries, got ", scale->numel());
  return has;
}

// Ask for transparent huge pages on a large output before its first write. glibc serves
// allocations above its largest mmap threshold (32 MiB) from fresh mmap regions, whose 4 KiB
// first-touch page faults cost ~0.35 s per GB here (PERF_NOTES.md), about 40% of a d = 256
// product; with THP in "madvise" mode one 2 MiB page is faulted per 512 small ones. Smaller
// outputs come from reused heap memory, so advising them would only split the heap's mappings.
// Only the 2 MiB-aligned interior is advised; memory semantics are unchanged.
void advise_huge_pages(const torch::Tensor& t) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t end = begin + t.nbytes();
  const uintptr_t first = (begin + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t last = end & ~(kHuge - 1);
  if (t.nbytes() >= (size_t(32) << 20) && last > first)
    madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
#else
  (void)t;
#endif
}

// The self-loop factors `loop` (or none): contiguous, of x's dtype, `n` rows of 1 or `heads` factors,
// their entries at (row0 + i, col0 + i) inside the rows x cols matrix.
template <typename scalar_t>
Loops<scalar_t> check_loops(const torch::optional<torch::Tensor>& loop, const torch::Tensor& x, int64_t heads,
                            int64_t row0, int64_t col0, int64_t rows, int64_t cols) {
  Loops<scalar_t> l;
  if (!loop.has_value() || !loop->defined()) return l;
  TORCH_CHECK(loop->is_contiguous() && loop->scalar_type() == x.scalar_type() && loop->dim() >= 1,
              "loop must be a contiguous tensor with the dtype of x");
  l.n = loop->size(0);
  l.per_row = l.n ? loop->numel() / l.n : 1;
  TORCH_CHECK(l.per_row == 1 || l.per_row == heads, "loop needs 1 or heads factors per row, got ", l.per_row);
  TORCH_CHECK(row0 >= 0 && col0 >= 0 && row0 + l.n <= rows && col0 + l.n <= cols,
              "loop entries (", l.n, " from (", row0, ", ", col0, ")) must lie inside the ", rows, " x ", cols, " matrix");
  l.f = loop->data_ptr<scalar_t>();
  l.row0 = row0;
  l.col0 = col0;
  return l;
}

}  // namespace

// x: [n_src, heads * head_dim] contiguous; weights: [E] (heads == 1) or [E, heads] or None.
// tile > 0 processes the features in tiles of `tile` columns, one parallel pass each (keeps a
// |V| x tile slab of x in the last-level cache); tile <= 0 makes one pass over all columns.
torch::Tensor spmm(torch::Tensor indptr, torch::Tensor col, torch::optional<torch::Tensor> weights,
                   torch::Tensor x, int64_t heads, int64_t tile, torch::optional<torch::Tensor> row_scale,
                   torch::optional<torch::Tensor> col_scale, torch::optional<torch::Tensor> loop, int64_t loop_row0,
                   int64_t loop_col0) {
  check_csr(indptr, col);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous 2-d tensor");
  TORCH_CHECK(heads >= 1 && x.size(1) % heads == 0, "feature dim must be divisible by heads");
  const int64_t rows = indptr.size(0) - 1;
  const int64_t head_dim = x.size(1) / heads;
  auto out = torch::empty({rows, x.size(1)}, x.options());
  if (rows == 0 || x.size(1) == 0) return out;
  advise_huge_pages(out);
  const bool has_w = check_weights(weights, x, col.numel(), heads);
  const bool has_rs = check_scale(row_scale, x, rows, "row_scale");
  const bool has_cs = check_scale(col_scale, x, x.size(0), "col_scale");
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "gnncompile_spmm", [&] {
    const scalar_t* wp = has_w ? weights->data_ptr<scalar_t>() : nullptr;
    const scalar_t* rp = has_rs ? row_scale->data_ptr<scalar_t>() : nullptr;
    const scalar_t* cp = has_cs ? col_scale->data_ptr<scalar_t>() : nullptr;
    const auto loops = check_loops<scalar_t>(loop, x, has_w ? heads : 1, loop_row0, loop_col0, rows, x.size(0));
    if (col.scalar_type() == torch::kInt32)
      spmm_impl<scalar_t, int32_t>(indptr.data_ptr<int64_t>(), col.data_ptr<int32_t>(), wp, heads, rp, cp,
                                   x.data_ptr<scalar_t>(), x.size(0), out.data_ptr<scalar_t>(), rows, head_dim, tile,
                                   loops);
    else
      spmm_impl<scalar_t, int64_t>(indptr.data_ptr<int64_t>(), col.data_ptr<int64_t>(), wp, heads, rp, cp,
                                   x.data_ptr<scalar_t>(), x.size(0), out.data_ptr<scalar_t>(), rows, head_dim, tile,
                                   loops);
  });
  return out;
}

// Transposed SpMM: x: [rows, heads * head_dim] (one row per CSR row), returns [cols, heads * head_dim];
// weights as for spmm; row_scale has one entry per CSR row, col_scale one per column. `bounds`
// (int64, nparts + 1 entries from 0 to cols) cuts the output rows into the parts the threads own.
torch::Tensor spmm_t(torch::Tensor indptr, torch::Tensor col, torch::optional<torch::Tensor> weights,
                     torch::Tensor x, int64_t heads, int64_t cols, torch::Tensor bounds,
                     torch::optional<torch::Tensor> row_scale, torch::optional<torch::Tensor> col_scale,
                     torch::optional<torch::Tensor> loop, int64_t loop_row0, int64_t loop_col0) {
  check_csr(indptr, col);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous 2-d tensor");
  TORCH_CHECK(heads >= 1 && x.size(1) % heads == 0, "feature dim must be divisible by heads");
  const int64_t rows = indptr.size(0) - 1;
  TORCH_CHECK(x.size(0) == rows, "x must have one row per CSR row");
  TORCH_CHECK(bounds.scalar_type() == torch::kInt64 && bounds.is_contiguous() && bounds.dim() == 1 &&
              bounds.numel() >= 2 && bounds[0].item<int64_t>() == 0 && bounds[-1].item<int64_t>() == cols,
              "bounds must be a contiguous int64 tensor from 0 to cols");
  auto out = torch::empty({cols, x.size(1)}, x.options());
  if (cols == 0 || x.size(1) == 0) return out;
  advise_huge_pages(out);
  const bool has_w = check_weights(weights, x, col.numel(), heads);
  const bool has_rs = check_scale(row_scale, x, rows, "row_scale");
  const bool has_cs = check_scale(col_scale, x, cols, "col_scale");
  const int64_t head_dim = x.size(1) / heads;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "gnncompile_spmm_t", [&] {
    const scalar_t* wp = has_w ? weights->data_ptr<scalar_t>() : nullptr;
    const scalar_t* rp = has_rs ? row_scale->data_ptr<scalar_t>() : nullptr;
    const scalar_t* cp = has_cs ? col_scale->data_ptr<scalar_t>() : nullptr;
    const auto loops = check_loops<scalar_t>(loop, x, has_w ? heads : 1, loop_row0, loop_col0, rows, cols);
    if (col.scalar_type() == torch::kInt32)
      spmm_t_impl<scalar_t, int32_t>(indptr.data_ptr<int64_t>(), col.data_ptr<int32_t>(), wp, heads, rp, cp,
                                     x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, head_dim,
                                     bounds.data_ptr<int64_t>(), bounds.numel() - 1, loops);
    else
      spmm_t_impl<scalar_t, int64_t>(indptr.data_ptr<int64_t>(), col.data_ptr<int64_t>(), wp, heads, rp, cp,
                                     x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, head_dim,
                                     bounds.data_ptr<int64_t>(), bounds.numel() - 1, loops);
  });
  return out;
}

// a: [rows, heads*head_dim] (destination side), b: [n_src, heads*head_dim]; returns [E, heads].
torch::Tensor sddmm(torch::Tensor indptr, torch::Tensor col, torch::Tensor a, torch::Tensor b, int64_t heads) {
  check_csr(indptr, col);
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.is_contiguous() && b.is_contiguous() && a.scalar_type() == b.scalar_type(),
              "a, b: contiguous 2-d tensors of the same dtype");
  TORCH_CHECK(heads >= 1 && a.size(1) == b.size(1) && a.size(1) % heads == 0,
              "a, b: equal feature dims divisible by heads");
  const int64_t rows = indptr.size(0) - 1;
  TORCH_CHECK(a.size(0) == rows, "a must have one row per CSR row");
  auto w = torch::empty({col.numel(), heads}, a.options());
  if (col.numel() == 0) return w;
  advise_huge_pages(w);
  if (a.size(1) == 0) return w.zero_();
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

// ----------------------------------------------------------------------------- edge reductions
// Edge-valued tensors t: [E (+ rows), W] in CSR order (row r's edges are rows indptr[r]..indptr[r+1]
// of t); with `loops`, row E + r of t is r's implicit self loop, last in its row's reductions.
// Each output row is written by one thread in edge order (then the loop): deterministic and
// independent of the thread count.
namespace {

template <typename scalar_t, int C>
void segment_sum_impl(const int64_t* indptr, const scalar_t* t, scalar_t* out, int64_t rows, int64_t width_rt) {
  const int64_t width = C ? C : width_rt;
  const std::vector<int64_t> bounds = row_blocks(indptr, rows);
  for_each_block((int64_t)bounds.size() - 1, [&](int64_t b) {
    for (int64_t r = bounds[b]; r < bounds[b + 1]; ++r) {
      scalar_t* __restrict o = out + r * width;
      std::fill(o, o + width, scalar_t(0));
      for (int64_t e = indptr[r]; e < indptr[r + 1]; ++e) {
        const scalar_t* __restrict te = t + e * width;
#pragma omp simd
        for (int64_t c = 0; c < width; ++c) o[c] += te[c];
      }
    }
  });
}

// out[col[e]] += t[e] for every edge, each thread owning the output rows [bounds[p], bounds[p+1]).
template <typename scalar_t, typename index_t, int C>
void scatter_sum_impl(const index_t* col, int64_t nnz, const scalar_t* t, scalar_t* out, int64_t width_rt,
                      const int64_t* bounds, int64_t nparts) {
  const int64_t width = C ? C : width_rt;
  for_each_block(nparts, [&](int64_t p) {
    const int64_t lo = bounds[p], hi = bounds[p + 1];
    if (hi <= lo) return;
    std::fill(out + lo * width, out + hi * width, scalar_t(0));
    for (int64_t e = 0; e < nnz; ++e) {
      const int64_t u = (int64_t)col[e];
      if (u < lo || u >= hi) continue;
      scalar_t* __restrict o = out + u * width;
      const scalar_t* __restrict te = t + e * width;
#pragma omp simd
      for (int64_t c = 0; c < width; ++c) o[c] += te[c];
    }
  });
}

// Softmax pieces per row r and column c over its edges (and loop):
//   shift:     out[e, c] = t[e, c] - max_e t[e, c]            (a new tensor)
//   normalize: t[e, c] /= sum_e t[e, c]                       (in place; the sum over edges, then the loop)
//   backward:  out[e, c] = s[e, c] g[e, c] - s[e, c] sum_e s[e, c] g[e, c]
// MODE 0: shift, 1: normalize, 2: backward. C: the compile-time width (0: width_rt).
template <typename scalar_t, int MODE, int C>
void softmax_rows_impl(const int64_t* indptr, const scalar_t* a, const scalar_t* g, scalar_t* out, int64_t rows,
                       int64_t width_rt, bool loops) {
  const int64_t width = C ? C : width_rt;
  const int64_t nnz = indptr[rows];
  const std::vector<int64_t> bounds = row_blocks(indptr, rows);
  for_each_block((int64_t)bounds.size() - 1, [&](int64_t b) {
    std::vector<scalar_t> acc_buf(C ? 0 : width);
    scalar_t acc_fixed[C ? C : 1];
    scalar_t* __restrict acc = C ? acc_fixed : acc_buf.data();
    auto reduce = [&](int64_t e) {
      const scalar_t* __restrict ae = a + e * width;
      if constexpr (MODE == 0) {
#pragma omp simd
        for (int64_t c = 0; c < width; ++c) acc[c] = std::max(acc[c], ae[c]);
      } else if constexpr (MODE == 1) {
#pragma omp simd
        for (int64_t c = 0; c < width; ++c) acc[c] += ae[c];
      } else {
        const scalar_t* __restrict ge = g + e * width;
#pragma omp simd
        for (int64_t c = 0; c < width; ++c) acc[c] = std::fma(ae[c], ge[c], acc[c]);
      }
    };
    auto apply = [&](int64_t e) {
      const scalar_t* __restrict ae = a + e * width;
      scalar_t* __restrict oe = out + e * width;
      if constexpr (MODE == 0) {
#pragma omp simd
        for (int64_t c = 0; c < width; ++c) oe[c] = ae[c] - acc[c];
      } else if constexpr (MODE == 1) {
#pragma omp simd
        for (int64_t c = 0; c < width; ++c) oe[c] = ae[c] / acc[c];
      } else {
        const scalar_t* __restrict ge = g + e * width;
#pragma omp simd
        for (int64_t c = 0; c < width; ++c) oe[c] = ae[c] * ge[c] - ae[c] * acc[c];
      }
    };
    for (int64_t r = bounds[b]; r < bounds[b + 1]; ++r) {
      const int64_t beg = indptr[r], end = indptr[r + 1];
      if (beg == end && !loops) continue;
      const scalar_t init = MODE == 0 ? -std::numeric_limits<scalar_t>::infinity() : scalar_t(0);
      for (int64_t c = 0; c < width; ++c) acc[c] = init;
      for (int64_t e = beg; e < end; ++e) reduce(e);
      if (loops) reduce(nnz + r);
      for (int64_t e = beg; e < end; ++e) apply(e);
      if (loops) apply(nnz + r);
    }
  });
}

// out[i] = t[index[i]] (rows of `width` elements), the rows of t prefetched `pf` ahead: a gather
// of rows at random (an edge permutation, the edges' sources) is bound by the latency of its reads.
template <typename scalar_t, typename index_t, int C>
void gather_rows_impl(const scalar_t* t, const index_t* index, scalar_t* out, int64_t n, int64_t width_rt) {
  const int64_t width = C ? C : width_rt;
  const int64_t bytes = width * (int64_t)sizeof(scalar_t);
  const int64_t pf = prefetch_distance(bytes);
  at::parallel_for(0, n, 4096, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      if (i + pf < hi) prefetch_span(t + (int64_t)index[i + pf] * width, bytes);
      const scalar_t* __restrict src = t + (int64_t)index[i] * width;
      scalar_t* __restrict dst = out + i * width;
#pragma omp simd
      for (int64_t c = 0; c < width; ++c) dst[c] = src[c];
    }
  });
}

// The edge tensor's rows: E, or E + rows with loops; its width: the product of the trailing dims.
int64_t check_edge_tensor(const torch::Tensor& indptr, const torch::Tensor& t, bool loops, const char* name) {
  TORCH_CHECK(indptr.device().is_cpu() && indptr.scalar_type() == torch::kInt64 && indptr.is_contiguous() &&
              indptr.dim() == 1 && indptr.numel() >= 1, "indptr must be a contiguous 1-d int64 CPU tensor");
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.dim() >= 1, name, " must be a contiguous CPU tensor");
  const int64_t rows = indptr.size(0) - 1;
  const int64_t want = indptr[-1].item<int64_t>() + (loops ? rows : 0);
  TORCH_CHECK(t.size(0) == want, name, " must have ", want, " rows (edges", loops ? " + self loops" : "",
              "), got ", t.size(0));
  return t.size(0) ? t.numel() / t.size(0) : 0;
}

}  // namespace

// Per-row sums of an edge tensor t [E, ...] in CSR order: returns [rows, ...].
torch::Tensor segment_sum(torch::Tensor indptr, torch::Tensor t) {
  const int64_t width = check_edge_tensor(indptr, t, false, "t");
  const int64_t rows = indptr.size(0) - 1;
  std::vector<int64_t> shape = t.sizes().vec();
  shape[0] = rows;
  auto out = torch::empty(shape, t.options());
  if (rows == 0 || width == 0) return out.zero_();
  AT_DISPATCH_FLOATING_TYPES(t.scalar_type(), "gnncompile_segment_sum", [&] {
    dispatch_width(width, [&](auto c) {
      segment_sum_impl<scalar_t, decltype(c)::value>(indptr.data_ptr<int64_t>(), t.data_ptr<scalar_t>(),
                                                     out.data_ptr<scalar_t>(), rows, width);
    });
  });
  return out;
}

// out[col[e]] += t[e]: t [E, ...] -> [cols, ...]; `bounds` as for spmm_t.
torch::Tensor scatter_sum(torch::Tensor indptr, torch::Tensor col, torch::Tensor t, int64_t cols, torch::Tensor bounds) {
  check_csr(indptr, col);
  const int64_t width = check_edge_tensor(indptr, t, false, "t");
  TORCH_CHECK(bounds.scalar_type() == torch::kInt64 && bounds.is_contiguous() && bounds.dim() == 1 &&
              bounds.numel() >= 2 && bounds[0].item<int64_t>() == 0 && bounds[-1].item<int64_t>() == cols,
              "bounds must be a contiguous int64 tensor from 0 to cols");
  std::vector<int64_t> shape = t.sizes().vec();
  shape[0] = cols;
  auto out = torch::empty(shape, t.options());
  if (cols == 0 || width == 0 || col.numel() == 0) return out.zero_();
  AT_DISPATCH_FLOATING_TYPES(t.scalar_type(), "gnncompile_scatter_sum", [&] {
    dispatch_width(width, [&](auto c) {
      constexpr int C = decltype(c)::value;
      if (col.scalar_type() == torch::kInt32)
        scatter_sum_impl<scalar_t, int32_t, C>(col.data_ptr<int32_t>(), col.numel(), t.data_ptr<scalar_t>(),
                                               out.data_ptr<scalar_t>(), width, bounds.data_ptr<int64_t>(),
                                               bounds.numel() - 1);
      else
        scatter_sum_impl<scalar_t, int64_t, C>(col.data_ptr<int64_t>(), col.numel(), t.data_ptr<scalar_t>(),
                                               out.data_ptr<scalar_t>(), width, bounds.data_ptr<int64_t>(),
                                               bounds.numel() - 1);
    });
  });
  return out;
}

// Rows `index` of t (t: [n_rows, ...] contiguous, index: int32 or int64 in [0, n_rows)): [len(index), ...].
// With `out` (contiguous, t's dtype and trailing shape, at least len(index) rows) the rows are
// written into its first len(index) rows and `out` is returned.
torch::Tensor gather_rows(torch::Tensor t, torch::Tensor index, c10::optional<torch::Tensor> into) {
  TORCH_CHECK(t.device().is_cpu() && index.device().is_cpu() && t.is_contiguous() && index.is_contiguous() &&
              t.dim() >= 1 && index.dim() == 1, "t: a contiguous CPU tensor; index: a contiguous 1-d CPU tensor");
  TORCH_CHECK(index.scalar_type() == torch::kInt32 || index.scalar_type() == torch::kInt64, "index must be int32 or int64");
  std::vector<int64_t> shape = t.sizes().vec();
  shape[0] = index.numel();
  torch::Tensor out;
  if (into.has_value() && into->defined()) {
    out = *into;
    TORCH_CHECK(out.device().is_cpu() && out.is_contiguous() && out.scalar_type() == t.scalar_type() &&
                out.dim() == t.dim() && out.size(0) >= index.numel() &&
                out.sizes().slice(1) == t.sizes().slice(1), "out: a contiguous tensor of t's dtype and row shape "
                "with at least len(index) rows");
  } else {
    out = torch::empty(shape, t.options());
    advise_huge_pages(out);
  }
  const int64_t width = t.size(0) ? t.numel() / t.size(0) : 0;
  if (index.numel() == 0 || width == 0) return out;
  {
    const auto range = torch::aminmax(index);
    TORCH_CHECK(std::get<0>(range).item<int64_t>() >= 0 && std::get<1>(range).item<int64_t>() < t.size(0),
                "index out of range for ", t.size(0), " rows");
  }
  AT_DISPATCH_FLOATING_TYPES(t.scalar_type(), "gnncompile_gather_rows", [&] {
    dispatch_width(width, [&](auto c) {
      constexpr int C = decltype(c)::value;
      if (index.scalar_type() == torch::kInt32)
        gather_rows_impl<scalar_t, int32_t, C>(t.data_ptr<scalar_t>(), index.data_ptr<int32_t>(),
                                               out.data_ptr<scalar_t>(), index.numel(), width);
      else
        gather_rows_impl<scalar_t, int64_t, C>(t.data_ptr<scalar_t>(), index.data_ptr<int64_t>(),
                                               out.data_ptr<scalar_t>(), index.numel(), width);
    });
  });
  return out;
}

// Softmax steps over each row's edges (and loop), see softmax_rows_impl: "shift" returns t minus
// its rows' maxima; "normalize" divides t in place by its rows' sums and returns it; "backward"
// returns s * g - s * rowsum(s * g).
torch::Tensor edge_softmax_step(torch::Tensor indptr, torch::Tensor t, c10::optional<torch::Tensor> grad, bool loops,
                                std::string step) {
  const int64_t width = check_edge_tensor(indptr, t, loops, "t");
  const int64_t rows = indptr.size(0) - 1;
  const bool backward = step == "backward";
  TORCH_CHECK(backward || step == "shift" || step == "normalize", "step must be shift, normalize or backward");
  TORCH_CHECK(backward == (grad.has_value() && grad->defined()), "grad is given exactly for the backward step");
  if (backward)
    TORCH_CHECK(grad->sizes() == t.sizes() && grad->is_contiguous() && grad->scalar_type() == t.scalar_type(),
                "grad must be contiguous, with the shape and dtype of t");
  auto out = step == "normalize" ? t : torch::empty_like(t);
  if (t.numel() == 0) return out;
  AT_DISPATCH_FLOATING_TYPES(t.scalar_type(), "gnncompile_edge_softmax", [&] {
    const int64_t* ip = indptr.data_ptr<int64_t>();
    const scalar_t* tp = t.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    dispatch_width(width, [&](auto c) {
      constexpr int C = decltype(c)::value;
      if (step == "shift")
        softmax_rows_impl<scalar_t, 0, C>(ip, tp, nullptr, op, rows, width, loops);
      else if (step == "normalize")
        softmax_rows_impl<scalar_t, 1, C>(ip, tp, nullptr, op, rows, width, loops);
      else
        softmax_rows_impl<scalar_t, 2, C>(ip, tp, grad->data_ptr<scalar_t>(), op, rows, width, loops);
    });
  });
  return out;
}

// GAT's attention over each row's edges (and loop), from per-vertex scores s_src [n_src, W] and
// s_dst [rows, W]; x[e, c] = s_src[src(e), c] + s_dst[r, c] is edge e's pre-activation (the loop of
// row r reads s_src[own + r]), y = LeakyReLU(x) (x > 0 ? x : x * slope, as torch):
//   forward:  out[e, c] = y[e, c] - max_e y[e, c]   (the softmax's shift; exp and normalize follow)
//   backward: with a = the softmax's output and g its gradient,
//             out[e, c] = (a g - a sum_e a g)[e, c] * (x[e, c] > 0 ? 1 : slope)   (the scores' gradient)
//             g_dst[r, c] = sum_e out[e, c]   (edges in order, then the loop)
// Both evaluate the same expressions in the same order as the unfused ops (gathers, add,
// leaky_relu, edge_softmax_step and segment_sum), so the results are those of the unfused chain;
// x is recomputed in the backward (two row reads) rather than saved.
namespace {

// One edge of attention_rows_impl's forward: its LeakyReLU score into oe, the row's maxima into acc.
template <typename scalar_t, int C>
inline void attention_score_edge(const scalar_t* __restrict ss, const scalar_t* __restrict sd, scalar_t* __restrict oe,
                                 scalar_t* __restrict acc, int64_t width_rt, scalar_t slope) {
  const int64_t width = C ? C : width_rt;
#pragma omp simd
  for (int64_t c = 0; c < width; ++c) {
    const scalar_t x = ss[c] + sd[c];
    // x > 0 ? x : x * slope, without a branch on the sign (one of the two terms is exactly 0)
    const scalar_t y = std::fma(slope, std::min(x, scalar_t(0)), std::max(x, scalar_t(0)));
    oe[c] = y;
    acc[c] = std::max(acc[c], y);
  }
}

// One edge of attention_rows_impl's backward: the score's gradient into oe, added to the row's sums.
template <typename scalar_t, int C>
inline void attention_grad_edge(const scalar_t* __restrict ss, const scalar_t* __restrict sd,
                                const scalar_t* __restrict ae, const scalar_t* __restrict ge,
                                const scalar_t* __restrict acc, scalar_t* __restrict oe, scalar_t* __restrict sum,
                                int64_t width_rt, scalar_t slope) {
  const int64_t width = C ? C : width_rt;
#pragma omp simd
  for (int64_t c = 0; c < width; ++c) {
    const scalar_t d = ae[c] * ge[c] - ae[c] * acc[c];
    const scalar_t x = ss[c] + sd[c];
    const scalar_t f = x > scalar_t(0) ? scalar_t(1) : slope;  // a select of constants: no branch
    const scalar_t v = d * f;
    oe[c] = v;
    sum[c] += v;
  }
}

template <typename scalar_t, typename index_t, bool BACKWARD, int C>
void attention_rows_impl(const int64_t* indptr, const index_t* col, const scalar_t* s_src, const scalar_t* s_dst,
                         const scalar_t* a, const scalar_t* g, scalar_t* out, scalar_t* g_dst, int64_t rows,
                         int64_t width_rt, bool loops, int64_t own, scalar_t slope) {
  const int64_t width = C ? C : width_rt;
  const int64_t nnz = indptr[rows];
  const int64_t pf = prefetch_distance(width * (int64_t)sizeof(scalar_t));
  const std::vector<int64_t> bounds = row_blocks(indptr, rows);
  for_each_block((int64_t)bounds.size() - 1, [&](int64_t b) {
    std::vector<scalar_t> acc_buf(C ? 0 : 2 * width);
    scalar_t acc_fixed[C ? 2 * C : 1];
    scalar_t* __restrict acc = C ? acc_fixed : acc_buf.data();
    scalar_t* __restrict sum = acc + width;
    const int64_t stop = indptr[bounds[b + 1]];
    for (int64_t r = bounds[b]; r < bounds[b + 1]; ++r) {
      const int64_t beg = indptr[r], end = indptr[r + 1];
      const scalar_t* __restrict sd = s_dst + r * width;
      const scalar_t* __restrict sl = s_src + (own + r) * width;  // the loop's source row
      const int64_t el = nnz + r;                                  // the loop's edge row
      if (beg == end && !loops) {
        if constexpr (BACKWARD) std::fill(g_dst + r * width, g_dst + (r + 1) * width, scalar_t(0));
        continue;
      }
      if constexpr (!BACKWARD) {
        for (int64_t c = 0; c < width; ++c) acc[c] = -std::numeric_limits<scalar_t>::infinity();
        for (int64_t e = beg; e < end; ++e) {
          if (e + pf < stop) __builtin_prefetch(s_src + (int64_t)col[e + pf] * width, 0, 3);
          attention_score_edge<scalar_t, C>(s_src + (int64_t)col[e] * width, sd, out + e * width, acc, width, slope);
        }
        if (loops) attention_score_edge<scalar_t, C>(sl, sd, out + el * width, acc, width, slope);
        for (int64_t e = beg; e < end; ++e) {
          scalar_t* __restrict oe = out + e * width;
#pragma omp simd
          for (int64_t c = 0; c < width; ++c) oe[c] = oe[c] - acc[c];
        }
        if (loops) {
          scalar_t* __restrict oe = out + el * width;
#pragma omp simd
          for (int64_t c = 0; c < width; ++c) oe[c] = oe[c] - acc[c];
        }
      } else {
        for (int64_t c = 0; c < width; ++c) acc[c] = scalar_t(0);
        auto dot = [&](int64_t e) {
          const scalar_t* __restrict ae = a + e * width;
          const scalar_t* __restrict ge = g + e * width;
#pragma omp simd
          for (int64_t c = 0; c < width; ++c) acc[c] = std::fma(ae[c], ge[c], acc[c]);
        };
        for (int64_t e = beg; e < end; ++e) dot(e);
        if (loops) dot(el);
        for (int64_t c = 0; c < width; ++c) sum[c] = scalar_t(0);
        for (int64_t e = beg; e < end; ++e) {
          if (e + pf < stop) __builtin_prefetch(s_src + (int64_t)col[e + pf] * width, 0, 3);
          attention_grad_edge<scalar_t, C>(s_src + (int64_t)col[e] * width, sd, a + e * width, g + e * width, acc,
                                           out + e * width, sum, width, slope);
        }
        if (loops)
          attention_grad_edge<scalar_t, C>(sl, sd, a + el * width, g + el * width, acc, out + el * width, sum, width,
                                           slope);
        scalar_t* __restrict gd = g_dst + r * width;
        for (int64_t c = 0; c < width; ++c) gd[c] = sum[c];
      }
    }
  });
}

// The width of per-vertex scores: s_src [n_src, ...] and s_dst [rows, ...] with the same trailing shape.
int64_t check_scores(const torch::Tensor& indptr, const torch::Tensor& col, const torch::Tensor& s_src,
                     const torch::Tensor& s_dst, bool loops, int64_t own) {
  check_csr(indptr, col);
  const int64_t rows = indptr.size(0) - 1;
  TORCH_CHECK(s_src.device().is_cpu() && s_dst.device().is_cpu() && s_src.is_contiguous() && s_dst.is_contiguous() &&
              s_src.dim() >= 1 && s_dst.dim() == s_src.dim() && s_src.scalar_type() == s_dst.scalar_type(),
              "s_src and s_dst must be contiguous CPU tensors of one dtype and rank");
  TORCH_CHECK(s_dst.size(0) == rows && s_dst.sizes().slice(1) == s_src.sizes().slice(1),
              "s_dst must have one row per CSR row and the row shape of s_src");
  TORCH_CHECK(!loops || (own >= 0 && own + rows <= s_src.size(0)), "the loop rows [own, own + rows) must be rows of s_src");
  if (col.numel()) {
    const auto range = torch::aminmax(col);
    TORCH_CHECK(std::get<0>(range).item<int64_t>() >= 0 && std::get<1>(range).item<int64_t>() < s_src.size(0),
                "column index out of range for ", s_src.size(0), " rows of s_src");
  }
  return s_src.size(0) ? s_src.numel() / s_src.size(0) : (s_dst.size(0) ? s_dst.numel() / s_dst.size(0) : 0);
}

template <bool BACKWARD>
void run_attention(const torch::Tensor& indptr, const torch::Tensor& col, const torch::Tensor& s_src,
                   const torch::Tensor& s_dst, const torch::Tensor* a, const torch::Tensor* g, torch::Tensor& out,
                   torch::Tensor* g_dst, int64_t width, bool loops, int64_t own, double slope) {
  const int64_t rows = indptr.size(0) - 1;
  AT_DISPATCH_FLOATING_TYPES(s_src.scalar_type(), "gnncompile_attention", [&] {
    const scalar_t* ap = a ? a->data_ptr<scalar_t>() : nullptr;
    const scalar_t* gp = g ? g->data_ptr<scalar_t>() : nullptr;
    scalar_t* gdp = g_dst ? g_dst->data_ptr<scalar_t>() : nullptr;
    dispatch_width(width, [&](auto c) {
      constexpr int C = decltype(c)::value;
      if (col.scalar_type() == torch::kInt32)
        attention_rows_impl<scalar_t, int32_t, BACKWARD, C>(
            indptr.data_ptr<int64_t>(), col.data_ptr<int32_t>(), s_src.data_ptr<scalar_t>(), s_dst.data_ptr<scalar_t>(),
            ap, gp, out.data_ptr<scalar_t>(), gdp, rows, width, loops, own, static_cast<scalar_t>(slope));
      else
        attention_rows_impl<scalar_t, int64_t, BACKWARD, C>(
            indptr.data_ptr<int64_t>(), col.data_ptr<int64_t>(), s_src.data_ptr<scalar_t>(), s_dst.data_ptr<scalar_t>(),
            ap, gp, out.data_ptr<scalar_t>(), gdp, rows, width, loops, own, static_cast<scalar_t>(slope));
    });
  });
}

std::vector<int64_t> edge_shape(const torch::Tensor& indptr, const torch::Tensor& s_dst, bool loops) {
  std::vector<int64_t> shape = s_dst.sizes().vec();
  shape[0] = indptr[-1].item<int64_t>() + (loops ? indptr.size(0) - 1 : 0);
  return shape;
}

}  // namespace

// The shifted attention scores [E (+ rows), ...] (see attention_rows_impl): exp then a
// "normalize" edge_softmax_step make the attention coefficients.
torch::Tensor attention_scores(torch::Tensor indptr, torch::Tensor col, torch::Tensor s_src, torch::Tensor s_dst,
                               double slope, bool loops, int64_t own) {
  const int64_t width = check_scores(indptr, col, s_src, s_dst, loops, own);
  auto out = torch::empty(edge_shape(indptr, s_dst, loops), s_src.options());
  if (out.numel() == 0) return out;
  run_attention<false>(indptr, col, s_src, s_dst, nullptr, nullptr, out, nullptr, width, loops, own, slope);
  return out;
}

// The attention's backward from its output `a` and gradient `grad` ([E (+ rows), ...]): returns the
// scores' gradient [E (+ rows), ...] and its per-row sums [rows, ...] (the gradient of s_dst).
std::vector<torch::Tensor> attention_backward(torch::Tensor indptr, torch::Tensor col, torch::Tensor s_src,
                                              torch::Tensor s_dst, torch::Tensor a, torch::Tensor grad, double slope,
                                              bool loops, int64_t own) {
  const int64_t width = check_scores(indptr, col, s_src, s_dst, loops, own);
  const auto shape = edge_shape(indptr, s_dst, loops);
  TORCH_CHECK(a.sizes() == torch::IntArrayRef(shape) && grad.sizes() == a.sizes() && a.is_contiguous() &&
              grad.is_contiguous() && a.scalar_type() == s_src.scalar_type() && grad.scalar_type() == a.scalar_type(),
              "a and grad must be contiguous edge tensors of the scores' dtype and row shape");
  auto out = torch::empty(shape, s_src.options());
  auto g_dst = torch::zeros_like(s_dst);
  if (out.numel() == 0) return {out, g_dst};
  run_attention<true>(indptr, col, s_src, s_dst, &a, &grad, out, &g_dst, width, loops, own, slope);
  return {out, g_dst};
}

namespace {
template <typename scalar_t>
void keep_times_span(const scalar_t* __restrict x, const uint8_t* __restrict keep, scalar_t scale,
                     scalar_t* __restrict out, int64_t lo, int64_t hi) {
  // branch free (a random mask mispredicts every other branch): the multiplier is keep * scale,
  // exactly 0 or scale, as torch's keep.to(dtype).mul_(scale) makes it
#pragma omp simd
  for (int64_t i = lo; i < hi; ++i) out[i] = (static_cast<scalar_t>(keep[i]) * scale) * x[i];
}
}  // namespace

// x * (keep ? scale : 0) elementwise (keep: bool, x's shape), the products x * noise makes.
torch::Tensor keep_times(torch::Tensor x, torch::Tensor keep, double scale) {
  TORCH_CHECK(x.device().is_cpu() && keep.device().is_cpu() && x.is_contiguous() && keep.is_contiguous(),
              "x and keep: contiguous CPU tensors");
  TORCH_CHECK(keep.scalar_type() == torch::kBool && keep.numel() == x.numel(), "keep: a bool tensor of x's size");
  auto out = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "gnncompile_keep_times", [&] {
    const scalar_t s = static_cast<scalar_t>(scale);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const uint8_t* kp = reinterpret_cast<const uint8_t*>(keep.data_ptr<bool>());
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, x.numel(), 32768, [&](int64_t lo, int64_t hi) { keep_times_span(xp, kp, s, op, lo, hi); });
  });
  return out;
}

// ----------------------------------------------------------------------------- dropout masks
namespace {

// Philox4x32-10 (Salmon, Moraes, Dror, Shaw, SC'11; Random123's multipliers, Weyl key increments
// and round order): the counter-based generator JAX and cuRAND use. Checked against Random123's
// known-answer vectors in tests/test_dropout_masks.py.
inline void philox4x32_10(uint32_t c[4], uint32_t k0, uint32_t k1) {
  for (int r = 0; r < 10; ++r) {
    if (r) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const uint64_t p0 = uint64_t(0xD2511F53u) * c[0];
    const uint64_t p1 = uint64_t(0xCD9E8D57u) * c[2];
    const uint32_t n0 = uint32_t(p1 >> 32) ^ c[1] ^ k0;
    const uint32_t n2 = uint32_t(p0 >> 32) ^ c[3] ^ k1;
    c[0] = n0;
    c[1] = uint32_t(p1);
    c[2] = n2;
    c[3] = uint32_t(p0);
  }
}

// Blocks generated together: their rounds run as one vector loop (AVX2/AVX-512 multiply 32-bit
// lanes into 64-bit products), several times the throughput of one block at a time.
constexpr int kPhiloxBatch = 16;

// Philox of the blocks ids[0..kPhiloxBatch): words[4 * b + w] is word w of block ids[b].
inline void philox_batch(const uint64_t* ids, uint32_t k0, uint32_t k1, uint32_t words[4 * kPhiloxBatch]) {
  uint32_t c0[kPhiloxBatch], c1[kPhiloxBatch], c2[kPhiloxBatch], c3[kPhiloxBatch];
  for (int b = 0; b < kPhiloxBatch; ++b) {
    c0[b] = uint32_t(ids[b]);
    c1[b] = uint32_t(ids[b] >> 32);
    c2[b] = 0;
    c3[b] = 0;
  }
  for (int r = 0; r < 10; ++r) {
    const uint32_t key0 = k0 + uint32_t(r) * 0x9E3779B9u, key1 = k1 + uint32_t(r) * 0xBB67AE85u;
#pragma omp simd
    for (int b = 0; b < kPhiloxBatch; ++b) {
      const uint64_t p0 = uint64_t(0xD2511F53u) * c0[b];
      const uint64_t p1 = uint64_t(0xCD9E8D57u) * c2[b];
      const uint32_t n0 = uint32_t(p1 >> 32) ^ c1[b] ^ key0;
      const uint32_t n2 = uint32_t(p0 >> 32) ^ c3[b] ^ key1;
      c0[b] = n0;
      c1[b] = uint32_t(p1);
      c2[b] = n2;
      c3[b] = uint32_t(p0);
    }
  }
  for (int b = 0; b < kPhiloxBatch; ++b) {
    words[4 * b] = c0[b];
    words[4 * b + 1] = c1[b];
    words[4 * b + 2] = c2[b];
    words[4 * b + 3] = c3[b];
  }
}

// Rows begin..end-1 of the output (see dropout_mask_impl). A function of plain arguments, called
// from parallel_for's lambda: a lambda body capturing by reference was measured 2-2.5x slower in
// parallel_for's out-of-line path than in its inline one (captures reloaded after every store).
// Elements first .. first + count - 1 of a mask into dst, kPhiloxBatch consecutive blocks at a time.
template <typename scalar_t>
void dropout_mask_run(uint32_t k0, uint32_t k1, uint64_t threshold, scalar_t scale, uint64_t first, uint64_t count,
                      scalar_t* dst) {
  uint32_t words[4 * kPhiloxBatch];
  uint64_t ids[kPhiloxBatch];
  const uint64_t last = first + count;
  for (uint64_t block = first >> 2; (block << 2) < last; block += kPhiloxBatch) {
    for (int b = 0; b < kPhiloxBatch; ++b) ids[b] = block + uint64_t(b);
    philox_batch(ids, k0, k1, words);
    const uint64_t lo = std::max(first, block << 2), hi = std::min(last, (block + kPhiloxBatch) << 2);
    const uint32_t* word = words + (lo - (block << 2));
    scalar_t* o = dst + (lo - first);
    const int64_t n = int64_t(hi - lo);
#pragma omp simd
    for (int64_t t = 0; t < n; ++t) o[t] = word[t] >= threshold ? scale : scalar_t(0);
  }
}

// Rows begin..end-1 of the output (see dropout_mask_impl). A function of plain arguments, called
// from parallel_for's lambda: a lambda body capturing by reference was measured 2-2.5x slower in
// parallel_for's out-of-line path than in its inline one (captures reloaded after every store).
// Runs of consecutive rows long enough to fill a batch are generated as one range of elements;
// the elements of other rows go through a queue of the distinct blocks they need.
template <typename scalar_t>
void dropout_mask_rows(uint32_t k0, uint32_t k1, uint64_t threshold, scalar_t scale, const int64_t* rows,
                       int64_t begin, int64_t end, int64_t width, scalar_t* out) {
  if (rows == nullptr) {  // rows begin..end-1 are one run of elements
    dropout_mask_run(k0, k1, threshold, scale, uint64_t(begin) * uint64_t(width),
                     uint64_t(end - begin) * uint64_t(width), out + begin * width);
    return;
  }
  uint32_t words[4 * kPhiloxBatch];
  uint64_t ids[kPhiloxBatch];
  int64_t pos[4 * kPhiloxBatch];
  uint8_t code[4 * kPhiloxBatch];  // slot * 4 + lane
  int nb = 0, np = 0;
  auto flush = [&]() {
    for (int b = nb; b < kPhiloxBatch; ++b) ids[b] = 0;
    philox_batch(ids, k0, k1, words);
    for (int q = 0; q < np; ++q) out[pos[q]] = words[code[q]] >= threshold ? scale : scalar_t(0);
    nb = np = 0;
  };
  for (int64_t i = begin; i < end;) {
    int64_t j = i + 1;
    while (j < end && rows[j] == rows[j - 1] + 1) ++j;
    if ((j - i) * width >= 4 * kPhiloxBatch) {  // a run of consecutive rows
      dropout_mask_run(k0, k1, threshold, scale, uint64_t(rows[i]) * uint64_t(width), uint64_t(j - i) * uint64_t(width),
                       out + i * width);
      i = j;
      continue;
    }
    for (; i < j; ++i) {
      const uint64_t base = uint64_t(rows[i]) * uint64_t(width);
      for (int64_t c = 0; c < width; ++c) {
        const uint64_t k = base + uint64_t(c);
        // a full batch (or, for a repeated row, a slot past its 4 elements) is generated and written
        if (np == 4 * kPhiloxBatch || (nb == kPhiloxBatch && ids[nb - 1] != (k >> 2))) flush();
        if (nb == 0 || ids[nb - 1] != (k >> 2)) ids[nb++] = k >> 2;
        pos[np] = i * width + c;
        code[np++] = uint8_t(((nb - 1) << 2) | int(k & 3));
      }
    }
  }
  if (np) flush();
}

// out[i, j] for i < n: element k = row(i) * width + j is kept iff word k & 3 of Philox(counter k >> 2)
// is >= threshold. The blocks the elements need are generated kPhiloxBatch at a time: consecutive
// ones for a whole mask; for chosen rows, the distinct blocks of the next elements in output order
// (each output element remembers its block's slot and lane until the batch is generated).
template <typename scalar_t>
void dropout_mask_impl(uint64_t seed, uint64_t threshold, scalar_t scale, const int64_t* rows, int64_t n,
                       int64_t width, scalar_t* out) {
  const uint32_t k0 = uint32_t(seed), k1 = uint32_t(seed >> 32);
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(width, 1));
  at::parallel_for(0, n, grain, [=](int64_t begin, int64_t end) {
    dropout_mask_rows<scalar_t>(k0, k1, threshold, scale, rows, begin, end, width, out);
  });
}

}  // namespace

// The dropout multipliers of rows `rows` (int64, or None: rows 0..num_rows-1) of a [num_rows, width]
// tensor: [n, width] of `dtype`, 0 or 1/(1-p) (bool: whether kept), element k = row * width + j kept iff its 32-bit
// Philox word is >= floor(p * 2^32).
torch::Tensor dropout_mask(int64_t seed, double p, int64_t num_rows, int64_t width, c10::optional<torch::Tensor> rows,
                           torch::ScalarType dtype) {
  TORCH_CHECK(p >= 0.0 && p < 1.0, "p must be in [0, 1)");
  TORCH_CHECK(num_rows >= 0 && width >= 0, "num_rows and width must be non-negative");
  const bool some = rows.has_value() && rows->defined();
  if (some)
    TORCH_CHECK(rows->scalar_type() == torch::kInt64 && rows->dim() == 1 && rows->is_contiguous() && rows->is_cpu(),
                "rows: a contiguous 1-d int64 CPU tensor");
  // rows only number the elements' counters (the caller checks they are in [0, num_rows)); the
  // output is written by position
  const int64_t n = some ? rows->numel() : num_rows;
  auto out = torch::empty({n, width}, torch::TensorOptions().dtype(dtype));
  if (n == 0 || width == 0) return out;
  const uint64_t threshold = uint64_t(p * 4294967296.0);
  AT_DISPATCH_FLOATING_TYPES_AND3(at::kHalf, at::kBFloat16, at::kBool, dtype, "gnncompile_dropout_mask", [&] {
    dropout_mask_impl<scalar_t>(uint64_t(seed), threshold, scalar_t(1.0 / (1.0 - p)),
                                some ? rows->data_ptr<int64_t>() : nullptr, n, width, out.data_ptr<scalar_t>());
  });
  return out;
}

// One Philox4x32-10 block (for known-answer tests).
std::vector<int64_t> philox4x32(std::vector<int64_t> counter, std::vector<int64_t> key) {
  TORCH_CHECK(counter.size() == 4 && key.size() == 2, "counter: 4 words, key: 2 words");
  uint32_t c[4];
  for (int i = 0; i < 4; ++i) c[i] = uint32_t(counter[i]);
  philox4x32_10(c, uint32_t(key[0]), uint32_t(key[1]));
  return {c[0], c[1], c[2], c[3]};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("spmm", &spmm, "CSR SpMM with optional (multi-head) edge weights and optional feature tiling",
        py::arg("indptr"), py::arg("indices"), py::arg("weights"), py::arg("x"), py::arg("heads"), py::arg("tile"),
        py::arg("row_scale") = py::none(), py::arg("col_scale") = py::none(), py::arg("loop") = py::none(),
        py::arg("loop_row0") = 0, py::arg("loop_col0") = 0);
  m.def("spmm_t", &spmm_t, "transposed CSR SpMM by scattering into thread-owned output parts",
        py::arg("indptr"), py::arg("indices"), py::arg("weights"), py::arg("x"), py::arg("heads"), py::arg("cols"),
        py::arg("bounds"), py::arg("row_scale") = py::none(), py::arg("col_scale") = py::none(),
        py::arg("loop") = py::none(), py::arg("loop_row0") = 0, py::arg("loop_col0") = 0);
  m.def("sddmm", &sddmm, "per-edge (multi-head) dot products over CSR", py::arg("indptr"), py::arg("indices"),
        py::arg("a"), py::arg("b"), py::arg("heads"));
  m.def("dropout_mask", &dropout_mask, "dropout multipliers of chosen rows from Philox4x32-10", py::arg("seed"),
        py::arg("p"), py::arg("num_rows"), py::arg("width"), py::arg("rows"), py::arg("dtype"));
  m.def("philox4x32", &philox4x32, "one Philox4x32-10 block", py::arg("counter"), py::arg("key"));
  m.def("segment_sum", &segment_sum, "per-row sums of an edge tensor in CSR order", py::arg("indptr"), py::arg("t"));
  m.def("scatter_sum", &scatter_sum, "sums of an edge tensor into its edges' columns, by thread-owned parts",
        py::arg("indptr"), py::arg("indices"), py::arg("t"), py::arg("cols"), py::arg("bounds"));
  m.def("edge_softmax_step", &edge_softmax_step, "one step of a softmax over each row's edges (and self loop)",
        py::arg("indptr"), py::arg("t"), py::arg("grad"), py::arg("loops"), py::arg("step"));
  m.def("attention_scores", &attention_scores, "shifted LeakyReLU attention scores over each row's edges (and loop)",
        py::arg("indptr"), py::arg("indices"), py::arg("s_src"), py::arg("s_dst"), py::arg("slope"), py::arg("loops"),
        py::arg("own"));
  m.def("attention_backward", &attention_backward, "the attention scores' gradient and its per-row sums",
        py::arg("indptr"), py::arg("indices"), py::arg("s_src"), py::arg("s_dst"), py::arg("a"), py::arg("grad"),
        py::arg("slope"), py::arg("loops"), py::arg("own"));
  m.def("gather_rows", &gather_rows, "rows of a tensor by an index, prefetched", py::arg("t"), py::arg("index"),
        py::arg("out") = py::none());
  m.def("keep_times", &keep_times, "x times a dropout multiplier given as a kept mask and a scale",
        py::arg("x"), py::arg("keep"), py::arg("scale"));
}
