"""The training machinery: loop, evaluation, sampling, logging, checkpoints.

Read top to bottom: batches -> sequence log-probs (forward_logps); optimizer and schedule; the trainer by concern
(Reference, EvaluationAndSampling, Checkpoints, MicroBatchLoss, and BasicTrainer, the loop, which inherits the
four); small pure helpers and checkpoint validation; then the distributed part: the Sharding interface with its
FSDP1 and FSDP2 implementations, picked once from fsdp.strategy (SHARDINGS), and FSDPTrainer.

`BasicTrainer` runs in one process (several GPUs: naive model parallel through `device_map`). `FSDPTrainer` shards
policy and reference with its Sharding object and overrides what the original FSDPTrainer overrode (wrapping,
clipping, saving, loading) and the few hooks where several processes differ from one (input device, gradient
sync, sampling, offloaded optimizer step, gathering, barriers, the non-finite decision, TR-DPO's sharded
reference). Every torch.distributed call of the training loop is in FSDPTrainer, the Sharding classes, utils.py's
small helpers or ulysses.py (sequence parallelism: the all-to-alls around attention and the sum of the slices'
log-probs, reached through forward_logps's `sequence_parallel`).

A step: the rank-local batch is split into `gradient_accumulation_steps` micro-batches; each runs ONE
policy forward over chosen and rejected concatenated (and one reference forward), the loss of each
micro-batch is divided by the number of micro-batches so that the summed gradient equals the gradient of
the mean loss over the whole batch; then clip, guard against non-finite values, step.
"""
from __future__ import annotations

import bisect
import contextlib
import functools
import gc
import hashlib
import json
import math
import os
import shutil
import signal
import socket
import sys
import threading
import time
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
import tqdm
import yaml
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl, CheckpointWrapper, apply_activation_checkpointing, checkpoint_wrapper)
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (BackwardPrefetch, CPUOffload, CPUOffloadPolicy, FSDPModule, FullyShardedDataParallel as FSDP,
                                    MixedPrecision, MixedPrecisionPolicy, OffloadPolicy, ShardingStrategy, fully_shard)
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy

import losses
import preference_datasets as data
import ulysses
from utils import (all_gather_if_needed, all_ranks_true, atomic_write_text, broadcast_object, dtype_of, find_block_class_names,
                   first_usable_dir, formatted_dict, fsync_dir, get_block_class_from_model, get_rng_state, rank0_print,
                   set_rng_state, use_shape_free_attention, wait_for_rank0)


def _wandb():
    """The one import not at the top: wandb takes ~1.4 s to import, and most runs (tests, debug=true,
    wandb.enabled=false) never log to it."""
    import wandb
    return wandb


CHECKPOINT_FORMAT = 1  # bumped when the files of a checkpoint change meaning


# ------------------------------------------------------------------------------------------------------
# Batches -> sequence log-probs
# ------------------------------------------------------------------------------------------------------
def pad_to_length(tensor: torch.Tensor, length: int, pad_value: int) -> torch.Tensor:
    """Right-pad the last dimension of `tensor` to `length` with `pad_value`."""
    if tensor.size(-1) >= length:
        return tensor
    pad = torch.full((*tensor.shape[:-1], length - tensor.size(-1)), pad_value, dtype=tensor.dtype, device=tensor.device)
    return torch.cat([tensor, pad], dim=-1)


def concatenated_inputs(batch: dict) -> dict[str, torch.Tensor]:
    """Stack chosen over rejected into one (2B, T) batch, so policy and reference each need ONE forward
    (under FSDP every forward is a round of all-gathers; one pass instead of two halves them)."""
    if "rejected_input_ids" not in batch:  # SFT batches carry only the target
        return {k: batch[f"chosen_{k}"] for k in ("input_ids", "attention_mask", "labels")}
    length = max(batch["chosen_input_ids"].size(1), batch["rejected_input_ids"].size(1))
    pads = {"input_ids": 0, "attention_mask": 0, "labels": -100}
    return {k: torch.cat([pad_to_length(batch[f"chosen_{k}"], length, p), pad_to_length(batch[f"rejected_{k}"], length, p)])
            for k, p in pads.items()}


def padded_inputs(inputs: dict[str, torch.Tensor], multiple: int = 1) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Model kwargs, labels (R, T) and the sequence each token belongs to (R, T; -1 on padding): one row each,
    T padded up to a multiple of `multiple` (the sequence-parallel size)."""
    length = -(-inputs["input_ids"].size(1) // multiple) * multiple
    pads = {"input_ids": 0, "attention_mask": 0, "labels": losses.IGNORE_INDEX}
    inputs = {k: pad_to_length(inputs[k], length, p) for k, p in pads.items()}
    n, t = inputs["input_ids"].shape
    owner = torch.arange(n, device=inputs["input_ids"].device)[:, None].expand(n, t)
    owner = torch.where(inputs["attention_mask"].bool(), owner, -1)
    return {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}, inputs["labels"], owner


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` in rows of at most `capacity` (>= the longest): longest first, each into the row it
    fills best (the least room left that still fits it), else a new row. O(n log n): rows are kept by room."""
    rows: list[list[int]] = []
    rooms: list[tuple[int, int]] = []  # (room left, row), sorted
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):  # stable: ties keep their order
        k = bisect.bisect_left(rooms, (lengths[i], -1))
        if k == len(rooms):
            rows.append([])
            room, row = capacity, len(rows) - 1
        else:
            room, row = rooms.pop(k)
        rows[row].append(i)
        bisect.insort(rooms, (room - lengths[i], row))
    return rows


def row_layout(lengths: list[int], capacity: int, attention_cost: float = 0.0, multiple: int = 1) -> list[list[int]]:
    """Sequences (indices of `lengths`) per packed row, the rows' width chosen for the fewest FLOPs.

    Every row is as wide as the widest, padding included: a batch of R rows of width W runs the backbone at R W
    positions and attention at R W^2 query-key pairs (the block-diagonal mask skips none), so its cost is
    R W (1 + attention_cost W), attention_cost = attention FLOPs per query-key pair over the backbone's FLOPs per
    position (trainers.attention_cost). Rows of `capacity` tokens leave up to a third of a small batch as
    padding: three rows of ~500 for 1200 tokens when the longest sequence is ~500. So row capacities from the
    longest sequence up (5% apart, and the total over 2-8 rows) are packed best-fit decreasing and the cheapest
    layout kept, among those whose attention matrices (R W^2: a boolean mask, eager attention's scores) are no
    larger than with rows of `capacity`. Widths round up to a multiple of `multiple` (sequence parallelism).
    Sharing a batch between FSDP ranks halves it, so this matters most there (benchmarks/fsdp_profile.py)."""
    longest, total = max(lengths), sum(lengths)

    def cost(rows: list[list[int]]) -> tuple[float, int]:
        width = -(-max(sum(lengths[i] for i in row) for row in rows) // multiple) * multiple
        return len(rows) * width * (1 + attention_cost * width), len(rows) * width ** 2

    best = best_fit_decreasing(lengths, max(capacity, longest))
    best_cost, budget = cost(best)
    widest = min(total, math.isqrt(budget))  # one row wider than this alone outgrows the budget
    capacities = {-(-total // k) for k in range(2, 9)}
    capacity = longest
    while capacity <= widest:
        capacities.add(capacity)
        capacity = max(capacity + 1, math.ceil(capacity * 1.05))
    for capacity in sorted(c for c in capacities if longest <= c <= widest):
        rows = best_fit_decreasing(lengths, capacity)
        flops, attention_matrices = cost(rows)
        if attention_matrices <= budget and flops < best_cost:
            best, best_cost = rows, flops
    return best


def packed_inputs(inputs: dict[str, torch.Tensor], capacity: int, multiple: int = 1,
                  attention_cost: float = 0.0) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """The same sequences without padding: packed into rows (row_layout: the width with the fewest FLOPs whose
    attention matrices are no larger than with rows of `capacity` tokens), position_ids
    restarting at 0 for each, attention confined to each sequence by a block-diagonal causal mask. Returns what
    `padded_inputs` returns. Sequences never share a row with padding in between, and only the row ends are
    padded (up to the widest row, a multiple of `multiple`)."""
    lengths = inputs["attention_mask"].sum(1).tolist()
    rows = row_layout(lengths, capacity, attention_cost, multiple)
    loads = [sum(lengths[i] for i in row) for row in rows]
    width, device = -(-max(loads) // multiple) * multiple, inputs["input_ids"].device
    shape = (len(rows), width)
    ids = torch.zeros(shape, dtype=torch.long, device=device)
    labels = torch.full(shape, -100, dtype=torch.long, device=device)
    positions = torch.zeros(shape, dtype=torch.long, device=device)
    owner = torch.full(shape, -1, dtype=torch.long, device=device)
    for r, members in enumerate(rows):
        start = 0
        for i in members:
            end = start + lengths[i]
            ids[r, start:end] = inputs["input_ids"][i, :lengths[i]]
            labels[r, start:end] = inputs["labels"][i, :lengths[i]]
            positions[r, start:end] = torch.arange(lengths[i], device=device)
            owner[r, start:end] = i
            start = end
    # Causal within each sequence. Padding (owner -1) attends to earlier padding: no row of the mask is empty (an
    # empty one gives NaN). One (R, T, T) allocation: the comparison, made causal in place.
    mask = (owner[:, :, None] == owner[:, None, :]).tril_()
    return {"input_ids": ids, "attention_mask": mask[:, None], "position_ids": positions}, labels, owner


def packed_attention_mask(mask: torch.Tensor, config):
    """The 4-D boolean mask (R or 1, 1, T, T) as each attention layer of `config` needs it. A model given a 4-D mask
    uses it as is, so (1) the sliding window (Mistral, Gemma2/3, Qwen2 with use_sliding_window) must be in it
    already: models with `layer_types` take one mask per layer type, the others slide in every layer; (2) eager
    attention adds the mask to the scores, so it must be additive (0 or a large negative), not boolean: bf16,
    half of fp32's bytes and the same range. A mask marked `causal_only` (ulysses.whole_row_inputs: a stand-in
    of no memory) stays as it is for full attention: the attention wrapper runs a causal kernel instead."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    causal_only = getattr(mask, "causal_only", False)
    masks = {"full_attention": mask}
    if window and (layer_types is None or "sliding_attention" in layer_types):
        t = mask.size(-1)  # query i sees keys i-window+1..i: a band, built in bool (no int64 position differences)
        band = torch.ones(t, t, dtype=torch.bool, device=mask.device).triu_(-(window - 1))
        masks["sliding_attention"] = band.tril_()[None, None] if causal_only else mask & band
    if getattr(config, "_attn_implementation", None) == "eager":
        low = torch.finfo(torch.bfloat16).min  # added to scores of any dtype it still zeroes the softmax
        masks = {k: m if getattr(m, "causal_only", False) else
                 torch.full(m.shape, low, dtype=torch.bfloat16, device=m.device).masked_fill_(m, 0.0) for k, m in masks.items()}
    if layer_types is not None:
        return masks
    return masks.get("sliding_attention", masks["full_attention"])


def lm_head_extras(config) -> dict:
    """What some LM heads do after the matmul (Cohere's logit_scale, Gemma's softcapping, Granite's scaling)."""
    scale = getattr(config, "logit_scale", None) or 1.0
    if getattr(config, "logits_scaling", None):
        scale /= config.logits_scaling
    return {"logit_scale": scale, "softcap": getattr(config, "final_logit_softcapping", None)}


def forward_logps(model: nn.Module, inputs: dict[str, torch.Tensor], *, packed_capacity: Optional[int] = None,
                  attention_cost: float = 0.0, tiled: bool = False, entropy: Optional[dict] = None, entropy_grad: bool = False,
                  sequence_parallel: Optional[ulysses.SequenceParallel] = None):
    """Per sequence: the summed log-probs of its labelled tokens (N,), their count (N,) and, with `entropy`
    (losses.entropy_from_logits kwargs), the policy's mean entropy over them (N,), else None.

    `packed_capacity` packs the sequences padding-free (packed_inputs; `attention_cost` sizes its rows). `tiled` runs only the backbone and
    projects the scored positions through the LM head in tiles (losses.linear_token_logps): no (rows, seq,
    vocab) logits ever exist. `sequence_parallel` (Ulysses, see ulysses.py): every rank of the group passes the
    same `inputs`, runs the model on its slice of the positions, and gets the whole sequences' results. None of
    the three changes what the log-probs are, only how they are computed.

    The ONE log-prob path of every trainer. Under FSDP (1 or 2) the whole computation runs as the forward of the
    root unit (as_root_forward): the root's pre-forward gathers the embeddings, final norm and LM head, so the
    tiled path may call the backbone and read the head's weight directly, and its post-forward hooks the
    backward on the returned sums. In one process the model is called as is.
    """
    options = dict(packed_capacity=packed_capacity, attention_cost=attention_cost, tiled=tiled, entropy=entropy, entropy_grad=entropy_grad,
                   sequence_parallel=sequence_parallel)
    inner = model.module if isinstance(model, FSDP) else model
    if not isinstance(model, FSDP) and not is_fsdp2_root(model):
        return sequence_logps(model, model, inputs, **options)
    # The inputs go through the root's call: FSDP2's root pre-forward on CUDA moves its arguments to the device
    # and fails on a call with none (torch 2.11: IndexError in _root_pre_forward); CPU skips that move.
    with as_root_forward(inner, lambda inputs: sequence_logps(inner, functools.partial(type(inner).forward, inner), inputs, **options)):
        return model(inputs)


def is_fsdp2_root(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule
    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def as_root_forward(inner: nn.Module, compute):
    """While inside, `inner`'s forward is `compute(inputs)`: calling the FSDP root with `inputs` (the FSDP1 wrapper
    of `inner`, or `inner` itself under FSDP2) runs the root unit's pre-forward, then `compute`, then its
    post-forward. Nothing is wrapped or renamed, so state dicts, checkpoints and the HF export keep the model's
    own keys."""
    inner.forward = compute
    try:
        yield
    finally:
        del inner.forward


def sequence_logps(model: nn.Module, call, inputs: dict[str, torch.Tensor], *, packed_capacity: Optional[int] = None,
                   attention_cost: float = 0.0, tiled: bool = False, entropy: Optional[dict] = None,
                   entropy_grad: bool = False, sequence_parallel: Optional[ulysses.SequenceParallel] = None):
    """forward_logps's computation on the causal LM `model`; `call(**kwargs)` runs its full forward (the model
    itself, or its class forward when already inside the root unit's forward)."""
    n = inputs["input_ids"].size(0)
    sp = sequence_parallel
    multiple = sp.size if sp else 1
    kwargs, labels, owner = (packed_inputs(inputs, packed_capacity, multiple, attention_cost) if packed_capacity
                             else padded_inputs(inputs, multiple))
    # Output t predicts token t+1: position t's target is labels[t+1], owned by that token's sequence. Aligned this
    # way, a row can be cut into slices of positions (sequence parallelism) and each slice scored on its own.
    targets = F.pad(labels[:, 1:], (0, 1), value=losses.IGNORE_INDEX)
    owner = F.pad(owner[:, 1:], (0, 1), value=-1)
    if sp:
        if not packed_capacity:
            kwargs = ulysses.whole_row_inputs(kwargs, targets.size(1))
        kwargs, targets, owner = ulysses.local_slice(kwargs, targets, owner, sp)
    if kwargs["attention_mask"].dim() == 4:
        kwargs["attention_mask"] = packed_attention_mask(kwargs["attention_mask"], model.config)
    # use_cache=False: training needs no KV cache, and a cache grows again when checkpointed blocks recompute.
    # Under device_map (several GPUs) the inputs sit on the first GPU, the backbone's output and the LM head on
    # the last: targets, the scored-position mask and the owners follow the tensor they index (`to` is free when
    # the devices are the same), so every op below runs on one device.
    if tiled:
        backbone = model.get_base_model().base_model if hasattr(model, "get_base_model") else model.base_model  # peft
        hidden = backbone(**kwargs, use_cache=False).last_hidden_state
        head = model.get_output_embeddings()
        # under autocast the backbone's output is in the compute dtype
        hidden = hidden.to(device=head.weight.device, dtype=head.weight.dtype)
        targets, owner = targets.to(hidden.device), owner.to(hidden.device)
        scored = targets != losses.IGNORE_INDEX
        out = losses.linear_token_logps(hidden[scored], head.weight, targets[scored], head.bias,
                                        with_entropy=entropy is not None, **lm_head_extras(model.config))
        logps, token_entropy = out if entropy is not None else (out, None)
    else:
        logits = call(**kwargs, use_cache=False).logits
        targets, owner = targets.to(logits.device), owner.to(logits.device)
        scored = targets != losses.IGNORE_INDEX
        logps = losses.target_logps(logits, targets)[scored]
        token_entropy = None
        if entropy is not None:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                token_entropy = losses.entropy_from_logits(logits, **entropy)[scored]
    owner = owner[scored]
    sums = logps.new_zeros(n).index_add(0, owner, logps)
    counts = torch.zeros(n, dtype=torch.long, device=owner.device).index_add(0, owner, torch.ones_like(owner))
    entropy_sums = None if token_entropy is None else token_entropy.new_zeros(n).index_add(0, owner, token_entropy)
    if sp:  # each rank scored its slice of every sequence: add the slices (differentiably)
        sums, counts = ulysses.sum_over_group(sums, sp), ulysses.sum_over_group(counts, sp)
        entropy_sums = None if entropy_sums is None else ulysses.sum_over_group(entropy_sums, sp)
    mean_entropy = None if entropy_sums is None else entropy_sums / counts.clamp(min=1)
    return sums, counts, mean_entropy


# ------------------------------------------------------------------------------------------------------
# Optimizer and schedule
# ------------------------------------------------------------------------------------------------------
OPTIMIZERS = {
    "RMSprop": lambda params, cfg: torch.optim.RMSprop(params, lr=cfg.lr),
    "AdamW": lambda params, cfg: torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                                   fused=cfg.fused_optimizer or None),
    "SGD": lambda params, cfg: torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay),  # for exact checks
}
DECAYS = {  # fraction of the peak learning rate after warmup, as a function of progress in [0, 1]
    "constant": lambda progress: 1.0,
    "linear": lambda progress: max(0.0, 1.0 - progress),
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))),
}


def lr_lambda(warmup_steps: int, total_steps: int, decay: str):
    """Linear warmup from 0 to the peak over `warmup_steps`, then `decay` until `total_steps`."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        return DECAYS[decay]((step - warmup_steps) / max(1, total_steps - warmup_steps))
    return factor


class Interrupted(Exception):
    """SIGTERM or SIGINT: the run stopped after a step and wrote a checkpoint to resume from."""

    def __init__(self, signum: int, step: int, examples: int, run_dir: Path):
        super().__init__(f"{signal.Signals(signum).name}: stopped at step {step} ({examples} pairs) with a checkpoint")
        self.signum, self.step, self.examples, self.run_dir = signum, step, examples, run_dir


@contextlib.contextmanager
def stop_on_signals(stop: dict):
    """Inside, SIGTERM (how SLURM and most schedulers preempt) and SIGINT (Ctrl-C) set stop["signal"] instead of
    ending the process: the loop finishes its step, writes a checkpoint and raises Interrupted. A second SIGINT
    stops at once, without a checkpoint. Outside the main thread (where Python delivers signals) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if stop["signal"] is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        stop["signal"] = signum
        rank0_print(f"{signal.Signals(signum).name}: stopping after this step, with a checkpoint (Ctrl-C again: now, without one)")
    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


class NonFiniteError(RuntimeError):
    """More than max_nonfinite_steps non-finite steps in a row: the run stops (after a checkpoint)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from: damaged, incomplete or of another run. Nothing was loaded."""


PROGRESS_EVERY_SECS = 30.0  # without a terminal: one plain progress line at most this often (and at the end)

# ------------------------------------------------------------------------------------------------------
# The trainer by concern: the reference, evaluation and sampling, checkpoints, the loss of a micro-batch; then
# BasicTrainer, the loop, which inherits them. Each part reads the trainer's state (self.config, self.policy, self.rank, ...) and
# calls its hooks (self.generate, self.barrier, ...): they are one object, written in five rooms.
# ------------------------------------------------------------------------------------------------------
class Reference:
    """The reference model: its log-probs (a forward, or the precomputed table), LoRA's adapters-off context, and
    TR-DPO's updates with their checkpoint files."""

    def reference_context(self):
        """Entered around every use of self.reference_model: under LoRA it is the policy, with the adapters off."""
        return unwrap(self.policy).disable_adapter() if self.lora else contextlib.nullcontext()

    def reference_logps(self, batch: dict, inputs: dict[str, torch.Tensor], split: str) -> Optional[torch.Tensor]:
        """Summed reference log-probs of chosen then rejected (2B,): from the precomputed table, or a forward."""
        if self.reference_tables:
            table = self.reference_tables["test" if split == "eval" else "train"][batch["example_index"]]  # (B, 2)
            return table[:, 0] if self.sft_mode else table.T.reshape(-1)  # chosen then rejected, as the forward
        if self.reference_model is None:
            return None
        with torch.no_grad(), self.reference_autocast(), self.reference_context():
            ref_inputs = {k: v.to(self.input_device(self.reference_model)) for k, v in inputs.items()}
            sums = forward_logps(self.reference_model, ref_inputs, **self.forward_options())[0]
        self.after_reference_forward()
        return sums

    def reference_autocast(self):
        """The reference computes as the policy does (fsdp.mixed_precision's param_dtype) unless
        model.reference_mixed_precision=false: then in model.reference_dtype."""
        return self.autocast() if reference_mixed_precision(self.config) else contextlib.nullcontext()

    # --- TR-DPO: the reference follows the policy ----------------------------------------------------------
    @torch.no_grad()
    def update_reference(self) -> bool:
        """Every ref_update.tau optimizer steps: ref <- alpha * policy + (1 - alpha) * ref (TR-DPO, Eq. 4 soft, Eq. 5
        hard with alpha = 1), in place, parameter by parameter. Under FSDP, policy and reference are sharded by the
        same code with the same units, so each rank's local shards of the two correspond element by element:
        the update is local, with no gather and no communication."""
        tau = self.config.ref_update.tau
        if tau is None or self.batch_counter % tau:
            return False
        # by name without wrapper prefixes: activation checkpointing wraps the policy's blocks, not the reference's
        policy = {clean_name(k): v for k, v in self.policy.named_parameters()}
        reference = {clean_name(k): v for k, v in self.reference_model.named_parameters()}
        if policy.keys() != reference.keys():
            raise RuntimeError(f"ref_update: policy and reference parameters differ: {sorted(policy.keys() ^ reference.keys())[:5]}")
        for name, ref in reference.items():
            ref, pol = local_tensor(ref), local_tensor(policy[name])
            if ref.shape != pol.shape:
                raise RuntimeError(f"ref_update: {name} is {tuple(pol.shape)} in the policy, {tuple(ref.shape)} in the reference")
            ref.lerp_(pol.to(ref.device, ref.dtype), self.config.ref_update.alpha)  # ref + alpha (policy - ref)
        return True

    def write_reference(self, tmp_dir: Path) -> None:
        """TR-DPO's reference is trained state: the checkpoint keeps it (reference.pt), so a resume is exact."""
        if self.config.ref_update.tau is not None and self.rank == 0:
            torch.save({k: v.detach().cpu() for k, v in self.reference_model.state_dict().items()}, tmp_dir / "reference.pt")

    def load_reference(self, ckpt: Path) -> None:
        if self.config.ref_update.tau is not None:
            self.reference_model.load_state_dict(torch.load(ckpt / "reference.pt", weights_only=True))

    # --- precomputed reference log-probs ---------------------------------------------------------------------
    def precompute_reference(self) -> None:
        """One pass of the reference over the pairs this run will use (train and eval), cached on disk, then the
        reference model is freed: training runs one model instead of two (and sampling shows the policy only)."""
        if not self.config.precompute_ref_log_probs or self.reference_model is None:
            return
        c = self.config
        n_train = self.n_train_pairs
        used = {i for idx in data.iter_batch_indices(n_train, batch_size=c.batch_size, shuffle=True, seed=self.seed,
                                                     n_epochs=c.n_epochs, n_examples=c.n_examples) for i in idx}
        self.reference_tables = {"train": self.reference_table("train", sorted(used)),
                                 "test": self.reference_table("test", None)}
        self.reference_model = None  # the tables replace it
        gc.collect()
        rank0_print(f"reference log-probs ready for {len(used)} train and {c.n_eval_examples} eval pairs; reference model freed")

    def reference_table(self, split: str, wanted: Optional[list[int]]) -> torch.Tensor:
        """(n_examples, 2) summed reference log-probs of chosen and rejected (NaN where never needed), cached
        under a key of model, archive, dtype, tokenizer and the tokenized examples themselves; a later run
        computes only the examples the cache lacks. `wanted` None = the eval examples."""
        examples, _ = data.load_tokenized(self.config.datasets, self.tokenizer, split, silent=True, **self.data_kwargs)
        if wanted is None:
            wanted = list(range(min(self.config.n_eval_examples, len(examples))))
        archive = Path(self.config.model.archive) if self.config.model.archive else None
        digest = hashlib.sha256(repr((self.config.model.name_or_path, self.config.model.reference_dtype or self.config.fsdp.model_dtype,
                                      archive and (str(archive.resolve()), archive.stat().st_size, archive.stat().st_mtime_ns),
                                      data.tokenizer_fingerprint(self.tokenizer), len(examples))).encode())
        for e in examples:
            digest.update(b"".join(bytes(memoryview(a)) for a in (e.prompt_ids, e.chosen_ids, e.rejected_ids) if a is not None))
        path = Path(self.data_kwargs["cache_dir"]).parent / "reference_logps" / f"{split}-{digest.hexdigest()[:16]}.pt"
        # Rank 0 decides what is cached and every rank takes its table: local_dirs may be node-local (another
        # node's disk may lack the file), and every rank must run the same forwards (collectives under FSDP).
        table = None
        if self.rank == 0:
            table = torch.load(path, weights_only=True) if path.exists() else torch.full((len(examples), 2), float("nan"))
        table = broadcast_object(table) if self.world_size > 1 else table
        missing = [i for i in wanted if math.isnan(table[i, 0])]
        rank0_print(f"reference log-probs of {split}: {len(wanted) - len(missing)} cached in {path}, {len(missing)} to compute")
        if missing:
            table[missing] = self.reference_pass(examples, missing)
            if self.rank == 0:
                path.parent.mkdir(parents=True, exist_ok=True)
                torch.save(table, path.with_suffix(".tmp"))
                os.replace(path.with_suffix(".tmp"), path)
        return table

    @torch.no_grad()
    def reference_pass(self, examples: list, indices: list[int]) -> torch.Tensor:
        """(len(indices), 2) reference sums; each data-parallel rank takes every dp_size-th example, and all ranks run
        the same number of forwards (under FSDP every forward is a collective)."""
        mine = rank_share(indices, self.dp_rank, self.dp_size)
        size = max(1, self.config.eval_batch_size // self.dp_size)
        values = []
        for start in tqdm.trange(0, len(mine), size, desc="reference log-probs", disable=not self.show_bars(), mininterval=10):
            batch = data.collate([examples[i] for i in mine[start:start + size]], self.tokenizer.pad_token_id)
            inputs = {k: v.to(self.input_device(self.reference_model)) for k, v in concatenated_inputs(batch).items()}
            with self.reference_context():
                sums = forward_logps(self.reference_model, inputs, **self.forward_options())[0].float().cpu()
            self.after_reference_forward()
            values.append(torch.stack([sums, sums], 1) if self.sft_mode else sums.view(2, -1).T)
        order = all_gather_if_needed(torch.tensor(mine), self.rank, self.world_size)
        gathered = all_gather_if_needed(torch.cat(values), self.rank, self.world_size)
        result = dict(zip(order.tolist(), gathered))
        return torch.stack([result[i] for i in indices])


class EvaluationAndSampling:
    """Metrics over the whole held-out set, samples from policy and reference, and their log record."""

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Metrics averaged over the whole eval set (all ranks), then samples from policy and reference."""
        self.policy.eval()
        collected = defaultdict(list)
        for batch in tqdm.tqdm(self.eval_batches, desc="Computing eval metrics", disable=not self.show_bars(), leave=False):
            _, metrics = self.get_batch_metrics(batch, "eval")
            valid = batch["valid"].to(self.device)
            for name, v in metrics.items():  # per row (or per completion of a row); the repeats are left out (NaN)
                collected[name].append(torch.where(valid.repeat(len(v) // len(valid)), v, float("nan")))
        mean = {name: all_gather_if_needed(torch.cat(v), self.rank, self.world_size).float().nanmean().item() for name, v in collected.items()}
        if self.config.sample_during_eval and self.config.n_eval_model_samples > 0:
            mean.update(self.sample_and_log())
        return mean

    def sample(self, model: nn.Module, batch: dict, seed: int) -> list[str]:
        """Sample completions of the batch's prompts (left-padded), decoded without the prompt.

        The draw uses its own random stream seeded by `seed`, and the training RNG is left as it was: samples
        are a function of (weights, prompts, seed), identical with or without a resume in between."""
        ids = batch["prompt_input_ids"].to(self.input_device(model))
        mask = batch["prompt_attention_mask"].to(ids.device)
        cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []  # device_map: any GPU
        with torch.random.fork_rng(devices=cuda):
            torch.manual_seed(seed)  # seeds the CPU and every CUDA generator, restored on exit
            out = self.generate(model, input_ids=ids, attention_mask=mask, max_new_tokens=self.config.max_new_tokens,
                                do_sample=True, temperature=self.config.temperature, top_p=self.config.top_p,
                                pad_token_id=self.tokenizer.pad_token_id)
        return self.tokenizer.batch_decode(out[:, ids.size(1):], skip_special_tokens=True)

    def sample_and_log(self) -> dict[str, float]:
        """Generate from policy and reference for the first n_eval_model_samples prompts (in groups, split over
        ranks); print three, write every one to run_dir/samples.jsonl (and a W&B table), and where the data has a
        checkable rule (the toy task) log the rate samples follow it."""
        rows = []
        for group, batch in self.sample_batches:  # as many on every rank: each generate is a collective under FSDP
            # The policy's stream depends on the examples seen; the frozen reference's does not (the same samples
            # at every eval), and at step 0 both streams are one: equal weights give equal samples.
            policy = self.sample(self.policy, batch, sampling_seed(self.seed, self.example_counter, max(group, 0)))
            reference = [None] * len(policy)
            if self.reference_model is not None:
                with self.reference_context():
                    reference = self.sample(self.reference_model, batch, sampling_seed(self.seed, 0, max(group, 0)))
                self.after_reference_forward()
            if group >= 0:
                rows += [(group, *row) for row in zip(batch["prompt"], policy, reference)]
        rows = [row[1:] for row in sorted(self.gather_objects(rows), key=lambda row: row[0])]  # in prompt order
        metrics = {}
        rule = data.sample_rule(self.config.datasets)
        for who, column in (("policy", 1), ("reference", 2)):
            samples = [row[column] for row in rows if row[column] is not None]
            if samples and rule is not None:
                metrics[f"samples/{who}_rule_rate"] = sum(map(rule, samples)) / len(samples)
        if self.rank == 0:
            for who, column in (("policy", 1), ("reference", 2)):
                for row in rows[:3]:
                    if row[column] is not None:
                        print(f"  {who} sample | {row[0]!r} -> {row[column]!r}")
            with open(self.run_dir / "samples.jsonl", "a") as f:
                f.writelines(json.dumps({"step": self.example_counter, "prompt": p, "policy": s, "reference": r}) + "\n"
                             for p, s, r in rows)
            if self.wandb_run is not None:
                table = _wandb().Table(columns=["step", "prompt", "policy", "reference"],
                                       data=[[self.example_counter, p, s, r or ""] for p, s, r in rows])
                self.wandb_run.log({"samples": table}, step=self.example_counter)
        return metrics

    def evaluate_and_log(self) -> None:
        rank0_print(f"Running evaluation after {self.example_counter} train examples")
        with self.params_on_device():
            metrics = self.evaluate()
        rank0_print(f"eval after {self.example_counter}: {formatted_dict(metrics)}")
        self.log(metrics)
        self.last_eval_metrics = metrics


class Checkpoints:
    """Writing a checkpoint atomically, validating one, and resuming from it (FSDPTrainer overrides the policy
    and optimizer state parts: sharded for resume, consolidated on rank 0)."""

    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu() for k, v in self.policy.state_dict().items()}

    def trainer_state(self) -> dict:
        return {"format": CHECKPOINT_FORMAT, "example_counter": self.example_counter, "batch_counter": self.batch_counter,
                "nonfinite_in_a_row": self.nonfinite_in_a_row, "nonfinite_total": self.nonfinite_total,
                "wandb_id": self.wandb_run.id if self.wandb_run is not None else None,
                "model": self.config.model.name_or_path, "datasets": list(self.config.datasets), "seed": self.seed,
                "batch_size": self.config.batch_size, "world_size": self.world_size}

    def write_checkpoint(self, tmp_dir: Path) -> None:
        """Every file of a checkpoint: what resume needs of each rank, then rank 0's consolidated policy."""
        self.write_resume_state(tmp_dir)
        self.write_reference(tmp_dir)
        state = self.policy_state_dict()  # under FSDP a collective: every rank takes part, rank 0 keeps the result
        if self.rank == 0:
            torch.save({"step_idx": self.example_counter, "state": state, "metrics": getattr(self, "last_eval_metrics", {})},
                       tmp_dir / "policy.pt")
            torch.save(self.scheduler.state_dict(), tmp_dir / "scheduler.pt")
            torch.save(self.trainer_state(), tmp_dir / "trainer_state.pt")
            self.export_hf(state, tmp_dir / "hf")

    def write_resume_state(self, tmp_dir: Path) -> None:
        """Optimizer state and RNG (one process: resume reloads policy.pt for the weights)."""
        torch.save(self.optimizer.state_dict(), tmp_dir / "optimizer.pt")
        torch.save(get_rng_state(), tmp_dir / "rng-0.pt")

    def export_hf(self, state: dict, out: Path) -> None:
        """A Hugging Face directory (safetensors + tokenizer) that plain `from_pretrained` loads. Under LoRA: the
        adapter alone (peft's format) in out/../adapter, and in `out` the base weights with the adapters merged."""
        model = unwrap(self.policy)
        if self.lora:
            model.save_pretrained(out.parent / "adapter", state_dict=state, safe_serialization=True)
            state = merged_lora_state(state, self.config.lora.alpha / self.config.lora.r, fan_in_fan_out_layers(model))
            model = model.get_base_model()
        model.save_pretrained(out, state_dict=state, safe_serialization=True)
        self.tokenizer.save_pretrained(out)

    def save_checkpoint(self) -> None:
        """run_dir/step-N/ written as step-N.tmp and renamed when complete; LATEST -> step-N swapped atomically.

        A kill at any point leaves either the previous LATEST or the new one, never a half-written one.
        """
        if self.config.debug:
            rank0_print("debug=true: skipping checkpoint")
            return
        final = self.run_dir / f"step-{self.example_counter}"
        tmp = self.run_dir / f"step-{self.example_counter}.tmp"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self.barrier()
        self.write_checkpoint(tmp)
        self.barrier()
        if self.rank == 0:
            write_manifest(tmp)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            link = self.run_dir / "LATEST.tmp"
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(final.name)
            os.replace(link, self.run_dir / "LATEST")
            fsync_dir(self.run_dir)
            rank0_print(f"checkpoint written: {final}")
        self.barrier()

    def maybe_resume(self) -> Optional[str]:
        """Restore weights, optimizer, schedule, RNG and data position from run_dir/LATEST when resuming."""
        if not self.config.resume_from:
            return None
        ckpt = validate_checkpoint(Path(self.config.resume_from) / "LATEST")
        state = torch.load(ckpt / "trainer_state.pt", weights_only=True)
        check_compatible(state, self.config, self.world_size)
        self.load_policy_and_optimizer(ckpt)
        self.load_reference(ckpt)
        self.scheduler.load_state_dict(torch.load(ckpt / "scheduler.pt", weights_only=True))
        self.apply_schedule()
        self.example_counter, self.batch_counter = state["example_counter"], state["batch_counter"]
        self.nonfinite_in_a_row, self.nonfinite_total = state["nonfinite_in_a_row"], state["nonfinite_total"]
        set_rng_state(torch.load(ckpt / f"rng-{self.rank}.pt", weights_only=True))
        self.truncate_metrics(self.example_counter)
        rank0_print(f"resumed from {ckpt.resolve()} at {self.example_counter} examples ({self.batch_counter} steps)")
        return state["wandb_id"] or ""

    def apply_schedule(self) -> None:
        """After loading: this run's lr and schedule (warmup, decay, total steps) from the loaded step on. The saved
        optimizer and scheduler state hold the learning rate the run was started with; a resume may change it."""
        before = [g["lr"] for g in self.optimizer.param_groups]
        self.scheduler.base_lrs = [self.config.lr] * len(self.optimizer.param_groups)
        for group, factor in zip(self.optimizer.param_groups, self.scheduler.lr_lambdas):
            group["initial_lr"], group["lr"] = self.config.lr, self.config.lr * factor(self.scheduler.last_epoch)
        self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]
        if before != self.scheduler._last_lr:
            rank0_print(f"resume: lr {before[0]:.6g} -> {self.scheduler._last_lr[0]:.6g} at step {self.scheduler.last_epoch} "
                        f"(lr={self.config.lr:g}, scheduler={self.config.scheduler}, warmup_steps={self.config.warmup_steps})")

    def truncate_metrics(self, step: int) -> None:
        """Drop the records logged after the checkpoint resumed from: the resumed run logs them again."""
        for path in (self.run_dir / "metrics.jsonl", self.run_dir / "samples.jsonl"):
            if self.rank == 0 and path.exists():
                kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
                atomic_write_text(path, "".join(line + "\n" for line in kept))

    def load_policy_and_optimizer(self, ckpt: Path) -> None:
        policy = torch.load(ckpt / "policy.pt", weights_only=True)
        self.policy.load_state_dict(policy["state"])
        self.optimizer.load_state_dict(torch.load(ckpt / "optimizer.pt", weights_only=True))


class MicroBatchLoss:
    """The loss of one micro-batch: policy and reference forwards (autocast, packed or tiled log-probs), the
    registered losses, the entropy bonus; and what a loss needs from the whole step first (KTO's KL point)."""

    def get_batch_metrics(self, batch: dict, split: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Mean loss of `batch` and its per-example metrics named as the original (`rewards_train/chosen`)."""
        inputs = {k: v.to(self.device) for k, v in concatenated_inputs(batch).items()}
        n = batch["chosen_input_ids"].size(0)
        entropy_grad = bool(self.config.loss.entropy_coeff)
        with self.autocast():
            sums, counts, entropy = forward_logps(self.policy, inputs, **self.forward_options(entropy_grad),
                                                  entropy=self.entropy_kwargs, entropy_grad=entropy_grad)
        paired = "rejected_input_ids" in batch  # SFT and unpaired (KTO) batches carry one sequence per example
        reference = {}
        ref_sums = self.reference_logps(batch, inputs, split)
        if ref_sums is not None:
            ref_sums = ref_sums.to(sums.device)
            reference = dict(reference_chosen_sum=ref_sums[:n], reference_rejected_sum=ref_sums[n:] if paired else None)
        rejected = dict(policy_rejected_sum=sums[n:], policy_rejected_len=counts[n:]) if paired else {}
        if self.unpaired:
            kl = batch["kl_reference_point"][:1] if "kl_reference_point" in batch else self.kl_reference_point(batch)
            rejected.update(kl=kl.to(sums.device), desirable=batch["desirable"].to(sums.device) if "desirable" in batch else None)
        out = losses.compute_loss(self.loss_names, self.config.loss.weights, self.config.loss,
                                  policy_chosen_sum=sums[:n], policy_chosen_len=counts[:n], **rejected, **reference)
        metrics = dict(out.metrics)
        metrics["entropy/chosen"] = entropy[:n].detach()
        if paired:
            metrics["entropy/rejected"] = entropy[n:].detach()
        loss = out.losses.mean()
        if entropy_grad:  # an entropy bonus, as verl's entropy_coeff: loss - c * H
            loss = loss - self.config.loss.entropy_coeff * entropy.mean()
        return loss, {split_name(k, split): v for k, v in metrics.items()}

    def autocast(self):
        """fsdp.mixed_precision in one process: the forward computes in its param_dtype (torch.autocast; the
        weights stay in model_dtype, and there is no gradient reduction for reduce_dtype to apply to)."""
        mp = self.config.fsdp.mixed_precision
        if mp is None or not self.autocasts:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype_of(mp.get("param_dtype", self.config.fsdp.dtype)))

    def forward_options(self, entropy_grad: bool = False) -> dict:
        """How log-probs are computed (never what they are): packed rows, the tiled LM head, sequence parallelism."""
        tiled = self.config.tiled_lm_head and not entropy_grad  # a differentiable entropy needs full logits
        return {"packed_capacity": self.config.max_length if self.config.padding_free else None,
                "attention_cost": attention_cost(self.model_shape, tiled), "tiled": tiled,
                "sequence_parallel": self.sequence_parallel}

    # --- KTO's KL reference point ---------------------------------------------------------------------------
    @torch.no_grad()
    def kl_reference_point(self, batch: dict) -> torch.Tensor:
        """KTO's z0 before clamping, Shape (1,): the mean policy-minus-reference log-ratio of the batch's mismatched
        (prompt, completion) rows (kl_* keys, see data.collate), over ALL ranks' rows of the step.

        Detached (no_grad) by definition, so it is computed once per step, before the micro-batches, and every
        micro-batch's loss uses the same value: the loss is the same for any split of the step (accumulation,
        ranks), unlike a per-micro-batch estimate. The rows are scored in the chunks a training step would use
        (max_tokens_per_microbatch, else gradient_accumulation_steps slices), so this pass needs no more activation
        memory than a training micro-batch.
        """
        rows = {k: batch[f"kl_{k}"] for k in ("input_ids", "attention_mask", "labels")}
        total = torch.zeros(2, dtype=torch.float64, device=self.device)  # (sum of log-ratios, rows)
        average = losses.average_log_prob(losses.LOSSES[self.loss_names[0]], self.config.loss)
        budget, n = self.config.max_tokens_per_microbatch, len(rows["input_ids"])
        parts = (token_groups(rows["attention_mask"].sum(1).tolist(), budget) if budget
                 else [list(range(n))[part] for part in even_slices(n, self.config.gradient_accumulation_steps)])
        real = len(parts)
        # the same number of forwards on every rank (each a collective under FSDP): repeats of a chunk, not counted
        parts += parts[:1] * (self.agreed_micro_batches(real) - real)
        for i, part in enumerate(parts):
            chunk = {k: v[part].to(self.device) for k, v in rows.items()}
            if part:  # cut to the chunk's longest row
                width = int(chunk["attention_mask"].sum(1).max())
                chunk = {k: v[:, :width] for k, v in chunk.items()}
            with self.autocast():
                sums, counts, _ = forward_logps(self.policy, chunk, **self.forward_options())
            if self.reference_model is not None and not self.config.loss.reference_free:
                ref = {k: v.to(self.input_device(self.reference_model)) for k, v in chunk.items()}
                with self.reference_autocast(), self.reference_context():
                    sums = sums - forward_logps(self.reference_model, ref, **self.forward_options())[0].to(sums.device)
                self.after_reference_forward()
            if i >= real:
                continue
            logratios = losses.sequence_logps(sums, counts, average)
            total += torch.stack([logratios.double().sum(), torch.tensor(float(len(logratios)), device=sums.device)]).to(total.device)
        # every rank's (sum, count): two numbers per rank, on self.device (NCCL gathers CUDA tensors only)
        total = all_gather_if_needed(total[None], self.rank, self.world_size).sum(0)
        return (total[0] / total[1]).float().reshape(1)

    def step_statistics(self, batch: dict) -> dict:
        """What a loss needs from the whole step before it is split into micro-batches: KTO's KL reference point,
        stored per row (so micro-batch splitting slices it like any other column), its kl_* rows dropped."""
        if not self.unpaired:
            return batch
        kl = self.kl_reference_point(batch)
        batch = {k: v for k, v in batch.items() if not k.startswith("kl_")}
        batch["kl_reference_point"] = kl.cpu().expand(len(batch["chosen_input_ids"])).clone()
        return batch


class BasicTrainer(MicroBatchLoss, Reference, EvaluationAndSampling, Checkpoints):
    """The loop in one process: micro-batches, loss, guarded optimizer step, logging, evaluation and checkpoint
    cadence. Several GPUs in one process: naive model parallel through `device_map`."""

    # What FSDPTrainer does differently, as facts rather than overrides: in one process fsdp.mixed_precision is
    # torch.autocast, and activation checkpointing wraps the blocks here.
    autocasts, checkpoints_when_built = True, True
    sequence_parallel: Optional[ulysses.SequenceParallel] = None  # FSDPTrainer's Ulysses group, if any

    def __init__(self, policy: nn.Module, config, seed: int, run_dir: str, reference_model: Optional[nn.Module] = None,
                 rank: int = 0, world_size: int = 1, tokenizer=None):
        """One process trains `policy` against the frozen `reference_model` (None for reference-free losses)."""
        self.config, self.seed, self.rank, self.world_size = config, seed, rank, world_size
        # Ranks that read different pairs: under Ulysses the `sp` ranks of a group read the same ones.
        self.sp_size = self.sequence_parallel.size if self.sequence_parallel else 1
        self.dp_rank, self.dp_size = rank // self.sp_size, world_size // self.sp_size
        self.run_dir = Path(run_dir)
        self.policy, self.reference_model, self.tokenizer = policy, reference_model, tokenizer
        self.lora = config.lora.r is not None
        if self.lora and losses.needs_reference(config.loss_names, config.loss.reference_free):
            # LoRA's reference is the policy itself with its adapters off (reference_context): one copy of the weights
            self.reference_model = policy
        self.loss_names = config.loss_names
        self.sft_mode = losses.is_sft_only(self.loss_names)
        self.unpaired = losses.is_unpaired(self.loss_names)  # KTO: labelled completions and a KL reference point
        self.device = self.input_device(policy)
        use_shape_free_attention(self.device)
        # The entropy is logged; it takes part in the gradient only with loss.entropy_coeff != 0. Compiling its
        # kernel pays on CUDA; on CPU the compile costs ~20 s per run for a logged figure, so null = CUDA only.
        use_compile = config.fsdp.use_torch_compile
        self.entropy_kwargs = dict(chunking=config.fsdp.entropy_from_logits_with_chunking,
                                   checkpointing=config.fsdp.entropy_checkpointing,
                                   use_compile=self.device.type == "cuda" if use_compile is None else use_compile)
        if not hasattr(self, "flops_params"):  # FSDPTrainer counts before sharding
            self.flops_params = flops_params(policy)
        self.model_shape = flops_shape(policy, self.flops_params)  # what executed_flops and row layouts need
        if config.activation_checkpointing and self.checkpoints_when_built:
            checkpoint_blocks(policy, tuple(block_classes(policy, config.fsdp.wrap_policy)))
        self.example_counter = 0  # training pairs seen, over all ranks: the x-axis of every plot
        self.batch_counter = 0    # optimizer steps taken (or skipped as non-finite)
        self.nonfinite_in_a_row = 0
        self.nonfinite_total = 0
        self.last_log = 0.0
        self.wandb_run = None
        self.stop = {"signal": None}  # set by SIGTERM / SIGINT (stop_on_signals): stop after the step with a checkpoint

        cache_dir = str(first_usable_dir(config.local_dirs) / "datasets")
        self.data_kwargs = dict(max_length=config.max_length, max_prompt_length=config.max_prompt_length,
                                sft_mode=self.sft_mode, cache_dir=cache_dir, truncation_mode=config.truncation_mode)
        eval_kwargs = self.data_kwargs
        if self.unpaired:
            self.data_kwargs = dict(self.data_kwargs, unpaired=True, pairs_to_unpaired=config.pairs_to_unpaired)
            # pairs_to_unpaired: training sees each pair as two labelled completions; eval keeps the pairs, so that
            # rewards_eval/accuracies ranks chosen over rejected as for DPO
            eval_kwargs = self.data_kwargs if not config.pairs_to_unpaired else eval_kwargs
        self.n_train_pairs = data.count_examples(config.datasets, tokenizer, split="train", silent=rank != 0, **self.data_kwargs)
        self.total_steps = data.num_steps(self.n_train_pairs, batch_size=config.batch_size, n_epochs=config.n_epochs,
                                          n_examples=config.n_examples)
        # Every one of the first n_eval_examples test pairs once (all of them if fewer), the last batch completed
        # with repeats that evaluation leaves out; a set smaller than eval_batch_size needs no full batch.
        n_test = data.count_examples(config.datasets, tokenizer, split="test", silent=True, **eval_kwargs)
        self.n_eval_pairs = min(n_test, config.n_eval_examples)
        per_rank = max(2 if self.unpaired else 1, -(-self.n_eval_pairs // self.dp_size))  # KTO: >= 2 rows for its KL
        self.eval_batch_size = min(config.eval_batch_size, per_rank * self.dp_size)
        self.eval_batches = data.get_eval_batches(
            config.datasets, tokenizer, batch_size=self.eval_batch_size, n_examples=config.n_eval_examples,
            rank=self.dp_rank, world_size=self.dp_size, silent=rank != 0, kl_rows=self.unpaired, **eval_kwargs)
        self.sample_batches = data.get_sample_batches(
            config.datasets, tokenizer, n_examples=config.n_eval_model_samples if config.sample_during_eval else 0,
            rank=self.dp_rank, world_size=self.dp_size, silent=True, **eval_kwargs)
        self.reference_tables: dict[str, torch.Tensor] = {}  # split -> (n_examples, 2) precomputed reference sums
        self.print_geometry()

    # --- hooks FSDPTrainer overrides ----------------------------------------------------------------------
    def input_device(self, model: nn.Module) -> torch.device:
        """Where inputs go: the device of the input embeddings (the first GPU under device_map)."""
        return model.get_input_embeddings().weight.device

    def no_sync(self, last_micro_batch: bool):
        return contextlib.nullcontext()  # one process: nothing to sync

    def after_reference_forward(self) -> None:
        pass  # one process: nothing gathered

    def params_on_device(self):
        return contextlib.nullcontext()  # one process: the parameters never leave their device

    def clip_gradient(self) -> float:
        return torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.config.max_grad_norm).item()

    def agreed_micro_batches(self, count: int) -> int:
        return count  # one process: nothing to line up

    def step_optimizer(self) -> None:
        self.optimizer.step()

    def generate(self, model: nn.Module, **kwargs) -> torch.Tensor:
        return model.generate(**kwargs)

    def gather_objects(self, items: list) -> list:
        return items  # one process: already everything

    def barrier(self) -> None:
        pass  # one process

    def all_ranks_finite(self, finite: bool) -> bool:
        return finite  # one process: its own decision

    def show_bars(self) -> bool:
        """tqdm bars only on rank 0 and only on a terminal: in a log file they are \r-redraw noise."""
        return self.rank == 0 and sys.stderr.isatty()

    # --- geometry ---------------------------------------------------------------------------------------
    def print_geometry(self) -> None:
        c = self.config
        per_rank = c.batch_size // self.dp_size
        ranks = (f"data-parallel {self.dp_size} (world size {self.world_size} = dp {self.dp_size} x sequence-parallel"
                 f" {self.sp_size})" if self.sp_size > 1 else f"world size {self.world_size}")
        unit = "completions" if self.unpaired else "pairs"  # KTO scores labelled completions
        eval_unit = "completions" if self.unpaired and not c.pairs_to_unpaired else "pairs"
        rank0_print(f"batch geometry: {c.batch_size} {unit} per step = {ranks}"
                    f" x accumulation {c.gradient_accumulation_steps} x micro-batch {per_rank // c.gradient_accumulation_steps}"
                    + (" on average (ranks get shares of near-equal FLOPs, not pairs);" if self.dp_size > 1 and c.balance_batch else ";") +
                    f" train {unit} {self.n_train_pairs}; total steps {self.total_steps}; eval {eval_unit} {self.n_eval_pairs}"
                    f" in batches of {self.eval_batch_size}")

    # --- one optimizer step ------------------------------------------------------------------------------
    def train_step(self, batch: dict) -> dict[str, float]:
        """Accumulate gradients over the micro-batches of this rank's batch, then one guarded step."""
        self.policy.train()
        batch = self.step_statistics(batch)
        budget = self.config.max_tokens_per_microbatch
        micro_batches = split_by_tokens(batch, budget) if budget else split_batch(batch, self.config.gradient_accumulation_steps)
        real = len(micro_batches)
        # Under FSDP every forward and backward is a collective: all ranks run the same number of micro-batches.
        # A rank with fewer token-budget micro-batches repeats its last one with weight 0 (no gradient, no metrics).
        micro_batches += [micro_batches[-1]] * (self.agreed_micro_batches(real) - real)
        # Each pair weighs 1 / (pairs per data-parallel rank on average): the summed gradient is that of this
        # rank's pairs' mean loss scaled by their share, and the average FSDP takes over ranks is the gradient of
        # the global batch's mean loss, however the batch was dealt (shares of near-equal FLOPs differ in count).
        per_rank = self.config.batch_size / self.dp_size
        step_metrics = defaultdict(list)
        for i, micro in enumerate(micro_batches):
            with self.no_sync(last_micro_batch=i == len(micro_batches) - 1):
                loss, metrics = self.get_batch_metrics(micro, "train")
                weight = len(micro["chosen_input_ids"]) / per_rank if i < real else 0.0
                (loss * weight).backward()
            if i < real:
                for name, v in metrics.items():
                    step_metrics[name].append(v.detach())
        # What the step's FLOPs are counted from (throughput): real tokens, the positions the LM head scores, and
        # the sum of squared sequence lengths (query-key pairs of attention).
        sides = [side for side in ("chosen", "rejected") if f"{side}_input_ids" in batch]
        lengths = torch.cat([batch[f"{side}_attention_mask"].sum(-1) for side in sides]).double()
        scored = sum(int((batch[f"{side}_labels"][:, 1:] != losses.IGNORE_INDEX).sum()) for side in sides)
        for name, value in (("tokens", lengths.sum().item()), ("scored_tokens", scored), ("attention_pairs", (lengths ** 2).sum().item())):
            step_metrics[name] = [torch.tensor([float(value)], device=self.device)]
        grad_norm = self.clip_gradient()
        finite = math.isfinite(grad_norm) and all(torch.isfinite(torch.cat(v)).all() for name, v in step_metrics.items() if name.startswith("loss"))
        finite = self.all_ranks_finite(finite)  # every rank steps, or every rank skips
        if finite:
            self.step_optimizer()
            self.scheduler.step()
            self.nonfinite_in_a_row = 0
        else:  # skip: parameters, optimizer state and schedule stay exactly as they were
            self.nonfinite_in_a_row += 1
            self.nonfinite_total += 1
            rank0_print(f"non-finite loss or gradient at step {self.batch_counter}: step skipped "
                        f"({self.nonfinite_in_a_row} in a row, {self.nonfinite_total} in total)")
        self.optimizer.zero_grad(set_to_none=True)
        # nanmean: a metric that does not apply to an example is NaN there (KTO's rewards/chosen on undesirable ones);
        # so are the NaN that pad each rank's per-pair values to one length for the gather (shares differ in count)
        mean = {name: all_gather_if_needed(nan_padded(torch.cat(v).float(), 2 * self.config.batch_size), self.rank,
                                           self.world_size).nanmean().item() for name, v in step_metrics.items()}
        for name in ("tokens", "scored_tokens", "attention_pairs"):
            mean[name] *= self.dp_size  # of the whole step, over all data-parallel ranks (real tokens, no padding)
        mean.update(grad_norm=grad_norm, lr=self.scheduler.get_last_lr()[0], nonfinite_steps=float(self.nonfinite_total))
        return mean

    # --- logging -----------------------------------------------------------------------------------------
    def init_logging(self, resumed_wandb_id: Optional[str]) -> None:
        if self.rank != 0 or self.config.debug or not self.config.wandb.enabled:
            return
        online = bool(os.environ.get("WANDB_API_KEY")) or Path("~/.netrc").expanduser().exists()
        mode = os.environ.get("WANDB_MODE") or ("online" if online else "offline")
        self.wandb_run = _wandb().init(entity=self.config.wandb.entity, project=self.config.wandb.project,
                                    name=self.config.exp_name, dir=str(self.run_dir), mode=mode,
                                    config=self.config.to_dict(), id=resumed_wandb_id, resume="allow" if resumed_wandb_id else None)

    def log(self, metrics: dict[str, float]) -> None:
        """One record: W&B (step = examples seen) and a line of run_dir/metrics.jsonl."""
        if self.rank != 0:
            return
        record = {"step": self.example_counter, **{k: v if math.isfinite(v) else None for k, v in metrics.items()}}
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record, allow_nan=False) + "\n")  # strict JSON: NaN/inf are logged as null
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=self.example_counter)

    # --- the loop ----------------------------------------------------------------------------------------
    def build_optimizer(self) -> None:
        self.optimizer = OPTIMIZERS[self.config.optimizer]([p for p in self.policy.parameters() if p.requires_grad], self.config)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(self.config.warmup_steps, self.total_steps, self.config.scheduler))

    def train_batches(self) -> Iterator[dict]:
        # balance_batch: each data-parallel rank's share of a step holds pairs of near-equal executed FLOPs
        # (data.balance_shares, share_flops), at least one per micro-batch (under FSDP each is a collective) and two for KTO's
        # mismatched KL rows; None = consecutive equal shares.
        c = self.config
        min_share = max(1 if c.max_tokens_per_microbatch else c.gradient_accumulation_steps,
                        2 if self.unpaired else 1) if c.balance_batch else None
        return data.get_batch_iterator(
            self.config.datasets, self.tokenizer, split="train", batch_size=self.config.batch_size, shuffle=True,
            n_epochs=self.config.n_epochs, n_examples=self.config.n_examples, rank=self.dp_rank,
            world_size=self.dp_size, start_example=self.example_counter, seed=self.seed, silent=True,
            kl_rows=self.unpaired, min_share=min_share, share_cost=self.share_flops if min_share else None,
            **self.data_kwargs)

    def share_flops(self, examples: list) -> float:
        """FLOPs of one policy forward over a rank's share of a step as train_step runs it (executed_flops): in
        micro-batches (the token budget, else gradient_accumulation_steps slices), each in the rows forward_logps
        lays out (packed: row_layout; padded: a row per sequence, as wide as the share's longest, or the micro-
        batch's under the token budget). What balance_batch evens out between the ranks (data.balance_shares)."""
        c, options = self.config, self.forward_options()
        lengths = [[len(e.prompt_ids) + len(r) for r in (e.chosen_ids, e.rejected_ids) if r is not None] for e in examples]
        scored = [sum(len(r) for r in (e.chosen_ids, e.rejected_ids) if r is not None) for e in examples]
        groups = (token_groups([sum(n) for n in lengths], c.max_tokens_per_microbatch) if c.max_tokens_per_microbatch
                  else [list(range(len(examples)))[part] for part in even_slices(len(examples), c.gradient_accumulation_steps)])
        share_width = max(n for sides in lengths for n in sides)
        flops = 0.0
        for group in filter(None, groups):
            sequences = [n for i in group for n in lengths[i]]
            if options["packed_capacity"]:
                rows = row_layout(sequences, options["packed_capacity"], options["attention_cost"], self.sp_size)
                n_rows, width = len(rows), max(sum(sequences[i] for i in row) for row in rows)
            else:
                n_rows, width = len(sequences), max(sequences) if c.max_tokens_per_microbatch else share_width
            head = sum(scored[i] for i in group) if options["tiled"] else n_rows * width
            flops += executed_flops(self.model_shape, n_rows * width, head, n_rows * width ** 2, passes=1)
        return flops

    def train(self) -> None:
        """Train until the data runs out; evaluate and checkpoint every eval_every pairs and at the end."""
        if self.config.fsdp.forward_only:  # no optimizer: evaluate (and sample) the loaded weights once
            self.init_logging(None)
            self.evaluate_and_log()
            return
        self.build_optimizer()
        self.precompute_reference()
        wandb_id = self.maybe_resume()
        self.init_logging(wandb_id)
        self.barrier()  # W&B starts on rank 0 alone (up to minutes online); the others wait here, not in a collective
        resumed_at = self.example_counter if self.config.resume_from else None  # its eval and save already happened
        bar = tqdm.tqdm(total=self.total_steps, initial=self.batch_counter, unit="step", disable=not self.show_bars(),
                        dynamic_ncols=True)
        last_progress = time.time()
        start, start_examples = time.time(), self.example_counter
        with stop_on_signals(self.stop):
            self.loop(bar, resumed_at, start, start_examples, last_progress)
        bar.close()
        if self.example_counter != resumed_at:
            self.evaluate_and_log()
            self.save_checkpoint()

    def loop(self, bar, resumed_at, start, start_examples, last_progress) -> None:
        """The steps, with evaluation and checkpoints every eval_every pairs (train's body)."""
        for batch in self.train_batches():
            if self.example_counter % self.config.eval_every == 0 and self.example_counter != resumed_at:
                if self.example_counter > 0 or self.config.do_first_eval:
                    self.evaluate_and_log()
                if self.example_counter > 0:
                    self.save_checkpoint()
            step_start = time.time()
            with self.params_on_device():
                metrics = self.train_step(batch)
            metrics.update(self.throughput(metrics.pop("tokens"), time.time() - step_start,
                                           metrics.pop("scored_tokens"), metrics.pop("attention_pairs")))
            self.batch_counter += 1
            self.example_counter += self.config.batch_size
            self.update_reference()
            rate = (self.example_counter - start_examples) / max(1e-9, time.time() - start)
            bar.update(1)
            bar.set_postfix(pairs_per_s=f"{rate:.2f}", loss=f"{metrics.get('loss/train', float('nan')):.4f}")
            if self.rank == 0 and bar.disable and (time.time() - last_progress >= PROGRESS_EVERY_SECS
                                                   or self.batch_counter == self.total_steps):
                # a log file gets plain lines instead of the bar's \r redraws
                print(f"progress: step {self.batch_counter}/{self.total_steps}, pairs seen {self.example_counter},"
                      f" pairs/s {rate:.2f}, loss/train {metrics.get('loss/train', float('nan')):.4f}", flush=True)
                last_progress = time.time()
            if time.time() - self.last_log >= self.config.minimum_log_interval_secs:
                self.log({**metrics, "examples_per_second": rate, "counters/examples": self.example_counter,
                          "counters/updates": self.batch_counter})
                self.last_log = time.time()
            if self.stop_agreed():  # SIGTERM or SIGINT on any rank: every rank stops after the same step
                self.save_checkpoint()
                raise Interrupted(self.stop["signal"] or signal.SIGTERM, self.batch_counter, self.example_counter, self.run_dir)
            if self.nonfinite_in_a_row > self.config.max_nonfinite_steps:
                self.save_checkpoint()
                raise NonFiniteError(f"{self.nonfinite_in_a_row} non-finite steps in a row (max_nonfinite_steps="
                                     f"{self.config.max_nonfinite_steps}); checkpoint saved at {self.run_dir / 'LATEST'}")

    def stop_agreed(self) -> bool:
        return self.stop["signal"] is not None  # one process: its own signal

    def throughput(self, tokens: float, seconds: float, scored_tokens: float = 0.0, attention_pairs: float = 0.0
                   ) -> dict[str, float]:
        """pairs/s, real tokens/s and two model FLOPs utilizations of one step, over the peak:

        throughput/mfu: the 6N rule, 6 N FLOPs per trained token plus 2 N per token through an online reference
            (N = parameters outside the input embedding), as usually reported; it counts the LM head at every
            token and no attention.
        throughput/mfu_executed: the matmuls the step runs on its real tokens (executed_flops): the LM head only
            at the positions it projects (the scored ones under tiled_lm_head), attention included.
        """
        if not hasattr(self, "peak_flops"):
            self.peak_flops, source = measure_peak_flops(self.config, self.device)
            rank0_print(f"MFU peak: {self.peak_flops / 1e12:.3f} TFLOP/s ({source})")
        reference = self.reference_model is not None
        per_token = 6 * self.flops_params + (2 * self.flops_params if reference else 0)
        head_positions = scored_tokens if self.forward_options()["tiled"] else tokens
        executed = executed_flops(self.model_shape, tokens, head_positions, attention_pairs,
                                  passes=3 + (1 if reference else 0))
        return {"throughput/pairs_per_second": self.config.batch_size / seconds, "throughput/tokens_per_second": tokens / seconds,
                "throughput/mfu": per_token * tokens / seconds / self.peak_flops,
                "throughput/mfu_executed": executed / seconds / self.peak_flops}



# ------------------------------------------------------------------------------------------------------
# Small pure helpers
# ------------------------------------------------------------------------------------------------------
def reference_mixed_precision(config) -> bool:
    """Whether the reference computes under fsdp.mixed_precision: model.reference_mixed_precision, and when null
    whenever the policy does (then both compute alike, and policy = reference gives exactly ln 2 at step 0)."""
    chosen = config.model.reference_mixed_precision
    return config.fsdp.mixed_precision is not None if chosen is None else chosen


def sampling_seed(seed: int, examples_seen: int, batch_index: int) -> int:
    """The seed of one eval batch's samples: a pure function of the run's seed, the training pairs seen and the
    batch, mixed by numpy's SeedSequence (so nearby inputs give unrelated streams)."""
    return int(np.random.SeedSequence([seed, examples_seen, batch_index]).generate_state(1)[0])


def flops_params(model: nn.Module) -> int:
    """N of the 6N-FLOPs-per-token rule: the parameters outside the input embedding (a lookup, not a matmul)."""
    return sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()


def flops_shape(model: nn.Module, n_params: int) -> dict[str, int]:
    """What executed_flops needs, from the model's config (readable on a sharded model too): parameters of the
    backbone's matmuls (`n_params` = flops_params less an untied LM head), of the LM head, layers and width."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    head = config.vocab_size * config.hidden_size
    tied = getattr(config, "tie_word_embeddings", False)  # then flops_params already left the head out
    return {"body": n_params - (0 if tied else head), "head": head, "layers": config.num_hidden_layers,
            "width": config.hidden_size}


def executed_flops(shape: dict[str, int], tokens: float, head_positions: float, attention_pairs: float,
                   passes: int) -> float:
    """Matmul FLOPs of one step's real tokens: per forward, 2 x backbone parameters per token, 2 x head
    parameters per position the LM head projects, and 4 x width per layer per query-key pair (QK^T and the
    weighted sum of V; no causal discount, as PaLM's appendix B); `passes` forwards' worth (3 = forward and
    backward of the policy, +1 for an online reference forward)."""
    forward = (2 * shape["body"] * tokens + 2 * shape["head"] * head_positions
               + 4 * shape["layers"] * shape["width"] * attention_pairs)
    return passes * forward


def attention_cost(shape: dict[str, int], tiled: bool) -> float:
    """executed_flops per query-key pair of attention over its FLOPs per position the row layout pays for (the
    backbone, and the LM head when it projects every position): what row_layout weighs wider rows with."""
    per_position = 2 * shape["body"] + (0 if tiled else 2 * shape["head"])
    return 4 * shape["layers"] * shape["width"] / per_position


def measure_peak_flops(config, device: torch.device) -> tuple[float, str]:
    """The matmul FLOP/s MFU divides by: `peak_tflops` if set, else measured here with square matmuls in the
    run's compute dtype (one second of work; an estimate of what this device reaches, not its datasheet)."""
    if config.peak_tflops:
        return config.peak_tflops * 1e12, "peak_tflops from the config"
    mp = config.fsdp.mixed_precision
    dtype = dtype_of(mp.get("param_dtype", config.fsdp.dtype) if mp else config.fsdp.model_dtype)
    n = 1024
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(3):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best, f"measured: best of 3 {n}x{n} {dtype} matmuls on {device}"


def split_name(name: str, split: str) -> str:
    """'rewards/chosen' -> 'rewards_train/chosen'; 'loss' -> 'loss/train' (the original's metric names)."""
    head, _, tail = name.partition("/")
    return f"{head}_{split}/{tail}" if tail else f"{head}/{split}"


def split_by_tokens(batch: dict, max_tokens: int) -> list[dict]:
    """Micro-batches of consecutive pairs whose real tokens (chosen + rejected) stay within `max_tokens` (a larger
    pair goes alone), each cut to its own longest sequence: a long pair costs what it weighs, not the padding of
    every short pair to its length."""
    sides = [s for s in ("chosen", "rejected") if f"{s}_attention_mask" in batch]
    sizes = sum(batch[f"{s}_attention_mask"].sum(1) for s in sides).tolist()
    micro_batches = []
    for group in token_groups(sizes, max_tokens):
        micro = {k: v[group] if torch.is_tensor(v) else [v[i] for i in group] for k, v in batch.items()}
        for s in sides:
            width = int(micro[f"{s}_attention_mask"].sum(1).max())
            for key in ("input_ids", "attention_mask", "labels"):
                micro[f"{s}_{key}"] = micro[f"{s}_{key}"][:, :width]
        micro_batches.append(micro)
    return micro_batches


def token_groups(sizes: list[int], max_tokens: int) -> list[list[int]]:
    """Consecutive indices of `sizes` in groups of at most `max_tokens` (a larger item goes alone)."""
    groups, load = [[]], 0
    for i, size in enumerate(sizes):
        if groups[-1] and load + size > max_tokens:
            groups.append([])
            load = 0
        groups[-1].append(i)
        load += size
    return groups


def even_slices(n: int, k: int) -> list[slice]:
    """k consecutive slices of range(n) whose sizes differ by at most one (empty ones when n < k)."""
    return [slice(i * n // k, (i + 1) * n // k) for i in range(k)]


def split_batch(batch: dict, k: int) -> list[dict]:
    """k micro-batches of near-equal size (tensors and lists sliced along the first dimension)."""
    return [{key: v[part] for key, v in batch.items()} for part in even_slices(len(batch["chosen_input_ids"]), k)]


def rank_share(indices: list[int], rank: int, world_size: int) -> list[int]:
    """Every world_size-th index from `rank`, completed with indices[0] to ceil(len / world_size): every rank gets
    as many (none empty while there are indices), so all ranks run the same number of forwards."""
    mine = indices[rank::world_size]
    return mine + indices[:1] * (-(-len(indices) // world_size) - len(mine))


def nan_padded(values: torch.Tensor, length: int) -> torch.Tensor:
    """1-D float `values` followed by NaN up to `length` (gathers need one shape on every rank; nanmean skips NaN)."""
    return torch.cat([values, values.new_full((length - len(values),), float("nan"))])


def write_manifest(ckpt: Path) -> None:
    """manifest.json: the size and sha256 of every file in the checkpoint, checked before a resume trusts it.

    Written last: a manifest vouches for files that are complete and on disk (each is fsynced as it is hashed),
    so a crash, a full disk or a later bit flip shows up at resume as a mismatch, never as wrong weights.
    """
    files, sha256 = {}, {}
    for p in sorted(ckpt.rglob("*")):
        name = str(p.relative_to(ckpt))
        if p.is_file() and name != "manifest.json":  # a manifest cannot vouch for itself
            with open(p, "rb") as f:
                os.fsync(f.fileno())
                sha256[name] = hashlib.file_digest(f, "sha256").hexdigest()
            files[name] = p.stat().st_size
    atomic_write_text(ckpt / "manifest.json",
                      json.dumps({"format": CHECKPOINT_FORMAT, "files": files, "sha256": sha256}, indent=1))


def validate_checkpoint(ckpt: Path) -> Path:
    """The checkpoint directory, after checking every file of its manifest: there, with its size and sha256.

    Nothing is loaded from a checkpoint that fails; the message names each bad file and the earlier
    complete checkpoints of the run, to which LATEST can be pointed by hand.
    """
    run_dir = ckpt.parent
    earlier = sorted((p.name for p in run_dir.glob("step-*") if p.is_dir() and not p.name.endswith(".tmp")
                      and (p / "manifest.json").exists() and p.resolve() != ckpt.resolve()),
                     key=lambda n: int(n.split("-")[1]) if n.split("-")[1].isdigit() else -1, reverse=True)
    hint = (f"\nearlier checkpoints in {run_dir}: {', '.join(earlier)}; to resume from one, point LATEST at it:"
            f" ln -sfn {earlier[0]} {run_dir / 'LATEST'}") if earlier else ""
    if not ckpt.is_dir():
        target = f" -> {os.readlink(ckpt)}" if ckpt.is_symlink() else ""
        raise CheckpointError(f"cannot resume: {ckpt}{target} is not a checkpoint directory{hint}")
    manifest = ckpt / "manifest.json"
    if not manifest.exists():
        raise CheckpointError(f"cannot resume: {ckpt} has no manifest.json (no complete checkpoint there){hint}")
    try:
        record = json.loads(manifest.read_text())
        listed, sums = dict(record["files"]), dict(record.get("sha256", {}))
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"cannot resume: {manifest} is unreadable ({type(e).__name__}: {e}){hint}") from None
    problems = []
    for name, size in listed.items():
        path = ckpt / name
        if not path.is_file():
            problems.append(f"{name}: missing")
        elif path.stat().st_size != size:
            problems.append(f"{name}: {path.stat().st_size} bytes, the manifest says {size} (truncated or overwritten)")
        elif name in sums:
            with open(path, "rb") as f:
                if hashlib.file_digest(f, "sha256").hexdigest() != sums[name]:
                    problems.append(f"{name}: sha256 differs from the manifest (same size, other bytes: corrupted)")
    if problems:
        raise CheckpointError(f"cannot resume: the checkpoint {ckpt.resolve()} is damaged, nothing was loaded:\n  "
                         + "\n  ".join(problems) + hint)
    return ckpt


# What a resume may change: the learning rate and its schedule (applied after loading, printed), how long the run
# goes on, evaluation, sampling and logging, where files go, and placement knobs that change memory, not numbers.
# Every other key must be the one the run was started with: it changes what the saved state means.
RESUME_MAY_CHANGE = ("lr", "scheduler", "warmup_steps", "n_epochs", "n_examples", "eval_every", "n_eval_examples",
                     "eval_batch_size", "do_first_eval", "sample_during_eval", "n_eval_model_samples", "max_new_tokens",
                     "temperature", "top_p", "minimum_log_interval_secs", "wandb.", "debug", "exp_name", "local_dirs",
                     "run_dir", "resume_from", "collective_timeout_secs", "fsdp_port", "n_workers", "max_nonfinite_steps",
                     "peak_tflops", "activation_checkpointing", "fsdp.param_offload", "fsdp.optimizer_offload",
                     "fsdp.offload_policy", "fsdp.forward_prefetch", "fsdp.entropy_from_logits_with_chunking",
                     "fsdp.entropy_checkpointing", "fsdp.use_torch_compile")


def flat_config(d: dict, prefix: str = "") -> dict:
    """A nested config dict as {dotted key: value}."""
    return {k2: v2 for k, v in d.items()
            for k2, v2 in (flat_config(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v}).items()}


def check_compatible(state: dict, config, world_size: int) -> None:
    """Refuse to resume a checkpoint of another model, data, geometry or objective: a resume must continue the
    same run. Called before anything is loaded (train.check_inputs, before any model; maybe_resume again), so a
    refused checkpoint is never half-loaded."""
    expected = {"model": config.model.name_or_path, "datasets": list(config.datasets),
                "seed": config.seed, "batch_size": config.batch_size, "world_size": world_size}
    wrong = [f"{k}: checkpoint has {state.get(k)!r}, this run has {v!r}" for k, v in expected.items() if state.get(k) != v]
    if state.get("format") != CHECKPOINT_FORMAT:
        wrong.append(f"format: checkpoint has {state.get('format')!r}, this code reads {CHECKPOINT_FORMAT}")
    original = Path(config.resume_from or "") / "config.yaml"
    if config.resume_from and original.is_file():  # what the run was started with: any other change is refused
        saved, now = flat_config(yaml.safe_load(original.read_text()) or {}), flat_config(config.to_dict())
        for key in sorted(set(saved) | set(now)):
            if saved.get(key) != now.get(key) and not key.startswith(RESUME_MAY_CHANGE):
                wrong.append(f"{key}: the run was started with {saved.get(key)!r} ({original}), this run has {now.get(key)!r}"
                             " (a resume may change only " + ", ".join(RESUME_MAY_CHANGE) + ")")
    if wrong:
        raise CheckpointError("cannot resume: the checkpoint belongs to a different run (nothing was loaded):\n  " + "\n  ".join(wrong))


# ------------------------------------------------------------------------------------------------------
# Sharding: FSDP1 or FSDP2, one object chosen once from fsdp.strategy. Everything below runs with an
# initialized process group.
# ------------------------------------------------------------------------------------------------------
def block_classes(model: nn.Module, wrap_policy: dict) -> set[type]:
    """The transformer block classes to wrap: fsdp.wrap_policy's names, else the model's _no_split_modules."""
    names = wrap_policy.get("transformer_layer_cls_to_wrap") or find_block_class_names(model)
    if not names:
        candidates = sorted({type(m).__name__ for m in model.modules() if isinstance(m, nn.Module) and len(list(m.children())) > 1})
        raise ValueError(f"cannot tell which blocks of {type(model).__name__} to shard: set model.block_name "
                         f"(or fsdp.wrap_policy.transformer_layer_cls_to_wrap); candidates: {', '.join(candidates)}")
    return {get_block_class_from_model(model, n) for n in names}


def size_based_modules(model: nn.Module, min_num_params: int) -> list[nn.Module]:
    """Modules to shard under a size policy, leaves first: a module is wrapped once the parameters it holds
    that no wrapped descendant holds reach `min_num_params` (FSDP1's size_based_auto_wrap_policy, for FSDP2)."""
    chosen = []
    # The LM head stays in the root unit: the tiled path reads its weight inside the root's forward, never calling it.
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None

    def remaining(module: nn.Module) -> int:
        n = sum(p.numel() for p in module.parameters(recurse=False)) + sum(remaining(c) for c in module.children())
        if module is not model and module is not head and n >= min_num_params:
            chosen.append(module)
            return 0
        return n

    remaining(model)
    return chosen


def checkpoint_blocks(model: nn.Module, units: tuple[type, ...]) -> None:
    """Recompute each block of class `units` in backward (NO_REENTRANT), as the original FSDPTrainer did.

    Unlike the original, a failure to import or apply the wrapper is an error, not a printed warning."""
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, units))
    n = sum(isinstance(m, CheckpointWrapper) for m in model.modules())
    rank0_print(f"activation checkpointing (NO_REENTRANT) on {n} blocks of {', '.join(u.__name__ for u in units)}")


class Sharding:
    """How a model is sharded over the ranks, and the few things that then differ: the interface FSDPTrainer
    calls. FSDP1 and FSDP2 implement it; `SHARDINGS[fsdp.strategy]` picks one, once. The state-dict methods are
    the same for both (torch.distributed.checkpoint reads either), so they live here.

    As the original: each transformer block is its own unit (FULL_SHARD, BACKWARD_PRE prefetch for FSDP1, mixed
    precision), with NO_REENTRANT activation checkpointing per block when asked.
    """

    def __init__(self, fsdp, device: torch.device, rank: int, world_size: int, policy: nn.Module):
        self.fsdp, self.device, self.rank = fsdp, device, rank
        self.mesh = self.build_mesh(world_size)
        # ("min_num_params", n) for a size policy, else the set of block classes that become units
        if fsdp.wrap_policy.get("min_num_params") is not None:
            self.blocks = ("min_num_params", fsdp.wrap_policy["min_num_params"])
        else:
            self.blocks = block_classes(policy, fsdp.wrap_policy)

    def build_mesh(self, world_size: int):
        """A 1-D mesh (shard over all ranks) or, when 1 <= fsdp_size < world, 2-D (replicate x shard)."""
        size = self.fsdp.fsdp_size
        if size in (-1, world_size):
            return init_device_mesh(self.device.type, (world_size,), mesh_dim_names=("shard",))
        return init_device_mesh(self.device.type, (world_size // size, size), mesh_dim_names=("replicate", "shard"))

    def mixed_precision_dtypes(self) -> Optional[dict[str, torch.dtype]]:
        """fsdp.mixed_precision as dtypes: param_dtype defaults to fsdp.dtype, reduce_dtype and buffer_dtype to
        fp32 (as verl): gradients summed over ranks in bf16 lose bits, and rotary `inv_freq` tables rounded to
        bf16 shift every angle by up to 0.4% of its value, an error that grows with the position."""
        mp = self.fsdp.mixed_precision
        if mp is None:
            return None
        return {"param_dtype": dtype_of(mp.get("param_dtype", self.fsdp.dtype)),
                "reduce_dtype": dtype_of(mp.get("reduce_dtype", "fp32")), "buffer_dtype": dtype_of(mp.get("buffer_dtype", "fp32"))}

    def describe(self) -> str:
        units = self.blocks if isinstance(self.blocks, tuple) else sorted(b.__name__ for b in self.blocks)
        return (f"units {units}, mesh {tuple(self.mesh.shape)}, reshard_after_forward {self.fsdp.reshard_after_forward},"
                f" mixed precision {self.fsdp.mixed_precision}, offload params {self.fsdp.param_offload}/policy {self.fsdp.offload_policy}")

    # --- what differs between FSDP1 and FSDP2 --------------------------------------------------------------
    def shard(self, model: nn.Module, checkpoint: bool, mixed_precision: bool = True, reshard_after_forward: bool = True
              ) -> nn.Module:
        """The sharded model. `mixed_precision=False`: it computes in the dtype it was loaded in (the reference with
        model.reference_mixed_precision=false). The reference is always sharded with `reshard_after_forward`: a
        forward-only model has no backward to keep gathered parameters for."""
        raise NotImplementedError

    def reshard(self, model: nn.Module) -> None:
        """Free every gathered parameter of `model` (after a reference forward, after evaluation): FSDP1 never frees
        the root unit after a forward, nor any unit under SHARD_GRAD_OP; FSDP2 keeps them under
        reshard_after_forward=false."""
        raise NotImplementedError

    def gradient_sync(self, model: nn.Module, last_micro_batch: bool):
        """A context for one micro-batch's backward: gradients are reduced across ranks only on the last."""
        raise NotImplementedError

    def clip(self, model: nn.Module, max_norm: float) -> float:
        """Clip the gradients of all shards together; returns the global norm before clipping."""
        raise NotImplementedError

    def params_on_device(self, model: nn.Module):
        """A context in which the parameters are on the device (they may live on CPU between uses)."""
        return contextlib.nullcontext()

    # --- the same for both ---------------------------------------------------------------------------------
    def generate(self, model: nn.Module, **kwargs) -> torch.Tensor:
        """Every rank runs the same number of forwards (synced_gpus) so that the all-gathers line up:
        the original's sampling hung when ranks stopped at different lengths. Each forward runs through the
        root FSDP1 unit (through_root_unit); FSDP2's units are hooks on the model itself."""
        with through_root_unit(model):
            return model.generate(**kwargs, synced_gpus=True)

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The consolidated state dict on rank 0 (on CPU), {} on the others; a collective."""
        # On CPU the full state dict must not offload (FSDP1 segfaults with offload_to_cpu on CPU).
        options = StateDictOptions(full_state_dict=True, cpu_offload=torch.cuda.is_available())
        state = get_model_state_dict(model, options=options)
        return {k: v.detach().cpu() for k, v in state.items()} if self.rank == 0 else {}

    def save_sharded(self, model: nn.Module, optimizer, path: Path) -> None:
        """Each rank's shard of model and optimizer state (torch.distributed.checkpoint)."""
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(path))

    def load_sharded(self, model: nn.Module, optimizer, path: Path) -> None:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

    def save_model_sharded(self, model: nn.Module, path: Path) -> None:
        """Each rank's shard of a model without an optimizer (TR-DPO's reference)."""
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(path))

    def load_model_sharded(self, model: nn.Module, path: Path) -> None:
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=str(path))
        set_model_state_dict(model, state["model"])


class FSDP1(Sharding):
    """FullyShardedDataParallel: the model is wrapped, each unit a FlatParameter."""

    def shard(self, model: nn.Module, checkpoint: bool, mixed_precision: bool = True, reshard_after_forward: bool = True
              ) -> nn.Module:
        dtypes = self.mixed_precision_dtypes() if mixed_precision else None
        if self.fsdp.offload_policy:
            raise ValueError("fsdp.offload_policy is FSDP2's CPUOffloadPolicy; with fsdp.strategy=fsdp use fsdp.param_offload")
        if isinstance(self.blocks, tuple):
            size_policy = functools.partial(size_based_auto_wrap_policy, min_num_params=self.blocks[1])
            head = model.get_output_embeddings()  # stays in the root unit: the tiled path reads its weight there
            policy = lambda module, recurse, nonwrapped_numel: (  # noqa: E731
                size_policy(module=module, recurse=recurse, nonwrapped_numel=nonwrapped_numel) and (recurse or module is not head))
        else:
            policy = ModuleWrapPolicy(self.blocks)
        hybrid = self.mesh.ndim == 2
        if self.mesh.ndim == 2 and self.mesh.shape[1] == 1:
            strategy, hybrid = ShardingStrategy.NO_SHARD, False  # fsdp_size=1: every rank holds everything
        elif hybrid:
            strategy = ShardingStrategy.HYBRID_SHARD if reshard_after_forward else ShardingStrategy._HYBRID_SHARD_ZERO2
        else:
            strategy = ShardingStrategy.FULL_SHARD if reshard_after_forward else ShardingStrategy.SHARD_GRAD_OP
        on_gpu = self.device.type == "cuda"
        if not on_gpu:
            broadcast_module(model, self.rank)
        wrapped = FSDP(model, auto_wrap_policy=policy, sharding_strategy=strategy,
                       # FSDP1's offload pins host memory, which needs a GPU; on a CPU-only machine the
                       # parameters are in host memory anyway.
                       cpu_offload=CPUOffload(offload_params=self.fsdp.param_offload and on_gpu),
                       backward_prefetch=BackwardPrefetch.BACKWARD_PRE, forward_prefetch=self.fsdp.forward_prefetch,
                       mixed_precision=MixedPrecision(**dtypes) if dtypes else None, device_id=self.device,
                       # the rate limiter keeps the CPU from issuing all-gathers far ahead of the GPU (memory);
                       # torch advises it off only for CPU-bound runs with low memory pressure, as gloo on CPU
                       use_orig_params=self.fsdp.use_orig_params, limit_all_gathers=on_gpu,
                       # Only rank 0 loaded weights; on GPU the others' meta tensors are allocated per unit and
                       # filled with rank 0's values by FSDP (on CPU, FSDP1 refuses: broadcast_module did it).
                       sync_module_states=on_gpu, param_init_fn=materialize(self.device, tied_slots(model)) if on_gpu else None,
                       device_mesh=self.mesh if hybrid else None)
        if on_gpu:  # sync_module_states may skip buffers across shard groups (torch < 2.11, hybrid): say it once more
            for buffer in wrapped.buffers():
                dist.broadcast(buffer, src=0)
        if checkpoint:  # as the original: after wrapping, each block recomputes its activations in backward
            checkpoint_blocks(wrapped, tuple(block_classes(model, self.fsdp.wrap_policy)))
        return wrapped

    def gradient_sync(self, model: nn.Module, last_micro_batch: bool):
        return contextlib.nullcontext() if last_micro_batch else model.no_sync()

    def clip(self, model: nn.Module, max_norm: float) -> float:
        return model.clip_grad_norm_(max_norm).item()

    def reshard(self, model: nn.Module) -> None:
        """FSDP1 keeps the ROOT unit's gathered parameters after a forward (meant for the backward), and every unit's
        under SHARD_GRAD_OP; its next forward reuses them without gathering."""
        for unit in FSDP.fsdp_modules(model):
            if unit._handle is not None and unit._handle.uses_sharded_strategy:
                unit._handle.reshard(free_unsharded_flat_param=True)


class FSDP2(Sharding):
    """fully_shard: the model keeps its class, its parameters become DTensors, each unit's hooks all-gather."""

    def shard(self, model: nn.Module, checkpoint: bool, mixed_precision: bool = True, reshard_after_forward: bool = True
              ) -> nn.Module:
        dtypes = self.mixed_precision_dtypes() if mixed_precision else None
        mp = MixedPrecisionPolicy(param_dtype=dtypes["param_dtype"], reduce_dtype=dtypes["reduce_dtype"]) if dtypes else MixedPrecisionPolicy()
        # FSDP2 has no buffer dtype: buffers keep the dtype they were loaded in unless buffer_dtype is set explicitly
        # (then they are cast once, as FSDP1's buffer_dtype would).
        if dtypes and self.fsdp.mixed_precision.get("buffer_dtype") is not None:
            for buffer in model.buffers():
                if buffer.is_floating_point():
                    buffer.data = buffer.data.to(dtypes["buffer_dtype"])
        ties = tied_slots(model)  # before `to("meta")`, which gives each module its own Parameter
        # Pinned memory needs a GPU; without one the copies are plain CPU tensors anyway.
        offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if self.fsdp.offload_policy else OffloadPolicy()
        full_state = model.state_dict() if self.rank == 0 else {}  # only rank 0 loaded weights (others: meta)
        buffers = {name: b.clone() for name, b in model.named_buffers()} if self.rank == 0 else {}
        if self.rank == 0:
            model.to("meta")  # every rank shards the same empty structure, then rank 0's values are broadcast
            retie(ties)  # `to` gave each module its own copy: a tied weight must be ONE FSDP parameter on every rank
        if checkpoint:  # before sharding, so that each sharded unit is the checkpointed block
            checkpoint_blocks(model, tuple(block_classes(model, self.fsdp.wrap_policy)))
        units = self.unit_modules(model)
        # On a 2-D mesh fully_shard replicates over the first dimension and shards over the second (HSDP).
        kwargs = dict(mesh=self.mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp, offload_policy=offload)
        for unit in units:
            fully_shard(unit, **kwargs)
        fully_shard(model, **kwargs)
        if self.device.type == "cpu":  # the shard group is gloo, whose own all-gather and reduce-scatter are slow (below)
            self.mailboxes = getattr(self, "mailboxes", None) or SharedMailboxes()  # one set for policy and reference
            for unit in (*units, model):
                unit.set_custom_all_gather(PairwiseAllGather(self.mailboxes))
                unit.set_custom_reduce_scatter(PairwiseReduceScatter(self.mailboxes))
        self.load_from_rank0(model, full_state, buffers, cpu=self.fsdp.offload_policy, ties=ties)
        if self.fsdp.forward_prefetch:  # FSDP2 prefetches explicitly: each unit all-gathers the next one early
            for unit, following in zip(units, units[1:]):
                unit.set_modules_to_forward_prefetch([following])
        return model

    def unit_modules(self, model: nn.Module) -> list[nn.Module]:
        """The modules that become FSDP2 units; a checkpointed block's unit is its checkpoint wrapper."""
        if isinstance(self.blocks, tuple):
            return size_based_modules(model, self.blocks[1])
        blocks = tuple(self.blocks)
        wrapped = {id(m._checkpoint_wrapped_module) for m in model.modules() if isinstance(m, CheckpointWrapper)}
        return [m for m in model.modules() if (isinstance(m, blocks) and id(m) not in wrapped)
                or (isinstance(m, CheckpointWrapper) and isinstance(m._checkpoint_wrapped_module, blocks))]

    def load_from_rank0(self, model: nn.Module, full_state: dict, buffers: dict, cpu: bool, ties: list) -> None:
        """Allocate the sharded empty model, re-tie what `to_empty` untied (the sharded DTensor of a tied
        embedding must be ONE Parameter on every rank), then fill it: parameters and persistent buffers scattered
        from rank 0's full state dict, every buffer (rotary tables are not in the state dict) broadcast."""
        model.to_empty(device="cpu" if cpu else self.device)
        retie(ties)
        set_model_state_dict(model, full_state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        for name, buffer in model.named_buffers():
            if self.rank == 0:
                buffer.copy_(buffers[name])
            dist.broadcast(buffer, src=0)

    def gradient_sync(self, model: nn.Module, last_micro_batch: bool):
        model.set_requires_gradient_sync(last_micro_batch)
        return contextlib.nullcontext()

    def reshard(self, model: nn.Module) -> None:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def clip(self, model: nn.Module, max_norm: float) -> float:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        return (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item()

    @contextlib.contextmanager
    def params_on_device(self, model: nn.Module):
        """With fsdp.param_offload the (sharded) parameters live on CPU between steps and evaluations and come to
        the device only while used, as verl offloads them (FSDP1 uses its own CPUOffload instead)."""
        if self.fsdp.param_offload:
            model.to(self.device)
        try:
            yield
        finally:
            if self.fsdp.param_offload:
                model.to("cpu")


SHARDINGS: dict[str, type[Sharding]] = {"fsdp": FSDP1, "fsdp2": FSDP2}  # fsdp.strategy -> implementation


class _Transfers(dist.Work):
    """Several point-to-point transfers as one Work: FSDP2 waits on what an asynchronous collective returns."""

    def __init__(self, works: list):
        super().__init__()
        self.works = works

    def wait(self, timeout=None) -> bool:
        for work in self.works:
            work.wait()
        return True


def _exchange(group: dist.ProcessGroup, sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor], tag: int) -> list:
    """Post every send and receive with the group's other ranks at once; the Works to wait on (none on one rank)."""
    ops = [dist.P2POp(dist.isend, t, group=group, group_peer=p, tag=tag) for p, t in sends.items()]
    ops += [dist.P2POp(dist.irecv, t, group=group, group_peer=p, tag=tag) for p, t in recvs.items()]
    return dist.batch_isend_irecv(ops) if ops else []


class _DirectSends:
    """What FSDP2's custom collectives must also provide: their buffers (plain tensors here)."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class SharedMailboxes:
    """Shared memory for FSDP2's CPU collectives when a group's ranks run on one machine: each rank writes what
    the others need into its own mailbox (a file in /dev/shm that every rank of the group maps), one barrier, and
    each reads from the others' mailboxes. A transfer is then one memory copy each way instead of a socket's
    (132 MB over 2 ranks with glibc's variables set, 2026-12-04: all-gather 38 against 66 ms, reduce-scatter 27
    against 62 ms; benchmarks/gloo_collectives.py).

    A second barrier after the reads keeps a rank from refilling its mailbox before the others have read it (two
    mailboxes used in turn would save it, ~0.1 ms, at twice the memory). FSDP2 runs the same collectives in the
    same order with the same sizes on every rank of a group, so the ranks agree without talking on when to map
    larger mailboxes, and on falling back to direct sends (ranks on several machines, or too little room in
    /dev/shm: tmpfs past its size faults on first touch, so the room is checked before). Each file is unlinked as
    soon as every rank has mapped it. Mailboxes hold the largest message: a shard for the all-gather, the chunks
    for the other ranks for the reduce-scatter (66 MB per rank for bench_dpo.py's root unit on 2 ranks; RSS also
    counts the other ranks' mailboxes once read)."""
    DIR = "/dev/shm"

    def __init__(self):
        self.groups: dict[int, dict] = {}  # id(group) -> its state, set up at the group's first call

    def boxes(self, group: dist.ProcessGroup, nbytes: int) -> Optional[list[torch.Tensor]]:
        """The group's mailboxes (one byte tensor per rank) of at least `nbytes`, or None: direct sends. A
        collective call: every rank of `group` makes it, in the same order."""
        state = self.groups.get(id(group))
        if state is None:
            state = self.groups[id(group)] = self.start(group)
        if state["off"]:
            return None
        if nbytes > state["capacity"]:
            self.grow(group, state, nbytes)
            if state["off"]:
                return None
        return state["boxes"]

    def start(self, group: dist.ProcessGroup) -> dict:
        names = [None] * group.size()
        dist.all_gather_object(names, (socket.gethostname(), f"dpo-{os.getpid()}-{os.urandom(4).hex()}"), group=group)
        one_machine = len({host for host, _ in names}) == 1 and os.path.isdir(self.DIR)
        return {"off": not one_machine, "capacity": 0, "boxes": None,
                "prefixes": [prefix for _, prefix in names], "generation": 0}

    def grow(self, group: dist.ProcessGroup, state: dict, nbytes: int) -> None:
        capacity = -(-nbytes // 2**20) * 2**20
        stat = os.statvfs(self.DIR)
        room = stat.f_bavail * stat.f_frsize >= group.size() * capacity * 1.25  # every rank creates one now
        agreed = torch.tensor([int(room)])
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
        if not agreed.item():
            state.update(off=True, boxes=None)
            rank0_print(f"FSDP2 on CPU: /dev/shm lacks room for {capacity / 2**20:.0f} MiB per rank; direct sends instead")
            return
        me, generation = group.rank(), state["generation"] + 1
        path = lambda rank: f"{self.DIR}/{state['prefixes'][rank]}-{generation}"  # noqa: E731
        own = torch.from_file(path(me), shared=True, size=capacity, dtype=torch.uint8)
        dist.barrier(group=group)
        boxes = [own if rank == me else torch.from_file(path(rank), shared=True, size=capacity, dtype=torch.uint8)
                 for rank in range(group.size())]
        dist.barrier(group=group)
        os.unlink(path(me))
        state.update(boxes=boxes, capacity=capacity, generation=generation)


def _mailbox(boxes: list, rank: int, rows: int, like: torch.Tensor) -> torch.Tensor:
    """Rank `rank`'s mailbox as `rows` rows shaped and typed as the 1-D tensor `like`."""
    return boxes[rank][:rows * like.numel() * like.element_size()].view(like.dtype).view(rows, -1)


class PairwiseAllGather(_DirectSends):
    """FSDP2's all-gather on CPU (gloo): through `mailboxes` (shared memory) where they apply, else as direct sends
    of each rank's shard to every other rank.

    Why: gloo's all_gather moves the same bytes 2-3x slower with 3x the CPU on one machine (132 MB over 2 ranks,
    2026-12-04: 218 against 66 ms, 157 against 48 ms of CPU; benchmarks/gloo_collectives.py). The ranks post their transfers
    in the same order (FSDP2 runs its collectives in program order), so the receives match the sends."""
    TAG = 0x5A1

    def __init__(self, mailboxes: Optional[SharedMailboxes] = None):
        self.mailboxes = mailboxes

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False):
        world, me = group.size(), group.rank()
        slots = output_tensor.view(world, -1)
        if slots[me].data_ptr() != input_tensor.data_ptr():  # FSDP2 copies its shard into its slot already
            slots[me].copy_(input_tensor.view(-1))
        others = [p for p in range(world) if p != me]
        boxes = self.mailboxes.boxes(group, slots[me].numel() * slots[me].element_size()) if others and self.mailboxes else None
        if boxes:
            _mailbox(boxes, me, 1, slots[me])[0].copy_(slots[me])
            dist.barrier(group=group)
            for p in others:
                slots[p].copy_(_mailbox(boxes, p, 1, slots[p])[0])
            dist.barrier(group=group)
            return _Transfers([]) if async_op else None
        works = _exchange(group, {p: slots[me] for p in others}, {p: slots[p] for p in others}, self.TAG)
        done = _Transfers(works)
        if async_op:
            return done
        done.wait()
        return None


class PairwiseReduceScatter(_DirectSends):
    """FSDP2's reduce-scatter on CPU (gloo): each rank gives every other rank that rank's chunk of its gradients
    (through `mailboxes` where they apply, else by direct sends), then sums what it received into its own chunk:
    half the bytes of gloo's reduce_scatter, which runs as an all_reduce (132 MB over 2 ranks, 2026-12-04: 62 against 251 ms, 52 against 143 ms of CPU)."""
    TAG = 0x5A2

    def __init__(self, mailboxes: Optional[SharedMailboxes] = None):
        self.mailboxes = mailboxes

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op=dist.ReduceOp.SUM, async_op: bool = False):
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):  # PREMUL_SUM needs set_gradient_divide_factor: unused
            raise ValueError(f"the direct-send reduce-scatter sums or averages, it cannot apply {op}")
        world, me = group.size(), group.rank()
        chunks = input_tensor.view(world, -1)
        others = [p for p in range(world) if p != me]
        chunk_bytes = chunks[me].numel() * chunks[me].element_size()
        boxes = self.mailboxes.boxes(group, (world - 1) * chunk_bytes) if others and self.mailboxes else None
        if boxes:  # my mailbox holds my chunks for the others (rank p's in row p, or p - 1 past mine)
            mine = _mailbox(boxes, me, world - 1, chunks[me])
            for i, p in enumerate(others):
                mine[i].copy_(chunks[p])
            dist.barrier(group=group)
            received = [_mailbox(boxes, p, world - 1, chunks[me])[me if me < p else me - 1] for p in others]
        else:
            received = torch.empty((world - 1, chunks.size(1)), dtype=input_tensor.dtype, device=input_tensor.device)
            for work in _exchange(group, {p: chunks[p] for p in others}, {p: received[i] for i, p in enumerate(others)}, self.TAG):
                work.wait()
        out = output_tensor.view(-1)
        if others:
            torch.add(chunks[me], received[0], out=out)
        else:
            out.copy_(chunks[me])
        for more in received[1:]:
            out.add_(more)
        if boxes:
            dist.barrier(group=group)  # every rank has read my mailbox: it may be refilled
        if op == dist.ReduceOp.AVG:
            out.div_(world)
        return None


class FSDPTrainer(BasicTrainer):
    """BasicTrainer with policy and reference sharded over all ranks by `self.sharding` (FSDP1 or FSDP2, from
    fsdp.strategy). Overrides what the original FSDPTrainer overrode (wrapping, clipping, saving, loading) and
    the few hooks where several processes differ from one: input device, gradient sync, sampling, the
    optimizer step with its state offloaded, gathering, barriers and the non-finite decision. Every field of
    `config.fsdp` is read here, in the Sharding classes, or rejected by config.validate.
    """
    # FSDP's own mixed precision casts the parameters (no autocast); log-probs (plain, tiled or packed) are the
    # root unit's forward (forward_logps); activation checkpointing is applied while sharding (after wrapping for
    # FSDP1, before for FSDP2).
    autocasts, checkpoints_when_built = False, False

    def __init__(self, policy: nn.Module, config, seed: int, run_dir: str, reference_model: Optional[nn.Module] = None,
                 rank: int = 0, world_size: int = 1, tokenizer=None):
        if not dist.is_initialized():
            raise RuntimeError("FSDPTrainer needs a process group (train.py starts one)")
        # torch's own deprecation chatter from inside FSDP state-dict code, once per tensor per rank
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
        warnings.filterwarnings("ignore", message=r".*_get_pg_default_device.*|.*Multiple backends are registered.*")
        self.fsdp, self.rank = config.fsdp, rank
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        # FSDP1 on CPU works only with device_id=cpu (verified on torch 2.13 + gloo).
        self.device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
        self.flops_params = flops_params(policy)  # meta tensors know their shapes too
        if config.fsdp.ulysses_sequence_parallel_size > 1:  # before sharding: recomputed blocks attend through it too
            self.sequence_parallel = ulysses.make_group(self.device, world_size, config.fsdp.ulysses_sequence_parallel_size)
            for model in (policy, reference_model) if reference_model is not None else (policy,):
                ulysses.install(model, self.sequence_parallel)
            rank0_print(f"Ulysses sequence parallelism: groups of {self.sequence_parallel.size} ranks split every sequence")
        self.sharding = SHARDINGS[config.fsdp.strategy](config.fsdp, self.device, rank, world_size, policy)
        rank0_print(f"sharding policy with {config.fsdp.strategy} ({self.sharding.describe()})")
        policy = self.sharding.shard(policy, checkpoint=config.activation_checkpointing,
                                     reshard_after_forward=config.fsdp.reshard_after_forward)
        if reference_model is not None:
            rank0_print("sharding reference model (forward only, resharded after every forward)")
            reference_model = self.sharding.shard(reference_model, checkpoint=False,
                                                  mixed_precision=reference_mixed_precision(config))
        super().__init__(policy, config, seed, run_dir, reference_model, rank, world_size, tokenizer)

    # --- what several processes change in the loop --------------------------------------------------------
    def input_device(self, model: nn.Module) -> torch.device:
        return self.device


    def no_sync(self, last_micro_batch: bool):
        """Gradients are reduce-scattered after every micro-batch (each rank keeps only its shard), unless
        no_sync_accumulation: then only after the last (less communication, but every rank holds the whole
        model's unsharded gradients, fp32 under FSDP2, between micro-batches)."""
        if not self.config.no_sync_accumulation:
            return contextlib.nullcontext()
        return self.sharding.gradient_sync(self.policy, last_micro_batch)

    def clip_gradient(self) -> float:
        return self.sharding.clip(self.policy, self.config.max_grad_norm)

    def agreed_micro_batches(self, count: int) -> int:
        """The most micro-batches any rank has this step (max_tokens_per_microbatch splits each rank's pairs by
        their lengths); one integer per rank, on self.device (NCCL reduces CUDA tensors only)."""
        count = torch.tensor([count], device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return int(count.item())

    def params_on_device(self):
        return self.sharding.params_on_device(self.policy)

    def step_optimizer(self) -> None:
        """With fsdp.optimizer_offload the optimizer state lives on CPU between steps (as verl)."""
        if self.fsdp.optimizer_offload:
            # to each parameter's device, not self.device: under FSDP1 CPUOffload / FSDP2 CPUOffloadPolicy the
            # parameters (and so the step) stay on CPU
            move_optimizer_state(self.optimizer, None)
        super().step_optimizer()
        if self.fsdp.optimizer_offload:
            move_optimizer_state(self.optimizer, torch.device("cpu"))

    def generate(self, model: nn.Module, **kwargs) -> torch.Tensor:
        with ulysses.paused():  # every rank generates from whole prompts
            return self.sharding.generate(model, **kwargs)

    def gather_objects(self, items: list) -> list:
        """Every data-parallel rank's items (the ranks of a Ulysses group hold the same ones: the first's are kept)."""
        out = [None] * self.world_size
        dist.all_gather_object(out, items)
        return [x for part in out[::self.sp_size] for x in part]

    def barrier(self) -> None:
        """Wait for rank 0's lone checkpoint work (writes, fsyncs, hashes): a barrier that slow disks do not
        time out (utils.RANK0_WORK_TIMEOUT, not collective_timeout_secs)."""
        wait_for_rank0()

    def all_ranks_finite(self, finite: bool) -> bool:
        """The losses are per rank: one rank's NaN must skip the step on all ranks, or the shards diverge."""
        return all_ranks_true(finite, self.device)

    def stop_agreed(self) -> bool:
        """A signal may reach some ranks only (a scheduler's, or `kill` on one process): all stop if any got one."""
        return not all_ranks_true(self.stop["signal"] is None, self.device)

    # --- checkpoints: sharded for resume, consolidated on rank 0 for everyone else -------------------------
    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        return self.sharding.full_state_dict(self.policy)

    def write_resume_state(self, tmp_dir: Path) -> None:
        """Sharded model and optimizer (torch.distributed.checkpoint) and each rank's RNG."""
        self.sharding.save_sharded(self.policy, self.optimizer, tmp_dir / "sharded")
        torch.save(get_rng_state(), tmp_dir / f"rng-{self.rank}.pt")

    # --- TR-DPO: the reference is trained state, sharded like the policy ------------------------------------
    def after_reference_forward(self) -> None:
        self.sharding.reshard(self.reference_model)

    def write_reference(self, tmp_dir: Path) -> None:
        """The TR-DPO reference, sharded like the policy (each rank writes its shards: no gather)."""
        if self.config.ref_update.tau is not None:
            self.sharding.save_model_sharded(self.reference_model, tmp_dir / "reference_sharded")

    def load_reference(self, ckpt: Path) -> None:
        if self.config.ref_update.tau is not None:
            self.sharding.load_model_sharded(self.reference_model, ckpt / "reference_sharded")

    def load_policy_and_optimizer(self, ckpt: Path) -> None:
        self.sharding.load_sharded(self.policy, self.optimizer, ckpt / "sharded")


@contextlib.contextmanager
def through_root_unit(model: nn.Module):
    """`generate` calls the causal LM's own `self(...)`: under FSDP1 that is the module inside the wrapper, under
    LoRA (peft, either strategy) the base model inside the PeftModel. Either call skips the root unit's pre-forward
    (the all-gather of the embeddings, final norm and LM head, the input casts of mixed precision). Inside this
    block that causal LM's forward goes through the root (`model(...)`), which then calls the causal LM's own
    forward. FSDP2 without LoRA (generate's call is the root's) and one process are left as they are."""
    inner = unwrap(model)
    lm = inner.get_base_model() if hasattr(inner, "get_base_model") else inner  # peft: the causal LM it wraps
    if lm is model:
        yield
        return

    def forward(*args, **kwargs):
        del lm.forward  # the root calls down to lm's class forward this time
        try:
            return model(*args, **kwargs)
        finally:
            lm.forward = forward
    lm.forward = forward
    try:
        yield
    finally:
        del lm.forward


def tied_slots(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Groups of (module, parameter name) that share one Parameter (a tied input/output embedding). `to`,
    `to_empty` and per-module materialization give each module its own copy: `retie` restores the sharing."""
    groups: dict[int, list[tuple[nn.Module, str]]] = defaultdict(list)
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                groups[id(param)].append((module, name))
    return [slots for slots in groups.values() if len(slots) > 1]


def retie(ties: list[list[tuple[nn.Module, str]]]) -> None:
    """Point every slot of each group at one Parameter: the first one that has memory (else the first)."""
    for slots in ties:
        params = [module._parameters[name] for module, name in slots]
        keep = next((p for p in params if not p.is_meta), params[0])
        for module, name in slots:
            module._parameters[name] = keep


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside an FSDP1 wrapper (FSDP2 and one process: the model itself)."""
    return model.module if hasattr(model, "module") else model


def merged_lora_state(state: dict[str, torch.Tensor], scaling: float, transposed: frozenset = frozenset(),
                      adapter: str = "default") -> dict[str, torch.Tensor]:
    """A peft LoRA model's full state dict -> the base model's, with each adapter merged: W + scaling * B @ A
    (scaling = lora.alpha / lora.r), keys without peft's prefixes. Layers named in `transposed` store their
    weight as (in, out) (transformers' Conv1D in GPT-2, peft's fan_in_fan_out): their delta is (B @ A).T, as
    peft merges it. Pure: the live model keeps its adapters."""
    prefix, merged = "base_model.model.", {}
    for key, value in state.items():
        if ".lora_" in key:
            continue
        name = (key[len(prefix):] if key.startswith(prefix) else key).replace(".base_layer.", ".")
        if key.endswith(".base_layer.weight"):
            stem = key[: -len(".base_layer.weight")]
            a, b = state[f"{stem}.lora_A.{adapter}.weight"], state[f"{stem}.lora_B.{adapter}.weight"]
            delta = scaling * (b.double() @ a.double())  # (out, r) @ (r, in)
            value = value + (delta.T if stem in transposed else delta).to(value.dtype)
        merged[name] = value
    return merged


def fan_in_fan_out_layers(model: nn.Module) -> frozenset:
    """State-dict stems of the LoRA layers whose base weight is stored (in, out) (peft sets fan_in_fan_out for
    transformers' Conv1D); wrapper prefixes (activation checkpointing, FSDP1) removed as state dicts remove them."""
    return frozenset(clean_name(name) for name, module in model.named_modules() if getattr(module, "fan_in_fan_out", False))


def clean_name(name: str) -> str:
    """A parameter or module name without the wrappers' prefixes (activation checkpointing, FSDP1)."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_fsdp_wrapped_module.", "")


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter: the local shard of an FSDP2 DTensor, the tensor itself otherwise (FSDP1's
    flat parameters are already local shards outside forward/backward)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def broadcast_module(model: nn.Module, rank: int) -> None:
    """Rank 0's parameters and buffers into every rank's copy (the others' meta tensors get CPU memory first,
    then are re-tied: the broadcast must see the same list of tensors on every rank)."""
    if rank != 0:
        ties = tied_slots(model)
        model.to_empty(device="cpu")
        retie(ties)
    for tensor in [*model.parameters(), *model.buffers()]:
        dist.broadcast(tensor.data, src=0)


def materialize(device: torch.device, ties: list):
    """FSDP1's param_init_fn, called once per module of each unit: give the module's meta tensors real
    (uninitialized) memory, sharing a tied Parameter that another module already materialized; then
    sync_module_states fills everything with rank 0's values."""
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
    """Every state tensor (not the step counters, which stay on CPU) to `device`, or with None to the device
    of its own parameter (where the optimizer step runs)."""
    for param, state in optimizer.state.items():
        target = param.device if device is None else device
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                # non_blocking only towards the GPU: a non-blocking copy to pageable CPU memory can be read
                # before it has landed
                state[key] = value.to(target, non_blocking=target.type == "cuda")
