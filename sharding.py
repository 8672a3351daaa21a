"""How the trainer's models are spread over processes: the small interface the loop calls, and its plain behaviour.

`OneProcess` is the plain behaviour, in one process (nothing to sync, gather or agree on). `FSDP1` and `FSDP2`
implement the same interface over several processes; they live in fsdp.py, which FSDPTrainer imports when it picks one
from fsdp.strategy, so a one-process run reads no FSDP code.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from utils import find_block_class_names, get_block_class_from_model, rank0_print


class OneProcess:
    """The interface, in one process. gradient_sync(model, sync): the context of a micro-batch's backward (FSDP
    reduces its gradients across ranks when `sync`); clip: the norm before clipping (all shards together); all_true /
    any_true: one decision for all ranks (a CPU-GPU sync point); agree_max: the largest count over the ranks (all run as
    many collective forwards); gather: every rank's tensor along dim 0; gather_objects: every data-parallel rank's
    items; barrier: wait for rank 0's lone work (a timeout slow disks do not trip); forward: a whole forward of the
    model's (logps.forward_logps); reshard: free gathered parameters; params_on_device: offloaded parameters on device
    for a phase; sampling(model): the context of sampling from the model (its forwards and `generate`, no training
    step in it): FSDP gathers the parameters once for the whole context where they fit beside the shards, else each
    forward gathers its units as training does (one process: nothing); save / load: what a resume needs besides
    policy.pt (the optimizer state, or TR-DPO's reference); release: a model's memory freed for good (a precomputed
    reference)."""

    autocasts = True  # fsdp.mixed_precision in one process: torch.autocast (FSDP casts the parameters itself)
    saves_weights = False  # save writes no policy weights: a resume reads them from policy.pt (FSDP: its sharded files)

    def __init__(self, model: nn.Module, config):
        self.device = self.input_device(model)
        if config.activation_checkpointing:  # FSDP applies it while sharding
            checkpoint_blocks(model, config.fsdp.wrap_policy)

    def input_device(self, model: nn.Module) -> torch.device:
        return model.get_input_embeddings().weight.device  # device_map: the first GPU

    def gradient_sync(self, model: nn.Module, sync: bool):
        return contextlib.nullcontext()

    def all_true(self, flag: bool) -> bool:
        return flag

    def any_true(self, flag: bool) -> bool:
        return not self.all_true(not flag)

    def agree_max(self, n: int) -> int:
        return n

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def gather_objects(self, items: list, sp_size: int = 1) -> list:
        return items

    def barrier(self) -> None:
        pass

    def reshard(self, model: nn.Module) -> None:
        pass

    def params_on_device(self, model: nn.Module):
        return contextlib.nullcontext()

    def sampling(self, model: nn.Module):
        return contextlib.nullcontext()

    def generate(self, model: nn.Module, **kwargs) -> torch.Tensor:
        return model.generate(**kwargs)

    def forward(self, model: nn.Module, fn, inputs: dict, **options):
        """fn(model, inputs, **options), fn a whole forward such as logps.forward_logps (FSDP: inside the root
        unit's)."""
        return fn(model, inputs, **options)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def clip(self, model: nn.Module, max_norm: float) -> float:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item()

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The consolidated state dict on rank 0, on CPU ({} on the others; a collective under FSDP)."""
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}

    def save(self, model: nn.Module, optimizer, ckpt: Path) -> None:
        if optimizer is not None:
            torch.save(optimizer.state_dict(), ckpt / "optimizer.pt")
        else:
            torch.save(self.full_state_dict(model), ckpt / "reference.pt")

    def load(self, model: nn.Module, optimizer, ckpt: Path) -> None:
        if optimizer is not None:
            model.load_state_dict(loadable(model, torch.load(ckpt / "policy.pt", weights_only=True)["state"]))
            optimizer.load_state_dict(torch.load(ckpt / "optimizer.pt", weights_only=True))
        else:
            model.load_state_dict(torch.load(ckpt / "reference.pt", weights_only=True))

    def release(self, model: nn.Module) -> int:
        """Frees the memory of `model`'s parameters and buffers on this rank (under FSDP its shards and the copies FSDP
        keeps) and returns the bytes freed. Their storage is resized to 0, so it goes even where something still holds
        the tensors: FSDP1's flat parameters outlive `del` and gc.collect(), each holding its modules, whose views hold
        it as their base (a cycle through C++ that gc cannot see). The model is unusable afterwards: its tensors keep
        their shapes over no memory, and a forward raises (an all-gather from a freed shard would crash the process)."""
        model.register_forward_pre_hook(released, prepend=True)  # before FSDP2's all-gather hook
        self.reshard(model)  # gathered parameters back to their shards: FSDP frees the gathered copies
        storages = {}  # data pointer -> (storage, its tensors): tied weights and views share one, counted once
        for tensor in self.tensors(model):
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # FSDP2: this rank's shard
            if not local.is_meta:
                storages.setdefault(local.untyped_storage().data_ptr(), (local.untyped_storage(), []))[1].append(local)
        freed = sum(storage.nbytes() for storage, _ in storages.values())
        for storage, tensors in storages.values():
            if storage.resizable():
                storage.resize_(0)
            else:  # memory torch cannot resize (weights mapped from a safetensors file): gone with its last tensor
                for tensor in tensors:
                    tensor.data = tensor.new_empty(0)
        return freed

    def tensors(self, model: nn.Module) -> list[torch.Tensor]:
        """Every tensor whose storage `release` frees."""
        return [*model.parameters(), *model.buffers()]


def loadable(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` as `model` loads it: a quantized base's (model.quantization) without bitsandbytes' constants, which the
    model got by quantizing the same weights (lora.loadable)."""
    if not getattr(model, "is_quantized", False):
        return state
    import lora

    return lora.loadable(state)


def released(module: nn.Module, args) -> None:
    raise RuntimeError(f"this {type(module).__name__} was released (sharding's release): its weights are gone")


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside an FSDP1 wrapper (FSDP2 and one process: the model itself)."""
    return model.module if isinstance(model, FSDP) else model


def block_classes(model: nn.Module, wrap_policy: dict) -> set[type]:
    """The transformer block classes to wrap: fsdp.wrap_policy's names, else the model's _no_split_modules."""
    names = wrap_policy.get("transformer_layer_cls_to_wrap")
    if not names:  # the model's own: transformers models name their blocks in _no_split_modules
        names = find_block_class_names(model)
        rank0_print(f"blocks of {type(model).__name__}: {', '.join(names) or 'none named'} (its _no_split_modules)")
    if not names:
        candidates = sorted({type(m).__name__ for m in model.modules() if len(list(m.children())) > 1})
        raise ValueError(
            f"cannot tell which blocks of {type(model).__name__} to shard: set model.block_name "
            f"(or fsdp.wrap_policy.transformer_layer_cls_to_wrap); candidates: {', '.join(candidates)}"
        )
    return {get_block_class_from_model(model, n) for n in names}


def checkpoint_blocks(model: nn.Module, wrap_policy: dict) -> None:
    """Recompute each block (block_classes) in backward (NO_REENTRANT), as the original FSDPTrainer did (one process
    too); unlike the original, a failure to apply it is an error, not a printed warning."""
    units = tuple(block_classes(unwrap(model), wrap_policy))
    apply_activation_checkpointing(
        model,
        check_fn=lambda m: isinstance(m, units),
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
    )
    n = sum(isinstance(m, CheckpointWrapper) for m in model.modules())
    rank0_print(f"activation checkpointing (NO_REENTRANT) on {n} blocks of {', '.join(u.__name__ for u in units)}")
