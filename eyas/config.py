"""The one configuration tree of eyas (strict pydantic: unknown fields are errors).

The flows take `RunConfig` as their parameter (the Prefect UI renders it as a form), the presets
in `deployments/` are JSON instances of it, and the trainer receives a `TrainJob` as one JSON
file. Paths inside a run live under `RunConfig.workdir` and are named by `RunPaths`.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_validator

DType = Literal["float32", "bfloat16", "float16"]


# Config keys renamed (old name -> new name): a preset still using an old name is refused with the new one.
RENAMED_FIELDS: dict[str, dict[str, str]] = {
    "train": {
        "ttt_steps": "num_ttt_steps",
        "warmup_steps": "num_warmup_steps",
        "keep_last_checkpoints": "num_checkpoints_kept",
    },
    "bench": {"steps": "num_steps"},
}


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _refuse_renamed(section: str, data):
    """A before-validator body: refuse the section's old field names, naming the new ones."""
    if isinstance(data, dict):
        old = sorted(set(data) & set(RENAMED_FIELDS[section]))
        if old:
            renames = ", ".join(f"{section}.{o} is now {section}.{RENAMED_FIELDS[section][o]}" for o in old)
            raise ValueError(f"renamed config fields: {renames}; rename them in the preset (same meaning and value)")
    return data


def _refuse_derived_flags(where: str, args: list[str]) -> None:
    """Launch flags eyas derives for every SGLang server are not extra_args: one setting, every server."""
    if any(a.split("=")[0] == "--trust-remote-code" for a in args):
        raise ValueError(
            f"{where}: --trust-remote-code comes from target.trust_remote_code for every SGLang server eyas starts; "
            "remove it and set target.trust_remote_code"
        )


class TargetConfig(StrictModel):
    model_path: str = Field(description="Hugging Face model directory of the target LLM")
    aux_layer_ids: list[int] | None = Field(
        default=None,
        description="aux layers, as indices into HF outputs.hidden_states (0 = embeddings); "
        "None = EAGLE-3 default [2, N//2, N-3]",
    )
    dtype: DType = Field(default="float32", description="dtype the target runs in")
    trust_remote_code: bool = Field(
        default=False,
        description="let transformers run the model directory's own code (auto_map) to load the target's model or "
        "tokenizer (Kimi-K2.5 needs it); the facts eyas reads from config.json and weight headers never do",
    )


class GenerationConfig(StrictModel):
    """How the target writes the responses of `dataset.responses = "regenerate"` (eyas.dataset.generate)."""

    generator: Literal["hf", "sglang", "openai"] = Field(
        default="hf",
        description="hf: transformers in the flow's process (small targets); sglang: SGLang's /generate with token "
        "ids; openai: an OpenAI-compatible server (vLLM, ...)",
    )
    server_urls: list[str] = Field(
        default_factory=list,
        description="servers used in parallel (sglang, openai); empty with sglang = eyas launches one",
    )
    max_in_flight: int = Field(default=8, ge=1, description="requests in flight per server")
    max_attempts: int = Field(default=4, ge=1, description="tries of one request (on any server) before it fails")
    request_timeout_s: int = Field(default=600, ge=1, description="per request")
    max_failed_fraction: float = Field(
        default=0.0, ge=0, le=1, description="fail the stage when more prompts than this failed every attempt"
    )
    temperature: float = Field(default=0.0, ge=0, description="sampling temperature (0 = greedy)")
    top_p: float = Field(default=1.0, gt=0, le=1, description="nucleus sampling")
    openai_endpoint: Literal["completions", "chat"] = Field(
        default="completions",
        description="completions: token ids in, token ids out where the server returns them; chat: messages in",
    )
    openai_model: str = Field(default="", description="the served model's name (openai)")
    sglang_port: int = Field(default=30000, ge=1, le=65535, description="port of a launched SGLang server")
    sglang_tp_size: int = Field(default=1, ge=1, description="--tp-size of a launched SGLang server")
    sglang_startup_timeout_s: int = Field(default=1800, ge=10, description="wait this long for GET /health")
    sglang_extra_args: list[str] = Field(default_factory=list, description="more launch_server flags")

    @model_validator(mode="after")
    def _servers_fit_the_generator(self) -> "GenerationConfig":
        _refuse_derived_flags("dataset.generation.sglang_extra_args", self.sglang_extra_args)
        bad = [u for u in self.server_urls if not u.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"dataset.generation.server_urls: {bad} expected http://HOST:PORT")
        if self.generator == "hf" and self.server_urls:
            raise ValueError(
                "dataset.generation.server_urls is set but generator is 'hf'; set generator to sglang or openai"
            )
        if self.generator == "openai" and (not self.server_urls or not self.openai_model):
            raise ValueError(
                "dataset.generation.generator='openai' needs server_urls and openai_model (the served model's name)"
            )
        return self

    def identity(self) -> dict:
        """What decides the responses (the cache key's part): not where they are asked or how patiently."""
        return self.model_dump(include={"generator", "temperature", "top_p", "openai_endpoint", "openai_model"})


class DatasetConfig(StrictModel):
    prompts_path: str = Field(
        description="conversations: JSONL or Parquet of {id, conversations:[{role, content}]}, ShareGPT "
        "{conversations:[{from, value}]} or OpenAI {messages:[{role, content}]} rows"
    )
    responses: Literal["regenerate", "as_given"] = Field(
        default="regenerate",
        description="regenerate: the target writes the answer to each conversation's last user turn; as_given: "
        "train on the file's assistant turns (every one loss-masked)",
    )
    system_prompt: Literal["keep", "drop"] = Field(default="keep", description="a conversation's system turn")
    reasoning: Literal["keep", "drop", "template"] = Field(
        default="keep",
        description="assistant reasoning (<think> blocks, reasoning_content): keep in the text, drop, or hand to "
        "the chat template as reasoning_content",
    )
    generation: GenerationConfig = Field(default=GenerationConfig(), description="the regeneration's generator")
    num_samples: int = Field(default=0, ge=0, description="use the first N prompts; 0 = all")
    max_new_tokens: int = Field(default=64, ge=1, le=8192, description="response tokens regenerated per prompt")
    max_length: int = Field(default=512, ge=8, description="tokens per sample after truncation")
    draft_vocab_size: int = Field(default=1024, ge=2, description="size of the draft's output vocabulary")
    max_empty_mask_fraction: float = Field(
        default=0.05, ge=0, le=1, description="fail when more samples than this have no loss-masked token"
    )
    generate_batch_size: int = Field(default=16, ge=1, description="prompts per generation batch")


class SGLangExtractConfig(StrictModel):
    """An SGLang server in aux-capture mode with eyas's capture hook (GPU only); `eyas engine-command CONFIG
    --stage extract` prints the exact command."""

    server_url: str = Field(
        default="", description="an SGLang server already running in aux-capture mode; empty = launch one"
    )
    port: int = Field(default=30000, ge=1, le=65535, description="port of the launched server")
    tp_size: int = Field(default=1, ge=1, description="--tp-size of the launched server")
    mem_fraction_static: float = Field(default=0.8, gt=0, le=1, description="--mem-fraction-static")
    startup_timeout_s: int = Field(default=1800, ge=10, description="wait this long for GET /health")
    request_timeout_s: int = Field(default=600, ge=1, description="per /generate request")
    extra_args: list[str] = Field(default_factory=list, description="more launch_server flags")
    capture_dir: str = Field(
        default="",
        description="folder the server's capture hook writes each request's states to and eyas reads them from "
        "(shared by both: one machine or a shared volume); empty = a new temporary folder for a launched server, "
        "the folder named in the server's --forward-hooks for server_url",
    )

    @model_validator(mode="after")
    def _server_url_or_launch(self) -> "SGLangExtractConfig":
        _refuse_derived_flags("extract.sglang.extra_args", self.extra_args)
        if self.server_url and not self.server_url.startswith(("http://", "https://")):
            raise ValueError(
                f"extract.sglang.server_url={self.server_url!r}: expected empty (launch a server) or http://HOST:PORT"
            )
        launch_only = ("port", "tp_size", "mem_fraction_static", "startup_timeout_s", "extra_args")
        fields = type(self).model_fields
        unused = [
            name
            for name in launch_only
            if self.server_url and getattr(self, name) != fields[name].get_default(call_default_factory=True)
        ]
        if unused:
            raise ValueError(
                f"extract.sglang.server_url={self.server_url!r} connects to a running server, so "
                f"{', '.join(f'extract.sglang.{n}' for n in unused)} would do nothing (they configure a launched "
                "server); remove them, or clear server_url to let eyas launch the server"
            )
        return self


class ExtractConfig(StrictModel):
    backend: Literal["hf", "sglang"] = Field(default="hf", description="hidden-state backend")
    shard_bytes: int = Field(default=1 << 30, ge=1 << 16, description="target size of one shard file")
    batch_size: int = Field(default=8, ge=1, description="samples per forward pass")
    dtype: DType = Field(
        default="float32",
        description="dtype of the stored teacher values: the last hidden states (teacher last_hidden), or the "
        "top-K log-probabilities (teacher topk: float16 or float32)",
    )
    aux_dtype: Literal["float32", "bfloat16", "float16", "float8_e4m3"] = Field(
        default="float32",
        description="encoding of the stored aux hidden states; float8_e4m3 keeps one float32 scale per token and "
        "aux layer (half of bfloat16's bytes); decoded by the trainer's reader as it reads",
    )
    teacher: Literal["last_hidden", "topk"] = Field(
        default="last_hidden",
        description="what the loss learns from: last_hidden = the final-norm states (H values a token); topk = the "
        "target's teacher_topk most likely next tokens and their log-probabilities (6 or 8 bytes each)",
    )
    teacher_topk: int = Field(default=32, ge=1, le=1024, description="K of teacher topk (unused with last_hidden)")
    device: Literal["cpu", "cuda"] = Field(
        default="cpu", description="hf backend: cpu, or cuda (worker k uses GPU k modulo the GPUs present)"
    )
    num_workers: int = Field(default=1, ge=1, description="workers extracting disjoint shards concurrently")
    fanout: Literal["local", "deployment"] = Field(
        default="local",
        description="local: workers are concurrent tasks of this flow run; deployment: one flow run per worker "
        "of `worker_deployment` (e.g. one per GPU node of a work pool)",
    )
    worker_deployment: str = Field(
        default="", description="'extract-worker/DEPLOYMENT' that fanout=deployment runs once per worker"
    )
    storage_url: str = Field(
        default="",
        description="where shards are written: empty = the run's shards dir; s3://bucket/prefix = S3 (the run's "
        "shards dir then holds a verified local copy for verification and training, unless train.cache_bytes > 0: "
        "then no copy is kept and every later stage reads S3)",
    )
    s3_endpoint_url: str = Field(
        default="", description="S3 API endpoint (MinIO, a local server); empty = AWS or $AWS_ENDPOINT_URL"
    )
    sglang: SGLangExtractConfig = Field(
        default=SGLangExtractConfig(), description="the SGLang server of the sglang backend (GPU only)"
    )

    @model_validator(mode="after")
    def _fanout_has_deployment(self) -> "ExtractConfig":
        if self.teacher == "topk" and self.dtype == "bfloat16":
            raise ValueError(
                "extract.teacher='topk' stores log-probabilities as float16 or float32, extract.dtype is bfloat16 "
                "(7 bits of mantissa: 0.4% error on a probability); set extract.dtype to float16"
            )
        if self.fanout == "deployment" and not self.worker_deployment:
            raise ValueError(
                "extract.fanout='deployment' needs extract.worker_deployment ('extract-worker/NAME'); "
                "set it, or use fanout='local'"
            )
        if self.storage_url and not self.storage_url.startswith("s3://"):
            raise ValueError(
                f"extract.storage_url={self.storage_url!r}: expected empty (the run's shards dir) or s3://bucket/prefix"
            )
        return self


class VerifyConfig(StrictModel):
    mode: Literal["cheap", "full"] = Field(default="full", description="cheap: headers + manifest; full: every byte")
    num_heal_rounds: int = Field(
        default=1, ge=0, le=5, description="quarantine + re-extract + verify again this many times before failing"
    )
    num_workers: int = Field(
        default=0,
        ge=0,
        description="workers verifying shards in parallel (threads in full mode and on S3, forked processes for "
        "cheap mode's header parsing when that is faster); 0 = one per core",
    )
    chunk_bytes: int = Field(
        default=512 << 10, ge=1 << 16, description="bytes each thread reads at a time (512 KiB fits a core's cache)"
    )


# The draft variants eyas trains (draft.variant) and the options each turns on: plain EAGLE-3, EAGLE 3.1
# (one RMSNorm per aux chunk before fc, the normed state fed back between draft steps) and one RMSNorm over the
# whole concatenated aux input before fc. All three run as trained in SGLang from the versions that read their
# flags (eyas.export.serving.variant_problem); norm_before_residual, which no SGLang release runs, is not a variant to train.
DRAFT_VARIANTS: dict[str, tuple[str, ...]] = {
    "eagle3": (),
    "eagle3.1": ("fc_norm", "norm_output"),
    "norm_before_fc": ("norm_before_fc",),
}


def variant_of(options) -> str | None:
    """The variant whose options are exactly `options` (any order), or None for a combination eyas does not
    train (a foreign checkpoint's)."""
    return next((name for name, on in DRAFT_VARIANTS.items() if set(on) == set(options)), None)


class DraftConfig(StrictModel):
    """Shape of the EAGLE-3 draft's decoder layers and its variant; hidden size is the target's."""

    variant: Literal["eagle3", "eagle3.1", "norm_before_fc"] = Field(
        default="eagle3",
        description="eagle3 = the plain EAGLE-3 draft; eagle3.1 = one RMSNorm per aux layer's chunk before fc "
        "(fc_norm) and the normed hidden state fed to the next draft step (norm_output); norm_before_fc = one "
        "RMSNorm over the concatenated aux input before fc. SGLang serves eagle3.1 from 0.5.12 and norm_before_fc "
        "from 0.5.17 (export.sglang_version says which servers an export is for)",
    )

    num_layers: int = Field(
        default=1,
        ge=1,
        description="decoder layers of the draft: 1 = EAGLE-3's single layer; more = a stack as SGLang >= 0.5.12 "
        "runs it (layer 0 takes the token embedding and the hidden state, later layers the running hidden state; "
        "exported as layers.{i}.* in format sglang-0.5.12)",
    )
    num_attention_heads: int = Field(default=4, ge=1, description="attention heads of each draft decoder layer")
    num_key_value_heads: int = Field(
        default=2, ge=1, description="key/value heads (grouped-query attention); divides num_attention_heads"
    )
    head_dim: int = Field(default=32, ge=8, description="width of one attention head")
    intermediate_size: int = Field(default=512, ge=8, description="width of the draft's MLP")
    rms_norm_eps: float = Field(default=1e-5, gt=0, description="epsilon of the draft's RMSNorms")
    rope_theta: float = Field(default=10000.0, gt=0, description="rotary embedding base (the target's, usually)")
    max_position_embeddings: int = Field(
        default=2048, ge=16, description="longest sequence the draft attends over; longer samples are cut"
    )

    def arch_fields(self) -> dict:
        """DraftArch's layer fields: the shape, name for name, and the variant's draft options turned on."""
        shape = self.model_dump(exclude={"variant"})
        return {**shape, **{option: True for option in DRAFT_VARIANTS[self.variant]}}

    @model_validator(mode="after")
    def _heads_divide(self) -> "DraftConfig":
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"draft.num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"draft.num_key_value_heads={self.num_key_value_heads}; pick a divisor"
            )
        return self


C10D_DEFAULT_PORT = 29400  # torch's: torch/distributed/elastic/rendezvous/c10d_rendezvous_backend.py DEFAULT_PORT
_NODE_COUNT = re.compile(r"^\s*([0-9]+)\s*(?::\s*([0-9]+)\s*)?$")
_ENDPOINT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.-]*)(?::([0-9]+))?$")
_RDZV_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_NODE_DEPLOYMENT = re.compile(r"^train-node/[^/]+$")
_RDZV_FIELDS = ("node_deployment", "rdzv_endpoint", "rdzv_id", "rdzv_join_timeout_s", "rdzv_last_call_timeout_s")


def parse_num_nodes(value: int | str) -> tuple[int, int]:
    """train.num_nodes as (MIN, MAX): N is (N, N); raises ValueError naming the field, what was found and the fix."""
    match = _NODE_COUNT.match(str(value)) if isinstance(value, (int, str)) and not isinstance(value, bool) else None
    low, high = (int(match[1]), int(match[2] or match[1])) if match else (0, 0)
    if match and 1 <= low <= high:
        return low, high
    found = "not a count or a range" if not match else ("a count below 1" if low < 1 else f"MIN {low} above MAX {high}")
    raise ValueError(
        f"train.num_nodes={value!r}: expected a node count N >= 1 or a range 'MIN:MAX' with 1 <= MIN <= MAX, found "
        f"{found}; write e.g. 1 (one node), 2, or '2:4'"
    )


class TrainConfig(StrictModel):
    num_processes: int = Field(
        default=2, ge=1, description="trainer processes on each node (torchrun --nproc_per_node): its GPUs, or cores"
    )
    num_nodes: StrictInt | StrictStr = Field(
        default=1,
        description="nodes the run trains on, each running num_processes trainers under its own torchrun agent: N, "
        "or 'MIN:MAX' (training starts once MIN nodes joined, admitting up to MAX). 1 = this node alone (torchrun "
        "--standalone); more = torch's elastic launcher with the c10d rendezvous at rdzv_endpoint (torchrun --nnodes "
        "--rdzv-backend c10d), the same command on every node",
    )
    node_deployment: str = Field(
        default="",
        description="with num_nodes other than 1: 'train-node/DEPLOYMENT' of which the training flow starts one flow "
        "run per further node (MAX - 1), each running this node's torchrun command on its work pool's machine; empty "
        "= the further nodes' agents are started by hand with the command the gate shows",
    )
    rdzv_endpoint: str = Field(
        default="",
        description="with num_nodes other than 1: HOST[:PORT] of the c10d rendezvous, an address of the first node "
        "that every node reaches; that node's agent hosts torch's rendezvous store there and the others connect to "
        f"it. The port defaults to {C10D_DEFAULT_PORT} (torch's c10d default) and is written into the config. Required "
        "without node_deployment; with it, empty = the address by which the training flow's machine reaches the "
        "Prefect server. Empty with one node",
    )
    rdzv_id: str = Field(
        default="",
        description="the rendezvous id the nodes' agents share (torchrun --rdzv-id; letters, digits, '_', '.', '-'); "
        "empty = derived from the run: its name and a hash of its workdir, draft and train sections, the same on "
        "every node launched with the same config",
    )
    rdzv_join_timeout_s: int = Field(
        default=600,
        ge=1,
        description="with num_nodes other than 1: seconds the agents wait for the nodes to join the rendezvous "
        "before giving up (torch's c10d join_timeout; its default 600)",
    )
    rdzv_last_call_timeout_s: int = Field(
        default=30,
        ge=1,
        description="with num_nodes 'MIN:MAX': seconds the rendezvous waits for more nodes once MIN have joined "
        "(torch's c10d last_call_timeout; its default 30)",
    )
    max_restarts: int = Field(
        default=3,
        ge=0,
        description="with num_nodes other than 1: how many times each node's agent restarts its workers after a worker "
        "or node failure (torchrun --max-restarts), each time re-running the rendezvous: the nodes still there (at "
        "least MIN, else the job fails once rdzv_join_timeout_s passes) resume from the newest complete checkpoint at "
        "their world size; a node joining a running job restarts the workers without spending one. A lost node "
        "spends one restart of every surviving agent, so the default outlives three node losses in a run of days; "
        "torch restarts blindly, so a failure that repeats (a bad shard, a non-finite loss) also costs up to this many "
        "rounds of the steps since the last checkpoint on every GPU before the job fails. The survivors notice a loss "
        "when a collective with the lost node fails: at once when its processes die (their connections close), after "
        "collective_timeout_s when the machine or its network vanishes; the rendezvous then waits for the lost "
        "node's keep-alive to expire (torch's 3 x 5 s) and for rdzv_last_call_timeout_s. 0 = a failure ends the job. "
        "With one node, leave it unset: the train task relaunches a failed launch from the newest checkpoint",
    )
    verify_reads: bool = Field(
        default=True,
        description="check each shard's XXH3 checksum against the manifest when the trainer first opens it "
        "(its size and header are always checked); about one read of the shard set per process, at page-cache speed",
    )
    backend: Literal["gloo", "nccl"] = Field(default="gloo", description="torch.distributed backend")
    num_epochs: int = Field(default=1, ge=1, description="passes over the training samples")
    global_batch_size: int = Field(default=8, ge=1, description="samples per optimizer step, all ranks")
    lr: float = Field(default=1e-4, gt=0, description="AdamW peak learning rate")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay")
    num_warmup_steps: int = Field(default=10, ge=0, description="optimizer steps of linear lr warmup")
    max_grad_norm: float = Field(default=0.5, gt=0, description="gradients are clipped to this total norm")
    num_ttt_steps: int = Field(default=7, ge=1, le=16, description="TTT unroll length K")
    ttt_decay: float = Field(default=0.8, gt=0, le=1, description="loss weight of unroll step k is decay**k")
    save_every_steps: int = Field(default=100, ge=1, description="write a checkpoint every this many optimizer steps")
    num_checkpoints_kept: int = Field(
        default=2, ge=1, description="complete checkpoints kept on disk (and in the copy); older ones are deleted"
    )
    max_steps: int = Field(default=0, ge=0, description="stop after N steps; 0 = run all epochs")
    seed: int = Field(default=0, description="seed of the draft's initialization and of the sample order")
    mixed_precision: Literal["auto", "bf16", "off"] = Field(
        default="auto", description="auto: bf16 autocast on CUDA, fp32 on CPU; bf16 on CPU is an error"
    )
    max_idle_gpu_memory_mib: int = Field(
        default=1024, ge=0, description="preflight: a GPU using more memory than this before launch counts as busy"
    )
    parallelism: Literal["ddp", "fsdp2"] = Field(
        default="ddp",
        description="ddp: a full replica of the draft on every rank; fsdp2: parameters, gradients and AdamW state "
        "sharded over the ranks (torch fully_shard), for drafts whose large vocabularies do not fit replicated. "
        "Checkpoints are the same full state either way: a run resumes under the other mode or world size",
    )
    checkpoint_copy_url: str = Field(
        default="",
        description="empty = off; s3://bucket/prefix (or an absolute directory, e.g. a network mount) = rank 0 "
        "copies every complete checkpoint there (each file's checksum in a manifest, the completion marker last) "
        "and keeps the newest num_checkpoints_kept; a run whose output_dir lacks the copy's newest checkpoint "
        "restores it first (a fresh machine resumes). The other ranks wait while rank 0 copies. Each request is "
        "retried by the storage layer (transient errors with backoff, damaged uploads re-sent); a copy that still "
        "fails stops the run with the error: the local checkpoint is complete, and a re-run resumes from it and "
        "copies it again",
    )
    s3_endpoint_url: str = Field(
        default="",
        description="S3 API endpoint of checkpoint_copy_url (MinIO, a local server); empty = AWS or $AWS_ENDPOINT_URL",
    )
    cache_bytes: int = Field(
        default=0,
        ge=0,
        description="0 = train from the full local copy of the shards (RUN/shards); N > 0 = no local copy is kept "
        "(verification, diagnosis and status read extract.storage_url) and every rank reads the shards from there "
        "through its own local cache of at most N "
        "bytes (OUTPUT/shard-cache/rank-R), fetched ahead of its sample order by a background thread, each shard "
        "checked against its manifest checksum; shards the rank needs latest are evicted first. Must hold the "
        "largest shard; pair it with shuffle_window_shards",
    )
    cache_dir: str = Field(
        default="",
        description="with cache_bytes > 0: an absolute directory on each node's own disk (the same path on every "
        "node) that holds the ranks' shard caches, in a folder of the run's own (CACHE_DIR/RUN-HASH/rank-R); empty "
        "= OUTPUT/shard-cache, which on several nodes lies on the shared volume: set it there, so that each node's "
        "ranks cache on their node's disk",
    )
    shuffle_window_shards: int = Field(
        default=0,
        ge=0,
        description="0 = every epoch shuffles all samples; W > 0 = the shards are shuffled, then the samples within "
        "each run of W consecutive shards, so a stretch of steps reads W shards: with cache_bytes set, choose W at "
        "most half the shards the cache holds, so the next window arrives while the current one trains",
    )
    eval_fraction: float = Field(
        default=0.0,
        ge=0,
        lt=0.5,
        description="0 = no held-out evaluation; f > 0 = that share of the samples (at least one per rank) is held "
        "out of training, chosen by a hash of the sample index (so the split never changes with the world size or a "
        "resume), and evaluated every eval_every_steps and at every checkpoint: teacher-forced accuracy per draft "
        "position and the acceptance length it implies for a chain of bench.num_steps (eyas.train.evaluate)",
    )
    eval_every_steps: int = Field(
        default=0,
        ge=0,
        description="evaluate the held-out split every this many optimizer steps as well; 0 = only at the "
        "checkpoints (each checkpoint is always evaluated, so the BEST marker can compare them)",
    )
    tensorboard: bool = Field(
        default=True,
        description="rank 0 writes TensorBoard event files to OUTPUT/tb (loss, accuracy per position, estimated tau, "
        "lr, grad norm, tokens/s); open them with `tensorboard --logdir RUN/train/tb`",
    )
    max_tokens_per_micro_batch: int = Field(
        default=0,
        ge=0,
        description="0 = auto: the memory plan (`eyas plan CONFIG`) picks the largest budget whose peak fits the "
        "device; N = each rank splits its share of a global batch into micro-batches of at most N tokens, padding "
        "counted (samples of similar length grouped), accumulating gradients with one collective sync per step; "
        "the update equals the whole batch's. At least the longest sample (draft.max_position_embeddings)",
    )
    activation_checkpointing: bool = Field(
        default=False,
        description="recompute each TTT unroll step (layers, logits, cross-entropy) in the backward instead of keeping "
        "its activations: about a third more compute for a fraction of the activation memory; the same gradients",
    )
    device_memory_gib: float = Field(
        default=0,
        ge=0,
        description="memory of one training device, for the memory plan before any device is held (H200: 139.8, "
        "as torch reports it); 0 = CUDA runs are planned against the devices the preflight finds, CPU runs against "
        "the host's available memory shared by train.num_processes",
    )
    prefetch_steps: int = Field(
        default=1,
        ge=0,
        le=2,
        description="steps of input a background thread reads, decodes and collates (pinned on CUDA) ahead of the "
        "step that trains: host memory up to (this + 1) steps of a rank's collated share; 0 = read each step's "
        "input in the training loop (the same batches, the same weights)",
    )
    collective_timeout_s: int = Field(
        default=3600,
        ge=60,
        description="how long a rank waits in a collective (e.g. while rank 0 writes or restores a checkpoint) "
        "before the process group gives up; passed to init_process_group",
    )

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data):
        return _refuse_renamed("train", data)

    @property
    def node_range(self) -> tuple[int, int]:
        """(MIN, MAX) nodes; (1, 1) on one node."""
        return parse_num_nodes(self.num_nodes)

    @property
    def min_world_size(self) -> int:
        """Trainer processes of the run at its fewest nodes: the world its memory plan and time estimate assume."""
        return self.node_range[0] * self.num_processes

    @model_validator(mode="after")
    def _nodes_meet_at_a_rendezvous(self) -> "TrainConfig":
        low, high = parse_num_nodes(self.num_nodes)
        self.num_nodes = low if low == high else f"{low}:{high}"
        if self.num_nodes == 1:
            unused = [f"train.{f}={getattr(self, f)!r}" for f in _RDZV_FIELDS
                      if getattr(self, f) != type(self).model_fields[f].default]  # fmt: skip
            if unused:
                them = "them" if len(unused) > 1 else "it"
                raise ValueError(
                    f"{', '.join(unused)} would do nothing: train.num_nodes=1 trains on this node alone (torchrun "
                    f"--standalone, no rendezvous between nodes); remove {them}, or set train.num_nodes"
                )
            return self
        if self.node_deployment and not _NODE_DEPLOYMENT.match(self.node_deployment):
            raise ValueError(
                f"train.node_deployment={self.node_deployment!r}: expected 'train-node/NAME', a deployment of the "
                "train-node flow (prefect.yaml has one per preset: train-node-PRESET); fix it, or leave it empty to "
                "start the further nodes by hand"
            )
        if self.rdzv_endpoint or not self.node_deployment:  # else the training flow fills in its own address
            self.rdzv_endpoint = _endpoint_with_port(self.rdzv_endpoint, self.num_nodes)
        if self.rdzv_id and not _RDZV_ID.match(self.rdzv_id):
            raise ValueError(
                f"train.rdzv_id={self.rdzv_id!r}: expected letters, digits, '_', '.' or '-' (torchrun --rdzv-id); "
                "rename it, or leave it empty to derive it from the run"
            )
        if low == high and self.rdzv_last_call_timeout_s != type(self).model_fields["rdzv_last_call_timeout_s"].default:
            raise ValueError(
                f"train.rdzv_last_call_timeout_s={self.rdzv_last_call_timeout_s} would do nothing: train.num_nodes="
                f"{low} is a fixed count, so the rendezvous completes as node {low} joins; remove it, or give "
                "train.num_nodes as a range 'MIN:MAX'"
            )
        return self

    @model_validator(mode="after")
    def _restarts_need_nodes(self) -> "TrainConfig":
        if self.num_nodes == 1 and self.max_restarts != type(self).model_fields["max_restarts"].default:
            raise ValueError(
                f"train.max_restarts={self.max_restarts} would do nothing: train.num_nodes=1 trains on this node "
                "alone (torchrun --standalone, whose workers torch does not restart); there the train task relaunches "
                "a failed launch that made progress, from the newest complete checkpoint; remove it, or set "
                "train.num_nodes"
            )
        return self

    @model_validator(mode="after")
    def _cache_dir_is_used(self) -> "TrainConfig":
        if self.cache_dir and not self.cache_bytes:
            raise ValueError(
                f"train.cache_dir={self.cache_dir!r} would do nothing: train.cache_bytes=0 trains from the local copy "
                "of the shards, with no cache; set train.cache_bytes, or remove train.cache_dir"
            )
        if self.cache_dir and not self.cache_dir.startswith("/"):
            raise ValueError(
                f"train.cache_dir={self.cache_dir!r}: expected an absolute directory (each node resolves it on its own "
                "disk, whatever its working directory); write e.g. '/local-nvme/eyas-cache'"
            )
        return self

    @model_validator(mode="after")
    def _copy_url_is_usable(self) -> "TrainConfig":
        url = self.checkpoint_copy_url
        if url and not (url.startswith("s3://") and len(url) > len("s3://") or url.startswith("/")):
            raise ValueError(
                f"train.checkpoint_copy_url={url!r}: expected empty (no copy), s3://bucket/prefix, or an absolute "
                f"directory path"
            )
        if self.s3_endpoint_url and not url.startswith("s3://"):
            raise ValueError(
                f"train.s3_endpoint_url={self.s3_endpoint_url!r} would do nothing: train.checkpoint_copy_url="
                f"{url!r} is not an s3:// URL; set checkpoint_copy_url to s3://bucket/prefix or clear s3_endpoint_url"
            )
        return self


def _endpoint_with_port(endpoint: str, num_nodes: int | str) -> str:
    """train.rdzv_endpoint as HOST:PORT (torch's c10d default port when none is given), or a ValueError."""
    if not endpoint:
        raise ValueError(
            f"train.rdzv_endpoint is empty with train.num_nodes={num_nodes!r}: the nodes' agents meet at a c10d "
            f"rendezvous and each must be given its address; set train.rdzv_endpoint to HOST:PORT of the first node "
            f"(e.g. 'node-0.cluster.local:{C10D_DEFAULT_PORT}', {C10D_DEFAULT_PORT} being torch's c10d default), or "
            "set train.node_deployment so that the training flow starts the further nodes and gives them its address"
        )
    match = _ENDPOINT.match(endpoint)
    port = int(match[2]) if match and match[2] else C10D_DEFAULT_PORT
    if not match or not 1 <= port <= 65535:
        raise ValueError(
            f"train.rdzv_endpoint={endpoint!r}: expected HOST or HOST:PORT (a host name, an IPv4 address or a "
            f"[bracketed] IPv6 one; a port from 1 to 65535); write e.g. '10.0.0.5:{C10D_DEFAULT_PORT}'"
        )
    return f"{match[1]}:{port}"


class SmokeConfig(StrictModel):
    num_samples: int = Field(default=8, ge=1, description="samples the smoke run overfits")
    num_steps: int = Field(default=40, ge=2, description="optimizer steps on the same batch")
    lr: float = Field(default=3e-3, gt=0, description="constant learning rate of the smoke run")
    min_loss_drop: float = Field(default=0.3, gt=0, lt=1, description="final loss must be below (1 - this) x first")
    max_cpu_minutes: float = Field(
        default=30,
        gt=0,
        description="a CPU run's smoke run is refused before it starts when its planned cost at this host's measured "
        "speed exceeds this (a GPU run's smoke runs on a training GPU)",
    )


class ApprovalConfig(StrictModel):
    @model_validator(mode="before")
    @classmethod
    def _refuse_removed(cls, data):
        if isinstance(data, dict) and "gpu_hours_per_step" in data:
            raise ValueError(
                "approval.gpu_hours_per_step was removed: the gate's estimate is scaled from the smoke run's "
                "measured speed; delete the key from the preset"
            )
        return data

    timeout_s: int = Field(
        default=7 * 24 * 3600,
        ge=10,
        description="how long the gate waits for a person; then the run fails and nothing is trained",
    )


class ExportConfig(StrictModel):
    format: Literal["sglang", "sglang-0.5.12"] = Field(
        default="sglang",
        description="the export stage's format: sglang = midlayer.* (every SGLang release); sglang-0.5.12 = "
        "layers.{i}.* (SGLang >= 0.5.12; needed for draft.num_layers > 1); eyas remap converts to others",
    )
    checkpoint: Literal["best", "last"] = Field(
        default="best",
        description="which training checkpoint is exported: best = the one the BEST marker names (the highest "
        "estimated acceptance on the held-out split; the newest when train.eval_fraction is 0), last = the newest",
    )
    dtype: DType = Field(default="float32", description="dtype of the exported weights")
    sglang_version: str = Field(
        default="",
        pattern=r"^(\d+\.\d+\.\d+)?$",
        description="the oldest SGLang release the export must run on (e.g. 0.5.23); it decides which draft "
        "variants may be exported (eagle3.1 needs 0.5.12, norm_before_fc 0.5.17); empty = every release the "
        "format serves (0.5.10 on: plain eagle3 only)",
    )


class BenchConfig(StrictModel):
    prompts_path: str = Field(description="held-out prompts JSONL (never the training prompts)")
    num_prompts: int = Field(default=0, ge=0, description="0 = all")
    num_steps: int = Field(default=3, ge=1, description="draft steps: chain length k (topk 1), tree depth (topk > 1)")
    max_new_tokens: int = Field(default=64, ge=1, description="new tokens per held-out prompt at most")
    min_tau: float = Field(default=1.0, ge=0, description="fail the flow when tau_mean is below this")
    engine: Literal["reference", "sglang"] = Field(
        default="reference", description="reference: eyas's loop through hf (CPU or GPU); sglang: a served run (GPU)"
    )
    topk: int = Field(default=1, ge=1, description="1 = chain of `steps`; > 1 = tree (EAGLE-2/3 expansion)")
    num_draft_tokens: int = Field(
        default=0, ge=0, description="tree size as SGLang counts it (root included); 0 = num_steps + 1 (a chain)"
    )
    ngram_max_n: int = Field(default=3, ge=1, description="longest suffix the n-gram baseline looks up")
    diagnose_num_samples: int = Field(default=8, ge=1, description="shard samples for the teacher-forced check")
    min_teacher_forced_accuracy: float = Field(
        default=0.3, ge=0, le=1, description="the diagnosis calls the draft weak below this step-0 accuracy"
    )
    sglang_port: int = Field(default=30000, ge=1, le=65535, description="port of the launched SGLang server")
    sglang_concurrency: int = Field(default=16, ge=1, description="requests in flight against SGLang")
    sglang_startup_timeout_s: int = Field(default=1800, ge=10, description="wait this long for GET /health")
    sglang_extra_args: list[str] = Field(
        default_factory=list,
        description="more launch_server flags, e.g. ['--tp-size', '8', '--mem-fraction-static', '0.8']",
    )

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data):
        return _refuse_renamed("bench", data)

    @model_validator(mode="after")
    def _draft_tokens_match_shape(self) -> "BenchConfig":
        _refuse_derived_flags("bench.sglang_extra_args", self.sglang_extra_args)
        if self.topk == 1 and self.num_draft_tokens not in (0, self.num_steps + 1):
            raise ValueError(
                f"bench.num_draft_tokens={self.num_draft_tokens} with bench.topk=1 (a chain of num_steps="
                f"{self.num_steps}): expected 0 or num_steps + 1 = {self.num_steps + 1}"
            )
        if self.topk > 1 and self.num_draft_tokens < 2:
            raise ValueError(
                f"bench.topk={self.topk} (a tree) needs bench.num_draft_tokens >= 2 (root + drafted nodes), "
                f"found {self.num_draft_tokens}"
            )
        return self

    @property
    def draft_tokens(self) -> int:
        """num_draft_tokens with the chain default resolved."""
        return self.num_draft_tokens or self.num_steps + 1


class SGLangEnvConfig(StrictModel):
    """SGLang's own environment, where every server eyas starts runs: regeneration, extraction, the benchmark and
    its baseline (SGLang pins its own torch and transformers; README: A GPU machine)."""

    python: str = Field(
        default="",
        description="the interpreter of SGLang's environment, e.g. /opt/sglang/bin/python, with eyas's capture "
        "module installed there (the eyas-capture wheel: torch and safetensors only); `eyas engine-command` prints "
        "it; empty = the interpreter running eyas (SGLang installed beside eyas)",
    )
    allow_unchecked_versions: list[str] = Field(
        default_factory=list,
        description="SGLang releases to run although eyas has not checked them (checked: 0.5.23), e.g. ['0.5.24']: "
        "the layer each aux id captures, the aux-capture flags, what the capture hook reads and the answers' fields "
        "are then unverified; empty = any other release is refused before its model loads",
    )

    @model_validator(mode="after")
    def _paths_and_versions(self) -> "SGLangEnvConfig":
        if self.python and "/" not in self.python:
            raise ValueError(
                f"sglang.python={self.python!r}: expected the path of SGLang's interpreter (e.g. "
                "/opt/sglang/bin/python), not a name each machine's PATH would resolve to some interpreter; or empty"
            )
        bad = [v for v in self.allow_unchecked_versions if not re.fullmatch(r"\d+\.\d+\.\d+\S*", v)]
        if bad:
            raise ValueError(
                f"sglang.allow_unchecked_versions: {bad} expected release strings as SGLang reports them (e.g. "
                "'0.5.24', '0.5.23.post1')"
            )
        return self


class RunConfig(StrictModel):
    name: str = Field(
        default="eyas-run", pattern=r"^[a-z0-9][a-z0-9-]*$", description="the run's name (lowercase, digits, '-')"
    )
    workdir: str = Field(description="directory holding every output of the run")
    target: TargetConfig = Field(description="the target LLM the draft is trained for")
    dataset: DatasetConfig = Field(description="prompts, regeneration, tokenization and the draft vocab")
    extract: ExtractConfig = Field(default=ExtractConfig(), description="hidden-state extraction into shards")
    verify: VerifyConfig = Field(default=VerifyConfig(), description="shard verification and healing")
    draft: DraftConfig = Field(default=DraftConfig(), description="the draft's decoder layer")
    train: TrainConfig = Field(default=TrainConfig(), description="the training run under torchrun")
    smoke: SmokeConfig = Field(default=SmokeConfig(), description="the smoke run before the approval gate")
    approval: ApprovalConfig = Field(default=ApprovalConfig(), description="the approval gate")
    export: ExportConfig = Field(default=ExportConfig(), description="the export of the trained draft")
    bench: BenchConfig = Field(description="the acceptance benchmark on held-out prompts")
    sglang: SGLangEnvConfig = Field(
        default=SGLangEnvConfig(), description="SGLang's environment, for every SGLang server eyas starts"
    )

    @model_validator(mode="after")
    def _cache_reads_remote_shards(self) -> "RunConfig":
        if self.train.cache_bytes and not self.extract.storage_url.startswith("s3://"):
            raise ValueError(
                f"train.cache_bytes={self.train.cache_bytes}: the shard cache reads shards stored on S3, and "
                f"extract.storage_url={self.extract.storage_url!r} keeps them in the run's local shards dir already; "
                f"set train.cache_bytes to 0, or extract.storage_url to s3://bucket/prefix"
            )
        return self

    @property
    def paths(self) -> "RunPaths":
        return RunPaths(Path(self.workdir))

    def fingerprint(self, *parts: str) -> str:
        """Hash of the named config sections (all when none): keys caches and approvals."""
        data = self.model_dump(mode="json")
        chosen = {k: data[k] for k in (parts or sorted(data))}
        return hashlib.sha256(json.dumps(chosen, sort_keys=True).encode()).hexdigest()[:16]


class PlannedShard(StrictModel):
    """One shard of the extraction's plan (eyas.shards.format.ShardPlan), known before it is extracted."""

    sample_start: int = Field(ge=0, description="its first global sample")
    sample_end: int = Field(gt=0, description="one past its last sample")
    num_tokens: int = Field(ge=1, description="tokens it will hold")


class StreamSource(StrictModel):
    """Train while extraction goes on: every planned shard, read only once its verdict names its bytes."""

    verify_mode: Literal["cheap", "full"] = Field(
        description="verify.mode: the verdict a shard needs before it is read"
    )
    plan: list[PlannedShard] = Field(min_length=1, description="the shard plan, shard 0 first (describe_extraction)")

    @model_validator(mode="after")
    def _plan_is_contiguous(self) -> "StreamSource":
        end = 0
        for k, p in enumerate(self.plan):
            if p.sample_start != end or p.sample_end <= p.sample_start:
                raise ValueError(
                    f"stream.plan[{k}]: samples {p.sample_start}..{p.sample_end}, expected a non-empty range from "
                    f"sample {end}; pass the shard plan of eyas.extract.plan.describe_extraction whole, in order"
                )
            end = p.sample_end
        return self


class TrainJob(StrictModel):
    """Everything `python -m eyas.train --config job.json` needs, written by the train task."""

    target_path: str = Field(description="the target's model directory")
    shards_dir: str = Field(
        description="the shard set to train on: a local directory; with train.cache_bytes > 0 also s3://bucket/prefix, "
        "read through the cache"
    )
    shards_endpoint_url: str = Field(default="", description="S3 API endpoint of an s3:// shards_dir; empty = AWS")
    vocab_path: str = Field(description="the draft vocab mapping (vocab.safetensors)")
    output_dir: str = Field(description="checkpoints, metrics.jsonl and final.json go here")
    aux_layer_ids: list[int] = Field(description="canonical aux layer ids the shards were extracted at")
    draft: DraftConfig = Field(description="the draft's decoder layer")
    train: TrainConfig = Field(description="the training run")
    max_samples: int = Field(default=0, ge=0, description="use the first N samples; 0 = all")
    chain_steps: int = Field(
        default=3, ge=1, description="bench.num_steps: the draft chain the held-out evaluation estimates tau for"
    )
    stream: StreamSource | None = Field(
        default=None,
        description="set: train while extraction goes on (sample index from the plan, each shard waited for until "
        "verified); unset: train on the finished manifest",
    )

    @model_validator(mode="after")
    def _remote_shards_need_a_cache(self) -> "TrainJob":
        if "://" in self.shards_dir and not self.train.cache_bytes:
            raise ValueError(
                f"shards_dir={self.shards_dir!r} with train.cache_bytes=0: a storage URL is read through the shard "
                f"cache; set train.cache_bytes, or point shards_dir at a local copy"
            )
        return self


class RunPaths:
    """Where each stage writes inside a run's workdir."""

    def __init__(self, root: Path):
        self.root = Path(root)

    @property
    def dataset_dir(self) -> Path:
        return self.root / "dataset"

    @property
    def tokenized(self) -> Path:
        return self.dataset_dir / "tokenized.parquet"

    @property
    def vocab(self) -> Path:
        return self.dataset_dir / "vocab.safetensors"

    @property
    def shards_dir(self) -> Path:
        return self.root / "shards"

    @property
    def verify_report(self) -> Path:
        return self.root / "verify" / "report.parquet"

    @property
    def smoke_dir(self) -> Path:
        return self.root / "smoke"

    @property
    def train_dir(self) -> Path:
        return self.root / "train"

    @property
    def export_dir(self) -> Path:
        return self.root / "export"

    @property
    def bench_dir(self) -> Path:
        return self.root / "bench"


def load_run_config(path: str | Path) -> RunConfig:
    """Read a preset (JSON) into a RunConfig. Relative paths inside it are kept as written: they are relative to
    the directory the command runs in (the repo root, for the bundled presets)."""
    return RunConfig.model_validate_json(Path(path).read_text())
