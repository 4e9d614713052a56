"""eyas.extract.capture_hook on its own: where the token ids come from, and how any failure inside it is reported.

The objects are the double's imitations of SGLang 0.5.23's (tests/sglang_extract_double.py); the hook inside
SGLang's own model classes and forward path is tests/test_sglang_conformance.py's capture test.
"""

from __future__ import annotations

import types

import pytest
import torch
from safetensors.torch import load_file

from eyas.extract import capture_hook
from eyas.extract.capture_hook import ERROR_FILE, CaptureError, CaptureHook
from tests.sglang_extract_double import ForwardBatch, ForwardMode, LogitsProcessorOutput

IDS = [5, 17, 300]


def prefill(rid="eyas-a", *, ids=IDS, width=4):
    batch = ForwardBatch(ForwardMode.EXTEND, 1, torch.tensor(ids), [rid], [len(ids)], [0])
    rows = torch.arange(len(ids) * width, dtype=torch.float32).reshape(len(ids), width)
    return batch, LogitsProcessorOutput(rows[-1:], hidden_states=torch.cat([rows] * 3, -1), last_hidden_states=rows)


def test_the_token_ids_come_from_the_forward_batch_when_the_logits_processor_gets_none(tmp_path):
    """Kimi-K2.5: general_mm_embed_routine calls the language model with input_ids=None (managers/mm_utils.py)."""
    hook = CaptureHook(tmp_path, rid_prefix="eyas-", tp_rank=lambda: 0)
    batch, out = prefill()
    hook(None, (None, out.last_hidden_states, None, batch, None), out)
    hook.flush()
    written = load_file(str(tmp_path / "eyas-a.safetensors"))
    assert written["input_ids"].tolist() == IDS and written["aux"].shape == (3, 12)


def test_an_unexpected_error_becomes_one_capture_error_written_beside_the_captures(tmp_path):
    hook = CaptureHook(tmp_path, rid_prefix="eyas-", tp_rank=lambda: 0)
    batch, out = prefill()
    drifted = types.SimpleNamespace(**{k: v for k, v in vars(batch).items() if k != "extend_seq_lens_cpu"})
    with pytest.raises(CaptureError) as err:
        hook(torch.nn.Identity(), (None, out.last_hidden_states, None, drifted, None), out)
    assert str(err.value) == (
        "capture hook: AttributeError: 'types.SimpleNamespace' object has no attribute 'extend_seq_lens_cpu', "
        "reading the forward of Identity (5 positional args, forward_mode EXTEND, rids [eyas-a]); expected "
        "LogitsProcessor.forward's (input_ids, hidden_states, lm_head, ForwardBatch, aux_hidden_states) and a "
        "LogitsProcessorOutput as SGLang 0.5.23 passes them: this server's SGLang passes something else; check "
        "eyas.extract.capture_hook against its version"
    )
    assert isinstance(err.value.__cause__, AttributeError)
    assert (tmp_path / ERROR_FILE).read_text() == f"CaptureError: {err.value}\n"


def test_a_write_that_fails_in_any_way_fails_the_next_forward(tmp_path, monkeypatch):
    def broken_save(tensors, path):
        raise ValueError("no space for the header")  # not an OSError: the writer thread must not die quietly

    monkeypatch.setattr(capture_hook, "save_file", broken_save)
    hook = CaptureHook(tmp_path, rid_prefix="eyas-", tp_rank=lambda: 0)
    batch, out = prefill()
    hook(None, (batch.input_ids, out.last_hidden_states, None, batch, None), out)
    with pytest.raises(CaptureError, match=r"capture hook: writing to .* failed$") as err:
        hook.flush()
    assert isinstance(err.value.__cause__, ValueError)
    with pytest.raises(CaptureError, match=r"writing to .* failed earlier"):
        hook(None, (batch.input_ids, out.last_hidden_states, None, batch, None), out)
    assert (tmp_path / ERROR_FILE).read_text().startswith("CaptureError: capture hook: writing to ")
