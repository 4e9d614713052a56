"""Data parallelism of the trainer: the process group, DDP or FSDP2, and full (unsharded) state dicts in one
format for both.

    ctx = init_distributed("gloo")                           # torchrun's group, or a one-process group
    model = parallelize(objective, "fsdp2", device)          # or "ddp"
    model_state = full_model_state(draft)                    # every rank calls; rank 0 gets the tensors
    optim_state = full_optimizer_state(draft, optimizer)     # torch's own optimizer.state_dict() layout
    load_full_model_state(draft, model_state)                # every rank, the same full dicts
    load_full_optimizer_state(draft, optimizer, optim_state)

DDP keeps a full replica of the draft on every rank: its state dicts are the plain ones. FSDP2
(`torch.distributed.fsdp.fully_shard`) turns every parameter into a DTensor sharded on dim 0 over
all ranks, so their gradients and the AdamW state are sharded too; the full state dicts are gathered
with `torch.distributed.checkpoint.state_dict` (full_state_dict, cpu_offload: only rank 0 holds the
gathered tensors, in CPU memory) and loaded back by each rank keeping its own shard. The optimizer
state is written with integer parameter ids (the order of the optimizer's param groups), exactly as
`optimizer.state_dict()` of an unsharded draft: a checkpoint does not record how it was trained, and
resumes under either mode on any world size.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from itertools import chain
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

# torch.distributed.{tensor,checkpoint,fsdp} cost about 0.6 s to import: only FSDP2 code paths import them.

Parallelism = Literal["ddp", "fsdp2"]


def _full_options(*, rank0_only: bool):
    """Full (unsharded) state dicts; rank0_only: gathered to rank 0's CPU memory, else given on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=rank0_only, strict=True)


@dataclass
class Dist:
    rank: int
    world: int
    device: torch.device


def init_distributed(backend: str, timeout_s: float = 3600) -> Dist:
    """The torchrun process group (env://), or a one-process group when not under torchrun; a collective waits at
    most `timeout_s` (train.collective_timeout_s: rank 0 alone writes and restores checkpoints meanwhile)."""
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("train.backend='nccl' needs CUDA GPUs and none is visible; use backend 'gloo' on CPU")
    timeout = timedelta(seconds=timeout_s)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    return Dist(rank=dist.get_rank(), world=dist.get_world_size(), device=device)


def parallelize(
    objective: nn.Module, parallelism: Parallelism, device: torch.device, *, bf16: bool = False
) -> nn.Module:
    """The module a training step calls: `objective` wrapped by DDP, or `objective` itself sharded by FSDP2.

    FSDP2: each decoder layer is its own group and the objective the root (fc, norms, lm_head), with bf16
    parameters and fp32 gradient reduction when training in bf16 (`MixedPrecisionPolicy`). Every unroll step runs
    every layer, so a layer stays gathered from its first forward to its backward (reshard_after_forward=False)
    instead of being gathered again at each of the K steps. The frozen embed_tokens is left out of FSDP
    (ignored_params): each rank holds it whole, in the training dtype, and it is never gathered or reduced;
    buffers (d2t, t2d) and the teacher's head rows stay plain tensors on every rank. Only `objective.forward` is
    ever called from outside: the draft's methods run inside it, after the root's pre-forward hook.
    """
    if parallelism == "ddp":
        # d2t/t2d never change: no buffer sync per forward; gradients live in the buckets (no second copy).
        return nn.parallel.DistributedDataParallel(objective, forward_sync_buffers=False, gradient_as_bucket_view=True)
    if parallelism == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if bf16 else None,
            reduce_dtype=torch.float32 if bf16 else None,
            cast_forward_inputs=False,  # the batch keeps its dtypes: the teacher is computed from them in fp32
        )
        for layer in objective.draft.decoder_layers():
            fully_shard(layer, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
        frozen = {p for p in objective.parameters() if not p.requires_grad}
        fully_shard(objective, mesh=mesh, mp_policy=policy, ignored_params=frozen)
        return objective
    raise ValueError(f"train.parallelism={parallelism!r}: expected 'ddp' or 'fsdp2'")


def reshard(model: nn.Module) -> None:
    """After forwards without a backward (the held-out evaluation): FSDP2 keeps gathered parameters after a
    forward, expecting a backward to free them; reshard every group so the draft is sharded again (its state
    dict, the next step). DDP and a plain module: nothing to do."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _dtensor_type() -> type | None:
    """DTensor, or None while torch.distributed.tensor was never imported (then no tensor is a DTensor)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module.DTensor if module is not None else None


def is_sharded(module: nn.Module) -> bool:
    dtensor = _dtensor_type()
    return dtensor is not None and any(isinstance(p, dtensor) for p in module.parameters())


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def local_value(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor: the full value of a DTensor (e.g. a grad norm reduced over shards), else itself."""
    dtensor = _dtensor_type()
    return tensor.full_tensor() if dtensor is not None and isinstance(tensor, dtensor) else tensor


def full_model_state(draft: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict, on CPU and contiguous, for rank 0 (the other ranks get {}).
    Every rank calls it: for a sharded draft it is a collective."""
    if is_sharded(draft):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = get_model_state_dict(draft, options=_full_options(rank0_only=True))
    else:
        state = draft.state_dict() if _rank() == 0 else {}
    # floating tensors in fp32 (the frozen embedding is held in the training dtype), as every checkpoint has them
    return {k: _as_saved(v.detach().contiguous().cpu()) for k, v in state.items()}


def _as_saved(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float() if tensor.is_floating_point() else tensor


def _param_names(draft: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The draft's name of every optimizer parameter, in the optimizer's id order."""
    names = {id(p): name for name, p in draft.named_parameters()}
    params = list(chain.from_iterable(g["params"] for g in optimizer.param_groups))
    strangers = [i for i, p in enumerate(params) if id(p) not in names]
    if strangers:
        raise ValueError(
            f"optimizer parameters {strangers}: not parameters of the draft; the optimizer must be built from "
            f"the draft's parameters after it was parallelized (eyas.train.make_optimizer)"
        )
    return [names[id(p)] for p in params]


def full_optimizer_state(draft: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """`optimizer.state_dict()` as an unsharded draft's optimizer gives it (integer ids), for rank 0 (the
    other ranks get {}). Every rank calls it: for a sharded draft it is a collective."""
    if not is_sharded(draft):
        return optimizer.state_dict() if _rank() == 0 else {}
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    by_name = get_optimizer_state_dict(draft, optimizer, options=_full_options(rank0_only=True))
    if not by_name:
        return {}
    ids = {name: i for i, name in enumerate(_param_names(draft, optimizer))}
    groups = [{**g, "params": [ids[name] for name in g["params"]]} for g in by_name["param_groups"]]
    return {"state": {ids[name]: s for name, s in by_name["state"].items()}, "param_groups": groups}


def load_full_model_state(draft: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load an unsharded state dict (the same on every rank); a sharded draft keeps its own shards."""
    if is_sharded(draft):
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(draft, state, options=_full_options(rank0_only=False))
    else:
        draft.load_state_dict(state, strict=True)


def load_full_optimizer_state(draft: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load an unsharded `optimizer.state_dict()` (integer ids; the same on every rank)."""
    if not is_sharded(draft):
        optimizer.load_state_dict(state)
        return
    names = _param_names(draft, optimizer)
    ids = sorted(chain.from_iterable(g["params"] for g in state["param_groups"]))
    if ids != list(range(len(names))):
        raise ValueError(
            f"optimizer state: parameter ids {ids}, expected 0..{len(names) - 1} for the draft's "
            f"{len(names)} trainable parameters ({', '.join(names)}); the state belongs to another model"
        )
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]
    by_name = {"state": {names[i]: s for i, s in state["state"].items()}, "param_groups": groups}
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(draft, optimizer, by_name, options=_full_options(rank0_only=False))
    # the round trip through DCP turns tuples (AdamW's betas) into lists: keep the saved values as they were
    for group, saved in zip(optimizer.param_groups, state["param_groups"], strict=True):
        group.update({k: v for k, v in saved.items() if k != "params"})
