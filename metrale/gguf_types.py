"""ggml's tensor types and llama.cpp's file types by number, as the `gguf` package's constants list them.

The reader (gguf_reader.py) names a tensor's type with these rather than import `gguf`, whose import (its
constants, writer, YAML metadata) costs a served process more than reading the file's header does.
tests/test_gguf_strings.py checks them against the installed package.
"""

from __future__ import annotations

from enum import IntEnum


class TensorType(IntEnum):
    """A tensor's ggml type (gguf.GGMLQuantizationType's names and numbers: equal to its members as ints)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39
    NVFP4 = 40
    Q1_0 = 41


# (inputs per block, bytes per block) of each type (gguf.GGML_QUANT_SIZES).
BLOCK_SIZES: dict[int, tuple[int, int]] = {
    TensorType.F32: (1, 4), TensorType.F16: (1, 2), TensorType.Q4_0: (32, 18), TensorType.Q4_1: (32, 20),
    TensorType.Q5_0: (32, 22), TensorType.Q5_1: (32, 24), TensorType.Q8_0: (32, 34), TensorType.Q8_1: (32, 40),
    TensorType.Q2_K: (256, 84), TensorType.Q3_K: (256, 110), TensorType.Q4_K: (256, 144),
    TensorType.Q5_K: (256, 176), TensorType.Q6_K: (256, 210), TensorType.Q8_K: (256, 292),
    TensorType.IQ2_XXS: (256, 66), TensorType.IQ2_XS: (256, 74), TensorType.IQ3_XXS: (256, 98),
    TensorType.IQ1_S: (256, 50), TensorType.IQ4_NL: (32, 18), TensorType.IQ3_S: (256, 110),
    TensorType.IQ2_S: (256, 82), TensorType.IQ4_XS: (256, 136), TensorType.I8: (1, 1), TensorType.I16: (1, 2),
    TensorType.I32: (1, 4), TensorType.I64: (1, 8), TensorType.F64: (1, 8), TensorType.IQ1_M: (256, 56),
    TensorType.BF16: (1, 2), TensorType.TQ1_0: (256, 54), TensorType.TQ2_0: (256, 66), TensorType.MXFP4: (32, 17),
    TensorType.NVFP4: (64, 36), TensorType.Q1_0: (128, 18),
}

# `general.file_type` -> llama.cpp's name for it (gguf.LlamaFileType).
FILE_TYPES: dict[int, str] = {
    0: "ALL_F32", 1: "MOSTLY_F16", 2: "MOSTLY_Q4_0", 3: "MOSTLY_Q4_1", 7: "MOSTLY_Q8_0", 8: "MOSTLY_Q5_0",
    9: "MOSTLY_Q5_1", 10: "MOSTLY_Q2_K", 11: "MOSTLY_Q3_K_S", 12: "MOSTLY_Q3_K_M", 13: "MOSTLY_Q3_K_L",
    14: "MOSTLY_Q4_K_S", 15: "MOSTLY_Q4_K_M", 16: "MOSTLY_Q5_K_S", 17: "MOSTLY_Q5_K_M", 18: "MOSTLY_Q6_K",
    19: "MOSTLY_IQ2_XXS", 20: "MOSTLY_IQ2_XS", 21: "MOSTLY_Q2_K_S", 22: "MOSTLY_IQ3_XS", 23: "MOSTLY_IQ3_XXS",
    24: "MOSTLY_IQ1_S", 25: "MOSTLY_IQ4_NL", 26: "MOSTLY_IQ3_S", 27: "MOSTLY_IQ3_M", 28: "MOSTLY_IQ2_S",
    29: "MOSTLY_IQ2_M", 30: "MOSTLY_IQ4_XS", 31: "MOSTLY_IQ1_M", 32: "MOSTLY_BF16", 36: "MOSTLY_TQ1_0",
    37: "MOSTLY_TQ2_0", 38: "MOSTLY_MXFP4_MOE", 39: "MOSTLY_NVFP4", 40: "MOSTLY_Q1_0", 1024: "GUESSED",
}


class ValueType(IntEnum):
    """A metadata value's type (gguf.GGUFValueType)."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12
