"""FSDP1 and FSDP2: the sharding interface (sharding.py) over several processes, picked once from fsdp.strategy.

`FSDP1` (FullyShardedDataParallel) and `FSDP2` (fully_shard) shard each model as the original DPO FSDPTrainer did:
every transformer block its own unit, FULL_SHARD, BACKWARD_PRE prefetch (FSDP1), MixedPrecision, NO_REENTRANT
activation checkpointing per block; rank 0 loads the weights and the others build empty (meta) models that rank 0's
values fill. Every torch.distributed call of training is here, in utils.py's helpers or in ulysses.py. Its own file:
a one-process run never reads it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    CPUOffloadPolicy,
    FSDPModule,
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardingStrategy,
    fully_shard,
)
from torch.distributed.fsdp._flat_param import HandleShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy

from config import dtype_of
from sharding import OneProcess, block_classes, checkpoint_blocks, loadable, unwrap
from utils import all_gather_if_needed, all_ranks_true, rank0_print, wait_for_rank0

# sampling gathers the whole model once where it takes at most this share of every rank's free memory: the rest is
# for generation's KV cache and activations
GATHER_SHARE = 0.75
# FSDP1's strategies that free a unit's gathered parameters after its forward -> the same without that free
KEEP_GATHERED = {
    HandleShardingStrategy.FULL_SHARD: HandleShardingStrategy.SHARD_GRAD_OP,
    HandleShardingStrategy.HYBRID_SHARD: HandleShardingStrategy._HYBRID_SHARD_ZERO2,
}


class Sharded(OneProcess):
    """What FSDP1 and FSDP2 share: mesh, units, collectives, sampling, offloaded optimizer state, sharded checkpoints
    (torch.distributed.checkpoint reads either's)."""

    autocasts = False
    saves_weights = True

    def __init__(self, fsdp, device: torch.device, rank: int, world_size: int, policy: nn.Module):
        self.fsdp = fsdp
        self.device = device
        self.rank = rank
        self.world_size = world_size
        size = fsdp.fsdp_size  # 1 <= fsdp_size < world: a 2-D mesh, replicate x shard (hybrid)
        shape = (world_size,) if size in (-1, world_size) else (world_size // size, size)
        self.mesh = init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard")[-len(shape) :])
        mnp = fsdp.wrap_policy.get("min_num_params")  # a size policy, else the block classes that become units
        self.blocks = ("min_num_params", mnp) if mnp is not None else block_classes(policy, fsdp.wrap_policy)
        self.gathered_bytes = {}  # sharded model -> bytes of all its parameters gathered, in the dtype it computes in
        self.told = set()  # the models whose sampling fell back to gathering per forward, said once each
        units = self.blocks if isinstance(self.blocks, tuple) else sorted(b.__name__ for b in self.blocks)
        rank0_print(
            f"sharding policy with {fsdp.strategy} (units {units}, mesh {tuple(self.mesh.shape)}, "
            f"reshard_after_forward {fsdp.reshard_after_forward}, mixed precision {fsdp.mixed_precision}, "
            f"offload params {fsdp.param_offload}/policy {fsdp.offload_policy})"
        )

    def mixed_precision_dtypes(self) -> Optional[dict[str, torch.dtype]]:
        """fsdp.mixed_precision as torch dtypes (config.FSDPEngineConfig.mixed_precision_dtypes: its defaults)."""
        names = self.fsdp.mixed_precision_dtypes()
        return None if names is None else {k: dtype_of(v) for k, v in names.items()}

    def input_device(self, model: nn.Module) -> torch.device:
        return self.device

    def all_true(self, flag: bool) -> bool:
        return all_ranks_true(flag, self.device)

    def agree_max(self, n: int) -> int:
        count = torch.tensor([n], device=self.device)  # on the device: NCCL reduces CUDA tensors only
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return int(count.item())

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return all_gather_if_needed(tensor, self.rank, self.world_size)

    def gather_objects(self, items: list, sp_size: int = 1) -> list:
        out = [None] * self.world_size
        dist.all_gather_object(out, items)
        return [x for part in out[::sp_size] for x in part]

    def barrier(self) -> None:
        wait_for_rank0()

    @contextlib.contextmanager
    def sampling(self, model: nn.Module):
        """Inside, a unit gathered by a forward stays gathered (keep_gathered): the first forward all-gathers each unit
        once, and every later forward and generated token reuses them; on exit all reshard. Where the whole model in
        the dtype it computes in does not fit in GATHER_SHARE of the free memory of every rank (one decision for all:
        their forwards are collectives), each forward gathers its units as in training, as said once per model. The
        forwards are training's own (FSDP's casts and hooks), so the samples do not change."""
        need = self.gathered_bytes.get(model, 0)
        free = -self.agree_max(-free_memory(self.device))  # the tightest rank's
        if need > GATHER_SHARE * free:
            if model not in self.told:
                self.told.add(model)
                rank0_print(
                    f"sampling: {type(unwrap(model)).__name__} gathered whole ({need / 2**20:.1f} MiB) does not fit "
                    f"in {GATHER_SHARE:.0%} of the {free / 2**20:.1f} MiB free on the tightest rank: each forward "
                    "gathers its units (one all-gather per unit per generated token)"
                )
            yield
            return
        try:
            with self.keep_gathered(model):
                yield
        finally:
            self.reshard(model)

    def generate(self, model: nn.Module, **kwargs) -> torch.Tensor:
        """Every rank runs as many forwards (synced_gpus: the original's sampling hung when ranks stopped at different
        lengths) over whole prompts (Ulysses paused), through the root unit: `generate` calls the causal LM's own
        `self(...)` (FSDP1: inside the wrapper; LoRA: the PeftModel's base model), skipping the root's pre-forward."""
        inner = unwrap(model)
        lm = inner.get_base_model() if hasattr(inner, "get_base_model") else inner

        def forward(*args, **inputs):
            del lm.forward  # the root calls down to lm's class forward this time
            try:
                return model(*args, **inputs)
            finally:
                lm.forward = forward

        if lm is not model:  # else (FSDP2 without LoRA) generate's call is the root's already
            lm.forward = forward
        import ulysses  # its attention hook, installed or not, stands aside while every rank generates

        try:
            with ulysses.paused():
                return model.generate(**kwargs, synced_gpus=True)
        finally:
            if lm is not model:
                del lm.forward

    def forward(self, model: nn.Module, fn, inputs: dict, **options):
        """fn(model, inputs, **options) as the root unit's forward: between its pre-forward (which gathers the
        embeddings, final norm and LM head: the tiled head calls the backbone and reads the head's weight directly) and
        its post-forward (which hooks the backward on the returned sums); `call` runs the model's class forward, not the
        root's again. Nothing wrapped or renamed: state dicts keep their keys. The inputs go through the root's call:
        FSDP2's root pre-forward on CUDA moves its arguments to the device."""
        inner = unwrap(model)  # FSDP1 wraps, FSDP2 not
        call = functools.partial(type(inner).forward, inner)
        inner.forward = lambda inputs: fn(inner, inputs, call, **options)
        try:
            return model(inputs)
        finally:
            del inner.forward

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """With fsdp.optimizer_offload the optimizer state lives on CPU between steps (as verl), and comes for the step
        to each parameter's device (CPU too, under FSDP1's CPUOffload or FSDP2's CPUOffloadPolicy)."""
        if self.fsdp.optimizer_offload:
            move_optimizer_state(optimizer, None)
        optimizer.step()
        if self.fsdp.optimizer_offload:
            move_optimizer_state(optimizer, torch.device("cpu"))

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        # on CPU the full state dict must not offload (FSDP1 segfaults with offload_to_cpu there)
        state = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=torch.cuda.is_available())
        )
        return {k: v.detach().cpu() for k, v in state.items()} if self.rank == 0 else {}

    def sharded_state(self, model: nn.Module, optimizer, ckpt: Path) -> tuple[dict, str]:
        """Each rank's shards for torch.distributed.checkpoint, and their folder (a model alone: TR-DPO's reference)."""
        model_state, optim_state = get_state_dict(model, optimizer or ())
        if optimizer is None:
            return {"model": model_state}, str(ckpt / "reference_sharded")
        return {"model": model_state, "optimizer": optim_state}, str(ckpt / "sharded")

    def save(self, model: nn.Module, optimizer, ckpt: Path) -> None:
        state, where = self.sharded_state(model, optimizer, ckpt)
        dcp.save(state, checkpoint_id=where)

    def load(self, model: nn.Module, optimizer, ckpt: Path) -> None:
        state, where = self.sharded_state(model, optimizer, ckpt)
        dcp.load(state, checkpoint_id=where)
        set_state_dict(
            model,
            optimizer or (),
            model_state_dict=loadable(model, state["model"]),  # a quantized base: without bitsandbytes' constants
            optim_state_dict=state.get("optimizer", {}),
        )


class FSDP1(Sharded):
    """FullyShardedDataParallel: the model is wrapped, each unit one FlatParameter."""

    def shard(
        self, model: nn.Module, checkpoint: bool, mixed_precision: bool = True, reshard_after_forward: bool = True
    ) -> nn.Module:
        """The sharded model; `mixed_precision=False`: it computes in the dtype it was loaded in."""
        if self.fsdp.offload_policy:
            raise ValueError(
                "fsdp.offload_policy is FSDP2's CPUOffloadPolicy; with fsdp.strategy=fsdp use fsdp.param_offload"
            )
        dtypes = self.mixed_precision_dtypes() if mixed_precision else None
        full = gathered_bytes(model, dtypes)  # before wrapping flattens the parameters into shards
        if isinstance(self.blocks, tuple):
            size_policy = functools.partial(size_based_auto_wrap_policy, min_num_params=self.blocks[1])
            kept = never_units(model)
            policy = lambda module, recurse, **numel: (
                size_policy(module=module, recurse=recurse, **numel) and (recurse or module not in kept)
            )
        else:
            policy = ModuleWrapPolicy(self.blocks)
        hybrid = self.mesh.ndim == 2 and self.mesh.shape[1] > 1
        strategy = {
            (False, True): ShardingStrategy.FULL_SHARD,
            (False, False): ShardingStrategy.SHARD_GRAD_OP,
            (True, True): ShardingStrategy.HYBRID_SHARD,
            (True, False): ShardingStrategy._HYBRID_SHARD_ZERO2,
        }[hybrid, reshard_after_forward]
        if self.mesh.ndim == 2 and self.mesh.shape[1] == 1:
            strategy = ShardingStrategy.NO_SHARD  # fsdp_size=1: every rank holds everything
        on_gpu = self.device.type == "cuda"
        filled = getattr(model, "is_quantized", False)  # model.quantization: every rank loaded the weights itself
        if not on_gpu and not filled:  # FSDP1 refuses sync_module_states on CPU: rank 0's values are broadcast first
            if self.rank != 0:  # meta tensors given CPU memory and re-tied (the broadcast must see the same tensors)
                ties = tied_slots(model)
                model.to_empty(device="cpu")
                retie(ties)
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor.data, src=0)
        wrapped = FSDP(
            model,
            auto_wrap_policy=policy,
            sharding_strategy=strategy,
            device_id=self.device,
            cpu_offload=CPUOffload(offload_params=self.fsdp.param_offload and on_gpu),  # pinned memory: GPU only
            backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
            forward_prefetch=self.fsdp.forward_prefetch,
            mixed_precision=MixedPrecision(**dtypes) if dtypes else None,
            use_orig_params=self.fsdp.use_orig_params,
            # the rate limiter keeps the CPU from issuing all-gathers far ahead of the GPU; torch advises
            # it off only for CPU-bound runs with low memory pressure, as gloo on CPU
            limit_all_gathers=on_gpu,
            # on GPU the other ranks' meta tensors get memory per unit, filled with rank 0's values
            sync_module_states=on_gpu and not filled,
            param_init_fn=materialize(self.device, tied_slots(model)) if on_gpu else None,
            device_mesh=self.mesh if hybrid else None,
        )
        if on_gpu and not filled:  # sync_module_states may skip buffers across shard groups (torch < 2.11, hybrid)
            for buffer in wrapped.buffers():
                dist.broadcast(buffer, src=0)
        if checkpoint:  # as the original: after wrapping, each block recomputes its activations in backward
            checkpoint_blocks(wrapped, self.fsdp.wrap_policy)
        self.gathered_bytes[wrapped] = full
        return wrapped

    @contextlib.contextmanager
    def keep_gathered(self, model: nn.Module):
        """Every unit keeps its parameters gathered after a forward, as SHARD_GRAD_OP does: the strategy each unit's
        handle reads after its forward (KEEP_GATHERED), swapped for the context (summon_full_params would gather
        them in full precision, not in fsdp.mixed_precision's param_dtype the forwards compute in)."""
        handles = [unit._handle for unit in FSDP.fsdp_modules(model) if unit._handle is not None]
        kept = [handle._sharding_strategy for handle in handles]
        for handle in handles:
            handle._sharding_strategy = KEEP_GATHERED.get(handle._sharding_strategy, handle._sharding_strategy)
        try:
            yield
        finally:
            for handle, strategy in zip(handles, kept):
                handle._sharding_strategy = strategy

    def gradient_sync(self, model: nn.Module, sync: bool):
        return contextlib.nullcontext() if sync else model.no_sync()

    def tensors(self, model: nn.Module) -> list[torch.Tensor]:
        """Also each flat parameter (not a parameter of the model under use_orig_params) and its copies beside it
        (_local_shard, _full_param_padded, _mp_shard, _cpu_grad...)."""
        flat = [unit._handle.flat_param for unit in FSDP.fsdp_modules(model) if unit._handle is not None]
        copies = [t for p in flat for t in vars(p).values() if isinstance(t, torch.Tensor)]
        return [*super().tensors(model), *flat, *copies]

    def clip(self, model: nn.Module, max_norm: float) -> float:
        return model.clip_grad_norm_(max_norm).item()

    def reshard(self, model: nn.Module) -> None:
        """FSDP1 keeps the root unit's gathered parameters after a forward (for the backward), every unit's under
        SHARD_GRAD_OP, and its next forward reuses them without gathering."""
        for unit in FSDP.fsdp_modules(model):
            handle = unit._handle  # before the first forward: nothing gathered, and no _local_shard to go back to
            if handle is not None and handle.uses_sharded_strategy and hasattr(handle.flat_param, "_local_shard"):
                handle.reshard(free_unsharded_flat_param=True)


class FSDP2(Sharded):
    """fully_shard: the model keeps its class, its parameters become DTensors, each unit's hooks all-gather."""

    def shard(
        self, model: nn.Module, checkpoint: bool, mixed_precision: bool = True, reshard_after_forward: bool = True
    ) -> nn.Module:
        dtypes = (self.mixed_precision_dtypes() if mixed_precision else None) or {}  # {}: no cast, FSDP2's default
        mp = MixedPrecisionPolicy(param_dtype=dtypes.get("param_dtype"), reduce_dtype=dtypes.get("reduce_dtype"))
        if dtypes and self.fsdp.mixed_precision.get("buffer_dtype") is not None:  # FSDP2 casts no buffers: once, here
            for buffer in filter(torch.is_floating_point, model.buffers()):
                buffer.data = buffer.data.to(dtypes["buffer_dtype"])
        # model.quantization: every rank loaded and quantized the same weights (train.load_models), whose bitsandbytes
        # constants, attributes of each layer, neither `to("meta")` nor a scatter keeps: sharded as they are
        scatter = not getattr(model, "is_quantized", False)
        ties = tied_slots(model)  # before `to("meta")`, which gives each module its own Parameter
        self.gathered_bytes[model] = gathered_bytes(model, dtypes)
        full_state = model.state_dict() if self.rank == 0 and scatter else {}  # only rank 0 loaded weights
        buffers = {name: b.clone() for name, b in model.named_buffers()} if self.rank == 0 and scatter else {}
        if self.rank == 0 and scatter:
            model.to("meta")  # every rank shards the same empty structure, then rank 0's values are scattered
            retie(ties)
        if checkpoint:  # before sharding: each sharded unit is then the checkpointed block
            checkpoint_blocks(model, self.fsdp.wrap_policy)
        if isinstance(self.blocks, tuple):
            units = size_based_modules(model, self.blocks[1])
        else:  # each block, or the checkpoint wrapper around it (a checkpointed block's unit)
            wrapper = {m._checkpoint_wrapped_module: m for m in model.modules() if isinstance(m, CheckpointWrapper)}
            units = [wrapper.get(m, m) for m in model.modules() if isinstance(m, tuple(self.blocks))]
        offload = (
            CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if self.fsdp.offload_policy else OffloadPolicy()
        )
        for unit in (*units, model):  # on a 2-D mesh: replicate over the first dimension, shard over the second
            fully_shard(
                unit, mesh=self.mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp, offload_policy=offload
            )
        if scatter:
            model.to_empty(device="cpu" if self.fsdp.offload_policy else self.device)
            retie(ties)  # a tied embedding must be ONE sharded Parameter on every rank
            set_model_state_dict(
                model, full_state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            )
            for name, buffer in model.named_buffers():  # non-persistent buffers (rotary tables): not in the state dict
                if self.rank == 0:
                    buffer.copy_(buffers[name])
                dist.broadcast(buffer, src=0)
        if self.fsdp.forward_prefetch:  # FSDP2 prefetches explicitly: each unit all-gathers the next one early
            for unit, following in zip(units, units[1:]):
                unit.set_modules_to_forward_prefetch([following])
        return model

    def gradient_sync(self, model: nn.Module, sync: bool):
        model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def keep_gathered(self, model: nn.Module):
        """Every unit keeps its parameters gathered after a forward: what set_reshard_after_forward(False) sets (each
        parameter group's post-forward mesh: None), put back as it was on exit (the root's is FSDP2's own choice)."""
        groups = [
            g for m in model.modules() if isinstance(m, FSDPModule) for g in m._get_fsdp_state()._fsdp_param_groups
        ]
        kept = [group.post_forward_mesh_info for group in groups]
        for group in groups:
            group.post_forward_mesh_info = None
        try:
            yield
        finally:
            for group, mesh in zip(groups, kept):
                group.post_forward_mesh_info = mesh

    def clip(self, model: nn.Module, max_norm: float) -> float:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        return (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item()

    def reshard(self, model: nn.Module) -> None:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    @contextlib.contextmanager
    def params_on_device(self, model: nn.Module):
        """fsdp.param_offload: the (sharded) parameters live on CPU between steps and evaluations, as verl's (FSDP1
        uses its own CPUOffload instead)."""
        if self.fsdp.param_offload:
            model.to(self.device)
        try:
            yield
        finally:
            if self.fsdp.param_offload:
                model.to("cpu")


SHARDINGS = {"fsdp": FSDP1, "fsdp2": FSDP2}  # fsdp.strategy -> implementation


def spread(policy: nn.Module, reference: Optional[nn.Module], c, rank: int, world_size: int) -> tuple:
    """FSDPTrainer's (sharding, policy, reference, Ulysses group or None): the engine fsdp.strategy names, on this
    rank's device, and both models sharded by it (the reference in its own compute dtype, config.reference_mixed);
    Ulysses installed first, as recomputed blocks attend through it."""
    if not dist.is_initialized():
        raise RuntimeError("FSDPTrainer needs a process group (train.py starts one)")
    # torch's deprecation chatter from inside FSDP state-dict code, once per tensor per rank
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    warnings.filterwarnings("ignore", message=r".*_get_pg_default_device.*|.*Multiple backends are registered.*")
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if on_gpu else torch.device("cpu")
    sp = None
    if c.fsdp.ulysses_sequence_parallel_size > 1:
        import ulysses  # sequence parallelism: off every other run's path

        sp = ulysses.make_group(device, world_size, c.fsdp.ulysses_sequence_parallel_size)
        for model in filter(None, (policy, reference)):
            ulysses.install(model, sp)
    sharding = SHARDINGS[c.fsdp.strategy](c.fsdp, device, rank, world_size, policy)
    policy = sharding.shard(policy, c.activation_checkpointing, reshard_after_forward=c.fsdp.reshard_after_forward)
    if reference is not None:
        reference = sharding.shard(reference, False, mixed_precision=c.reference_mixed)
    return sharding, policy, reference, sp


# --- Helpers of the two ---
def gathered_bytes(model: nn.Module, dtypes: Optional[dict]) -> int:
    """Bytes of all `model`'s parameters (a tied one once; meta ones count too) in the dtype its forwards compute in:
    fsdp.mixed_precision's param_dtype, else their own."""
    return sum(p.numel() * (dtypes or {}).get("param_dtype", p.dtype).itemsize for p in model.parameters())


def free_memory(device: torch.device) -> int:
    """Bytes this rank can still allocate: on a GPU its free memory and the allocator's cached blocks not in use; on
    CPU the machine's available memory (shared by the ranks on it)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type == "cpu":
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return 0  # a device whose free memory this does not read: gather per forward, as in training


def size_based_modules(model: nn.Module, min_num_params: int) -> list[nn.Module]:
    """Modules to shard under a size policy, leaves first, as FSDP1's size_based_auto_wrap_policy: a module is wrapped
    once the parameters no wrapped descendant holds reach min_num_params, unless never_units keeps it."""
    chosen = []
    kept = never_units(model)

    def remaining(module: nn.Module) -> int:
        n = sum(p.numel() for p in module.parameters(recurse=False)) + sum(remaining(c) for c in module.children())
        if module is not model and module not in kept and n >= min_num_params:
            chosen.append(module)
            return 0
        return n

    remaining(model)
    return chosen


def never_units(model: nn.Module) -> set[nn.Module]:
    """What a size policy never makes a unit: containers (ModuleList, ModuleDict: fully_shard refuses them, FSDP1's
    policy skips them) and every module holding the LM head's weight (the head, a tied input embedding, their parents).
    That weight stays in the root unit, as under the block policy: the tiled head reads it there, and a tied weight in
    a unit of its own is flattened again by FSDP1's root (embedding and head then train as two matrices) or shared by
    two FSDP2 groups (refused at the first forward)."""
    weight = getattr(model.get_output_embeddings(), "weight", None) if hasattr(model, "get_output_embeddings") else None
    return {
        m
        for m in model.modules()
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) or any(p is weight for p in m.parameters())
    }


def tied_slots(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Groups of (module, parameter name) that share one Parameter (a tied embedding): `to`, `to_empty` and
    per-module materialization give each module its own copy, `retie` restores the sharing."""
    groups: dict[int, list[tuple[nn.Module, str]]] = defaultdict(list)
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                groups[id(param)].append((module, name))
    return [slots for slots in groups.values() if len(slots) > 1]


def retie(ties: list[list[tuple[nn.Module, str]]]) -> None:
    """Point every slot of each group at one Parameter: the first that has memory (else the first)."""
    for slots in ties:
        params = [module._parameters[name] for module, name in slots]
        keep = next((p for p in params if not p.is_meta), params[0])
        for module, name in slots:
            module._parameters[name] = keep


def materialize(device: torch.device, ties: list):
    """FSDP1's param_init_fn, once per module of each unit: the module's meta tensors get real (uninitialized)
    memory, sharing a tied Parameter another module already has; sync_module_states then fills them."""

    def init(module: nn.Module) -> None:
        for name, param in module._parameters.items():
            if param is not None and param.is_meta:
                module._parameters[name] = nn.Parameter(torch.empty_like(param, device=device), param.requires_grad)
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_meta:
                module._buffers[name] = torch.empty_like(buffer, device=device)
        retie(ties)

    return init


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: Optional[torch.device]) -> None:
    """Every state tensor (not the step counters, which stay on CPU) to `device`, or with None to its parameter's."""
    for param, state in optimizer.state.items():
        target = param.device if device is None else device
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                # non_blocking only towards the GPU: a non-blocking copy to pageable CPU memory can be read early
                state[key] = value.to(target, non_blocking=target.type == "cuda")
