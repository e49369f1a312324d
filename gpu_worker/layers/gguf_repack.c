/* GGUF repacking: rows of codes (gguf_quant_types.py's common form) into the quantized kernels' panel layouts
 * (cpu_quant.cpp's), one pass each. Plain C over raw pointers, no torch: gguf_repack.py builds it with the
 * system compiler and calls it through ctypes (which releases the GIL, so row ranges run on several threads).
 * Each function fills panels [p0, p1) of its output; rows past `rows` are zero (the last panel's padding).
 * The layouts, for panels of 16 rows:
 *   int8  codes [panels, cols / 4, 16, 4]: out[p][g][r][k] = codes[16p + r][4g + k]
 *   int4  codes [panels, cols / 8, 16, 4]: out[p][g][r][k] = c[8g + k] | c[8g + k + 4] << 4, c = codes + bias
 *   bits5 [panels, cols / 8, 16]: per group of 8 inputs and half h (inputs 4h .. 4h + 3), the 64 fifth bits of
 *         c (row r, input k: bit 4r + k), little-endian, in bytes 8h .. 8h + 7. */
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define PANEL 16

void panel_int8(const int8_t *codes, int64_t rows, int64_t cols, int64_t p0, int64_t p1, int8_t *out) {
    const int64_t groups = cols / 4;
    for (int64_t p = p0; p < p1; p++) {
        int8_t *dst = out + p * groups * PANEL * 4;
        for (int64_t r = 0; r < PANEL; r++) {
            const int64_t row = p * PANEL + r;
            if (row >= rows) {
                for (int64_t g = 0; g < groups; g++) memset(dst + (g * PANEL + r) * 4, 0, 4);
                continue;
            }
            const int8_t *src = codes + row * cols;
            for (int64_t g = 0; g < groups; g++) memcpy(dst + (g * PANEL + r) * 4, src + 4 * g, 4);
        }
    }
}

void panel_int4(const int8_t *codes, int64_t bias, int64_t rows, int64_t cols, int64_t p0, int64_t p1, uint8_t *out) {
    const int64_t groups = cols / 8;
    for (int64_t p = p0; p < p1; p++) {
        uint8_t *dst = out + p * groups * PANEL * 4;
        for (int64_t r = 0; r < PANEL; r++) {
            const int64_t row = p * PANEL + r;
            if (row >= rows) {
                for (int64_t g = 0; g < groups; g++) memset(dst + (g * PANEL + r) * 4, 0, 4);
                continue;
            }
            const int8_t *src = codes + row * cols;
            for (int64_t g = 0; g < groups; g++) {
                const int8_t *c = src + 8 * g;
                uint8_t *o = dst + (g * PANEL + r) * 4;
                for (int k = 0; k < 4; k++)
                    o[k] = (uint8_t)((((uint8_t)(c[k] + bias)) & 15) | ((((uint8_t)(c[k + 4] + bias)) & 15) << 4));
            }
        }
    }
}

void panel_bits5(const int8_t *codes, int64_t bias, int64_t rows, int64_t cols, int64_t p0, int64_t p1, uint8_t *out) {
    const int64_t groups = cols / 8;
    for (int64_t p = p0; p < p1; p++) {
        for (int64_t g = 0; g < groups; g++) {
            uint8_t *o = out + (p * groups + g) * 16;
            for (int h = 0; h < 2; h++) {
                uint64_t bits = 0;
                for (int r = 0; r < PANEL; r++) {
                    const int64_t row = p * PANEL + r;
                    if (row >= rows) break;
                    const int8_t *c = codes + row * cols + 8 * g + 4 * h;
                    for (int k = 0; k < 4; k++)
                        bits |= (uint64_t)((((uint8_t)(c[k] + bias)) >> 4) & 1) << (4 * r + k);
                }
                for (int b = 0; b < 8; b++) o[8 * h + b] = (uint8_t)(bits >> (8 * b));
            }
        }
    }
}

/* ---- Stored blocks straight into the panels ---------------------------------------------------------------
 * The same layouts filled from the file's stored blocks, with no common form in between (gguf_quant_types.py's
 * decoders, whose bytes these reproduce: the tests compare them). A run's rows come as one address per row
 * (`ptrs`: the row's blocks, 0 for a row no part filled, which decodes as zero blocks) and one type per row
 * (`types`: TYPE_*, -1 for the padding past the last row, which is all zeros); each call fills whole panels
 * [p0, p1), so threads never share a panel. Scales and offsets of the 4- and 5-bit layouts are written as
 * float32, in numpy's order of operations (s = d * sc, z = dm * mn + (-bias * s)); f16_exact then gives their
 * fp16 bits where every one is exact. Each returns 1 when every fp16 scale it read was finite, else 0 (the file's
 * finiteness check, made in the same pass). */

enum { TYPE_Q8_0 = 0, TYPE_Q4_0 = 1, TYPE_Q4_1 = 2, TYPE_Q4_K = 3, TYPE_Q5_0 = 4, TYPE_Q5_1 = 5, TYPE_Q5_K = 6, TYPE_Q6_K = 7 };

static const int64_t BLOCK_INPUTS[8] = {32, 32, 32, 256, 32, 32, 256, 256};
static const int64_t BLOCK_BYTES[8] = {34, 18, 20, 144, 22, 24, 176, 210};
static const uint8_t ZERO_BLOCK[256];

static float h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exp = 113;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static uint16_t half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return h;
}

/* Where each type's fp16 scales lie in its block (gguf_quant_types.TYPES' halves; -1: none). */
static const int HALF0[8] = {0, 0, 0, 0, 0, 0, 0, 208}, HALF1[8] = {-1, -1, 2, 2, -1, 2, 2, -1};

/* 1 when the block's fp16 scales are finite (an inf or NaN scale makes its whole block so), else 0. */
static int block_finite(int type, const uint8_t *b) {
    int ok = (half_at(b + HALF0[type]) & 0x7C00) != 0x7C00;
    if (HALF1[type] >= 0) ok &= (half_at(b + HALF1[type]) & 0x7C00) != 0x7C00;
    return ok;
}

/* The fp16 bits of x when x is exactly an fp16 number (1), else 0 (torch's x.half().float() == x). */
static int f2h_exact(float x, uint16_t *out) {
    uint32_t b;
    memcpy(&b, &x, 4);
    const uint16_t sign = (uint16_t)((b >> 16) & 0x8000);
    const int exp = (int)((b >> 23) & 0xFF);
    const uint32_t man = b & 0x7FFFFF;
    if (exp == 0 && man == 0) { *out = sign; return 1; }
    if (exp == 0xFF) { *out = (uint16_t)(sign | 0x7C00 | (man >> 13)); return man == 0; } /* inf; NaN never equal */
    const int e = exp - 127;
    if (e > 15 || e < -24 || exp == 0) return 0;
    if (e >= -14) {
        if (man & 0x1FFF) return 0;
        *out = (uint16_t)(sign | ((e + 15) << 10) | (man >> 13));
        return 1;
    }
    const uint32_t full = man | 0x800000;
    const int shift = -(e + 1); /* a subnormal fp16: full * 2^(e - 23) = k * 2^-24 */
    if (full & ((1u << shift) - 1)) return 0;
    *out = (uint16_t)(sign | (full >> shift));
    return 1;
}

/* out[i] = fp16 bits of x[i] for i < n; 0 at the first x[i] that is not exactly an fp16 number (out then partial). */
int64_t f16_exact(const float *x, int64_t n, uint16_t *out) {
    for (int64_t i = 0; i < n; i++)
        if (!f2h_exact(x[i], out + i)) return 0;
    return 1;
}

/* Q4_K / Q5_K: the 6-bit scales and mins of the 8 sub-blocks (gguf's Q4_K.get_scale_min). */
static void k_scales(const uint8_t *s, uint8_t *sc, uint8_t *mn) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (uint8_t)((s[j + 8] & 0x0F) | ((s[j] >> 6) << 4));
        mn[j + 4] = (uint8_t)((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
    }
}

/* One block of a 4- or 5-bit type as the low four bits u of its stored unsigned codes (the fifth bits of a 5-bit
 * type as *fifth, bit i for input i of the 32) and, per 32 inputs, the float32 scale and offset of w = s * u + z. */
static void unsigned_block(int type, const uint8_t *b, uint8_t *u, uint32_t *fifth, float *s, float *z) {
    int j, t;
    switch (type) {
    case TYPE_Q4_0:
    case TYPE_Q4_1:
    case TYPE_Q5_0:
    case TYPE_Q5_1: {
        /* d, then m (Q4_1, Q5_1), then the fifth bits (Q5_0, Q5_1), then the nibbles */
        const int with_m = type == TYPE_Q4_1 || type == TYPE_Q5_1, five = type == TYPE_Q5_0 || type == TYPE_Q5_1;
        const int head = 2 + 2 * with_m;
        const uint8_t *qs = b + head + (five ? 4 : 0);
        for (j = 0; j < 16; j++) {
            u[j] = qs[j] & 15;
            u[j + 16] = qs[j] >> 4;
        }
        if (five) {
            uint32_t qh;
            memcpy(&qh, b + head, 4);
            *fifth = qh; /* (u keeps the low four bits: the layouts store the fifth apart) */
        }
        const float d = h2f(half_at(b));
        s[0] = d;
        if (type == TYPE_Q4_0 || type == TYPE_Q5_0) {
            z[0] = -(float)(type == TYPE_Q4_0 ? 8 : 16) * d;
        } else {
            const float zero = -0.0f * d;
            z[0] = h2f(half_at(b + 2)) * 1.0f + zero;
        }
        break;
    }
    case TYPE_Q4_K: {
        uint8_t sc[8], mn[8];
        k_scales(b + 4, sc, mn);
        const float d = h2f(half_at(b)), dm = -h2f(half_at(b + 2));
        for (j = 0; j < 8; j++) {
            s[j] = d * (float)sc[j];
            const float zero = -0.0f * s[j];
            z[j] = dm * (float)mn[j] + zero;
        }
        const uint8_t *qs = b + 16;
        for (t = 0; t < 4; t++)
            for (j = 0; j < 32; j++) {
                u[64 * t + j] = qs[32 * t + j] & 15;
                u[64 * t + 32 + j] = qs[32 * t + j] >> 4;
            }
        break;
    }
    }
}

/* A 32-input block's 16 bytes of nibbles (input j low in byte j, input j + 16 high) as the 4-bit layout's four
 * groups of one row (group gi at out + 64 gi: byte k = input 8gi + k | input 8gi + k + 4 << 4). SSE2 is part of
 * x86-64 itself (no ISA flag); elsewhere the same bytes one by one. */
static void nibbles16(const uint8_t *qs, uint8_t *out) {
#if defined(__SSE2__)
    const __m128i q = _mm_loadu_si128((const __m128i *)qs), low = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(q, low), hi = _mm_and_si128(_mm_srli_epi16(q, 4), low);
    /* (a 16-bit shift by 4 keeps each byte's nibble in its own byte: every byte is below 16) */
    const __m128i a = _mm_or_si128(lo, _mm_slli_epi16(_mm_srli_si128(lo, 4), 4));  /* groups 0 and 1 at bytes 0, 8 */
    const __m128i b = _mm_or_si128(hi, _mm_slli_epi16(_mm_srli_si128(hi, 4), 4));  /* groups 2 and 3 */
    const uint32_t g0 = (uint32_t)_mm_cvtsi128_si32(a), g1 = (uint32_t)_mm_cvtsi128_si32(_mm_srli_si128(a, 8));
    const uint32_t g2 = (uint32_t)_mm_cvtsi128_si32(b), g3 = (uint32_t)_mm_cvtsi128_si32(_mm_srli_si128(b, 8));
    memcpy(out, &g0, 4);
    memcpy(out + PANEL * 4, &g1, 4);
    memcpy(out + 2 * PANEL * 4, &g2, 4);
    memcpy(out + 3 * PANEL * 4, &g3, 4);
#else
    for (int k = 0; k < 4; k++) {
        out[k] = (uint8_t)((qs[k] & 15) | ((qs[k + 4] & 15) << 4));
        out[PANEL * 4 + k] = (uint8_t)((qs[8 + k] & 15) | ((qs[12 + k] & 15) << 4));
        out[2 * PANEL * 4 + k] = (uint8_t)((qs[k] >> 4) | (qs[k + 4] & 0xF0));
        out[3 * PANEL * 4 + k] = (uint8_t)((qs[8 + k] >> 4) | (qs[12 + k] & 0xF0));
    }
#endif
}

/* One panel of rows all of one 32-input type (Q4_0, Q4_1, Q5_0 or Q5_1), for stored_int4: each block's nibbles go
 * straight to their output bytes (group 4b + gi of block b: inputs 8gi .. 8gi + 7 of the 32), with no decoded
 * row in between; the same bytes and float32 values as unsigned_block and the general loop. */
static int panel_blocks32(int type, const int64_t *ptrs, int64_t p, int64_t cols, uint8_t *codes, uint8_t *bits5,
                          float *s, float *z) {
    const int with_m = type == TYPE_Q4_1 || type == TYPE_Q5_1, five = type == TYPE_Q5_0 || type == TYPE_Q5_1;
    const int64_t nbytes = BLOCK_BYTES[type], groups = cols / 8, blocks32 = cols / 32, head = 2 + 2 * with_m;
    const float bias = type == TYPE_Q4_0 ? 8.0f : 16.0f;
    int finite = 1;
    for (int64_t b = 0; b < blocks32; b++) {
        uint64_t lo[4] = {0, 0, 0, 0}, hi[4] = {0, 0, 0, 0};
        float *sl = s + (p * blocks32 + b) * PANEL, *zl = z + (p * blocks32 + b) * PANEL;
        uint8_t *o = codes + (p * groups + 4 * b) * PANEL * 4;
        for (int r = 0; r < PANEL; r++) {
            const uint8_t *src = (const uint8_t *)(intptr_t)ptrs[p * PANEL + r];
            const uint8_t *blk = src ? src + b * nbytes : ZERO_BLOCK, *qs = blk + head + (five ? 4 : 0);
            finite &= block_finite(type, blk);
            const float d = h2f(half_at(blk));
            sl[r] = d;
            if (with_m) {
                const float zero = -0.0f * d;
                zl[r] = h2f(half_at(blk + 2)) * 1.0f + zero;
            } else {
                zl[r] = -bias * d;
            }
            nibbles16(qs, o + 4 * r);
            if (five) {
                uint32_t qh;
                memcpy(&qh, blk + head, 4);
                for (int gi = 0; gi < 4; gi++) {
                    lo[gi] |= (uint64_t)((qh >> (8 * gi)) & 15) << (4 * r);
                    hi[gi] |= (uint64_t)((qh >> (8 * gi + 4)) & 15) << (4 * r);
                }
            }
        }
        if (five)
            for (int gi = 0; gi < 4; gi++) {
                uint8_t *line = bits5 + (p * groups + 4 * b + gi) * 16;
                for (int k = 0; k < 8; k++) {
                    line[k] = (uint8_t)(lo[gi] >> (8 * k));
                    line[8 + k] = (uint8_t)(hi[gi] >> (8 * k));
                }
            }
    }
    return finite;
}

/* The 4-bit layout's codes (and, with bits5, the 5-bit layout's plane of fifth bits) and float32 scales and
 * offsets [panels][cols / 32][16] of rows of Q4_0, Q4_1, Q4_K (bits5 NULL) or Q5_0, Q5_1. A panel is filled a
 * chunk of inputs at a time (256 where a row is Q4_K, else 32), its 16 rows decoded first, so each output line
 * is written whole, in order. */
int64_t stored_int4(const int64_t *ptrs, const int8_t *types, int64_t cols, int64_t p0, int64_t p1, uint8_t *codes,
                    uint8_t *bits5, float *s, float *z) {
    const int64_t groups = cols / 8, blocks32 = cols / 32;
    uint8_t u[PANEL][256];
    uint32_t fifth[PANEL][8];
    float bs[PANEL][8], bz[PANEL][8];
    int finite = 1;
    for (int64_t p = p0; p < p1; p++) {
        int same = types[p * PANEL] != TYPE_Q4_K && types[p * PANEL] >= 0;
        for (int r = 1; r < PANEL; r++) same &= types[p * PANEL + r] == types[p * PANEL];
        if (same && (bits5 != NULL) == (types[p * PANEL] == TYPE_Q5_0 || types[p * PANEL] == TYPE_Q5_1)) {
            finite &= panel_blocks32(types[p * PANEL], ptrs, p, cols, codes, bits5, s, z);
            continue;
        }
        int64_t chunk = 32;
        for (int r = 0; r < PANEL; r++)
            if (types[p * PANEL + r] == TYPE_Q4_K) chunk = 256;
        for (int64_t c0 = 0; c0 < cols; c0 += chunk) {
            for (int r = 0; r < PANEL; r++) {
                const int64_t row = p * PANEL + r;
                const int type = types[row];
                if (type < 0) { /* padding: all zeros */
                    memset(u[r], 0, (size_t)chunk);
                    memset(fifth[r], 0, sizeof fifth[r]);
                    for (int j = 0; j < chunk / 32; j++) bs[r][j] = bz[r][j] = 0.0f;
                    continue;
                }
                const int64_t n = BLOCK_INPUTS[type], nbytes = BLOCK_BYTES[type];
                const uint8_t *src = (const uint8_t *)(intptr_t)ptrs[row];
                for (int64_t at = 0; at < chunk; at += n) {
                    const int64_t blk = (c0 + at) / n;
                    const uint8_t *block = src ? src + blk * nbytes : ZERO_BLOCK;
                    fifth[r][at / 32] = 0;
                    finite &= block_finite(type, block);
                    unsigned_block(type, block, u[r] + at, &fifth[r][at / 32], bs[r] + at / 32, bz[r] + at / 32);
                }
            }
            for (int64_t j = 0; j < chunk / 32; j++) {
                float *sl = s + (p * blocks32 + c0 / 32 + j) * PANEL, *zl = z + (p * blocks32 + c0 / 32 + j) * PANEL;
                for (int r = 0; r < PANEL; r++) {
                    sl[r] = bs[r][j];
                    zl[r] = bz[r][j];
                }
            }
            for (int64_t gi = 0; gi < chunk / 8; gi++) {
                const int64_t g = c0 / 8 + gi;
                uint8_t *o = codes + ((p * groups + g) * PANEL) * 4;
                for (int r = 0; r < PANEL; r++) {
                    const uint8_t *c = u[r] + 8 * gi;
                    for (int k = 0; k < 4; k++) o[4 * r + k] = (uint8_t)((c[k] & 15) | ((c[k + 4] & 15) << 4));
                }
                if (bits5) { /* per half h, bit 4r + k: the fifth bit of row r's input 8g + 4h + k */
                    uint64_t lo = 0, hi = 0;
                    for (int r = 0; r < PANEL; r++) {
                        const uint32_t bits = fifth[r][gi / 4] >> (8 * (gi & 3));
                        lo |= (uint64_t)(bits & 15) << (4 * r);
                        hi |= (uint64_t)((bits >> 4) & 15) << (4 * r);
                    }
                    uint8_t *line = bits5 + (p * groups + g) * 16;
                    for (int b = 0; b < 8; b++) {
                        line[b] = (uint8_t)(lo >> (8 * b));
                        line[8 + b] = (uint8_t)(hi >> (8 * b));
                    }
                }
            }
        }
    }
    return finite;
}

/* The int8 layout (codes [panels][cols / 4][16][4], fp16 scale bits [panels][cols / 32][16]) of Q8_0 rows. */
int64_t stored_int8(const int64_t *ptrs, const int8_t *types, int64_t cols, int64_t p0, int64_t p1, int8_t *codes,
                    uint16_t *d) {
    const int64_t groups = cols / 4, blocks = cols / 32;
    int finite = 1;
    for (int64_t p = p0; p < p1; p++) {
        int8_t *dst = codes + p * groups * PANEL * 4;
        for (int64_t r = 0; r < PANEL; r++) {
            const int64_t row = p * PANEL + r;
            const uint8_t *src = types[row] < 0 ? NULL : ptrs[row] ? (const uint8_t *)(intptr_t)ptrs[row] : NULL;
            for (int64_t b = 0; b < blocks; b++) {
                const uint8_t *blk = src ? src + b * 34 : ZERO_BLOCK;
                finite &= block_finite(TYPE_Q8_0, blk);
                d[(p * blocks + b) * PANEL + r] = half_at(blk);
                for (int gi = 0; gi < 8; gi++) memcpy(dst + ((b * 8 + gi) * PANEL + r) * 4, blk + 2 + 4 * gi, 4);
            }
        }
    }
    return finite;
}

/* One K block (Q5_K or Q6_K) as the common form's signed codes c, int8 sub-scales and mins, d and dm bits. */
static void k_block(int type, const uint8_t *b, int8_t *c, int8_t *sc, int8_t *mn, uint16_t *d, uint16_t *dm) {
    int j, t, i;
    if (type == TYPE_Q6_K) {
        const uint8_t *ql = b, *qh = b + 128;
        for (t = 0; t < 2; t++)
            for (i = 0; i < 64; i++) {
                c[128 * t + i] = (int8_t)(ql[64 * t + i] & 15);
                c[128 * t + 64 + i] = (int8_t)(ql[64 * t + i] >> 4);
            }
        for (t = 0; t < 2; t++)
            for (j = 0; j < 4; j++)
                for (i = 0; i < 32; i++) c[128 * t + 32 * j + i] = (int8_t)((c[128 * t + 32 * j + i] | (((qh[32 * t + i] >> (2 * j)) & 3) << 4)) - 32);
        memcpy(sc, b + 192, 16);
        *d = half_at(b + 208);
        *dm = 0;
        return;
    }
    /* Q5_K */
    uint8_t s8[8], m8[8];
    k_scales(b + 4, s8, m8);
    for (j = 0; j < 8; j++) {
        sc[j] = (int8_t)s8[j];
        mn[j] = (int8_t)m8[j];
    }
    const uint8_t *qh = b + 16, *qs = b + 48;
    for (t = 0; t < 4; t++)
        for (i = 0; i < 32; i++) {
            c[64 * t + i] = (int8_t)(qs[32 * t + i] & 15);
            c[64 * t + 32 + i] = (int8_t)(qs[32 * t + i] >> 4);
        }
    for (j = 0; j < 8; j++)
        for (i = 0; i < 32; i++) c[32 * j + i] |= (int8_t)(((qh[i] >> j) & 1) << 4);
    *d = half_at(b);
    *dm = (uint16_t)(half_at(b + 2) ^ 0x8000); /* -dmin */
}

/* The kq8 layout (gguf_quant_types.pack_kq8, of the rows merged at sub-blocks of `sub` inputs: a type's coarser
 * sub-scales repeated; mins, when with_mn, zero for a type without them) of Q5_K and Q6_K rows. */
int64_t stored_kq8(const int64_t *ptrs, const int8_t *types, int64_t cols, int64_t sub, int64_t with_mn, int64_t p0,
                   int64_t p1, int8_t *codes, int8_t *sc, int8_t *mn, uint16_t *d, uint16_t *dm) {
    const int64_t groups = cols / 4, subs = cols / sub, blocks = cols / 256;
    int8_t c[256], bsc[16], bmn[16];
    uint16_t bd, bdm;
    int finite = 1;
    for (int64_t p = p0; p < p1; p++) {
        int8_t *dst = codes + p * groups * PANEL * 4;
        for (int64_t r = 0; r < PANEL; r++) {
            const int64_t row = p * PANEL + r;
            const int type = types[row];
            const uint8_t *src = (const uint8_t *)(intptr_t)ptrs[row];
            const int64_t own_sub = type == TYPE_Q6_K ? 16 : 32, repeat = own_sub / sub;
            for (int64_t blk = 0; blk < blocks; blk++) {
                if (type < 0) {
                    memset(c, 0, 256);
                    memset(bsc, 0, 16);
                    memset(bmn, 0, 16);
                    bd = bdm = 0;
                } else {
                    const uint8_t *block = src ? src + blk * BLOCK_BYTES[type] : ZERO_BLOCK;
                    memset(bmn, 0, 16);
                    finite &= block_finite(type, block);
                    k_block(type, block, c, bsc, bmn, &bd, &bdm);
                }
                for (int gi = 0; gi < 64; gi++) memcpy(dst + ((blk * 64 + gi) * PANEL + r) * 4, c + 4 * gi, 4);
                for (int64_t j = 0; j < 256 / sub; j++) {
                    const int64_t at = (p * subs + blk * (256 / sub) + j) * PANEL + r;
                    sc[at] = bsc[j / repeat];
                    if (with_mn) mn[at] = bmn[j / repeat];
                }
                d[(p * blocks + blk) * PANEL + r] = bd;
                if (with_mn) dm[(p * blocks + blk) * PANEL + r] = bdm;
            }
        }
    }
    return finite;
}
