"""Sequence log-probs from a causal LM, top to bottom:
  1. Log-probs of labels by one kernel (`_LabelLogProbs`), a tile of scored rows at a time: the backbone's hidden
     states through the LM head (the tiled head, the default: never (rows, vocab) logits; `tiled_head` gives its
     scale or softcap by model type), or the model's own logits (tiled_lm_head=false). Backward recomputes a tile.
     `label_logps` is the same kernel on given logits or a given head, with its arguments checked.
  2. Entropy of the policy's distribution (logged; an optional bonus in the loss).
  3. Inputs: chosen over rejected in one batch, right-padded rows or rows packed without padding.
  4. `forward_logps`, the one path every trainer calls: per sequence the summed log-probs of its labelled tokens,
     their count and the mean entropy. The default reads straight through `_score` and `_label_logps`; each option
     is one call off it: packed, shared-prefix or Ulysses rows (`_other_rows`), FSDP (`_root_forward`), a mixture
     of experts' routing (`_routing`).

Output t predicts token t+1 everywhere. No option (packing, the tiled head, sequence parallelism) changes what the
log-probs are, only how they are computed; tests/test_logps.py and tests/test_trainers.py compare each with the
plain path.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import math
import warnings
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100  # label of positions that are not scored (prompt, padding)
# Rows per chunk: 1024 rows x 128k vocab x 4 bytes = 0.5 GB of fp32 scratch, a small fraction of the logits and
# their gradient, and large enough to keep a GPU busy.
DEFAULT_CHUNK_SIZE = 1024
# The tiled head sizes its tiles by bytes: its scratch is its only (rows, vocab) memory, so a fixed row count would
# grow with the vocabulary. 128 MiB is 1024 rows up to vocab 32768, 261 rows at Llama-3's 128256.
HEAD_TILE_BYTES = 128 * 2**20


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half/bf16/fp32 inputs (for stability); fp64 stays fp64."""
    return torch.promote_types(dtype, torch.float32)


def _chunks(n: int, size: int) -> list[slice]:
    return [slice(start, start + size) for start in range(0, n, size)]


# ---------- 1. Log-probs of labels ----------
def _tile_logits(hidden, weight, bias, logit_scale: float, softcap, dtype: torch.dtype) -> Tensor:
    """One tile's logits (n, V) in `dtype`, a fresh tensor: `hidden` (n, V) itself where weight is None, else the LM
    head (weight (V, H), bias (V,) or None) on hidden (n, H), the matmul in the inputs' dtype (bf16 on tensor cores,
    as the model's own head), then scale and softcap (None: none) after the upcast."""
    if weight is None:
        return hidden.to(dtype, copy=True)  # copy: the in-place ops must never touch fp32 logits
    logits = F.linear(hidden, weight, bias).to(dtype)
    if logit_scale != 1.0:
        logits.mul_(logit_scale)  # Cohere: logits * logit_scale (Granite: 1 / logits_scaling)
    if softcap is not None:
        logits.div_(softcap).tanh_().mul_(softcap)  # Gemma-2/3: cap * tanh(logits / cap)
    return logits


class _LabelLogProbs(torch.autograd.Function):
    """log softmax(logits)[label] per row, a tile of rows at a time (logits: _tile_logits). Forward keeps only the
    per-row logsumexp (N,); backward recomputes each tile's logits (for the head: one extra matmul) and turns
    d out / d logits straight into the inputs' gradients. The only (rows, V) memory is a few fp32 tiles."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk_size, logit_scale, softcap, with_entropy, with_sum_sq=False):
        dtype = _compute_dtype(hidden.dtype)
        mask = labels != IGNORE_INDEX
        safe = labels.masked_fill(~mask, 0).long()  # any valid index: masked out below
        out = torch.empty(hidden.shape[0], dtype=dtype, device=hidden.device)
        lse = torch.empty_like(out)
        entropy = torch.empty_like(out) if with_entropy else out.new_empty(0)
        sum_sq = torch.empty_like(out) if with_sum_sq else out.new_empty(0)
        # autocast off: the forward and the backward's recomputation must see identical logits
        with torch.autocast(hidden.device.type, enabled=False):
            for rows in _chunks(hidden.shape[0], chunk_size):
                logits = _tile_logits(hidden[rows], weight, bias, logit_scale, softcap, dtype)
                if with_entropy:
                    entropy[rows] = _entropy_chunk(logits)
                if with_sum_sq:
                    sum_sq[rows] = log_sum_sq(logits)
                label_logits = logits.gather(1, safe[rows, None])[:, 0]
                row_max = logits.amax(dim=-1)
                log_sum = logits.sub_(row_max[:, None]).exp_().sum(dim=-1).log_()
                # the same order of roundings as log_softmax: about one fp32 ulp from the exact value
                out[rows], lse[rows] = (label_logits - row_max) - log_sum, row_max + log_sum
                del logits  # free this tile before the next one is allocated
        ctx.save_for_backward(hidden, weight, bias, safe, mask, lse)
        ctx.chunk_size = chunk_size
        ctx.logit_scale = logit_scale
        ctx.softcap = softcap
        ctx.mark_non_differentiable(entropy, sum_sq)
        return out.masked_fill_(~mask, 0.0), entropy, sum_sq

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output: Tensor, _grad_entropy: Tensor, _grad_sum_sq: Tensor):
        hidden, weight, bias, safe, mask, lse = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        # masked rows: exactly zero; logit_scale: d logits / d (hidden @ weight.T + bias), times `slope` below
        grad_rows = grad_output.to(lse.dtype).masked_fill(~mask, 0.0)[:, None] * ctx.logit_scale
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # weight and bias gradients sum over all tiles: accumulated in fp32, cast once at the end
        grad_weight = weight.new_zeros(weight.shape, dtype=lse.dtype) if need_weight else None
        grad_bias = bias.new_zeros(bias.shape, dtype=lse.dtype) if need_bias else None
        with torch.autocast(hidden.device.type, enabled=False):
            for rows in _chunks(hidden.shape[0], ctx.chunk_size):
                tile, targets, g = hidden[rows], safe[rows], grad_rows[rows]
                logits = _tile_logits(tile, weight, bias, ctx.logit_scale, ctx.softcap, lse.dtype)
                # y = c tanh(z / c): dy/dz = 1 - (y / c)^2
                slope = None if ctx.softcap is None else logits.div(ctx.softcap).square_().neg_().add_(1.0)
                # d out / d logits = g (one_hot(label) - softmax) * slope in two parts: `rest` = -g softmax slope
                # goes through the matmuls; the one-hot part, a row of weight (or hidden) times g slope[label], is
                # added apart: inside the matmul that one term of ~1 among V of ~1/V costs up to 4e-5 in fp32.
                label_coef = g if slope is None else g * slope.gather(1, targets[:, None])
                rest = logits.sub_(lse[rows, None]).exp_().mul_(g.neg())
                rest = rest if slope is None else rest.mul_(slope)
                if weight is None:  # hidden held the logits: their gradient, written in their dtype
                    grad_hidden[rows] = rest.scatter_add_(1, targets[:, None], label_coef)
                    continue
                if need_bias:
                    grad_bias += rest.sum(dim=0)
                    grad_bias.index_add_(0, targets, label_coef[:, 0])
                rest = rest.to(hidden.dtype)  # the two matmuls in the inputs' dtype, as the plain path's backward
                if need_hidden:
                    label_rows = weight[targets].to(lse.dtype).mul_(label_coef)
                    grad_hidden[rows] = (rest @ weight).to(lse.dtype).add_(label_rows)
                if need_weight:
                    if grad_weight.dtype == rest.dtype:
                        grad_weight.addmm_(rest.T, tile)  # in place: no (V, H) temporary
                    else:
                        grad_weight += rest.T @ tile
                    grad_weight.index_add_(0, targets, tile.to(lse.dtype).mul_(label_coef))
                del logits, rest, slope
        grad_weight = grad_weight.to(weight.dtype) if need_weight else None
        grad_bias = grad_bias.to(bias.dtype) if need_bias else None
        return grad_hidden, grad_weight, grad_bias, *[None] * 6  # labels and the five settings: none


def head_tile_rows(vocab: int, dtype: torch.dtype = torch.float32) -> int:
    """Rows per tile of the tiled head: DEFAULT_CHUNK_SIZE, fewer where a compute-dtype tile passes HEAD_TILE_BYTES."""
    return max(1, min(DEFAULT_CHUNK_SIZE, HEAD_TILE_BYTES // (vocab * _compute_dtype(dtype).itemsize)))


def label_logps(
    x, labels, weight=None, bias=None, *, chunk_size=None, logit_scale=1.0, softcap=None, with_entropy=False
):
    """log p(labels[n] | row n), Shape (N,), fp32 (fp64 for fp64 inputs), by the kernel training runs, a tile of rows
    at a time: x (N, V) logits, or with weight (V, H) and bias (V,) or None, x (N, H) hidden states through an LM head
    (logit_scale, softcap: see tiled_head), never more than a tile of logits. IGNORE_INDEX labels give 0 and no
    gradient; chunk_size None: head_tile_rows; with_entropy: (log-probs, entropy (N,), detached). For forks and
    benchmarks: training calls the kernel in _label_logps."""
    head = weight is not None
    if x.dim() != 2 or labels.shape != x.shape[:1] or (head and (weight.dim() != 2 or weight.shape[1] != x.shape[1])):
        raise ValueError(
            f"expected x (N, V), or (N, H) with weight (V, H), and labels (N,); got x {tuple(x.shape)}, "
            f"weight {None if weight is None else tuple(weight.shape)}, labels {tuple(labels.shape)}"
        )
    if bias is not None and (not head or bias.shape != weight.shape[:1]):
        raise ValueError(f"bias must be (V,) beside a weight (V, H); got bias {tuple(bias.shape)}")
    given = [t for t in (x, weight, bias) if t is not None]
    if len({t.dtype for t in given}) > 1:
        raise TypeError(f"x, weight and bias must share a dtype; got {[t.dtype for t in given]}")
    chunk_size = head_tile_rows(weight.shape[0] if head else x.shape[1], x.dtype) if chunk_size is None else chunk_size
    if chunk_size < 1 or (softcap is not None and softcap <= 0):
        raise ValueError(f"chunk_size must be >= 1 and softcap > 0 or None; got {chunk_size}, {softcap}")
    out = _LabelLogProbs.apply(x, weight, bias, labels, chunk_size, float(logit_scale), softcap, with_entropy)
    return out[:2] if with_entropy else out[0]


# What a model type's CausalLM does to `hidden @ W.T (+ b)`, read in transformers' modeling files: "*" or "/" by a
# config value, or "tanh" (value * tanh(logits / value)). The tiled head does the same; other types do nothing.
SOFTCAP = ("tanh", "final_logit_softcapping")  # Gemma 2 on, and the types below that share its head
HEAD_POSTPROCESSING = {
    **dict.fromkeys(("cohere", "cohere2", "cohere2_moe", "cohere_compass_text"), ("*", "logit_scale")),
    "hyperclovax": ("*", "logits_scaling"),  # the same key as Granite's, which divides
    "falcon_h1": ("*", "lm_head_multiplier"),
    # MiniCPM3 divides the hidden states: the same for its bias-free head
    **dict.fromkeys(
        ("granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared", "minicpm3"),
        ("/", "logits_scaling"),
    ),
    **dict.fromkeys(("gemma2", "gemma3_text", "gemma3n", "gemma3n_text", "vaultgemma", "nanochat", "beam"), SOFTCAP),
    **dict.fromkeys(("gemma4", "gemma4_text", "gemma4_unified", "gemma4_unified_text"), SOFTCAP),
    "recurrent_gemma": ("tanh", "logits_soft_cap"),
}
# A config carrying one of these keys for a type not listed with it has a head the tiled path does not know (MPT's
# logit_scale, which transformers' MPT ignores; Inkling's width multiplier, with a vocabulary cut): refused.
HEAD_KEYS = {key: op for op, key in HEAD_POSTPROCESSING.values()} | {"logits_mup_width_multiplier": "/"}


def tiled_head(config) -> tuple[float, Optional[float]]:
    """(logit_scale, softcap) for _LabelLogProbs that give the logits of `config`'s model (HEAD_POSTPROCESSING).
    Raises ValueError where the tiled head cannot know them: the model's own code (auto_map), or a head key that its
    type's entry does not apply. train.py can call it on config.json alone, before any model loads."""
    kind = config.model_type
    text = getattr(config, "text_config", None) or config  # multimodal: the text model's
    op, key = HEAD_POSTPROCESSING.get(kind, (None, None))
    values = {k: getattr(text, k, None) for k in HEAD_KEYS if k != key}  # the keys its type's entry does not apply
    found = [f"{k}={v}" for k, v in values.items() if v is not None and (HEAD_KEYS[k] == "tanh" or v != 1)]
    if "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {}):
        found.append("its own code (auto_map)")
    if found:
        raise ValueError(
            f"tiled_lm_head=true: the LM head of model type {kind!r} has {', '.join(found)}, which the tiled head "
            "does not reproduce (its log-probs would differ from the model's); set tiled_lm_head=false"
        )
    value = getattr(text, key, None) if key else None
    if op == "tanh" or value is None:
        return 1.0, value
    return float(value) if op == "*" else 1 / value, None


# ---------- 2. Entropy ----------
def _entropy_chunk(logits: Tensor) -> Tensor:
    """H(softmax(x)) in fp32, (rows, V) -> (rows,), as log s - sum exp(z) z / s with z = x - max(x), s = sum exp(z):
    both terms >= 0, nothing cancels (the textbook logsumexp(x) - sum softmax(x) x loses 3e-5 in fp32 at V=50257)."""
    x = logits.to(_compute_dtype(logits.dtype))
    shifted = x - x.amax(dim=-1, keepdim=True)
    exp = shifted.exp()
    total = exp.sum(dim=-1)
    return total.log() - (exp * shifted).sum(dim=-1) / total


def log_sum_sq(logits: Tensor) -> Tensor:
    """log sum_v p_v^2 of softmax(logits) in fp32, (rows, V) -> (rows,): logsumexp(2 x) - 2 logsumexp(x). WPO's
    alignment term: the log-prob a token would have if sampled from the policy itself, on average."""
    x = logits.to(_compute_dtype(logits.dtype))
    return torch.logsumexp(2 * x, dim=-1) - 2 * torch.logsumexp(x, dim=-1)


class _CompileOnFirstCall:
    """torch.compile(fn), built on the first call (only runs that ask pay the compile); where compiling fails (no
    C++ compiler) it warns once and runs fn eagerly from then on."""

    def __init__(self, fn: Callable[[Tensor], Tensor]):
        self.fn = fn
        self.impl = None

    def __call__(self, x: Tensor) -> Tensor:
        if self.impl is None:
            try:
                self.impl = torch.compile(self.fn, dynamic=True)  # dynamic: the last chunk is shorter
                return self.impl(x)
            except Exception as err:  # noqa: BLE001 - any compile failure means "not available here"
                warnings.warn(
                    f"torch.compile is unavailable here ({type(err).__name__}: {err}); computing "
                    f"{self.fn.__name__} eagerly instead",
                    RuntimeWarning,
                    stacklevel=2,
                )
                self.impl = self.fn
        return self.impl(x)


_COMPILED_ENTROPY_CHUNK = _CompileOnFirstCall(_entropy_chunk)


def entropy_from_logits(
    logits: Tensor,
    *,
    chunking: bool = False,
    checkpointing: bool = False,
    use_compile: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Tensor:
    """Entropy of softmax(logits) at every position, (..., V) -> (...,) in fp32. `chunking`: chunk_size rows at a
    time (one chunk's fp32 softmax at once); `checkpointing`: backward recomputes each chunk instead of keeping it
    (matters only when the entropy is differentiated); `use_compile`: the per-chunk function through torch.compile.
    forward_logps calls it for the entropy bonus (differentiable, also logged); otherwise the logged entropy comes
    from _LabelLogProbs."""
    fn = _COMPILED_ENTROPY_CHUNK if use_compile else _entropy_chunk
    flat = logits.reshape(-1, logits.shape[-1])
    if flat.shape[0] == 0:
        return flat.new_zeros(logits.shape[:-1], dtype=_compute_dtype(logits.dtype))
    recompute = checkpointing and torch.is_grad_enabled() and logits.requires_grad
    pieces = [
        checkpoint(fn, flat[rows], use_reentrant=False) if recompute else fn(flat[rows])
        for rows in _chunks(flat.shape[0], chunk_size if chunking else flat.shape[0])
    ]
    return torch.cat(pieces).view(logits.shape[:-1])


# ---------- 3. Inputs ----------
PADS = {"input_ids": 0, "attention_mask": 0, "labels": IGNORE_INDEX}


def pad_to_length(tensor: Tensor, length: int, pad_value: int) -> Tensor:  # right-pads the last dimension
    return F.pad(tensor, (0, max(0, length - tensor.size(-1))), value=pad_value)


def concatenated_inputs(batch: dict) -> dict[str, Tensor]:
    """Chosen stacked over rejected in one (2B, T) batch, so that the policy and the reference each run ONE forward
    (under FSDP every forward is a round of all-gathers). SFT and KTO batches carry one sequence per example."""
    if "rejected_input_ids" not in batch:
        return {k: batch[f"chosen_{k}"] for k in PADS}
    t = max(batch["chosen_input_ids"].size(1), batch["rejected_input_ids"].size(1))
    return {
        k: torch.cat([pad_to_length(batch[f"chosen_{k}"], t, p), pad_to_length(batch[f"rejected_{k}"], t, p)])
        for k, p in PADS.items()
    }


def padded_inputs(inputs: dict[str, Tensor], multiple: int = 1) -> tuple[dict, Tensor, Tensor]:
    """Model kwargs, labels (R, T) and the sequence each token belongs to (R, T; -1 on padding): one row per
    sequence, right-padded, T rounded up to a multiple of `multiple` (the sequence-parallel size). No attention
    mask: causal attention never lets a token see the padding after it, and padding is never scored, so the model's
    own causal mask gives the same log-probs, and sdpa its causal kernel (a padding mask is a (R, 1, T, T) bias)."""
    t = -(-inputs["input_ids"].size(1) // multiple) * multiple
    ids, mask, labels = (pad_to_length(inputs[k], t, p) for k, p in PADS.items())
    owner = torch.where(mask.bool(), torch.arange(ids.size(0), device=ids.device)[:, None], -1)
    return {"input_ids": ids}, labels, owner


def packed_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """Sequence indices per row of at most max(capacity, longest) tokens: best-fit decreasing (longest first, each
    into the row it fills best, else a new row); rows are kept sorted by room, so O(n log n)."""
    capacity = max(capacity, max(lengths))
    rows = []
    rooms = []  # sorted (room left, row)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        k = bisect.bisect_left(rooms, (lengths[i], -1))
        room, row = rooms.pop(k) if k < len(rooms) else (capacity, len(rows))
        if row == len(rows):
            rows.append([])
        rows[row].append(i)
        bisect.insort(rooms, (room - lengths[i], row))
    return rows


def packed_inputs(
    inputs: dict[str, Tensor], capacity: Optional[int], multiple: int = 1, shared_prefix: bool = False, flex_config=None
) -> tuple[dict, Tensor, Tensor, Optional[tuple]]:
    """The sequences in rows with explicit positions and a (R, 1, T, T) mask, only row ends padded (to the widest
    row, a multiple of `multiple`): `capacity` packs rows of at most that many tokens (packed_rows), positions
    restarting for each sequence and attention confined to it; None: one per row. Returns what padded_inputs
    returns, then the targets the rows cannot hold (None without `shared_prefix`). With `flex_config` (a model
    config) the mask is FlexAttention's block masks for that model instead (block_masks): no (T, T) tensor.

    `shared_prefix` (inputs: chosen rows, then the rejected rows of the same pairs): each pair is ONE sequence,
    prompt + chosen + rejected, so the prompt is computed once (Wang & Hegde 2024, arXiv:2410.20305). The rejected
    continues the prompt's positions and attends to the prompt and to itself, never to the chosen: every log-prob
    is that of the separate sequences. The prompt is the pair's common unscored prefix. The rejected's first
    token is predicted by the prompt's last position, whose own target is the chosen's first: those targets come
    apart, as (flat position in the rows, label, sequence index, column in its input row)."""
    ids, labels = inputs["input_ids"], inputs["labels"]
    (n, t), device = ids.shape, ids.device
    lengths = inputs["attention_mask"].sum(1).tolist()
    units = [[(i, 0, lengths[i])] for i in range(n)]  # a unit's (sequence, start, end) slices, in order
    prompts = []
    if shared_prefix:
        if n % 2:
            raise ValueError(f"shared_prefix needs chosen rows, then the rejected rows of the same pairs; got {n} rows")
        n //= 2
        differ = (ids[:n] != ids[n:]) | (labels[:n] != IGNORE_INDEX) | (labels[n:] != IGNORE_INDEX)
        first = torch.where(differ.any(1), differ.int().argmax(1), t).tolist()  # a pair's first differing column
        prompts = [min(p, lengths[i], lengths[n + i]) for i, p in enumerate(first)]
        units = [[(i, 0, lengths[i]), (n + i, p, lengths[n + i])] for i, p in enumerate(prompts)]
    sizes = [sum(e - s for _, s, e in unit) for unit in units]
    rows = packed_rows(sizes, capacity) if capacity else [[u] for u in range(len(units))]
    width = -(-max(sum(sizes[u] for u in row) for row in rows) // multiple) * multiple
    source = torch.full((len(rows), width), -1)  # each token's flat index into (n, t); -1: padding
    unit = torch.full_like(source, -1)
    branch = torch.zeros_like(source)
    extra = []
    for r, row in enumerate(rows):
        at = 0
        for u in row:
            first = at
            for k, (i, s, e) in enumerate(units[u]):
                source[r, at : at + e - s], unit[r, at : at + e - s] = torch.arange(i * t + s, i * t + e), u
                if shared_prefix:  # 0 prompt, 1 chosen, 2 rejected
                    branch[r, at + (prompts[u] if k == 0 else 0) : at + e - s] = 1 + k
                # (predicting position, the rejected's first token, its label, sequence, column)
                if k == 1 and 0 < s < e:
                    extra.append((r * width + first + s - 1, r * width + at, i * t + s, i, s))
                at += e - s
    source, unit, branch = source.to(device), unit.to(device), branch.to(device)
    pad = source < 0
    ids, row_labels = (
        x.flatten()[source.clamp(min=0)].masked_fill_(pad, fill) for x, fill in ((ids, 0), (labels, IGNORE_INDEX))
    )
    if extra:
        predictor, first_token, label, sequence, column = (torch.tensor(c, device=device) for c in zip(*extra))
        row_labels.view(-1)[first_token] = IGNORE_INDEX  # predicted by the prompt's last position, not the chosen's
        label = labels.flatten()[label]
        extra = tuple(x[label != IGNORE_INDEX] for x in (predictor, label, sequence, column))
    positions = (source % t).masked_fill_(pad, 0)
    owner = torch.where(pad, -1, source // t)
    row_labels.masked_fill_(positions == 0, IGNORE_INDEX)  # a sequence's first token: no output of its own predicts it
    if flex_config is not None:
        mask = block_masks(unit, branch, positions, flex_config)
    else:  # causal within each unit; padding (unit -1) attends to earlier padding, so no row is empty (NaN)
        mask = (unit[:, :, None] == unit[:, None, :]).tril_()
        if shared_prefix:  # block_masks' rule: keys of the prompt (branch 0) or of the query's own branch
            mask &= (branch[:, None, :] == 0) | (branch[:, None, :] == branch[:, :, None])
        mask = mask[:, None]
    return {"input_ids": ids, "attention_mask": mask, "position_ids": positions}, row_labels, owner, extra or None


# Devices whose packed or shared rows attend through FlexAttention: block masks from per-token vectors, fully masked
# blocks skipped, a fused kernel. CPU keeps the dense mask: FlexAttention has no backward on CPU (torch 2.13).
FLEX_DEVICES = ("cuda",)


@functools.cache
def _block_mask_builder(device_type: str):
    """create_block_mask, compiled on GPUs (eager, it materializes the (R, 1, T, T) mask it compresses)."""
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask) if device_type == "cuda" else create_block_mask


def sliding_window(config, length: int) -> Optional[int]:
    """The window of `config`'s sliding-window layers (Mistral, Gemma2/3, Qwen2 with use_sliding_window) where rows of
    `length` tokens are longer; None where no layer slides or the window holds whole rows (causal, as full layers)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    slides = layer_types is None or "sliding_attention" in layer_types
    return window if window and window < length and slides else None


def _per_layer_type(config, length: int, full, banded: Callable):
    """The mask each attention layer of `config` takes, over rows of `length` tokens: `full` for full attention,
    `banded(window)` for sliding-window layers whose window is shorter than the rows (else `full`: causal is the same);
    a dict by layer type for models with `layer_types`, else the one mask all their layers use."""
    window = sliding_window(config, length)
    masks = {"full_attention": full, "sliding_attention": banded(window) if window else full}
    return masks if getattr(config, "layer_types", None) is not None else masks["sliding_attention"]


def block_masks(unit: Tensor, branch: Tensor, positions: Tensor, config):
    """packed_inputs' mask as FlexAttention block masks, as packed_attention_mask shapes it for each layer type of
    `config` (the sliding window counted in positions); the model's sdpa attention takes them (use_flex_attention)."""
    use_flex_attention()
    (rows, t), build = unit.shape, _block_mask_builder(unit.device.type)

    def full(b, h, q, k):  # causal within a unit, keys of the prompt (branch 0) or of the query's own branch
        return (unit[b, q] == unit[b, k]) & (q >= k) & ((branch[b, k] == 0) | (branch[b, k] == branch[b, q]))

    def banded(window: int):
        def sliding(b, h, q, k):
            return full(b, h, q, k) & (positions[b, q] - positions[b, k] < window)

        return build(sliding, rows, None, t, t, device=unit.device)

    return _per_layer_type(config, t, build(full, rows, None, t, t, device=unit.device), banded)


@functools.cache
def use_flex_attention() -> None:
    """Once: transformers' sdpa attention function, wrapped so that a FlexAttention block mask goes to its
    flex_attention_forward instead. The model keeps its sdpa setting: checkpointed recomputation and generation
    dispatch on the mask they are given, as the first forward did."""
    from torch.nn.attention.flex_attention import BlockMask
    from transformers.integrations import flex_attention
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    @functools.wraps(sdpa)  # keeps ulysses.install's mark: it wraps the registry entry once
    def attention(module, query, key, value, attention_mask, **kwargs):
        # over Ulysses' wrapper (installed first) its block masks go to it: FlexAttention after its all-to-all
        if isinstance(attention_mask, BlockMask) and not getattr(sdpa, "ulysses", False):
            return flex_attention.flex_attention_forward(module, query, key, value, attention_mask, **kwargs)
        return sdpa(module, query, key, value, attention_mask, **kwargs)

    ALL_ATTENTION_FUNCTIONS["sdpa"] = attention


def packed_attention_mask(mask: Tensor, config, positions: Optional[Tensor] = None):
    """A 4-D boolean mask (R or 1, 1, T, T) as each attention layer of `config` needs it: a model given a 4-D mask
    uses it as is, so (1) a sliding window (Mistral, Gemma2/3, Qwen2 with use_sliding_window) must be in it, one
    mask per layer type for models with `layer_types`, counted in `positions` (R, T) where they are given (a shared
    prefix: the rejected is nearer the prompt than its column says), else in columns; (2) eager attention adds it
    to the scores: additive bf16 (0 or a large negative; half of fp32's bytes, the same range). A mask marked
    `causal_only` (ulysses.whole_row_inputs: a stand-in of no memory) stays as it is for full attention."""
    causal_only = getattr(mask, "causal_only", False)
    eager = getattr(config, "_attn_implementation", None) == "eager"

    def additive(m: Tensor) -> Tensor:  # added to scores of any dtype, bf16's min still zeroes the softmax
        if not eager or getattr(m, "causal_only", False):
            return m
        low = torch.full(m.shape, torch.finfo(torch.bfloat16).min, dtype=torch.bfloat16, device=m.device)
        return low.masked_fill_(m, 0.0)

    def banded(window: int) -> Tensor:
        if positions is None:  # query i sees keys i-window+1..i: a band, built in bool (no int64 position differences)
            band = torch.ones(mask.shape[-2:], dtype=torch.bool, device=mask.device).triu_(-(window - 1))
        else:  # (R, 1, T) positions: query position - window < key position, compared straight to bool
            p = positions[:, None]
            band = p[..., None, :] > p[..., :, None] - window
        return additive(band.tril_()[None, None] if causal_only else mask & band)

    return _per_layer_type(config, mask.shape[-1], additive(mask), banded)


# ---------- 4. Sequence log-probs ----------
class SequenceLogps(NamedTuple):
    """forward_logps' result, one row per sequence of its inputs."""

    sums: Tensor  # (N,) summed log-probs of the labelled tokens
    counts: Tensor  # (N,) how many
    entropy: Optional[Tensor] = None  # (N,) their mean entropy, with `entropy`
    tokens: Optional[Tensor] = None  # (N, T) each labelled token's log-prob at its column, else 0, with `per_token`
    log_sum_sq: Optional[Tensor] = None  # (N,) summed log sum_v p_v^2 (log_sum_sq) over them, detached, with `sum_sq`
    # (N, 2, E) over each sequence's real tokens and routed layers: top-k picks and router probabilities per expert,
    # with `routing` on a mixture of experts (losses.load_balancing_loss)
    routing: Optional[Tensor] = None


def forward_logps(model: nn.Module, inputs: dict[str, Tensor], **options) -> SequenceLogps:
    """Per sequence of `inputs` ({input_ids, attention_mask, labels}, (N, T)): the summed log-probs of its labelled
    tokens (N,), their count (N,) and what the `options` (keywords, all off by default) ask for besides:
    - `entropy` (entropy_from_logits options): their mean entropy (N,), detached unless `entropy_grad` (a bonus:
      from the full logits, so not with `tiled`); `sum_sq`: WPO's statistic, summed; `per_token`: each token's
      log-prob (N, T), differentiable; `routing` (`routing_grad`: differentiable): a mixture of experts' routing;
    - how they are computed, never what they are: `tiled` (the backbone, then the LM head in tiles on the scored
      positions), `packed_capacity` (rows packed without padding: packed_inputs), `prefix_sharing` (inputs: chosen
      rows, then the rejected of the same pairs; each pair's prompt computed once), `sequence_parallel` (a
      ulysses.SequenceParallel: each rank of the group passes the same inputs, runs its slice of the positions and
      gets whole sequences' results)."""
    # FSDP (1 or 2), told by its class names: this file imports nothing of torch.distributed
    if {"FullyShardedDataParallel", "FSDPModule"} & {cls.__name__ for cls in type(model).__mro__}:
        return _root_forward(model, inputs, options)
    return _score(model, model, inputs, **options)


def _root_forward(model: nn.Module, inputs: dict[str, Tensor], options: dict) -> SequenceLogps:
    """forward_logps under FSDP (1 or 2), as the root unit's forward: between its pre-forward (which gathers the
    embeddings, final norm and LM head: the tiled path may call the backbone and read the head's weight directly) and
    its post-forward (which hooks the backward on the returned sums)."""
    inner = model.module if type(model).__name__ == "FullyShardedDataParallel" else model  # FSDP1 wraps, FSDP2 not
    # nothing wrapped or renamed: state dicts keep their keys. The inputs go through the root's call: FSDP2's root
    # pre-forward on CUDA moves its arguments to the device.
    inner.forward = lambda inputs: _score(inner, functools.partial(type(inner).forward, inner), inputs, **options)
    try:
        return model(inputs)
    finally:
        del inner.forward


def _score(
    model: nn.Module,
    call,
    inputs: dict[str, Tensor],
    *,
    packed_capacity: Optional[int] = None,
    tiled: bool = False,
    prefix_sharing: bool = False,
    entropy: Optional[dict] = None,
    entropy_grad: bool = False,
    sequence_parallel=None,
    per_token: bool = False,
    sum_sq: bool = False,
    routing: bool = False,
    routing_grad: bool = False,
) -> SequenceLogps:
    """forward_logps on the causal LM `model`; `call(**kwargs)` runs its full forward (the model itself, or its class
    forward inside the root unit's forward)."""
    (n, width), sp = inputs["input_ids"].shape, sequence_parallel
    if packed_capacity or prefix_sharing or sp:
        kwargs, labels, owner, extra = _other_rows(model, inputs, packed_capacity, prefix_sharing, sp)
    else:  # one right-padded row per sequence
        (kwargs, labels, owner), extra = padded_inputs(inputs), None
    # each token's column in its input row: its position, where rows hold several sequences
    column = kwargs.get("position_ids", torch.arange(labels.size(1), device=labels.device).expand_as(labels))
    token_of = (owner, column)  # unshifted: a router sees token t at position t
    # output t predicts token t+1: aligned so that position t holds its own target, a row can be cut into slices
    targets, owner, column = (
        F.pad(x[:, 1:], (0, 1), value=v) for x, v in ((labels, IGNORE_INDEX), (owner, -1), (column, 0))
    )
    if sp:
        kwargs, targets, owner, column, *token_of = sp.local_slice(kwargs, targets, owner, column, *token_of)
    with _router_logits(model) if routing else contextlib.nullcontext([]) as routed:
        logps, token_entropy, token_sq, scored = _label_logps(
            model, call, kwargs, targets, extra, tiled=tiled, entropy=entropy, entropy_grad=entropy_grad, sum_sq=sum_sq
        )
    owner, column = owner.to(scored.device)[scored], column.to(scored.device)[scored]
    if extra is not None:
        owner, column = torch.cat([owner, extra[2].to(owner.device)]), torch.cat([column, extra[3].to(owner.device)])

    def per_sequence(values: Tensor) -> Tensor:  # summed over each sequence's tokens, then over the group's slices
        sums = values.new_zeros(n).index_add(0, owner, values)
        return sp.sum_over_group(sums) if sp else sums  # differentiable: each rank scored a slice

    sums, counts = per_sequence(logps), per_sequence(torch.ones_like(owner))
    # each rank scattered its slice's tokens: the group's sum holds every token once
    tokens = logps.new_zeros(n, width).index_put((owner, column), logps) if per_token else None
    return SequenceLogps(
        sums,
        counts,
        None if token_entropy is None else per_sequence(token_entropy) / counts.clamp(min=1),
        sp.sum_over_group(tokens) if sp and per_token else tokens,
        None if token_sq is None else per_sequence(token_sq),
        _routing(routed, *token_of, n, prefix_sharing, model.config, routing_grad, sp) if routed else None,
    )


def _label_logps(
    model, call, kwargs: dict, targets: Tensor, extra: Optional[tuple], *, tiled, entropy, entropy_grad, sum_sq
) -> tuple[Tensor, Optional[Tensor], Optional[Tensor], Tensor]:
    """The model on its row inputs: each target's log-prob (the scored positions in row order, then `extra`'s), their
    entropies and log sum p^2 where asked, and the (R, T) mask of scored positions. One kernel (_LabelLogProbs) on
    the scored rows: of the backbone's hidden states through the LM head (`tiled`), or of the model's own logits;
    only an entropy bonus (`entropy_grad`) differentiates the full softmax of those logits."""
    if tiled:
        lm = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft
        backbone, head = lm.base_model, lm.get_output_embeddings()
        others = ", ".join(name for name, child in lm.named_children() if child not in (backbone, head))
        if others or hasattr(head, "base_layer"):  # a head of more than its output embeddings, or with LoRA (peft)
            why = (
                f"computes its logits with {others} too, not its output embeddings alone"
                if others
                else "has a LoRA adapter on its LM head, whose .weight is the base layer's"
            )
            raise ValueError(
                f"tiled_lm_head=true: {type(lm).__name__} {why}, which the tiled head does not reproduce; set "
                "tiled_lm_head=false"
            )
        scale, softcap = tiled_head(lm.config)
        hidden = backbone(**kwargs, use_cache=False).last_hidden_state  # use_cache=False: training needs no KV cache
        weight, bias = head.weight, head.bias
        if torch.is_autocast_enabled(hidden.device.type):  # the tiles' matmuls in its dtype, as the model's own head
            dtype = torch.get_autocast_dtype(hidden.device.type)  # (the casts' backward: grads in the params' dtype)
            weight, bias = weight.to(dtype), None if bias is None else bias.to(dtype)
        # under device_map the LM head may sit on another GPU than the backbone's output
        hidden = hidden.to(device=weight.device, dtype=weight.dtype)
        chunk = head_tile_rows(weight.shape[0], weight.dtype)
    else:  # the logits stand where the hidden states were: no head (weight None), nothing to scale or cap
        hidden = call(**kwargs, use_cache=False).logits
        weight, bias = None, None
        scale, softcap = 1.0, None
        chunk = DEFAULT_CHUNK_SIZE
    targets = targets.to(hidden.device)  # free on the same device
    scored = targets != IGNORE_INDEX
    rows, labels = hidden[scored], targets[scored]
    if extra is not None:  # the rejected's first tokens, from the prompts' last positions
        extra = tuple(x.to(hidden.device) for x in extra)
        rows, labels = torch.cat([rows, hidden.flatten(0, 1)[extra[0]]]), torch.cat([labels, extra[1]])
    del hidden  # untiled: the full logits go before the kernel runs (only the scored rows are kept, for backward)
    bonus = entropy is not None and entropy_grad and not tiled and torch.is_grad_enabled()
    logps, token_entropy, token_sq = _LabelLogProbs.apply(
        rows, weight, bias, labels, chunk, scale, softcap, entropy is not None and not bonus, sum_sq
    )
    if bonus:  # differentiable: entropy_from_logits, chunked or checkpointed as asked
        token_entropy = entropy_from_logits(rows, **entropy)
    return logps, token_entropy if entropy is not None else None, token_sq if sum_sq else None, scored


def _other_rows(model: nn.Module, inputs: dict[str, Tensor], packed_capacity, prefix_sharing, sp):
    """The rows of the options that lay sequences out otherwise than one right-padded row each, as packed_inputs
    returns them: packed (`packed_capacity`), a pair's prompt shared (`prefix_sharing`), or whole rows for Ulysses
    to slice (`sp`: a width its size divides). Their attention mask is dense, shaped for each layer type
    (packed_attention_mask), or on GPUs FlexAttention's block masks (no (T, T) tensor)."""
    if prefix_sharing and sp:
        raise ValueError("prefix_sharing with sequence parallelism is not supported yet")
    multiple = sp.size if sp else 1
    sdpa = model.config._attn_implementation == "sdpa"
    on_gpu = inputs["input_ids"].device.type in FLEX_DEVICES
    flex = on_gpu and sdpa and getattr(model, "_supports_flex_attn", False)  # GPT-2's attention reads the mask's ndim
    # refused from the config alone: every rank at its first forward (a row's width would stop some ranks, not all)
    if sp and on_gpu and sdpa and not flex and (packed_capacity or (window := sliding_window(model.config, math.inf))):
        option = "padding_free=true" if packed_capacity else f"a sliding window ({window})"
        raise ValueError(
            f"fsdp.ulysses_sequence_parallel_size={sp.size} with {option}: {type(model).__name__} does not"
            " attend through FlexAttention, and sdpa on CUDA would keep a dense (T, T) mask in every "
            "layer; " + ("set padding_free=false" if packed_capacity else "not supported yet")
        )
    # Ulysses' padded rows longer than a sliding window need its band: on GPUs a BlockMask, the rows laid out as packed
    band = sp and sliding_window(model.config, -(-inputs["input_ids"].size(1) // multiple) * multiple)
    if packed_capacity or prefix_sharing or (band and flex):
        kwargs, labels, owner, extra = packed_inputs(
            inputs, packed_capacity, multiple, prefix_sharing, model.config if flex else None
        )
    else:  # Ulysses over padded rows: explicit positions and a causal stand-in mask
        (kwargs, labels, owner), extra = padded_inputs(inputs, multiple), None
        kwargs = sp.whole_row_inputs(kwargs)
    if isinstance(kwargs["attention_mask"], Tensor):  # dense: the mask each layer type needs
        kwargs["attention_mask"] = packed_attention_mask(
            kwargs["attention_mask"], model.config, kwargs["position_ids"] if prefix_sharing else None
        )
    return kwargs, labels, owner, extra


def routers(model: nn.Module) -> list[tuple[nn.Module, int]]:
    """The router modules of a mixture of experts and the index of the logits in their output: those transformers
    records as `router_logits` (output_router_logits, load_balancing_loss_func); [] for a dense model."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft
    recorder = (getattr(lm, "_can_record_outputs", None) or {}).get("router_logits")
    if recorder is None:
        return []
    if recorder.target_class is None:  # a class named by its suffix: not among the models tested here
        raise ValueError(
            f"{type(lm).__name__} records router logits of class {recorder.class_name!r}, which "
            "logps.routers does not find; set loss.router_aux_loss=off"
        )
    return [(m, recorder.index) for m in lm.modules() if isinstance(m, recorder.target_class)]


@contextlib.contextmanager
def _router_logits(model: nn.Module):
    """A list that each router of `model` appends its logits (tokens, E) to during the forward inside. The hooks go
    before backward: a checkpointed block's recomputation appends nothing."""
    found = []
    hooks = [m.register_forward_hook(lambda _m, _a, out, i=i: found.append(out[i])) for m, i in routers(model)]
    try:
        yield found
    finally:
        for hook in hooks:
            hook.remove()


def _routing(logits: list[Tensor], owner: Tensor, column: Tensor, n: int, shared_prefix: bool, config, grad, sp):
    """(n, 2, E): per sequence, how often each expert is among a token's top_k and its summed router probability,
    over the sequence's real tokens (owner (R, T): its index, -1 on padding) and every routed layer (logits: one
    (R * T, E) per layer), as load_balancing_loss_func counts them (softmax over all experts, top-k of it). Shared
    rows (chosen, then the rejected of the same pairs) hold a pair's prompt once: it counts for both sequences.
    Differentiable with `grad`; under Ulysses (`sp`) each rank routed a slice of the tokens: summed over the group."""
    with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
        probs = [torch.softmax(x.to(owner.device).float(), -1) for x in logits]  # device_map: layers on several GPUs
        picks = sum(
            torch.zeros_like(p).scatter_(1, p.detach().topk(config.num_experts_per_tok).indices, 1.0) for p in probs
        )
        tokens = torch.stack([picks, sum(probs)], 1)
        owner, column = owner.flatten(), column.flatten()
        real = owner >= 0
        out = tokens.new_zeros(n, *tokens.shape[1:]).index_add(0, owner[real], tokens[real])
        if shared_prefix:  # the prompt: the chosen's tokens before the column where its rejected's own tokens start
            start = torch.full((n,), column.numel(), device=owner.device)
            start = start.scatter_reduce(0, owner[real], column[real], "amin")
            half = n // 2
            prompt = real & (owner < half) & (column < start[(owner + half).clamp(max=n - 1)])
            out = out.index_add(0, owner[prompt] + half, tokens[prompt])
        return sp.sum_over_group(out) if sp else out
