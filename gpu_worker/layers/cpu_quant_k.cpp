// The K-quant product of layers/gguf_quant_types.py's "kq8" types (Q5_1, Q5_K, Q6_K, Q3_K, Q2_K, IQ4_XS): one
// kernel for every type whose weight is w = d * sc * c + dm * mn, with c an int8 code per input, sc and mn int8
// per sub-block of 16 or 32 inputs, d and dm fp16 per block of 32 or 256 inputs (gguf_quant_types.py's
// `Blocks`). Compiled after cpu_quant.cpp in the same unit: it shares its activation quantization (int8 per
// block of 32, with the sums of each block's halves), its tiling (over_tiles, with_rows) and its stores.
//
// As llama.cpp's vec_dot_q6_K / q5_K: each sub-block's dot product is exact in int32, the sub-blocks of a block
// of 32 are combined in int32 with their integer scales (sc), then scaled once per block by d and the
// activations' scale in float32; the offsets likewise (mn times the sub-block's sum of activation codes, by dm).
//
// Layout (gguf_quant_types.pack_kq8): codes as the int8 product's ([panels][in / 4][16][4]); per panel, sc and
// mn [in / sub][16] int8, d and dm [in / sup][16] fp16, each the panel's 16 rows side by side. Per class as the
// int8 product: AVX-512 VNNI flips a code to c + 128 (each sub-block's sum starts at -128 times its activation
// codes' sum), AVX2 takes llama.cpp's sign trick, generic plain loops.

namespace {

struct KQ8 {
  const int8_t* codes;
  const int8_t* sc;
  const int8_t* mn;
  const uint16_t* d;
  const uint16_t* dm;
  int64_t blocks;     // blocks of 32 inputs per row
  int64_t per_super;  // blocks of 32 per block of d (1 or 8)
  int subs;           // sub-blocks per block of 32 (1 or 2)

  const int8_t* line(int64_t p, int64_t b, int g) const { return codes + (p * blocks * 8 + b * 8 + g) * 64; }
  const int8_t* scales(int64_t p, int64_t b, int s) const { return sc + (p * blocks * subs + b * subs + s) * kPanel; }
  const int8_t* mins(int64_t p, int64_t b, int s) const { return mn + (p * blocks * subs + b * subs + s) * kPanel; }
  const uint16_t* dscale(int64_t p, int64_t b) const { return d + (p * (blocks / per_super) + b / per_super) * kPanel; }
  const uint16_t* dmin(int64_t p, int64_t b) const { return dm + (p * (blocks / per_super) + b / per_super) * kPanel; }
};

// The sum of row r's activation codes over sub-block s of block b (SUBS sub-blocks a block).
template <int SUBS>
inline int32_t code_sum(const QuantRows& q, int64_t r, int64_t blocks, int64_t b, int s) {
  return SUBS == 1 ? q.sum[r * blocks + b] : q.sum16[2 * (r * blocks + b) + s];
}

#if defined(METRALE_AVX512) && defined(__AVX512VNNI__)
template <int MR, int NP, int SUBS, bool OFF>
void kq8_panels(const KQ8& w, int64_t p0, const QuantRows& q, int64_t m0, int64_t kp, float* out) {
  const int64_t blocks = w.blocks;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[MR][NP];
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i isum[MR][NP][SUBS];
    for (int m = 0; m < MR; ++m)
      for (int s = 0; s < SUBS; ++s) {
        const __m512i start = _mm512_set1_epi32(-128 * code_sum<SUBS>(q, m0 + m, blocks, b, s));
        for (int p = 0; p < NP; ++p) isum[m][p][s] = start;
      }
    const int8_t* xb = q.codes.data() + m0 * kp + b * kBlock;
    for (int g = 0; g < kBlock / 4; ++g) {
      const int s = SUBS == 2 ? g >> 2 : 0;
      __m512i wv[NP];
      for (int p = 0; p < NP; ++p) {
        const int8_t* line = w.line(p0 + p, b, g);
        prefetch(line + kPrefetchBytes);
        wv[p] = _mm512_xor_si512(_mm512_loadu_si512(line), flip);
      }
      for (int m = 0; m < MR; ++m) {
        int32_t x4;
        std::memcpy(&x4, xb + m * kp + g * 4, 4);
        const __m512i xv = _mm512_set1_epi32(x4);
        for (int p = 0; p < NP; ++p) isum[m][p][s] = _mm512_dpbusd_epi32(isum[m][p][s], wv[p], xv);
      }
    }
    for (int p = 0; p < NP; ++p) {
      __m512i sc[SUBS], mn[SUBS];
      for (int s = 0; s < SUBS; ++s) {
        sc[s] = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)w.scales(p0 + p, b, s)));
        if (OFF) mn[s] = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)w.mins(p0 + p, b, s)));
      }
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)w.dscale(p0 + p, b)));
      const __m512 dm = OFF ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)w.dmin(p0 + p, b))) : d;
      for (int m = 0; m < MR; ++m) {
        __m512i total = _mm512_mullo_epi32(isum[m][p][0], sc[0]);
        if (SUBS == 2) total = _mm512_add_epi32(total, _mm512_mullo_epi32(isum[m][p][1], sc[1]));
        const __m512 xs = _mm512_set1_ps(q.scale[(m0 + m) * blocks + b]);
        acc[m][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(d, xs), acc[m][p]);
        if (OFF) {
          __m512i mins = _mm512_mullo_epi32(mn[0], _mm512_set1_epi32(code_sum<SUBS>(q, m0 + m, blocks, b, 0)));
          if (SUBS == 2) mins = _mm512_add_epi32(mins, _mm512_mullo_epi32(mn[1], _mm512_set1_epi32(code_sum<SUBS>(q, m0 + m, blocks, b, 1))));
          acc[m][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(mins), _mm512_mul_ps(dm, xs), acc[m][p]);
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < NP; ++p) _mm512_storeu_ps(out + m * NP * kPanel + p * kPanel, acc[m][p]);
}
#elif defined(METRALE_AVX2)
// A panel's 16 rows as two halves of 8 (one 32-byte half-line each).
template <int MR, int NP, int SUBS, bool OFF>
void kq8_panels(const KQ8& w, int64_t p0, const QuantRows& q, int64_t m0, int64_t kp, float* out) {
  static_assert(NP == 1, "AVX2 has registers for one panel");
  const int64_t blocks = w.blocks;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i isum[MR][2][SUBS];
    for (int m = 0; m < MR; ++m)
      for (int h = 0; h < 2; ++h)
        for (int s = 0; s < SUBS; ++s) isum[m][h][s] = _mm256_setzero_si256();
    const int8_t* xb = q.codes.data() + m0 * kp + b * kBlock;
    for (int g = 0; g < kBlock / 4; ++g) {
      const int s = SUBS == 2 ? g >> 2 : 0;
      const int8_t* line = w.line(p0, b, g);
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
          isum[m][h][s] = _mm256_add_epi32(isum[m][h][s], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      __m256i sc[SUBS], mn[SUBS];
      for (int s = 0; s < SUBS; ++s) {
        sc[s] = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(w.scales(p0, b, s) + 8 * h)));
        if (OFF) mn[s] = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(w.mins(p0, b, s) + 8 * h)));
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w.dscale(p0, b) + 8 * h)));
      const __m256 dm = OFF ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w.dmin(p0, b) + 8 * h))) : d;
      for (int m = 0; m < MR; ++m) {
        __m256i total = _mm256_mullo_epi32(isum[m][h][0], sc[0]);
        if (SUBS == 2) total = _mm256_add_epi32(total, _mm256_mullo_epi32(isum[m][h][1], sc[1]));
        const __m256 xs = _mm256_set1_ps(q.scale[(m0 + m) * blocks + b]);
        acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, xs), acc[m][h]);
        if (OFF) {
          __m256i mins = _mm256_mullo_epi32(mn[0], _mm256_set1_epi32(code_sum<SUBS>(q, m0 + m, blocks, b, 0)));
          if (SUBS == 2) mins = _mm256_add_epi32(mins, _mm256_mullo_epi32(mn[1], _mm256_set1_epi32(code_sum<SUBS>(q, m0 + m, blocks, b, 1))));
          acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_mul_ps(dm, xs), acc[m][h]);
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + m * kPanel + 8 * h, acc[m][h]);
}
#else
template <int MR, int NP, int SUBS, bool OFF>
void kq8_panels(const KQ8& w, int64_t p0, const QuantRows& q, int64_t m0, int64_t kp, float* out) {
  const int64_t blocks = w.blocks;
  for (int m = 0; m < MR; ++m) {
    const int64_t row = m0 + m;
    for (int p = 0; p < NP; ++p) {
      float acc[kPanel] = {};
      for (int64_t b = 0; b < blocks; ++b) {
        int32_t isum[kPanel][SUBS] = {};
        const int8_t* xb = q.codes.data() + row * kp + b * kBlock;
        for (int g = 0; g < kBlock / 4; ++g) {
          const int s = SUBS == 2 ? g >> 2 : 0;
          const int8_t* line = w.line(p0 + p, b, g);
          for (int r = 0; r < kPanel; ++r)
            for (int j = 0; j < 4; ++j) isum[r][s] += int32_t(line[r * 4 + j]) * xb[g * 4 + j];
        }
        const float xs = q.scale[row * blocks + b];
        for (int r = 0; r < kPanel; ++r) {
          int32_t total = 0, mins = 0;
          for (int s = 0; s < SUBS; ++s) {
            total += isum[r][s] * w.scales(p0 + p, b, s)[r];
            if (OFF) mins += int32_t(w.mins(p0 + p, b, s)[r]) * code_sum<SUBS>(q, row, blocks, b, s);
          }
          acc[r] += float(total) * (half_to_float(w.dscale(p0 + p, b)[r]) * xs);
          if (OFF) acc[r] += float(mins) * (half_to_float(w.dmin(p0 + p, b)[r]) * xs);
        }
      }
      std::memcpy(out + m * NP * kPanel + p * kPanel, acc, sizeof(acc));
    }
  }
}
#endif

template <int SUBS, bool OFF>
struct KQ8Of {
  template <int MR, int NP>
  struct Tile {
    static void run(const KQ8& w, int64_t p0, const QuantRows& q, int64_t m0, int64_t kp, float* out) {
      kq8_panels<MR, NP, SUBS, OFF>(w, p0, q, m0, kp, out);
    }
  };
};

#if defined(METRALE_AMX)
// Panel p into buf [kp / 2][16][2] bf16 for the wide product: per sub-block, w = c * (d * sc) + dm * mn in
// float32 (gguf_quant_types.dequantize's order of roundings), then rounded to bf16.
template <int SUBS, bool OFF>
void dequant_kq8_panel(const KQ8& w, int64_t p, c10::BFloat16* buf) {
  for (int64_t b = 0; b < w.blocks; ++b) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)w.dscale(p, b)));
    const __m512 dm = OFF ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)w.dmin(p, b))) : d;
    for (int s = 0; s < SUBS; ++s) {
      const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)w.scales(p, b, s))));
      const Spread scale(_mm512_mul_ps(d, sc));
      const Spread offset(OFF ? _mm512_mul_ps(dm, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)w.mins(p, b, s)))))
                              : _mm512_setzero_ps());
      for (int g = s * (8 / SUBS); g < (s + 1) * (8 / SUBS); ++g) {
        const int8_t* line = w.line(p, b, g);
        __m128i v[4];
        for (int i = 0; i < 4; ++i) v[i] = _mm_loadu_si128((const __m128i*)(line + 16 * i));
        c10::BFloat16* at = buf + (b * 16 + 2 * g) * 32;
        dequant_line<true, OFF>(v, scale, offset, at, at + 32);
      }
    }
  }
}
#endif

template <int SUBS, bool OFF>
void kq8_product(const at::Tensor& x, const KQ8& w, int64_t n, bool wide, at::Tensor& y) {
  const int64_t m = x.size(0), kp = w.blocks * kBlock;
  if (wide) {
    check_wide(x);
#if defined(METRALE_AMX)
    amx_linear(x, kp, n, y, [&](int64_t p, c10::BFloat16* buf) { dequant_kq8_panel<SUBS, OFF>(w, p, buf); });
#endif
    return;
  }
  QuantRows& q = scratch();
  quantize_input(x, kp, q);
  over_tiles(m, n, [&](int64_t p0, int np, int64_t m0, int mr, float* buf) {
    if (np == kPanelsPerStep)
      with_rows<KQ8Of<SUBS, OFF>::template Tile, kPanelsPerStep>(mr, w, p0, q, m0, kp, buf);
    else
      with_rows<KQ8Of<SUBS, OFF>::template Tile, 1>(mr, w, p0, q, m0, kp, buf);
    store_rows(buf, mr, np, y, n, m0, p0 * kPanel);
  });
}

// y [M, n] = x [M, k] @ W.T, W packed by gguf_quant_types.pack_kq8: codes int8 [panels, kp / 4, 16, 4], sc and mn
// int8 [panels, kp / sub, 16], d and dm fp16 bits (int16) [panels, kp / sup, 16]; mn and dm empty: no offsets.
// wide: the amx class's many bf16 rows, through the weight dequantized to bf16 (cpu_quant.cpp's amx_linear).
at::Tensor kq8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& sc, const at::Tensor& mn, const at::Tensor& d,
                      const at::Tensor& dm, int64_t n, bool wide) {
  TORCH_CHECK(codes.dim() == 4 && sc.dim() == 3 && d.dim() == 3, "kq8_linear: codes [panels, kp / 4, 16, 4], sc and d [panels, *, 16]");
  const int64_t panels = codes.size(0), kp = codes.size(1) * 4, blocks = kp / kBlock;
  check_input(x, kp);
  const bool off = mn.numel() > 0;
  TORCH_CHECK(codes.scalar_type() == at::kChar && sc.scalar_type() == at::kChar && mn.scalar_type() == at::kChar &&
                  d.scalar_type() == at::kShort && dm.scalar_type() == at::kShort,
              "kq8_linear: codes, sc, mn int8; d, dm int16 (fp16 bits)");
  TORCH_CHECK(codes.is_contiguous() && sc.is_contiguous() && mn.is_contiguous() && d.is_contiguous() && dm.is_contiguous(),
              "kq8_linear: contiguous tensors");
  TORCH_CHECK(kp % kBlock == 0 && panels * kPanel >= n && sc.size(0) == panels && d.size(0) == panels, "kq8_linear: packed sizes do not match");
  const int64_t subs = sc.size(1) / blocks, supers = d.size(1);
  TORCH_CHECK((subs == 1 || subs == 2) && sc.size(1) == subs * blocks && supers > 0 && blocks % supers == 0, "kq8_linear: sub-blocks of 16 or 32, whole blocks");
  TORCH_CHECK(!off || (mn.sizes() == sc.sizes() && dm.sizes() == d.sizes()), "kq8_linear: mn and dm shaped as sc and d");
  const KQ8 w{codes.data_ptr<int8_t>(), sc.data_ptr<int8_t>(), off ? mn.data_ptr<int8_t>() : nullptr,
              reinterpret_cast<const uint16_t*>(d.data_ptr<int16_t>()), off ? reinterpret_cast<const uint16_t*>(dm.data_ptr<int16_t>()) : nullptr,
              blocks, blocks / supers, int(subs)};
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  if (subs == 2)
    off ? kq8_product<2, true>(x, w, n, wide, y) : kq8_product<2, false>(x, w, n, wide, y);
  else
    off ? kq8_product<1, true>(x, w, n, wide, y) : kq8_product<1, false>(x, w, n, wide, y);
  return y;
}

}  // namespace

METRALE_FRAGMENT(m) {
  m.def("kq8_linear(Tensor x, Tensor codes, Tensor sc, Tensor mn, Tensor d, Tensor dm, int n, bool wide) -> Tensor");
  m.impl("kq8_linear", c10::DispatchKey::CPU, TORCH_FN(kq8_linear));
}
