"""The memory plan of a training run: the per-device peak of one optimizer step, before any device is held.

    shape = PlanShape.of_run(config, facts.target)            # or PlanShape(arch=..., ...) directly
    plan = plan_memory(shape, micro_batch_tokens=16384, device_bytes=139 * GIB)
    plan.peak_bytes, plan.fits, plan.rows                     # state, activations, workspace, each named
    tokens = pick_micro_batch_tokens(shape, device_bytes)      # the largest budget that fits (0: none does)

The model follows what one step allocates, tensor by tensor (eyas.objective, eyas.attention, eyas.train.step):

- state: the trainable parameters, their gradients and AdamW's two moments in fp32 (sharded over the ranks by
  FSDP2, which also holds the gathered parameters in the training dtype through forward and backward, and with
  more than one micro-batch the unsharded gradients accumulated in fp32); the frozen embedding and the teacher's
  head rows in the training dtype; under DDP in bf16 autocast's cache of bf16 weights.
- activations, per token of a micro-batch: what autograd keeps of every unroll step (per layer: the norms'
  fp32 inputs and normalized values, the attention input, queries, keys, values, the fused attention's output
  and log-sum-exp, the merge weights, the MLP's four intermediates; per step: the final norm and the
  log-softmax over the draft vocab), and once per micro-batch the teacher's distribution [Vd] in fp32 and the
  batch itself. With activation checkpointing a step keeps only its outputs, and one step is recomputed at a
  time in the backward.
- workspace: the largest transient, at the last step's logits and the first backward ops (logits, the fp32 copy,
  the cross-entropy's product and gradients: about two to three [tokens, Vd] fp32 tensors).

Validated against measured peaks (bench/train_scale.py; tests/test_memory_plan.py): on CPU within 20 % at
several widths, lengths, micro-batch sizes and both parallelisms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from eyas.draft import DraftArch, Eagle3Draft
from eyas.layer_ids import default_aux_layer_ids
from eyas.shards.encoding import ITEMSIZE, ShardEncoding

GIB = 1 << 30
HEADROOM = 0.10  # of the device kept free for the allocator's fragmentation and the runtime (CUDA context, NCCL)
TOKEN_GRANULARITY = 256  # an auto budget is a multiple of this
AUTO_MAX_TOKENS = 4096  # an auto budget holds at most this many tokens, or the longest sample


@dataclass(frozen=True)
class PlanShape:
    """What a training step's memory depends on."""

    arch: DraftArch
    num_ttt_steps: int
    bf16: bool
    parallelism: str  # ddp | fsdp2 | none (the smoke run: one plain process)
    world: int
    checkpointing: bool
    encoding: ShardEncoding
    longest_sample: int  # tokens of the longest (padded) sample a micro-batch must hold
    share_tokens: int  # tokens of a rank's share of a global batch at the longest samples

    @classmethod
    def of_run(cls, config, target, *, world: int | None = None, parallelism: str | None = None) -> "PlanShape":
        """The shape of a RunConfig's training on its target (TargetFacts); the smoke run passes world 1 and
        parallelism "none"."""
        from eyas.shards.encoding import extract_encoding

        t, d = config.train, config.draft
        world = world or t.min_world_size  # at the fewest nodes: the largest share per rank (batch, FSDP2 shards)
        arch = DraftArch(
            hidden_size=target.hidden_size,
            num_aux=len(config.target.aux_layer_ids or default_aux_layer_ids(8)),  # unset: EAGLE-3's three layers
            target_vocab_size=target.vocab_size,
            draft_vocab_size=config.dataset.draft_vocab_size,
            **d.arch_fields(),
        )
        longest = max(min(d.max_position_embeddings, config.dataset.max_length), t.num_ttt_steps + 1)
        return cls(
            arch=arch,
            num_ttt_steps=t.num_ttt_steps,
            bf16=t.backend == "nccl" and t.mixed_precision != "off",
            parallelism=parallelism or t.parallelism,
            world=world,
            checkpointing=t.activation_checkpointing,
            encoding=extract_encoding(config.extract),
            longest_sample=longest,
            share_tokens=math.ceil(t.global_batch_size / world) * longest,
        )


@dataclass
class MemoryPlan:
    shape: PlanShape
    micro_batch_tokens: int
    device_bytes: int
    rows: list[tuple[str, int, str]] = field(default_factory=list)  # (component, bytes, what it is)

    @property
    def peak_bytes(self) -> int:
        return sum(b for _, b, _ in self.rows)

    @property
    def usable_bytes(self) -> int:
        return int(self.device_bytes * (1 - HEADROOM))

    @property
    def fits(self) -> bool:
        return self.micro_batch_tokens >= self.shape.longest_sample and self.peak_bytes <= self.usable_bytes

    def to_dict(self) -> dict:
        return {
            "micro_batch_tokens": self.micro_batch_tokens,
            "peak_bytes": self.peak_bytes,
            "device_bytes": self.device_bytes,
            "usable_bytes": self.usable_bytes,
            "fits": self.fits,
            "rows": [{"component": n, "bytes": b, "what": w} for n, b, w in self.rows],
        }


def param_counts(arch: DraftArch) -> dict[str, int]:
    """Elements of the trainable parameters (total, largest FSDP2 group, largest tensor) and the frozen embedding."""
    with torch.device("meta"):
        draft = Eagle3Draft(arch)
    trainable = {n: p.numel() for n, p in draft.named_parameters() if n != "embed_tokens.weight"}
    layers = [sum(p.numel() for p in layer.parameters()) for layer in draft.decoder_layers()]
    total = sum(trainable.values())
    return {
        "trainable": total,
        "largest_group": max([total - sum(layers), *layers]),
        "largest_tensor": max(trainable.values()),
        "embedding": arch.target_vocab_size * arch.hidden_size,
    }


def state_rows(shape: PlanShape, micro_batches: int) -> list[tuple[str, int, str]]:
    """The parameters, gradients, optimizer state and frozen tensors of one rank."""
    a, counts = (2 if shape.bf16 else 4), param_counts(shape.arch)
    p, w = counts["trainable"], shape.world
    vd, h = shape.arch.draft_vocab_size, shape.arch.hidden_size
    rows = [
        ("frozen embedding", counts["embedding"] * a, "the target's embedding, training dtype, whole on every rank"),
        ("teacher head rows", vd * h * a, "the target's lm_head rows of the draft vocab, training dtype"),
    ]
    if shape.parallelism == "fsdp2":
        rows += [
            ("parameters (sharded)", 4 * p // w, f"fp32 master weights, 1/{w} per rank"),
            ("gradients (sharded)", 4 * p // w, "fp32, reduce-scattered"),
            ("optimizer state (sharded)", 8 * p // w, "AdamW exp_avg and exp_avg_sq, fp32"),
            ("gathered parameters", p * a, "every group gathered from its first forward to its backward"),
            (
                "unsharded gradients",
                4 * p if micro_batches > 1 else counts["largest_group"] * (a + 4),
                "accumulated in fp32 between micro-batches" if micro_batches > 1 else "one group before its reduce",
            ),
        ]
    else:
        rows += [
            ("parameters", 4 * p, "fp32 master weights, a full replica per rank"),
            ("gradients", 4 * p, "fp32 (DDP: the gradient buckets themselves)"),
            ("optimizer state", 8 * p, "AdamW exp_avg and exp_avg_sq, fp32"),
        ]
        if shape.bf16:
            rows.append(("autocast weight cache", 2 * p, "bf16 copies of the weights during forward and backward"))
    return rows


def _rmsnorm(a: int) -> int:
    """Bytes per element an RMSNorm keeps for its backward: the fp32 input (a copy when it is bf16) and the
    normalized value in the input's dtype (the fp32 input itself when it is fp32)."""
    return 4 if a == 4 else 4 + a


def step_bytes_per_token(shape: PlanShape, k: int) -> int:
    """What autograd keeps of unroll step k, per token (all layers, the final norm and the log-softmax)."""
    x, a = shape.arch, (2 if shape.bf16 else 4)
    hd, kvd, h, d = (
        x.num_attention_heads * x.head_dim,
        x.num_key_value_heads * x.head_dim,
        x.num_attention_heads,
        x.head_dim,
    )
    attention = (hd + 2 * kvd) * a + 4 * d * a + hd * a + 4 * h + hd * a  # q, k, v; rotary cos/sin; out; lse; o_proj in
    if k:  # the merge with the unroll steps' own keys: stacked scores, their log-sum-exp, the weights
        attention += (k + 1) * h * 4 + h * 4 + (k + 1) * h * 4 + ((k + 1) * h * a if a != 4 else 0)
    mlp = 4 * x.intermediate_size * a
    residuals = 2 * x.hidden_size * a + (_rmsnorm(a) + a) * x.hidden_size  # mid, out; post-attention norm + out
    first = x.hidden_size * a + 2 * _rmsnorm(a) * x.hidden_size + 2 * x.hidden_size * a  # embeds, 2 norms, cat
    later = (_rmsnorm(a) + a) * x.hidden_size  # hidden_norm and its output (the attention input)
    layers = first + (x.num_layers - 1) * later + x.num_layers * (attention + mlp + residuals)
    head = (_rmsnorm(a) + a) * x.hidden_size + 4 * x.draft_vocab_size + 8  # final norm, log-softmax, ce and mask
    return layers + head + 8  # + the step's token ids


def once_bytes_per_token(shape: PlanShape) -> int:
    """What a micro-batch keeps once, per token: the batch on the device, the aux input in the compute dtype, the
    norms before fc, fc's output, and the teacher's distribution over the draft vocab (fp32)."""
    x, enc, a = shape.arch, shape.encoding, (2 if shape.bf16 else 4)
    aux_width = x.num_aux * x.hidden_size
    stored_aux = 4 if enc.aux_dtype == "float8_e4m3" else ITEMSIZE[enc.aux_dtype]  # float8 is decoded to fp32
    teacher = (
        x.hidden_size * ITEMSIZE[enc.dtype]
        if enc.teacher == "last_hidden"
        else enc.teacher_topk * (4 + ITEMSIZE[enc.dtype])
    )
    batch = 8 + 1 + 1 + aux_width * stored_aux + teacher
    aux = aux_width * a if stored_aux != a else 0
    if x.norm_before_fc:
        aux += (_rmsnorm(a) + a) * aux_width
    if x.fc_norm:
        aux += (_rmsnorm(a) + a) * aux_width
    return batch + aux + x.hidden_size * a + 4 * x.draft_vocab_size


def workspace_bytes_per_token(shape: PlanShape) -> int:
    """The largest transient per token: the last step's logits and its first backward ops (two fp32 [Vd] tensors,
    the logits themselves and their fp32 copy under bf16), or the MLP's gradients where the vocab is small."""
    x, a = shape.arch, (2 if shape.bf16 else 4)
    logits = 8 * x.draft_vocab_size + a * x.draft_vocab_size + (4 * x.draft_vocab_size if a != 4 else 0)
    return max(logits, 3 * x.intermediate_size * a)


def activation_rows(shape: PlanShape, tokens: int) -> list[tuple[str, int, str]]:
    """Activations and workspace of a micro-batch of `tokens` tokens (padding counted)."""
    steps = [step_bytes_per_token(shape, k) for k in range(shape.num_ttt_steps)]
    x, a = shape.arch, (2 if shape.bf16 else 4)
    if shape.checkpointing:
        kept_per_step = x.hidden_size * a + x.num_layers * 2 * x.num_key_value_heads * x.head_dim * a + 8
        kept = shape.num_ttt_steps * kept_per_step + max(steps)
        what = f"{shape.num_ttt_steps} unroll steps' outputs kept, one step recomputed at a time"
    else:
        kept, what = sum(steps), f"everything {shape.num_ttt_steps} unroll steps keep for the backward"
    return [
        ("activations", tokens * kept, what),
        ("micro-batch inputs and teacher", tokens * once_bytes_per_token(shape), "batch, aux input, fp32 teacher [Vd]"),
        ("logits workspace", tokens * workspace_bytes_per_token(shape), "the last step's logits and first gradients"),
    ]


def plan_memory(shape: PlanShape, micro_batch_tokens: int, device_bytes: int) -> MemoryPlan:
    """The per-rank peak of a step with micro-batches of at most `micro_batch_tokens` tokens."""
    tokens = min(micro_batch_tokens, max(shape.share_tokens, shape.longest_sample))
    micro_batches = math.ceil(shape.share_tokens / tokens) if tokens else 1
    plan = MemoryPlan(shape=shape, micro_batch_tokens=micro_batch_tokens, device_bytes=device_bytes)
    plan.rows = state_rows(shape, micro_batches) + activation_rows(shape, tokens)
    return plan


def pick_micro_batch_tokens(shape: PlanShape, device_bytes: int) -> int:
    """The largest token budget whose planned peak fits the device, up to max(the longest sample,
    AUTO_MAX_TOKENS): micro-batches that large already run full-size matrix products, and smaller ones group
    samples of similar length with little padding (a whole share pads every sample to its longest). 0 when not
    even the longest sample alone fits."""
    whole = min(max(shape.share_tokens, shape.longest_sample), max(shape.longest_sample, AUTO_MAX_TOKENS))
    if plan_memory(shape, whole, device_bytes).fits:
        return whole
    low, high = shape.longest_sample, whole  # low fits or nothing does
    if not plan_memory(shape, low, device_bytes).fits:
        return 0
    while high - low > TOKEN_GRANULARITY:
        mid = (low + high) // 2
        low, high = (mid, high) if plan_memory(shape, mid, device_bytes).fits else (low, mid)
    return max(shape.longest_sample, low // TOKEN_GRANULARITY * TOKEN_GRANULARITY)


def device_bytes(device: torch.device, processes_on_host: int = 1) -> int:
    """The memory one rank may plan with: the CUDA device's total, or on CPU the host's available memory shared
    by its `processes_on_host` ranks."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return host_available_bytes() // max(1, processes_on_host)


def host_available_bytes() -> int:
    """MemAvailable of /proc/meminfo (Linux): what the host can give without swapping."""
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable line; eyas plans host memory on Linux only")


class PlanDoesNotFit(ValueError):
    """The training run's planned peak exceeds its device, or its micro-batch cannot hold a sample."""


def run_plan(config, target, *, device_bytes_found: int = 0) -> MemoryPlan:
    """The plan of a RunConfig's training on its target (TargetFacts): at train.max_tokens_per_micro_batch, or
    the auto budget, against train.device_memory_gib, else `device_bytes_found` (the preflight's devices), else
    for a CPU run the host's available memory shared by its processes. device_bytes 0: not known yet (a CUDA
    run planned where no GPU is visible); the auto budget is then the largest it may become."""
    t, shape = config.train, PlanShape.of_run(config, target)
    known = int(t.device_memory_gib * GIB) or device_bytes_found
    if not known and t.backend == "gloo":
        known = host_available_bytes() // t.num_processes
    tokens = t.max_tokens_per_micro_batch
    if not tokens:
        cap = min(max(shape.share_tokens, shape.longest_sample), max(shape.longest_sample, AUTO_MAX_TOKENS))
        tokens = pick_micro_batch_tokens(shape, known) if known else cap
    return plan_memory(shape, tokens or shape.longest_sample, known)


def check_run_plan(config, target, *, device_bytes_found: int = 0) -> MemoryPlan:
    """The run's plan, refused (PlanDoesNotFit) when a micro-batch cannot hold the longest sample or the peak does
    not fit the device, with the fixes that apply."""
    plan = run_plan(config, target, device_bytes_found=device_bytes_found)
    t, shape = config.train, plan.shape
    if t.max_tokens_per_micro_batch and t.max_tokens_per_micro_batch < shape.longest_sample:
        raise PlanDoesNotFit(
            f"train.max_tokens_per_micro_batch={t.max_tokens_per_micro_batch} cannot hold a sample of "
            f"{shape.longest_sample} tokens (draft.max_position_embeddings / dataset.max_length); raise it to at "
            f"least {shape.longest_sample}, or set 0 to let the memory plan choose"
        )
    if plan.device_bytes and not plan.fits:
        raise PlanDoesNotFit(
            f"training needs {plan.peak_bytes / GIB:.1f} GiB per device at micro-batches of "
            f"{plan.micro_batch_tokens:,} tokens, and {plan.usable_bytes / GIB:.1f} GiB of "
            f"{plan.device_bytes / GIB:.1f} GiB is usable ({HEADROOM:.0%} kept for the allocator):\n"
            + describe_plan(plan)
            + "\nfixes: "
            + "; ".join(plan_fixes(config, plan))
        )
    return plan


def plan_fixes(config, plan: MemoryPlan) -> list[str]:
    """What would shrink the plan, most effective first, for the refusal's message."""
    t, fixes = config.train, []
    if t.max_tokens_per_micro_batch > plan.shape.longest_sample:
        fixes.append(f"a smaller train.max_tokens_per_micro_batch (now {t.max_tokens_per_micro_batch}; 0 = auto)")
    if not t.activation_checkpointing:
        fixes.append("train.activation_checkpointing=true (each unroll step recomputed in the backward)")
    if t.parallelism == "ddp":
        fixes.append("train.parallelism='fsdp2' (parameters, gradients and optimizer state sharded over the ranks)")
    fixes.append(
        f"fewer tokens per sample (draft.max_position_embeddings / dataset.max_length, now {plan.shape.longest_sample})"
    )
    return fixes


def describe_plan(plan: MemoryPlan) -> str:
    """The plan as lines: one per component, then the peak against the device."""
    lines = [f"  {name:32s} {size / GIB:9.2f} GiB  {what}" for name, size, what in plan.rows]
    device = f"{plan.device_bytes / GIB:.1f} GiB device" if plan.device_bytes else "device not known yet"
    lines.append(f"  {'peak':32s} {plan.peak_bytes / GIB:9.2f} GiB  of {device}")
    return "\n".join(lines)
