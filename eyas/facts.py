"""The facts of a run that the stages after the dataset share, resolved once and handed down.

    facts = resolve_facts(config)        # once per run, after the dataset stage
    facts.aux_layer_ids, facts.target.hidden_size, facts.dataset_hash, facts.storage()

They come from config.json and the weight headers of the target (no weights are read), the footer
of the tokenized table (its content hash and sample count), the configured aux layer ids resolved
against the target's layer count, and where extraction writes. `sample_lengths()` reads one
column of the table, on demand. A RunFacts is a pydantic model: flows hand it to their tasks and
subflows as an argument, and extraction hands it to workers on other machines. What a user can get wrong in
them (paths, vocab sizes, process counts, a dataset with nothing to train on) is refused before the dataset
stage, by eyas.run_inputs.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from eyas.config import RunConfig, SGLangEnvConfig
from eyas.dataset.table import read_dataset_hash, sample_lengths, tokenized_num_samples
from eyas.layer_ids import resolve_aux_layer_ids, sglang_layer_ids
from eyas.storage import LocalStorage, Storage, open_storage
from eyas.target import TargetFacts


class RunFacts(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    target: TargetFacts
    aux_layer_ids: list[int]  # canonical (eyas.layer_ids)
    tokenized_path: str
    dataset_hash: str
    num_samples: int
    shards_dir: str  # the run's local copy (RUN/shards); "" = none: the stages after extraction read storage_url
    storage_url: str  # where extraction writes: the local shards dir, or s3://bucket/prefix
    s3_endpoint_url: str = ""
    trust_remote_code: bool = False  # target.trust_remote_code: the hf backend may run the target's own code
    sglang: SGLangEnvConfig = SGLangEnvConfig()  # the run's SGLang environment, where the sglang backend launches

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids)

    @property
    def hidden_size(self) -> int:
        return self.target.hidden_size

    def storage(self) -> Storage:
        """The storage extraction writes to (a new client each call: safe to use from any thread)."""
        return open_storage(self.storage_url, endpoint_url=self.s3_endpoint_url)

    def shards(self) -> Storage:
        """Where the stages after extraction read the shards: the local copy, or the storage when none is kept."""
        return LocalStorage(self.shards_dir) if self.shards_dir else self.storage()

    def sample_lengths(self) -> list[int]:
        """Tokens per sample, in dataset order (one column of the tokenized table, read once per process)."""
        return list(_lengths(self.tokenized_path, self.dataset_hash))


def shard_source(config: RunConfig) -> Storage:
    """Where the stages after extraction read a run's shards, from its config alone: the local copy extraction
    keeps (RUN/shards), or with train.cache_bytes > 0 the S3 storage extraction writes (then no copy is kept:
    verification streams or range-reads it, training reads it through the shard cache)."""
    if config.train.cache_bytes:
        return open_storage(config.extract.storage_url, endpoint_url=config.extract.s3_endpoint_url)
    return LocalStorage(config.paths.shards_dir)


@lru_cache(maxsize=4)
def _lengths(path: str, dataset_hash: str) -> tuple[int, ...]:
    return tuple(sample_lengths(path))


def check_layer_ids(config: RunConfig, target: TargetFacts | None = None) -> list[int]:
    """The run's aux layer ids (canonical), refused before any GPU time when they are out of range or not ascending
    (resolve_aux_layer_ids), or when SGLang cannot be given them for this target: its export is for SGLang
    (export.format) and its sglang backend launches with them, so every SGLang release from
    export.sglang_version must capture exactly these layers for the target's class (eyas.layer_ids.sglang_layer_ids:
    a class SGLang does not know, an id its family cannot express such as 1 on a DeepSeek-family target, or a
    release that numbers them otherwise). `target` defaults to the target's facts read from its files."""
    target = target or TargetFacts.read(config.target.model_path)
    ids = resolve_aux_layer_ids(config.target.aux_layer_ids, target.num_layers)
    sglang_layer_ids(ids, target.architectures, target.num_layers, oldest_release=config.export.sglang_version)
    return ids


def resolve_facts(config: RunConfig) -> RunFacts:
    """The run's facts from its config, its target's files and its tokenized table (which must exist).
    With train.cache_bytes > 0 no local copy is kept (shards_dir ""): see `shard_source`."""
    paths = config.paths
    return facts_for(
        target_path=config.target.model_path,
        tokenized_path=paths.tokenized,
        aux_layer_ids=config.target.aux_layer_ids,
        shards_dir="" if config.train.cache_bytes else paths.shards_dir,
        storage_url=config.extract.storage_url,
        s3_endpoint_url=config.extract.s3_endpoint_url,
        trust_remote_code=config.target.trust_remote_code,
        sglang=config.sglang,
    )


def facts_for(
    *,
    target_path: str | Path,
    tokenized_path: str | Path,
    aux_layer_ids: list[int] | None = None,
    shards_dir: str | Path = "",
    storage_url: str = "",
    s3_endpoint_url: str = "",
    trust_remote_code: bool = False,
    sglang: SGLangEnvConfig = SGLangEnvConfig(),
) -> RunFacts:
    """The facts of a run given by its parts (library callers without a RunConfig: `python -m eyas.extract`,
    benchmarks, tests). `storage_url` defaults to `shards_dir`; a local storage_url is its own shards dir."""
    tokenized = Path(tokenized_path)
    if not tokenized.is_file():
        raise FileNotFoundError(f"tokenized dataset {tokenized}: no such file; run the dataset stage first")
    if not storage_url and not shards_dir:
        raise ValueError("facts_for: expected shards_dir (a local directory) or storage_url (s3://bucket/prefix)")
    storage_url = str(storage_url or shards_dir)
    if not shards_dir and not storage_url.startswith("s3://"):
        shards_dir = storage_url
    target = TargetFacts.read(target_path)
    return RunFacts(
        target=target,
        aux_layer_ids=resolve_aux_layer_ids(aux_layer_ids, target.num_layers),
        tokenized_path=str(tokenized),
        dataset_hash=read_dataset_hash(tokenized),
        num_samples=tokenized_num_samples(tokenized),
        shards_dir=str(shards_dir),
        storage_url=storage_url,
        s3_endpoint_url=s3_endpoint_url,
        trust_remote_code=trust_remote_code,
        sglang=sglang,
    )
