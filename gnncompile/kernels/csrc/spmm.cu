// gnncompile's CUDA sparse kernels: SpMM (pull and push) and SDDMM over a CSR structure.
//
// Compiled at run time by NVRTC through CuPy (gnncompile/kernels/cuda.py), one template
// instantiation per module, so the source includes no header. float32 values; column indices
// int32 or int64 (I); row offsets int64. Dense operands are row-major [rows, width] and 16-byte
// aligned when VEC = 4 (the launcher checks).
//
// Thread mapping: a group of GROUP lanes (a power of two, at most a warp) owns one CSR row, or one
// chunk of a hub row; each lane owns VEC consecutive columns of a tile of GROUP * VEC columns
// (blockIdx.y picks the tile in the products; SDDMM loops over the tiles, its output being per
// edge). Lanes of a group share the row's column indices through shuffles: lane j loads edge
// base + j, then every lane reads them in turn (coalesced index loads, one per edge per group).
// All control flow that reaches a shuffle is uniform over the group; lanes past the last column
// take part in the shuffles and skip the loads and stores.
//
// Hub rows: with split > 0 the row kernels skip rows of more than `split` edges, and the chunk
// kernels take them, one chunk of at most `split` edges per group (`chunks` holds each chunk's
// (row, first edge)); chunk results are added atomically into an output zeroed beforehand.

typedef long long i64;
typedef unsigned int u32;

template <int VEC> struct Pack;
template <> struct Pack<1> {
  static __device__ __forceinline__ void load(const float* p, float* v) { v[0] = __ldg(p); }
  static __device__ __forceinline__ void store(float* p, const float* v) { p[0] = v[0]; }
};
template <> struct Pack<2> {
  static __device__ __forceinline__ void load(const float* p, float* v) {
    const float2 t = __ldg(reinterpret_cast<const float2*>(p));
    v[0] = t.x; v[1] = t.y;
  }
  static __device__ __forceinline__ void store(float* p, const float* v) {
    *reinterpret_cast<float2*>(p) = make_float2(v[0], v[1]);
  }
};
template <> struct Pack<4> {
  static __device__ __forceinline__ void load(const float* p, float* v) {
    const float4 t = __ldg(reinterpret_cast<const float4*>(p));
    v[0] = t.x; v[1] = t.y; v[2] = t.z; v[3] = t.w;
  }
  static __device__ __forceinline__ void store(float* p, const float* v) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  }
};

// The shuffle mask of the calling lane's group: GROUP consecutive lanes of its warp.
template <int GROUP>
__device__ __forceinline__ u32 group_mask() {
  const u32 bits = GROUP == 32 ? 0xffffffffu : (1u << (GROUP % 32)) - 1u;
  const u32 lane = threadIdx.x & 31u;
  return bits << (lane & ~(u32)(GROUP - 1));
}

// Edges [begin, end) of `row`, pull (PUSH = false): out[row] (+)= rs[row] * sum_e w_e cs[c_e] x[c_e];
// push: out[c_e] += cs[c_e] * w_e * rs[row] * x[row] for every edge (atomically).
template <typename I, int VEC, int GROUP, bool PUSH>
__device__ __forceinline__ void product_range(
    i64 row, i64 begin, i64 end, bool atomic, const I* __restrict__ indices,
    const float* __restrict__ values, int heads, const float* __restrict__ x, float* __restrict__ out,
    const float* __restrict__ row_scale, const float* __restrict__ col_scale, int width,
    int head_width) {
  const u32 mask = group_mask<GROUP>();
  const int lane = (int)(threadIdx.x % GROUP);
  const int col = (int)blockIdx.y * GROUP * VEC + lane * VEC;
  const bool active = col < width;
  const int head = active ? col / head_width : 0;
  const float rs = row_scale ? row_scale[row] : 1.0f;
  float acc[VEC];
  float own[VEC];
#pragma unroll
  for (int v = 0; v < VEC; ++v) acc[v] = 0.0f;
  if (PUSH) {
    if (active) {
      Pack<VEC>::load(x + row * (i64)width + col, own);
    } else {
#pragma unroll
      for (int v = 0; v < VEC; ++v) own[v] = 0.0f;
    }
#pragma unroll
    for (int v = 0; v < VEC; ++v) own[v] *= rs;
  }
  for (i64 base = begin; base < end; base += GROUP) {
    const i64 e_lane = base + lane;
    I c_lane = 0;
    float s_lane = 1.0f;
    if (e_lane < end) {
      c_lane = indices[e_lane];
      if (col_scale) s_lane = col_scale[c_lane];
    }
    const int n = (int)(end - base < GROUP ? end - base : GROUP);
#pragma unroll 4
    for (int j = 0; j < n; ++j) {
      const I c = __shfl_sync(mask, c_lane, j, GROUP);
      const float s = __shfl_sync(mask, s_lane, j, GROUP);
      if (!active) continue;
      const float w = (values ? __ldg(values + (base + j) * heads + head) : 1.0f) * s;
      if (PUSH) {
        float* o = out + (i64)c * width + col;
#pragma unroll
        for (int v = 0; v < VEC; ++v) atomicAdd(o + v, w * own[v]);
      } else {
        float xv[VEC];
        Pack<VEC>::load(x + (i64)c * width + col, xv);
#pragma unroll
        for (int v = 0; v < VEC; ++v) acc[v] = fmaf(w, xv[v], acc[v]);
      }
    }
  }
  if (PUSH || !active) return;
  float* o = out + row * (i64)width + col;
#pragma unroll
  for (int v = 0; v < VEC; ++v) acc[v] *= rs;
  if (atomic) {
#pragma unroll
    for (int v = 0; v < VEC; ++v) atomicAdd(o + v, acc[v]);
  } else {
    Pack<VEC>::store(o, acc);
  }
}

// One group per row (rows of more than `split` edges skipped when split > 0).
template <typename I, int VEC, int GROUP, bool PUSH>
__global__ void spmm_rows(const i64* __restrict__ indptr, const I* __restrict__ indices,
                          const float* __restrict__ values, int heads, const float* __restrict__ x,
                          float* __restrict__ out, const float* __restrict__ row_scale,
                          const float* __restrict__ col_scale, i64 rows, int width, int head_width,
                          i64 split) {
  const i64 row = (i64)blockIdx.x * (blockDim.x / GROUP) + threadIdx.x / GROUP;
  if (row >= rows) return;
  const i64 begin = indptr[row], end = indptr[row + 1];
  if (split > 0 && end - begin > split) return;
  product_range<I, VEC, GROUP, PUSH>(row, begin, end, PUSH, indices, values, heads, x, out,
                                     row_scale, col_scale, width, head_width);
}

// One group per chunk of a hub row: chunks[2k] = row, chunks[2k + 1] = first edge.
template <typename I, int VEC, int GROUP, bool PUSH>
__global__ void spmm_chunks(const i64* __restrict__ indptr, const I* __restrict__ indices,
                            const float* __restrict__ values, int heads, const float* __restrict__ x,
                            float* __restrict__ out, const float* __restrict__ row_scale,
                            const float* __restrict__ col_scale, const i64* __restrict__ chunks,
                            i64 num_chunks, int width, int head_width, i64 split) {
  const i64 k = (i64)blockIdx.x * (blockDim.x / GROUP) + threadIdx.x / GROUP;
  if (k >= num_chunks) return;
  const i64 row = chunks[2 * k], begin = chunks[2 * k + 1];
  const i64 stop = indptr[row + 1];
  const i64 end = begin + split < stop ? begin + split : stop;
  product_range<I, VEC, GROUP, PUSH>(row, begin, end, true, indices, values, heads, x, out,
                                     row_scale, col_scale, width, head_width);
}

// w[e, h] = <a[row, h], b[c_e, h]> for the edges [begin, end) of `row`. A head's columns are
// reduced over `reduce` lanes (a power of two: min(head_width / VEC, GROUP)); a head wider than a
// tile accumulates over its tiles first. The group's first lane of each head writes.
template <typename I, int VEC, int GROUP>
__device__ __forceinline__ void sddmm_range(i64 row, i64 begin, i64 end, const I* __restrict__ indices,
                                            const float* __restrict__ a, const float* __restrict__ b,
                                            float* __restrict__ out, int heads, int width,
                                            int head_width, int reduce) {
  const u32 mask = group_mask<GROUP>();
  const int lane = (int)(threadIdx.x % GROUP);
  const int tile = GROUP * VEC;
  const int tiles = (width + tile - 1) / tile;
  const float* ar = a + row * (i64)width;
  for (i64 e = begin; e < end; ++e) {
    const i64 c = (i64)indices[e];
    const float* br = b + c * (i64)width;
    float acc = 0.0f;
    for (int t = 0; t < tiles; ++t) {
      const int col = t * tile + lane * VEC;
      if (col < width) {
        float av[VEC], bv[VEC];
        Pack<VEC>::load(ar + col, av);
        Pack<VEC>::load(br + col, bv);
#pragma unroll
        for (int v = 0; v < VEC; ++v) acc = fmaf(av[v], bv[v], acc);
      }
      const int done = (t + 1) * tile;  // columns of the row covered so far
      if (done % head_width == 0 || t == tiles - 1) {
        for (int off = reduce / 2; off > 0; off /= 2) acc += __shfl_xor_sync(mask, acc, off, GROUP);
        if (col < width && lane % reduce == 0) out[e * heads + col / head_width] = acc;
        acc = 0.0f;
      }
    }
  }
}

template <typename I, int VEC, int GROUP>
__global__ void sddmm_rows(const i64* __restrict__ indptr, const I* __restrict__ indices,
                           const float* __restrict__ a, const float* __restrict__ b,
                           float* __restrict__ out, i64 rows, int heads, int width, int head_width,
                           int reduce, i64 split) {
  const i64 row = (i64)blockIdx.x * (blockDim.x / GROUP) + threadIdx.x / GROUP;
  if (row >= rows) return;
  const i64 begin = indptr[row], end = indptr[row + 1];
  if (split > 0 && end - begin > split) return;
  sddmm_range<I, VEC, GROUP>(row, begin, end, indices, a, b, out, heads, width, head_width, reduce);
}

template <typename I, int VEC, int GROUP>
__global__ void sddmm_chunks(const i64* __restrict__ indptr, const I* __restrict__ indices,
                             const float* __restrict__ a, const float* __restrict__ b,
                             float* __restrict__ out, const i64* __restrict__ chunks, i64 num_chunks,
                             int heads, int width, int head_width, int reduce, i64 split) {
  const i64 k = (i64)blockIdx.x * (blockDim.x / GROUP) + threadIdx.x / GROUP;
  if (k >= num_chunks) return;
  const i64 row = chunks[2 * k], begin = chunks[2 * k + 1];
  const i64 stop = indptr[row + 1];
  const i64 end = begin + split < stop ? begin + split : stop;
  sddmm_range<I, VEC, GROUP>(row, begin, end, indices, a, b, out, heads, width, head_width, reduce);
}

// ---------------------------------------------------------------------------- GAT attention
// Per-vertex scores -> attention coefficients, fused: alpha[e, h] = softmax over row r's edges of
// LeakyReLU(src[c_e, h] + dst[r, h]) (with loops, row E + r is r's self loop, whose source row is
// src[own + r]). A group of GROUP lanes owns a row; lane i takes the (edge, head) pairs k = i,
// i + GROUP, ... of the row (k = (e - begin) * heads + h: coalesced over the row's [deg, heads]
// block), so with heads a power of two dividing GROUP a lane always sees head i % heads and a
// head's lanes reduce by shuffles at distances GROUP / 2 ... heads. The pre-activations are
// recomputed in each pass, never stored. log_heads = log2(heads).

__device__ __forceinline__ float leaky(float v, float slope) { return v > 0.0f ? v : v * slope; }

template <int GROUP>
__device__ __forceinline__ float head_max(u32 mask, float v, int heads) {
  for (int off = GROUP / 2; off >= heads; off /= 2) v = fmaxf(v, __shfl_xor_sync(mask, v, off, GROUP));
  return v;
}

template <int GROUP>
__device__ __forceinline__ float head_sum(u32 mask, float v, int heads) {
  for (int off = GROUP / 2; off >= heads; off /= 2) v += __shfl_xor_sync(mask, v, off, GROUP);
  return v;
}

// The calling lane's place in the attention kernels: its group's row, the row's first edge and
// number of (edge, head) pairs, its lane, head and shuffle mask, and whether it holds a self loop.
// Groups past the last row (row >= rows) return before load() reads the row's offsets.
template <int GROUP>
struct RowPairs {
  i64 row, begin, n;
  int lane, h;
  u32 mask;
  bool loop_lane;
  __device__ __forceinline__ RowPairs(int heads, int loops)
      : row((i64)blockIdx.x * (blockDim.x / GROUP) + threadIdx.x / GROUP), begin(0), n(0),
        lane((int)(threadIdx.x % GROUP)), h(lane & (heads - 1)), mask(group_mask<GROUP>()),
        loop_lane(loops && lane < heads) {}
  __device__ __forceinline__ void load(const i64* __restrict__ indptr, int log_heads) {
    begin = indptr[row];
    n = (indptr[row + 1] - begin) << log_heads;
  }
};

template <typename I, int GROUP>
__global__ void attention_forward(const i64* __restrict__ indptr, const I* __restrict__ indices,
                                  const float* __restrict__ src, const float* __restrict__ dst,
                                  float* __restrict__ alpha, i64 rows, i64 edges, int heads, int log_heads,
                                  float slope, int loops, i64 own) {
  RowPairs<GROUP> rp(heads, loops);
  if (rp.row >= rows) return;
  rp.load(indptr, log_heads);
  const auto [row, begin, n, lane, h, mask, loop_lane] = rp;
  const float d = dst[row * heads + h];
  const float y_loop = loop_lane ? leaky(src[(own + row) * heads + h] + d, slope) : 0.0f;
  float* a = alpha + begin * heads;
  float* a_loop = alpha + (edges + row) * heads + h;

  float m = loop_lane ? y_loop : __int_as_float(0xff800000);  // -inf
  for (i64 k = lane; k < n; k += GROUP) {
    const i64 c = (i64)indices[begin + (k >> log_heads)];
    m = fmaxf(m, leaky(src[c * heads + h] + d, slope));
  }
  m = head_max<GROUP>(mask, m, heads);
  float s = 0.0f;
  for (i64 k = lane; k < n; k += GROUP) {
    const i64 c = (i64)indices[begin + (k >> log_heads)];
    const float p = expf(leaky(src[c * heads + h] + d, slope) - m);
    a[k] = p;
    s += p;
  }
  float p_loop = 0.0f;
  if (loop_lane) {
    p_loop = expf(y_loop - m);
    s += p_loop;
  }
  s = head_sum<GROUP>(mask, s, heads);
  const float inv = 1.0f / s;
  for (i64 k = lane; k < n; k += GROUP) a[k] *= inv;
  if (loop_lane) *a_loop = p_loop * inv;
}

// Backward of attention_forward: from alpha and its gradient g, the scores' gradient
// gs = (alpha g - alpha rowsum(alpha g)) * LeakyReLU'(src[c] + dst[r]) and its per-row sums
// (dst's gradient, g_dst [rows, heads]).
template <typename I, int GROUP>
__global__ void attention_backward(const i64* __restrict__ indptr, const I* __restrict__ indices,
                                   const float* __restrict__ src, const float* __restrict__ dst,
                                   const float* __restrict__ alpha, const float* __restrict__ grad,
                                   float* __restrict__ gs, float* __restrict__ g_dst, i64 rows, i64 edges,
                                   int heads, int log_heads, float slope, int loops, i64 own) {
  RowPairs<GROUP> rp(heads, loops);
  if (rp.row >= rows) return;
  rp.load(indptr, log_heads);
  const auto [row, begin, n, lane, h, mask, loop_lane] = rp;
  const i64 base = begin * heads, loop_at = (edges + row) * heads + h;

  float dot = loop_lane ? alpha[loop_at] * grad[loop_at] : 0.0f;
  for (i64 k = lane; k < n; k += GROUP) dot = fmaf(alpha[base + k], grad[base + k], dot);
  dot = head_sum<GROUP>(mask, dot, heads);
  const float d = dst[row * heads + h];
  float sum = 0.0f;
  for (i64 k = lane; k < n; k += GROUP) {
    const i64 c = (i64)indices[begin + (k >> log_heads)];
    const float a = alpha[base + k];
    const float v = (a * grad[base + k] - a * dot) * (src[c * heads + h] + d > 0.0f ? 1.0f : slope);
    gs[base + k] = v;
    sum += v;
  }
  if (loop_lane) {
    const float a = alpha[loop_at];
    const float v = (a * grad[loop_at] - a * dot) * (src[(own + row) * heads + h] + d > 0.0f ? 1.0f : slope);
    gs[loop_at] = v;
    sum += v;
  }
  sum = head_sum<GROUP>(mask, sum, heads);
  if (lane < heads) g_dst[row * heads + h] = sum;
}

// Dropout masks (gnncompile/kernels/dropout.py has the rule): element e of the whole
// [num_rows, width] tensor is kept iff word e % 4 of Philox4x32-10 at counter (e / 4, 0) under key
// (key0, key1) is at least `threshold`; kept elements get `scale`, the others 0. `rows` null: the
// mask of every row, one thread per Philox block (its four elements, consecutive in the output);
// else the mask of rows rows[0..n), one thread per element. Grid-stride loops over the units.
__device__ __forceinline__ void philox4x32_10(u32 c[4], u32 k0, u32 k1) {
  for (int r = 0; r < 10; ++r) {
    if (r) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const unsigned long long p0 = (unsigned long long)0xD2511F53u * c[0];
    const unsigned long long p1 = (unsigned long long)0xCD9E8D57u * c[2];
    const u32 n0 = (u32)(p1 >> 32) ^ c[1] ^ k0;
    const u32 n2 = (u32)(p0 >> 32) ^ c[3] ^ k1;
    c[0] = n0;
    c[1] = (u32)p1;
    c[2] = n2;
    c[3] = (u32)p0;
  }
}

template <typename T>
__global__ void dropout_mask(const i64* __restrict__ rows, i64 n, i64 width, u32 key0, u32 key1, u32 threshold,
                             T scale, T* __restrict__ out) {
  const i64 total = n * width;
  const i64 stride = (i64)gridDim.x * blockDim.x;
  const i64 first = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (rows == nullptr) {
    for (i64 b = first; 4 * b < total; b += stride) {
      u32 c[4] = {(u32)b, (u32)((unsigned long long)b >> 32), 0u, 0u};
      philox4x32_10(c, key0, key1);
      for (int w = 0; w < 4 && 4 * b + w < total; ++w) out[4 * b + w] = c[w] >= threshold ? scale : (T)0;
    }
    return;
  }
  for (i64 i = first; i < total; i += stride) {
    const i64 row = i / width;
    const unsigned long long e = (unsigned long long)rows[row] * width + (i - row * width);
    u32 c[4] = {(u32)(e >> 2), (u32)(e >> 34), 0u, 0u};
    philox4x32_10(c, key0, key1);
    out[i] = c[e & 3] >= threshold ? scale : (T)0;
  }
}
