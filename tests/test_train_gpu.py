"""The trainer on a CUDA device: one NCCL process, bf16 autocast. Skipped without a GPU."""

import pytest
import torch
from test_data import tiny_job, write_tiny_run

from eyas.train import Dist, Trainer

pytestmark = pytest.mark.gpu


def test_one_cuda_step_in_bf16_lowers_nothing_to_nan(tmp_path):
    import torch.distributed as dist

    run = write_tiny_run(tmp_path / "run", num_samples=16)
    job = tiny_job(run, tmp_path / "out", backend="nccl", num_processes=1, max_steps=2, global_batch_size=8)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        trainer = Trainer(job, Dist(rank=0, world=1, device=torch.device("cuda", 0)))
        record = trainer.train_one_step(0.0)
        assert trainer.model.module.bf16
        assert torch.isfinite(torch.tensor(record["loss"]))
        assert next(trainer.draft.parameters()).device.type == "cuda"
    finally:
        dist.destroy_process_group()
