"""Bundled GPU specs, custom machines, and the CPU measurement."""

from __future__ import annotations

import pytest

from lowbit.errors import UsageError
from lowbit.plan.hardware import GPUS, custom_hardware, lookup_gpu, measure_cpu


def test_lookup_and_aliases():
    assert lookup_gpu("H100") is GPUS["h100"]
    assert lookup_gpu("h100-sxm") is GPUS["h100"]
    assert lookup_gpu("RTX-4090") is GPUS["rtx4090"]
    assert GPUS["h200"].bandwidth_gbs == 4800 and GPUS["b200"].tflops_fp4 == 9000
    assert GPUS["a100"].tflops_fp8 is None  # Ampere has no fp8 tensor cores
    with pytest.raises(UsageError, match="unknown GPU 'tpu'"):
        lookup_gpu("tpu")


def test_custom_machine_needs_all_three_numbers():
    hw = custom_hardware(None, 500, 48, 200)
    assert (hw.bandwidth_gbs, hw.memory_gib, hw.tflops_bf16) == (500, 48, 200)
    with pytest.raises(UsageError, match="missing --memory, --tflops"):
        custom_hardware(None, 500, None, None)
    with pytest.raises(UsageError, match="positive"):
        custom_hardware(None, -1, 48, 200)


def test_overrides_keep_the_rest():
    hw = custom_hardware(GPUS["h100"], 2500, None, None)
    assert hw.bandwidth_gbs == 2500 and hw.memory_gib == GPUS["h100"].memory_gib


def test_cpu_measurement_is_plausible():
    hw = measure_cpu(buffer_mib=64, matmul_size=256, repeats=2)
    assert hw.measured and hw.cores >= 1
    assert 0.5 < hw.bandwidth_gbs < 2000  # GB/s of a real machine
    assert 0 < hw.tflops_bf16 < 1000
    assert hw.memory_gib > 0.5
