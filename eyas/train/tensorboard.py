"""TensorBoard event files of a training run: rank 0 writes OUTPUT/tb (RUN/train/tb) when train.tensorboard is on.

    tensorboard --logdir runs/demo/train/tb        # then open http://localhost:6006

Scalars per optimizer step (the metric record, eyas.train.metrics): train/loss, train/loss_k/{k},
train/acc_k/{k} (position k + 1), train/lr, train/grad_norm, train/tokens_per_s, train/padding_waste (tokens padded
/ tokens computed), train/micro_batches, train/data_wait_s and train/data_stall_fraction (the step's wait for its
input), on CUDA train/peak_memory_bytes; and at each held-out
evaluation eval/loss, eval/acc_k/{k}, eval/tau_estimate. The files are TensorBoard's own event format, which
W&B (`wandb sync --sync-tensorboard`) and MLflow import as they are. A resumed run purges the events from the
first step it trains again (SummaryWriter's purge_step), so every step is shown once after any resume.
Writing them changes nothing else about training.
"""

from __future__ import annotations

from pathlib import Path

TB_DIR = "tb"


class TensorBoardLog:
    """A SummaryWriter over OUTPUT/tb that takes metric records."""

    def __init__(self, output_dir: str | Path, resumed_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(
            str(Path(output_dir) / TB_DIR), purge_step=resumed_step + 1 if resumed_step else None
        )

    def add(self, record: dict) -> None:
        step, w = record["step"], self.writer
        w.add_scalar("train/loss", record["loss"], step)
        for k, v in enumerate(record["loss_k"]):
            w.add_scalar(f"train/loss_k/{k}", v, step)
        for k, v in enumerate(record["acc_k"]):
            w.add_scalar(f"train/acc_k/{k}", v, step)
        scalars = ("lr", "grad_norm", "tokens_per_s", "padding_waste", "micro_batches", "data_wait_s",
                   "data_stall_fraction", "peak_memory_bytes")  # fmt: skip
        for key in scalars:
            if key in record:  # the peak is measured on CUDA only
                w.add_scalar(f"train/{key}", record[key], step)
        evaluated = record.get("eval")
        if evaluated:
            w.add_scalar("eval/loss", evaluated["loss"], step)
            w.add_scalar("eval/tau_estimate", evaluated["tau_estimate"], step)
            for k, v in enumerate(evaluated["acc_k"]):
                w.add_scalar(f"eval/acc_k/{k}", v, step)
        if evaluated or step % 10 == 0:
            w.flush()

    def close(self) -> None:
        self.writer.close()
