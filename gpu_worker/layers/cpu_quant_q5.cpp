// The 5-bit product of layers/gguf_quant_types.py's "int5" types (Q5_0, Q5_1): codes 0..31 in groups of 32
// inputs with an fp16 scale and offset each (w = s * q + z; Q5_0's z = -16 s, not stored: the layout then holds
// the file's 5.5 bits a weight, Q5_1's 6), rather than widened to 8. Compiled after cpu_quant.cpp in the same unit (its activation
// quantization, tiling and stores).
//
// Layout (gguf_quant_types.pack_int5): the low four bits as the 4-bit product's ([panels][in / 8][16][4], a
// byte's low nibble one input, its high nibble the input four later), and per 64-byte line of those a 16-byte
// line of fifth bits: 8 bytes for the low nibbles (bit i: byte i's), then 8 for the high ones. AVX-512 turns a
// bit line into a mask and adds 16 where it is set (one masked move per nibble plane); AVX2 spreads bits to
// bytes as llama.cpp's bytes_from_bits_32 does; codes are unsigned, so VNNI takes them as they are and AVX2's
// maddubs needs no sign trick (a block's pairs are summed to int32 per group: 5-bit pairs overflow int16 over
// a whole block).

namespace {

#if defined(METRALE_AVX512) && defined(__AVX512VNNI__)
template <int MR, int NP>
void int5_panels(const uint8_t* w, const uint8_t* hb, const uint16_t* ws, const uint16_t* wz, int64_t blocks, const QuantRows& q,
                 int64_t m0, int64_t kp, float* out) {
  const int64_t panel_bytes = blocks * kBlock * kPanel / 2, panel_bits = panel_bytes / 4;
  const __m512i low = _mm512_set1_epi8(0x0F), sixteen = _mm512_set1_epi8(16);
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
        const uint8_t* bits = hb + p * panel_bits + (b * 4 + g) * 16;
        prefetch(line + kPrefetchBytes);
        const __m512i v = _mm512_loadu_si512(line);
        uint64_t mlo, mhi;
        std::memcpy(&mlo, bits, 8);
        std::memcpy(&mhi, bits + 8, 8);
        lo[p] = _mm512_mask_add_epi8(_mm512_and_si512(v, low), (__mmask64)mlo, _mm512_and_si512(v, low), sixteen);
        const __m512i h4 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        hi[p] = _mm512_mask_add_epi8(h4, (__mmask64)mhi, h4, sixteen);
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
      const __m512 zw = wz ? load16(wz + p * blocks * kPanel + b * kPanel) : _mm512_mul_ps(sw, _mm512_set1_ps(-16.0f));
      for (int m = 0; m < MR; ++m) {
        const float xs = q.scale[(m0 + m) * blocks + b];
        acc[m][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[m][p]), _mm512_mul_ps(sw, _mm512_set1_ps(xs)), acc[m][p]);
        acc[m][p] = _mm512_fmadd_ps(zw, _mm512_set1_ps(xs * float(q.sum[(m0 + m) * blocks + b])), acc[m][p]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < NP; ++p) _mm512_storeu_ps(out + m * NP * kPanel + p * kPanel, acc[m][p]);
}
#elif defined(METRALE_AVX2)
// 32 bits as 32 bytes: 0xFF where the bit is set (llama.cpp's bytes_from_bits_32).
inline __m256i bytes_from_bits(const uint8_t* p) {
  uint32_t x32;
  std::memcpy(&x32, p, 4);
  const __m256i shuffle = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000);
  const __m256i bytes = _mm256_or_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(x32), shuffle), _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}

template <int MR, int NP>
void int5_panels(const uint8_t* w, const uint8_t* hb, const uint16_t* ws, const uint16_t* wz, int64_t blocks, const QuantRows& q,
                 int64_t m0, int64_t kp, float* out) {
  static_assert(NP == 1, "AVX2 has registers for one panel");
  const __m256i low = _mm256_set1_epi8(0x0F), sixteen = _mm256_set1_epi8(16), ones = _mm256_set1_epi16(1);
  __m256 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i isum[MR][2];
    for (int m = 0; m < MR; ++m) isum[m][0] = isum[m][1] = _mm256_setzero_si256();
    const int8_t* xb = q.codes.data() + m0 * kp + b * kBlock;
    for (int g = 0; g < kBlock / 8; ++g) {
      const uint8_t* line = w + (b * 4 + g) * 64;
      const uint8_t* bits = hb + (b * 4 + g) * 16;
      prefetch(line + kPrefetchBytes);
      __m256i lo[2], hi[2];
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(line + 32 * h));
        lo[h] = _mm256_or_si256(_mm256_and_si256(v, low), _mm256_and_si256(bytes_from_bits(bits + 4 * h), sixteen));
        hi[h] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), _mm256_and_si256(bytes_from_bits(bits + 8 + 4 * h), sixteen));
      }
      for (int m = 0; m < MR; ++m) {
        int32_t x4[2];
        std::memcpy(x4, xb + m * kp + g * 8, 8);
        const __m256i x0 = _mm256_set1_epi32(x4[0]), x1 = _mm256_set1_epi32(x4[1]);
        for (int h = 0; h < 2; ++h) {
          const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], x0), _mm256_maddubs_epi16(hi[h], x1));
          isum[m][h] = _mm256_add_epi32(isum[m][h], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 sw = load8(ws + b * kPanel + 8 * h);
      const __m256 zw = wz ? load8(wz + b * kPanel + 8 * h) : _mm256_mul_ps(sw, _mm256_set1_ps(-16.0f));
      for (int m = 0; m < MR; ++m) {
        const float xs = q.scale[(m0 + m) * blocks + b];
        acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[m][h]), _mm256_mul_ps(sw, _mm256_set1_ps(xs)), acc[m][h]);
        acc[m][h] = _mm256_fmadd_ps(zw, _mm256_set1_ps(xs * float(q.sum[(m0 + m) * blocks + b])), acc[m][h]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + m * kPanel + 8 * h, acc[m][h]);
}
#else
template <int MR, int NP>
void int5_panels(const uint8_t* w, const uint8_t* hb, const uint16_t* ws, const uint16_t* wz, int64_t blocks, const QuantRows& q,
                 int64_t m0, int64_t kp, float* out) {
  const int64_t panel_bytes = blocks * kBlock * kPanel / 2, panel_bits = panel_bytes / 4;
  for (int m = 0; m < MR; ++m) {
    for (int p = 0; p < NP; ++p) {
      float acc[kPanel] = {};
      for (int64_t b = 0; b < blocks; ++b) {
        int32_t isum[kPanel] = {};
        const int8_t* xb = q.codes.data() + (m0 + m) * kp + b * kBlock;
        for (int g = 0; g < kBlock / 8; ++g) {
          const uint8_t* line = w + p * panel_bytes + (b * 4 + g) * 64;
          const uint8_t* bits = hb + p * panel_bits + (b * 4 + g) * 16;
          for (int r = 0; r < kPanel; ++r)
            for (int j = 0; j < 4; ++j) {
              const int i = r * 4 + j;
              const int lo = (line[i] & 15) | (((bits[i / 8] >> (i % 8)) & 1) << 4);
              const int hi = (line[i] >> 4) | (((bits[8 + i / 8] >> (i % 8)) & 1) << 4);
              isum[r] += lo * xb[g * 8 + j] + hi * xb[g * 8 + 4 + j];
            }
        }
        const float xs = q.scale[(m0 + m) * blocks + b];
        const float xsum = xs * float(q.sum[(m0 + m) * blocks + b]);
        const int64_t at = p * blocks * kPanel + b * kPanel;
        for (int r = 0; r < kPanel; ++r) {
          acc[r] += float(isum[r]) * (half_to_float(ws[at + r]) * xs);
          acc[r] += (wz ? half_to_float(wz[at + r]) : -16.0f * half_to_float(ws[at + r])) * xsum;
        }
      }
      std::memcpy(out + m * NP * kPanel + p * kPanel, acc, sizeof(acc));
    }
  }
}
#endif

#if defined(METRALE_AMX)
// One 5-bit panel into buf [kp / 2][16][2] bf16 for the wide product: as dequant_int4_panel, each nibble plane
// raised by 16 where its fifth bit is set (a 16-byte chunk's bits are two bytes of the line's bit plane), then
// w = code * s + z (z = -16 s for Q5_0: gguf's d * (q - 16) exactly, both products being exact in float32).
void dequant_int5_panel(const uint8_t* w, const uint8_t* hb, const uint16_t* ws, const uint16_t* wz, int64_t blocks, c10::BFloat16* buf) {
  const __m128i low = _mm_set1_epi8(0x0F), sixteen = _mm_set1_epi8(16);
  for (int64_t b = 0; b < blocks; ++b) {
    const __m512 sv = load16(ws + b * kPanel);
    const Spread scale(sv), offset(wz ? load16(wz + b * kPanel) : _mm512_mul_ps(sv, _mm512_set1_ps(-16.0f)));
    for (int g = 0; g < kBlock / 8; ++g) {
      const uint8_t* line = w + (b * 4 + g) * 64;
      const uint8_t* bits = hb + (b * 4 + g) * 16;
      __m128i lo[4], hi[4];
      for (int i = 0; i < 4; ++i) {
        const __m128i v = _mm_loadu_si128((const __m128i*)(line + 16 * i));
        uint16_t blo, bhi;
        std::memcpy(&blo, bits + 2 * i, 2);
        std::memcpy(&bhi, bits + 8 + 2 * i, 2);
        const __m128i l4 = _mm_and_si128(v, low), h4 = _mm_and_si128(_mm_srli_epi16(v, 4), low);
        lo[i] = _mm_mask_add_epi8(l4, (__mmask16)blo, l4, sixteen);
        hi[i] = _mm_mask_add_epi8(h4, (__mmask16)bhi, h4, sixteen);
      }
      c10::BFloat16* at = buf + (b * 16 + 4 * g) * 32;
      dequant_line<false, true>(lo, scale, offset, at, at + 32);
      dequant_line<false, true>(hi, scale, offset, at + 64, at + 96);
    }
  }
}
#endif

template <int MR, int NP>
struct Int5Tile {
  static void run(const uint8_t* w, const uint8_t* hb, const uint16_t* ws, const uint16_t* wz, int64_t blocks, const QuantRows& q, int64_t m0,
                  int64_t kp, float* out) {
    int5_panels<MR, NP>(w, hb, ws, wz, blocks, q, m0, kp, out);
  }
};

// y [M, n] = x [M, k] @ W.T for W packed by gguf_quant_types.pack_int5: low bits uint8 [panels, kp / 8, 16, 4]
// (pack_int4's), fifth bits uint8 [panels, kp / 8, 16], scales and offsets fp16 bits (int16) [panels, kp / 32, 16]
// (offsets empty: Q5_0's, -16 times the scale).
// wide (the amx class's many bf16 rows): the weight dequantized to bf16 a panel pair at a time, AMX-BF16 tiles
// (cpu_quant.cpp's amx_linear).
at::Tensor int5_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& bits, const at::Tensor& scales, const at::Tensor& zeros,
                       int64_t n, bool wide) {
  const int64_t blocks = scales.size(1), kp = blocks * kBlock, panels = scales.size(0);
  check_input(x, kp);
  TORCH_CHECK(codes.scalar_type() == at::kByte && bits.scalar_type() == at::kByte && scales.scalar_type() == at::kShort &&
                  zeros.scalar_type() == at::kShort && codes.is_contiguous() && bits.is_contiguous() && scales.is_contiguous() &&
                  zeros.is_contiguous(),
              "int5_linear: codes and bits uint8, scales and offsets fp16 bits (int16), contiguous");
  TORCH_CHECK(panels * kPanel >= n && codes.numel() == panels * kp * kPanel / 2 && bits.numel() == panels * kp * kPanel / 8 &&
                  (zeros.sizes() == scales.sizes() || zeros.numel() == 0),
              "int5_linear: packed sizes do not match");
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  const uint8_t* w = codes.data_ptr<uint8_t>();
  const uint8_t* hb = bits.data_ptr<uint8_t>();
  const uint16_t* ws = reinterpret_cast<const uint16_t*>(scales.data_ptr<int16_t>());
  // No offsets (Q5_0): each is -16 times its scale (exact in float32, as the fp16 offset it replaces was).
  const uint16_t* wz = zeros.numel() ? reinterpret_cast<const uint16_t*>(zeros.data_ptr<int16_t>()) : nullptr;
  const int64_t panel_bytes = kp * kPanel / 2, panel_bits = panel_bytes / 4;
  if (wide) {
    check_wide(x);
#if defined(METRALE_AMX)
    amx_linear(x, kp, n, y, [&](int64_t p, c10::BFloat16* buf) {
      const int64_t at = p * blocks * kPanel;
      dequant_int5_panel(w + p * panel_bytes, hb + p * panel_bits, ws + at, wz ? wz + at : nullptr, blocks, buf);
    });
#endif
    return y;
  }
  QuantRows& q = scratch();
  quantize_input(x, kp, q);
  over_tiles(x.size(0), n, [&](int64_t p0, int np, int64_t m0, int mr, float* buf) {
    const int64_t at = p0 * blocks * kPanel;
    if (np == kPanelsPerStep)
      with_rows<Int5Tile, kPanelsPerStep>(mr, w + p0 * panel_bytes, hb + p0 * panel_bits, ws + at, wz ? wz + at : nullptr, blocks, q, m0, kp, buf);
    else
      with_rows<Int5Tile, 1>(mr, w + p0 * panel_bytes, hb + p0 * panel_bits, ws + at, wz ? wz + at : nullptr, blocks, q, m0, kp, buf);
    store_rows(buf, mr, np, y, n, m0, p0 * kPanel);
  });
  return y;
}

}  // namespace

METRALE_FRAGMENT(m) {
  m.def("int5_linear(Tensor x, Tensor codes, Tensor bits, Tensor scales, Tensor zeros, int n, bool wide) -> Tensor");
  m.impl("int5_linear", c10::DispatchKey::CPU, TORCH_FN(int5_linear));
}
