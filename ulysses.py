"""Ulysses sequence parallelism (DeepSpeed-Ulysses, as verl uses it): the `sp` ranks of one sequence-parallel group
hold the same pairs, each a contiguous slice of every row's positions. Everything per token (embeddings, MLPs,
norms, the LM head, the log-probs) runs on the slice, so activations and logits per rank shrink by `sp`. Around
attention an all-to-all turns the sequence slices into head slices: each rank attends over WHOLE sequences for
`heads / sp` of the heads, then a second all-to-all turns the result back into its sequence slice.

The whole feature is three functions that trainers.py calls:
  - `install`: the all-to-all around the attention function transformers' models call (their AttentionInterface
    registry, for sdpa and eager attention), and the group on the model's modules. That model then attends
    sequence-parallel, in forward and in the recomputation of checkpointed blocks, except inside `paused()`
    (sampling, where every rank holds whole sequences); other models of the process are not affected.
  - `local_slice`: this rank's positions of the model inputs, targets and owners (sequence_logps).
  - `sum_over_group`: the per-slice sums of a sequence added over the group, differentiably.

Gradients: every rank of a group computes the same loss from the summed log-probs; the backward of the sum is
again a sum over the group, so the gradients summed over the group are `sp` times one sequence's gradient, and
FSDP's average over all `dp x sp` ranks gives exactly the data-parallel mean (tests/test_ulysses.py checks it
against one process).
"""
from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Attention functions the wrapper knows how to call with whole sequences and a full 4-D mask. Flash-attention
# kernels take a 2-D padding mask or cu_seqlens instead: not supported yet (train.py refuses them before loading).
SUPPORTED_ATTENTION = ("sdpa", "eager")


@dataclass(frozen=True)
class SequenceParallel:
    """One rank's sequence-parallel group: `size` consecutive ranks holding the same pairs; this rank holds the
    `rank`-th slice of every row."""
    group: object  # torch.distributed ProcessGroup
    rank: int
    size: int


def make_group(device: torch.device, world_size: int, size: int) -> SequenceParallel:
    """The (data-parallel x sequence-parallel) mesh, as verl's: groups of `size` consecutive ranks; FSDP still
    shards over every rank. A collective: every rank calls it."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(device.type, (world_size // size, size), mesh_dim_names=("dp", "sp"))
    return SequenceParallel(group=mesh["sp"].get_group(), rank=mesh.get_local_rank("sp"), size=size)


# --- the communication ----------------------------------------------------------------------------------------
class _AllToAll(torch.autograd.Function):
    """x of Shape (sp, ...): chunk j is sent to rank j, and chunk r of the result came from rank r. Swapping
    (rank, chunk) pairs is its own inverse, so the backward is the same exchange of the gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()  # the collective reads and writes raw memory in row-major order
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) whose backward is again a sum: every rank's loss is a function of the same total."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_over_group(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """x summed over the group's ranks (any shape), differentiable when x requires grad."""
    if x.requires_grad:
        return _SumOverGroup.apply(x, sp.group)
    x = x.clone()
    dist.all_reduce(x, group=sp.group)
    return x


def sequence_to_heads(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """(B, H, T/sp, d) with all heads of this rank's positions -> (B, H/sp, T, d): this rank's heads, all positions."""
    b, h, t, d = x.shape
    chunks = x.reshape(b, sp.size, h // sp.size, t, d).transpose(0, 1)  # chunk j: the heads rank j attends with
    received = _AllToAll.apply(chunks, sp.group)  # chunk r: rank r's positions of my heads
    return received.permute(1, 2, 0, 3, 4).reshape(b, h // sp.size, sp.size * t, d)


def heads_to_sequence(y: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """(B, T, H/sp, d), attention's output for this rank's heads -> (B, T/sp, H, d): all heads, my positions."""
    b, t, h, d = y.shape
    chunks = y.reshape(b, sp.size, t // sp.size, h, d).transpose(0, 1)  # chunk j: rank j's positions
    received = _AllToAll.apply(chunks, sp.group)  # chunk r: rank r's heads at my positions
    return received.permute(1, 2, 0, 3, 4).reshape(b, t // sp.size, sp.size * h, d)


# --- attention ------------------------------------------------------------------------------------------------
_PAUSED = [False]  # True inside paused()


class _AllKeyValueHeads:
    """The attention module as the inner function sees it once the key/value heads were repeated to one per query
    head (when their count does not divide by sp): no further grouping."""
    num_key_value_groups = 1

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        return getattr(self._module, name)


def _wrap(inner_of, takes_is_causal: bool):
    """An attention function for the registry: the all-to-all, `inner_of(module)`'s attention over whole sequences
    for this rank's heads, the all-to-all back. transformers calls it with q, k, v of Shape (B, heads, T/sp, d)
    and the full (B or 1, 1, T, T) mask (sequence_logps passes a 4-D mask for the whole rows).

    A plain causal mask (whole_row_inputs' stand-in, marked `causal_only`) becomes `is_causal=True` where the inner
    function takes it (sdpa): its causal kernel needs O(T) memory, a boolean (T, T) mask sends it to the O(T^2)
    math kernel. Eager attention, which builds (T, T) scores anyway, gets the additive causal mask per call."""
    def attention(module, query, key, value, attention_mask, **kwargs):
        inner = inner_of(module)
        sp = getattr(module, "ulysses_group", None)  # set by install on the modules of a sequence-parallel model
        if sp is None or _PAUSED[0]:
            return inner(module, query, key, value, attention_mask, **kwargs)
        if key.shape[1] % sp.size:  # fewer KV heads than ranks (or not a multiple): one per query head
            from transformers.integrations.sdpa_attention import repeat_kv
            key, value = repeat_kv(key, module.num_key_value_groups), repeat_kv(value, module.num_key_value_groups)
            module = _AllKeyValueHeads(module)
        causal = getattr(attention_mask, "causal_only", False)
        if causal and takes_is_causal:
            attention_mask, kwargs["is_causal"] = None, True
        query, key, value = (sequence_to_heads(x, sp) for x in (query, key, value))
        if causal and not takes_is_causal:
            t = query.size(-2)
            attention_mask = torch.full((t, t), torch.finfo(torch.bfloat16).min, dtype=torch.bfloat16,
                                        device=query.device).triu_(1)[None, None]
        out, _ = inner(module, query, key, value, attention_mask, **kwargs)
        return heads_to_sequence(out, sp), None  # no attention weights: they would be per head slice
    return attention


def install(model: torch.nn.Module, sp: SequenceParallel) -> None:
    """`model` attends sequence-parallel over `sp` from now on (see the module docstring)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    implementation = model.config._attn_implementation
    if implementation not in SUPPORTED_ATTENTION:
        raise ValueError(f"fsdp.ulysses_sequence_parallel_size={sp.size} with attention {implementation!r}: not supported"
                         f" yet; expected one of {SUPPORTED_ATTENTION} (the model's config._attn_implementation)")
    if not getattr(ALL_ATTENTION_FUNCTIONS.get(implementation), "ulysses", False):
        if implementation == "eager":  # each architecture has its own eager function, in its modeling file
            inner_of = lambda module: sys.modules[type(module).__module__].eager_attention_forward  # noqa: E731
        else:
            original = ALL_ATTENTION_FUNCTIONS[implementation]
            inner_of = lambda module: original  # noqa: E731
        wrapped = _wrap(inner_of, takes_is_causal=implementation == "sdpa")
        wrapped.ulysses = True
        ALL_ATTENTION_FUNCTIONS[implementation] = wrapped
    for module in model.modules():  # the attention function receives the attention module: it finds the group there
        module.ulysses_group = sp


@contextlib.contextmanager
def paused():
    """Plain attention inside (sampling: every rank generates from whole prompts)."""
    paused_before, _PAUSED[0] = _PAUSED[0], True
    try:
        yield
    finally:
        _PAUSED[0] = paused_before


# --- inputs ---------------------------------------------------------------------------------------------------
def whole_row_inputs(kwargs: dict, length: int) -> dict:
    """Padded-row model inputs for sequence parallelism: the 2-D padding mask becomes a causal (1, 1, T, T) mask
    (rows are right-padded, so causal attention never reaches a padding key from a real token) and positions are
    explicit, because each rank sees only a slice of them. The mask is a stand-in of one element, marked
    `causal_only`: the attention wrapper runs a causal kernel (sdpa) or builds the mask per call (eager), so no
    (T, T) tensor lives through the forward (8 GiB... of masks at 32k tokens otherwise, on every rank)."""
    device = kwargs["input_ids"].device
    causal = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device).expand(1, 1, length, length)
    causal.causal_only = True
    positions = torch.arange(length, device=device).expand(kwargs["input_ids"].size(0), length)
    return {"input_ids": kwargs["input_ids"], "attention_mask": causal, "position_ids": positions}


def local_slice(kwargs: dict, targets: torch.Tensor, owner: torch.Tensor, sp: SequenceParallel):
    """This rank's contiguous slice of positions of input_ids, position_ids, targets and owners (T divisible by
    sp). The attention mask stays whole: attention sees whole sequences after the all-to-all."""
    t = targets.size(1) // sp.size
    cut = slice(sp.rank * t, (sp.rank + 1) * t)
    local = dict(kwargs, input_ids=kwargs["input_ids"][:, cut], position_ids=kwargs["position_ids"][:, cut])
    return local, targets[:, cut], owner[:, cut]
