"""The sections of what a run reads and extracts: the target, the dataset and its regeneration, extraction,
verification."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from eyas.config.base import DType, StrictModel, _refuse_derived_flags


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
    stream_deployment: str = Field(
        default="",
        description="train.start='streaming': 'extract-stream/DEPLOYMENT' = the producer runs as a flow run of that "
        "deployment (its own work pool, e.g. the inference node) while the pipeline's run trains; empty = the "
        "producer is a subflow of the pipeline's run",
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
    retention: Literal["keep"] | Annotated[int, Field(ge=1)] = Field(
        default="keep",
        description="keep: every shard stays in storage (exact resume, later epochs); N: a streamed single-epoch "
        "run keeps at most N shards, releasing each once the trainer's newest checkpoint is past its last use",
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
        flow, _, name = self.stream_deployment.partition("/")
        if self.stream_deployment and (flow != "extract-stream" or not name):
            raise ValueError(
                f"extract.stream_deployment={self.stream_deployment!r}: expected 'extract-stream/NAME' (a deployment "
                "of the extract-stream flow, e.g. extract-stream/tiny-cpu); set it so, or leave it empty to run the "
                "producer in the pipeline's own run"
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
