"""Record llama.cpp's own Q4_K blocks (quantize_row_q4_K_ref from libggml-base) for a fixed input.

Run by hand where llama.cpp is built (not in CI):
    python tests/data/record_q4k_reference.py /path/to/llama.cpp/build/bin/libggml-base.so
writes tests/data/q4k_reference.npz (input float32 [16, 1024] and llama.cpp's bytes [16, 576]).
"""

import ctypes
import sys
from pathlib import Path

import numpy as np


def main(lib_path: str) -> None:
    lib = ctypes.CDLL(lib_path)
    quantize = lib.quantize_row_q4_K_ref
    quantize.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((16, 1024)) * rng.uniform(0.01, 1.0, (16, 1))).astype(np.float32)
    x[3] = np.abs(x[3])  # all-positive rows: the min is clamped to 0
    x[5, :256] = 0.0  # an all-zero super-block
    x[7] = rng.standard_t(3, 1024).astype(np.float32)  # heavy tails
    out = np.zeros((16, 1024 // 256 * 144), dtype=np.uint8)
    quantize(x.ctypes.data, out.ctypes.data, x.size)
    np.savez_compressed(Path(__file__).with_name("q4k_reference.npz"), x=x, blocks=out)


if __name__ == "__main__":
    main(sys.argv[1])
