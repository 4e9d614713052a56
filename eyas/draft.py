"""The EAGLE-3 draft model (Llama style) and its training-time test (TTT) unroll.

Alignment: for a sample with tokens x_0..x_{L-1}, target aux features f_t and target logits z_t
(z_t predicts x_{t+1}), unroll step k at index t takes token x_{t+k+1} and, as hidden input,
fc(f_t) at step 0 or the draft's own step-(k-1) output at index t afterwards; it sits at
position t+k and is trained towards softmax(z_{t+k+1}) restricted to the draft vocab.
Attention at step k sees step-0 keys causally (indices <= t) and the keys of steps 1..k at its
own index only: exactly what a chain draft sees at inference, where drafted positions follow
the prefix that the target has verified.

State-dict keys (the eyas format): embed_tokens.weight, fc.weight, midlayer.{input_layernorm,
hidden_norm, post_attention_layernorm}.weight, midlayer.self_attn.{q,k,v,o}_proj.weight,
midlayer.mlp.{gate,up,down}_proj.weight, norm.weight, lm_head.weight, and buffers d2t, t2d (a draft of
num_layers > 1 has layers.{i}.* in place of midlayer.*: eyas.draft_keys.layer_prefixes); with the
draft options (DRAFT_OPTIONS, all off in a plain EAGLE-3 draft) also input_norm.weight (norm_before_fc)
and fc_norm.{i}.weight (fc_norm). The options, as speculators' Eagle3DraftModel runs them:
- norm_before_fc: one RMSNorm over the concatenated n_aux*H aux input, before fc;
- fc_norm: one RMSNorm per aux chunk of H, before fc (EAGLE 3.1);
- norm_before_residual: the layer's residual is the normed hidden input instead of the raw one;
- norm_output: the hidden state fed to the next unroll step is norm(h) instead of h (logits are
  lm_head(norm(h)) either way).
eyas trains the variants of eyas.config.DRAFT_VARIANTS (draft.variant: eagle3, eagle3.1 = fc_norm +
norm_output, norm_before_fc); norm_before_residual exists so that a foreign checkpoint that has it runs as
trained.

A stack of num_layers decoder layers runs as SGLang (>= 0.5.12) LlamaModel does (llama_eagle3.py): layer 0 takes
cat(input_layernorm(embeds), hidden_norm(h)) into a 2H-wide qkv; each later layer has no input_layernorm and
no embeds: its hidden_norm is the input norm over the running residual sum, into an H-wide qkv (a plain Llama
layer). Every layer keeps its own keys and values of the unroll steps; the final norm, logits and the state fed
to the next step are those of the last layer's output.

Inference (the reference engine, eyas.bench.proposers): `Eagle3Draft.decode` runs the same layers on one
sequence through a DraftKVCache, where slot = position. For a chain, step 0 fills slots 0..m-1 and step k >= 1 at
the last index fills slot m-1+k, so the keys a query sees (every filled slot up to its own) are exactly the ones
`unroll`'s step k sees at that index: step-0 keys causally and its own steps 1..k. `unroll`, `step` and
training (eyas.objective.ttt_loss) do not use it. Training attention never forms the [T, T] scores: the causal
block runs through a fused kernel and the unroll steps' own keys are merged through its log-sum-exp
(eyas.attention).
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from eyas.attention import IMPLEMENTATIONS, attention_scale, ttt_attention
from eyas.draft_keys import DRAFT_OPTIONS


@dataclass(frozen=True)
class DraftArch:
    hidden_size: int
    num_aux: int
    target_vocab_size: int
    draft_vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_before_residual: bool = False
    norm_output: bool = False
    num_layers: int = 1

    def options(self) -> tuple[str, ...]:
        """The draft options this architecture turns on (DRAFT_OPTIONS order)."""
        return tuple(name for name in DRAFT_OPTIONS if getattr(self, name))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict, *, where: str) -> "DraftArch":
        """A DraftArch from a dict with every required field and no unknown one; `where` names the source."""
        names = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING}
        missing, unknown = sorted(required - set(data)), sorted(set(data) - names)
        if missing or unknown:
            raise ValueError(
                f"{where}: arch has missing fields {missing} and unknown fields {unknown}; "
                f"expected the fields of DraftArch {sorted(names)}"
            )
        return cls(**data)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x.to(dtype)).to(dtype)  # the input's dtype (bf16 under autocast), as SGLang's kernel


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_angles(positions: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    """The rotary angles [B, 1, T, d] of integer positions [B, T] (HF Llama layout)."""
    d = head_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=positions.device) / d))
    freqs = positions.to(torch.float32)[..., None] * inv_freq  # [B, T, d/2]
    return torch.cat((freqs, freqs), dim=-1)[:, None]


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of x [B, h, T, d] at integer positions [B, T] (HF Llama layout)."""
    emb = rope_angles(positions.to(x.device), x.shape[-1], theta)
    return (x * emb.cos().to(x.dtype)) + (rotate_half(x) * emb.sin().to(x.dtype))


class Attention(nn.Module):
    def __init__(self, a: DraftArch, width: int):
        super().__init__()
        self.a = a
        self.q_proj = nn.Linear(width, a.num_attention_heads * a.head_dim, bias=False)
        self.k_proj = nn.Linear(width, a.num_key_value_heads * a.head_dim, bias=False)
        self.v_proj = nn.Linear(width, a.num_key_value_heads * a.head_dim, bias=False)
        self.o_proj = nn.Linear(a.num_attention_heads * a.head_dim, a.hidden_size, bias=False)
        self.impl = "fused"  # eyas.attention.IMPLEMENTATIONS; Eagle3Draft.set_attention

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, n, self.a.head_dim).transpose(1, 2)

    def forward(self, x, positions, earlier: list, valid: torch.Tensor | None):
        """x [B,T,2H] (first layer) or [B,T,H]; earlier: this layer's (k, v) of the earlier unroll steps, step 0's
        first; valid [B,T] bool (right padding). Returns (output [B,T,H], this step's (k, v)): the caller keeps the
        steps' keys (a wrapper such as FSDP2 may hand the module copies of its arguments, so nothing is appended to
        them here). Attention itself: eyas.attention.ttt_attention."""
        a = self.a
        q = rope(self._heads(self.q_proj(x), a.num_attention_heads), positions, a.rope_theta)
        k = rope(self._heads(self.k_proj(x), a.num_key_value_heads), positions, a.rope_theta)
        # a copy, not a view: the step returns v to its caller, and FSDP2 warns of views leaving a wrapped module
        v = self._heads(self.v_proj(x), a.num_key_value_heads).clone(memory_format=torch.contiguous_format)
        out = ttt_attention(q, [*earlier, (k, v)], attention_scale(a.head_dim), valid, self.impl)
        b, tlen = x.shape[:2]
        return self.o_proj(out.transpose(1, 2).reshape(b, tlen, -1)), (k, v)

    def decode(self, x, cache: DraftKVCache, layer: int) -> torch.Tensor:
        """Inference: x [1,T,W] at the next T slots of `cache` (slot = position), each attending to every slot up
        to its own; writes this layer's keys and values of those slots into the cache."""
        a, tlen = self.a, x.shape[1]
        start, end = cache.length, cache.length + tlen
        cos, sin = cache.cos[:, :, start:end], cache.sin[:, :, start:end]
        q = self._heads(self.q_proj(x), a.num_attention_heads)
        k = self._heads(self.k_proj(x), a.num_key_value_heads)
        keys, values = cache.keys[layer], cache.values[layer]
        keys[:, :, start:end] = k * cos + rotate_half(k) * sin
        values[:, :, start:end] = self._heads(self.v_proj(x), a.num_key_value_heads)
        mask = None
        if tlen > 1:  # a single query may see every filled slot; a chunk is causal within itself
            mask = torch.arange(end, device=x.device) <= torch.arange(start, end, device=x.device)[:, None]
        out = F.scaled_dot_product_attention(
            q * cos + rotate_half(q) * sin, keys[:, :, :end], values[:, :, :end], attn_mask=mask, enable_gqa=True
        )
        return self.o_proj(out.transpose(1, 2).reshape(1, tlen, -1))


class MLP(nn.Module):
    def __init__(self, a: DraftArch):
        super().__init__()
        self.gate_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.up_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """The first layer (embeds and hidden in, 2H-wide qkv) or a later one (hidden only, H-wide qkv)."""

    def __init__(self, a: DraftArch, first: bool = True):
        super().__init__()
        self.first = first
        if first:
            self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.hidden_norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = Attention(a, (2 if first else 1) * a.hidden_size)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = MLP(a)
        self.norm_before_residual = a.norm_before_residual and first

    def forward(self, embeds, hidden, positions, earlier, valid):
        """Returns (the layer's output residual sum [B,T,H], this step's (k, v)); `embeds` is read by the first
        layer only; `earlier`: the layer's (k, v) of the earlier unroll steps (Attention.forward)."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1) if self.first else normed
        attended, kv = self.self_attn(x, positions, earlier, valid)
        hidden = residual + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden)), kv

    def decode(self, embeds, hidden, cache: DraftKVCache, layer: int):
        """forward at inference: the same layer, its attention through the slots of `cache` (Attention.decode)."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1) if self.first else normed
        hidden = residual + self.self_attn.decode(x, cache, layer)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Draft(nn.Module):
    def __init__(self, arch: DraftArch):
        super().__init__()
        a = self.arch = arch
        self.embed_tokens = nn.Embedding(a.target_vocab_size, a.hidden_size)
        if a.norm_before_fc:
            self.input_norm = RMSNorm(a.num_aux * a.hidden_size, a.rms_norm_eps)
        if a.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(a.hidden_size, a.rms_norm_eps) for _ in range(a.num_aux))
        self.fc = nn.Linear(a.num_aux * a.hidden_size, a.hidden_size, bias=False)
        if a.num_layers == 1:
            self.midlayer = DecoderLayer(a)
        else:
            self.layers = nn.ModuleList(DecoderLayer(a, first=i == 0) for i in range(a.num_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.lm_head = nn.Linear(a.hidden_size, a.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(a.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(a.target_vocab_size, dtype=torch.bool))

    def decoder_layers(self) -> list[DecoderLayer]:
        """The decoder layers in order (midlayer alone, or layers.0..n-1)."""
        return [self.midlayer] if self.arch.num_layers == 1 else list(self.layers)

    def new_cache(self) -> list[list]:
        """An empty unroll cache: one list of per-step (k, v) for each decoder layer."""
        return [[] for _ in range(self.arch.num_layers)]

    def set_attention(self, impl: str) -> None:
        """The training attention of every layer: fused (default), blockwise or eager (eyas.attention)."""
        if impl not in IMPLEMENTATIONS:
            raise ValueError(f"draft attention {impl!r}: expected one of {IMPLEMENTATIONS}")
        for layer in self.decoder_layers():
            layer.self_attn.impl = impl

    def freeze_embeddings(self) -> None:
        self.embed_tokens.weight.requires_grad_(False)

    def project(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        width = aux_hidden.shape[-1]
        expected = self.arch.num_aux * self.arch.hidden_size
        if width != expected:
            raise ValueError(
                f"draft input: aux hidden width {width}, expected {expected} "
                f"({self.arch.num_aux} layers x {self.arch.hidden_size}); the target did not return "
                f"the aux hidden states of {self.arch.num_aux} layers concatenated"
            )
        if self.arch.norm_before_fc:
            aux_hidden = self.input_norm(aux_hidden)
        if self.arch.fc_norm:
            chunks = aux_hidden.chunk(self.arch.num_aux, dim=-1)
            aux_hidden = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        return self.fc(aux_hidden)

    def step(self, input_ids, hidden, positions, cache, valid=None) -> torch.Tensor:
        """One unroll step: returns the output hidden [B,T,H] that the next step takes as input (pre-norm,
        or normed with norm_output); `logits` of it are this step's draft logits. `cache` is new_cache()'s,
        carried across the steps."""
        embeds = self.embed_tokens(input_ids)
        for layer, layer_cache in zip(self.decoder_layers(), cache, strict=True):
            hidden, kv = layer(embeds, hidden, positions, layer_cache, valid)
            layer_cache.append(kv)
        return self.norm(hidden) if self.arch.norm_output else hidden

    def decode(self, input_ids: torch.Tensor, hidden: torch.Tensor, cache: DraftKVCache) -> torch.Tensor:
        """`step` at inference, for one sequence: input_ids [1,T] and hidden [1,T,H] fill the next T slots of `cache`
        (their positions), each attending causally to all slots before it; returns the output hidden [1,T,H] as
        `step` does. Inference only: the cache's buffers are written in place (run it under torch.no_grad())."""
        cache.reserve(cache.length + input_ids.shape[1])
        embeds = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.decoder_layers()):
            hidden = layer.decode(embeds, hidden, cache, i)
        cache.length += input_ids.shape[1]
        return self.norm(hidden) if self.arch.norm_output else hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits of a step's output hidden (already normed with norm_output)."""
        return self.lm_head(hidden if self.arch.norm_output else self.norm(hidden))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def unroll(self, input_ids, aux_hidden, num_steps: int, valid=None):
        """TTT unroll over a batch. input_ids [B,L] are x_0..x_{L-1}; yields (k, draft logits [B,T,Vd])
        with T = L-1 where index t of step k predicts x_{t+k+2} (its target is z_{t+k+1})."""
        tlen = input_ids.shape[1] - 1
        hidden = self.project(aux_hidden[:, :tlen])
        cache = self.new_cache()
        for k in range(num_steps):
            ids, positions = unroll_inputs(input_ids, k)
            hidden = self.step(ids, hidden, positions, cache, None if valid is None else valid[:, :tlen])
            yield k, self.logits(hidden)


def unroll_inputs(input_ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Unroll step k's token ids [B,T] (x_{t+k+1} at index t, 0 past the end) and positions [B,T] (t + k)."""
    b, tlen = input_ids.shape[0], input_ids.shape[1] - 1
    ids = torch.zeros(b, tlen, dtype=torch.int64, device=input_ids.device)
    ids[:, : max(tlen - k, 0)] = input_ids[:, k + 1 :]
    return ids, torch.arange(k, tlen + k, device=input_ids.device).expand(b, tlen)


class DraftKVCache:
    """The keys and values of a draft's decoder layers at inference (`Eagle3Draft.decode`), by slot = position.

    Per decoder layer: keys (rotary embedding applied) and values [1, kv_heads, capacity, head_dim]; with them
    the rotary cos/sin of every slot, computed once. Slots 0..length-1 are filled; `crop` drops the slots after a
    length, `reserve` doubles the capacity when a decode needs more (copying the filled slots once)."""

    def __init__(self, draft: Eagle3Draft, capacity: int = 256):
        self.arch, self.length = draft.arch, 0
        self.weight = draft.fc.weight  # dtype and device of the buffers
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.cos = self.sin = torch.empty(0)
        self._allocate(capacity)

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def _allocate(self, capacity: int) -> None:
        a, w, n = self.arch, self.weight, self.length
        shape = (1, a.num_key_value_heads, capacity, a.head_dim)
        for buffers in (self.keys, self.values):
            old = list(buffers)
            buffers[:] = [w.new_empty(shape) for _ in range(a.num_layers)]
            for new, filled in zip(buffers, old):
                new[:, :, :n] = filled[:, :, :n]
        emb = rope_angles(torch.arange(capacity, device=w.device)[None], a.head_dim, a.rope_theta)
        self.cos, self.sin = emb.cos().to(w.dtype), emb.sin().to(w.dtype)

    def reserve(self, length: int) -> None:
        """Room for `length` slots."""
        if length > self.capacity:
            self._allocate(max(length, 2 * self.capacity))

    def crop(self, length: int) -> None:
        """Keep the first `length` slots (0 <= length <= self.length)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"DraftKVCache.crop({length}): expected 0..{self.length}, the filled slots")
        self.length = length


def build_draft(arch: DraftArch, embed_weight: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor, seed: int = 0):
    """A fresh draft: random trainable weights, embed_tokens copied from the target and frozen."""
    torch.manual_seed(seed)
    draft = Eagle3Draft(arch)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(embed_weight)
        draft.d2t.copy_(d2t)
        draft.t2d.copy_(t2d)
    draft.freeze_embeddings()
    return draft
