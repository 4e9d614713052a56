"""train.mixed_precision resolves per device; bf16 asked for on CPU is refused, not ignored."""

import pytest
import torch

from eyas.train.step import use_bf16


def test_auto_is_fp32_on_cpu_and_bf16_on_cuda():
    assert use_bf16("auto", torch.device("cpu")) is False
    assert use_bf16("auto", torch.device("cuda", 0)) is True
    assert use_bf16("off", torch.device("cuda", 0)) is False


def test_explicit_bf16_on_cpu_is_an_error():
    with pytest.raises(ValueError, match=r"train.mixed_precision='bf16' on cpu: bf16 autocast is for CUDA devices"):
        use_bf16("bf16", torch.device("cpu"))
