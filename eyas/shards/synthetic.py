"""Synthetic runs for tests and benchmarks: a target stub, a vocab mapping and shards whose next-token
rule is learnable, written by the same writers the real stages use (shards with real checksums: verification passes them).

The target stub is `config.json` + `model.safetensors` with only embed_tokens and lm_head (what
the trainer reads). Token chains follow x_{t+1} = succ(x_t) over the draft vocab (the even target
ids); aux states encode x_t; the last hidden state makes the target predict x_{t+1}.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from eyas.dataset.vocab import save_vocab
from eyas.layer_ids import LAYER_ID_CONVENTION
from eyas.shards.encoding import ShardEncoding, encode_aux, encode_teacher, topk_teacher
from eyas.shards.format import ShardMeta, write_shard
from eyas.shards.manifest import write_manifest
from eyas.target import target_fingerprint

SYNTHETIC_DATASET_HASH = "synthetic"


@dataclass(frozen=True)
class SyntheticSpec:
    hidden: int = 32
    num_aux: int = 3
    vocab: int = 64
    min_len: int = 10
    max_len: int = 16
    aux_layer_ids: tuple[int, ...] = (1, 2, 3)

    @property
    def draft_vocab(self) -> int:
        return self.vocab // 2


def write_target_stub(root: Path, spec: SyntheticSpec, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """config.json + model.safetensors holding only embed_tokens and lm_head (unit-norm rows)."""
    root.mkdir(parents=True)
    embed = torch.randn(spec.vocab, spec.hidden, generator=gen)
    lm_head = torch.nn.functional.normalize(torch.randn(spec.vocab, spec.hidden, generator=gen), dim=-1)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": spec.vocab,
        "hidden_size": spec.hidden,
        "num_hidden_layers": max(spec.aux_layer_ids) + 1,
        "tie_word_embeddings": False,
    }
    (root / "config.json").write_text(json.dumps(config))
    save_file({"model.embed_tokens.weight": embed, "lm_head.weight": lm_head}, root / "model.safetensors")
    return embed, lm_head


def write_vocab(path: Path, spec: SyntheticSpec) -> None:
    """Draft vocab = the even target ids, so d2t[i] = i (target id 2i)."""
    t2d = torch.zeros(spec.vocab, dtype=torch.bool)
    t2d[::2] = True
    save_vocab(path, torch.arange(spec.draft_vocab, dtype=torch.int64), t2d, SYNTHETIC_DATASET_HASH)


def make_samples(num_samples: int, lm_head: torch.Tensor, spec: SyntheticSpec, gen: torch.Generator) -> list[dict]:
    """Token chains x_{t+1} = succ(x_t) over the draft vocab; aux states encode x_t, the target predicts x_{t+1}."""
    succ = torch.randperm(spec.draft_vocab, generator=gen) * 2
    codes = torch.randn(spec.vocab, spec.num_aux * spec.hidden, generator=gen)
    samples = []
    for _ in range(num_samples):
        length = int(torch.randint(spec.min_len, spec.max_len + 1, (1,), generator=gen))
        ids = [2 * int(torch.randint(spec.draft_vocab, (1,), generator=gen))]
        for _ in range(length):
            ids.append(int(succ[ids[-1] // 2]))
        ids = torch.tensor(ids)
        tokens, following = ids[:-1], ids[1:]
        mask = torch.ones(length, dtype=torch.uint8)
        mask[:2] = 0
        noise = 0.05 * torch.randn(length, spec.num_aux * spec.hidden, generator=gen)
        samples.append(
            {
                "input_ids": tokens,
                "loss_mask": mask,
                "aux_hidden_states": codes[tokens] + noise,
                "last_hidden_states": 8.0 * lm_head[following],
            }
        )
    return samples


def encode_sample(sample: dict, enc: ShardEncoding, lm_head: torch.Tensor, num_aux: int) -> dict:
    """A float32/last_hidden sample in the stored form of another encoding (the top-K from lm_head)."""
    last = sample["last_hidden_states"]
    teacher = topk_teacher(last, lm_head, enc.teacher_topk) if enc.teacher == "topk" else last
    features = {**encode_aux(sample["aux_hidden_states"], enc, num_aux=num_aux), **encode_teacher(teacher, enc)}
    return {"input_ids": sample["input_ids"], "loss_mask": sample["loss_mask"], **features}


def write_shards(
    shards_dir: Path,
    samples: list[dict],
    per_shard: int,
    fingerprint: str,
    spec: SyntheticSpec,
    encoding: ShardEncoding = ShardEncoding(),
    lm_head: torch.Tensor | None = None,
) -> None:
    """Shards and manifest.parquet, written as extraction writes them (eyas.shards.format.write_shard, real
    checksums), for a dataset named `synthetic`; in `encoding` (a top-K teacher needs the target's lm_head)."""
    shards_dir.mkdir(parents=True)
    rows = []
    if encoding != ShardEncoding():
        samples = [encode_sample(s, encoding, lm_head, spec.num_aux) for s in samples]
    for index, start in enumerate(range(0, len(samples), per_shard)):
        chunk = samples[start : start + per_shard]
        lengths = torch.tensor([s["input_ids"].numel() for s in chunk])
        tensors = {k: torch.cat([s[k] for s in chunk]) for k in chunk[0]}
        tensors["sample_offsets"] = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        tensors["sample_indices"] = torch.arange(start, start + len(chunk), dtype=torch.int64)
        meta = ShardMeta(
            target_fingerprint=fingerprint,
            aux_layer_ids=tuple(spec.aux_layer_ids),
            layer_id_convention=LAYER_ID_CONVENTION,
            hidden_size=spec.hidden,
            num_aux=spec.num_aux,
            dtype=encoding.dtype,
            backend="synthetic",
            dataset_hash=SYNTHETIC_DATASET_HASH,
            shard_index=index,
            sample_start=start,
            sample_end=start + len(chunk),
            aux_dtype=encoding.aux_dtype,
            teacher=encoding.teacher,
            teacher_topk=encoding.teacher_topk,
        )
        rows.append(write_shard(shards_dir, tensors, meta))
    write_manifest(shards_dir, rows)


def write_synthetic_run(
    root: Path,
    *,
    num_samples: int = 32,
    per_shard: int = 10,
    seed: int = 0,
    spec: SyntheticSpec = SyntheticSpec(),
    encoding: ShardEncoding = ShardEncoding(),
) -> dict:
    """A target stub, vocab and shards (in `encoding`) under root; returns their paths and the samples (float32,
    last_hidden) written."""
    gen = torch.Generator().manual_seed(seed)
    _, lm_head = write_target_stub(root / "target", spec, gen)
    write_vocab(root / "vocab.safetensors", spec)
    samples = make_samples(num_samples, lm_head, spec, gen)
    write_shards(root / "shards", samples, per_shard, target_fingerprint(root / "target"), spec, encoding, lm_head)
    return {
        "target": root / "target",
        "vocab": root / "vocab.safetensors",
        "shards": root / "shards",
        "samples": samples,
    }
