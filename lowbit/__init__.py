"""lowbit: quantize large language models into low-bit formats, convert checkpoints, run them.

The repository root is this package; its folders are the subpackages:
cli (commands), quant (number formats and algorithms), formats (checkpoint I/O),
kernels (matmul kernels and their dispatch), runtime (models and engine), data (text sets and demo assets).
"""

__version__ = "0.1.0"
