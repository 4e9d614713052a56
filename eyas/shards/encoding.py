"""How a shard stores each token's features: the aux states' encoding and the teacher's.

    enc = ShardEncoding(aux_dtype="float8_e4m3", teacher="topk", teacher_topk=32, dtype="float16")
    enc.bytes_per_token(hidden_size=7168, num_aux=3)      # 21,717 (bfloat16 + last_hidden: 57,353)
    tensors = {**encode_aux(aux, enc, num_aux=3), **encode_teacher(teacher, enc)}
    aux = decode_aux(stored, enc, num_aux=3)              # float32 [t, 3*7168] (or [b, t, 3*7168]), where it lies

Aux (`aux_hidden_states` [T, n_aux*H]):
- float32 | bfloat16 | float16: the values in that dtype.
- float8_e4m3: float8 e4m3fn values plus `aux_scales` float32 [T, n_aux]. The H values of one aux layer at
  one token are divided by scale = amax / 448 (448 is e4m3fn's largest finite value), so the token's
  largest value lands on 448 and every value keeps 3 mantissa bits (relative error <= 1/16). A scale per
  token per layer, not per tensor: hidden states carry outlier tokens (the first token's norm is often
  ~100x the others'), and one scale for all of them would push the ordinary tokens into subnormals.
  A token whose layer is all zeros gets scale 1.

Teacher (what the loss compares the draft with):
- last_hidden: `last_hidden_states` [T, H] in `dtype`, the lm_head input; the trainer multiplies it by the
  target's lm_head rows of the draft vocab (a dense softmax over the draft vocab).
- topk: `teacher_topk_ids` int32 [T, K] and `teacher_topk_logprobs` [T, K] in `dtype` (float16 or float32):
  the target's K most likely next tokens at every position with their log-probabilities over the full
  target vocab, in descending order. The loss (eyas.objective.teacher_probs) keeps the entries inside the draft
  vocab and renormalizes them; the mass outside the top K and outside the draft vocab is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AUX_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3")
TEACHERS = ("last_hidden", "topk")
TOPK_DTYPES = ("float16", "float32")
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3": torch.float8_e4m3fn,
}
# safetensors' names of the dtypes a shard holds
ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float8_e4m3": "F8_E4M3"}
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3": 1}
# Per-token bytes besides the features: input_ids (int64) + loss_mask (uint8).
TOKEN_OVERHEAD_BYTES = 9


@dataclass(frozen=True)
class ShardEncoding:
    """aux_dtype: the aux states' encoding; teacher: last_hidden | topk; teacher_topk: K (0 with last_hidden);
    dtype: the teacher values' dtype (the last hidden states or the top-K log-probabilities)."""

    aux_dtype: str = "float32"
    teacher: str = "last_hidden"
    teacher_topk: int = 0
    dtype: str = "float32"

    def __post_init__(self) -> None:
        problems = []
        if self.aux_dtype not in AUX_DTYPES:
            problems.append(f"aux_dtype {self.aux_dtype!r}, expected one of {list(AUX_DTYPES)}")
        if self.teacher not in TEACHERS:
            problems.append(f"teacher {self.teacher!r}, expected one of {list(TEACHERS)}")
        elif self.teacher == "topk" and (self.teacher_topk < 1 or self.dtype not in TOPK_DTYPES):
            problems.append(
                f"teacher topk with K={self.teacher_topk} and dtype {self.dtype!r}: expected K >= 1 and the "
                f"log-probabilities in {list(TOPK_DTYPES)}"
            )
        elif self.teacher == "last_hidden" and (self.teacher_topk != 0 or self.dtype not in ITEMSIZE):
            problems.append(
                f"teacher last_hidden with teacher_topk={self.teacher_topk} and dtype {self.dtype!r}: expected "
                f"teacher_topk 0 and dtype in {list(ITEMSIZE)[:3]}"
            )
        if problems:
            raise ValueError(f"shard encoding: {'; '.join(problems)}")

    def label(self) -> str:
        """`float8_e4m3/topk32` style: what the benchmark tables call a variant."""
        teacher = f"topk{self.teacher_topk}" if self.teacher == "topk" else self.teacher
        return f"{self.aux_dtype}/{teacher}"

    def feature_layout(self, num_tokens: int, *, num_aux: int, hidden_size: int) -> dict[str, tuple[str, tuple]]:
        """{tensor: (safetensors dtype, shape)} of the feature tensors a shard of num_tokens tokens holds."""
        t = num_tokens
        out = {"aux_hidden_states": (ST_DTYPES[self.aux_dtype], (t, num_aux * hidden_size))}
        if self.aux_dtype == "float8_e4m3":
            out["aux_scales"] = ("F32", (t, num_aux))
        if self.teacher == "last_hidden":
            out["last_hidden_states"] = (ST_DTYPES[self.dtype], (t, hidden_size))
        else:
            out["teacher_topk_ids"] = ("I32", (t, self.teacher_topk))
            out["teacher_topk_logprobs"] = (ST_DTYPES[self.dtype], (t, self.teacher_topk))
        return out

    def bytes_per_token(self, *, hidden_size: int, num_aux: int) -> int:
        """Shard bytes per token: the feature tensors plus TOKEN_OVERHEAD_BYTES for ids and mask."""
        sizes = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "I32": 4}
        layout = self.feature_layout(1, num_aux=num_aux, hidden_size=hidden_size)
        return sum(sizes[dt] * shape[1] for dt, shape in layout.values()) + TOKEN_OVERHEAD_BYTES


def extract_encoding(extract_cfg) -> ShardEncoding:
    """The encoding an `ExtractConfig` asks for."""
    topk = extract_cfg.teacher == "topk"
    return ShardEncoding(
        aux_dtype=extract_cfg.aux_dtype,
        teacher=extract_cfg.teacher,
        teacher_topk=extract_cfg.teacher_topk if topk else 0,
        dtype=extract_cfg.dtype,
    )


@dataclass(frozen=True)
class TopK:
    """A top-K teacher for t positions: ids int [t, K], logprobs float [t, K] (descending along K)."""

    ids: torch.Tensor
    logprobs: torch.Tensor


def topk_teacher(last: torch.Tensor, lm_head: torch.Tensor, k: int) -> TopK:
    """The target's top-K next-token log-probabilities (over its full vocab) from its final states [t, H]."""
    logprobs = torch.log_softmax(last.float() @ lm_head.float().T, dim=-1)
    values, ids = torch.topk(logprobs, k, dim=-1)
    return TopK(ids.to(torch.int32), values)


def encode_aux(aux: torch.Tensor, enc: ShardEncoding, *, num_aux: int) -> dict[str, torch.Tensor]:
    """The stored form of aux states [t, n_aux*H] (any float dtype)."""
    if enc.aux_dtype != "float8_e4m3":
        return {"aux_hidden_states": aux.to(TORCH_DTYPES[enc.aux_dtype])}
    t = aux.shape[0]
    per_layer = aux.float().reshape(t, num_aux, -1)
    amax = per_layer.abs().amax(dim=-1)
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    values = (per_layer / scales[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"aux_hidden_states": values.reshape(t, -1), "aux_scales": scales}


def decode_aux(stored: dict[str, torch.Tensor], enc: ShardEncoding, *, num_aux: int) -> torch.Tensor:
    """Aux states [..., n_aux*H] from their stored form: float8 values [..., n_aux*H] times their scales
    [..., n_aux] (as float32, on the values' device), else as stored. A sample [t, ...] and a batch [b, t, ...]
    decode alike, element by element the same values."""
    values = stored["aux_hidden_states"]
    if enc.aux_dtype != "float8_e4m3":
        return values
    lead = values.shape[:-1]
    scales = stored["aux_scales"].float()
    return (values.float().reshape(*lead, num_aux, -1) * scales[..., None]).reshape(*lead, -1)


def encode_teacher(teacher: "torch.Tensor | TopK", enc: ShardEncoding) -> dict[str, torch.Tensor]:
    """The stored form of a teacher: final states [t, H], or a TopK with at least K entries per position."""
    dtype = TORCH_DTYPES[enc.dtype]
    if enc.teacher == "last_hidden":
        if not isinstance(teacher, torch.Tensor):
            raise TypeError(f"teacher last_hidden: the backend returned {type(teacher).__name__}, expected states")
        return {"last_hidden_states": teacher.to(dtype)}
    if not isinstance(teacher, TopK):
        raise TypeError(f"teacher topk: the backend returned {type(teacher).__name__}, expected TopK")
    k = enc.teacher_topk
    return {
        "teacher_topk_ids": teacher.ids[:, :k].to(torch.int32),
        "teacher_topk_logprobs": teacher.logprobs[:, :k].to(dtype),
    }


# Stored teacher tensor -> the batch key eyas.objective.ttt_loss reads.
TEACHER_KEYS = {
    "last_hidden_states": "last_hidden",
    "teacher_topk_ids": "topk_ids",
    "teacher_topk_logprobs": "topk_logprobs",
}


def empty_features(enc: ShardEncoding, num_tokens: int, *, num_aux: int, hidden_size: int) -> dict[str, torch.Tensor]:
    """Zeroed feature tensors of a shard, filled sample by sample by the extractor."""
    torch_of = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F8_E4M3": torch.float8_e4m3fn,
                "I32": torch.int32}  # fmt: skip
    layout = enc.feature_layout(num_tokens, num_aux=num_aux, hidden_size=hidden_size)
    return {name: torch.zeros(shape, dtype=torch_of[dt]) for name, (dt, shape) in layout.items()}
