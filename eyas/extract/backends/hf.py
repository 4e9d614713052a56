"""The `hf` backend: the target through transformers in this process, on the CPU or one GPU."""

from __future__ import annotations

import torch

from eyas.shards.encoding import TopK, topk_teacher
from eyas.target import lm_head_weight, load_target_model


class HFBackend:
    """The target through transformers, one right-padded forward pass per batch. With `teacher_topk` K > 0 the
    teacher is the top K of log_softmax(final states @ lm_head) over the full vocab, computed on the device.
    A wrapped target (Kimi-K2.5) runs as its text model (eyas.target.load_target_model); no tokenizer is loaded."""

    name = "hf"

    def __init__(
        self,
        target_path: str,
        *,
        target_dtype: str,
        aux_layer_ids: list[int],
        hidden_size: int,
        device: str,
        teacher_topk: int = 0,
        trust_remote_code: bool = False,
    ):
        self.model = load_target_model(target_path, target_dtype, trust_remote_code=trust_remote_code)
        if self.model.config.hidden_size != hidden_size:
            raise ValueError(
                f"target {target_path}: loaded model has H={self.model.config.hidden_size}, config.json says "
                f"{hidden_size}; the model directory changed during the run"
            )
        self.model.to(device)
        self.aux_layer_ids, self.device, self.teacher_topk = list(aux_layer_ids), device, teacher_topk

    @torch.no_grad()
    def features(self, samples: list[torch.Tensor]) -> list[tuple[torch.Tensor, "torch.Tensor | TopK"]]:
        lengths = [len(s) for s in samples]
        ids = torch.zeros(len(samples), max(lengths), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(samples):
            ids[i, : len(s)] = s
            mask[i, : len(s)] = 1
        # logits_to_keep=1: the lm_head runs on one position only (eyas needs hidden states, and full
        # logits of a 150k vocabulary would take more memory than the whole batch's hidden states).
        out = self.model(
            input_ids=ids.to(self.device),
            attention_mask=None if len(samples) == 1 else mask.to(self.device),
            output_hidden_states=True,
            use_cache=False,
            logits_to_keep=1,
        )
        hs = out.hidden_states
        feats = []
        for i, n in enumerate(lengths):
            aux = torch.cat([hs[j][i, :n] for j in self.aux_layer_ids], dim=-1).cpu()
            last = hs[-1][i, :n]
            if self.teacher_topk:
                top = topk_teacher(last, lm_head_weight(self.model), self.teacher_topk)
                feats.append((aux, TopK(top.ids.cpu(), top.logprobs.cpu())))
            else:
                feats.append((aux, last.cpu()))
        return feats

    def close(self) -> None:
        self.model = None
