// The sampler's fused passes (gpu_worker/sampler.py), per instruction-set class.
//
// sample_rows picks one token per row in a few passes over that row alone (rows in parallel): penalties over the
// history's cells, greedy argmax or temperature, the top-k cutoff from a running-threshold selection (no sort of
// the vocabulary), the top-p cutoff from exact integer masses (a band of candidates sorted, not the vocabulary),
// min-p as a threshold from the max, and the Gumbel-max draw with noise computed only for vectors holding a kept
// token. The numeric rules (log32, exp_weight, the noise) are the ones sampler.py and engine_core/host_sampler.py
// compute with torch and numpy: the same IEEE operations in the same order (no FMA: -ffp-contract=off), so every
// class, the torch path and the host give the same bits.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;  // splitmix64 (sampler.py)
constexpr uint64_t kMix1 = 0xBF58476D1CE4E5B9ull;
constexpr uint64_t kMix2 = 0x94D049BB133111EBull;
constexpr int kNoiseBits = 23;

inline float from_bits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// The rules' float32 constants, by their bits (no decimal conversion to disagree on).
const float kLg1 = from_bits(0x3f2aaaaa), kLg2 = from_bits(0x3eccce13), kLg3 = from_bits(0x3e91e9ee),
            kLg4 = from_bits(0x3e789e26), kLn2Hi = from_bits(0x3f317180), kLn2Lo = from_bits(0x3717f7d1);
const float kLog2e = from_bits(0x3fb8aa3b), kC1 = from_bits(0x3f318000), kC2 = from_bits(0xb95e8083);
const float kP0 = from_bits(0x39506967), kP1 = from_bits(0x3ab743ce), kP2 = from_bits(0x3c088908),
            kP3 = from_bits(0x3d2aa9c1), kP4 = from_bits(0x3e2aaaaa), kP5 = from_bits(0x3f000000);

// One lane: the reference the vector classes must equal bit for bit (and the tails of every vector loop).
struct Lane1 {
  using F = float;
  using I = int32_t;
  static constexpr int N = 1;
  static F set(float v) { return v; }
  static I seti(int32_t v) { return v; }
  static F add(F a, F b) { return a + b; }
  static F sub(F a, F b) { return a - b; }
  static F mul(F a, F b) { return a * b; }
  static F div(F a, F b) { return a / b; }
  static F max(F a, F b) { return a > b ? a : b; }
  static F floor(F a) { return std::floor(a); }
  static I bits(F a) { I i; std::memcpy(&i, &a, 4); return i; }
  static F of_bits(I i) { F a; std::memcpy(&a, &i, 4); return a; }
  static I shr23(I a) { return a >> 23; }
  static I shl23(I a) { return I(uint32_t(a) << 23); }
  static I and_(I a, I b) { return a & b; }
  static I or_(I a, I b) { return a | b; }
  static I xor_(I a, I b) { return a ^ b; }
  static I addi(I a, I b) { return a + b; }
  static F to_float(I a) { return F(a); }
  static I trunc(F a) { return I(a); }
};

#if defined(METRALE_AVX512)
struct Lane16 {
  using F = __m512;
  using I = __m512i;
  static constexpr int N = 16;
  static F set(float v) { return _mm512_set1_ps(v); }
  static I seti(int32_t v) { return _mm512_set1_epi32(v); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F floor(F a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  static I bits(F a) { return _mm512_castps_si512(a); }
  static F of_bits(I i) { return _mm512_castsi512_ps(i); }
  static I shr23(I a) { return _mm512_srai_epi32(a, 23); }
  static I shl23(I a) { return _mm512_slli_epi32(a, 23); }
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  static I xor_(I a, I b) { return _mm512_xor_si512(a, b); }
  static I addi(I a, I b) { return _mm512_add_epi32(a, b); }
  static F to_float(I a) { return _mm512_cvtepi32_ps(a); }
  static I trunc(F a) { return _mm512_cvttps_epi32(a); }
};
#endif

#if defined(METRALE_AVX2)
struct Lane8 {
  using F = __m256;
  using I = __m256i;
  static constexpr int N = 8;
  static F set(float v) { return _mm256_set1_ps(v); }
  static I seti(int32_t v) { return _mm256_set1_epi32(v); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F floor(F a) { return _mm256_floor_ps(a); }
  static I bits(F a) { return _mm256_castps_si256(a); }
  static F of_bits(I i) { return _mm256_castsi256_ps(i); }
  static I shr23(I a) { return _mm256_srai_epi32(a, 23); }
  static I shl23(I a) { return _mm256_slli_epi32(a, 23); }
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  static I xor_(I a, I b) { return _mm256_xor_si256(a, b); }
  static I addi(I a, I b) { return _mm256_add_epi32(a, b); }
  static F to_float(I a) { return _mm256_cvtepi32_ps(a); }
  static I trunc(F a) { return _mm256_cvttps_epi32(a); }
};
#endif

// log(x) for positive normal float32 x (fdlibm's logf reduction and polynomial, one branch): within a few ulp of
// the true log and, being + - * / only, the same bits wherever IEEE float32 is. sampler.py's _log32_ and
// host_sampler.log32 are this, operation for operation.
template <class L>
inline typename L::F log32(typename L::F x) {
  using I = typename L::I;
  using F = typename L::F;
  const I ix = L::bits(x);
  const I m = L::and_(ix, L::seti(0x7fffff));
  const I i = L::and_(L::addi(m, L::seti(0x4afb20)), L::seti(0x800000));  // mantissa >= sqrt(2): halve it
  const F f = L::sub(L::of_bits(L::or_(m, L::xor_(i, L::seti(0x3f800000)))), L::set(1.0f));
  const F dk = L::to_float(L::addi(L::addi(L::shr23(ix), L::seti(-127)), L::shr23(i)));
  const F s = L::div(f, L::add(f, L::set(2.0f)));
  const F z = L::mul(s, s);
  const F w = L::mul(z, z);
  const F t2 = L::mul(L::add(L::mul(w, L::set(kLg3)), L::set(kLg1)), z);
  const F t1 = L::mul(L::add(L::mul(w, L::set(kLg4)), L::set(kLg2)), w);
  const F r = L::add(t2, t1);
  const F hfsq = L::mul(L::mul(f, L::set(0.5f)), f);
  const F inner = L::add(L::mul(L::add(hfsq, r), s), L::mul(dk, L::set(kLn2Lo)));
  return L::sub(L::mul(dk, L::set(kLn2Hi)), L::sub(L::sub(hfsq, inner), f));
}

// The top-p weight of a token t = x - max <= 0: floor(e^t * 2^30) as an integer (Cephes' expf; t below -64
// weighs 0). Integer weights make every mass an exact sum, the same in any order.
template <class L>
inline typename L::I exp_weight(typename L::F t) {
  using F = typename L::F;
  t = L::max(t, L::set(-64.0f));
  const F n = L::floor(L::add(L::mul(t, L::set(kLog2e)), L::set(0.5f)));
  const F r = L::sub(L::sub(t, L::mul(n, L::set(kC1))), L::mul(n, L::set(kC2)));
  F p = L::add(L::mul(L::set(kP0), r), L::set(kP1));
  p = L::add(L::mul(p, r), L::set(kP2));
  p = L::add(L::mul(p, r), L::set(kP3));
  p = L::add(L::mul(p, r), L::set(kP4));
  p = L::add(L::mul(p, r), L::set(kP5));
  const F e = L::add(L::add(L::mul(p, L::mul(r, r)), r), L::set(1.0f));
  const F scale = L::of_bits(L::shl23(L::addi(L::trunc(n), L::seti(157))));  // 2^(n + 30)
  return L::trunc(L::mul(e, scale));
}

inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * kMix1;
  z = (z ^ (z >> 27)) * kMix2;
  return z ^ (z >> 31);
}

// The 23 uniform bits of vocab index i in the row keyed by key (the hash of (seed, position); sampler.row_keys).
inline int32_t noise_bits1(uint64_t key, int64_t i) { return int32_t(mix64(key + uint64_t(i + 1) * kGolden) >> (64 - kNoiseBits)); }

// Gumbel noise of uniform bits k: u = (k + 0.5) / 2^23, -log(-log(u)).
template <class L>
inline typename L::F gumbel_of_bits(typename L::I k) {
  const typename L::F u = L::mul(L::add(L::to_float(k), L::set(0.5f)), L::set(1.0f / float(1 << kNoiseBits)));
  const typename L::F zero = L::set(0.0f);
  return L::sub(zero, log32<L>(L::sub(zero, log32<L>(u))));
}

inline float noise1(uint64_t key, int64_t i) { return gumbel_of_bits<Lane1>(noise_bits1(key, i)); }

// An upper bound on the noise of bits k, cheap to compute: with D = 2^23 - k >= 2^e, 1 - u >= 2^(e - 24), and
// -log(-log(u)) <= -log(1 - u) <= (24 - e) ln 2. The margin covers log32's rounding many times over.
constexpr float kLn2 = 0.6931472f, kBoundMargin = 0.01f;
constexpr float kNoiseMax = 24 * kLn2 + kBoundMargin;  // every token's bound
template <class L>
inline typename L::F noise_bound(typename L::I k) {
  const typename L::I d = L::addi(L::seti(1 << kNoiseBits), L::addi(L::xor_(k, L::seti(-1)), L::seti(1)));  // 2^23 - k
  const typename L::F e = L::to_float(L::addi(L::shr23(L::bits(L::to_float(d))), L::seti(-127)));
  return L::sub(L::set(kNoiseMax), L::mul(e, L::set(kLn2)));
}

#if defined(METRALE_AVX512)
inline __m512i mix64x8(__m512i z) {
  z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 30)), _mm512_set1_epi64(int64_t(kMix1)));
  z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 27)), _mm512_set1_epi64(int64_t(kMix2)));
  return _mm512_xor_si512(z, _mm512_srli_epi64(z, 31));
}

// The uniform bits of indices i .. i + 15.
inline __m512i noise_bits16(uint64_t key, int64_t i) {
  const __m512i offsets = _mm512_setr_epi64(0, int64_t(kGolden), int64_t(2 * kGolden), int64_t(3 * kGolden), int64_t(4 * kGolden),
                                            int64_t(5 * kGolden), int64_t(6 * kGolden), int64_t(7 * kGolden));
  const __m512i base = _mm512_add_epi64(_mm512_set1_epi64(int64_t(key + uint64_t(i + 1) * kGolden)), offsets);
  const __m512i lo = mix64x8(base);
  const __m512i hi = mix64x8(_mm512_add_epi64(base, _mm512_set1_epi64(int64_t(8 * kGolden))));
  const __m256i klo = _mm512_cvtepi64_epi32(_mm512_srli_epi64(lo, 64 - kNoiseBits));
  const __m256i khi = _mm512_cvtepi64_epi32(_mm512_srli_epi64(hi, 64 - kNoiseBits));
  return _mm512_inserti64x4(_mm512_castsi256_si512(klo), khi, 1);
}
#endif

#if defined(METRALE_AVX2)
// The low 64 bits of a * b (AVX2 has no 64-bit multiply): three 32 x 32 products.
inline __m256i mul64(__m256i a, uint64_t b) {
  const __m256i blo = _mm256_set1_epi64x(int64_t(b & 0xffffffffull)), bhi = _mm256_set1_epi64x(int64_t(b >> 32));
  const __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a, 32), blo), _mm256_mul_epu32(a, bhi));
  return _mm256_add_epi64(_mm256_mul_epu32(a, blo), _mm256_slli_epi64(cross, 32));
}

inline __m256i mix64x4(__m256i z) {
  z = mul64(_mm256_xor_si256(z, _mm256_srli_epi64(z, 30)), kMix1);
  z = mul64(_mm256_xor_si256(z, _mm256_srli_epi64(z, 27)), kMix2);
  return _mm256_xor_si256(z, _mm256_srli_epi64(z, 31));
}

// The uniform bits of indices i .. i + 7.
inline __m256i noise_bits8(uint64_t key, int64_t i) {
  const __m256i offsets = _mm256_setr_epi64x(0, int64_t(kGolden), int64_t(2 * kGolden), int64_t(3 * kGolden));
  const __m256i base = _mm256_add_epi64(_mm256_set1_epi64x(int64_t(key + uint64_t(i + 1) * kGolden)), offsets);
  const __m256i lo = mix64x4(base);
  const __m256i hi = mix64x4(_mm256_add_epi64(base, _mm256_set1_epi64x(int64_t(4 * kGolden))));
  // The low 32 bits of each 64-bit lane, in order: [lo0 lo1 hi0 hi1 | lo2 lo3 hi2 hi3], then the middle swapped.
  const __m256i packed = _mm256_castps_si256(_mm256_shuffle_ps(_mm256_castsi256_ps(_mm256_srli_epi64(lo, 64 - kNoiseBits)),
                                                               _mm256_castsi256_ps(_mm256_srli_epi64(hi, 64 - kNoiseBits)),
                                                               _MM_SHUFFLE(2, 0, 2, 0)));
  return _mm256_permute4x64_epi64(packed, _MM_SHUFFLE(3, 1, 2, 0));
}
#endif

// --- the row passes ----------------------------------------------------------------------------------------------

// The widest lane type of this class's build: its loads, masks and noise. Tails and the generic class use Lane1.
#if defined(METRALE_AVX512)
#define SAMPLING_VEC 16
using LaneV = Lane16;
using VecF = __m512;
inline __m512 loadv(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 loadv(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline void storev(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline uint32_t ge_mask(__m512 a, __m512 b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
inline uint32_t gt_mask(__m512 a, __m512 b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
inline uint32_t nlt_mask(__m512 a, __m512 b) { return _mm512_cmp_ps_mask(a, b, _CMP_NLT_UQ); }
inline float hmax(__m512 v) { return _mm512_reduce_max_ps(v); }
inline __m512i noise_bitsv(uint64_t key, int64_t i) { return noise_bits16(key, i); }
#elif defined(METRALE_AVX2)
#define SAMPLING_VEC 8
using LaneV = Lane8;
using VecF = __m256;
inline __m256 loadv(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 loadv(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline void storev(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline uint32_t ge_mask(__m256 a, __m256 b) { return uint32_t(_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GE_OQ))); }
inline uint32_t gt_mask(__m256 a, __m256 b) { return uint32_t(_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GT_OQ))); }
inline uint32_t nlt_mask(__m256 a, __m256 b) { return uint32_t(_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_NLT_UQ))); }
inline float hmax(__m256 v) {
  alignas(32) float a[8];
  _mm256_store_ps(a, v);
  return *std::max_element(a, a + 8);
}
inline __m256i noise_bitsv(uint64_t key, int64_t i) { return noise_bits8(key, i); }
#else
#define SAMPLING_VEC 1
#endif

inline float load1(const float* p, int64_t i) { return p[i]; }
inline float load1(const c10::BFloat16* p, int64_t i) { return float(p[i]); }

using Candidates = std::vector<std::pair<float, int32_t>>;  // (value, vocab index), or (value, top-p weight)

// The first index of the row's largest value (torch's max(dim).indices; a row of -inf: 0). Per-lane bests are
// raised only for the blocks that beat them, which after the first few blocks is rare.
template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  int64_t i = 0, best_at = 0;
  float best = -INFINITY;
#if SAMPLING_VEC > 1
  constexpr int W = SAMPLING_VEC;
  alignas(64) float top[W];
  alignas(64) int32_t at[W];
  for (int l = 0; l < W; ++l) top[l] = -INFINITY, at[l] = 0;
  VecF vtop = LaneV::set(-INFINITY);
  for (; i + W <= n; i += W) {
    const uint32_t gt = gt_mask(loadv(x + i), vtop);
    if (!gt) continue;
    for (uint32_t b = gt; b; b &= b - 1) {
      const int l = __builtin_ctz(b);
      top[l] = load1(x, i + l);
      at[l] = int32_t(i + l);
    }
    vtop = loadv(top);
  }
  best = top[0];
  best_at = at[0];
  for (int l = 1; l < W; ++l)
    if (top[l] > best || (top[l] == best && at[l] < best_at)) best = top[l], best_at = at[l];
#endif
  for (; i < n; ++i)
    if (load1(x, i) > best) best = load1(x, i), best_at = i;
  return best_at;
}

// dst = src / temperature (torch's div: one rounding), returning the largest quotient.
template <typename T>
float divide_row(const T* src, float* dst, int64_t n, float temperature) {
  int64_t i = 0;
  float m = -INFINITY;
#if SAMPLING_VEC > 1
  const VecF t = LaneV::set(temperature);
  VecF vm = LaneV::set(-INFINITY);
  for (; i + SAMPLING_VEC <= n; i += SAMPLING_VEC) {
    const VecF v = LaneV::div(loadv(src + i), t);
    storev(dst + i, v);
    vm = LaneV::max(vm, v);
  }
  m = hmax(vm);
#endif
  for (; i < n; ++i) {
    dst[i] = load1(src, i) / temperature;
    m = std::max(m, dst[i]);
  }
  return m;
}

constexpr int32_t kSeen = 1 << 30;  // a penalty mark: the token occurs in the history (low bits: output count)

// vLLM's penalties over the history's cells only: repetition once per token seen (prompt or output), then
// frequency times the output count and presence, in the device's float32 order. seen is all zero before and after.
void penalise(float* x, int64_t vocab, const int32_t* hist, int64_t len, int64_t prompt_len, float rep, float freq,
              float presence, int32_t* seen) {
  for (int64_t j = 0; j < len; ++j) {
    const int32_t t = hist[j];
    if (t < 0 || t >= vocab) continue;
    seen[t] |= kSeen;
    if (j >= prompt_len) seen[t] += 1;
  }
  for (int64_t j = 0; j < len; ++j) {
    const int32_t t = hist[j];
    if (t < 0 || t >= vocab || seen[t] == 0) continue;
    const int32_t count = seen[t] & (kSeen - 1);
    seen[t] = 0;  // each token once
    float v = x[t];
    v = v > 0 ? v / rep : v * rep;
    if (count) {
      v = v - freq * float(count);
      v = v - presence;
    }
    x[t] = v;
  }
}

// Appends (x[i], i) for begin <= i < end where x[i] >= theta.
void gather_at_least(const float* x, int64_t begin, int64_t end, float theta, Candidates& out) {
  int64_t i = begin;
#if SAMPLING_VEC > 1
  const VecF th = LaneV::set(theta);
  for (; i + SAMPLING_VEC <= end; i += SAMPLING_VEC)
    for (uint32_t b = ge_mask(loadv(x + i), th); b; b &= b - 1) {
      const int l = __builtin_ctz(b);
      out.emplace_back(x[i + l], int32_t(i + l));
    }
#endif
  for (; i < end; ++i)
    if (x[i] >= theta) out.emplace_back(x[i], int32_t(i));
}

inline bool value_desc(const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) { return a.first > b.first; }

// Drops the candidates below theta.
inline void keep_at_least(Candidates& cand, float theta) {
  cand.erase(std::remove_if(cand.begin(), cand.end(), [theta](const auto& c) { return !(c.first >= theta); }), cand.end());
}

// The k-th largest value of x (0 < k < n), leaving in cand every token at or above it (top-k keeps ties). No sort:
// candidates gather above a bar; whenever there are 2k of them, the k-th largest becomes the bar and the rest go.
float top_k_cutoff(const float* x, int64_t n, int64_t k, Candidates& cand) {
  constexpr int64_t kBlock = 1024;  // the bar is raised between blocks
  cand.clear();
  size_t limit = size_t(std::max<int64_t>(2 * k, 256));
  float theta = -INFINITY;
  for (int64_t i = 0; i < n; i += kBlock) {
    gather_at_least(x, i, std::min(n, i + kBlock), theta, cand);
    if (cand.size() >= limit) {
      std::nth_element(cand.begin(), cand.begin() + (k - 1), cand.end(), value_desc);
      theta = cand[k - 1].first;
      keep_at_least(cand, theta);
      limit = std::max(limit, 2 * cand.size());  // ties at the bar stay, however many
    }
  }
  if (int64_t(cand.size()) < k) return -INFINITY;  // NaNs aside, unreachable
  std::nth_element(cand.begin(), cand.begin() + (k - 1), cand.end(), value_desc);
  const float cutoff = cand[k - 1].first;
  keep_at_least(cand, cutoff);
  return cutoff;
}

// The smallest value top-p keeps. cand holds (value, weight) of the tokens whose place it decides, `above` the
// weight of every token above all of them (all kept): a value stays when the weight strictly above it is below
// limit. A weighted selection (partition around a pivot, keep the side holding the edge): no full sort.
float top_p_cutoff(Candidates& c, double above, double limit) {
  size_t lo = 0, hi = c.size();
  while (hi - lo > 32) {
    const float a = c[lo].first, b = c[(lo + hi) / 2].first, d = c[hi - 1].first;
    const float pivot = std::max(std::min(a, b), std::min(std::max(a, b), d));  // the median of three
    size_t gt = lo, j = lo, lt = hi;  // [lo, gt) > pivot, [gt, lt) == pivot, [lt, hi) < pivot
    while (j < lt) {
      if (c[j].first > pivot) std::swap(c[gt++], c[j++]);
      else if (c[j].first < pivot) std::swap(c[j], c[--lt]);
      else ++j;
    }
    double larger = 0.0, equal = 0.0;
    for (size_t q = lo; q < gt; ++q) larger += double(c[q].second);
    for (size_t q = gt; q < lt; ++q) equal += double(c[q].second);
    if (!(above + larger < limit)) {  // the pivot's group is out: the edge is among the larger values
      hi = gt;
      continue;
    }
    above += larger + equal;
    if (!(above < limit) || lt == hi) return pivot;  // the pivot's group is the last one kept
    lo = lt;
  }
  std::sort(c.begin() + lo, c.begin() + hi, value_desc);
  float cutoff = c[lo].first;
  for (size_t j = lo; j < hi && above < limit;) {
    const float v = c[j].first;
    cutoff = v;
    for (; j < hi && c[j].first == v; ++j) above += double(c[j].second);
  }
  return cutoff;
}

// Bounds on x - max for top-p's first pass: the mass at or above each is summed, and only the tokens between
// the two bounds around the nucleus's edge are sorted.
constexpr int kLevels = 8;
const float kLevel[kLevels] = {-0.5f, -1.0f, -2.0f, -3.0f, -4.0f, -6.0f, -9.0f, -16.0f};

// mass[j]: the total weight of the tokens with x - max >= kLevel[j]; mass[kLevels]: of all of them (exact
// integers held in doubles: every sum is below 2^53); weight[i]: token i's.
void level_masses(const float* x, int64_t n, float max, double* mass, int32_t* weight) {
  int64_t i = 0;
  for (int j = 0; j <= kLevels; ++j) mass[j] = 0.0;
#if SAMPLING_VEC == 16
  __m512d acc[kLevels + 1][2];
  for (int j = 0; j <= kLevels; ++j) acc[j][0] = acc[j][1] = _mm512_setzero_pd();
  const __m512 vmax = _mm512_set1_ps(max);
  for (; i + 16 <= n; i += 16) {
    const __m512 t = _mm512_sub_ps(_mm512_loadu_ps(x + i), vmax);
    const __m512i w = exp_weight<Lane16>(t);
    _mm512_storeu_si512(weight + i, w);
    const __m512d lo = _mm512_cvtepi32_pd(_mm512_castsi512_si256(w)), hi = _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(w, 1));
    acc[kLevels][0] = _mm512_add_pd(acc[kLevels][0], lo);
    acc[kLevels][1] = _mm512_add_pd(acc[kLevels][1], hi);
    if (!_mm512_cmp_ps_mask(t, _mm512_set1_ps(kLevel[kLevels - 1]), _CMP_GE_OQ)) continue;  // all far below
    for (int j = 0; j < kLevels; ++j) {
      const __mmask16 k = _mm512_cmp_ps_mask(t, _mm512_set1_ps(kLevel[j]), _CMP_GE_OQ);
      acc[j][0] = _mm512_mask_add_pd(acc[j][0], __mmask8(k), acc[j][0], lo);
      acc[j][1] = _mm512_mask_add_pd(acc[j][1], __mmask8(k >> 8), acc[j][1], hi);
    }
  }
  for (int j = 0; j <= kLevels; ++j) mass[j] = _mm512_reduce_add_pd(_mm512_add_pd(acc[j][0], acc[j][1]));
#elif SAMPLING_VEC == 8
  __m256d acc[kLevels + 1][2];
  for (int j = 0; j <= kLevels; ++j) acc[j][0] = acc[j][1] = _mm256_setzero_pd();
  const __m256 vmax = _mm256_set1_ps(max);
  for (; i + 8 <= n; i += 8) {
    const __m256 t = _mm256_sub_ps(_mm256_loadu_ps(x + i), vmax);
    const __m256i w = exp_weight<Lane8>(t);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(weight + i), w);
    const __m256d lo = _mm256_cvtepi32_pd(_mm256_castsi256_si128(w)), hi = _mm256_cvtepi32_pd(_mm256_extracti128_si256(w, 1));
    acc[kLevels][0] = _mm256_add_pd(acc[kLevels][0], lo);
    acc[kLevels][1] = _mm256_add_pd(acc[kLevels][1], hi);
    if (!_mm256_movemask_ps(_mm256_cmp_ps(t, _mm256_set1_ps(kLevel[kLevels - 1]), _CMP_GE_OQ))) continue;
    const __m256d tlo = _mm256_cvtps_pd(_mm256_castps256_ps128(t)), thi = _mm256_cvtps_pd(_mm256_extractf128_ps(t, 1));
    for (int j = 0; j < kLevels; ++j) {
      const __m256d bound = _mm256_set1_pd(double(kLevel[j]));
      acc[j][0] = _mm256_add_pd(acc[j][0], _mm256_and_pd(lo, _mm256_cmp_pd(tlo, bound, _CMP_GE_OQ)));
      acc[j][1] = _mm256_add_pd(acc[j][1], _mm256_and_pd(hi, _mm256_cmp_pd(thi, bound, _CMP_GE_OQ)));
    }
  }
  alignas(32) double lanes[4];
  for (int j = 0; j <= kLevels; ++j) {
    _mm256_store_pd(lanes, _mm256_add_pd(acc[j][0], acc[j][1]));
    mass[j] = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  }
#endif
  for (; i < n; ++i) {
    const float t = x[i] - max;
    weight[i] = exp_weight<Lane1>(t);
    const double w = double(weight[i]);
    mass[kLevels] += w;
    for (int j = 0; j < kLevels; ++j)
      if (t >= kLevel[j]) mass[j] += w;
  }
}

// Appends (x[i], weight[i]) for the tokens with lo <= x[i] - max < hi (lo may be -inf: every token below hi).
void gather_band(const float* x, const int32_t* weight, int64_t n, float max, float lo, float hi, Candidates& out) {
  int64_t i = 0;
#if SAMPLING_VEC > 1
  const VecF vmax = LaneV::set(max), vlo = LaneV::set(lo), vhi = LaneV::set(hi);
  for (; i + SAMPLING_VEC <= n; i += SAMPLING_VEC) {
    const VecF t = LaneV::sub(loadv(x + i), vmax);
    for (uint32_t b = ge_mask(t, vlo) & ~ge_mask(t, vhi); b; b &= b - 1) {
      const int l = __builtin_ctz(b);
      out.emplace_back(x[i + l], weight[i + l]);
    }
  }
#endif
  for (; i < n; ++i) {
    const float t = x[i] - max;
    if (t >= lo && !(t >= hi)) out.emplace_back(x[i], weight[i]);
  }
}

// The first index holding v (which x holds).
int64_t first_equal(const float* x, int64_t n, float v) {
  int64_t i = 0;
#if SAMPLING_VEC > 1
  const VecF vv = LaneV::set(v);
  for (; i + SAMPLING_VEC <= n; i += SAMPLING_VEC) {
    const VecF xv = loadv(x + i);
    const uint32_t eq = ge_mask(xv, vv) & ~gt_mask(xv, vv);
    if (eq) return i + __builtin_ctz(eq);
  }
#endif
  while (i < n && !(x[i] == v)) ++i;
  return i;
}

// The Gumbel-max draw over the kept tokens (x >= cutoff and x - max >= log_min_p, as torch's masks leave them):
// the first index of the largest x + noise. The noise is computed exactly only where a bound says the token could
// reach the best so far (`floor`: starting from the row's largest token's): x + an upper bound of its noise from
// the hash's bits, or from no bits at all. Far below the best, most tokens need no log.
int64_t gumbel_pick(const float* x, int64_t n, float max, float cutoff, float log_min_p, uint64_t key) {
  const int64_t top_at = first_equal(x, n, max);
  float floor = x[top_at] + noise1(key, top_at);  // a value the pick reaches: no token strictly below it can win
  int64_t i = 0, best_at = 0;
  float best = -INFINITY;
#if SAMPLING_VEC > 1
  constexpr int W = SAMPLING_VEC;
  alignas(64) float top[W], y[W];
  alignas(64) int32_t at[W];
  for (int l = 0; l < W; ++l) top[l] = -INFINITY, at[l] = 0;
  VecF vtop = LaneV::set(-INFINITY), vfloor = LaneV::set(floor);
  const VecF vcut = LaneV::set(cutoff), vmax = LaneV::set(max), vmin = LaneV::set(log_min_p), vnoise_max = LaneV::set(kNoiseMax);
  for (; i + W <= n; i += W) {
    const VecF v = loadv(x + i);
    uint32_t live = nlt_mask(v, vcut) & nlt_mask(LaneV::sub(v, vmax), vmin) & nlt_mask(LaneV::add(v, vnoise_max), vfloor);
    if (!live) continue;
    const typename LaneV::I bits = noise_bitsv(key, i);
    live &= nlt_mask(LaneV::add(v, noise_bound<LaneV>(bits)), vfloor);
    if (!live) continue;
    const VecF noisy = LaneV::add(v, gumbel_of_bits<LaneV>(bits));
    const uint32_t gt = gt_mask(noisy, vtop) & live;
    if (!gt) continue;
    storev(y, noisy);
    for (uint32_t b = gt; b; b &= b - 1) {
      const int l = __builtin_ctz(b);
      top[l] = y[l];
      at[l] = int32_t(i + l);
      floor = std::max(floor, y[l]);
    }
    vtop = loadv(top);
    vfloor = LaneV::set(floor);
  }
  best = top[0];
  best_at = at[0];
  for (int l = 1; l < W; ++l)
    if (top[l] > best || (top[l] == best && at[l] < best_at)) best = top[l], best_at = at[l];
#endif
  for (; i < n; ++i) {
    if (x[i] < cutoff || x[i] - max < log_min_p || x[i] + kNoiseMax < floor) continue;
    const int32_t bits = noise_bits1(key, i);
    if (x[i] + noise_bound<Lane1>(bits) < floor) continue;
    const float noisy = x[i] + gumbel_of_bits<Lane1>(bits);
    if (noisy > best) best = noisy, best_at = i;
    floor = std::max(floor, noisy);
  }
  return best_at;
}

// One row's parameters (sampler.py lays them out: _NativeParams).
struct RowParams {
  float temperature;  // 0: greedy
  float top_p;        // >= 1: off
  float log_min_p;    // -inf: off
  float rep, freq, presence;
  int64_t top_k;  // 0: off
  uint64_t key;
  const int32_t* hist;
  int64_t hist_len, prompt_len;  // hist_len 0: no penalties
};

template <typename T>
int64_t sample_row(const T* src, int64_t vocab, const RowParams& p, float* row, int32_t* seen, int32_t* weight, Candidates& cand) {
  const bool penalised = p.hist_len > 0;
  if (penalised) {
    divide_row(src, row, vocab, 1.0f);  // a float32 copy (x / 1 is x)
    penalise(row, vocab, p.hist, p.hist_len, p.prompt_len, p.rep, p.freq, p.presence, seen);
  }
  if (p.temperature == 0.0f) return penalised ? argmax_row(row, vocab) : argmax_row(src, vocab);
  const float max = penalised ? divide_row(row, row, vocab, p.temperature) : divide_row(src, row, vocab, p.temperature);
  if (!(max > -INFINITY)) return 0;  // nothing finite: torch's argmax of -inf everywhere
  float cutoff = -INFINITY;
  const bool top_p_on = p.top_p < 1.0f;
  if (p.top_k > 0 && p.top_k < vocab) {
    cutoff = top_k_cutoff(row, vocab, p.top_k, cand);
    if (top_p_on) {
      double total = 0.0;
      for (auto& c : cand) {
        c.second = exp_weight<Lane1>(c.first - max);  // the index is no longer needed: the weight takes its place
        total += double(c.second);
      }
      cutoff = top_p_cutoff(cand, 0.0, double(p.top_p) * total);
    }
  } else if (top_p_on) {
    double mass[kLevels + 1];
    level_masses(row, vocab, max, mass, weight);
    const double limit = double(p.top_p) * mass[kLevels];
    int j = 0;
    while (j < kLevels && mass[j] < limit) ++j;  // the first level holding the nucleus's edge
    cand.clear();
    gather_band(row, weight, vocab, max, j < kLevels ? kLevel[j] : -INFINITY, j > 0 ? kLevel[j - 1] : INFINITY, cand);
    cutoff = top_p_cutoff(cand, j > 0 ? mass[j - 1] : 0.0, limit);
  }
  return gumbel_pick(row, vocab, max, cutoff, p.log_min_p, p.key);
}

struct Scratch {  // one thread's, kept between rows and calls (grown, never shrunk)
  std::vector<float> row;
  std::vector<int32_t> seen;  // all zero between rows
  std::vector<int32_t> weight;
  Candidates cand;
};

Scratch& scratch(int64_t vocab) {
  static thread_local Scratch s;
  if (int64_t(s.row.size()) < vocab) {
    s.row.resize(vocab);
    s.seen.assign(vocab, 0);
    s.weight.resize(vocab);
  }
  return s;
}

// Picks out[r] for each row r of x [S, V] (float32 or bfloat16): fparams float32 [6, S] (temperature, top_p,
// log_min_p, repetition, frequency, presence), iparams int64 [5, S] (top_k, noise key, history start, history
// length, prompt length), hist int32: the plan's history tokens.
void sample_rows(const at::Tensor& x, const at::Tensor& fparams, const at::Tensor& iparams, const at::Tensor& hist, at::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be contiguous float32 or bfloat16 [rows, vocab]");
  const int64_t rows = x.size(0), vocab = x.size(1);
  TORCH_CHECK(vocab < (int64_t{1} << 30), "vocabularies of 2^30 or more are not supported");
  TORCH_CHECK(fparams.scalar_type() == at::kFloat && fparams.is_contiguous() && fparams.dim() == 2 && fparams.size(0) == 6 &&
                  fparams.size(1) == rows, "fparams must be contiguous float32 [6, rows]");
  TORCH_CHECK(iparams.scalar_type() == at::kLong && iparams.is_contiguous() && iparams.dim() == 2 && iparams.size(0) == 5 &&
                  iparams.size(1) == rows, "iparams must be contiguous int64 [5, rows]");
  TORCH_CHECK(hist.scalar_type() == at::kInt && hist.is_contiguous(), "hist must be contiguous int32");
  TORCH_CHECK(out.scalar_type() == at::kLong && out.is_contiguous() && out.numel() == rows, "out must be int64 [rows]");
  const float* fp = fparams.data_ptr<float>();
  const int64_t* ip = iparams.data_ptr<int64_t>();
  const int32_t* hp = hist.data_ptr<int32_t>();
  const int64_t hist_size = hist.numel();
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(ip[3 * rows + r] == 0 || (ip[2 * rows + r] >= 0 && ip[2 * rows + r] + ip[3 * rows + r] <= hist_size),
                "a row's history lies outside hist");
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    Scratch& s = scratch(vocab);
    for (int64_t r = begin; r < end; ++r) {
      const RowParams p{fp[r], fp[rows + r], fp[2 * rows + r], fp[3 * rows + r], fp[4 * rows + r], fp[5 * rows + r],
                        ip[r], uint64_t(ip[rows + r]), hp + ip[2 * rows + r], ip[3 * rows + r], ip[4 * rows + r]};
      op[r] = x.scalar_type() == at::kFloat
                  ? sample_row(x.data_ptr<float>() + r * vocab, vocab, p, s.row.data(), s.seen.data(), s.weight.data(), s.cand)
                  : sample_row(x.data_ptr<c10::BFloat16>() + r * vocab, vocab, p, s.row.data(), s.seen.data(), s.weight.data(), s.cand);
    }
  });
}

// out[r, i] = the Gumbel noise of vocab index i in the row keyed by keys[r] (what sample_rows adds).
void gumbel_noise(const at::Tensor& keys, at::Tensor out) {
  TORCH_CHECK(keys.scalar_type() == at::kLong && keys.is_contiguous() && keys.dim() == 1, "keys must be contiguous int64 [rows]");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 && out.size(0) == keys.size(0),
              "out must be contiguous float32 [rows, vocab]");
  const int64_t rows = out.size(0), vocab = out.size(1);
  const int64_t* kp = keys.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* o = op + r * vocab;
      const uint64_t key = uint64_t(kp[r]);
      int64_t i = 0;
#if SAMPLING_VEC > 1
      for (; i + SAMPLING_VEC <= vocab; i += SAMPLING_VEC) storev(o + i, gumbel_of_bits<LaneV>(noise_bitsv(key, i)));
#endif
      for (; i < vocab; ++i) o[i] = noise1(key, i);
    }
  });
}

// The shared rules element-wise, for the tests: out = log32(x) (float32), or exp_weight(x) (int32).
void shared_rule(const at::Tensor& x, at::Tensor out) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && out.is_contiguous() && out.numel() == x.numel() &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kInt), "x float32, out float32 (log) or int32 (weight)");
  const float* xp = x.data_ptr<float>();
  const int64_t n = x.numel();
  int64_t i = 0;
  if (out.scalar_type() == at::kFloat) {
    float* op = out.data_ptr<float>();
#if SAMPLING_VEC > 1
    for (; i + SAMPLING_VEC <= n; i += SAMPLING_VEC) storev(op + i, log32<LaneV>(loadv(xp + i)));
#endif
    for (; i < n; ++i) op[i] = log32<Lane1>(xp[i]);
  } else {
    int32_t* op = out.data_ptr<int32_t>();
#if SAMPLING_VEC > 1
    for (; i + SAMPLING_VEC <= n; i += SAMPLING_VEC) storev(reinterpret_cast<float*>(op + i), LaneV::of_bits(exp_weight<LaneV>(loadv(xp + i))));
#endif
    for (; i < n; ++i) op[i] = exp_weight<Lane1>(xp[i]);
  }
}
}  // namespace

METRALE_FRAGMENT(m) {
  m.def("sample_rows(Tensor x, Tensor fparams, Tensor iparams, Tensor hist, Tensor(a!) out) -> ()");
  m.impl("sample_rows", c10::DispatchKey::CPU, TORCH_FN(sample_rows));
  m.def("gumbel_noise(Tensor keys, Tensor(a!) out) -> ()");
  m.impl("gumbel_noise", c10::DispatchKey::CPU, TORCH_FN(gumbel_noise));
  m.def("shared_rule(Tensor x, Tensor(a!) out) -> ()");
  m.impl("shared_rule", c10::DispatchKey::CPU, TORCH_FN(shared_rule));
}
