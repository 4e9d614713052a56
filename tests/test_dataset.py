import json

import pyarrow.parquet as pq
import pytest

from eyas.config import DatasetConfig
from eyas.dataset import DatasetError, build_dataset, check_conversation, read_tokenized

CODE = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n"


def write_prompts(path, n=6, repeats=(1, 2)):
    with open(path, "w") as f:
        for i in range(n):
            content = CODE * repeats[i % len(repeats)]
            f.write(json.dumps({"id": f"p{i}", "conversations": [{"role": "user", "content": content}]}) + "\n")
    return path


def test_roles_must_alternate_and_end_with_user():
    row = {"id": "x", "conversations": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}
    with pytest.raises(DatasetError, match=r"roles \['user', 'user'\]; expected alternating user/assistant"):
        check_conversation(row, "prompts.jsonl:3")


def test_dataset_masks_exactly_the_regenerated_response(tmp_path, random_target_dir):
    cfg = DatasetConfig(prompts_path=str(write_prompts(tmp_path / "p.jsonl")), max_new_tokens=5, draft_vocab_size=64)
    report = build_dataset(cfg, random_target_dir, tmp_path / "out")
    ids, masks, chash = read_tokenized(tmp_path / "out" / "tokenized.parquet")
    assert report.num_samples == 6 and chash == report.content_hash
    for x, m in zip(ids, masks):
        assert len(x) == len(m)
        assert m == sorted(m)  # prompt zeros, then response ones
        assert 1 <= sum(m) <= 5
    assert (tmp_path / "out" / "responses.jsonl").read_text().count('"assistant"') == 6


def test_unchanged_dataset_is_reused(tmp_path, random_target_dir):
    cfg = DatasetConfig(prompts_path=str(write_prompts(tmp_path / "p.jsonl")), max_new_tokens=3, draft_vocab_size=64)
    first = build_dataset(cfg, random_target_dir, tmp_path / "out")
    mtime = (tmp_path / "out" / "tokenized.parquet").stat().st_mtime_ns
    again = build_dataset(cfg, random_target_dir, tmp_path / "out")
    assert again.reused and again.content_hash == first.content_hash
    assert (tmp_path / "out" / "tokenized.parquet").stat().st_mtime_ns == mtime
    changed = build_dataset(cfg.model_copy(update={"max_new_tokens": 4}), random_target_dir, tmp_path / "out")
    assert not changed.reused and changed.num_loss_tokens > first.num_loss_tokens


def test_all_zero_loss_masks_fail_loudly(tmp_path, random_target_dir):
    prompts = write_prompts(tmp_path / "p.jsonl", n=2, repeats=(1,))
    cfg = DatasetConfig(prompts_path=str(prompts), max_new_tokens=2, max_length=30, draft_vocab_size=64)
    with pytest.raises(DatasetError, match=r"2 of 2 samples have an all-zero loss mask"):
        build_dataset(cfg, random_target_dir, tmp_path / "out")
    assert not (tmp_path / "out" / "tokenized.parquet").exists()


def test_truncation_that_drops_most_of_a_sample_fails(tmp_path, random_target_dir):
    prompts = write_prompts(tmp_path / "p.jsonl", n=2, repeats=(2,))
    cfg = DatasetConfig(prompts_path=str(prompts), max_new_tokens=2, max_length=30, draft_vocab_size=64)
    with pytest.raises(DatasetError, match=r"sample p0: \d+ tokens, truncation to dataset.max_length=30 drops most"):
        build_dataset(cfg, random_target_dir, tmp_path / "out")


def test_table_schema_is_the_shard_contract(tmp_path, random_target_dir):
    cfg = DatasetConfig(
        prompts_path=str(write_prompts(tmp_path / "p.jsonl", n=2)), max_new_tokens=2, draft_vocab_size=64
    )
    build_dataset(cfg, random_target_dir, tmp_path / "out")
    schema = pq.read_schema(tmp_path / "out" / "tokenized.parquet")
    assert schema.names == ["sample_index", "id", "input_ids", "loss_mask", "num_tokens"]
    assert b"eyas.content_hash" in schema.metadata
