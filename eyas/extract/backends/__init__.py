"""Hidden-state backends: what turns token ids into (aux, teacher) features, behind one interface.

    backend = open_backend(extract_cfg, target_path=..., target_dtype="bfloat16", aux_layer_ids=[2, 16, 29],
                           hidden_size=4096, device="cuda:0")
    [(aux, last), ...] = backend.features([ids_0, ids_1])   # aux [t_i, n_aux*H], last [t_i, H]
    # with teacher_topk=K > 0 the teacher is an eyas.shards.encoding.TopK: ids [t_i, K], logprobs [t_i, K]
    backend.close()

`hf` runs the target through transformers in this process (CPU or one GPU); `sglang` asks an SGLang
server in aux-capture mode (eyas.extract.backends.sglang). The extractor checks the widths of every
batch of any backend (eyas.extract.backends.base) before it writes anything.
"""

from __future__ import annotations

from eyas.config import ExtractConfig, SGLangEnvConfig
from eyas.extract.backends.base import AuxWidthError, HiddenStateBackend, check_aux_width, check_feature_widths
from eyas.extract.backends.hf import HFBackend

__all__ = [
    "AuxWidthError",
    "HFBackend",
    "HiddenStateBackend",
    "check_aux_width",
    "check_feature_widths",
    "open_backend",
]


def open_backend(
    extract_cfg: ExtractConfig,
    *,
    target_path: str,
    target_dtype: str,
    aux_layer_ids: list[int],
    hidden_size: int,
    device: str,
    trust_remote_code: bool = False,
    sglang_env: SGLangEnvConfig = SGLangEnvConfig(),
) -> HiddenStateBackend:
    """The configured backend (the sglang one is imported only when asked for); `trust_remote_code` (the run's
    target.trust_remote_code) lets the hf backend run a model whose code comes from its directory and the sglang
    backend's server load it (--trust-remote-code); `sglang_env` (the run's `sglang` section) is SGLang's
    environment, where the sglang backend launches its server."""
    topk = extract_cfg.teacher_topk if extract_cfg.teacher == "topk" else 0
    if extract_cfg.backend == "hf":
        return HFBackend(
            target_path, target_dtype=target_dtype, aux_layer_ids=aux_layer_ids, hidden_size=hidden_size,
            device=device, teacher_topk=topk, trust_remote_code=trust_remote_code,
        )  # fmt: skip
    if extract_cfg.backend == "sglang":
        from eyas.extract.backends.sglang import SGLangBackend

        return SGLangBackend(
            extract_cfg.sglang, target_path=target_path, aux_layer_ids=aux_layer_ids, hidden_size=hidden_size,
            teacher_topk=topk, env=sglang_env, trust_remote_code=trust_remote_code,
        )  # fmt: skip
    raise ValueError(f"extract.backend={extract_cfg.backend!r}: expected 'hf' or 'sglang'")
