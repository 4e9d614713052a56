"""eyas.data: the sample index over shards, the (seed, epoch) order, rank slices, collate.

`write_tiny_run` (also used by test_train.py and test_smoke.py) writes a tiny target, vocab and
shards whose next-token rule is learnable, in the formats the other stages write.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import save_file

from eyas.config import DraftConfig, TrainConfig, TrainJob
from eyas.data import (
    ShardDataError,
    ShardSamples,
    batch_at,
    collate,
    global_order,
    rank_slice,
)
from eyas.target import target_fingerprint

HIDDEN, NUM_AUX, VOCAB, DRAFT_VOCAB = 32, 3, 64, 32
AUX_LAYER_IDS = [1, 2, 3]


def write_tiny_target(root: Path, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """config.json + model.safetensors holding only embed_tokens and lm_head (unit-norm rows)."""
    root.mkdir(parents=True)
    embed = torch.randn(VOCAB, HIDDEN, generator=gen)
    lm_head = torch.nn.functional.normalize(torch.randn(VOCAB, HIDDEN, generator=gen), dim=-1)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "num_hidden_layers": 4,
        "tie_word_embeddings": False,
    }
    (root / "config.json").write_text(json.dumps(config))
    save_file({"model.embed_tokens.weight": embed, "lm_head.weight": lm_head}, root / "model.safetensors")
    return embed, lm_head


def write_vocab(path: Path) -> None:
    """Draft vocab = the even target ids, so d2t[i] = i (target id 2i)."""
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[::2] = True
    save_file({"d2t": torch.arange(DRAFT_VOCAB, dtype=torch.int64), "t2d": t2d}, path)


def make_samples(num_samples: int, lm_head: torch.Tensor, gen: torch.Generator) -> list[dict]:
    """Token chains x_{t+1} = succ(x_t) over the draft vocab; aux states encode x_t, the target predicts x_{t+1}."""
    succ = torch.randperm(DRAFT_VOCAB, generator=gen) * 2
    codes = torch.randn(VOCAB, NUM_AUX * HIDDEN, generator=gen)
    samples = []
    for _ in range(num_samples):
        length = int(torch.randint(10, 17, (1,), generator=gen))
        ids = [2 * int(torch.randint(DRAFT_VOCAB, (1,), generator=gen))]
        for _ in range(length):
            ids.append(int(succ[ids[-1] // 2]))
        ids = torch.tensor(ids)
        tokens, following = ids[:-1], ids[1:]
        mask = torch.ones(length, dtype=torch.uint8)
        mask[:2] = 0
        samples.append(
            {
                "input_ids": tokens,
                "loss_mask": mask,
                "aux_hidden_states": codes[tokens] + 0.05 * torch.randn(length, NUM_AUX * HIDDEN, generator=gen),
                "last_hidden_states": 8.0 * lm_head[following],
            }
        )
    return samples


def write_shards(shards_dir: Path, samples: list[dict], per_shard: int, fingerprint: str) -> None:
    """Shards and manifest.parquet in the eyas.shards format."""
    shards_dir.mkdir(parents=True)
    rows = []
    for index, start in enumerate(range(0, len(samples), per_shard)):
        chunk = samples[start : start + per_shard]
        lengths = torch.tensor([s["input_ids"].numel() for s in chunk])
        tensors = {k: torch.cat([s[k] for s in chunk]) for k in chunk[0]}
        tensors["sample_offsets"] = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        tensors["sample_indices"] = torch.arange(start, start + len(chunk), dtype=torch.int64)
        name = f"shard-{index:05d}.safetensors"
        metadata = {
            "format_version": "1",
            "aux_layer_ids": json.dumps(AUX_LAYER_IDS),
            "layer_id_convention": "hf_hidden_states",
            "hidden_size": str(HIDDEN),
            "num_aux": str(NUM_AUX),
            "dtype": "float32",
            "target_fingerprint": fingerprint,
        }
        save_file(tensors, shards_dir / name, metadata=metadata)
        rows.append(
            {
                "shard_index": index,
                "file": name,
                "sample_start": start,
                "sample_end": start + len(chunk),
                "num_tokens": int(lengths.sum()),
                "num_bytes": (shards_dir / name).stat().st_size,
                "sha256": "0" * 64,
            }
        )
    pq.write_table(pa.Table.from_pylist(rows), shards_dir / "manifest.parquet")


def write_tiny_run(root: Path, *, num_samples: int = 32, per_shard: int = 10, seed: int = 0) -> dict:
    """A target dir, vocab and shards under root; returns their paths and the samples written."""
    gen = torch.Generator().manual_seed(seed)
    _, lm_head = write_tiny_target(root / "target", gen)
    write_vocab(root / "vocab.safetensors")
    samples = make_samples(num_samples, lm_head, gen)
    write_shards(root / "shards", samples, per_shard, target_fingerprint(root / "target"))
    return {
        "target": root / "target",
        "vocab": root / "vocab.safetensors",
        "shards": root / "shards",
        "samples": samples,
    }


def tiny_job(run: dict, output_dir: Path, **train) -> TrainJob:
    """A TrainJob over a tiny run: a small draft, 3 TTT steps, gloo."""
    defaults = dict(
        num_processes=2,
        backend="gloo",
        global_batch_size=8,
        lr=1e-2,
        warmup_steps=1,
        ttt_steps=3,
        save_every_steps=2,
        keep_last_checkpoints=2,
        seed=0,
    )
    return TrainJob(
        target_path=str(run["target"]),
        shards_dir=str(run["shards"]),
        vocab_path=str(run["vocab"]),
        output_dir=str(output_dir),
        aux_layer_ids=AUX_LAYER_IDS,
        draft=DraftConfig(
            num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=64, max_position_embeddings=64
        ),
        train=TrainConfig(**{**defaults, **train}),
    )


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> dict:
    return write_tiny_run(tmp_path_factory.mktemp("tiny-run"), num_samples=25, per_shard=10)


def test_load_sample_returns_the_written_sample_from_its_shard(tiny_run):
    samples = ShardSamples(tiny_run["shards"])
    assert len(samples) == 25
    for index in (0, 9, 10, 24):
        got = samples.load_sample(index)
        want = tiny_run["samples"][index]
        assert got["sample_index"] == index
        assert torch.equal(got["input_ids"], want["input_ids"])
        assert torch.equal(got["loss_mask"], want["loss_mask"])
        assert torch.equal(got["aux_hidden"], want["aux_hidden_states"])
        assert torch.equal(got["last_hidden"], want["last_hidden_states"])
    assert samples.metadata["aux_layer_ids"] == AUX_LAYER_IDS and samples.metadata["hidden_size"] == HIDDEN


def test_max_samples_keeps_the_first_samples(tiny_run):
    samples = ShardSamples(tiny_run["shards"], max_samples=12)
    assert len(samples) == 12
    with pytest.raises(IndexError, match="sample 12: expected 0 <= index < 12"):
        samples.load_sample(12)


def test_manifest_gap_is_refused(tmp_path, tiny_run):
    shards = tmp_path / "shards"
    shards.mkdir()
    table = pq.read_table(tiny_run["shards"] / "manifest.parquet").to_pylist()
    pq.write_table(pa.Table.from_pylist([table[0], table[2]]), shards / "manifest.parquet")
    with pytest.raises(
        ShardDataError,
        match=r"shard shard-00002.safetensors covers samples \[20, 25\), "
        r"expected it to start at 10",
    ):
        ShardSamples(shards)


def test_global_order_depends_only_on_seed_and_epoch():
    order = global_order(100, seed=3, epoch=1)
    assert sorted(order) == list(range(100))
    assert global_order(100, seed=3, epoch=1) == order
    assert global_order(100, seed=3, epoch=2) != order
    assert global_order(100, seed=4, epoch=1) != order


def test_batch_at_walks_epochs_by_samples_consumed():
    # 10 samples, batches of 4: 2 steps per epoch, the 2-sample tail of each shuffled epoch is skipped.
    assert batch_at(0, 10, 4, seed=0) == (0, global_order(10, 0, 0)[0:4])
    assert batch_at(4, 10, 4, seed=0) == (0, global_order(10, 0, 0)[4:8])
    assert batch_at(8, 10, 4, seed=0) == (1, global_order(10, 0, 1)[0:4])


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_rank_slices_partition_the_global_batch(world):
    ids = global_order(50, seed=0, epoch=0)[:8]
    slices = [rank_slice(ids, rank, world) for rank in range(world)]
    assert [i for s in slices for i in s] == ids
    assert max(map(len, slices)) - min(map(len, slices)) <= 1


def test_rank_slice_refuses_more_ranks_than_samples():
    with pytest.raises(ValueError, match="a global batch of 2 samples cannot give each of 4 ranks a sample"):
        rank_slice([5, 6], 0, 4)


def test_collate_right_pads_and_marks_valid_tokens(tiny_run):
    samples = ShardSamples(tiny_run["shards"])
    picked = [samples.load_sample(i) for i in (0, 1, 2)]
    lengths = [int(s["input_ids"].numel()) for s in picked]
    batch = collate(picked, max_len=64)
    width = max(lengths)
    assert batch["input_ids"].shape == (3, width) and batch["input_ids"].dtype == torch.int64
    assert batch["loss_mask"].shape == (3, width) and batch["loss_mask"].dtype == torch.uint8
    assert batch["aux_hidden"].shape == (3, width, NUM_AUX * HIDDEN)
    assert batch["last_hidden"].shape == (3, width, HIDDEN)
    assert batch["valid"].dtype == torch.bool
    for row, n in enumerate(lengths):
        assert batch["valid"][row].tolist() == [True] * n + [False] * (width - n)
        assert torch.equal(batch["input_ids"][row, :n], picked[row]["input_ids"])
        assert not batch["loss_mask"][row, n:].any() and not batch["aux_hidden"][row, n:].any()


def test_collate_cuts_samples_to_max_len(tiny_run):
    samples = ShardSamples(tiny_run["shards"])
    batch = collate([samples.load_sample(0), samples.load_sample(1)], max_len=5)
    assert batch["input_ids"].shape == (2, 5) and bool(batch["valid"].all())


def test_collate_pads_to_min_len_with_invalid_masked_columns(tiny_run):
    sample = ShardSamples(tiny_run["shards"]).load_sample(0)
    batch = collate([sample], max_len=4, min_len=8)
    assert batch["input_ids"].shape == (1, 8)
    assert batch["valid"][0].tolist() == [True] * 4 + [False] * 4
    assert not batch["loss_mask"][0, 4:].any()
