// The quantized products of layers/quantization.py: int8 weights in blocks of 32 inputs (GGUF's Q8_0) and
// 4-bit codes in groups of 32 with a scale and an offset each (Q4_0 / Q4_1 / Q4_K), multiplied as llama.cpp
// does: each input row is quantized on the fly to int8 in blocks of 32 (scale = block absmax / 127, rounded
// half to even), every block's dot product is exact in int32, and the blocks are summed in float32 with their
// two scales. quantization.py's `quantize_activations` is the same rounding in torch, and its reference runs
// the same integers dense (see there).
//
// Weight layout (quantization.py's pack_int8 / pack_int4 build it, the same for every class): output rows in
// panels of 16; within a panel, inputs in groups of 4, each group the 16 rows' 4 bytes side by side:
// [panels][in / 4][16][4] (the layout of VNNI's and AMX's int8 products: one 64-byte line is one group for
// all 16 rows, so a panel is one sequential stream and no sum is ever reduced across lanes). 4-bit codes put
// two consecutive groups in one byte line (low nibble the first). Per panel and block of 32 inputs, the 16
// rows' scales (int8: fp16 as in Q8_0; 4-bit: a scale and an offset, fp16 where they are exact in it, else
// float32) lie side by side too.
//
// Per class: AVX-512 VNNI multiplies unsigned by signed bytes, so an int8 weight is flipped to w + 128 (one
// xor) and each block's sum starts at -128 * (sum of the block's activation codes); 4-bit codes are unsigned
// already. AVX2 has no VNNI: llama.cpp's sign trick (|w| times x with w's sign, pairs summed to int16 by
// maddubs, which cannot saturate with both below 128) and madd to int32; 4-bit products are small enough to
// sum a whole block in int16 first. Generic: plain loops. On the amx class, many bf16 rows (`wide`, a prefill)
// instead take the weight dequantized to bf16 through AMX tiles (see there).

#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define METRALE_AMX 1
#endif

namespace {

constexpr int kPanel = 16;  // output rows per panel
constexpr int kBlock = 32;  // inputs per scale block
// How far ahead of its reads a decode product asks for a panel's lines: one sequential stream per panel
// leaves the hardware prefetcher too few lines in flight to keep the memory busy.
constexpr int kPrefetchBytes = 1024;

inline void prefetch(const void* p) {
#if defined(__SSE__)
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
#endif
}

// One input row quantized: codes [kp], per block its scale and the sum of its codes, and the sums of each half
// block (the K-quant products' sub-blocks of 16).
struct QuantRows {
  std::vector<int8_t> codes;
  std::vector<float> scale;
  std::vector<int32_t> sum;
  std::vector<int32_t> sum16;
  void resize(int64_t m, int64_t kp) {
    if ((int64_t)codes.size() < m * kp) codes.resize(m * kp);
    if ((int64_t)scale.size() < m * kp / kBlock) {
      scale.resize(m * kp / kBlock);
      sum.resize(m * kp / kBlock);
      sum16.resize(2 * m * kp / kBlock);
    }
  }
};

// The activations' scratch, reused across calls (a thread calls one product at a time).
QuantRows& scratch() {
  static thread_local QuantRows rows;
  return rows;
}

template <typename T>
inline float to_float(T v) {
  return static_cast<float>(v);
}

#if defined(METRALE_AVX2)
inline int32_t hsum8(__m256i v) {
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
  return _mm_cvtsi128_si32(s4);
}
#endif

// One block of 32 floats quantized: its codes into out, its scale d = absmax / 127, the sum of its codes and of
// each half's. code = round_half_even(v * (1 / d)), 0 for a block of zeros: exactly quantization.py's
// quantize_activations.
inline void quantize_block(const float* v, int8_t* out, float& scale, int32_t& sum, int32_t* half) {
#if defined(METRALE_AVX2)
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 f[4], amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    f[i] = _mm256_loadu_ps(v + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, f[i]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  const float d = _mm_cvtss_f32(m4) / 127.0f;
  const __m256 id = _mm256_set1_ps(d > 0.f ? 1.0f / d : 0.f);
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(f[i], id));  // MXCSR's default: half to even
  // Pack to bytes (the packs interleave 128-bit lanes; the permute puts them back in order).
  const __m256i w16 = _mm256_packs_epi32(q[0], q[1]), z16 = _mm256_packs_epi32(q[2], q[3]);
  const __m256i b8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w16, z16), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256((__m256i*)out, b8);
  scale = d;
  half[0] = hsum8(_mm256_add_epi32(q[0], q[1]));
  half[1] = hsum8(_mm256_add_epi32(q[2], q[3]));
  sum = half[0] + half[1];
#else
  float amax = 0.f;
  for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(v[i]));
  const float d = amax / 127.0f;
  const float id = d > 0.f ? 1.0f / d : 0.f;
  half[0] = half[1] = 0;
  for (int i = 0; i < kBlock; ++i) {
    const float c = std::nearbyint(v[i] * id);  // the default rounding mode: half to even, as torch.round
    out[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, c)));
    half[i / 16] += out[i];
  }
  scale = d;
  sum = half[0] + half[1];
#endif
}


// Block b of row r as float32: in place where it is whole float32, else widened (zeros past k) into buf.
inline const float* block_floats(const float* x, int64_t k, int64_t at, float* buf) {
  if (at + kBlock <= k) return x + at;
  for (int64_t i = 0; i < kBlock; ++i) buf[i] = at + i < k ? x[at + i] : 0.f;
  return buf;
}

inline const float* block_floats(const c10::BFloat16* x, int64_t k, int64_t at, float* buf) {
#if defined(METRALE_AVX2)
  if (at + kBlock <= k) {
    for (int i = 0; i < 4; ++i) {  // a bf16 is the high half of its float32
      const __m128i h = _mm_loadu_si128((const __m128i*)(x + at + 8 * i));
      _mm256_storeu_ps(buf + 8 * i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
    }
    return buf;
  }
#endif
  for (int64_t i = 0; i < kBlock; ++i) buf[i] = at + i < k ? static_cast<float>(x[at + i]) : 0.f;
  return buf;
}

inline const float* block_floats(const c10::Half* x, int64_t k, int64_t at, float* buf) {
#if defined(METRALE_AVX2)
  if (at + kBlock <= k) {
    for (int i = 0; i < 4; ++i)  // F16C: eight halves to eight floats, exactly
      _mm256_storeu_ps(buf + 8 * i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(x + at + 8 * i))));
    return buf;
  }
#endif
  for (int64_t i = 0; i < kBlock; ++i) buf[i] = at + i < k ? static_cast<float>(x[at + i]) : 0.f;
  return buf;
}

// Quantize x [M, k] into q (row stride kp, zeros past k); rows spread over the threads in chunks big enough to
// be worth a thread.
template <typename T>
void quantize_rows(const T* x, int64_t m, int64_t k, int64_t kp, QuantRows& q) {
  const int64_t blocks = kp / kBlock;
  at::parallel_for(0, m, std::max<int64_t>(1, 32768 / kp), [&](int64_t m0, int64_t m1) {
    float buf[kBlock];
    for (int64_t r = m0; r < m1; ++r)
      for (int64_t b = 0; b < blocks; ++b)
        quantize_block(block_floats(x + r * k, k, b * kBlock, buf), q.codes.data() + r * kp + b * kBlock, q.scale[r * blocks + b],
                       q.sum[r * blocks + b], q.sum16.data() + 2 * (r * blocks + b));
  });
}

void quantize_input(const at::Tensor& x, int64_t kp, QuantRows& q) {
  const int64_t m = x.size(0), k = x.size(1);
  q.resize(m, kp);
  if (x.scalar_type() == at::kBFloat16)
    quantize_rows(x.data_ptr<c10::BFloat16>(), m, k, kp, q);
  else if (x.scalar_type() == at::kHalf)
    quantize_rows(x.data_ptr<c10::Half>(), m, k, kp, q);
  else
    quantize_rows(x.data_ptr<float>(), m, k, kp, q);
}

inline float half_to_float(uint16_t h) {
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

// A 4-bit product's per-block scales and offsets are float32, or fp16 (as its bits) where they are exact in it.
inline float scalar_of(const float* p) { return *p; }
inline float scalar_of(const uint16_t* p) { return half_to_float(*p); }
#if defined(METRALE_AVX512)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
#endif
#if defined(METRALE_AVX2)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
#endif

// ---- int8 ---------------------------------------------------------------------------------------------

// out[m][r] (r < 16 per panel, NP panels) of MR input rows against NP consecutive panels.
#if defined(METRALE_AVX512) && defined(__AVX512VNNI__)
template <int MR, int NP>
void int8_panels(const int8_t* w, const uint16_t* ws, int64_t blocks, const QuantRows& q, int64_t m0, int64_t kp, float* out) {
  const int64_t panel_bytes = blocks * kBlock * kPanel;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[MR][NP];
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i isum[MR][NP];
    for (int m = 0; m < MR; ++m) {
      const __m512i start = _mm512_set1_epi32(-128 * q.sum[(m0 + m) * blocks + b]);
      for (int p = 0; p < NP; ++p) isum[m][p] = start;
    }
    const int8_t* xb = q.codes.data() + m0 * kp + b * kBlock;
    for (int g = 0; g < kBlock / 4; ++g) {
      __m512i wv[NP];
      for (int p = 0; p < NP; ++p) {
        const int8_t* line = w + p * panel_bytes + (b * 8 + g) * 64;
        prefetch(line + kPrefetchBytes);
        wv[p] = _mm512_xor_si512(_mm512_loadu_si512(line), flip);
      }
      for (int m = 0; m < MR; ++m) {
        int32_t x4;
        std::memcpy(&x4, xb + m * kp + g * 4, 4);
        const __m512i xv = _mm512_set1_epi32(x4);
        for (int p = 0; p < NP; ++p) isum[m][p] = _mm512_dpbusd_epi32(isum[m][p], wv[p], xv);
      }
    }
    for (int p = 0; p < NP; ++p) {
      const __m512 sw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(ws + p * blocks * kPanel + b * kPanel)));
      for (int m = 0; m < MR; ++m) {
        const __m512 s = _mm512_mul_ps(sw, _mm512_set1_ps(q.scale[(m0 + m) * blocks + b]));
        acc[m][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[m][p]), s, acc[m][p]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < NP; ++p) _mm512_storeu_ps(out + m * NP * kPanel + p * kPanel, acc[m][p]);
}
constexpr int kInt8MaxRows = 4;
#elif defined(METRALE_AVX2)
// A panel's 16 rows as two halves of 8 (one 32-byte half-line each).
template <int MR, int NP>
void int8_panels(const int8_t* w, const uint16_t* ws, int64_t blocks, const QuantRows& q, int64_t m0, int64_t kp, float* out) {
  static_assert(NP == 1, "AVX2 has registers for one panel");
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i isum[MR][2];
    for (int m = 0; m < MR; ++m) isum[m][0] = isum[m][1] = _mm256_setzero_si256();
    const int8_t* xb = q.codes.data() + m0 * kp + b * kBlock;
    for (int g = 0; g < kBlock / 4; ++g) {
      const int8_t* line = w + (b * 8 + g) * 64;
      prefetch(line + kPrefetchBytes);
      __m256i wv[2], wabs[2];
      for (int h = 0; h < 2; ++h) {
        wv[h] = _mm256_loadu_si256((const __m256i*)(line + 32 * h));
        wabs[h] = _mm256_sign_epi8(wv[h], wv[h]);
      }
      for (int m = 0; m < MR; ++m) {
        int32_t x4;
        std::memcpy(&x4, xb + m * kp + g * 4, 4);
        const __m256i xv = _mm256_set1_epi32(x4);
        for (int h = 0; h < 2; ++h) {
          const __m256i pairs = _mm256_maddubs_epi16(wabs[h], _mm256_sign_epi8(xv, wv[h]));
          isum[m][h] = _mm256_add_epi32(isum[m][h], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 sw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(ws + b * kPanel + 8 * h)));
      for (int m = 0; m < MR; ++m) {
        const __m256 s = _mm256_mul_ps(sw, _mm256_set1_ps(q.scale[(m0 + m) * blocks + b]));
        acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[m][h]), s, acc[m][h]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + m * kPanel + 8 * h, acc[m][h]);
}
constexpr int kInt8MaxRows = 2;
#else
template <int MR, int NP>
void int8_panels(const int8_t* w, const uint16_t* ws, int64_t blocks, const QuantRows& q, int64_t m0, int64_t kp, float* out) {
  const int64_t panel_bytes = blocks * kBlock * kPanel;
  for (int m = 0; m < MR; ++m) {
    for (int p = 0; p < NP; ++p) {
      float acc[kPanel] = {};
      for (int64_t b = 0; b < blocks; ++b) {
        int32_t isum[kPanel] = {};
        const int8_t* xb = q.codes.data() + (m0 + m) * kp + b * kBlock;
        for (int g = 0; g < kBlock / 4; ++g) {
          const int8_t* line = w + p * panel_bytes + (b * 8 + g) * 64;
          for (int r = 0; r < kPanel; ++r)
            for (int j = 0; j < 4; ++j) isum[r] += int32_t(line[r * 4 + j]) * xb[g * 4 + j];
        }
        const float xs = q.scale[(m0 + m) * blocks + b];
        for (int r = 0; r < kPanel; ++r)
          acc[r] += float(isum[r]) * (half_to_float(ws[p * blocks * kPanel + b * kPanel + r]) * xs);
      }
      std::memcpy(out + m * NP * kPanel + p * kPanel, acc, sizeof(acc));
    }
  }
}
constexpr int kInt8MaxRows = 4;
#endif

// ---- 4-bit --------------------------------------------------------------------------------------------

#if defined(METRALE_AVX512) && defined(__AVX512VNNI__)
template <int MR, int NP, typename S>
void int4_panels(const uint8_t* w, const S* ws, const S* wz, int64_t blocks, const QuantRows& q, int64_t m0, int64_t kp,
                 float* out) {
  const int64_t panel_bytes = blocks * kBlock * kPanel / 2;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[MR][NP];
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i isum[MR][NP];
    for (int m = 0; m < MR; ++m)
      for (int p = 0; p < NP; ++p) isum[m][p] = _mm512_setzero_si512();
    const int8_t* xb = q.codes.data() + m0 * kp + b * kBlock;
    for (int g = 0; g < kBlock / 8; ++g) {
      __m512i lo[NP], hi[NP];
      for (int p = 0; p < NP; ++p) {
        const uint8_t* line = w + p * panel_bytes + (b * 4 + g) * 64;
        prefetch(line + kPrefetchBytes);
        const __m512i v = _mm512_loadu_si512(line);
        lo[p] = _mm512_and_si512(v, low);
        hi[p] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
      for (int m = 0; m < MR; ++m) {
        int32_t x4[2];
        std::memcpy(x4, xb + m * kp + g * 8, 8);
        const __m512i x0 = _mm512_set1_epi32(x4[0]), x1 = _mm512_set1_epi32(x4[1]);
        for (int p = 0; p < NP; ++p) isum[m][p] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(isum[m][p], lo[p], x0), hi[p], x1);
      }
    }
    for (int p = 0; p < NP; ++p) {
      const __m512 sw = load16(ws + p * blocks * kPanel + b * kPanel);
      const __m512 zw = load16(wz + p * blocks * kPanel + b * kPanel);
      for (int m = 0; m < MR; ++m) {
        const float xs = q.scale[(m0 + m) * blocks + b];
        const __m512 s = _mm512_mul_ps(sw, _mm512_set1_ps(xs));
        acc[m][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[m][p]), s, acc[m][p]);
        acc[m][p] = _mm512_fmadd_ps(zw, _mm512_set1_ps(xs * float(q.sum[(m0 + m) * blocks + b])), acc[m][p]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < NP; ++p) _mm512_storeu_ps(out + m * NP * kPanel + p * kPanel, acc[m][p]);
}
#elif defined(METRALE_AVX2)
template <int MR, int NP, typename S>
void int4_panels(const uint8_t* w, const S* ws, const S* wz, int64_t blocks, const QuantRows& q, int64_t m0, int64_t kp,
                 float* out) {
  static_assert(NP == 1, "AVX2 has registers for one panel");
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    // A whole block sums in int16: maddubs's pairs are at most 2 * 15 * 127 each, and a block's eight fit.
    __m256i psum[MR][2];
    for (int m = 0; m < MR; ++m) psum[m][0] = psum[m][1] = _mm256_setzero_si256();
    const int8_t* xb = q.codes.data() + m0 * kp + b * kBlock;
    for (int g = 0; g < kBlock / 8; ++g) {
      const uint8_t* line = w + (b * 4 + g) * 64;
      prefetch(line + kPrefetchBytes);
      __m256i lo[2], hi[2];
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(line + 32 * h));
        lo[h] = _mm256_and_si256(v, low);
        hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      }
      for (int m = 0; m < MR; ++m) {
        int32_t x4[2];
        std::memcpy(x4, xb + m * kp + g * 8, 8);
        const __m256i x0 = _mm256_set1_epi32(x4[0]), x1 = _mm256_set1_epi32(x4[1]);
        for (int h = 0; h < 2; ++h)
          psum[m][h] = _mm256_add_epi16(psum[m][h], _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], x0), _mm256_maddubs_epi16(hi[h], x1)));
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 sw = load8(ws + b * kPanel + 8 * h);
      const __m256 zw = load8(wz + b * kPanel + 8 * h);
      for (int m = 0; m < MR; ++m) {
        const float xs = q.scale[(m0 + m) * blocks + b];
        const __m256i isum = _mm256_madd_epi16(psum[m][h], ones);
        acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(sw, _mm256_set1_ps(xs)), acc[m][h]);
        acc[m][h] = _mm256_fmadd_ps(zw, _mm256_set1_ps(xs * float(q.sum[(m0 + m) * blocks + b])), acc[m][h]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + m * kPanel + 8 * h, acc[m][h]);
}
#else
template <int MR, int NP, typename S>
void int4_panels(const uint8_t* w, const S* ws, const S* wz, int64_t blocks, const QuantRows& q, int64_t m0, int64_t kp,
                 float* out) {
  const int64_t panel_bytes = blocks * kBlock * kPanel / 2;
  for (int m = 0; m < MR; ++m) {
    for (int p = 0; p < NP; ++p) {
      float acc[kPanel] = {};
      for (int64_t b = 0; b < blocks; ++b) {
        int32_t isum[kPanel] = {};
        const int8_t* xb = q.codes.data() + (m0 + m) * kp + b * kBlock;
        for (int g = 0; g < kBlock / 8; ++g) {
          const uint8_t* line = w + p * panel_bytes + (b * 4 + g) * 64;
          for (int r = 0; r < kPanel; ++r)
            for (int j = 0; j < 4; ++j)
              isum[r] += int32_t(line[r * 4 + j] & 15) * xb[g * 8 + j] + int32_t(line[r * 4 + j] >> 4) * xb[g * 8 + 4 + j];
        }
        const float xs = q.scale[(m0 + m) * blocks + b];
        const float xsum = xs * float(q.sum[(m0 + m) * blocks + b]);
        const int64_t at = p * blocks * kPanel + b * kPanel;
        for (int r = 0; r < kPanel; ++r) {
          acc[r] += float(isum[r]) * (scalar_of(ws + at + r) * xs);
          acc[r] += scalar_of(wz + at + r) * xsum;
        }
      }
      std::memcpy(out + m * NP * kPanel + p * kPanel, acc, sizeof(acc));
    }
  }
}
#endif

#if defined(METRALE_AVX2) && !(defined(METRALE_AVX512) && defined(__AVX512VNNI__))
constexpr int kPanelsPerStep = 1;  // AVX2: 16 registers hold one panel's sums
#else
constexpr int kPanelsPerStep = 2;  // two independent chains of products per input row
#endif
constexpr int kRowsPerStep = kInt8MaxRows;

// Write the tile out[MR rows][NP * 16] (float32 sums) into y [M, n] at (m0, first output row o0).
template <typename T>
void store_tile(const float* tile, int mr, int np, T* y, int64_t n, int64_t m0, int64_t o0) {
  const int64_t cols = std::min<int64_t>(int64_t(np) * kPanel, n - o0);
  for (int m = 0; m < mr; ++m)
    for (int64_t c = 0; c < cols; ++c) y[(m0 + m) * n + o0 + c] = T(tile[m * np * kPanel + c]);
}

// A tile into y in y's dtype (x's: float32, bfloat16 or float16).
inline void store_rows(const float* tile, int mr, int np, at::Tensor& y, int64_t n, int64_t m0, int64_t o0) {
  switch (y.scalar_type()) {
    case at::kBFloat16: store_tile(tile, mr, np, y.data_ptr<c10::BFloat16>(), n, m0, o0); break;
    case at::kHalf: store_tile(tile, mr, np, y.data_ptr<c10::Half>(), n, m0, o0); break;
    default: store_tile(tile, mr, np, y.data_ptr<float>(), n, m0, o0); break;
  }
}

// Dispatch MR in 1..kRowsPerStep at compile time.
template <template <int, int> class F, int NP, typename... A>
void with_rows(int mr, A&&... a) {
  switch (mr) {
    case 1: F<1, NP>::run(a...); break;
    case 2: F<(kRowsPerStep >= 2 ? 2 : 1), NP>::run(a...); break;
    case 3: F<(kRowsPerStep >= 3 ? 3 : 1), NP>::run(a...); break;
    default: F<(kRowsPerStep >= 4 ? 4 : 1), NP>::run(a...); break;
  }
}

template <int MR, int NP>
struct Int8Tile {
  static void run(const int8_t* w, const uint16_t* ws, int64_t blocks, const QuantRows& q, int64_t m0, int64_t kp, float* out) {
    int8_panels<MR, NP>(w, ws, blocks, q, m0, kp, out);
  }
};

template <int MR, int NP>
struct Int4Tile {
  template <typename S>
  static void run(const uint8_t* w, const S* ws, const S* wz, int64_t blocks, const QuantRows& q, int64_t m0, int64_t kp, float* out) {
    int4_panels<MR, NP>(w, ws, wz, blocks, q, m0, kp, out);
  }
};

// Each task takes a run of panels (kPanelsPerStep at a time) and, for each, every input row kRowsPerStep at
// a time: the panels' lines stay in cache while all rows use them.
template <typename Tile>
void over_tiles(int64_t m, int64_t n, Tile&& tile) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const int64_t steps = (panels + kPanelsPerStep - 1) / kPanelsPerStep;
  at::parallel_for(0, steps, 1, [&](int64_t begin, int64_t end) {
    float buf[kRowsPerStep * kPanelsPerStep * kPanel];
    for (int64_t s = begin; s < end; ++s) {
      const int64_t p0 = s * kPanelsPerStep;
      const int np = int(std::min<int64_t>(kPanelsPerStep, panels - p0));
      for (int64_t m0 = 0; m0 < m; m0 += kRowsPerStep) {
        const int mr = int(std::min<int64_t>(kRowsPerStep, m - m0));
        tile(p0, np, m0, mr, buf);
      }
    }
  });
}


// ---- many rows on AMX: the weight dequantized to bf16 a panel pair at a time, AMX-BF16 tiles --------------
//
// At a prefill's rows the int8 products are bound by compute, where AMX's bf16 tiles do several times the
// work of VNNI: each task dequantizes two panels into a bf16 buffer (in cache, reused by every row) and
// multiplies the bf16 rows by it. The weight rounds once to bf16 (RNE) and x is not quantized: quantization.py's
// reference takes the same path for the same calls (`wide`).
#if defined(METRALE_AMX)

// Linux lends a thread AMX's tile state only after the process asks for it once.
bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Eight tiles of 16 rows x 64 bytes: C 0-3 (two row tiles x two panels, float32), A 4-5 (16 rows x 32 bf16 of
// x), B 6-7 (16 pairs of inputs x 16 outputs x 2 bf16, one per panel).
void amx_configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

// A block's 16 per-row values (scales or offsets) spread for dequant_line: part i holds rows 4i..4i+3, each
// row's value 4 times (once per input of its group).
struct Spread {
  __m512 part[4];
  explicit Spread(__m512 v) {
    for (int i = 0; i < 4; ++i)
      part[i] = _mm512_permutexvar_ps(_mm512_add_epi32(_mm512_set1_epi32(4 * i), _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0)), v);
  }
};

// A 64-byte line of one panel (16 rows x 4 consecutive inputs, as bytes in v0..v3: rows 0-3, 4-7, 8-11, 12-15)
// as two bf16 rows of a B tile: inputs (0, 1) of each row, then inputs (2, 3). w = code * scale (+ offset).
template <bool Signed, bool Offset>
inline void dequant_line(const __m128i* v, const Spread& scale, const Spread& offset, c10::BFloat16* pair0, c10::BFloat16* pair1) {
  __m512 f[4];
  for (int i = 0; i < 4; ++i) {
    const __m512i w = Signed ? _mm512_cvtepi8_epi32(v[i]) : _mm512_cvtepu8_epi32(v[i]);
    f[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(w), scale.part[i]);
    if (Offset) f[i] = _mm512_add_ps(f[i], offset.part[i]);
  }
  // Each dword is one row's pair: (0,1) at even dwords, (2,3) at odd ones.
  const __m512i lo = (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0]), hi = (__m512i)_mm512_cvtne2ps_pbh(f[3], f[2]);
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  _mm512_storeu_si512(pair0, _mm512_permutex2var_epi32(lo, even, hi));
  _mm512_storeu_si512(pair1, _mm512_permutex2var_epi32(lo, odd, hi));
}

// One int8 panel into buf [kp / 2][16][2] bf16.
void dequant_int8_panel(const int8_t* w, const uint16_t* ws, int64_t blocks, c10::BFloat16* buf) {
  for (int64_t b = 0; b < blocks; ++b) {
    const Spread scale(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(ws + b * kPanel))));
    for (int g = 0; g < kBlock / 4; ++g) {
      const int8_t* line = w + (b * 8 + g) * 64;
      __m128i v[4];
      for (int i = 0; i < 4; ++i) v[i] = _mm_loadu_si128((const __m128i*)(line + 16 * i));
      c10::BFloat16* at = buf + (b * 16 + 2 * g) * 32;
      dequant_line<true, false>(v, scale, scale, at, at + 32);
    }
  }
}

// One 4-bit panel into buf [kp / 2][16][2] bf16.
template <typename S>
void dequant_int4_panel(const uint8_t* w, const S* ws, const S* wz, int64_t blocks, c10::BFloat16* buf) {
  const __m128i low = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < blocks; ++b) {
    const Spread scale(load16(ws + b * kPanel)), offset(load16(wz + b * kPanel));
    for (int g = 0; g < kBlock / 8; ++g) {
      const uint8_t* line = w + (b * 4 + g) * 64;
      __m128i lo[4], hi[4];
      for (int i = 0; i < 4; ++i) {
        const __m128i v = _mm_loadu_si128((const __m128i*)(line + 16 * i));
        lo[i] = _mm_and_si128(v, low);
        hi[i] = _mm_and_si128(_mm_srli_epi16(v, 4), low);
      }
      c10::BFloat16* at = buf + (b * 16 + 4 * g) * 32;
      dequant_line<false, true>(lo, scale, offset, at, at + 32);
      dequant_line<false, true>(hi, scale, offset, at + 64, at + 96);
    }
  }
}

// c [32][32] float32 = rows x [16 or 32][kp] (bf16, row stride kp) times the two dequantized panels b0, b1.
template <bool TwoRowTiles>
void amx_tile(const c10::BFloat16* x, int64_t kp, const c10::BFloat16* b0, const c10::BFloat16* b1, float* c) {
  const int64_t stride = kp * 2;
  _tile_zero(0);
  _tile_zero(1);
  if (TwoRowTiles) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t k = 0; k < kp; k += 32) {
    _tile_loadd(4, x + k, stride);
    _tile_loadd(6, b0 + k * 16, 64);
    _tile_loadd(7, b1 + k * 16, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (TwoRowTiles) {
      _tile_loadd(5, x + 16 * kp + k, stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 128);
  _tile_stored(1, c + 16, 128);
  if (TwoRowTiles) {
    _tile_stored(2, c + 16 * 32, 128);
    _tile_stored(3, c + 16 * 32 + 16, 128);
  }
}

// The C tiles' float32 sums c [32][32] (rows m0.., outputs o0..) into bf16 y [M, n]: 16 at a time, rounded to
// nearest even as c10::BFloat16's conversion does (a scalar loop here took longer than the tiles' products at a
// small k).
inline void store_bf16_tile(const float* c, int mr, c10::BFloat16* y, int64_t n, int64_t m0, int64_t o0) {
  const int64_t cols = std::min<int64_t>(2 * kPanel, n - o0);
  const __mmask16 lo = cols >= 16 ? 0xFFFF : __mmask16((1u << cols) - 1);
  const __mmask16 hi = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : __mmask16((1u << (cols - 16)) - 1);
  for (int m = 0; m < mr; ++m) {
    c10::BFloat16* row = y + (m0 + m) * n + o0;
    _mm256_mask_storeu_epi16(row, lo, (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(c + m * 32)));
    if (hi) _mm256_mask_storeu_epi16(row + 16, hi, (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(c + m * 32 + 16)));
  }
}

// y [M, n] = x [M, k] (bf16) @ W.T, `dequant(p, buf)` writing panel p as bf16 into buf.
template <typename Dequant>
void amx_linear(const at::Tensor& x, int64_t kp, int64_t n, at::Tensor& y, Dequant&& dequant) {
  const int64_t m = x.size(0), k = x.size(1), mp = (m + 15) / 16 * 16;
  // x padded to whole tiles (zero rows and inputs), reused across calls.
  static thread_local std::vector<c10::BFloat16> padded;
  if ((int64_t)padded.size() < mp * kp) padded.resize(mp * kp);
  const c10::BFloat16* src = x.data_ptr<c10::BFloat16>();
  for (int64_t r = 0; r < mp; ++r) {
    c10::BFloat16* row = padded.data() + r * kp;
    if (r < m) std::memcpy(row, src + r * k, k * sizeof(c10::BFloat16));
    std::memset(row + (r < m ? k : 0), 0, (kp - (r < m ? k : 0)) * sizeof(c10::BFloat16));
  }
  const c10::BFloat16* xp = padded.data();
  c10::BFloat16* out = y.data_ptr<c10::BFloat16>();
  const int64_t panels = (n + kPanel - 1) / kPanel;
  at::parallel_for(0, (panels + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    static thread_local std::vector<c10::BFloat16> buf;
    if ((int64_t)buf.size() < 2 * kp * kPanel) buf.resize(2 * kp * kPanel);
    alignas(64) float c[32 * 32];
    amx_configure();
    for (int64_t s = begin; s < end; ++s) {
      const int64_t p0 = 2 * s;
      const bool pair = p0 + 1 < panels;
      dequant(p0, buf.data());
      if (pair) dequant(p0 + 1, buf.data() + kp * kPanel);
      const c10::BFloat16* b1 = pair ? buf.data() + kp * kPanel : buf.data();
      for (int64_t m0 = 0; m0 < m; m0 += 32) {
        const int mr = int(std::min<int64_t>(32, m - m0));
        if (mr > 16)
          amx_tile<true>(xp + m0 * kp, kp, buf.data(), b1, c);
        else
          amx_tile<false>(xp + m0 * kp, kp, buf.data(), b1, c);
        store_bf16_tile(c, mr, out, n, m0, p0 * kPanel);
      }
    }
    _tile_release();
  });
}
#endif

void check_wide(const at::Tensor& x) {
#if defined(METRALE_AMX)
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && amx_permitted(), "wide: bfloat16 rows on a CPU that lends AMX tiles");
#else
  TORCH_CHECK(false, "wide: only the amx class multiplies dequantized bf16 tiles");
#endif
}

void check_input(const at::Tensor& x, int64_t kp) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [rows, in] matrix");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "x must be float32, bfloat16 or float16");
  TORCH_CHECK(x.size(1) <= kp && kp - x.size(1) < kBlock, "x's inputs do not match the packed weight");
}

// y [M, n] = x [M, k] @ W.T for W packed by quantization.py's pack_int8: codes int8 [panels, kp / 4, 16, 4],
// scales fp16 (as int16 bits) [panels, kp / 32, 16].
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t n, bool wide) {
  const int64_t blocks = scales.size(1), kp = blocks * kBlock;
  check_input(x, kp);
  TORCH_CHECK(codes.scalar_type() == at::kChar && scales.scalar_type() == at::kShort && codes.is_contiguous() && scales.is_contiguous(),
              "int8_linear: codes int8, scales int16 (fp16 bits), contiguous");
  TORCH_CHECK(scales.size(0) * kPanel >= n && codes.numel() == scales.size(0) * kp * kPanel, "int8_linear: packed sizes do not match");
  const int64_t m = x.size(0);
  at::Tensor y = at::empty({m, n}, x.options());
  const int8_t* w = codes.data_ptr<int8_t>();
  const uint16_t* ws = reinterpret_cast<const uint16_t*>(scales.data_ptr<int16_t>());
  const int64_t panel_bytes = kp * kPanel;
  if (wide) {
    check_wide(x);
#if defined(METRALE_AMX)
    amx_linear(x, kp, n, y, [&](int64_t p, c10::BFloat16* buf) { dequant_int8_panel(w + p * panel_bytes, ws + p * blocks * kPanel, blocks, buf); });
#endif
    return y;
  }
  QuantRows& q = scratch();
  quantize_input(x, kp, q);
  over_tiles(m, n, [&](int64_t p0, int np, int64_t m0, int mr, float* buf) {
    const int8_t* wp = w + p0 * panel_bytes;
    const uint16_t* sp = ws + p0 * blocks * kPanel;
    if (np == kPanelsPerStep)
      with_rows<Int8Tile, kPanelsPerStep>(mr, wp, sp, blocks, q, m0, kp, buf);
    else
      with_rows<Int8Tile, 1>(mr, wp, sp, blocks, q, m0, kp, buf);
    store_rows(buf, mr, np, y, n, m0, p0 * kPanel);
  });
  return y;
}

template <typename S>
void int4_product(const at::Tensor& x, const uint8_t* w, const S* ws, const S* wz, int64_t blocks, int64_t n, bool wide, at::Tensor& y) {
  const int64_t m = x.size(0), kp = blocks * kBlock, panel_bytes = kp * kPanel / 2;
  if (wide) {
    check_wide(x);
#if defined(METRALE_AMX)
    amx_linear(x, kp, n, y, [&](int64_t p, c10::BFloat16* buf) {
      dequant_int4_panel(w + p * panel_bytes, ws + p * blocks * kPanel, wz + p * blocks * kPanel, blocks, buf);
    });
#endif
    return;
  }
  QuantRows& q = scratch();
  quantize_input(x, kp, q);
  over_tiles(m, n, [&](int64_t p0, int np, int64_t m0, int mr, float* buf) {
    const uint8_t* wp = w + p0 * panel_bytes;
    const int64_t at = p0 * blocks * kPanel;
    if (np == kPanelsPerStep)
      with_rows<Int4Tile, kPanelsPerStep>(mr, wp, ws + at, wz + at, blocks, q, m0, kp, buf);
    else
      with_rows<Int4Tile, 1>(mr, wp, ws + at, wz + at, blocks, q, m0, kp, buf);
    store_rows(buf, mr, np, y, n, m0, p0 * kPanel);
  });
}

// y [M, n] = x [M, k] @ W.T with W = scale * code + offset per group of 32, packed by quantization.py's
// pack_int4: codes uint8 [panels, kp / 8, 16, 4] (two groups of 4 inputs a byte), scales and offsets
// [panels, kp / 32, 16], float32 or fp16 bits as int16.
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& zeros, int64_t n,
                       bool wide) {
  const int64_t blocks = scales.size(1), kp = blocks * kBlock;
  check_input(x, kp);
  const bool half = scales.scalar_type() == at::kShort;
  TORCH_CHECK(codes.scalar_type() == at::kByte && (half || scales.scalar_type() == at::kFloat) &&
                  zeros.scalar_type() == scales.scalar_type() && codes.is_contiguous() && scales.is_contiguous() && zeros.is_contiguous(),
              "int4_linear: codes uint8, scales and offsets both float32 or both fp16 bits (int16), contiguous");
  TORCH_CHECK(scales.size(0) * kPanel >= n && codes.numel() == scales.size(0) * kp * kPanel / 2 && zeros.sizes() == scales.sizes(),
              "int4_linear: packed sizes do not match");
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  const uint8_t* w = codes.data_ptr<uint8_t>();
  if (half)
    int4_product(x, w, reinterpret_cast<const uint16_t*>(scales.data_ptr<int16_t>()), reinterpret_cast<const uint16_t*>(zeros.data_ptr<int16_t>()),
                 blocks, n, wide, y);
  else
    int4_product(x, w, scales.data_ptr<float>(), zeros.data_ptr<float>(), blocks, n, wide, y);
  return y;
}

// The activations as the products quantize them: (codes int8 [M, kp], scales float32 [M, kp / 32]), for the
// tests' check against quantization.py's quantize_activations.
std::tuple<at::Tensor, at::Tensor> quantize_activations(const at::Tensor& x, int64_t kp) {
  check_input(x, kp);
  QuantRows q;
  quantize_input(x, kp, q);
  const int64_t m = x.size(0);
  at::Tensor codes = at::empty({m, kp}, x.options().dtype(at::kChar));
  at::Tensor scales = at::empty({m, kp / kBlock}, x.options().dtype(at::kFloat));
  std::memcpy(codes.data_ptr<int8_t>(), q.codes.data(), m * kp);
  std::memcpy(scales.data_ptr<float>(), q.scale.data(), m * kp / kBlock * sizeof(float));
  return {codes, scales};
}

}  // namespace

METRALE_FRAGMENT(m) {
  m.def("int8_linear(Tensor x, Tensor codes, Tensor scales, int n, bool wide) -> Tensor");
  m.impl("int8_linear", c10::DispatchKey::CPU, TORCH_FN(int8_linear));
  m.def("int4_linear(Tensor x, Tensor codes, Tensor scales, Tensor zeros, int n, bool wide) -> Tensor");
  m.impl("int4_linear", c10::DispatchKey::CPU, TORCH_FN(int4_linear));
  m.def("quantize_activations(Tensor x, int kp) -> (Tensor, Tensor)");
  m.impl("quantize_activations", c10::DispatchKey::CPU, TORCH_FN(quantize_activations));
}
