"""Each draft variant (draft.variant) against SGLang 0.5.23's own forward: an implementation written in this file
from `sglang/srt/models/llama_eagle3.py` of the 0.5.23 wheel (lines cited), run on the SGLang export the way
SGLang loads it, next to eyas's training unroll and eyas's reference engine loader on the same weights. A change
on either side (what is normed before fc, what is fed back between draft steps) fails here."""

from __future__ import annotations

import json
import math

import pytest
import torch
from draft_fixtures import ARCH, write_checkpoint
from safetensors.torch import load_file

from eyas.config import DRAFT_VARIANTS, RunConfig, load_run_config, variant_of
from eyas.draft import DraftArch, Eagle3Draft
from eyas.export.convert import export_checkpoint
from eyas.export.reader import load_exported_draft
from eyas.export.serving import check_variant_served
from eyas.train.checkpoint import read_checkpoint


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm.forward_native (sglang/srt/layers/layernorm.py:828-877): float32 variance, x * rsqrt(var + eps),
    times the weight."""
    x = x.float()
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope_neox(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """get_rope(..., is_neox_style=True) of LlamaAttention (sglang/srt/models/llama.py:225-246): the two halves
    of each head rotated by position * theta^(-2i/d). x [T, heads, d]."""
    d = x.shape[-1]
    freqs = positions.float()[:, None] * theta ** (-torch.arange(0, d, 2).float() / d)  # [T, d/2]
    cos, sin = freqs.cos()[:, None], freqs.sin()[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class SGLangDraft:
    """LlamaForCausalLMEagle3 of SGLang 0.5.23 on one sequence, from an export directory."""

    def __init__(self, export_dir, embed: torch.Tensor):
        config = json.loads((export_dir / "config.json").read_text())
        eagle = config.get("eagle_config") or {}
        self.c = config
        # LlamaModel.__init__ :166-168 norm_before_fc (eagle_config, else the top level); :184-186 fc_norm or
        # the legacy use_aux_norm; :207 norm_output; :156-160 num_aux from eagle_aux_hidden_state_layer_ids
        self.norm_before_fc = bool(eagle.get("norm_before_fc", config.get("norm_before_fc", False)))
        self.fc_norm = bool(config.get("fc_norm") or config.get("use_aux_norm", False))
        self.norm_output = bool(config.get("norm_output", False))
        self.num_aux = len(eagle["eagle_aux_hidden_state_layer_ids"])
        weights = {}
        legacy = {"midlayer": "layers.0", "aux_norm_low": "fc_norm.0", "aux_norm_mid": "fc_norm.1",
                  "aux_norm_high": "fc_norm.2"}  # fmt: skip
        for name, tensor in load_file(export_dir / "model.safetensors").items():
            for old, new in legacy.items():  # load_weights :338-347: legacy names replaced by substring
                if old in name:
                    name = name.replace(old, new)
            weights[name] = tensor.float()
        self.w, self.embed = weights, embed.float()
        self.num_layers = config["num_hidden_layers"]  # :198-204 model.layers, one per num_hidden_layers
        self.kv: list[list] = [[] for _ in range(self.num_layers)]  # per layer, per position: (k, v)

    def _attention(self, i: int, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """LlamaAttention of layer i over its cache of earlier positions and these, causally (RadixAttention)."""
        c, w, kv = self.c, self.w, self.kv[i]
        heads, kv_heads, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        p, t = f"layers.{i}.self_attn.", x.shape[0]
        q = rope_neox((x @ w[p + "q_proj.weight"].T).view(t, heads, d), positions, c["rope_theta"])
        k = rope_neox((x @ w[p + "k_proj.weight"].T).view(t, kv_heads, d), positions, c["rope_theta"])
        v = (x @ w[p + "v_proj.weight"].T).view(t, kv_heads, d)
        past = len(kv)
        kv += list(zip(k, v, strict=True))
        keys = torch.stack([kk for kk, _ in kv]).repeat_interleave(heads // kv_heads, dim=1)  # [S, h, d]
        values = torch.stack([vv for _, vv in kv]).repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("thd,shd->hts", q, keys) / math.sqrt(d)
        allowed = torch.arange(len(kv))[None, :] <= (past + torch.arange(t))[:, None]
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        out = torch.einsum("hts,shd->thd", probs, values).reshape(t, heads * d)
        return out @ w[p + "o_proj.weight"].T

    def _layer(self, i: int, positions, embeds, hidden_states, residual):
        """LlamaDecoderLayer.forward :88-119: layer 0 (is_input_layer, :63-64 2H-wide qkv) norms the embeds and
        the hidden state and concatenates them; a later layer fuses the residual add into hidden_norm (:103-105)."""
        w, eps, p = self.w, self.c["rms_norm_eps"], f"layers.{i}."
        if i == 0:
            residual = hidden_states  # :99
            hidden_states = rms(hidden_states, w[p + "hidden_norm.weight"], eps)  # :100
            embeds = rms(embeds, w[p + "input_layernorm.weight"], eps)  # :101
            hidden_states = torch.cat([embeds, hidden_states], dim=-1)  # :102
        else:
            residual = hidden_states + residual  # :105 hidden_norm(hidden_states, residual): fused add
            hidden_states = rms(residual, w[p + "hidden_norm.weight"], eps)
        hidden_states = self._attention(i, hidden_states, positions)  # :108-112
        residual = hidden_states + residual  # :114 post_attention_layernorm(hidden_states, residual): fused add
        hidden_states = rms(residual, w[p + "post_attention_layernorm.weight"], eps)
        m = w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"], w[p + "mlp.down_proj.weight"]
        hidden_states = (torch.nn.functional.silu(hidden_states @ m[0].T) * (hidden_states @ m[1].T)) @ m[2].T  # :117
        return hidden_states, residual  # :119

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor):
        """LlamaModel.forward :209-270 over every decoder layer (:253-261), then the draft logits of
        LlamaForCausalLMEagle3 (lm_head of the normed state). Returns (logits, the state handed to the next draft
        step)."""
        w, eps = self.w, self.c["rms_norm_eps"]
        embeds = self.embed[input_ids]
        if hidden_states.shape[-1] != embeds.shape[-1]:  # :238 target features: fc (and its norms) first
            if self.norm_before_fc:
                hidden_states = rms(hidden_states, w["input_norm.weight"], eps)  # :239-240
            if self.fc_norm:  # :241-246 one norm per aux chunk
                chunks = hidden_states.chunk(self.num_aux, dim=-1)
                hidden_states = torch.cat([rms(ch, w[f"fc_norm.{i}.weight"], eps) for i, ch in enumerate(chunks)], -1)
            hidden_states = hidden_states.float() @ w["fc.weight"].T  # :247
        residual = None  # :253
        for i in range(self.num_layers):  # :254-261
            hidden_states, residual = self._layer(i, positions, embeds, hidden_states, residual)
        residual = hidden_states + residual  # :263-265 self.norm(hidden_states, residual): fused add
        to_logits = rms(residual, w["norm.weight"], eps)
        aux = to_logits if self.norm_output else residual  # :268
        return to_logits @ w["lm_head.weight"].T, aux


def _draft_of(tmp_path, variant: str, num_layers: int = 1):
    """A checkpoint of `variant` with every norm weight (fc_norm and input_norm too) away from one, exported to
    SGLang 0.5.23 (a stack of layers in format sglang-0.5.12, layers.{i}.*)."""
    arch = DraftArch(**{**ARCH.to_dict(), **{o: True for o in DRAFT_VARIANTS[variant]}, "num_layers": num_layers})
    g = torch.Generator().manual_seed(11)

    def perturb(state):
        for k in state:
            if "norm" in k:
                state[k] = 1 + 0.3 * torch.randn(state[k].shape, generator=g)

    name = f"{variant}-{num_layers}"
    ckpt = write_checkpoint(tmp_path / f"ckpt-{name}", arch, state_edit=perturb)
    fmt = "sglang" if num_layers == 1 else "sglang-0.5.12"
    out = export_checkpoint(ckpt, tmp_path / f"sglang-{name}", to=fmt, sglang_version="0.5.23")
    return arch, ckpt, out


SEQ = [7, 300, 41, 1999, 5, 812, 64, 1200, 77, 3]
AT, STEPS = 4, 3  # the chain drafted from index AT (the verified prefix is SEQ[:AT + 2]) and its length


def _sglang_chain(export_dir, embed, aux: torch.Tensor, norm_output=None, num_layers=None) -> list[torch.Tensor]:
    """SGLang's draft on the verified prefix (draft extend: token x_{t+1} with the target's features at t, positions
    0..AT), then STEPS-1 decode steps, each fed the previous step's state and the next token of SEQ."""
    model = SGLangDraft(export_dir, embed)
    if norm_output is not None:
        model.norm_output = norm_output
    if num_layers is not None:
        model.num_layers = num_layers
    ids = torch.tensor(SEQ)
    logits, state = model.forward(ids[1 : AT + 2], torch.arange(AT + 1), aux[: AT + 1])
    out, hidden = [logits[-1]], state[-1:]
    for k in range(1, STEPS):
        logits, hidden = model.forward(ids[AT + k + 1 : AT + k + 2], torch.tensor([AT + k]), hidden)
        out.append(logits[-1])
    return out


def _eyas_chain(draft: Eagle3Draft, aux: torch.Tensor) -> list[torch.Tensor]:
    """eyas's TTT unroll (what training optimizes) at index AT, step by step."""
    with torch.no_grad():
        return [logits[0, AT].float() for _, logits in draft.unroll(torch.tensor([SEQ]), aux[None], STEPS)]


@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("variant", sorted(DRAFT_VARIANTS))
def test_each_variant_runs_as_sglang_0_5_23_runs_it(tmp_path, variant, num_layers):
    arch, ckpt_dir, export_dir = _draft_of(tmp_path, variant, num_layers)
    ckpt = read_checkpoint(ckpt_dir)
    embed = ckpt.state["embed_tokens.weight"]
    aux = torch.randn(len(SEQ), arch.num_aux * arch.hidden_size, generator=torch.Generator().manual_seed(5))
    trained = Eagle3Draft(arch)
    trained.load_state_dict(ckpt.state)
    served = load_exported_draft(export_dir, embed.float())  # the reference engine's draft, from the export
    assert variant_of(served.arch.options()) == variant and served.arch.num_layers == num_layers
    expected = _sglang_chain(export_dir, embed, aux)
    for name, draft in (("training unroll", trained), ("reference engine", served)):
        for k, (ours, theirs) in enumerate(zip(_eyas_chain(draft, aux), expected, strict=True)):
            assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-5), (variant, name, k, (ours - theirs).abs().max())


def test_the_pin_tells_the_fed_back_state_and_the_norms_apart(tmp_path):
    """The comparison above could fail: norm_output changes the steps after the first, the fc norms the first."""
    arch, ckpt_dir, export_dir = _draft_of(tmp_path, "eagle3.1")
    embed = read_checkpoint(ckpt_dir).state["embed_tokens.weight"]
    aux = torch.randn(len(SEQ), arch.num_aux * arch.hidden_size, generator=torch.Generator().manual_seed(5))
    normed, raw = _sglang_chain(export_dir, embed, aux), _sglang_chain(export_dir, embed, aux, norm_output=False)
    assert torch.equal(normed[0], raw[0]) and (normed[1] - raw[1]).abs().max() > 1e-2
    plain = _sglang_chain(_draft_of(tmp_path, "eagle3")[2], embed, aux)
    assert (plain[0] - normed[0]).abs().max() > 1e-2


def test_a_variant_is_refused_before_any_stage_spends_time_for_servers_that_drop_it(tiny_target_dir):
    """Before any GPU time is spent: a variant the export's SGLang servers would run without its norms."""
    base = load_run_config(tiny_target_dir.parents[1] / "deployments" / "tiny-cpu.json").model_dump()

    def config(variant, version=""):
        run = RunConfig.model_validate(
            {
                **base,
                "draft": {**base["draft"], "variant": variant},
                "export": {**base["export"], "sglang_version": version},
            }
        )
        check_variant_served(run)  # what resolve-run-facts does first in every flow
        return run

    with pytest.raises(ValueError, match=r"draft.variant='eagle3.1' turns on fc_norm, norm_output, which SGLang runs "
                       r"from 0.5.12; .*from 0.5.10.*set export.sglang_version to 0.5.12 or newer"):  # fmt: skip
        config("eagle3.1")
    with pytest.raises(ValueError, match=r"'norm_before_fc' turns on norm_before_fc, which SGLang runs from 0.5.17"):
        config("norm_before_fc", "0.5.12")
    options = ("norm_before_fc", "fc_norm", "norm_output")
    fields = config("eagle3.1", "0.5.12").draft.arch_fields()
    assert {k: v for k, v in fields.items() if k in options} == {"fc_norm": True, "norm_output": True}
    assert "variant" not in fields and fields["head_dim"] == base["draft"]["head_dim"]
    assert config("norm_before_fc", "0.5.23").draft.arch_fields()["norm_before_fc"] is True
    assert not set(options) & set(config("eagle3").draft.arch_fields())


def test_a_trained_eagle3_1_draft_learns_its_norms_and_exports_them_for_the_servers_that_run_them(tmp_path):
    """A real training run of draft.variant eagle3.1: the checkpoint records the options and trains the per-aux
    norms; the export for SGLang 0.5.23 writes the flags and fc_norm.{i} where SGLang reads them; an export for
    every release (0.5.10 on) is refused, naming the version that serves it."""
    from run_fixtures import run_trainer, tiny_job, write_tiny_run

    from eyas.export.convert import ExportError
    from eyas.export.inspect import inspect_drafter
    from eyas.train.checkpoint import latest_complete

    run = write_tiny_run(tmp_path / "run", num_samples=16)
    job = tiny_job(run, tmp_path / "out", max_steps=4, save_every_steps=4, num_processes=1)
    job = job.model_copy(update={"draft": job.draft.model_copy(update={"variant": "eagle3.1"})})
    (tmp_path / "job.json").write_text(job.model_dump_json())
    run_trainer(tmp_path / "job.json", nproc=None)
    ckpt_dir = latest_complete(tmp_path / "out")
    ckpt = read_checkpoint(ckpt_dir)
    assert ckpt.arch.options() == ("fc_norm", "norm_output")
    for i in range(ckpt.arch.num_aux):
        assert not torch.equal(ckpt.state[f"fc_norm.{i}.weight"], torch.ones(ckpt.arch.hidden_size))  # trained
    out = export_checkpoint(ckpt_dir, tmp_path / "sglang", to="sglang", sglang_version="0.5.23")
    config = json.loads((out / "config.json").read_text())
    assert (config["fc_norm"], config["norm_output"]) == (True, True) and "norm_before_fc" not in config
    exported = load_file(out / "model.safetensors")
    assert all(torch.equal(exported[f"fc_norm.{i}.weight"], ckpt.state[f"fc_norm.{i}.weight"]) for i in range(3))
    report = inspect_drafter(out)  # eyas inspect: the variant, and which engine versions serve it
    assert report.variant == "eagle3.1" and "  draft variant: eagle3.1" in report.text
    assert report.engines["sglang>=0.5.12"] and report.engines["sglang>=0.5.17"]
    assert not report.engines["sglang<=0.5.11"] and not report.engines["vllm"]
    assert inspect_drafter(ckpt_dir).variant == "eagle3.1"
    with pytest.raises(
        ExportError, match=r"fc_norm: served by SGLang from 0.5.12; this export is for SGLang >= 0.5.10"
    ):
        export_checkpoint(ckpt_dir, tmp_path / "old", to="sglang")


def test_the_pin_tells_a_stack_from_its_first_layer(tmp_path):
    """The second layer of a stack changes every step (so the 2-layer pin above compares something)."""
    arch, ckpt_dir, export_dir = _draft_of(tmp_path, "eagle3", num_layers=2)
    embed = read_checkpoint(ckpt_dir).state["embed_tokens.weight"]
    aux = torch.randn(len(SEQ), arch.num_aux * arch.hidden_size, generator=torch.Generator().manual_seed(5))
    both = _sglang_chain(export_dir, embed, aux)
    model = SGLangDraft(export_dir, embed)
    assert model.num_layers == 2
    first_only = _sglang_chain(export_dir, embed, aux, num_layers=1)
    assert all((a - b).abs().max() > 1e-2 for a, b in zip(both, first_only, strict=True))


def test_a_two_layer_draft_trains_exports_as_a_stack_and_is_refused_where_it_would_not_run(tmp_path, tiny_target_dir):
    """A real training run of draft.num_layers 2: layer 1 has no input_layernorm and an H-wide qkv; the export to
    format sglang-0.5.12 writes layers.{0,1}.* and num_hidden_layers 2; eyas inspect says which engines run the
    stack; format sglang (midlayer.*, every release) and SGLang 0.5.11 are refused, naming the fix; the module
    table of the approval gate lists both layers."""
    from run_fixtures import run_trainer, tiny_job, write_tiny_run

    from eyas.export.convert import ExportError
    from eyas.export.inspect import inspect_drafter
    from eyas.export.remap import remap_checkpoint
    from eyas.train.checkpoint import latest_complete
    from eyas.train.modules import module_table

    run = write_tiny_run(tmp_path / "run", num_samples=16)
    job = tiny_job(run, tmp_path / "out", max_steps=4, save_every_steps=4, num_processes=1)
    job = job.model_copy(update={"draft": job.draft.model_copy(update={"num_layers": 2, "variant": "eagle3.1"})})
    (tmp_path / "job.json").write_text(job.model_dump_json())
    run_trainer(tmp_path / "job.json", nproc=None)
    ckpt_dir = latest_complete(tmp_path / "out")
    ckpt = read_checkpoint(ckpt_dir)
    h = ckpt.arch.hidden_size
    assert ckpt.arch.num_layers == 2 and not any(k.startswith("midlayer.") for k in ckpt.state)
    assert "layers.0.input_layernorm.weight" in ckpt.state and "layers.1.input_layernorm.weight" not in ckpt.state
    assert ckpt.state["layers.0.self_attn.q_proj.weight"].shape[1] == 2 * h
    assert ckpt.state["layers.1.self_attn.q_proj.weight"].shape[1] == h
    assert not torch.equal(ckpt.state["layers.1.hidden_norm.weight"], torch.ones(h))  # trained
    draft = Eagle3Draft(ckpt.arch)
    draft.load_state_dict(ckpt.state)
    rows = [row["module"] for row in module_table(draft)]
    assert rows[:3] == ["embed_tokens", "fc_norm", "fc"] and "layers.1.hidden_norm" in rows
    assert "layers.1.input_layernorm" not in rows and rows[-2:] == ["norm", "lm_head"]

    out = export_checkpoint(ckpt_dir, tmp_path / "stack", to="sglang-0.5.12")
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 2
    exported = load_file(out / "model.safetensors")
    assert {k.split(".")[1] for k in exported if k.startswith("layers.")} == {"0", "1"}
    assert all(torch.equal(exported[k], ckpt.state[k]) for k in exported)
    report = inspect_drafter(out)
    assert report.ok, report.problems
    assert "  config.num_hidden_layers = 2" in report.text
    assert report.engines["sglang>=0.5.12"] and report.engines["sglang>=0.5.17"]
    assert not report.engines["sglang<=0.5.11"] and not report.engines["vllm"]
    assert inspect_drafter(ckpt_dir).ok
    again = remap_checkpoint(out, tmp_path / "again", to="sglang-0.5.12", sglang_version="0.5.23")  # read back
    assert json.loads((again / "config.json").read_text())["num_hidden_layers"] == 2
    assert load_file(again / "model.safetensors").keys() == exported.keys()
    with pytest.raises(ExportError, match=r"num_layers=2: format sglang holds one draft layer"):
        remap_checkpoint(out, tmp_path / "flat-remap", to="sglang", sglang_version="0.5.23")
    with pytest.raises(ExportError, match=r"num_layers=2: format sglang holds one draft layer .*export a stack of "
                       r"draft layers to format sglang-0.5.12 \(layers.\{i\}.\*, served by SGLang >= 0.5.12\)"):  # fmt: skip
        export_checkpoint(ckpt_dir, tmp_path / "flat", to="sglang", sglang_version="0.5.23")
    with pytest.raises(ExportError, match=r"format sglang-0.5.12 with SGLang 0.5.11: expected 0.5.12 or newer"):
        export_checkpoint(ckpt_dir, tmp_path / "old", to="sglang-0.5.12", sglang_version="0.5.11")
    for fmt in ("vllm", "eagle", "speculators"):
        with pytest.raises(
            ExportError, match=r"num_layers=2: .*export a stack of draft layers to format sglang-0.5.12"
        ):
            export_checkpoint(ckpt_dir, tmp_path / fmt, to=fmt)

    base = load_run_config(tiny_target_dir.parents[1] / "deployments" / "tiny-cpu.json").model_dump()
    stacked = {**base, "draft": {**base["draft"], "num_layers": 2, "variant": "eagle3"}}
    with pytest.raises(ValueError, match=r"draft.num_layers with export.format='sglang': num_layers=2"):
        check_variant_served(RunConfig.model_validate({**stacked, "export": {**base["export"], "format": "sglang"}}))
    check_variant_served(RunConfig.model_validate({**stacked, "export": {**base["export"], "format": "sglang-0.5.12"}}))
