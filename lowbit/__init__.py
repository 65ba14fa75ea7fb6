"""lowbit: quantize large language models into low-bit formats, convert checkpoints, run them.

Each folder is one floor, and imports only point down (docs/architecture.md; tests/test_layers.py):
native (C sources and their build) < quant (number formats) < formats (checkpoint I/O), kernels
(matmul and attention paths) < runtime (models, engine, server) < compress (calibration, GPTQ, AWQ,
the layer pipeline) < cli (commands); data (demo texts) and plan (deployment planning) beside runtime.
"""

__version__ = "0.1.0"
