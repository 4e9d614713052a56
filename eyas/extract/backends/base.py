"""The interface every hidden-state backend implements, and the width checks each batch passes before it is written."""

from __future__ import annotations

from typing import Protocol

import torch

from eyas.shards.encoding import TopK


class AuxWidthError(ValueError):
    """The backend returned hidden states of the wrong width."""


class HiddenStateBackend(Protocol):
    name: str

    def features(self, samples: list[torch.Tensor]) -> list[tuple[torch.Tensor, "torch.Tensor | TopK"]]:
        """Per sample (1-D int64 token ids of length t): (aux [t, n_aux*H], teacher) on the CPU; the teacher is
        last [t, H], or with a top-K teacher a TopK (ids, logprobs [t, K])."""

    def close(self) -> None:
        """Release the model or the server connection."""


def check_aux_width(aux_width: int, *, num_aux: int, hidden_size: int, source: str) -> None:
    """Fail when the aux states are not n_aux * H wide (an H-wide input silently bypasses the draft's fc)."""
    expected = num_aux * hidden_size
    if aux_width == expected:
        return
    hint = "it is H: the backend returned one layer's states, not the aux layers'; " if aux_width == hidden_size else ""
    raise AuxWidthError(
        f"{source}: aux_hidden_states width {aux_width}, expected {expected} ({num_aux} layers x {hidden_size}); "
        f"{hint}known causes: (1) aux hidden-state capture is not enabled (SGLang needs "
        f"--enable-return-aux-hidden-states and eagle_config.use_aux_hidden_state not false); "
        f"(2) SGLang runs --speculative-algorithm EAGLE instead of EAGLE3, which returns last-layer states only; "
        f"(3) a wrapper model (multimodal, pipeline stage pp > 1) whose capture hook does not reach the decoder "
        f"layers. Fix the backend and re-run extraction."
    )


def check_feature_widths(
    feats: list[tuple[torch.Tensor, "torch.Tensor | TopK"]],
    lengths: list[int],
    *,
    num_aux: int,
    hidden_size: int,
    source: str,
    teacher_topk: int = 0,
) -> None:
    """Rows per sample = its token count, aux width n_aux*H, last width H (or K top-K entries); the first
    mismatch raises."""
    for i, ((aux, teacher), n) in enumerate(zip(feats, lengths, strict=True)):
        where = f"{source} sample {i}"
        check_aux_width(aux.shape[-1], num_aux=num_aux, hidden_size=hidden_size, source=where)
        if teacher_topk:
            _check_topk(teacher, n, teacher_topk, where)
            continue
        last = teacher
        if not isinstance(last, torch.Tensor):
            raise AuxWidthError(f"{where}: the teacher is {type(last).__name__}, expected final states [t, H]")
        if last.shape[-1] != hidden_size:
            raise AuxWidthError(
                f"{where}: last_hidden_states width {last.shape[-1]}, expected H={hidden_size}; "
                f"the backend did not return the final layer's states (the lm_head input)"
            )
        if aux.shape[0] != n or last.shape[0] != n:
            raise AuxWidthError(
                f"{where}: {aux.shape[0]} aux rows and {last.shape[0]} last rows, expected {n} (one per prompt "
                f"token); the backend truncated or extended the sample (check its context length and that it "
                f"returns the prompt's hidden states, not the generated tokens')"
            )


def _check_topk(top, n: int, k: int, where: str) -> None:
    if not isinstance(top, TopK):
        raise AuxWidthError(f"{where}: the teacher is {type(top).__name__}, expected top-{k} log-probabilities")
    for name, t in (("ids", top.ids), ("logprobs", top.logprobs)):
        if tuple(t.shape) != (n, k):
            raise AuxWidthError(
                f"{where}: top-K teacher {name} of shape {list(t.shape)}, expected [{n}, {k}] (one row of "
                f"extract.teacher_topk={k} entries per prompt token); the backend returned fewer entries"
            )
