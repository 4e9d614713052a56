"""The streamed finiteness test finds the first NaN/inf of every hidden dtype and nothing else."""

from __future__ import annotations

import math

import pytest
import torch

from eyas.verify.checks import _first_nonfinite

ST_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def _bytes(x: torch.Tensor) -> memoryview:
    return memoryview(x.view(torch.uint8).numpy())


@pytest.mark.parametrize("dtype", list(ST_NAMES), ids=str)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_first_non_finite_value_is_found(dtype, bad):
    x = torch.randn(1000).to(dtype)
    x[617], x[900] = bad, bad
    assert _first_nonfinite(_bytes(x), ST_NAMES[dtype]) == 617


@pytest.mark.parametrize("dtype", list(ST_NAMES), ids=str)
def test_extreme_finite_values_pass(dtype):
    info = torch.finfo(dtype)
    x = torch.tensor([info.max, -info.max, info.tiny, 0.0, -0.0], dtype=dtype)
    assert _first_nonfinite(_bytes(x), ST_NAMES[dtype]) == -1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_every_16_bit_pattern_is_classified_like_torch_isfinite(dtype):
    patterns = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(dtype)
    ones = torch.ones(7, dtype=dtype)
    wrong = []
    for i, value in enumerate(patterns):
        found = _first_nonfinite(_bytes(torch.cat([ones, value.reshape(1), ones])), ST_NAMES[dtype])
        if found != (-1 if torch.isfinite(value) else 7):
            wrong.append(hex(i))
    assert wrong == []


@pytest.mark.parametrize(
    "bits, finite",
    [
        (0x7F7FFFFF, True), (0x7F800000, False), (0x7FFFFFFF, False), (0x80000000, True),
        (0xFF7FFFFF, True), (0xFF800000, False), (0xFFC00000, False), (0xFFFFFFFF, False),
    ],
    ids=hex,
)  # fmt: skip
def test_float32_patterns_at_the_exponent_boundary(bits, finite):
    x = torch.tensor([1.0, 2.0, bits - (1 << 32) if bits >= 1 << 31 else bits], dtype=torch.int64)
    x = x.to(torch.int32)
    x[:2] = torch.tensor([1.0, 2.0]).view(torch.int32)
    assert _first_nonfinite(_bytes(x.view(torch.float32)), "F32") == (-1 if finite else 2)
