"""The GGUF block formats served in their own blocks, and their constants (no PyTorch: the benchmark's file writer
reads them too)."""

from __future__ import annotations

import numpy as np

#: The GGUF block formats served in their own blocks, and the bits of their ``q`` here.
NATIVE_BITS = {
    "Q2_K": 2,
    "Q3_K": 3,
    "Q4_0": 4,
    "Q4_1": 4,
    "Q4_K": 4,
    "Q5_0": 8,
    "Q5_1": 8,
    "Q5_K": 8,
    "Q6_K": 6,
    "Q8_0": 8,
    "IQ4_NL": 8,
}

#: IQ4_NL's values for its 4-bit indices (llama.cpp's ``kvalues_iq4nl``).
IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int16)
