import pytest
import torch

from eyas.dataset.vocab import (
    VocabMappingError,
    build_vocab_mapping,
    check_vocab_mapping,
    count_loss_tokens,
    ensure_vocab,
    load_vocab,
)


def test_counts_only_loss_masked_tokens():
    counts = count_loss_tokens([[1, 2, 2, 3]], [[0, 1, 1, 0]], 5)
    assert counts.tolist() == [0, 0, 2, 0, 0]


def test_top_tokens_sorted_with_ties_to_lower_id():
    counts = torch.tensor([0, 5, 3, 3, 9, 3])
    d2t, t2d = build_vocab_mapping(counts, 4)
    chosen = torch.arange(4) + d2t
    assert chosen.tolist() == [1, 2, 3, 4]  # 4 (9), 1 (5), then 2 and 3 beat 5 on the tie
    assert t2d.nonzero().flatten().tolist() == [1, 2, 3, 4]
    assert d2t.tolist() == [1, 1, 1, 1]


def test_draft_vocab_larger_than_target_is_refused():
    with pytest.raises(VocabMappingError, match=r"draft_vocab_size=7: expected 1..5"):
        build_vocab_mapping(torch.ones(5, dtype=torch.int64), 7)


def test_absolute_ids_instead_of_offsets_are_refused():
    t2d = torch.tensor([False, True, False, True])
    with pytest.raises(VocabMappingError, match=r"where: d2t holds absolute target ids, expected offsets"):
        check_vocab_mapping(torch.tensor([1, 3]), t2d, "where")


def test_t2d_count_must_equal_draft_vocab():
    with pytest.raises(VocabMappingError, match=r"t2d marks 3 target ids, d2t has 2, expected draft_vocab_size=2"):
        check_vocab_mapping(torch.tensor([1, 2]), torch.tensor([False, True, True, True]), "where")


def test_mapping_is_cached_by_content_hash(tmp_path):
    path = tmp_path / "vocab.safetensors"
    ids, masks = [[1, 2, 3, 3]], [[1, 1, 1, 1]]
    assert ensure_vocab(path, ids, masks, "hash-a", 6, 2) is True
    assert ensure_vocab(path, ids, masks, "hash-a", 6, 2) is False
    assert ensure_vocab(path, ids, masks, "hash-b", 6, 2) is True
    d2t, t2d, meta = load_vocab(path)
    assert (torch.arange(2) + d2t).tolist() == [1, 3]  # 3 is most frequent, then 1 beats 2 on the tie
    assert meta["content_hash"] == "hash-b"
