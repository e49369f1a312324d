// The dense product of layers/linear_method.py's DenseLinearMethod (see there): oneDNN's on a packed
// weight, and for a plain bfloat16 [out, in] weight our own, by instruction-set class:
//
// - AVX512-BF16 and AMX (native bf16 products): for one or two rows a GEMV that streams eight weight rows side
//   by side (eight sequential streams the prefetcher follows) and folds each 64-byte line into every input
//   row's dot product with AVX512-BF16 (products exact, sums in float32); more rows go to oneDNN's matmul
//   (AMX tiles) on the same weight.
// - AVX2 and AVX-512 without BF16, and generic: no native bf16 product, and torch's emulated one is slow. A
//   few rows (a decode step) take a GEMV that widens each bfloat16 weight to float32 in registers (a shift)
//   and sums with FMA: bound by reading the weight, as the native one. More rows (batched decode, prefill)
//   widen the weight a chunk of rows at a time into a float32 buffer that stays in cache and multiply it by
//   float32 inputs with torch's sgemm, one chunk per task: compute-bound, the weight read once, and never a
//   float32 copy of the whole weight in memory.
// Every path sums in float32 and rounds once to bfloat16, as oneDNN's bf16 matmul does.
// ATen/ATen.h: cpu_prelude.h
#include <ATen/Parallel.h>

namespace {

#if defined(__AVX512BF16__) && defined(METRALE_AVX512)
#define METRALE_NATIVE_BF16 1
#endif

#if defined(METRALE_NATIVE_BF16)
// At most this many input rows take the GEMV: past two its dot products cost more than oneDNN's AMX tiles.
constexpr int64_t kGemvRows = 2;

// y[m, o0:o1] for input rows m < M, R weight rows at a time; the last partial line of each weight row
// is loaded masked (zeros add nothing).
template <int M, int R>
void gemv_rows(const c10::BFloat16* x, int64_t x_row, const c10::BFloat16* w, const c10::BFloat16* bias, c10::BFloat16* y,
               int64_t y_row, int64_t in, int64_t o0, int64_t o1) {
  const int64_t full = in / 32 * 32;
  const __mmask32 tail = static_cast<__mmask32>((uint64_t{1} << (in - full)) - 1);
  for (int64_t o = o0; o + R <= o1; o += R) {
    __m512 acc[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
    const c10::BFloat16* wr = w + o * in;
    for (int64_t i = 0; i < full; i += 32) {
      __m512bh xv[M];
      for (int m = 0; m < M; ++m) xv[m] = (__m512bh)_mm512_loadu_si512(x + m * x_row + i);
      for (int r = 0; r < R; ++r) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(wr + r * in + i);
        for (int m = 0; m < M; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv, xv[m]);
      }
    }
    if (tail) {
      __m512bh xv[M];
      for (int m = 0; m < M; ++m) xv[m] = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + m * x_row + full);
      for (int r = 0; r < R; ++r) {
        const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(tail, wr + r * in + full);
        for (int m = 0; m < M; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv, xv[m]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const float b = bias ? static_cast<float>(bias[o + r]) : 0.0f;
      for (int m = 0; m < M; ++m) y[m * y_row + o + r] = c10::BFloat16(_mm512_reduce_add_ps(acc[r][m]) + b);
    }
  }
}

// Rows [o0, o1) of every output row: blocks of R, then the rest one at a time.
template <int M>
void gemv_range(const c10::BFloat16* x, int64_t x_row, const c10::BFloat16* w, const c10::BFloat16* bias, c10::BFloat16* y,
                int64_t y_row, int64_t in, int64_t o0, int64_t o1) {
  constexpr int R = 8;  // R * M accumulators and M inputs within the 32 vector registers
  const int64_t split = o0 + (o1 - o0) / R * R;
  gemv_rows<M, R>(x, x_row, w, bias, y, y_row, in, o0, split);
  gemv_rows<M, 1>(x, x_row, w, bias, y, y_row, in, split, o1);
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  const int64_t rows = x.size(0), in = x.size(1), out = w.size(0);
  at::Tensor y = at::empty({rows, out}, x.options());
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const auto* wp = w.data_ptr<c10::BFloat16>();
  const c10::BFloat16* bp = b ? b->data_ptr<c10::BFloat16>() : nullptr;
  auto* yp = y.data_ptr<c10::BFloat16>();
  const int64_t x_row = x.stride(0);
  // Whole 8-row blocks per task, at least 64 weight rows each (a task's fork costs more than fewer rows).
  at::parallel_for(0, (out + 7) / 8, 8, [&](int64_t begin, int64_t end) {
    const int64_t o0 = begin * 8, o1 = std::min(end * 8, out);
    if (rows == 1) gemv_range<1>(xp, x_row, wp, bp, yp, out, in, o0, o1);
    else gemv_range<2>(xp, x_row, wp, bp, yp, out, in, o0, o1);
  });
  return y;
}

#else  // no native bf16 product: widen to float32

// At most this many input rows take the widening GEMV (each group of kGroup rows reads the weight once);
// more take the chunked float32 product.
constexpr int64_t kGemvRows = 4;
constexpr int kGroup = 4;
// Weight rows widened per task of the chunked product: a chunk in float32 of the widest layer stays in L2.
constexpr int64_t kChunkRows = 128;

// One float32 vector of the class: its width, and the loads, FMA and sum the kernels use.
#if defined(METRALE_AVX512)
constexpr int kLanes = 16;
using VecF = __m512;
inline VecF vzero() { return _mm512_setzero_ps(); }
inline VecF vload(const float* p) { return _mm512_loadu_ps(p); }
inline VecF vload(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline VecF vfma(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(VecF a) { return _mm512_reduce_add_ps(a); }
inline void vstore(float* p, VecF a) { _mm512_storeu_ps(p, a); }
#elif defined(METRALE_AVX2)
constexpr int kLanes = 8;
using VecF = __m256;
inline VecF vzero() { return _mm256_setzero_ps(); }
inline VecF vload(const float* p) { return _mm256_loadu_ps(p); }
inline VecF vload(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline VecF vfma(VecF a, VecF b, VecF c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(VecF a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline void vstore(float* p, VecF a) { _mm256_storeu_ps(p, a); }
#else
// Generic: eight float32 lanes as plain arrays, which the compiler vectorises with whatever the baseline has.
constexpr int kLanes = 8;
struct VecF {
  float v[8];
};
inline VecF vzero() { return VecF{}; }
inline VecF vload(const float* p) {
  VecF r;
  for (int l = 0; l < 8; ++l) r.v[l] = p[l];
  return r;
}
inline VecF vload(const c10::BFloat16* p) {
  VecF r;
  for (int l = 0; l < 8; ++l) r.v[l] = static_cast<float>(p[l]);
  return r;
}
inline VecF vfma(VecF a, VecF b, VecF c) {
  for (int l = 0; l < 8; ++l) c.v[l] += a.v[l] * b.v[l];
  return c;
}
inline float vsum(VecF a) {
  float s = 0.0f;
  for (int l = 0; l < 8; ++l) s += a.v[l];
  return s;
}
inline void vstore(float* p, VecF a) {
  for (int l = 0; l < 8; ++l) p[l] = a.v[l];
}
#endif

// Dot products of M float32 input rows (x, stride x_row) with R bfloat16 weight rows (w, stride in) over
// `in` features: acc[r][m]. The ragged end (in % kLanes) is summed in scalar.
template <int M, int R, typename W>
inline void dots(const float* x, int64_t x_row, const W* w, int64_t in, float (&out)[R][M]) {
  VecF acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = vzero();
  const int64_t full = in / kLanes * kLanes;
  for (int64_t i = 0; i < full; i += kLanes) {
    VecF xv[M];
    for (int m = 0; m < M; ++m) xv[m] = vload(x + m * x_row + i);
    for (int r = 0; r < R; ++r) {
      const VecF wv = vload(w + r * in + i);
      for (int m = 0; m < M; ++m) acc[r][m] = vfma(wv, xv[m], acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) {
      float s = vsum(acc[r][m]);
      for (int64_t i = full; i < in; ++i) s += static_cast<float>(w[r * in + i]) * x[m * x_row + i];
      out[r][m] = s;
    }
}

// y[m, o0:o1] for M widened input rows: R weight rows at a time, then one at a time.
template <int M>
void widen_gemv_range(const float* x, int64_t x_row, const c10::BFloat16* w, const c10::BFloat16* bias, c10::BFloat16* y,
                      int64_t y_row, int64_t in, int64_t o0, int64_t o1) {
  // R * M accumulators, M inputs and a weight within the 16 (AVX2) or 32 (AVX-512) vector registers.
  constexpr int R = kLanes == 16 ? 6 : (M == 1 ? 8 : (M == 2 ? 4 : 2));
  int64_t o = o0;
  for (; o + R <= o1; o += R) {
    float s[R][M];
    dots<M, R>(x, x_row, w + o * in, in, s);
    for (int r = 0; r < R; ++r) {
      const float b = bias ? static_cast<float>(bias[o + r]) : 0.0f;
      for (int m = 0; m < M; ++m) y[m * y_row + o + r] = c10::BFloat16(s[r][m] + b);
    }
  }
  for (; o < o1; ++o) {
    float s[1][M];
    dots<M, 1>(x, x_row, w + o * in, in, s);
    const float b = bias ? static_cast<float>(bias[o]) : 0.0f;
    for (int m = 0; m < M; ++m) y[m * y_row + o] = c10::BFloat16(s[0][m] + b);
  }
}

// The inputs as float32 [rows, in] (exact: bfloat16 widens losslessly).
at::Tensor widen_inputs(const at::Tensor& x) { return x.to(at::kFloat).contiguous(); }

at::Tensor widen_gemv(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  const int64_t rows = x.size(0), in = x.size(1), out = w.size(0);
  at::Tensor y = at::empty({rows, out}, x.options());
  const at::Tensor xf = widen_inputs(x);
  const float* xp = xf.data_ptr<float>();
  const auto* wp = w.data_ptr<c10::BFloat16>();
  const c10::BFloat16* bp = b ? b->data_ptr<c10::BFloat16>() : nullptr;
  auto* yp = y.data_ptr<c10::BFloat16>();
  at::parallel_for(0, (out + 7) / 8, 8, [&](int64_t begin, int64_t end) {
    const int64_t o0 = begin * 8, o1 = std::min(end * 8, out);
    for (int64_t m = 0; m < rows; m += kGroup) {
      const float* xm = xp + m * in;
      c10::BFloat16* ym = yp + m * out;
      switch (std::min<int64_t>(kGroup, rows - m)) {
        case 1: widen_gemv_range<1>(xm, in, wp, bp, ym, out, in, o0, o1); break;
        case 2: widen_gemv_range<2>(xm, in, wp, bp, ym, out, in, o0, o1); break;
        case 3: widen_gemv_range<3>(xm, in, wp, bp, ym, out, in, o0, o1); break;
        default: widen_gemv_range<4>(xm, in, wp, bp, ym, out, in, o0, o1); break;
      }
    }
  });
  return y;
}

// Many rows: per task a chunk of weight rows widened into a float32 buffer of the task's own, multiplied by
// the float32 inputs with torch's sgemm (run serially inside the task), the chunk's columns of y written in
// bfloat16 with the bias added first.
at::Tensor chunked_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  const int64_t rows = x.size(0), in = x.size(1), out = w.size(0);
  at::Tensor y = at::empty({rows, out}, x.options());
  const at::Tensor xf = widen_inputs(x);
  const auto* wp = w.data_ptr<c10::BFloat16>();
  const c10::BFloat16* bp = b ? b->data_ptr<c10::BFloat16>() : nullptr;
  auto* yp = y.data_ptr<c10::BFloat16>();
  at::parallel_for(0, (out + kChunkRows - 1) / kChunkRows, 1, [&](int64_t begin, int64_t end) {
    // The thread's own buffers, kept between calls: a fresh allocation this size is fresh pages to fault in.
    thread_local std::vector<float> w_buf, y_buf;
    w_buf.resize(std::max<size_t>(w_buf.size(), kChunkRows * in));
    y_buf.resize(std::max<size_t>(y_buf.size(), rows * kChunkRows));
    at::Tensor wf = at::from_blob(w_buf.data(), {kChunkRows, in}, xf.options());
    at::Tensor yf = at::from_blob(y_buf.data(), {rows, kChunkRows}, xf.options());
    float* wfp = w_buf.data();
    for (int64_t c = begin; c < end; ++c) {
      const int64_t o0 = c * kChunkRows, n = std::min(kChunkRows, out - o0);
      const c10::BFloat16* src = wp + o0 * in;
      for (int64_t i = 0; i < n * in; ++i) wfp[i] = static_cast<float>(src[i]);
      at::Tensor yc = yf.narrow(1, 0, n);
      at::mm_out(yc, xf, wf.narrow(0, 0, n).t());
      const float* ycp = yf.data_ptr<float>();
      for (int64_t m = 0; m < rows; ++m)
        for (int64_t j = 0; j < n; ++j) {
          const float bias = bp ? static_cast<float>(bp[o0 + j]) : 0.0f;
          yp[m * out + o0 + j] = c10::BFloat16(ycp[m * kChunkRows + j] + bias);
        }
    }
  });
  return y;
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  return x.size(0) <= kGemvRows ? widen_gemv(x, w, b) : chunked_linear(x, w, b);
}
#endif

// True when our product takes x @ w.T: bfloat16 rows with unit stride on a plain contiguous bfloat16 weight
// (a few rows only where the class multiplies bf16 natively; any count where it widens).
bool gemv_serves(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  return x.dim() == 2 && x.size(0) >= 1 &&
#if defined(METRALE_NATIVE_BF16)
         x.size(0) <= kGemvRows &&
#endif
         x.stride(1) == 1 && x.scalar_type() == at::kBFloat16 && !w.is_mkldnn() && w.dim() == 2 && w.is_contiguous() &&
         w.scalar_type() == at::kBFloat16 && w.size(1) == x.size(1) &&
         (!b || (b->is_contiguous() && b->scalar_type() == at::kBFloat16 && b->numel() == w.size(0)));
}

// x @ W.T (+ b) as DenseLinearMethod computes it: oneDNN's product on a packed weight; ours for bfloat16 rows
// on a plain one (see gemv_serves); else at::linear.
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  if (w.is_mkldnn()) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                               .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                                 c10::string_view, c10::List<std::optional<at::Scalar>>,
                                                 std::optional<c10::string_view>)>();
    return op.call(x.contiguous(), w, b, "none", c10::List<std::optional<at::Scalar>>(), c10::string_view(""));
  }
  if (gemv_serves(x, w, b)) return gemv(x, w, b);
  return at::linear(x, w, b);
}

}  // namespace

METRALE_FRAGMENT(m) {
  m.def("linear(Tensor x, Tensor w, Tensor? b) -> Tensor");
  m.impl("linear", c10::DispatchKey::CPU, TORCH_FN(dense_linear));
}
