"""The streamed finiteness test finds the first NaN/inf of every hidden dtype and nothing else."""

from __future__ import annotations

import math

import pytest
import torch

from eyas.verify_checks import _first_nonfinite

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
