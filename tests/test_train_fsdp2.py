"""eyas.train with train.parallelism='fsdp2': real 2-process gloo runs against DDP runs of the same job, and
an FSDP2 checkpoint resumed by one process under DDP.

FSDP2 and DDP compute the same gradients bit for bit here; what differs is clip_grad_norm_: under FSDP2
the total norm is summed from each rank's shard norms, in another order than DDP's norm over full
gradients, so the norm (and the clip coefficient) can differ in the last bit of float32. With clipping
active at every step, 6 steps leave the weights within about 1.2e-7 of DDP's (values of order 1), and
without clipping they are bit-identical.

The resume on one process checks the restored state (first loss, lr, AdamW step counts), not the final
weights: each rank's loss is its own token mean and the ranks' gradients are averaged, so a run on 1
process and one on 2 follow slightly different trajectories (about 1e-4 apart after 2 steps here).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from run_fixtures import run_trainer, tiny_job, write_tiny_run
from safetensors.torch import load_file

STEPS, BATCH = 6, 8
WEIGHT_TOLERANCE = {"atol": 1e-6, "rtol": 1e-5}  # about 8x what 6 clipped steps were measured to differ


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "checkpoints" / f"step-{STEPS:08d}" / "model.safetensors")


def train_both(root: Path, run: dict, draft: dict | None = None, **train) -> dict:
    """The same job on 2 gloo ranks under DDP and under FSDP2: {parallelism: {job, out, stdout, metrics}};
    `draft` updates the job's draft section."""
    runs = {}
    for parallelism in ("ddp", "fsdp2"):
        out = root / parallelism / "out"
        job = tiny_job(
            run,
            out,
            num_epochs=3,
            max_steps=STEPS,
            global_batch_size=BATCH,
            save_every_steps=2,
            num_checkpoints_kept=3,
            parallelism=parallelism,
            **train,
        )
        job = job.model_copy(update={"draft": job.draft.model_copy(update=draft or {})})
        job_path = out.parent / "job.json"
        out.parent.mkdir(parents=True)
        job_path.write_text(job.model_dump_json())
        stdout, metrics = run_trainer(job_path, nproc=2)
        runs[parallelism] = {"job": job, "out": out, "stdout": stdout, "metrics": metrics}
    return runs


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> dict:
    return write_tiny_run(tmp_path_factory.mktemp("fsdp2-run"), num_samples=32)


@pytest.fixture(scope="module")
def clipped(tiny_run, tmp_path_factory) -> dict:
    """max_grad_norm 0.5: the gradients (norm 2 to 3) are clipped at every step."""
    return train_both(tmp_path_factory.mktemp("clipped"), tiny_run)


def test_fsdp2_lowers_the_loss_in_the_ddp_sample_order(clipped):
    ddp, fsdp2 = clipped["ddp"]["metrics"], clipped["fsdp2"]["metrics"]
    assert "world size 2, fsdp2" in clipped["fsdp2"]["stdout"]
    assert [m["step"] for m in fsdp2] == list(range(1, STEPS + 1))
    assert fsdp2[-1]["loss"] < 0.8 * fsdp2[0]["loss"]
    assert [m["sample_ids"] for m in fsdp2] == [m["sample_ids"] for m in ddp]
    assert all(m["grad_norm"] > 0.5 for m in ddp)  # the clip is active
    assert [m["grad_norm"] for m in fsdp2] == pytest.approx([m["grad_norm"] for m in ddp], rel=1e-6)
    assert [m["loss"] for m in fsdp2] == pytest.approx([m["loss"] for m in ddp], rel=1e-6)


def test_fsdp2_final_weights_match_ddp_within_float32_rounding(clipped):
    ddp, fsdp2 = final_weights(clipped["ddp"]["out"]), final_weights(clipped["fsdp2"]["out"])
    assert fsdp2.keys() == ddp.keys()
    for key in ("embed_tokens.weight", "d2t", "t2d"):  # frozen and buffers: untouched
        assert torch.equal(fsdp2[key], ddp[key]), key
    for key in ddp:
        torch.testing.assert_close(fsdp2[key], ddp[key], **WEIGHT_TOLERANCE, msg=key)


def test_fsdp2_writes_the_ddp_optimizer_state_format(clipped):
    path = Path("checkpoints") / f"step-{STEPS:08d}" / "optimizer.pt"
    ddp, fsdp2 = (torch.load(clipped[p]["out"] / path, weights_only=True) for p in ("ddp", "fsdp2"))
    assert fsdp2["param_groups"] == ddp["param_groups"]
    assert fsdp2["state"].keys() == ddp["state"].keys() == set(range(13))
    for i, state in ddp["state"].items():
        assert torch.equal(fsdp2["state"][i]["step"], state["step"])
        for name in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(fsdp2["state"][i][name], state[name], **WEIGHT_TOLERANCE)


def test_fsdp2_matches_ddp_bit_for_bit_without_clipping(tiny_run, tmp_path):
    runs = train_both(tmp_path, tiny_run, max_grad_norm=1e6)
    ddp, fsdp2 = final_weights(runs["ddp"]["out"]), final_weights(runs["fsdp2"]["out"])
    assert sorted(k for k in ddp if not torch.equal(ddp[k], fsdp2[k])) == []


def test_fsdp2_trains_a_stack_of_layers_with_norms_as_ddp_does(tiny_run, tmp_path):
    """draft.num_layers 2 with eagle3.1's norms: FSDP2 shards the stack with the rest, and its weights equal DDP's."""
    runs = train_both(tmp_path, tiny_run, draft={"num_layers": 2, "variant": "eagle3.1"}, max_grad_norm=1e6)
    ddp, fsdp2 = final_weights(runs["ddp"]["out"]), final_weights(runs["fsdp2"]["out"])
    assert {"layers.1.hidden_norm.weight", "fc_norm.0.weight"} <= ddp.keys() == fsdp2.keys()
    assert sorted(k for k in ddp if not torch.equal(ddp[k], fsdp2[k])) == []


def test_fsdp2_checkpoint_resumes_on_one_process_under_ddp(clipped, tmp_path):
    # Simulate a crash while step 6 was being saved: its COMPLETE marker never got written.
    out = tmp_path / "out"
    shutil.copytree(clipped["fsdp2"]["out"], out)
    (out / "checkpoints" / "step-00000006" / "COMPLETE").unlink()
    (out / "final.json").unlink()
    train = clipped["fsdp2"]["job"].train.model_copy(update={"parallelism": "ddp"})
    job = clipped["fsdp2"]["job"].model_copy(update={"output_dir": str(out), "train": train})
    job_path = tmp_path / "job.json"
    job_path.write_text(job.model_dump_json())
    stdout, metrics = run_trainer(job_path, nproc=None)
    assert "at step 4 (32 samples consumed, saved with world size 2, now 1; saved under fsdp2, now ddp)" in stdout
    before = {m["step"]: m for m in clipped["fsdp2"]["metrics"]}
    assert [m["step"] for m in metrics] == [5, 6]
    assert [m["sample_ids"] for m in metrics] == [before[5]["sample_ids"], before[6]["sample_ids"]]
    assert [m["lr"] for m in metrics] == [before[5]["lr"], before[6]["lr"]]  # the scheduler resumed
    # the restored weights are FSDP2's: the first loss is the same function of them on 1 or 2 ranks
    assert metrics[0]["loss"] == pytest.approx(before[5]["loss"], rel=1e-6)
    optimizer = torch.load(out / "checkpoints" / "step-00000006" / "optimizer.pt", weights_only=True)
    assert {float(s["step"]) for s in optimizer["state"].values()} == {6.0}  # AdamW went on from step 4
