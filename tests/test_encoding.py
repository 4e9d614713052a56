"""Shard encodings (eyas.shards.encoding): float8 aux states with per-token scales, the top-K teacher, what they
cost, and that extraction, verification, the reader and the loss all speak them."""

from __future__ import annotations

import random
import shutil

import pytest
import torch
from run_fixtures import extract, run_trainer, tiny_job, write_tiny_run, write_tokenized

from eyas.config import ExtractConfig
from eyas.draft import DraftArch, build_draft
from eyas.facts import facts_for
from eyas.objective import teacher_probs, ttt_loss
from eyas.shards.encoding import (
    FP8_MAX,
    ShardEncoding,
    TopK,
    decode_aux,
    encode_aux,
    encode_teacher,
    extract_encoding,
    topk_teacher,
)
from eyas.shards.format import load_shard, shard_filename, write_shard
from eyas.shards.manifest import read_manifest, write_manifest
from eyas.shards.reader import ShardSamples
from eyas.target import load_embed_and_lm_head, load_target, target_features
from eyas.train.data import collate
from eyas.verify.shard_set import expected_shard_meta, verify_shards

AUX_IDS = [2, 4, 5]
H = 64
FP8_TOPK = ExtractConfig(shard_bytes=1 << 16, batch_size=3, aux_dtype="float8_e4m3", teacher="topk",
                         teacher_topk=8, dtype="float16")  # fmt: skip


def test_float8_keeps_every_token_within_one_sixteenth_of_its_layers_largest_value():
    torch.manual_seed(0)
    aux = torch.randn(6, 3 * H)
    aux[0] *= 1000.0  # an outlier token (the first token's states often are): its scale is its own
    aux[3, H : 2 * H] = 0.0  # a layer of zeros at one token: scale 1
    stored = encode_aux(aux, ShardEncoding(aux_dtype="float8_e4m3"), num_aux=3)
    assert stored["aux_hidden_states"].dtype == torch.float8_e4m3fn
    assert stored["aux_scales"].shape == (6, 3) and stored["aux_scales"][3, 1] == 1.0
    decoded = decode_aux(stored, ShardEncoding(aux_dtype="float8_e4m3"), num_aux=3)
    per_layer = aux.reshape(6, 3, H)
    err = (decoded.reshape(6, 3, H) - per_layer).abs().amax(-1)
    amax = per_layer.abs().amax(-1)
    assert bool((err <= amax / 16).all()), (err / amax.clamp_min(1e-9)).max()
    assert stored["aux_hidden_states"].float().abs().max() == FP8_MAX  # each token-layer's amax lands on 448
    assert torch.equal(decoded[3, H : 2 * H], torch.zeros(H))


def test_bytes_per_token_of_each_encoding_at_kimi_width():
    kimi = {"hidden_size": 7168, "num_aux": 3}
    assert ShardEncoding("bfloat16", "last_hidden", 0, "bfloat16").bytes_per_token(**kimi) == 4 * 7168 * 2 + 9
    assert ShardEncoding("float8_e4m3", "last_hidden", 0, "bfloat16").bytes_per_token(**kimi) == (
        3 * 7168 + 3 * 4 + 7168 * 2 + 9
    )
    assert ShardEncoding("float8_e4m3", "topk", 32, "float16").bytes_per_token(**kimi) == 3 * 7168 + 12 + 32 * 6 + 9


def test_an_encoding_that_cannot_be_stored_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match=r"teacher topk with K=8 and dtype 'bfloat16': expected K >= 1 and the "):
        ShardEncoding("float32", "topk", 8, "bfloat16")
    with pytest.raises(ValueError, match=r"extract.dtype is bfloat16 .* set extract.dtype to float16"):
        ExtractConfig(teacher="topk", dtype="bfloat16")


def _draft(vocab: int, draft_vocab: int, keep: torch.Tensor):
    arch = DraftArch(hidden_size=32, num_aux=3, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                     intermediate_size=64, target_vocab_size=vocab, draft_vocab_size=draft_vocab)  # fmt: skip
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[keep] = True
    d2t = keep - torch.arange(draft_vocab)
    return build_draft(arch, torch.randn(vocab, 32), d2t, t2d, seed=0)


def test_a_topk_teacher_holding_all_the_mass_gives_the_dense_loss():
    torch.manual_seed(1)
    vocab, keep = 48, torch.tensor(sorted(random.Random(0).sample(range(48), 20)))
    draft = _draft(vocab, len(keep), keep)
    lm_head = torch.randn(vocab, 32)
    b, length = 2, 9
    last = torch.randn(b, length, 32)
    batch = {"input_ids": torch.randint(0, vocab, (b, length)), "loss_mask": torch.ones(b, length, dtype=torch.uint8),
             "aux_hidden": torch.randn(b, length, 3 * 32), "valid": torch.ones(b, length, dtype=torch.bool)}  # fmt: skip
    top = topk_teacher(last.reshape(-1, 32), lm_head, vocab)  # K = the whole vocab: every bit of the mass
    sparse = {**batch, "topk_ids": top.ids.reshape(b, length, -1), "topk_logprobs": top.logprobs.reshape(b, length, -1)}
    dense = {**batch, "last_hidden": last}
    p_dense, _ = teacher_probs(dense, lm_head[keep], draft.t2d)
    p_sparse, has_mass = teacher_probs(sparse, lm_head[keep], draft.t2d)
    torch.testing.assert_close(p_sparse, p_dense, atol=1e-6, rtol=1e-5)
    assert bool(has_mass.all())
    loss_dense, *_ = ttt_loss(draft, dense, lm_head[keep], 3, 0.8)
    loss_sparse, *_ = ttt_loss(draft, sparse, lm_head[keep], 3, 0.8)
    torch.testing.assert_close(loss_sparse, loss_dense, atol=1e-5, rtol=1e-6)


def test_a_topk_teacher_drops_the_mass_outside_the_draft_vocab_and_renormalizes():
    t2d = torch.tensor([True, False, True, True, False, False])  # draft vocab = target ids 0, 2, 3
    ids = torch.tensor([[[4, 2, 1, 0]], [[5, 4, 1, 1]]])  # position 2 has no draft-vocab entry
    logprobs = torch.log(torch.tensor([[[0.5, 0.3, 0.1, 0.1]], [[0.6, 0.2, 0.1, 0.1]]]))
    probs, has_mass = teacher_probs({"topk_ids": ids, "topk_logprobs": logprobs}, torch.zeros(3, 4), t2d)
    torch.testing.assert_close(probs[0, 0], torch.tensor([0.1, 0.3, 0.0]) / 0.4)  # draft ids of targets 0, 2, 3
    assert has_mass.tolist() == [[True], [False]] and probs[1, 0].sum() == 0
    with pytest.raises(ValueError, match=r"top-K teacher ids span 1..6, expected 0..5 \(the target's vocab\)"):
        teacher_probs({"topk_ids": ids + 1, "topk_logprobs": logprobs}, torch.zeros(3, 4), t2d)


@pytest.fixture(scope="module")
def fp8_topk_run(tmp_path_factory, random_target_dir):
    root = tmp_path_factory.mktemp("encoded")
    rng = random.Random(2)
    samples = [[rng.randrange(1, 2048) for _ in range(rng.randint(4, 20))] for _ in range(9)]
    tokenized = write_tokenized(root / "tokenized.parquet", samples)
    extract(tokenized, root / "shards", random_target_dir, FP8_TOPK)
    facts = facts_for(target_path=random_target_dir, tokenized_path=tokenized, shards_dir=root / "shards")
    return tokenized, root / "shards", expected_shard_meta(facts, extract_encoding(FP8_TOPK)), samples


def test_extraction_writes_the_encoding_and_the_reader_decodes_it(fp8_topk_run, random_target_dir):
    _, shards, _, samples = fp8_topk_run
    tensors, meta = load_shard(shards / shard_filename(0))
    assert (meta.aux_dtype, meta.teacher, meta.teacher_topk, meta.dtype) == ("float8_e4m3", "topk", 8, "float16")
    assert sorted(tensors) == ["aux_hidden_states", "aux_scales", "input_ids", "loss_mask", "sample_indices",
                               "sample_offsets", "teacher_topk_ids", "teacher_topk_logprobs"]  # fmt: skip
    model = load_target(random_target_dir).model
    _, lm_head = load_embed_and_lm_head(random_target_dir)
    reader = ShardSamples(shards)
    for i in (0, len(samples) - 1):
        aux, last, _ = target_features(model, torch.tensor([samples[i]]), AUX_IDS)
        sample = reader.load_sample(i)
        assert sample["aux_hidden"].dtype == torch.float32 and "last_hidden" not in sample
        per_layer = aux[0].reshape(len(samples[i]), 3, H)
        err = (sample["aux_hidden"].reshape(per_layer.shape) - per_layer).abs().amax(-1)
        assert bool((err <= per_layer.abs().amax(-1) / 16).all())
        want = topk_teacher(last[0], lm_head, 8)
        assert torch.equal(sample["topk_ids"], want.ids)
        torch.testing.assert_close(sample["topk_logprobs"].float(), want.logprobs, atol=2e-3, rtol=1e-3)
    batch = collate([reader.load_sample(i) for i in range(3)], 64)
    assert batch["topk_ids"].shape[-1] == 8 and batch["aux_hidden"].shape[-1] == 3 * H


def _rewrite(shards, index, mutate):
    tensors, meta = load_shard(shards / shard_filename(index))
    row = write_shard(shards, mutate({k: v.clone() for k, v in tensors.items()}), meta)
    write_manifest(shards, [row if r.shard_index == index else r for r in read_manifest(shards)])


def _reasons(shards, run, mode="full"):
    report = verify_shards(shards_dir=shards, tokenized_path=run[0], expected=run[2], mode=mode)
    return {r.file: r.reason for r in report.rows if r.status == "bad"}


def test_encoded_shards_pass_verification(fp8_topk_run):
    assert _reasons(fp8_topk_run[1], fp8_topk_run) == {}


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda t: t["aux_hidden_states"].view(torch.uint8)[1, 5].fill_(0x7F),
         "aux_hidden_states has non-finite values (first at token 1, sample 0)"),
        (lambda t: t["aux_scales"][2, 1].fill_(0.0),
         "aux_scales has a value 0.0 <= 0 (token 2, sample 0); a float8 scale is the layer's amax / 448"),
        (lambda t: t["aux_scales"][2, 1].fill_(float("inf")),
         "aux_scales has non-finite values (first at token 2, sample 0)"),
        (lambda t: t["teacher_topk_logprobs"][3, 0].fill_(2.5),
         "teacher_topk_logprobs has 2.5 > 0 (token 3, sample 0): not log-probabilities (logits?)"),
        (lambda t: t["teacher_topk_ids"][0, 0].fill_(-1), "teacher_topk_ids has a negative id (token 0, sample 0)"),
    ],
)  # fmt: skip
def test_a_damaged_encoding_is_named_by_verification(tmp_path, fp8_topk_run, damage, reason):
    shards = tmp_path / "shards"
    shutil.copytree(fp8_topk_run[1], shards)

    def mutate(tensors):
        damage(tensors)
        return tensors

    _rewrite(shards, 0, mutate)
    found = _reasons(shards, fp8_topk_run)["shard-00000.safetensors"]
    assert found.startswith(f"shard-00000.safetensors: {reason}"), found


def test_shards_of_another_encoding_are_refused_by_their_metadata(fp8_topk_run):
    tokenized, shards, expected, _ = fp8_topk_run
    other = verify_shards(shards_dir=shards, tokenized_path=tokenized, expected=expected.__class__(
        **{**expected.__dict__, "aux_dtype": "bfloat16", "teacher_topk": 32}), mode="cheap")  # fmt: skip
    reason = next(r.reason for r in other.rows)
    assert "aux_dtype 'float8_e4m3', expected 'bfloat16'; teacher_topk 8, expected 32" in reason


def test_encode_teacher_refuses_the_other_kind():
    with pytest.raises(TypeError, match="teacher topk: the backend returned Tensor, expected TopK"):
        encode_teacher(torch.zeros(2, 4), ShardEncoding("float32", "topk", 2, "float16"))
    top = encode_teacher(TopK(torch.tensor([[3, 1, 0]]), torch.tensor([[-0.1, -2.0, -3.0]])),
                         ShardEncoding("float32", "topk", 2, "float32"))  # fmt: skip
    assert top["teacher_topk_ids"].tolist() == [[3, 1]] and top["teacher_topk_ids"].dtype == torch.int32


def _train(tmp_path, name, encoding):
    run = write_tiny_run(tmp_path / name, num_samples=24, per_shard=8, encoding=encoding)
    job = tiny_job(run, tmp_path / name / "out", num_epochs=4, global_batch_size=8, max_steps=8)
    job_path = tmp_path / name / "job.json"
    job_path.write_text(job.model_dump_json())
    return [m["loss"] for m in run_trainer(job_path, nproc=None)[1]]


def test_training_from_a_full_topk_teacher_follows_the_dense_losses_and_float8_topk_trains(tmp_path):
    dense = _train(tmp_path, "dense", ShardEncoding())
    full_topk = _train(tmp_path, "topk-all", ShardEncoding("float32", "topk", 64, "float32"))  # K = the vocab
    torch.testing.assert_close(torch.tensor(full_topk), torch.tensor(dense), atol=1e-4, rtol=1e-4)
    small = _train(tmp_path, "fp8-topk8", ShardEncoding("float8_e4m3", "topk", 8, "float16"))
    assert len(small) == len(dense) == 8 and small[-1] < 0.8 * small[0], small
