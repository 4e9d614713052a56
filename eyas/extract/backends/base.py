"""The interface every hidden-state backend implements, and the width checks each batch passes before it is written."""

from __future__ import annotations

from typing import Protocol

import torch


class AuxWidthError(ValueError):
    """The backend returned hidden states of the wrong width."""


class HiddenStateBackend(Protocol):
    name: str

    def features(self, samples: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per sample (1-D int64 token ids of length t): (aux [t, n_aux*H], last [t, H]) on the CPU."""

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
    feats: list[tuple[torch.Tensor, torch.Tensor]], lengths: list[int], *, num_aux: int, hidden_size: int, source: str
) -> None:
    """Rows per sample = its token count, aux width n_aux*H, last width H; the first mismatch raises."""
    for i, ((aux, last), n) in enumerate(zip(feats, lengths, strict=True)):
        where = f"{source} sample {i}"
        check_aux_width(aux.shape[-1], num_aux=num_aux, hidden_size=hidden_size, source=where)
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
