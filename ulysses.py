"""Ulysses sequence parallelism (DeepSpeed-Ulysses, as verl uses it): the `sp` ranks of a group hold the same pairs,
each a contiguous slice of every row's positions, so everything per token (embeddings, MLPs, norms, the LM head, the
log-probs) and its activations shrink by `sp`. Around attention an all-to-all turns sequence slices into head
slices: each rank attends over WHOLE sequences with `heads / sp` heads, and a second all-to-all turns the result back.

trainers.py calls `make_group` and `install` (`paused()` turns it off for sampling); logps.py calls the methods of
the `SequenceParallel` it is handed (`whole_row_inputs`, `local_slice`, `sum_over_group`) and never imports this file.
Every rank of a group computes the same loss from the summed log-probs and the backward of a sum is a sum, so FSDP's
average over all `dp x sp` ranks is the data-parallel mean.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.attention.flex_attention import BlockMask
from transformers.integrations import flex_attention
from transformers.integrations.sdpa_attention import repeat_kv
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from config import ConfigError

# Called with whole sequences and a 4-D mask; flash kernels take cu_seqlens instead (train.py refuses them).
SUPPORTED_ATTENTION = ("sdpa", "eager")
_PAUSED = [False]  # True inside paused()


@dataclass(frozen=True)
class SequenceParallel:
    """One rank's group: `size` consecutive ranks holding the same pairs; this one holds every row's `rank`-th slice."""

    group: object  # torch.distributed ProcessGroup
    rank: int
    size: int

    @staticmethod
    @contextlib.contextmanager
    def paused():
        """Plain attention inside (sampling: every rank generates from whole prompts); also reached through the group
        by code that does not import this file (self_check.py)."""
        paused_before, _PAUSED[0] = _PAUSED[0], True
        try:
            yield
        finally:
            _PAUSED[0] = paused_before

    def sum_over_group(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the group's ranks (any shape), differentiable when x requires grad."""
        return _SelfAdjoint.apply(x, _all_reduce, self.group)

    @staticmethod
    def whole_row_inputs(kwargs: dict) -> dict:
        """Padded-row inputs for sequence parallelism: explicit positions (each rank sees a slice of them) and a
        one-element causal (1, 1, T, T) stand-in marked `causal_only` (rows are right-padded, so a causal mask never
        lets a real token see padding; the model given none would build one for its slice): the wrapper runs a causal
        kernel or builds the mask per call."""
        ids = kwargs["input_ids"]
        t = ids.size(1)
        causal = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=ids.device).expand(1, 1, t, t)
        causal.causal_only = True
        positions = torch.arange(t, device=ids.device).expand_as(ids)
        return {"input_ids": ids, "attention_mask": causal, "position_ids": positions}

    def local_slice(self, kwargs: dict, *per_position: torch.Tensor):
        """This rank's contiguous slice of positions of input_ids, position_ids and each (rows, T) tensor of
        `per_position` (targets, owners; T divisible by size). The attention mask stays whole: attention sees whole
        sequences after the all-to-all."""
        t = kwargs["input_ids"].size(1) // self.size
        cut = slice(self.rank * t, (self.rank + 1) * t)
        local = dict(kwargs, input_ids=kwargs["input_ids"][:, cut], position_ids=kwargs["position_ids"][:, cut])
        return (local, *(x[:, cut] for x in per_position))


def rules(c, world: int) -> list[str]:
    """The config's problems with Ulysses (config_loader.validate calls this when its size is over 1)."""
    sp = c.fsdp.ulysses_sequence_parallel_size
    if c.trainer != "FSDPTrainer":
        return [
            f"fsdp.ulysses_sequence_parallel_size={sp}: sequence parallelism splits sequences over "
            f"ranks; it needs trainer=FSDPTrainer (trainer={c.trainer} runs one process)"
        ]
    if world % sp:
        return [f"fsdp.ulysses_sequence_parallel_size={sp}: expected a divisor of the world size {world}"]
    return []


def check(cfg, config) -> None:
    """From config.json alone (`config`; train.check_inputs, before any model loads): each rank of a group attends with
    heads / sp whole attention heads, so sp must divide the model's attention heads (fewer key/value heads are
    repeated); RoPE types that scale by the longest position of a call are refused; on CUDA, packed rows or a sliding
    window need FlexAttention (sdpa would keep a dense (T, T) mask in every layer)."""
    import packing  # its sliding-window rule: Ulysses' rows are its layout

    name = cfg.model.name_or_path
    sp = cfg.fsdp.ulysses_sequence_parallel_size
    heads = getattr(config, "num_attention_heads", None)
    if heads is None:
        raise ConfigError(
            [
                f"fsdp.ulysses_sequence_parallel_size={sp}: the config of model.name_or_path={name!r} has no "
                "attention heads"
            ]
        )
    if heads % sp:
        raise ConfigError(
            [
                f"fsdp.ulysses_sequence_parallel_size={sp}: expected a divisor of the {heads} attention heads of"
                f" model.name_or_path={name!r} (each rank of a sequence-parallel group attends with heads / {sp})"
            ]
        )
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    # Gemma 3: one per layer type
    kinds = [r.get("rope_type", r.get("type")) for r in (rope, *rope.values()) if isinstance(r, dict)]
    if kind := next((k for k in kinds if k in ("dynamic", "longrope")), None):  # each rank sees only its slice
        raise ConfigError(
            [
                f"fsdp.ulysses_sequence_parallel_size={sp} with model.name_or_path={name!r} (model type "
                f"{config.model_type!r}): its RoPE type {kind!r} scales frequencies by the longest position"
                " of a call, and each rank of a group sees only its slice of the positions: not supported yet"
            ]
        )
    # sdpa is the default of a model class that supports it
    cls = transformers.AutoModelForCausalLM._model_mapping.get(type(config), None)
    window = packing.sliding_window(config, float("inf"))
    no_flex = cls is not None and cls._supports_sdpa and not cls._supports_flex_attn
    if torch.cuda.is_available() and no_flex and (cfg.padding_free or window):
        option = "padding_free=true" if cfg.padding_free else f"a sliding window ({window})"
        raise ConfigError(
            [
                f"fsdp.ulysses_sequence_parallel_size={sp} with {option}: {cls.__name__} (model type "
                f"{config.model_type!r}) does not attend through FlexAttention, and sdpa on CUDA would "
                "keep a dense (T, T) mask in every layer; "
                + ("set padding_free=false" if cfg.padding_free else "not supported yet")
            ]
        )


def make_group(device: torch.device, world_size: int, size: int) -> SequenceParallel:
    """The (dp x sp) mesh, as verl's: groups of `size` consecutive ranks (FSDP still shards over all); a collective."""
    mesh = init_device_mesh(device.type, (world_size // size, size), mesh_dim_names=("dp", "sp"))
    return SequenceParallel(group=mesh["sp"].get_group(), rank=mesh.get_local_rank("sp"), size=size)


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """x of Shape (sp, ...): chunk j goes to rank j; chunk r of the result came from rank r."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)  # raw memory, in row-major order
    dist.all_to_all_single(out, x.contiguous(), group=group)
    return out


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    out = x.clone()
    dist.all_reduce(out, group=group)
    return out


class _SelfAdjoint(torch.autograd.Function):
    """A collective whose backward is the same collective of the gradients: the all-to-all (swapping (rank, chunk)
    pairs is its own inverse) and the sum (every rank's loss is a function of the same total)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, collective, group) -> torch.Tensor:
        ctx.collective = collective
        ctx.group = group
        return collective(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.collective(grad, ctx.group), None, None


def _exchange(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """(B, N, M, d) -> (B, N/sp, sp*M, d): chunk j of dim 1 goes to rank j; the chunks received from the ranks are
    concatenated along dim 2, in rank order. Sequence to heads: N heads, M positions; heads to sequence: the reverse."""
    b, n, m, d = x.shape
    chunks = x.reshape(b, sp.size, n // sp.size, m, d).transpose(0, 1)
    received = _SelfAdjoint.apply(chunks, _all_to_all, sp.group)
    return received.permute(1, 2, 0, 3, 4).reshape(b, n // sp.size, sp.size * m, d)


class _AttentionView:
    """The attention module as the inner function sees it: `overrides` (after repeat_kv one key/value head per query
    head; this rank's heads' sinks) in place of its own attributes."""

    def __init__(self, module, **overrides):
        self._module = module
        self.__dict__.update(overrides)

    def __getattr__(self, name):
        return getattr(self._module, name)


def _eager_attention(module):
    """The eager attention function of `module`'s architecture, from the first class of its MRO whose module defines
    one: FSDP2 swaps a sharded module's class for a dynamic `FSDP<cls>` subclass that lives in torch."""
    for cls in type(module).__mro__:
        function = getattr(sys.modules.get(cls.__module__), "eager_attention_forward", None)
        if function is not None:
            return function
    raise TypeError(f"{type(module).__name__}: no eager_attention_forward in the modules of its classes; use sdpa")


def _wrap(implementation: str):
    """The registry's attention function for `implementation` (sdpa, eager): all-to-all, the original over whole
    sequences for this rank's heads, all-to-all back. The causal stand-in of SequenceParallel.whole_row_inputs becomes
    is_causal=True for sdpa (its O(T) causal kernel; a (T, T) mask would pick the O(T^2) math kernel) and, for eager
    (T x T scores anyway), a causal mask per call. A FlexAttention block mask (logps.block_masks: on GPUs, built over
    whole sequences) goes to FlexAttention."""
    original = ALL_ATTENTION_FUNCTIONS.get(implementation)  # eager is unregistered: each model file has its own

    def attention(module, query, key, value, attention_mask, **kwargs):
        inner = _eager_attention(module) if implementation == "eager" else original
        if isinstance(attention_mask, BlockMask):
            inner = flex_attention.flex_attention_forward
        sp = getattr(module, "ulysses_group", None)  # set by install on the modules of a sequence-parallel model
        if sp is None or _PAUSED[0]:
            return inner(module, query, key, value, attention_mask, **kwargs)
        if key.shape[1] % sp.size:  # fewer KV heads than ranks (or not a multiple): one per query head
            key, value = repeat_kv(key, module.num_key_value_groups), repeat_kv(value, module.num_key_value_groups)
            module = _AttentionView(module, num_key_value_groups=1)
        if getattr(module, "sinks", None) is not None:  # gpt-oss: a learned sink logit per head; this rank's heads only
            heads = slice(sp.rank * query.size(1) // sp.size, (sp.rank + 1) * query.size(1) // sp.size)
            module = _AttentionView(module, sinks=module.sinks[heads])
            if "s_aux" in kwargs:  # the copy FlexAttention and flash kernels read
                kwargs["s_aux"] = module.sinks
        # (B, H, T/sp, d), all heads at my positions -> (B, H/sp, T, d), my heads at all positions
        query, key, value = (_exchange(x, sp) for x in (query, key, value))
        if getattr(attention_mask, "causal_only", False):  # the stand-in: sdpa's causal kernel, or eager's mask
            if implementation == "sdpa":
                attention_mask = None
                kwargs["is_causal"] = True
            else:
                t = query.size(-2)
                low = torch.finfo(torch.bfloat16).min
                attention_mask = torch.full((t, t), low, dtype=torch.bfloat16, device=query.device).triu_(1)[None, None]
        out, _ = inner(module, query, key, value, attention_mask, **kwargs)
        # (B, T, H/sp, d) -> (B, T/sp, H, d); no attention weights: they would be per head slice
        return _exchange(out, sp), None

    attention.ulysses = True
    return attention


def install(model: torch.nn.Module, sp: SequenceParallel) -> None:
    """`model` attends sequence-parallel over `sp` from now on: the all-to-all wraps its modules' attention function
    only, in forward and in checkpointed recomputation."""
    implementation = model.config._attn_implementation
    if implementation not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"fsdp.ulysses_sequence_parallel_size={sp.size} with attention {implementation!r}: not supported"
            f" yet; expected one of {SUPPORTED_ATTENTION} (the model's config._attn_implementation)"
        )
    if not getattr(ALL_ATTENTION_FUNCTIONS.get(implementation), "ulysses", False):  # wrapped once per process
        ALL_ATTENTION_FUNCTIONS[implementation] = _wrap(implementation)
    for module in model.modules():  # the attention function receives the attention module: it finds the group there
        module.ulysses_group = sp


paused = SequenceParallel.paused  # also by its module name: sampling (online.py, fsdp.py) and tests
whole_row_inputs = SequenceParallel.whole_row_inputs  # also by its module name: tests build the stand-in alone
