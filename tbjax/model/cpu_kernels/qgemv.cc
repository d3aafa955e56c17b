// Weight-only quantized matrix products for small token counts on CPU (XLA FFI custom calls).
//
// Why: at decode batch sizes XLA:CPU dequantizes a quantized weight into a bf16 copy and then runs its dot, so an
// int4 weight costs more memory traffic than the bf16 one. These kernels stream the codes once, convert them in
// registers and accumulate in float32 (weight-only: activations stay float32, no activation quantization).
//
// tbjax_qgemv_cols: y[T, N] = x[T, D] @ W, W given as codes [D, C] in the tree's [in, out] orientation with scale
//   (and optional zero) [D / group, N]: W[d, n] = code * scale[d / group, n] (+ zero[d / group, n]).
//   int8 codes: C == N. int4 codes (two per byte): the row is `segments` runs of `seg` bytes; byte i of run s holds
//   output column s * 2 seg + i in its low nibble and s * 2 seg + seg + i in its high nibble (C * 2 == N).
// tbjax_qgemv_rows: y[T, V] = x[T, D] @ E^T for E [V, D] (a tied embedding used as the head): codes [V, C],
//   scale/zero [V, D / group]; int4 rows hold d < D/2 in low nibbles and D/2 + i in high nibbles.
// Scales and zeros may be float32, float16 or bfloat16. Work is split over XLA's intra-op thread pool by output
// columns (cols) or rows (rows); every output element is computed by one thread in a fixed order (deterministic).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kTile = 64;
// A tile walks down the rows of its column slice (one cache line per row, a large stride): the hardware prefetcher
// kept up poorly with that (576 x 3072 int4 streamed at 3.4 GB/s against 6.8 for 1536 x 576), so each row asks for the
// line this many rows ahead.
constexpr int64_t kPrefetchRows = 16;
constexpr int kMaxT = 8;

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Scales/zeros of one dtype as float32.
struct ScaleView {
  const void* p = nullptr;
  ffi::DataType t = ffi::DataType::F32;
  inline float at(int64_t i) const {
    switch (t) {
      case ffi::DataType::F16:
        return static_cast<float>(reinterpret_cast<const _Float16*>(p)[i]);
      case ffi::DataType::BF16:
        return bf16_to_f32(reinterpret_cast<const uint16_t*>(p)[i]);
      default:
        return reinterpret_cast<const float*>(p)[i];
    }
  }
};

// Runs f(chunk) for chunk in [0, n) on the thread pool and the calling thread; returns when all are done.
template <typename F>
void parallel_for(ffi::ThreadPool& pool, int n, F f) {
  if (n <= 1) {
    if (n == 1) f(0);
    return;
  }
  // the counters outlive this call: a helper that starts after every chunk is done still reads them
  struct State { std::atomic<int> next{1}, done{0}; };
  auto st = std::make_shared<State>();
  F* fp = &f;   // only called for chunks < n, all of which finish before this function returns
  auto work = [st, fp, n]() {
    for (int c = st->next.fetch_add(1); c < n; c = st->next.fetch_add(1)) {
      (*fp)(c);
      st->done.fetch_add(1, std::memory_order_release);
    }
  };
  int helpers = static_cast<int>(std::min<int64_t>(pool.num_threads(), n - 1));
  for (int h = 0; h < helpers; ++h) {
    auto task = work;
    pool.Schedule(std::move(task));
  }
  f(0);
  st->done.fetch_add(1, std::memory_order_release);
  work();
  while (st->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

// One tile of int4 columns: bytes [j, j + w) of every row of one segment, all T rows of x.
template <int T>
void cols_int4_tile(const float* x, const float* xs, const uint8_t* q, int64_t D, int64_t C, int64_t group,
                    ScaleView s, ScaleView z, bool has_zero, int64_t N, int64_t out_lo, int64_t out_hi, int64_t qcol,
                    int w, float* y) {
  float acc_lo[T][kTile], acc_hi[T][kTile];
  for (int t = 0; t < T; ++t)
    for (int i = 0; i < kTile; ++i) acc_lo[t][i] = acc_hi[t][i] = 0.f;
  const int64_t G = D / group;
  for (int64_t g = 0; g < G; ++g) {
    float gl[T][kTile], gh[T][kTile];
    for (int t = 0; t < T; ++t)
      for (int i = 0; i < kTile; ++i) gl[t][i] = gh[t][i] = 0.f;
    for (int64_t d = g * group; d < (g + 1) * group; ++d) {
      const uint8_t* row = q + d * C + qcol;
      if (d + kPrefetchRows < D) __builtin_prefetch(row + kPrefetchRows * C);
      float xv[T];
      for (int t = 0; t < T; ++t) xv[t] = x[t * D + d];
#pragma GCC ivdep
      for (int i = 0; i < w; ++i) {
        float lo = static_cast<float>(row[i] & 15), hi = static_cast<float>(row[i] >> 4);
        for (int t = 0; t < T; ++t) {
          gl[t][i] += xv[t] * lo;
          gh[t][i] += xv[t] * hi;
        }
      }
    }
    const int64_t sl = g * N + out_lo, sh = g * N + out_hi;
    for (int i = 0; i < w; ++i) {
      float slo = s.at(sl + i), shi = s.at(sh + i);
      float zlo = has_zero ? z.at(sl + i) : 0.f, zhi = has_zero ? z.at(sh + i) : 0.f;
      for (int t = 0; t < T; ++t) {
        acc_lo[t][i] += slo * gl[t][i] + zlo * xs[t * G + g];
        acc_hi[t][i] += shi * gh[t][i] + zhi * xs[t * G + g];
      }
    }
  }
  for (int t = 0; t < T; ++t)
    for (int i = 0; i < w; ++i) {
      y[t * N + out_lo + i] = acc_lo[t][i];
      y[t * N + out_hi + i] = acc_hi[t][i];
    }
}

template <int T>
void cols_int8_tile(const float* x, const float* xs, const int8_t* q, int64_t D, int64_t group, ScaleView s,
                    ScaleView z, bool has_zero, int64_t N, int64_t col, int w, float* y) {
  float acc[T][kTile];
  for (int t = 0; t < T; ++t)
    for (int i = 0; i < kTile; ++i) acc[t][i] = 0.f;
  const int64_t G = D / group;
  for (int64_t g = 0; g < G; ++g) {
    float ga[T][kTile];
    for (int t = 0; t < T; ++t)
      for (int i = 0; i < kTile; ++i) ga[t][i] = 0.f;
    for (int64_t d = g * group; d < (g + 1) * group; ++d) {
      const int8_t* row = q + d * N + col;
      if (d + kPrefetchRows < D) __builtin_prefetch(row + kPrefetchRows * N);
      float xv[T];
      for (int t = 0; t < T; ++t) xv[t] = x[t * D + d];
#pragma GCC ivdep
      for (int i = 0; i < w; ++i) {
        float c = static_cast<float>(row[i]);
        for (int t = 0; t < T; ++t) ga[t][i] += xv[t] * c;
      }
    }
    for (int i = 0; i < w; ++i) {
      float sv = s.at(g * N + col + i), zv = has_zero ? z.at(g * N + col + i) : 0.f;
      for (int t = 0; t < T; ++t) acc[t][i] += sv * ga[t][i] + zv * xs[t * G + g];
    }
  }
  for (int t = 0; t < T; ++t)
    for (int i = 0; i < w; ++i) y[t * N + col + i] = acc[t][i];
}

// Group sums of x: xs[t, g] = sum of x[t, d] over the group (for zero points).
void group_sums(const float* x, int64_t T, int64_t D, int64_t group, std::vector<float>& xs) {
  const int64_t G = D / group;
  xs.assign(T * G, 0.f);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t g = 0; g < G; ++g) {
      float a = 0.f;
      for (int64_t d = g * group; d < (g + 1) * group; ++d) a += x[t * D + d];
      xs[t * G + g] = a;
    }
}

template <int T>
void run_cols(ffi::ThreadPool& pool, const float* x, const void* q, bool int4, int64_t D, int64_t C, int64_t N,
              int64_t group, int64_t seg, ScaleView s, ScaleView z, bool has_zero, float* y) {
  std::vector<float> xs;
  group_sums(x, T, D, group, xs);
  // tiles: (segment, byte offset, width)
  struct Tile { int64_t qcol, lo, hi; int w; };
  std::vector<Tile> tiles;
  if (int4) {
    for (int64_t s0 = 0; s0 < C; s0 += seg)
      for (int64_t j = 0; j < seg; j += kTile) {
        int w = static_cast<int>(std::min<int64_t>(kTile, seg - j));
        int64_t base = (s0 / seg) * 2 * seg;
        tiles.push_back({s0 + j, base + j, base + seg + j, w});
      }
  } else {
    for (int64_t j = 0; j < N; j += kTile) tiles.push_back({j, j, 0, static_cast<int>(std::min<int64_t>(kTile, N - j))});
  }
  const int n_chunks = static_cast<int>(std::min<size_t>(tiles.size(), 2 * (pool.num_threads() + 1)));
  const size_t per = (tiles.size() + n_chunks - 1) / n_chunks;
  parallel_for(pool, n_chunks, [&](int c) {
    for (size_t k = c * per; k < std::min(tiles.size(), (c + 1) * per); ++k) {
      const Tile& tl = tiles[k];
      if (int4)
        cols_int4_tile<T>(x, xs.data(), static_cast<const uint8_t*>(q), D, C, group, s, z, has_zero, N, tl.lo, tl.hi,
                          tl.qcol, tl.w, y);
      else
        cols_int8_tile<T>(x, xs.data(), static_cast<const int8_t*>(q), D, group, s, z, has_zero, N, tl.qcol, tl.w,
                          y);
    }
  });
}

template <int T>
void run_rows(ffi::ThreadPool& pool, const float* x, const void* q, bool int4, int64_t D, int64_t C, int64_t V,
              int64_t group, ScaleView s, ScaleView z, bool has_zero, float* y) {
  const int64_t G = D / group, half = D / 2;
  const int n_chunks = static_cast<int>(std::min<int64_t>(V, 8 * (pool.num_threads() + 1)));
  const int64_t per = (V + n_chunks - 1) / n_chunks;
  parallel_for(pool, n_chunks, [&](int c) {
    std::vector<float> wrow(D);
    for (int64_t v = c * per; v < std::min(V, (c + 1) * per); ++v) {
      // row v dequantized in float32 (code * scale + zero), then one dot with each x row
      for (int64_t g = 0; g < G; ++g) {
        const float sv = s.at(v * G + g), zv = has_zero ? z.at(v * G + g) : 0.f;
        float* wr = wrow.data() + g * group;
        if (int4) {
          const uint8_t* row = static_cast<const uint8_t*>(q) + v * C;
          const bool hi = g * group >= half;
          const uint8_t* src = row + (hi ? g * group - half : g * group);
#pragma GCC ivdep
          for (int64_t i = 0; i < group; ++i)
            wr[i] = static_cast<float>(hi ? (src[i] >> 4) : (src[i] & 15)) * sv + zv;
        } else {
          const int8_t* src = static_cast<const int8_t*>(q) + v * C + g * group;
#pragma GCC ivdep
          for (int64_t i = 0; i < group; ++i) wr[i] = static_cast<float>(src[i]) * sv + zv;
        }
      }
      float out[T];
      for (int t = 0; t < T; ++t) {
        const float* xr = x + t * D;
        float a = 0.f;
#pragma omp simd reduction(+ : a)
        for (int64_t i = 0; i < D; ++i) a += xr[i] * wrow[i];
        out[t] = a;
      }
      for (int t = 0; t < T; ++t) y[t * V + v] = out[t];
    }
  });
}

ScaleView view(ffi::AnyBuffer b) { return ScaleView{b.untyped_data(), b.element_type()}; }

template <typename Run>
ffi::Error dispatch_t(int64_t T, Run run) {
  switch (T) {
    case 1: run(std::integral_constant<int, 1>{}); break;
    case 2: run(std::integral_constant<int, 2>{}); break;
    case 3: run(std::integral_constant<int, 3>{}); break;
    case 4: run(std::integral_constant<int, 4>{}); break;
    case 5: run(std::integral_constant<int, 5>{}); break;
    case 6: run(std::integral_constant<int, 6>{}); break;
    case 7: run(std::integral_constant<int, 7>{}); break;
    case 8: run(std::integral_constant<int, 8>{}); break;
    default: return ffi::Error(ffi::ErrorCode::kInvalidArgument, "qgemv: T must be 1..8");
  }
  return ffi::Error::Success();
}

ffi::Error cols_impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q, ffi::AnyBuffer scale,
                     ffi::AnyBuffer zero, ffi::ResultBuffer<ffi::F32> y, int64_t group, int64_t seg, bool has_zero,
                     int64_t layer) {
  // q [L, D, C], scale / zero [L, D / group, N]: layer `layer` of a stack, read in place
  auto xd = x.dimensions(), qd = q.dimensions(), yd = y->dimensions(), sd = scale.dimensions();
  if (xd.size() != 2 || qd.size() != 3 || yd.size() != 2 || sd.size() != 3)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "qgemv_cols: x, y must be 2-D, q and scale 3-D");
  const int64_t T = xd[0], D = xd[1], C = qd[2], N = yd[1], L = qd[0];
  const bool int4 = q.element_type() == ffi::DataType::U8;
  if (qd[1] != D || D % group || layer < 0 || layer >= L || sd[0] != L || sd[1] * group != D || sd[2] != N ||
      (int4 ? (C * 2 != N || C % seg) : C != N))
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "qgemv_cols: inconsistent shapes");
  const int64_t sbytes = ffi::ByteWidth(scale.element_type()) * (D / group) * N;
  const int64_t qbytes = ffi::ByteWidth(q.element_type()) * D * C;
  const char* qp = static_cast<const char*>(q.untyped_data()) + layer * qbytes;
  ScaleView sv{static_cast<const char*>(scale.untyped_data()) + layer * sbytes, scale.element_type()};
  ScaleView zv{has_zero ? static_cast<const char*>(zero.untyped_data()) + layer * sbytes : nullptr,
               zero.element_type()};
  return dispatch_t(T, [&](auto tc) {
    run_cols<decltype(tc)::value>(pool, x.typed_data(), qp, int4, D, C, N, group, seg, sv, zv, has_zero,
                                  y->typed_data());
  });
}

ffi::Error rows_impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q, ffi::AnyBuffer scale,
                     ffi::AnyBuffer zero, ffi::ResultBuffer<ffi::F32> y, int64_t group, bool has_zero) {
  auto xd = x.dimensions(), qd = q.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || qd.size() != 2 || yd.size() != 2)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "qgemv_rows: x, q, y must be 2-D");
  const int64_t T = xd[0], D = xd[1], V = qd[0], C = qd[1];
  const bool int4 = q.element_type() == ffi::DataType::U8;
  if (yd[1] != V || D % group || (int4 ? (C * 2 != D || (D / 2) % group) : C != D))
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "qgemv_rows: inconsistent shapes");
  return dispatch_t(T, [&](auto tc) {
    run_rows<decltype(tc)::value>(pool, x.typed_data(), q.untyped_data(), int4, D, C, V, group, view(scale),
                                  view(zero), has_zero, y->typed_data());
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TbjaxQgemvCols, cols_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("group")
                                  .Attr<int64_t>("seg")
                                  .Attr<bool>("has_zero")
                                  .Attr<int64_t>("layer"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TbjaxQgemvRows, rows_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("group")
                                  .Attr<bool>("has_zero"));
