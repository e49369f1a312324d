// The dense product of layers/linear_method.py's DenseLinearMethod (see there): oneDNN's on a packed
// weight, and for a few rows of a bfloat16 model a native GEMV over the plain [out, in] weight.
//
// A decode step of one or two rows is bound by reading the weights: each is used once per row. oneDNN's
// AMX kernel reads them at about two thirds of the box's streaming bandwidth at one row; this one streams
// eight weight rows side by side (eight sequential streams the prefetcher follows) and folds each 64-byte
// line into every input row's dot product with AVX512-BF16 (products exact, sums in float32), at about
// the streaming bandwidth. More rows (batched decode, prefill) go to oneDNN's matmul on the same weight.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

namespace {

// At most this many input rows take the GEMV: past two its dot products cost more than oneDNN's AMX
// tiles (scripts/bench_quant_kernels.py and bench_limits.py time both on a model's shapes).
constexpr int64_t kGemvRows = 2;

#if defined(__AVX512BF16__) && defined(METRALE_AVX512)
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
#endif

// True when the GEMV takes this product: few bfloat16 rows with unit stride, a plain contiguous weight.
bool gemv_serves(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
#if defined(__AVX512BF16__) && defined(METRALE_AVX512)
  return x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kGemvRows && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16 &&
         !w.is_mkldnn() && w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kBFloat16 && w.size(1) == x.size(1) &&
         (!b || (b->is_contiguous() && b->scalar_type() == at::kBFloat16 && b->numel() == w.size(0)));
#else
  return false;
#endif
}

// x @ W.T (+ b) as DenseLinearMethod computes it: oneDNN's product on a packed weight; the GEMV for a few
// bfloat16 rows on a plain one; else at::linear (oneDNN's matmul on the plain weight).
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  if (w.is_mkldnn()) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                               .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                                 c10::string_view, c10::List<std::optional<at::Scalar>>,
                                                 std::optional<c10::string_view>)>();
    return op.call(x.contiguous(), w, b, "none", c10::List<std::optional<at::Scalar>>(), c10::string_view(""));
  }
#if defined(__AVX512BF16__) && defined(METRALE_AVX512)
  if (gemv_serves(x, w, b)) return gemv(x, w, b);
#endif
  return at::linear(x, w, b);
}

}  // namespace

METRALE_FRAGMENT(m) {
  m.def("linear(Tensor x, Tensor w, Tensor? b) -> Tensor");
  m.impl("linear", c10::DispatchKey::CPU, TORCH_FN(dense_linear));
}
