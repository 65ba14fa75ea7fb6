"""formats/native.py count_nonfinite: NaN/inf counted exactly, chunk by chunk, every float dtype."""

import pytest
import torch

from lowbit.formats import native


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_counts_nonfinite_values_across_chunks(dtype, monkeypatch):
    monkeypatch.setattr(native, "FINITE_CHUNK", 7)  # many chunks, a ragged last one
    t = torch.randn(5, 13).to(dtype)
    assert native.count_nonfinite(t) == 0
    bad = torch.zeros(65, dtype=torch.bool)
    bad[[0, 6, 7, 40, 64]] = True
    values = t.reshape(-1).float()
    values[bad] = float("nan")
    values[64] = float("inf") if dtype is not torch.float8_e4m3fn else float("nan")  # e4m3fn has no inf
    t = values.to(dtype).reshape(5, 13)
    assert native.count_nonfinite(t) == 5
    assert native.count_nonfinite(t[:, 1:]) == 4  # a strided view without column 0 (position 0)


def test_integer_and_empty_tensors_have_none():
    assert native.count_nonfinite(torch.arange(10)) == 0
    assert native.count_nonfinite(torch.empty(0)) == 0
