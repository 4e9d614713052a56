"""Cross-implementation check: an eyas drafter exported to speculators format runs in speculators' own
EAGLE-3 model class on CPU and gives the same logits as eyas.

speculators is an optional extra (`pip install speculators`); this module skips when it is absent.
It is not installed by `make test`: speculators 0.9 requires torchvision and torchaudio, which
replace the pinned CPU torch 2.13.0 with a CUDA torch 2.14 and the nvidia-* wheels.
"""

from __future__ import annotations

import pytest
import torch
from draft_fixtures import ARCH, write_checkpoint
from safetensors.torch import load_file

from eyas.draft import build_draft
from eyas.export.convert import export_checkpoint, read_checkpoint

speculators = pytest.importorskip(
    "speculators", reason="speculators not installed (optional: it pulls a CUDA torch through torchvision)"
)
eagle3 = pytest.importorskip("speculators.models.eagle3")

# Modules of speculators' model that an EAGLE-3 draft checkpoint does not carry (verifier parts).
SPECULATORS_ONLY_KEYS = {"verifier_norm.weight", "verifier_lm_head.weight"}


def test_speculators_model_gives_eyas_logits(tmp_path):
    ckpt = write_checkpoint(tmp_path / "step-00000010")
    out = export_checkpoint(ckpt, tmp_path / "spec", to="speculators")
    config = eagle3.Eagle3SpeculatorConfig.from_pretrained(out)
    assert config.eagle_aux_hidden_state_layer_ids == [2, 4, 5] and config.draft_vocab_size == 512
    assert not (config.norm_before_residual or config.norm_before_fc or config.norm_output)
    config.transformer_layer_config._attn_implementation = "eager"
    model = eagle3.Eagle3DraftModel(config).eval()
    ours = load_file(out / "model.safetensors")
    theirs = model.state_dict()
    assert set(theirs) - set(ours) == SPECULATORS_ONLY_KEYS and set(ours) <= set(theirs)
    model.load_state_dict({**theirs, **ours}, strict=True)

    source = read_checkpoint(ckpt)
    draft = build_draft(ARCH, source.state["embed_tokens.weight"], source.state["d2t"], source.state["t2d"])
    draft.load_state_dict(source.state, strict=True)
    ids = torch.randint(0, 2048, (1, 10), generator=torch.Generator().manual_seed(0))
    aux = torch.randn(1, 10, 192, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, expected = next(draft.unroll(ids, aux, 1))
        tlen = ids.shape[1] - 1
        hidden = model.fc(aux[:, :tlen])
        x = torch.cat([model.embed_tokens(ids[:, 1:]), hidden], dim=-1)
        positions = torch.arange(tlen)[None]
        mask = model._build_attn_mask(torch.zeros(tlen, dtype=torch.long), tlen, x.device)
        h = model.layers[0](
            x,
            attention_mask=mask,
            position_ids=positions,
            position_embeddings=model.rotary_emb(x, positions),
        )
        h = h[0] if isinstance(h, tuple) else h
        logits = model.lm_head(model.norm(h))
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
