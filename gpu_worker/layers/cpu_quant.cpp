// The quantized products of layers/quantization.py (int8 per row, 4-bit groups), per instruction-set class.
