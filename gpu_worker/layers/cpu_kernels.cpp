// metrale's native CPU kernels for the decode step (see cpu_kernels.py, which builds and loads them).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

// Flush denormals to zero (and read them as zero) on this thread while a task runs: a softmax weight
// far below the row's max is ~1e-38, and arithmetic on denormals is hundreds of times slower.
struct FlushDenormals {
#if defined(__SSE__)
  unsigned int saved = _mm_getcsr();
  FlushDenormals() { _mm_setcsr(saved | 0x8040); }
  ~FlushDenormals() { _mm_setcsr(saved); }
#endif
};

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const c10::BFloat16* p, int64_t i) { return static_cast<float>(p[i]); }
inline float load(const c10::Half* p, int64_t i) { return static_cast<float>(p[i]); }
inline void store(float* p, int64_t i, float x) { p[i] = x; }
inline void store(c10::BFloat16* p, int64_t i, float x) { p[i] = c10::BFloat16(x); }
inline void store(c10::Half* p, int64_t i, float x) { p[i] = c10::Half(x); }

// e^x for x <= 0: Cephes' expf (range reduction by ln 2, then a degree-6 polynomial), within a few
// ulp of expf; exactly 0 below -80 (see FlushDenormals).
inline float exp_nonpositive(float x) {
  const float y = std::max(x, -80.0f);
  const float k = std::floor(y * 1.44269504088896341f + 0.5f);
  const float r = (y - k * 0.693359375f) + k * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return x < -80.0f ? 0.0f : std::ldexp(p, static_cast<int>(k));
}

// Ask for the next block's keys and values while this one is folded: rows hop between blocks, so the
// hardware prefetcher (which follows sequential runs) loses the stream at every block boundary.
inline void prefetch_block(const void* k, const void* v, int64_t bytes) {
#if defined(__SSE__)
  const char* kc = static_cast<const char*>(k);
  const char* vc = static_cast<const char*>(v);
  for (int64_t i = 0; i < bytes; i += 64) {
    _mm_prefetch(kc + i, _MM_HINT_T0);
    _mm_prefetch(vc + i, _MM_HINT_T0);
  }
#endif
}

// One row's attention state while its blocks stream past: the scaled queries, and per query head
// the running max, the running sum of weights and the running sum of weight * value.
struct RowState {
  float* qf;   // [heads, dim]
  float* acc;  // [heads, dim]
  float* w;    // [heads, block_size]: one block's scores, then its weights
  float* m;    // [heads]
  float* l;    // [heads]
};

struct Shape {
  int64_t heads, kv_heads, group, dim, block_size;
};

// Fold tokens [offset, offset + n) of one block into the row's state, for KV heads [h0, h1) and their
// query heads: keys are stored [kv_heads, dim, block_size], values [block_size, kv_heads, dim]. Portable
// scalar loops.
template <typename T>
void fold_block_generic(const RowState& st, const Shape& sh, const T* kb, const T* vb, int64_t offset, int64_t n,
                        const T* nk, const T* nv, int64_t h0, int64_t h1) {
  if (nk) prefetch_block(nk, nv, sh.kv_heads * sh.dim * sh.block_size * static_cast<int64_t>(sizeof(T)));
  const int64_t bs = sh.block_size, dim = sh.dim;
  for (int64_t hq = h0 * sh.group; hq < h1 * sh.group; ++hq) {
    const int64_t h = hq / sh.group;
    float* w = st.w + hq * bs;
    const float* q = st.qf + hq * dim;
    for (int64_t j = 0; j < n; ++j) w[j] = 0.0f;
    for (int64_t d = 0; d < dim; ++d) {
      const T* row = kb + (h * dim + d) * bs + offset;
      for (int64_t j = 0; j < n; ++j) w[j] += q[d] * load(row, j);
    }
    float top = st.m[hq];
    for (int64_t j = 0; j < n; ++j) top = std::max(top, w[j]);
    const float alpha = exp_nonpositive(st.m[hq] - top);
    float sum = 0.0f;
    for (int64_t j = 0; j < n; ++j) {
      w[j] = exp_nonpositive(w[j] - top);
      sum += w[j];
    }
    st.l[hq] = st.l[hq] * alpha + sum;
    st.m[hq] = top;
    float* a = st.acc + hq * dim;
    for (int64_t d = 0; d < dim; ++d) a[d] *= alpha;
    for (int64_t j = 0; j < n; ++j) {
      const T* v = vb + ((offset + j) * sh.kv_heads + h) * dim;
      for (int64_t d = 0; d < dim; ++d) a[d] += w[j] * load(v, d);
    }
  }
}

#if defined(METRALE_AVX512)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Stores rounding to T as torch does (round to nearest even; NaN stays NaN), and that rounding alone.
inline __m512i bf16_bits(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}
inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store16(c10::BFloat16* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(x)));
}
inline void store16(c10::Half* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
template <typename T>
inline __m512 round16(__m512 x) {  // x rounded to T and back to float32
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(x), 16));
  } else {
    return _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

// e^x on 16 lanes, exactly 0 below -80 (scalef applies the 2^k of the range reduction; +inf past ~88).
inline __m512 exp16(__m512 x) {
  const __m512 floor_in = _mm512_set1_ps(-80.0f);
  const __m512 y = _mm512_max_ps(x, floor_in);
  const __m512 k = _mm512_roundscale_ps(_mm512_fmadd_ps(y, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), y);
  r = _mm512_fmadd_ps(k, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512 e = _mm512_scalef_ps(p, k);
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, floor_in, _CMP_GE_OQ), e);
}

// The same fold for 16-token blocks, G query heads per KV head, head_dim a multiple of 16: a block's
// scores for one head are one register (its 16 tokens), built by multiply-adds over the head dim;
// lanes outside [offset, offset + n) are masked out of the softmax. Written for instruction-level
// parallelism (the fold is bound by FMA latency, not by arithmetic): two accumulators per head for
// the scores, one exp for every head's rescale factor, and the value pass keeps 8 independent
// accumulators in flight. The next block (nk, nv; null for none) is prefetched a line or two per
// score iteration, spread over the fold: a burst of prefetches would stall on the fill buffers.
template <typename T, int G>
void fold_block16(const RowState& st, const Shape& sh, const T* kb, const T* vb, int64_t offset, int64_t n,
                  const T* nk, const T* nv, int64_t h0, int64_t h1) {
  constexpr int CB = G >= 8 ? 1 : (G == 4 ? 2 : 4);  // value chunks per pass: G * CB accumulators
  constexpr int PF = sizeof(T) / 2;  // next-block lines per score iteration: K and V, head by head
  const int64_t dim = sh.dim, kv_heads = sh.kv_heads;
  const __mmask16 lanes = static_cast<__mmask16>(((1u << n) - 1u) << offset);
  const __m512 lowest = _mm512_set1_ps(-FLT_MAX);
  for (int64_t h = h0; h < h1; ++h) {
    const char* pk = nk ? reinterpret_cast<const char*>(nk + h * dim * 16) : nullptr;
    const char* pv = nv ? reinterpret_cast<const char*>(nv) + h * dim * 16 * sizeof(T) : nullptr;
    __m512 s0[G], s1[G];
    for (int g = 0; g < G; ++g) s0[g] = s1[g] = _mm512_setzero_ps();
    const T* kh = kb + h * dim * 16;
    const float* qh = st.qf + h * G * dim;
    for (int64_t d = 0; d < dim; d += 2) {
      if (pk) {
        for (int u = 0; u < PF; ++u) {
          _mm_prefetch(pk + ((d / 2) * PF + u) * 64, _MM_HINT_T0);
          _mm_prefetch(pv + ((d / 2) * PF + u) * 64, _MM_HINT_T0);
        }
      }
      const __m512 k0 = load16(kh + d * 16), k1 = load16(kh + (d + 1) * 16);
      for (int g = 0; g < G; ++g) {
        s0[g] = _mm512_fmadd_ps(_mm512_set1_ps(qh[g * dim + d]), k0, s0[g]);
        s1[g] = _mm512_fmadd_ps(_mm512_set1_ps(qh[g * dim + d + 1]), k1, s1[g]);
      }
    }
    alignas(64) float shift[16] = {0.0f};
    float top[G];
    __m512 sg[G];
    for (int g = 0; g < G; ++g) {
      const int64_t hq = h * G + g;
      sg[g] = _mm512_mask_blend_ps(lanes, lowest, _mm512_add_ps(s0[g], s1[g]));
      top[g] = std::max(st.m[hq], _mm512_reduce_max_ps(sg[g]));
      shift[g] = st.m[hq] - top[g];
    }
    alignas(64) float alpha[16];
    _mm512_store_ps(alpha, exp16(_mm512_load_ps(shift)));
    for (int g = 0; g < G; ++g) {
      const int64_t hq = h * G + g;
      const __m512 p = exp16(_mm512_sub_ps(sg[g], _mm512_set1_ps(top[g])));
      st.l[hq] = st.l[hq] * alpha[g] + _mm512_reduce_add_ps(p);
      st.m[hq] = top[g];
      _mm512_storeu_ps(st.w + hq * 16, p);
    }
    for (int64_t c0 = 0; c0 < dim; c0 += 16 * CB) {
      __m512 a[G][CB];
      for (int g = 0; g < G; ++g)
        for (int u = 0; u < CB; ++u)
          a[g][u] = c0 + 16 * u < dim ? _mm512_mul_ps(_mm512_loadu_ps(st.acc + (h * G + g) * dim + c0 + 16 * u), _mm512_set1_ps(alpha[g]))
                                      : _mm512_setzero_ps();
      for (int64_t j = offset; j < offset + n; ++j) {
        const T* vj = vb + (j * kv_heads + h) * dim + c0;
        __m512 wj[G];
        for (int g = 0; g < G; ++g) wj[g] = _mm512_set1_ps(st.w[(h * G + g) * 16 + j]);
        for (int u = 0; u < CB; ++u) {
          if (c0 + 16 * u >= dim) break;
          const __m512 v = load16(vj + 16 * u);
          for (int g = 0; g < G; ++g) a[g][u] = _mm512_fmadd_ps(wj[g], v, a[g][u]);
        }
      }
      for (int g = 0; g < G; ++g)
        for (int u = 0; u < CB; ++u)
          if (c0 + 16 * u < dim) _mm512_storeu_ps(st.acc + (h * G + g) * dim + c0 + 16 * u, a[g][u]);
    }
  }
}
#endif

#if defined(METRALE_AVX2) && !defined(METRALE_AVX512)
// AVX2 (8 lanes): a 16-token block is two registers.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// Stores rounding to T as torch does (round to nearest even; NaN stays NaN), and that rounding alone.
inline __m256i bf16_bits8(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
}
inline void store8(float* p, __m256 x) { _mm256_storeu_ps(p, x); }
inline void store8(c10::BFloat16* p, __m256 x) {
  const __m256i b = bf16_bits8(x);  // 8 x 32-bit lanes holding 16-bit values: pack to 8 x 16 bits
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
inline void store8(c10::Half* p, __m256 x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
template <typename T>
inline __m256 round8(__m256 x) {  // x rounded to T and back to float32
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(x), 16));
  } else {
    return _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

// e^x on 8 lanes for x <= 0 (the softmax's), as exp_nonpositive: 0 below -80, 2^k built in the exponent bits
// (k >= -116 there, so always a normal number).
inline __m256 exp8(__m256 x) {
  const __m256 floor_in = _mm256_set1_ps(-80.0f);
  const __m256 y = _mm256_max_ps(x, floor_in);
  const __m256 k = _mm256_floor_ps(_mm256_fmadd_ps(y, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), y);
  r = _mm256_fmadd_ps(k, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  const __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(pow2));
  return _mm256_and_ps(e, _mm256_cmp_ps(x, floor_in, _CMP_GE_OQ));
}

// fold_block16's scheme for 16-token blocks on AVX2: each head's scores are two registers (tokens 0-7 and
// 8-15), G query heads of a KV head share each key load (G <= 4: two accumulators a head within the 16
// registers), lanes outside [offset, offset + n) masked out of the softmax, the value pass with G * CB
// accumulators. Query heads of a larger group are folded G at a time.
template <typename T, int G>
void fold_block8x2(const RowState& st, const Shape& sh, const T* kb, const T* vb, int64_t offset, int64_t n,
                   const T* nk, const T* nv, int64_t h0, int64_t h1) {
  constexpr int CB = G >= 3 ? 2 : 4;
  constexpr int PF = sizeof(T) / 2;
  const int64_t dim = sh.dim, kv_heads = sh.kv_heads, group = sh.group;
  const __m256 idx_lo = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), idx_hi = _mm256_add_ps(idx_lo, _mm256_set1_ps(8.0f));
  const __m256 first = _mm256_set1_ps(static_cast<float>(offset)), past = _mm256_set1_ps(static_cast<float>(offset + n));
  const __m256 in_lo = _mm256_and_ps(_mm256_cmp_ps(idx_lo, first, _CMP_GE_OQ), _mm256_cmp_ps(idx_lo, past, _CMP_LT_OQ));
  const __m256 in_hi = _mm256_and_ps(_mm256_cmp_ps(idx_hi, first, _CMP_GE_OQ), _mm256_cmp_ps(idx_hi, past, _CMP_LT_OQ));
  const __m256 lowest = _mm256_set1_ps(-FLT_MAX);
  for (int64_t h = h0; h < h1; ++h) {
    const char* pk = nk ? reinterpret_cast<const char*>(nk + h * dim * 16) : nullptr;
    const char* pv = nv ? reinterpret_cast<const char*>(nv) + h * dim * 16 * sizeof(T) : nullptr;
    const T* kh = kb + h * dim * 16;
    for (int64_t g0 = 0; g0 < group; g0 += G) {
      const int64_t hq0 = h * group + g0;
      __m256 lo[G], hi[G];
      for (int g = 0; g < G; ++g) lo[g] = hi[g] = _mm256_setzero_ps();
      const float* qh = st.qf + hq0 * dim;
      for (int64_t d = 0; d < dim; ++d) {
        if (pk && g0 == 0 && d % 2 == 0) {
          for (int u = 0; u < PF; ++u) {
            _mm_prefetch(pk + ((d / 2) * PF + u) * 64, _MM_HINT_T0);
            _mm_prefetch(pv + ((d / 2) * PF + u) * 64, _MM_HINT_T0);
          }
        }
        const __m256 k0 = load8(kh + d * 16), k1 = load8(kh + d * 16 + 8);
        for (int g = 0; g < G; ++g) {
          const __m256 qd = _mm256_set1_ps(qh[g * dim + d]);
          lo[g] = _mm256_fmadd_ps(qd, k0, lo[g]);
          hi[g] = _mm256_fmadd_ps(qd, k1, hi[g]);
        }
      }
      float alpha[G];
      for (int g = 0; g < G; ++g) {
        const int64_t hq = hq0 + g;
        lo[g] = _mm256_blendv_ps(lowest, lo[g], in_lo);
        hi[g] = _mm256_blendv_ps(lowest, hi[g], in_hi);
        const float top = std::max(st.m[hq], std::max(hmax8(lo[g]), hmax8(hi[g])));
        alpha[g] = exp_nonpositive(st.m[hq] - top);
        const __m256 t = _mm256_set1_ps(top);
        const __m256 p0 = _mm256_and_ps(exp8(_mm256_sub_ps(lo[g], t)), in_lo);
        const __m256 p1 = _mm256_and_ps(exp8(_mm256_sub_ps(hi[g], t)), in_hi);
        st.l[hq] = st.l[hq] * alpha[g] + hsum8(p0) + hsum8(p1);
        st.m[hq] = top;
        _mm256_storeu_ps(st.w + hq * 16, p0);
        _mm256_storeu_ps(st.w + hq * 16 + 8, p1);
      }
      for (int64_t c0 = 0; c0 < dim; c0 += 8 * CB) {
        __m256 a[G][CB];
        for (int g = 0; g < G; ++g)
          for (int u = 0; u < CB; ++u)
            a[g][u] = c0 + 8 * u < dim ? _mm256_mul_ps(_mm256_loadu_ps(st.acc + (hq0 + g) * dim + c0 + 8 * u), _mm256_set1_ps(alpha[g]))
                                       : _mm256_setzero_ps();
        for (int64_t j = offset; j < offset + n; ++j) {
          const T* vj = vb + (j * kv_heads + h) * dim + c0;
          __m256 wj[G];
          for (int g = 0; g < G; ++g) wj[g] = _mm256_set1_ps(st.w[(hq0 + g) * 16 + j]);
          for (int u = 0; u < CB; ++u) {
            if (c0 + 8 * u >= dim) break;
            const __m256 v = load8(vj + 8 * u);
            for (int g = 0; g < G; ++g) a[g][u] = _mm256_fmadd_ps(wj[g], v, a[g][u]);
          }
        }
        for (int g = 0; g < G; ++g)
          for (int u = 0; u < CB; ++u)
            if (c0 + 8 * u < dim) _mm256_storeu_ps(st.acc + (hq0 + g) * dim + c0 + 8 * u, a[g][u]);
      }
    }
  }
}
#endif

template <typename T>
using FoldFn = void (*)(const RowState&, const Shape&, const T*, const T*, int64_t, int64_t, const T*, const T*, int64_t, int64_t);

// The fastest fold this build and shape allow.
template <typename T>
FoldFn<T> choose_fold(const Shape& sh) {
#if defined(METRALE_AVX512)
  if (sh.block_size == 16 && sh.dim % 16 == 0) {
    switch (sh.group) {
      case 1: return fold_block16<T, 1>;
      case 2: return fold_block16<T, 2>;
      case 3: return fold_block16<T, 3>;
      case 4: return fold_block16<T, 4>;
      case 8: return fold_block16<T, 8>;
      default: break;
    }
  }
#elif defined(METRALE_AVX2)
  if (sh.block_size == 16 && sh.dim % 8 == 0) {
    if (sh.group % 4 == 0) return fold_block8x2<T, 4>;
    if (sh.group % 3 == 0) return fold_block8x2<T, 3>;
    if (sh.group % 2 == 0) return fold_block8x2<T, 2>;
    return fold_block8x2<T, 1>;
  }
#endif
  return fold_block_generic<T>;
}

// A row's keys are folded in chunks of this many positions, aligned to multiples of it (whole blocks): a
// chunk is the unit a lone row's keys are split into across threads, and every row is chunked alike whatever
// the batch and the thread count, so a row's bits never depend on them. A row within one chunk pays no merge.
constexpr int64_t kChunkKeys = 256;

// Merge one head's softmax state over later keys (pm, pl, pacc) into its state over the keys before them
// (m, l, acc): both rescaled to the larger max. Chunks are merged in key order, left to right, in every path.
// The side holding the larger max has factor e^0 = 1 exactly, so its exp and products are skipped.
inline void merge_state(float& m, float& l, float* __restrict acc, float pm, float pl, const float* __restrict pacc, int64_t dim) {
  if (m >= pm) {
    const float b = exp_nonpositive(pm - m);
    for (int64_t d = 0; d < dim; ++d) acc[d] = acc[d] + pacc[d] * b;
    l = l + pl * b;
  } else {
    const float a = exp_nonpositive(m - pm);
    for (int64_t d = 0; d < dim; ++d) acc[d] = acc[d] * a + pacc[d];
    l = l * a + pl;
    m = pm;
  }
}

// A unit of a split decode: KV head h of row r over keys [t0, t1); slot: where its partial state goes, -1 for
// a row of one chunk (written out directly).
struct ChunkUnit {
  int64_t r, h, t0, t1, slot;
};

// Buffers reused from call to call on each thread (their capacity: a decode step calls this per layer).
struct DecodeScratch {
  std::vector<float> state;  // a task's RowState
  std::vector<float> merged;  // a row's merged chunks (one unit a row)
  // The caller's plan of a split decode: its units, per row the first slot and the chunks, per thread its first
  // unit, the chunks' partial states, per (row, KV head) the chunks done.
  std::vector<ChunkUnit> units;
  std::vector<int64_t> slot0, chunks, owner_start;
  std::vector<float> partial;
  std::unique_ptr<std::atomic<int64_t>[]> done;
  int64_t done_size = 0;
};
thread_local DecodeScratch decode_scratch;

template <typename T>
void decode(const at::Tensor& q, const at::Tensor& k_blocks, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& first_key,
            double scale, at::Tensor& out) {
  const Shape sh{q.size(1), k_blocks.size(1), q.size(1) / k_blocks.size(1), q.size(2), k_blocks.size(3)};
  const int64_t rows = q.size(0), width = block_tables.size(1);
  const int64_t heads = sh.heads, dim = sh.dim, group = sh.group, bs = sh.block_size;
  const int64_t q_row = q.stride(0), q_head = q.stride(1), block_elems = sh.kv_heads * dim * bs;
  const T* qp = q.data_ptr<T>();
  const T* kp = k_blocks.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* firsts = first_key.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const float sc = static_cast<float>(scale);
  const FoldFn<T> fold = choose_fold<T>(sh);
  const int64_t span = std::max<int64_t>(1, kChunkKeys / bs) * bs;  // a chunk's positions

  // Flash-decoding: each row's blocks in order with an online softmax, every key and value read once,
  // straight from its block. One task's state: per query head the scaled query, the running sum of weight *
  // value, one block's weights, the running max and sum (RowState).
  auto scratch_for = [&](std::vector<float>& buf) {
    buf.resize(heads * dim * 2 + heads * bs + heads * 2);  // every entry is written before it is read
    float* b = buf.data();
    return RowState{b, b + heads * dim, b + 2 * heads * dim, b + 2 * heads * dim + heads * bs,
                    b + 2 * heads * dim + heads * bs + heads};
  };
  auto load_queries = [&](const RowState& st, int64_t r, int64_t h0, int64_t h1) {
    for (int64_t hq = h0 * group; hq < h1 * group; ++hq) {
      const T* src = qp + r * q_row + hq * q_head;
      for (int64_t d = 0; d < dim; ++d) st.qf[hq * dim + d] = load(src, d) * sc;
    }
  };
  // Fold keys [t0, t1) of row r into a fresh state of KV heads [h0, h1); after_k/after_v (null for none) is
  // the block this task folds next, prefetched while the range's last block is folded.
  auto fold_keys = [&](const RowState& st, int64_t r, int64_t h0, int64_t h1, int64_t t0, int64_t t1,
                       const T* after_k, const T* after_v) {
    for (int64_t hq = h0 * group; hq < h1 * group; ++hq) {
      for (int64_t d = 0; d < dim; ++d) st.acc[hq * dim + d] = 0.0f;
      st.m[hq] = -FLT_MAX;
      st.l[hq] = 0.0f;
    }
    const int64_t* table = tables + r * width;
    for (int64_t t = t0; t < t1;) {
      const int64_t block = table[t / bs];
      const int64_t offset = t % bs;
      const int64_t n = std::min(bs - offset, t1 - t);
      const T* nk = after_k;
      const T* nv = after_v;
      if (t + n < t1) {
        nk = kp + table[(t + n) / bs] * block_elems;
        nv = vp + table[(t + n) / bs] * block_elems;
      }
      fold(st, sh, kp + block * block_elems, vp + block * block_elems, offset, n, nk, nv, h0, h1);
      t += n;
    }
  };
  auto finish = [&](int64_t r, int64_t hq0, int64_t hq1, const float* acc, const float* l) {
    for (int64_t hq = hq0; hq < hq1; ++hq) {
      const float inv = 1.0f / l[hq];
      T* dst = op + (r * heads + hq) * dim;
      for (int64_t d = 0; d < dim; ++d) store(dst, d, acc[hq * dim + d] * inv);
    }
  };
  auto chunk_end = [&](int64_t t, int64_t len) { return std::min(len, (t / span + 1) * span); };

  const int64_t threads = at::get_num_threads();
  if (rows >= 2 * threads) {
    // Enough rows for every thread: one unit a row, its chunks folded in turn and merged as they end.
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      FlushDenormals ftz;
      DecodeScratch& mine = decode_scratch;
      const RowState st = scratch_for(mine.state);
      mine.merged.resize(heads * dim + 2 * heads);
      float* run_acc = mine.merged.data();
      float* run_m = run_acc + heads * dim;
      float* run_l = run_m + heads;
      for (int64_t r = begin; r < end; ++r) {
        load_queries(st, r, 0, sh.kv_heads);
        const int64_t first = firsts[r], len = lens[r];
        int64_t t0 = first;
        do {
          const int64_t t1 = chunk_end(t0, len);
          const T* ak = nullptr;
          const T* av = nullptr;
          if (t1 < len) {
            ak = kp + tables[r * width + t1 / bs] * block_elems;
            av = vp + tables[r * width + t1 / bs] * block_elems;
          } else if (r + 1 < end && firsts[r + 1] < lens[r + 1]) {
            ak = kp + tables[(r + 1) * width + firsts[r + 1] / bs] * block_elems;
            av = vp + tables[(r + 1) * width + firsts[r + 1] / bs] * block_elems;
          }
          fold_keys(st, r, 0, sh.kv_heads, t0, std::max(t0, t1), ak, av);
          if (t0 == first && t1 < len) {
            std::memcpy(run_acc, st.acc, sizeof(float) * heads * dim);
            std::memcpy(run_m, st.m, sizeof(float) * heads);
            std::memcpy(run_l, st.l, sizeof(float) * heads);
          } else if (t0 != first) {
            for (int64_t hq = 0; hq < heads; ++hq)
              merge_state(run_m[hq], run_l[hq], run_acc + hq * dim, st.m[hq], st.l[hq], st.acc + hq * dim, dim);
          }
          t0 = t1;
        } while (t0 < len);
        if (chunk_end(first, len) >= len) {
          finish(r, 0, heads, st.acc, st.l);
        } else {
          finish(r, 0, heads, run_acc, run_l);
        }
      }
    });
    return;
  }

  // Fewer rows than that (a batch-1 step): a unit is one KV head of one chunk of a row, so a lone row's
  // work spreads over every thread whatever its KV heads, and the units are dealt to the threads in even
  // shares of keys. A chunk's state goes to its slot; the last of a (row, KV head)'s chunks to finish merges
  // them in key order and writes the row's output.
  DecodeScratch& plan = decode_scratch;
  std::vector<ChunkUnit>& units = plan.units;
  std::vector<int64_t>& slot0 = plan.slot0;
  std::vector<int64_t>& chunks = plan.chunks;
  std::vector<int64_t>& owner_start = plan.owner_start;
  units.clear();
  slot0.assign(rows, -1);
  chunks.assign(rows, 1);
  int64_t slots = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t first = firsts[r], len = lens[r];
    if (first < len) chunks[r] = (len - 1) / span - first / span + 1;
    if (chunks[r] > 1) {
      slot0[r] = slots;
      slots += chunks[r];
    }
    for (int64_t h = 0; h < sh.kv_heads; ++h) {
      int64_t t0 = first;
      for (int64_t c = 0; c < chunks[r]; ++c) {
        const int64_t t1 = std::max(t0, chunk_end(t0, len));
        units.push_back({r, h, t0, t1, chunks[r] > 1 ? slot0[r] + c : -1});
        t0 = t1;
      }
    }
  }
  // Thread i takes the units whose middle key lies in the i-th share (a unit's cost: its keys and a block).
  const int64_t count = static_cast<int64_t>(units.size());
  owner_start.assign(threads + 1, count);
  {
    int64_t total = 0;
    for (const ChunkUnit& u : units) total += u.t1 - u.t0 + bs;
    int64_t before = 0, next = 0;
    for (int64_t i = 0; i < count; ++i) {
      const int64_t cost = units[i].t1 - units[i].t0 + bs;
      const int64_t owner = std::min(threads - 1, (2 * before + cost) * threads / (2 * total));
      while (next <= owner) owner_start[next++] = i;
      before += cost;
    }
  }
  plan.partial.resize(slots * heads * (dim + 2));
  float* part_acc = plan.partial.data();
  float* part_m = part_acc + slots * heads * dim;
  float* part_l = part_m + slots * heads;
  if (plan.done_size < rows * sh.kv_heads) {
    plan.done.reset(new std::atomic<int64_t>[rows * sh.kv_heads]);
    plan.done_size = rows * sh.kv_heads;
  }
  std::atomic<int64_t>* done = plan.done.get();
  for (int64_t i = 0; i < rows * sh.kv_heads; ++i) done[i].store(0, std::memory_order_relaxed);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    FlushDenormals ftz;
    const RowState st = scratch_for(decode_scratch.state);
    const int64_t last = owner_start[end];
    for (int64_t i = owner_start[begin]; i < last; ++i) {
      const ChunkUnit& u = units[i];
      const int64_t hq0 = u.h * group, hq1 = hq0 + group;
      const T* ak = nullptr;
      const T* av = nullptr;
      if (i + 1 < last && units[i + 1].t0 < units[i + 1].t1) {
        const ChunkUnit& nu = units[i + 1];
        ak = kp + tables[nu.r * width + nu.t0 / bs] * block_elems;
        av = vp + tables[nu.r * width + nu.t0 / bs] * block_elems;
      }
      if (i == owner_start[begin] || units[i - 1].r != u.r || units[i - 1].h != u.h) load_queries(st, u.r, u.h, u.h + 1);
      fold_keys(st, u.r, u.h, u.h + 1, u.t0, u.t1, ak, av);
      if (u.slot < 0) {
        finish(u.r, hq0, hq1, st.acc, st.l);
        continue;
      }
      std::memcpy(part_acc + (u.slot * heads + hq0) * dim, st.acc + hq0 * dim, sizeof(float) * group * dim);
      std::memcpy(part_m + u.slot * heads + hq0, st.m + hq0, sizeof(float) * group);
      std::memcpy(part_l + u.slot * heads + hq0, st.l + hq0, sizeof(float) * group);
      if (done[u.r * sh.kv_heads + u.h].fetch_add(1, std::memory_order_acq_rel) + 1 < chunks[u.r]) continue;
      // The (row, KV head)'s last chunk: merge every chunk into the first's slot, in key order.
      const int64_t s0 = slot0[u.r];
      for (int64_t c = 1; c < chunks[u.r]; ++c)
        for (int64_t hq = hq0; hq < hq1; ++hq)
          merge_state(part_m[s0 * heads + hq], part_l[s0 * heads + hq], part_acc + (s0 * heads + hq) * dim,
                      part_m[(s0 + c) * heads + hq], part_l[(s0 + c) * heads + hq],
                      part_acc + ((s0 + c) * heads + hq) * dim, dim);
      finish(u.r, hq0, hq1, part_acc + s0 * heads * dim, part_l + s0 * heads);
    }
  });
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_blocks, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        const at::Tensor& first_key, double scale, at::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [rows, heads, head_dim] with unit last stride");
  TORCH_CHECK(k_blocks.dim() == 4 && v_cache.dim() == 4 && k_blocks.is_contiguous() && v_cache.is_contiguous(),
              "caches must be contiguous: keys [blocks, kv_heads, head_dim, block_size], values [blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(k_blocks.size(0) == v_cache.size(0) && k_blocks.size(1) == v_cache.size(2) &&
                  k_blocks.size(2) == v_cache.size(3) && k_blocks.size(3) == v_cache.size(1), "key and value caches do not match");
  TORCH_CHECK(q.scalar_type() == k_blocks.scalar_type() && q.scalar_type() == v_cache.scalar_type() &&
                  q.scalar_type() == out.scalar_type(), "q, caches and out must share a dtype");
  TORCH_CHECK(k_blocks.size(2) == q.size(2) && q.size(1) % k_blocks.size(1) == 0, "head shapes do not match");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 && block_tables.is_contiguous() &&
                  block_tables.size(0) == q.size(0), "block_tables must be contiguous int64 [rows, width]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous() && seq_lens.numel() == q.size(0) &&
                  first_key.scalar_type() == at::kLong && first_key.is_contiguous() && first_key.numel() == q.size(0),
              "seq_lens and first_key must be contiguous int64 [rows]");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "out must be contiguous and shaped like q");
  switch (q.scalar_type()) {
    case at::kFloat: decode<float>(q, k_blocks, v_cache, block_tables, seq_lens, first_key, scale, out); break;
    case at::kBFloat16: decode<c10::BFloat16>(q, k_blocks, v_cache, block_tables, seq_lens, first_key, scale, out); break;
    case at::kHalf: decode<c10::Half>(q, k_blocks, v_cache, block_tables, seq_lens, first_key, scale, out); break;
    default: TORCH_CHECK(false, "unsupported dtype ", q.scalar_type());
  }
  return out;
}


// Store a step's keys (transposed into [kv_heads, dim, block_size] blocks) and values into their slots.
template <typename T>
void write_kv_impl(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_blocks, at::Tensor& v_cache, const at::Tensor& slots) {
  const int64_t tokens = k.size(0), kv_heads = k.size(1), dim = k.size(2), bs = k_blocks.size(3);
  const int64_t k_row = k.stride(0), k_head = k.stride(1), v_row = v.stride(0), v_head = v.stride(1);
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* kb = k_blocks.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  // A token's key touches one cache line per two head dims of each head (the layout is transposed):
  // ask for the next token's lines before storing this one's, so the misses overlap.
  const int64_t dims_per_line = std::max<int64_t>(1, 64 / (bs * static_cast<int64_t>(sizeof(T))));
  auto key_dst = [&](int64_t t, int64_t h) { return kb + ((sp[t] / bs * kv_heads + h) * dim) * bs + sp[t] % bs; };
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (t + 1 < end) {
        for (int64_t h = 0; h < kv_heads; ++h) {
          const T* next = key_dst(t + 1, h);
          for (int64_t d = 0; d < dim; d += dims_per_line) __builtin_prefetch(next + d * bs, 1, 3);
        }
      }
      for (int64_t h = 0; h < kv_heads; ++h) {
        const T* src_k = kp + t * k_row + h * k_head;
        T* dst_k = key_dst(t, h);
        for (int64_t d = 0; d < dim; ++d) dst_k[d * bs] = src_k[d];
        std::memcpy(vc + (sp[t] * kv_heads + h) * dim, vp + t * v_row + h * v_head, dim * sizeof(T));
      }
    }
  });
}

void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor k_blocks, at::Tensor v_cache, const at::Tensor& slots) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.stride(2) == 1 && v.stride(2) == 1,
              "k, v must be [tokens, kv_heads, head_dim] with unit last stride");
  TORCH_CHECK(k_blocks.is_contiguous() && v_cache.is_contiguous() && k_blocks.size(1) == k.size(1) &&
                  k_blocks.size(2) == k.size(2) && v_cache.size(2) == k.size(1) && v_cache.size(3) == k.size(2),
              "caches must be contiguous and match k's heads");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && k.scalar_type() == k_blocks.scalar_type() &&
                  k.scalar_type() == v_cache.scalar_type(), "k, v and the caches must share a dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == k.size(0),
              "slots must be contiguous int64 [tokens]");
  switch (k.scalar_type()) {
    case at::kFloat: write_kv_impl<float>(k, v, k_blocks, v_cache, slots); break;
    case at::kBFloat16: write_kv_impl<c10::BFloat16>(k, v, k_blocks, v_cache, slots); break;
    case at::kHalf: write_kv_impl<c10::Half>(k, v, k_blocks, v_cache, slots); break;
    default: TORCH_CHECK(false, "unsupported dtype ", k.scalar_type());
  }
}

// Hugging Face's RMSNorm with its rounding points, optionally after the residual add it follows:
// x += delta (rounded to T, as torch's add), then out = T(w * T(x / rms(x))), the norm in float32.
template <typename T>
void rms_norm_impl(at::Tensor& x, const at::Tensor* delta, const at::Tensor& weight, double eps, at::Tensor& out) {
  const int64_t rows = x.numel() / x.size(-1), n = x.size(-1);
  T* xp = x.data_ptr<T>();
  const T* dp = delta ? delta->data_ptr<T>() : nullptr;
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float e = static_cast<float>(eps);
#if defined(METRALE_AVX512)
  if (n % 16 == 0) {
    // The same arithmetic 16 lanes at a time: the stored sum is re-read for the second pass.
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        T* xr = xp + r * n;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i += 16) {
          __m512 v = load16(xr + i);
          if (dp) {
            v = round16<T>(_mm512_add_ps(v, load16(dp + r * n + i)));
            store16(xr + i, v);
          }
          acc = _mm512_fmadd_ps(v, v, acc);
        }
        const __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(n) + e));
        T* orow = op + r * n;
        for (int64_t i = 0; i < n; i += 16) {
          const __m512 normed = round16<T>(_mm512_mul_ps(load16(xr + i), inv));
          store16(orow + i, _mm512_mul_ps(load16(wp + i), normed));
        }
      }
    });
    return;
  }
#endif
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(n);
    for (int64_t r = begin; r < end; ++r) {
      T* xr = xp + r * n;
      float sumsq = 0.0f;
      for (int64_t i = 0; i < n; ++i) {
        float value = static_cast<float>(xr[i]);
        if (dp) {
          const T sum = static_cast<T>(value + static_cast<float>(dp[r * n + i]));
          xr[i] = sum;
          value = static_cast<float>(sum);
        }
        buf[i] = value;
      }
#pragma omp simd reduction(+ : sumsq)
      for (int64_t i = 0; i < n; ++i) sumsq += buf[i] * buf[i];
      const float inv = 1.0f / std::sqrt(sumsq / static_cast<float>(n) + e);
      T* orow = op + r * n;
      for (int64_t i = 0; i < n; ++i) {
        const T normed = static_cast<T>(buf[i] * inv);
        orow[i] = static_cast<T>(static_cast<float>(wp[i]) * static_cast<float>(normed));
      }
    }
  });
}

void rms_norm(at::Tensor x, const std::optional<at::Tensor>& delta, const at::Tensor& weight, double eps, at::Tensor out) {
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && out.sizes() == x.sizes() && weight.is_contiguous() &&
                  weight.numel() == x.size(-1), "x, out contiguous and alike; weight [hidden]");
  TORCH_CHECK(!delta || (delta->is_contiguous() && delta->sizes() == x.sizes()), "delta must be contiguous and shaped like x");
  TORCH_CHECK(x.scalar_type() == out.scalar_type() && x.scalar_type() == weight.scalar_type() &&
                  (!delta || delta->scalar_type() == x.scalar_type()), "x, delta, weight and out must share a dtype");
  const at::Tensor* d = delta ? &*delta : nullptr;
  switch (x.scalar_type()) {
    case at::kFloat: rms_norm_impl<float>(x, d, weight, eps, out); break;
    case at::kBFloat16: rms_norm_impl<c10::BFloat16>(x, d, weight, eps, out); break;
    case at::kHalf: rms_norm_impl<c10::Half>(x, d, weight, eps, out); break;
    default: TORCH_CHECK(false, "unsupported dtype ", x.scalar_type());
  }
}

// silu(gate) * up for gate_up [rows, 2n] (the stacked MLP projection), with torch's rounding points:
// silu in float32, rounded to T, times up in float32, rounded to T. One pass instead of two ops.
inline float silu_scalar(float x) { return x / (1.0f + std::exp(-x)); }


template <typename T>
void silu_mul_impl(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t rows = out.size(0), n = out.size(1), row_stride = gate_up.stride(0);
  const T* gp = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 8192 / std::max<int64_t>(n, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = gp + r * row_stride;
      const T* up = gate + n;
      T* dst = op + r * n;
      int64_t i = 0;
#if defined(METRALE_AVX512)
      const __m512 one = _mm512_set1_ps(1.0f);
      for (; i + 16 <= n; i += 16) {
        const __m512 x = load16(gate + i);
        const __m512 s = round16<T>(_mm512_div_ps(x, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), x)))));
        store16(dst + i, _mm512_mul_ps(s, load16(up + i)));
      }
#elif defined(METRALE_AVX2)
      // x * sigmoid(x) with the exponent always of -|x| (exp8 takes x <= 0): 1 / (1 + e) or e / (1 + e).
      const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
      for (; i + 8 <= n; i += 8) {
        const __m256 x = load8(gate + i);
        const __m256 e = exp8(_mm256_or_ps(x, sign));
        const __m256 sig = _mm256_div_ps(_mm256_blendv_ps(one, e, x), _mm256_add_ps(one, e));
        const __m256 s = round8<T>(_mm256_mul_ps(x, sig));
        store8(dst + i, _mm256_mul_ps(s, load8(up + i)));
      }
#endif
      for (; i < n; ++i) {
        const T s = static_cast<T>(silu_scalar(load(gate, i)));
        store(dst, i, static_cast<float>(s) * load(up, i));
      }
    }
  });
}

void silu_mul(const at::Tensor& gate_up, at::Tensor out) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gate_up must be [rows, 2n] with unit last stride");
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == gate_up.size(0) && out.size(1) * 2 == gate_up.size(1) &&
                  out.scalar_type() == gate_up.scalar_type(), "out must be contiguous [rows, n] in gate_up's dtype");
  switch (gate_up.scalar_type()) {
    case at::kFloat: silu_mul_impl<float>(gate_up, out); break;
    case at::kBFloat16: silu_mul_impl<c10::BFloat16>(gate_up, out); break;
    case at::kHalf: silu_mul_impl<c10::Half>(gate_up, out); break;
    default: TORCH_CHECK(false, "unsupported dtype ", gate_up.scalar_type());
  }
}

// Rotary embedding in place on x [T, heads, dim] (any token/head strides): x * cos + rotate_half(x) * sin
// with torch's rounding points (each product rounded to T, then their sum), from a [len, 2, dim] table
// of cos and signed sin (sin with its first half negated, so rotate_half needs no negation).
template <typename T>
void rotary_impl(at::Tensor& x, const at::Tensor& table, const at::Tensor& positions) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  const int64_t x_tok = x.stride(0), x_head = x.stride(1);
  T* xp = x.data_ptr<T>();
  const T* tp = table.data_ptr<T>();
  const int64_t* pp = positions.data_ptr<int64_t>();
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> lo(half), hi(half);
    for (int64_t t = begin; t < end; ++t) {
      const T* cos = tp + pp[t] * 2 * dim;
      const T* sin = cos + dim;
      for (int64_t h = 0; h < heads; ++h) {
        T* row = xp + t * x_tok + h * x_head;
        for (int64_t i = 0; i < half; ++i) {
          lo[i] = load(row, i);
          hi[i] = load(row, half + i);
        }
        for (int64_t i = 0; i < half; ++i) {
          const T a = static_cast<T>(lo[i] * load(cos, i)), b = static_cast<T>(hi[i] * load(sin, i));
          const T c = static_cast<T>(hi[i] * load(cos, half + i)), d = static_cast<T>(lo[i] * load(sin, half + i));
          store(row, i, static_cast<float>(a) + static_cast<float>(b));
          store(row, half + i, static_cast<float>(c) + static_cast<float>(d));
        }
      }
    }
  });
}

void rotary(at::Tensor x, const at::Tensor& table, const at::Tensor& positions) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "x must be [tokens, heads, dim] with unit last stride");
  TORCH_CHECK(table.dim() == 3 && table.is_contiguous() && table.size(1) == 2 && table.size(2) == x.size(2) &&
                  table.scalar_type() == x.scalar_type(), "table must be contiguous [len, 2, dim] in x's dtype");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == x.size(0),
              "positions must be contiguous int64 [tokens]");
  switch (x.scalar_type()) {
    case at::kFloat: rotary_impl<float>(x, table, positions); break;
    case at::kBFloat16: rotary_impl<c10::BFloat16>(x, table, positions); break;
    case at::kHalf: rotary_impl<c10::Half>(x, table, positions); break;
    default: TORCH_CHECK(false, "unsupported dtype ", x.scalar_type());
  }
}

// One row's argmax, the first index among equal maxima (what torch's max(dim).indices gives); float32
// or bfloat16 rows (a bf16 model's logits need no float32 copy to be argmaxed: the conversion is exact).
#if defined(METRALE_AVX512)
// Fold one 16-wide block at `pos` into a lane-wise (top, at): strictly greater replaces, so each lane
// keeps the first position of its largest value.
template <typename T>
inline void argmax_fold(const T* row, int64_t i, __m512i pos, __m512& top, __m512i& at) {
  const __m512 v = load16(row + i);
  const __mmask16 gt = _mm512_cmp_ps_mask(v, top, _CMP_GT_OQ);
  top = _mm512_mask_mov_ps(top, gt, v);
  at = _mm512_mask_mov_epi32(at, gt, pos);
}
#endif

template <typename T>
int64_t argmax_row(const T* row, int64_t n) {
  int64_t i = 0, best_at = 0;
  float best = -INFINITY;
#if defined(METRALE_AVX512)
  if (n >= 64) {
    // Four independent accumulators over interleaved 16-wide blocks: one accumulator's compare ->
    // move chain is a loop-carried dependency, four keep the core's vector units busy (~2x faster).
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 top[4];
    __m512i at[4];
    for (int a = 0; a < 4; ++a) {
      top[a] = load16(row + 16 * a);
      at[a] = _mm512_add_epi32(lane, _mm512_set1_epi32(16 * a));
    }
    __m512i pos = lane;
    const __m512i step = _mm512_set1_epi32(16);
    for (i = 64; i + 64 <= n; i += 64) {
      // The logits were just written by the lm_head product and are out of cache by now: fetch ahead
      // (each iteration reads 64 values, sizeof(T) cache lines; 168 -> 140 us for 32 x 32,000 bf16).
      for (int line = 0; line < int(sizeof(T)); ++line)
        _mm_prefetch(reinterpret_cast<const char*>(row + i) + 2048 + 64 * line, _MM_HINT_T0);
      pos = _mm512_add_epi32(pos, _mm512_set1_epi32(64));
      argmax_fold(row, i, pos, top[0], at[0]);
      argmax_fold(row, i + 16, _mm512_add_epi32(pos, step), top[1], at[1]);
      argmax_fold(row, i + 32, _mm512_add_epi32(pos, _mm512_set1_epi32(32)), top[2], at[2]);
      argmax_fold(row, i + 48, _mm512_add_epi32(pos, _mm512_set1_epi32(48)), top[3], at[3]);
    }
    for (; i + 16 <= n; i += 16) argmax_fold(row, i, _mm512_add_epi32(lane, _mm512_set1_epi32(int32_t(i))), top[0], at[0]);
    // Across accumulators and lanes: the largest value, the smallest position among equals.
    alignas(64) float tops[64];
    alignas(64) int32_t ats[64];
    for (int a = 0; a < 4; ++a) {
      _mm512_store_ps(tops + 16 * a, top[a]);
      _mm512_store_si512(reinterpret_cast<__m512i*>(ats + 16 * a), at[a]);
    }
    best = tops[0];
    best_at = ats[0];
    for (int l = 1; l < 64; ++l) {
      if (tops[l] > best || (tops[l] == best && ats[l] < best_at)) {
        best = tops[l];
        best_at = ats[l];
      }
    }
  }
#endif
#if defined(METRALE_AVX2) && !defined(METRALE_AVX512)
  if (n >= 32) {
    // As the AVX-512 loop: four accumulators over interleaved 8-wide blocks.
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 top[4];
    __m256i at[4];
    for (int a = 0; a < 4; ++a) {
      top[a] = load8(row + 8 * a);
      at[a] = _mm256_add_epi32(lane, _mm256_set1_epi32(8 * a));
    }
    auto fold = [&](int a, int64_t from) {
      const __m256 v = load8(row + from);
      const __m256 gt = _mm256_cmp_ps(v, top[a], _CMP_GT_OQ);
      top[a] = _mm256_blendv_ps(top[a], v, gt);
      at[a] = _mm256_blendv_epi8(at[a], _mm256_add_epi32(lane, _mm256_set1_epi32(int32_t(from))), _mm256_castps_si256(gt));
    };
    for (i = 32; i + 32 <= n; i += 32) {
      for (int line = 0; line < int(sizeof(T)) / 2; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(row + i) + 2048 + 64 * line, _MM_HINT_T0);
      for (int a = 0; a < 4; ++a) fold(a, i + 8 * a);
    }
    for (; i + 8 <= n; i += 8) fold(0, i);
    alignas(32) float tops[32];
    alignas(32) int32_t ats[32];
    for (int a = 0; a < 4; ++a) {
      _mm256_store_ps(tops + 8 * a, top[a]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(ats + 8 * a), at[a]);
    }
    best = tops[0];
    best_at = ats[0];
    for (int l = 1; l < 32; ++l) {
      if (tops[l] > best || (tops[l] == best && ats[l] < best_at)) {
        best = tops[l];
        best_at = ats[l];
      }
    }
  }
#endif
  for (; i < n; ++i) {
    if (load(row, i) > best) {
      best = load(row, i);
      best_at = i;
    }
  }
  return best_at;
}

template <typename T>
void argmax_rows_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0), n = x.size(1);
  const T* xp = x.data_ptr<T>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * n, n);
  });
}

void argmax_rows(const at::Tensor& x, at::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be contiguous float32 or bfloat16 [rows, n]");
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kLong && out.numel() == x.size(0), "out must be int64 [rows]");
  TORCH_CHECK(x.size(1) < (int64_t{1} << 31), "rows longer than 2^31 are not supported");
  if (x.scalar_type() == at::kFloat) argmax_rows_impl<float>(x, out);
  else argmax_rows_impl<c10::BFloat16>(x, out);
}
}  // namespace

METRALE_LIBRARY(m) {
  m.def("paged_decode(Tensor q, Tensor k_blocks, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor first_key, float scale, Tensor(a!) out) -> Tensor(a!)");
  m.impl("paged_decode", c10::DispatchKey::CPU, TORCH_FN(paged_decode));
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_blocks, Tensor(b!) v_cache, Tensor slots) -> ()");
  m.impl("write_kv", c10::DispatchKey::CPU, TORCH_FN(write_kv));
  m.def("rms_norm(Tensor(a!) x, Tensor? delta, Tensor weight, float eps, Tensor(b!) out) -> ()");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.def("rotary(Tensor(a!) x, Tensor table, Tensor positions) -> ()");
  m.impl("rotary", c10::DispatchKey::CPU, TORCH_FN(rotary));
  m.def("silu_mul(Tensor gate_up, Tensor(a!) out) -> ()");
  m.impl("silu_mul", c10::DispatchKey::CPU, TORCH_FN(silu_mul));
  m.def("argmax_rows(Tensor x, Tensor(a!) out) -> ()");
  m.impl("argmax_rows", c10::DispatchKey::CPU, TORCH_FN(argmax_rows));
}
