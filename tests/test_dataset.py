import json

import pyarrow.parquet as pq
import pytest

from eyas.config import DatasetConfig, RunConfig
from eyas.dataset.build import build_dataset, read_dataset_report
from eyas.dataset.prompts import DatasetError, check_conversation
from eyas.dataset.table import read_dataset_hash

CODE = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n"


def write_prompts(path, n=6, repeats=(1, 2)):
    with open(path, "w") as f:
        for i in range(n):
            content = CODE * repeats[i % len(repeats)]
            f.write(json.dumps({"id": f"p{i}", "conversations": [{"role": "user", "content": content}]}) + "\n")
    return path


def build(cfg: DatasetConfig, target, out):
    """build_dataset for a run whose dataset dir is `out`."""
    config = RunConfig(
        workdir=str(out.parent),
        target={"model_path": str(target)},
        dataset=cfg,
        bench={"prompts_path": cfg.prompts_path},
    )
    assert config.paths.dataset_dir.name == out.name == "dataset"
    return build_dataset(config)


def test_roles_must_alternate_and_end_with_user():
    row = {"id": "x", "conversations": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}
    with pytest.raises(DatasetError, match=r"roles \['user', 'user'\]; expected alternating user/assistant"):
        check_conversation(row, "prompts.jsonl:3")


def test_dataset_masks_exactly_the_regenerated_response(tmp_path, random_target_dir):
    cfg = DatasetConfig(prompts_path=str(write_prompts(tmp_path / "p.jsonl")), max_new_tokens=5, draft_vocab_size=64)
    report = build(cfg, random_target_dir, tmp_path / "dataset")
    table = pq.read_table(tmp_path / "dataset" / "tokenized.parquet")
    ids, masks = table.column("input_ids").to_pylist(), table.column("loss_mask").to_pylist()
    chash = read_dataset_hash(tmp_path / "dataset" / "tokenized.parquet")
    assert report.num_samples == 6 and chash == report.content_hash
    for x, m in zip(ids, masks):
        assert len(x) == len(m)
        assert m == sorted(m)  # prompt zeros, then response ones
        assert 1 <= sum(m) <= 5
    assert (tmp_path / "dataset" / "responses.jsonl").read_text().count('"assistant"') == 6


def test_unchanged_dataset_is_reused(tmp_path, random_target_dir):
    cfg = DatasetConfig(prompts_path=str(write_prompts(tmp_path / "p.jsonl")), max_new_tokens=3, draft_vocab_size=64)
    first = build(cfg, random_target_dir, tmp_path / "dataset")
    mtime = (tmp_path / "dataset" / "tokenized.parquet").stat().st_mtime_ns
    again = build(cfg, random_target_dir, tmp_path / "dataset")
    assert again.reused and again.content_hash == first.content_hash
    assert (tmp_path / "dataset" / "tokenized.parquet").stat().st_mtime_ns == mtime
    changed = build(cfg.model_copy(update={"max_new_tokens": 4}), random_target_dir, tmp_path / "dataset")
    assert not changed.reused and changed.num_loss_tokens > first.num_loss_tokens


def test_all_zero_loss_masks_fail_loudly(tmp_path, random_target_dir):
    prompts = write_prompts(tmp_path / "p.jsonl", n=2, repeats=(1,))
    cfg = DatasetConfig(prompts_path=str(prompts), max_new_tokens=2, max_length=30, draft_vocab_size=64)
    with pytest.raises(DatasetError, match=r"2 of 2 samples have an all-zero loss mask"):
        build(cfg, random_target_dir, tmp_path / "dataset")
    assert not (tmp_path / "dataset" / "tokenized.parquet").exists()


def test_truncation_that_drops_most_of_a_sample_fails(tmp_path, random_target_dir):
    turns = [{"role": "user", "content": "def f():"}, {"role": "assistant", "content": CODE * 2}]
    (tmp_path / "p.jsonl").write_text(json.dumps({"id": "p0", "conversations": turns}) + "\n")
    cfg = DatasetConfig(prompts_path=str(tmp_path / "p.jsonl"), responses="as_given", max_length=30,
                        draft_vocab_size=64)  # fmt: skip
    with pytest.raises(DatasetError, match=r"sample p0: \d+ tokens, truncation to dataset.max_length=30 drops most"):
        build(cfg, random_target_dir, tmp_path / "dataset")


def test_a_prompt_that_alone_fills_max_length_is_skipped_and_counted(tmp_path, random_target_dir):
    prompts = write_prompts(tmp_path / "p.jsonl", n=2, repeats=(2,))
    cfg = DatasetConfig(prompts_path=str(prompts), max_new_tokens=2, max_length=30, draft_vocab_size=64)
    with pytest.raises(
        DatasetError, match=r"2 of 2 samples have an all-zero loss mask \(no response token, or a prompt"
    ):
        build(cfg, random_target_dir, tmp_path / "dataset")


def test_table_schema_is_the_shard_contract(tmp_path, random_target_dir):
    cfg = DatasetConfig(
        prompts_path=str(write_prompts(tmp_path / "p.jsonl", n=2)), max_new_tokens=2, draft_vocab_size=64
    )
    build(cfg, random_target_dir, tmp_path / "dataset")
    schema = pq.read_schema(tmp_path / "dataset" / "tokenized.parquet")
    assert schema.names == ["sample_index", "id", "input_ids", "loss_mask", "num_tokens"]
    assert b"eyas.content_hash" in schema.metadata


def test_a_report_changed_by_hand_is_an_error_naming_its_file(tmp_path):
    (tmp_path / "report.json").write_text('{"num_samples": 3,')
    with pytest.raises(ValueError, match=f"{tmp_path / 'report.json'}: not valid JSON.*delete it"):
        read_dataset_report(tmp_path)
    assert read_dataset_report(tmp_path / "absent") is None


def test_the_vocab_file_is_byte_deterministic_across_processes(tmp_path):
    """safetensors' own writer orders metadata keys by a per-process hash; eyas's does not."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    script = (
        "import sys, torch; from eyas.dataset.vocab import save_vocab, load_vocab; "
        "d2t = torch.arange(8) * 4; t2d = torch.zeros(40, dtype=torch.bool); t2d[::5] = True; "
        "save_vocab(sys.argv[1], d2t, t2d, 'abc123'); print(load_vocab(sys.argv[1])[2])"
    )
    outs = []
    for i in range(4):
        path = tmp_path / f"vocab-{i}.safetensors"
        done = subprocess.run([sys.executable, "-c", script, str(path)], cwd=repo, capture_output=True, text=True,
                              env={**__import__("os").environ, "PYTHONPATH": str(repo), "PYTHONHASHSEED": str(i)})  # fmt: skip
        assert done.returncode == 0, done.stderr
        outs.append(path.read_bytes())
    assert all(o == outs[0] for o in outs)


def test_conversations_without_the_turn_to_train_on_count_against_the_empty_fraction(tmp_path, random_target_dir):
    """as_given with 24 of 25 conversations lacking an assistant turn fails, instead of training on one sample."""
    user = {"role": "user", "content": CODE}
    rows = [[user, {"role": "assistant", "content": CODE}]] + [[user]] * 24
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"id": f"c{i}", "conversations": r}) + "\n"
                                              for i, r in enumerate(rows)))  # fmt: skip
    cfg = DatasetConfig(prompts_path=str(tmp_path / "c.jsonl"), responses="as_given", draft_vocab_size=64)
    with pytest.raises(DatasetError, match=r"24 of 25 samples have an all-zero loss mask \(.*; 24 x no assistant turn "
                       r"to train on\), more than dataset.max_empty_mask_fraction=0.05"):  # fmt: skip
        build(cfg, random_target_dir, tmp_path / "dataset")
    assert not (tmp_path / "dataset" / "tokenized.parquet").exists()
