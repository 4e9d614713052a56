"""Tasks of the dataset stage."""

from __future__ import annotations

from prefect import task

from eyas.config import RunConfig
from eyas.dataset.build import build_dataset
from eyas.dataset.vocab import build_vocab
from tasks.caching import cached_by, discard_changed_outputs
from tasks.reporting import StageProgress, table_artifact
from tasks.retry import TRANSIENT_IO


# Cached by the prompts, dataset config and target (the dataset's own key) while the table, its report and the
# responses are the files it wrote; storage errors retried.
@task(
    name="regenerate-and-tokenize",
    **cached_by(("target", "dataset"), ("prompts",), outputs=("tokenized",)),
    **TRANSIENT_IO,
)
def regenerate_and_tokenize(config: RunConfig) -> dict:
    """Regenerate responses with the target and write the tokenized table (reused when unchanged)."""
    discard_changed_outputs()  # a damaged table is rebuilt (from the response log), never reused
    with StageProgress("dataset-progress", "regenerating responses", "samples_done", "samples_total") as progress:
        report = build_dataset(config, progress=progress)
    table_artifact("dataset-report", [report.to_dict()], "tokenized dataset")
    return report.to_dict()


# Cached by the tokenized table's bytes and the vocab sizes while vocab.safetensors is the file it wrote; storage
# errors retried.
@task(
    name="build-vocab-mapping",
    **cached_by(("target", "dataset"), ("tokenized",), outputs=("vocab",)),
    **TRANSIENT_IO,
)
def build_vocab_mapping(config: RunConfig) -> dict:
    """Count loss-masked tokens and write d2t/t2d for the draft vocab (cached by content hash)."""
    discard_changed_outputs()  # a damaged mapping is rebuilt, never reused
    return build_vocab(config)
