"""The sections of what a run trains: the draft's architecture and the training (one node or several)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, StrictInt, StrictStr, model_validator

from eyas.config.base import StrictModel, _refuse_renamed

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
    start: Literal["offline", "streaming"] = Field(
        default="offline",
        description="offline = extract and verify every shard, smoke run, approval gate, then train on the finished "
        "shard set; streaming = the approval gate comes before extraction (after a smoke run on the shards its "
        "samples need, extracted first), then extraction and training run together: the shards are extracted in "
        "the order the trainer first needs them, each verified on arrival, and every rank waits for a shard's "
        "verdict before reading it; the same sample sequence and weights as offline",
        # the default is left out of every dump, so that an offline run's job file, config hashes, cached results
        # and approvals read as they did before this field existed
        exclude_if=lambda start: start == "offline",
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


def check_streaming(train: TrainConfig, extract) -> None:
    """train.start='streaming' against the extraction it runs beside (extract: ExtractConfig): a ValueError naming
    the fix for a combination the streamed extraction cannot run."""
    if train.start != "streaming":
        if extract.stream_deployment:
            raise ValueError(
                f"extract.stream_deployment={extract.stream_deployment!r} runs a streamed run's producer, and "
                f"train.start={train.start!r} extracts before training; set train.start='streaming', or leave "
                f"extract.stream_deployment empty"
            )
        return
    if extract.fanout != "local":
        raise ValueError(
            f"train.start='streaming' with extract.fanout={extract.fanout!r}: the streamed extraction runs its "
            f"extract.num_workers workers in the producer's own process (each shard verified as it commits), it "
            f"starts no extract-worker flow runs; set extract.fanout='local' (and extract.num_workers), or "
            f"train.start='offline'"
        )
    if extract.storage_url and not train.cache_bytes:
        raise ValueError(
            f"train.start='streaming' with extract.storage_url={extract.storage_url!r} and train.cache_bytes=0: the "
            f"trainer would read the run's local copy of the shards, which is brought in line only once extraction "
            f"ends; set train.cache_bytes (each rank then reads S3 through its cache as shards are verified), or "
            f"leave extract.storage_url empty, or set train.start='offline'"
        )


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
