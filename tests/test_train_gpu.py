"""The trainer on a CUDA device: one NCCL process, bf16 autocast, DDP and FSDP2. Skipped without a GPU."""

import pytest
import torch
import torch.distributed as dist
from run_fixtures import tiny_job, write_tiny_run
from safetensors.torch import load_file

from eyas.train.checkpoint import latest_complete
from eyas.train.parallel import Dist, full_model_state, is_sharded
from eyas.train.trainer import Trainer

pytestmark = pytest.mark.gpu


@pytest.fixture
def nccl_process():
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    yield Dist(rank=0, world=1, device=torch.device("cuda", 0))
    dist.destroy_process_group()


def cuda_job(tmp_path, parallelism: str):
    run = write_tiny_run(tmp_path / "run", num_samples=16)
    return tiny_job(
        run,
        tmp_path / "out",
        backend="nccl",
        num_processes=1,
        max_steps=2,
        global_batch_size=8,
        parallelism=parallelism,
    )


def one_step(trainer: Trainer) -> dict:
    """One training step read through the trainer's own input pipeline (stopped after it)."""
    pipeline = trainer.input_pipeline()
    try:
        return trainer.train_one_step(0.0, pipeline)
    finally:
        pipeline.stop()
        pipeline.join()


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp2"])
def test_one_cuda_step_in_bf16_lowers_nothing_to_nan(tmp_path, nccl_process, parallelism):
    trainer = Trainer(cuda_job(tmp_path, parallelism), nccl_process)
    record = one_step(trainer)
    objective = trainer.model.module if parallelism == "ddp" else trainer.model
    assert objective.bf16 and is_sharded(trainer.draft) == (parallelism == "fsdp2")
    assert torch.isfinite(torch.tensor(record["loss"])) and record["grad_norm"] > 0
    assert next(trainer.draft.parameters()).device.type == "cuda"


def test_a_cuda_fsdp2_checkpoint_resumes_to_the_same_weights(tmp_path, nccl_process):
    job = cuda_job(tmp_path, "fsdp2")
    trainer = Trainer(job, nccl_process)
    one_step(trainer)
    trainer.save(epoch=0)
    saved = load_file(latest_complete(job.output_dir) / "model.safetensors")
    resumed = Trainer(job, nccl_process)
    assert resumed.step == 1
    state = full_model_state(resumed.draft)
    assert sorted(k for k in saved if not torch.equal(saved[k], state[k])) == []
