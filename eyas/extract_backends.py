"""Hidden-state backends: what turns token ids into (aux, last) hidden states, behind one interface.

    backend = open_backend(extract_cfg, target_path=..., target_dtype="bfloat16", aux_layer_ids=[2, 16, 29],
                           hidden_size=4096, device="cuda:0")
    [(aux, last), ...] = backend.features([ids_0, ids_1])   # aux [t_i, n_aux*H], last [t_i, H]
    backend.close()

`hf` runs the target through transformers in this process (CPU or one GPU); `sglang` asks an SGLang
server in aux-capture mode (see eyas.extract_sglang). The extractor checks the widths of the first
batch of any backend (`check_aux_width`) before it writes anything.
"""

from __future__ import annotations

from typing import Protocol

import torch

from eyas.config import ExtractConfig
from eyas.target import load_target


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


class HFBackend:
    """The target through transformers, one right-padded forward pass per batch."""

    name = "hf"

    def __init__(self, target_path: str, *, target_dtype: str, aux_layer_ids: list[int], hidden_size: int, device: str):
        self.target = load_target(target_path, target_dtype)
        if self.target.hidden_size != hidden_size:
            raise ValueError(
                f"target {target_path}: loaded model has H={self.target.hidden_size}, config.json says "
                f"{hidden_size}; the model directory changed during the run"
            )
        self.target.model.to(device)
        self.aux_layer_ids, self.device = list(aux_layer_ids), device

    @torch.no_grad()
    def features(self, samples: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        lengths = [len(s) for s in samples]
        ids = torch.zeros(len(samples), max(lengths), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(samples):
            ids[i, : len(s)] = s
            mask[i, : len(s)] = 1
        # logits_to_keep=1: the lm_head runs on one position only (eyas needs hidden states, and full
        # logits of a 150k vocabulary would take more memory than the whole batch's hidden states).
        out = self.target.model(
            input_ids=ids.to(self.device),
            attention_mask=None if len(samples) == 1 else mask.to(self.device),
            output_hidden_states=True,
            use_cache=False,
            logits_to_keep=1,
        )
        hs = out.hidden_states
        return [
            (torch.cat([hs[j][i, :n] for j in self.aux_layer_ids], dim=-1).cpu(), hs[-1][i, :n].cpu())
            for i, n in enumerate(lengths)
        ]

    def close(self) -> None:
        self.target = None


def open_backend(
    extract_cfg: ExtractConfig,
    *,
    target_path: str,
    target_dtype: str,
    aux_layer_ids: list[int],
    hidden_size: int,
    device: str,
) -> HiddenStateBackend:
    if extract_cfg.backend == "hf":
        return HFBackend(
            target_path, target_dtype=target_dtype, aux_layer_ids=aux_layer_ids, hidden_size=hidden_size, device=device
        )
    if extract_cfg.backend == "sglang":
        from eyas.extract_sglang import SGLangBackend

        return SGLangBackend(
            extract_cfg.sglang, target_path=target_path, aux_layer_ids=aux_layer_ids, hidden_size=hidden_size
        )
    raise ValueError(f"extract.backend={extract_cfg.backend!r}: expected 'hf' or 'sglang'")
