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
