"""Flow `build-dataset`: prompts -> target responses -> tokenized table -> draft vocab mapping."""

from prefect import flow

from eyas.config import RunConfig
from tasks.dataset import build_vocab_mapping, regenerate_and_tokenize
from tasks.facts import check_run_inputs
from tasks.status import stage_status_artifact


@flow(name="build-dataset", log_prints=True)
def build_dataset_flow(config: RunConfig) -> dict:
    """Regenerate the responses, tokenize the samples and build the draft vocab mapping (each reused when unchanged)."""
    check_run_inputs(config, ["dataset"])  # paths, vocab, trainable conversations, aux ids: before any answer
    report = regenerate_and_tokenize(config)
    vocab = build_vocab_mapping(config)
    print(
        f"dataset: {report['num_samples']} samples, {report['num_loss_tokens']} loss tokens, "
        f"hash {report['content_hash']}; draft vocab {vocab['draft_vocab_size']}/{vocab['target_vocab_size']}"
    )
    stage_status_artifact(config, "dataset")
    return {"dataset": report, "vocab": vocab}
