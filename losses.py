"""The math of preference optimization: log-prob helpers and one pure function per loss.

Read top to bottom:
  1. Per-token log-probs of the labels, computed chunk by chunk so that no full-vocabulary fp32
     copy of the logits ever exists (custom autograd Function), and the sequence reductions.
  2. Entropy of the policy over response tokens, for logging.
  2b. The same log-probs (and entropy) from the backbone's last hidden states: only the scored
     positions go through the LM head, a tile of rows at a time (`linear_token_logps`).
  3. The losses: one small pure function each, all with the original DPO signature
     `(policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps,
     *, <hyperparameters named as the config keys>) -> (losses, chosen_rewards, rejected_rewards)`,
     registered in the one dict `LOSSES`.
  4. `compute_loss`, the only thing the trainer calls: it turns summed log-probs and token counts
     into what each loss wants (sum or per-token mean, reference or zeros), sums the weighted
     losses and builds the batch metrics.

To add a loss: write a function like `dpo_loss`, add one line to `LOSSES` (and a field to config.LossConfig
for a new hyperparameter), add `config/loss/<name>.yaml`, and a hand-worked test in tests/test_losses.py.
README.md "Adding a loss" walks through an example.

Departures from the papers and from the original DPO code, numbered:
  1. `sft` defaults to the per-token mean NLL of the chosen response (the original SFT trainer
     summed); the mean keeps its scale independent of length and equal to the NLL term of
     RPO/ORPO, so `names=[dpo, sft]` reproduces RPO. Set `average_log_prob: true/false` to choose.
  2. `bco_pair` uses the detached mean reward of the current batch as its shift δ, not the
     running mean of the BCO paper: a loss here is a pure function with no state across steps.
  3. The f-divergence transforms drop additive constants of f'(u) so that the implicit reward is
     0 when policy = reference (constants cancel in the loss, so the loss is unchanged).
  4. `simpo`'s `gamma` is the margin γ itself; the SimPO code base exposes γ/β instead.
  5. `exo_pair` raises on `label_smoothing == 0` (its loss is infinite there) instead of
     silently replacing it with 1e-3.
  6. `chosen_nll` is each sequence's own per-token mean (then averaged over the batch by the
     trainer), not one mean over all tokens of the batch.
  7. f-DPO's forward_kl and alpha_divergence terms exp(-alpha log u) are computed as
     exp(log beta - alpha log u), capped one e below overflow (`_exp_capped`, as TRL's cap_exp): a
     log-ratio <= -90 gave an inf loss and a NaN gradient in fp32; now the loss is exact as far as
     the dtype can hold it and flat (gradient 0 in that log-ratio) beyond.
  8. `aot` and `bco_pair` use statistics of the whole batch (registry `batch_statistics=True`), so
     they are refused, not approximated, when a step is split (gradient accumulation, token-budget
     micro-batches, several ranks): config.py says so before anything loads.

  9. `kto`'s KL reference point is estimated over the mismatched rows of the whole step (all micro-batches and
     ranks, by the trainer) rather than per micro-batch as HALOs does, so the loss does not depend on the split;
     it is clamped at 0 and detached, as in the paper (TRL all-gathers it across processes the same way).

Which loss reads which `loss.<key>` is declared once, by the keyword-only parameters of its
function; config.py refuses a key changed from its default that no selected loss reads (for
example `loss=ipo loss.label_smoothing=0.1`), so no setting is silently ignored.
"""

from __future__ import annotations

import functools
import inspect
import math
import warnings
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100  # label value of positions that are not scored (prompt, padding)

# Rows per chunk: 1024 rows x 128k vocab x 4 bytes = 0.5 GB of fp32 scratch, a small fraction of
# the (rows, vocab) logits and their gradient, and large enough to keep a GPU busy.
DEFAULT_CHUNK_SIZE = 1024
# The tiled LM head (linear_token_logps) sizes its tiles by bytes instead: its scratch is the only
# (rows, vocab) memory it has, so a fixed row count would make it grow with the vocabulary (1024 rows
# are 0.49 GiB at Llama-3's 128256, more than the rest of a small model's step). 128 MiB is 1024 rows
# up to vocab 32768, 261 rows at 128256; a 261 x hidden x 128256 matmul still fills a GPU.
HEAD_TILE_BYTES = 128 * 2**20


# ---------------------------------------------------------------------------------------------
# 1. Per-token log-probs
# ---------------------------------------------------------------------------------------------


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half/bf16/fp32 logits (for stability), fp64 stays fp64."""
    return torch.promote_types(dtype, torch.float32)


class _LabelLogProbs(torch.autograd.Function):
    """log softmax(logits)[label] = logit[label] - logsumexp(logits), chunked over rows.

    Forward keeps only the per-row logsumexp (N,) for backward; backward recomputes the softmax one
    chunk at a time and writes the gradient straight into a tensor of the logits' dtype. So besides
    the logits and their gradient, the only (rows, vocab) memory is one fp32 chunk.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, chunk_size: int) -> Tensor:
        # logits: (N, V), labels: (N,) with IGNORE_INDEX at masked rows.
        dtype = _compute_dtype(logits.dtype)
        mask = labels != IGNORE_INDEX
        safe_labels = labels.masked_fill(~mask, 0).long()  # any valid index; masked out below
        label_logits = logits.gather(1, safe_labels.unsqueeze(1)).squeeze(1).to(dtype)
        row_max = torch.empty(logits.shape[0], dtype=dtype, device=logits.device)
        log_sum_exp_shifted = torch.empty_like(row_max)  # log sum exp(x - max)
        for start in range(0, logits.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            # copy=True: the in-place ops below must never touch fp32 logits themselves
            chunk = logits[rows].to(dtype, copy=True)
            row_max[rows] = chunk.amax(dim=-1)
            log_sum_exp_shifted[rows] = chunk.sub_(row_max[rows].unsqueeze(1)).exp_().sum(dim=-1).log_()
        # (x_label - max) - log sum exp(x - max) rather than x_label - logsumexp(x): the same order
        # of roundings as log_softmax, and about one fp32 ulp from the exact value.
        out = (label_logits - row_max) - log_sum_exp_shifted
        ctx.save_for_backward(logits, safe_labels, mask, row_max + log_sum_exp_shifted)  # lse (N,)
        ctx.chunk_size = chunk_size
        return out.masked_fill(~mask, 0.0)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output: Tensor):
        logits, safe_labels, mask, lse = ctx.saved_tensors
        # d out / d logits = one_hot(label) - softmax; masked rows get a zero upstream gradient,
        # so their gradient is exactly zero.
        grad_rows = grad_output.to(lse.dtype).masked_fill(~mask, 0.0).unsqueeze(1)
        grad_logits = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            chunk = logits[rows].to(lse.dtype, copy=True)
            softmax = chunk.sub_(lse[rows].unsqueeze(1)).exp_()
            chunk_grad = softmax.mul_(grad_rows[rows].neg())
            chunk_grad.scatter_add_(1, safe_labels[rows].unsqueeze(1), grad_rows[rows])
            grad_logits[rows] = chunk_grad  # cast to the logits' dtype here, one chunk at a time
        return grad_logits, None, None


def _check_shapes(logits: Tensor, labels: Tensor) -> None:
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            "logits.shape[:-1] must equal labels.shape; got logits "
            f"{tuple(logits.shape)} and labels {tuple(labels.shape)}"
        )


def _shift_labels(labels: Tensor) -> Tensor:
    """labels[..., t+1] moved to position t, IGNORE_INDEX at the last position. Shape as labels."""
    # output t predicts token t+1. We shift the labels rather than slicing logits[..., :-1, :]:
    # a sliced (batch, seq-1, vocab) view cannot be flattened without copying the whole logits.
    return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


def per_token_logps(
    logits: Tensor, labels: Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> tuple[Tensor, Tensor]:
    """Log-prob of each label token under the model, without a full fp32 log-softmax.

    Args:
        logits: Shape (batch, seq, vocab), any float dtype (bf16 in practice).
        labels: Shape (batch, seq); IGNORE_INDEX (-100) marks tokens that are not scored.
        chunk_size: rows (positions) processed at once.

    Returns:
        (logps, mask), each Shape (batch, seq - 1): logps[b, t] = log p(labels[b, t+1] | logits[b, t])
        in fp32 (fp64 for fp64 logits), 0 where masked; mask is True where the label is scored.
    """
    _check_shapes(logits, labels)
    shifted = _shift_labels(labels)
    return target_logps(logits, shifted, chunk_size)[..., :-1], shifted[..., :-1] != IGNORE_INDEX


def target_logps(logits: Tensor, targets: Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE) -> Tensor:
    """per_token_logps with the targets already aligned to the logits (no shift): log p(targets[b, t] | logits[b, t]).

    Args:
        logits: Shape (batch, seq, vocab).
        targets: Shape (batch, seq); IGNORE_INDEX where not scored. Used where a row's positions are cut into
            slices (sequence parallelism): the target of a slice's last position is the next slice's first token.

    Returns:
        Shape (batch, seq), fp32 (fp64 for fp64 logits), 0 where ignored.
    """
    _check_shapes(logits, targets)
    vocab = logits.shape[-1]
    return _LabelLogProbs.apply(logits.reshape(-1, vocab), targets.reshape(-1), chunk_size).view(targets.shape)


def sequence_logps(logps_sum: Tensor, lengths: Tensor, average_log_prob: bool) -> Tensor:
    """Sequence log-prob: the sum over its tokens (the original DPO), or the per-token mean.

    Args:
        logps_sum: Shape (batch,), summed token log-probs.
        lengths: Shape (batch,), number of scored tokens (clamped to >= 1 so an empty response
            gives 0, not NaN).
    """
    if not average_log_prob:
        return logps_sum
    return logps_sum / lengths.clamp(min=1).to(logps_sum.dtype)


def logps_sum_and_count(
    logits: Tensor, labels: Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> tuple[Tensor, Tensor]:
    """What `compute_loss` takes: summed label log-probs and token counts, each Shape (batch,)."""
    logps, mask = per_token_logps(logits, labels, chunk_size)
    return logps.sum(-1), mask.sum(-1)


# ---------------------------------------------------------------------------------------------
# 2. Entropy, for logging
# ---------------------------------------------------------------------------------------------


def _entropy_chunk(logits: Tensor) -> Tensor:
    """H(softmax(x)) in fp32. Shape (rows, vocab) -> (rows,).

    With z = x - max(x) and s = sum exp(z): H = log s - sum exp(z) z / s. Both terms are >= 0, so
    nothing cancels. The textbook logsumexp(x) - sum softmax(x) x subtracts two numbers near
    log(vocab) + max(x): 3e-5 off in fp32 at vocab 50257, against 6e-7 for this form.
    """
    x = logits.to(_compute_dtype(logits.dtype))
    shifted = x - x.amax(dim=-1, keepdim=True)
    exp = shifted.exp()
    total = exp.sum(dim=-1)
    return total.log() - (exp * shifted).sum(dim=-1) / total


class _CompileOnFirstCall:
    """`torch.compile(fn)`, built lazily on the first call (compiling costs seconds, so only runs
    that ask for it pay). If compiling fails (no C++ compiler, unsupported platform) it warns once
    and runs `fn` eagerly from then on; a genuine bug in `fn` still raises from the eager call."""

    def __init__(self, fn: Callable[[Tensor], Tensor]):
        self.fn = fn
        self.impl: Callable[[Tensor], Tensor] | None = None

    def __call__(self, x: Tensor) -> Tensor:
        if self.impl is not None:
            return self.impl(x)
        try:
            compiled = torch.compile(self.fn, dynamic=True)  # dynamic: the last chunk is shorter
            out = compiled(x)
        except Exception as err:  # noqa: BLE001 - any compile failure means "not available here"
            warnings.warn(
                f"torch.compile is unavailable here ({type(err).__name__}: {err}); "
                f"computing {self.fn.__name__} eagerly instead",
                RuntimeWarning,
                stacklevel=2,
            )
            self.impl = self.fn
            return self.fn(x)
        self.impl = compiled
        return out


_COMPILED_ENTROPY_CHUNK = _CompileOnFirstCall(_entropy_chunk)


def entropy_from_logits(
    logits: Tensor,
    *,
    chunking: bool = False,
    checkpointing: bool = False,
    use_compile: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Tensor:
    """Entropy of softmax(logits) at every position. Shape (..., vocab) -> (...,), fp32.

    Args:
        chunking: process `chunk_size` rows at a time, so only one chunk's fp32 softmax exists.
        checkpointing: wrap each chunk in torch.utils.checkpoint, so backward recomputes the
            softmax instead of keeping it (only matters when the entropy is differentiated).
        use_compile: run the per-chunk function through torch.compile (Inductor fuses its
            elementwise ops and reductions); falls back to eager with a warning where compiling fails.
    """
    chunk_fn = _COMPILED_ENTROPY_CHUNK if use_compile else _entropy_chunk
    flat = logits.reshape(-1, logits.shape[-1])
    if flat.shape[0] == 0:
        return flat.new_zeros(logits.shape[:-1], dtype=_compute_dtype(logits.dtype))
    step = chunk_size if chunking else flat.shape[0]
    recompute = checkpointing and torch.is_grad_enabled() and logits.requires_grad
    pieces = []
    for start in range(0, flat.shape[0], step):
        rows = flat[start : start + step]
        pieces.append(checkpoint(chunk_fn, rows, use_reentrant=False) if recompute else chunk_fn(rows))
    return torch.cat(pieces).view(logits.shape[:-1])


def response_entropy(
    logits: Tensor,
    labels: Tensor,
    *,
    chunking: bool = False,
    checkpointing: bool = False,
    use_compile: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Tensor:
    """Mean entropy of the policy over each sequence's response tokens. Shape (batch,).

    Position t counts when labels[t+1] is scored (output t predicts token t+1), the same tokens
    `per_token_logps` scores. logits: Shape (batch, seq, vocab); labels: Shape (batch, seq).
    """
    _check_shapes(logits, labels)
    entropy = entropy_from_logits(
        logits,
        chunking=chunking,
        checkpointing=checkpointing,
        use_compile=use_compile,
        chunk_size=chunk_size,
    )
    mask = _shift_labels(labels) != IGNORE_INDEX
    return (entropy * mask).sum(-1) / mask.sum(-1).clamp(min=1)


# ---------------------------------------------------------------------------------------------
# 2b. Log-probs (and entropy) straight from the last hidden states: the LM head, in tiles
#
# per_token_logps needs the model's (batch, seq, vocab) logits, most of them at prompt and
# padding positions that are never scored. Here the caller runs only the backbone, keeps the
# rows whose next token is scored (select_scored_positions), and linear_token_logps projects
# those rows through the LM head a tile at a time: no (rows, vocab) tensor beyond a few tiles
# exists, forward or backward.
# ---------------------------------------------------------------------------------------------


def select_scored_positions(hidden: Tensor, labels: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The rows `linear_token_logps` takes: the hidden states of the positions that are scored.

    Args:
        hidden: Shape (batch, seq, H), the backbone's last hidden states, i.e. what the LM head
            sees (after the final norm: `model.model(...).last_hidden_state` for HF Llama).
        labels: Shape (batch, seq); IGNORE_INDEX (-100) marks tokens that are not scored.

    Returns:
        (rows, targets, mask): rows Shape (N, H), targets Shape (N,), and mask Shape (batch, seq - 1),
        the same mask per_token_logps returns; rows are hidden[:, :-1][mask] in row-major order, so
        `linear_token_logps(rows, W, targets)[i] == per_token_logps(logits, labels)[0][mask][i]`.
        Per-sequence sums: `logps.new_zeros(mask.shape).masked_scatter(mask, logps).sum(-1)`;
        token counts: `mask.sum(-1)`.
    """
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            "hidden.shape[:-1] must equal labels.shape; got hidden "
            f"{tuple(hidden.shape)} and labels {tuple(labels.shape)}"
        )
    shifted = _shift_labels(labels)  # output t predicts token t+1; the last position is never scored
    keep = shifted != IGNORE_INDEX
    return hidden[keep], shifted[keep], keep[..., :-1]


def _head_logits(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, logit_scale: float, softcap: float | None,
    dtype: torch.dtype,
) -> Tensor:
    """The LM head on one tile of rows: (n, H) -> (n, V) logits in `dtype`, a fresh tensor.

    The matmul runs in the inputs' dtype, as the model's own lm_head does (bf16 on tensor cores);
    scaling and softcapping run after the upcast.
    """
    logits = F.linear(hidden, weight, bias).to(dtype)  # .to is a no-op for fp32: still fresh
    if logit_scale != 1.0:
        logits.mul_(logit_scale)  # Cohere: logits * logit_scale
    if softcap is not None:
        logits.div_(softcap).tanh_().mul_(softcap)  # Gemma-2/3: cap * tanh(logits / cap)
    return logits


class _LinearLabelLogProbs(torch.autograd.Function):
    """log softmax(head(hidden))[label] for each row of hidden, one tile of rows at a time.

    Forward keeps only the per-row logsumexp (N,), like _LabelLogProbs; backward recomputes each
    tile's logits from hidden and weight (one extra matmul) and turns d out / d logits straight
    into the gradients of hidden, weight and bias. The only (rows, vocab) memory is a few fp32
    tiles of `chunk_size` rows.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk_size, logit_scale, softcap, with_entropy):
        # hidden: (N, H), weight: (V, H), bias: (V,) or None, labels: (N,) with IGNORE_INDEX rows.
        dtype = _compute_dtype(hidden.dtype)
        mask = labels != IGNORE_INDEX
        safe_labels = labels.masked_fill(~mask, 0).long()  # any valid index; masked out below
        out = torch.empty(hidden.shape[0], dtype=dtype, device=hidden.device)
        lse = torch.empty_like(out)
        entropy = torch.empty_like(out) if with_entropy else out.new_empty(0)
        # autocast off: the forward and the backward's recomputation must see identical logits
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], chunk_size):
                rows = slice(start, start + chunk_size)
                logits = _head_logits(hidden[rows], weight, bias, logit_scale, softcap, dtype)
                if with_entropy:  # section 2's formula; before the in-place ops below
                    entropy[rows] = _entropy_chunk(logits)
                label_logits = logits.gather(1, safe_labels[rows].unsqueeze(1)).squeeze(1)
                row_max = logits.amax(dim=-1)
                log_sum_exp_shifted = logits.sub_(row_max.unsqueeze(1)).exp_().sum(dim=-1).log_()
                # the same order of roundings as _LabelLogProbs (see there)
                out[rows] = (label_logits - row_max) - log_sum_exp_shifted
                lse[rows] = row_max + log_sum_exp_shifted
                del logits  # free this tile before the next one is allocated: one tile, not two
        ctx.save_for_backward(hidden, weight, bias, safe_labels, mask, lse)
        ctx.chunk_size, ctx.logit_scale, ctx.softcap = chunk_size, logit_scale, softcap
        ctx.mark_non_differentiable(entropy)
        return out.masked_fill_(~mask, 0.0), entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output: Tensor, _grad_entropy: Tensor):
        hidden, weight, bias, safe_labels, mask, lse = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_rows = grad_output.to(lse.dtype).masked_fill(~mask, 0.0).unsqueeze(1)  # g; 0 at masked rows
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # weight and bias gradients are sums over all tiles: accumulated in fp32, cast once at the end
        grad_weight = weight.new_zeros(weight.shape, dtype=lse.dtype) if need_weight else None
        grad_bias = bias.new_zeros(bias.shape, dtype=lse.dtype) if need_bias else None
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], ctx.chunk_size):
                rows = slice(start, start + ctx.chunk_size)
                tile = hidden[rows]
                logits = _head_logits(tile, weight, bias, ctx.logit_scale, ctx.softcap, lse.dtype)
                if ctx.softcap is not None:  # y = c tanh(z / c): dy/dz = 1 - tanh^2 = 1 - (y / c)^2
                    slope = logits.div(ctx.softcap).square_().neg_().add_(1.0).mul_(ctx.logit_scale)
                else:
                    slope = None
                targets = safe_labels[rows]
                # d out / d logits = g (one_hot(label) - softmax) * slope, with slope = logit_scale
                # times the softcap's derivative, in two parts: `rest` = -g softmax * slope goes
                # through the matmuls; the one-hot part, g * slope[label] per row, is added as rows
                # of weight (to grad_hidden) and of hidden (to grad_weight). Summed inside the
                # matmul, that one term of size ~1 among V terms of size ~1/V costs up to 4e-5 in
                # fp32 at V = 50257 (a long dot product), and in bf16 it would be rounded to bf16.
                label_slope = ctx.logit_scale if slope is None else slope.gather(1, targets.unsqueeze(1))
                label_coef = grad_rows[rows] * label_slope  # (n, 1)
                rest = logits.sub_(lse[rows].unsqueeze(1)).exp_().mul_(grad_rows[rows].neg())
                if slope is not None:
                    rest.mul_(slope)
                elif ctx.logit_scale != 1.0:
                    rest.mul_(ctx.logit_scale)
                if need_bias:
                    grad_bias += rest.sum(dim=0)
                    grad_bias.index_add_(0, targets, label_coef.squeeze(1))
                # the two matmuls run in the inputs' dtype, as the plain path's backward would
                rest = rest.to(hidden.dtype)
                if need_hidden:
                    label_part = weight[targets].to(lse.dtype).mul_(label_coef)
                    grad_hidden[rows] = (rest @ weight).to(lse.dtype).add_(label_part)
                if need_weight:
                    if grad_weight.dtype == rest.dtype:
                        grad_weight.addmm_(rest.T, tile)  # in place: no (V, H) temporary
                    else:
                        grad_weight += rest.T @ tile
                    grad_weight.index_add_(0, targets, tile.to(lse.dtype).mul_(label_coef))
                del logits, rest, slope  # free this tile's scratch before the next is allocated
        return (
            grad_hidden,
            grad_weight.to(weight.dtype) if need_weight else None,
            grad_bias.to(bias.dtype) if need_bias else None,
            None, None, None, None, None,
        )


def head_tile_rows(vocab: int, dtype: torch.dtype = torch.float32) -> int:
    """linear_token_logps' default rows per tile: DEFAULT_CHUNK_SIZE, fewer where a (rows, vocab) tile
    in the compute dtype (fp32 for fp32/bf16/fp16 inputs) would exceed HEAD_TILE_BYTES; at least 1."""
    row_bytes = vocab * torch.empty(0, dtype=_compute_dtype(dtype)).element_size()
    return max(1, min(DEFAULT_CHUNK_SIZE, HEAD_TILE_BYTES // row_bytes))


def linear_token_logps(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None = None,
    *,
    chunk_size: int | None = None,
    with_entropy: bool = False,
    logit_scale: float = 1.0,
    softcap: float | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """log p(label) of each row under the LM head, never holding more than a tile of logits.

    Equals `log_softmax(softcap(logit_scale * (hidden @ weight.T + bias)))[label]` (the plain
    path), computed `chunk_size` rows at a time: the matmul in the inputs' dtype, the rest in fp32.
    Backward recomputes each tile's logits instead of saving them.

    Args:
        hidden: Shape (N, H), the last hidden states at the positions whose next token is scored;
            the caller shifts and selects (`select_scored_positions`: output t predicts token t+1).
        weight: Shape (V, H), the LM head weight (`model.lm_head.weight`; tied embeddings are fine).
            Same dtype as hidden (cast one of them first; autocast is switched off inside).
        labels: Shape (N,), target ids; IGNORE_INDEX rows give 0 and no gradient (but still cost
            a row of compute: select them away instead).
        bias: Shape (V,) or None.
        chunk_size: rows per tile; the fp32 scratch is a few (chunk_size, V) tensors. None:
            head_tile_rows(V), i.e. tiles of at most HEAD_TILE_BYTES (1024 rows up to V = 32768).
        with_entropy: also return the entropy of each row's distribution (detached, for logging).
        logit_scale, softcap: extra steps some LM heads take after the matmul, applied in this
            order: Cohere multiplies by `config.logit_scale`; Gemma-2/3 apply
            `softcap * tanh(logits / softcap)` with `config.final_logit_softcapping`; Granite
            divides by `config.logits_scaling` (pass its inverse). The model's own forward does
            these in the model dtype, we do them in fp32. A model whose head does anything else
            (check its forward between lm_head and the return) must use per_token_logps on its
            full logits, or pass hidden already transformed.

    Returns:
        logps Shape (N,), fp32 (fp64 for fp64 inputs), differentiable w.r.t. hidden, weight and
        bias; with `with_entropy`, the pair (logps, entropy), entropy Shape (N,) and detached.
    """
    if chunk_size is None:
        chunk_size = head_tile_rows(weight.shape[0], weight.dtype)
    _check_linear_inputs(hidden, weight, labels, bias, chunk_size, softcap)
    logps, entropy = _LinearLabelLogProbs.apply(
        hidden, weight, bias, labels, chunk_size, float(logit_scale), softcap, with_entropy
    )
    return (logps, entropy) if with_entropy else logps


def _check_linear_inputs(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None, chunk_size: int,
                         softcap: float | None) -> None:
    """linear_token_logps' shapes, dtypes and settings, each refused with what was given."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            "hidden must be (N, H) and weight (V, H) with the same H; got hidden "
            f"{tuple(hidden.shape)} and weight {tuple(weight.shape)}"
        )
    if labels.shape != hidden.shape[:1]:
        raise ValueError(
            f"labels must be (N,) for hidden (N, H); got labels {tuple(labels.shape)} and hidden "
            f"{tuple(hidden.shape)}"
        )
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(
            f"bias must be (V,) for weight (V, H); got bias {tuple(bias.shape)} and weight "
            f"{tuple(weight.shape)}"
        )
    dtypes = {hidden.dtype, weight.dtype} | ({bias.dtype} if bias is not None else set())
    if len(dtypes) > 1:
        raise TypeError(
            f"hidden, weight and bias must share a dtype; got hidden {hidden.dtype}, weight "
            f"{weight.dtype}" + (f", bias {bias.dtype}" if bias is not None else "")
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap must be > 0 or None; got {softcap}")


# ---------------------------------------------------------------------------------------------
# 3. Losses
#
# Shared notation: a = policy_chosen_logps - reference_chosen_logps and
# b = policy_rejected_logps - reference_rejected_logps are the log-ratios log pi/pi_ref of the
# chosen and rejected responses, h = a - b is the DPO margin, each Shape (batch,). Rewards are
# the implicit rewards beta * a, beta * b unless a docstring says otherwise, always detached.
# ---------------------------------------------------------------------------------------------

LossReturn = tuple[Tensor, Tensor | None, Tensor | None]


def _lookup(table: dict, name: str, what: str):
    try:
        return table[name]
    except KeyError:
        raise KeyError(f"unknown {what} {name!r}; valid: {sorted(table)}") from None


def _implicit_rewards(beta: float, chosen_logratios: Tensor, rejected_logratios: Tensor):
    return (beta * chosen_logratios).detach(), (beta * rejected_logratios).detach()


def sft_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor | None = None,
    reference_chosen_logps: Tensor | None = None,
    reference_rejected_logps: Tensor | None = None,
) -> LossReturn:
    """Supervised fine-tuning: negative log-likelihood of the chosen response.

    Paper: the SFT stage of Ouyang et al. 2022 (arXiv:2203.02155); the generation term of
    RPO/MPO. Loss = -log pi(y_w | x), Shape (batch,); per-token mean by default (departure 1).
    Intuition: imitate the preferred response, ignore the rejected one. No hyperparameters.
    Returns no rewards (None, None).
    """
    return -policy_chosen_logps, None, None


# f-divergence transforms beta * g(log u) of the log-ratio log u = log pi/pi_ref, with g = f' up to an
# additive constant chosen so that g(0) = 0 (departure 3). Wang et al. 2023, arXiv:2309.16240.
# beta is applied inside each transform so that exp(log beta - log u) replaces beta * exp(-log u): in fp32
# exp overflows at 88.7, and the gradient of an overflowed exp is NaN (see _exp_capped).
def _exp_capped(x: Tensor) -> Tensor:
    """exp(x) for the f-divergence transforms, never inf: x is capped one e below where exp overflows
    its dtype (88.7 in fp32), the headroom being for the difference of two such terms that follows.
    Below the cap this is exactly exp; past it the value stays at finfo.max / e and the gradient with
    respect to x is 0 (as TRL's cap_exp), instead of an inf loss and a NaN gradient for the whole step."""
    cap = math.log(torch.finfo(x.dtype).max) - 1.0
    return torch.exp(x.clamp(max=cap))


def _reverse_kl(log_ratio: Tensor, beta: float, f_alpha: float) -> Tensor:
    return beta * log_ratio  # f(u) = u log u, f'(u) = log u + 1: plain DPO


def _forward_kl(log_ratio: Tensor, beta: float, f_alpha: float) -> Tensor:
    # f(u) = -log u, f'(u) = -1/u; beta (1 - exp(-log u)) in the stable form beta - exp(log beta - log u)
    return beta - _exp_capped(math.log(beta) - log_ratio)


def _js_divergence(log_ratio: Tensor, beta: float, f_alpha: float) -> Tensor:
    # f(u) = u log u - (u + 1) log((u + 1) / 2), f'(u) = log(2u / (1 + u)) = log 2 + log sigmoid(log u)
    return beta * (F.logsigmoid(log_ratio) + math.log(2.0))


def _alpha_divergence(log_ratio: Tensor, beta: float, f_alpha: float) -> Tensor:
    # f(u) = (u^(1-a) - (1-a) u - a) / (a (a-1)), f'(u) = (1 - u^-a) / a with a = f_alpha in (0, 1]:
    # a -> 0 gives reverse KL, a = 1 forward KL (Wang et al.'s alpha). TRL 1.x writes the same term as
    # f'(u) = (u^(c-1) - 1) / (c - 1) with c = f_alpha_divergence_coef, c = 1 being reverse KL: our
    # f_alpha = 1 - c. (TRL's first f-DPO code, 2024, used our a directly; tests/test_losses.py checks
    # both.) Stable form as _forward_kl.
    return beta / f_alpha - _exp_capped(math.log(beta / f_alpha) - f_alpha * log_ratio)


F_DIVERGENCES: dict[str, Callable[[Tensor, float, float], Tensor]] = {
    "reverse_kl": _reverse_kl,
    "forward_kl": _forward_kl,
    "js_divergence": _js_divergence,
    "alpha_divergence": _alpha_divergence,
}


def dpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    reference_chosen_logps: Tensor,
    reference_rejected_logps: Tensor,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    f_divergence: str = "reverse_kl",
    f_alpha: float = 0.5,
) -> LossReturn:
    """Direct Preference Optimization (Rafailov et al. 2023, arXiv:2305.18290), Eq. 7, with the
    original code's label smoothing (conservative DPO) and f-DPO's divergences.

    z = beta * (g(a) - g(b)); loss = -(1 - eps) log sigma(z) - eps log sigma(-z), eps =
    label_smoothing in [0, 0.5), Shape (batch,) from four Shape (batch,) inputs. eps = 0 is Eq. 7;
    eps > 0 is cDPO exactly as the original DPO code computes it (`loss=dpo loss.label_smoothing=0.3`
    means what it meant there; `loss=cdpo` is the same loss). g = f' is the derivative of the
    f-divergence that constrains the policy (Wang et al. 2023, "Beyond Reverse KL", arXiv:2309.16240):
    reverse_kl (g(a) = a, plain DPO, the default), forward_kl, js_divergence, alpha_divergence (with
    f_alpha in (0, 1]; see _alpha_divergence for how it maps to TRL's coefficient).
    Intuition: raise the chosen log-ratio above the rejected one; beta sets how far from the
    reference the policy may move. Typical beta 0.1-0.5 (we ignore the reference as beta -> 0).
    Rewards: beta * g(a), beta * g(b).
    """
    transform = _lookup(F_DIVERGENCES, f_divergence, "f_divergence")
    chosen = transform(policy_chosen_logps - reference_chosen_logps, beta, f_alpha)  # beta * g(a)
    rejected = transform(policy_rejected_logps - reference_rejected_logps, beta, f_alpha)
    logits = chosen - rejected
    # Eq. 7 of the DPO paper; with eps > 0 the labels are assumed flipped with probability eps (cDPO)
    losses = -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    return losses, chosen.detach(), rejected.detach()


def cdpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    reference_chosen_logps: Tensor,
    reference_rejected_logps: Tensor,
    *,
    beta: float,
    label_smoothing: float,
) -> LossReturn:
    """Conservative DPO (Mitchell 2023, "A note on DPO with noisy preferences & relationship to
    IPO", https://ericmitchell.ai/cdpo.pdf; no arXiv id).

    loss = -(1 - eps) log sigma(beta h) - eps log sigma(-beta h), eps = label_smoothing, Shape (batch,).
    Intuition: DPO against labels that are flipped with probability eps, so the optimum margin is
    finite (beta h* = log((1 - eps) / eps)) instead of infinite. eps = 0 is DPO. The same function as
    `loss=dpo loss.label_smoothing=eps` (dpo_loss), kept as its own name for the preset config/loss/cdpo.yaml.
    Typical beta 0.1-0.5, eps 0.05-0.3 (an assumed label-noise rate, < 0.5).
    """
    return dpo_loss(
        policy_chosen_logps,
        policy_rejected_logps,
        reference_chosen_logps,
        reference_rejected_logps,
        beta=beta,
        label_smoothing=label_smoothing,
    )


def robust_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    reference_chosen_logps: Tensor,
    reference_rejected_logps: Tensor,
    *,
    beta: float,
    label_smoothing: float,
) -> LossReturn:
    """Robust DPO, rDPO (Chowdhury, Kini & Natarajan 2024, "Provably Robust DPO", arXiv:2403.00409),
    their de-biased rDPO loss.

    loss = [(1 - eps) l(beta h) - eps l(-beta h)] / (1 - 2 eps), l(z) = -log sigma(z),
    eps = label_smoothing in [0, 0.5), Shape (batch,).
    Intuition: an unbiased estimate of the clean-label DPO loss when each label is flipped with
    known probability eps (unlike cDPO, whose optimum moves with eps). eps = 0 is DPO.
    Typical beta 0.1, eps = the (estimated) flip rate of the data, e.g. 0.1-0.4.
    """
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"robust needs 0 <= label_smoothing < 0.5, got {label_smoothing}")
    chosen = policy_chosen_logps - reference_chosen_logps
    rejected = policy_rejected_logps - reference_rejected_logps
    margin = beta * (chosen - rejected)
    losses = (
        -(1 - label_smoothing) * F.logsigmoid(margin) + label_smoothing * F.logsigmoid(-margin)
    ) / (1 - 2 * label_smoothing)
    return losses, *_implicit_rewards(beta, chosen, rejected)


def ipo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    reference_chosen_logps: Tensor,
    reference_rejected_logps: Tensor,
    *,
    beta: float,
) -> LossReturn:
    """Identity Preference Optimization (Azar et al. 2023, "A General Theoretical Paradigm to
    Understand Learning from Human Preferences", arXiv:2310.12036), Eq. 17, with tau = beta.

    loss = (h - 1 / (2 beta))^2, Shape (batch,).
    Intuition: regress the margin to a finite target 1/(2 beta) instead of pushing it to
    infinity, so the policy cannot drift arbitrarily far from the reference on deterministic
    preferences. Default log-probs: per-token average (registry `average_log_prob=True`), as the
    IPO authors recommend for LLMs; set `average_log_prob: false` for the summed variant the
    paper's equation writes. Typical beta (tau) 0.01-1.0; a smaller beta means a larger target margin.
    """
    chosen = policy_chosen_logps - reference_chosen_logps
    rejected = policy_rejected_logps - reference_rejected_logps
    losses = (chosen - rejected - 1 / (2 * beta)) ** 2  # Eq. 17 of the IPO paper
    return losses, *_implicit_rewards(beta, chosen, rejected)


def hinge_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    reference_chosen_logps: Tensor,
    reference_rejected_logps: Tensor,
    *,
    beta: float,
) -> LossReturn:
    """Hinge loss on the normalized likelihood margin: SLiC (Zhao et al. 2023, arXiv:2305.10425,
    the calibration loss) in the reference-normalized "hinge-norm" form of RSO (Liu et al. 2023,
    arXiv:2309.06657).

    loss = max(0, 1 - beta h), Shape (batch,).
    Intuition: a margin classifier; pairs already separated by 1/beta contribute no gradient.
    Typical beta 0.1-0.5 (1/beta is the required margin in log-ratio units).
    """
    chosen = policy_chosen_logps - reference_chosen_logps
    rejected = policy_rejected_logps - reference_rejected_logps
    losses = torch.relu(1 - beta * (chosen - rejected))
    return losses, *_implicit_rewards(beta, chosen, rejected)


def simpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    reference_chosen_logps: Tensor | None = None,
    reference_rejected_logps: Tensor | None = None,
    *,
    beta: float,
    gamma: float,
) -> LossReturn:
    """Simple Preference Optimization (Meng, Xia & Chen 2024, arXiv:2405.14734), Eq. 6.

    loss = -log sigma(beta * (logp_w / |y_w| - logp_l / |y_l|) - gamma), Shape (batch,); the inputs
    are per-token mean log-probs (registry `average_log_prob=True`); no reference model.
    Intuition: the reward is the length-normalized likelihood the model generates with, and the
    chosen reward must beat the rejected one by a margin gamma. Typical beta 2.0-2.5,
    gamma 0.3-1.6 (departure 4: gamma is the margin itself, not gamma/beta).
    Rewards: beta * logp_w / |y_w|, beta * logp_l / |y_l|.
    """
    chosen_rewards = beta * policy_chosen_logps
    rejected_rewards = beta * policy_rejected_logps
    losses = -F.logsigmoid(chosen_rewards - rejected_rewards - gamma)  # Eq. 6 of the SimPO paper
    return losses, chosen_rewards.detach(), rejected_rewards.detach()


def _log_odds(logps: Tensor) -> Tensor:
    """log(p / (1 - p)) from log p. The clamp keeps p < 1, where the odds are infinite."""
    logps = logps.clamp(max=-1e-6)
    return logps - torch.log(-torch.expm1(logps))


def orpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    reference_chosen_logps: Tensor | None = None,
    reference_rejected_logps: Tensor | None = None,
    *,
    orpo_lambda: float,
    chosen_nll: Tensor,
) -> LossReturn:
    """Odds Ratio Preference Optimization (Hong, Lee & Thorne 2024, arXiv:2403.07691), Eqs. 6-7.

    loss = chosen_nll - lambda * log sigma(log odds(y_w) - log odds(y_l)), odds(y) = p / (1 - p)
    with p = exp(per-token mean log-prob) (registry `average_log_prob=True`); no reference model.
    Shapes: all (batch,). Intuition: SFT on the chosen response plus a penalty that pushes the
    odds of generating the chosen response above those of the rejected one, in one stage.
    Typical lambda 0.1-1.0. Rewards: log odds(y_w), log odds(y_l) (their difference is the log
    odds ratio the paper plots).
    """
    chosen = _log_odds(policy_chosen_logps)
    rejected = _log_odds(policy_rejected_logps)
    odds_ratio_loss = -F.logsigmoid(chosen - rejected)  # Eq. 7 of the ORPO paper
    losses = chosen_nll + orpo_lambda * odds_ratio_loss  # Eq. 6
    return losses, chosen.detach(), rejected.detach()


def rpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    reference_chosen_logps: Tensor,
    reference_rejected_logps: Tensor,
    *,
    beta: float,
    rpo_alpha: float,
    chosen_nll: Tensor,
) -> LossReturn:
    """DPO plus the NLL of the chosen response: the loss of Iterative Reasoning Preference
    Optimization (Pang et al. 2024, arXiv:2404.19733), also derived as "RPO" by Liu et al.
    2024 (arXiv:2405.16436).

    loss = dpo_loss + alpha * chosen_nll, chosen_nll = per-token mean NLL of y_w, Shape (batch,).
    Intuition: DPO alone can lower the likelihood of the chosen response too; the NLL term keeps it
    up. Typical beta 0.1, alpha 1.0. Same as `names=[dpo, sft], weights=[1, alpha]`.
    """
    losses, chosen_rewards, rejected_rewards = dpo_loss(
        policy_chosen_logps,
        policy_rejected_logps,
        reference_chosen_logps,
        reference_rejected_logps,
        beta=beta,
    )
    return losses + rpo_alpha * chosen_nll, chosen_rewards, rejected_rewards


def exo_pair_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    reference_chosen_logps: Tensor,
    reference_rejected_logps: Tensor,
    *,
    beta: float,
    label_smoothing: float,
) -> LossReturn:
    """Efficient Exact Optimization, pairwise (Ji et al. 2024, arXiv:2402.00856), Eq. 16 with K = 2.

    loss = KL(p_theta || p_label) over the pair: p_theta = (sigma(beta h), sigma(-beta h)),
    p_label = (1 - eps, eps), eps = label_smoothing in (0, 1):
    loss = sigma(beta h) (log sigma(beta h) - log(1 - eps)) + sigma(-beta h) (log sigma(-beta h) - log eps),
    Shape (batch,). Intuition: the reverse KL (mode-seeking) counterpart of DPO's forward-KL
    classification; it minimises at a finite margin log((1 - eps) / eps) / beta.
    Typical beta 0.1, eps 1e-3 (eps = 0 makes the loss infinite; departure 5).
    """
    if not 0.0 < label_smoothing < 1.0:
        raise ValueError(
            f"exo_pair needs 0 < label_smoothing < 1 (EXO uses 1e-3), got {label_smoothing}"
        )
    chosen = policy_chosen_logps - reference_chosen_logps
    rejected = policy_rejected_logps - reference_rejected_logps
    margin = beta * (chosen - rejected)
    losses = torch.sigmoid(margin) * (F.logsigmoid(margin) - math.log1p(-label_smoothing)) + torch.sigmoid(
        -margin
    ) * (F.logsigmoid(-margin) - math.log(label_smoothing))  # Eq. 16 of the EXO paper
    return losses, *_implicit_rewards(beta, chosen, rejected)


def nca_pair_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    reference_chosen_logps: Tensor,
    reference_rejected_logps: Tensor,
    *,
    beta: float,
) -> LossReturn:
    """Noise Contrastive Alignment, pairwise (Chen et al. 2024, "Noise Contrastive Alignment of
    Language Models with Explicit Rewards", arXiv:2402.05369), the NCA loss with K = 2 responses.

    loss = -log sigma(r_w) - 1/2 log sigma(-r_w) - 1/2 log sigma(-r_l), r = beta * log-ratio,
    Shape (batch,). Intuition: classify each response's absolute reward rather than only their
    difference, so unlike DPO the chosen likelihood is not pushed down along with the rejected.
    Typical beta 0.01-0.1.
    """
    chosen_rewards = beta * (policy_chosen_logps - reference_chosen_logps)
    rejected_rewards = beta * (policy_rejected_logps - reference_rejected_logps)
    losses = (
        -F.logsigmoid(chosen_rewards)
        - 0.5 * F.logsigmoid(-chosen_rewards)
        - 0.5 * F.logsigmoid(-rejected_rewards)
    )
    return losses, chosen_rewards.detach(), rejected_rewards.detach()


def bco_pair_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    reference_chosen_logps: Tensor,
    reference_rejected_logps: Tensor,
    *,
    beta: float,
) -> LossReturn:
    """Binary Classifier Optimization on pairs (Jung et al. 2024, "Binary Classifier Optimization
    for Large Language Model Alignment", arXiv:2404.04656), the BCO loss with reward shift delta.

    loss = -log sigma(r_w - delta) - log sigma(-(r_l - delta)), r = beta * log-ratio, Shape (batch,).
    delta = detached mean of all 2 * batch rewards in this batch (departure 2: the paper keeps a
    running mean across steps). Intuition: a binary classifier that labels chosen responses 1
    and rejected 0, with delta centring the logits. Typical beta 0.1.
    delta is a batch statistic (registry `batch_statistics=True`): the batch must be the whole step,
    so config.py refuses this loss with gradient accumulation, token-budget micro-batches or more
    than one rank (each would compute its own delta).
    """
    chosen_rewards = beta * (policy_chosen_logps - reference_chosen_logps)
    rejected_rewards = beta * (policy_rejected_logps - reference_rejected_logps)
    delta = torch.cat([chosen_rewards, rejected_rewards]).mean().detach()
    losses = -F.logsigmoid(chosen_rewards - delta) - F.logsigmoid(-(rejected_rewards - delta))
    return losses, chosen_rewards.detach(), rejected_rewards.detach()


def sppo_hard_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    reference_chosen_logps: Tensor,
    reference_rejected_logps: Tensor,
    *,
    beta: float,
) -> LossReturn:
    """Self-Play Preference Optimization with hard labels (Wu et al. 2024, arXiv:2405.00675), the
    square loss of their Algorithm 1 with P(y_w wins) = 1, P(y_l wins) = 0, eta = 1/beta.

    loss = (a - 1/(2 beta))^2 + (b + 1/(2 beta))^2, Shape (batch,).
    Intuition: regress each log-ratio to its own target (winner up by eta/2, loser down by eta/2)
    instead of only their difference, as IPO does for the margin. Typical beta 0.001-0.1
    (the reference is the previous self-play iterate).
    """
    chosen = policy_chosen_logps - reference_chosen_logps
    rejected = policy_rejected_logps - reference_rejected_logps
    losses = (chosen - 0.5 / beta) ** 2 + (rejected + 0.5 / beta) ** 2
    return losses, *_implicit_rewards(beta, chosen, rejected)


def apo_zero_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    reference_chosen_logps: Tensor,
    reference_rejected_logps: Tensor,
    *,
    beta: float,
) -> LossReturn:
    """Anchored Preference Optimization, APO-zero (D'Oosterlinck et al. 2024, arXiv:2408.06266), Eq. 7.

    loss = (1 - sigma(beta a)) + sigma(beta b), Shape (batch,).
    Intuition: anchored to the reference: raise the chosen likelihood and lower the rejected one,
    for data whose chosen answers beat the model's own. Typical beta 0.1-0.2.
    """
    chosen = policy_chosen_logps - reference_chosen_logps
    rejected = policy_rejected_logps - reference_rejected_logps
    losses = (1 - torch.sigmoid(beta * chosen)) + torch.sigmoid(beta * rejected)  # Eq. 7
    return losses, *_implicit_rewards(beta, chosen, rejected)


def apo_down_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    reference_chosen_logps: Tensor,
    reference_rejected_logps: Tensor,
    *,
    beta: float,
) -> LossReturn:
    """Anchored Preference Optimization, APO-down (D'Oosterlinck et al. 2024, arXiv:2408.06266), Eq. 8.

    loss = sigma(beta a) + (1 - sigma(beta (a - b))), Shape (batch,).
    Intuition: lower both likelihoods, the rejected more, for data whose chosen answers are
    worse than the model's own. Typical beta 0.1-0.2.
    """
    chosen = policy_chosen_logps - reference_chosen_logps
    rejected = policy_rejected_logps - reference_rejected_logps
    losses = torch.sigmoid(beta * chosen) + (1 - torch.sigmoid(beta * (chosen - rejected)))  # Eq. 8
    return losses, *_implicit_rewards(beta, chosen, rejected)


def discopop_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    reference_chosen_logps: Tensor,
    reference_rejected_logps: Tensor,
    *,
    beta: float,
    discopop_tau: float,
) -> LossReturn:
    """DiscoPOP, the log-ratio modulated loss (Chris Lu et al. 2024, "Discovering Preference
    Optimization Algorithms with and for Large Language Models", arXiv:2406.08414), Eq. 5.

    z = beta h, rho = sigma(z / tau); loss = (1 - rho) * (-log sigma(z)) + rho * exp(-z), Shape (batch,).
    Intuition: logistic (DPO) loss for negative margins, exponential loss for positive ones,
    blended by a sigmoid of the margin; found by LLM-driven search. Typical beta 0.05, tau 0.05.
    """
    chosen = policy_chosen_logps - reference_chosen_logps
    rejected = policy_rejected_logps - reference_rejected_logps
    z = beta * (chosen - rejected)
    # rho * exp(-z) computed as exp(log rho - z): rho underflows to 0 exactly where exp(-z)
    # overflows, and 0 * inf would be NaN.
    exp_part = torch.exp(F.logsigmoid(z / discopop_tau) - z)
    losses = (1 - torch.sigmoid(z / discopop_tau)) * -F.logsigmoid(z) + exp_part  # Eq. 5
    return losses, *_implicit_rewards(beta, chosen, rejected)


def aot_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    reference_chosen_logps: Tensor,
    reference_rejected_logps: Tensor,
    *,
    beta: float,
) -> LossReturn:
    """Alignment via Optimal Transport, paired (Melnyk et al. 2024, "Distributional Preference
    Alignment of LLMs via Optimal Transport", arXiv:2406.05882).

    u = sort(policy_chosen - policy_rejected), v = sort(reference_chosen - reference_rejected) over
    the batch; loss = -log sigma(beta (u - v)) elementwise, Shape (batch,), indexed by quantile, not
    by example. Intuition: first-order stochastic dominance of the policy's margin distribution over
    the reference's, whose 1-D optimal transport plan is the sorted matching. At batch size 1
    it is DPO. Typical beta 0.01-0.1; larger batches give a better quantile estimate.
    Rewards: the per-example beta * a, beta * b.
    The sort is over the batch (registry `batch_statistics=True`): the batch must be the whole step,
    so config.py refuses this loss with gradient accumulation, token-budget micro-batches or more
    than one rank (each would sort only its own share).
    """
    policy_margins, _ = torch.sort(policy_chosen_logps - policy_rejected_logps)
    reference_margins, _ = torch.sort(reference_chosen_logps - reference_rejected_logps)
    losses = -F.logsigmoid(beta * (policy_margins - reference_margins))
    return losses, *_implicit_rewards(
        beta,
        policy_chosen_logps - reference_chosen_logps,
        policy_rejected_logps - reference_rejected_logps,
    )


def kto_loss(
    policy_logps: Tensor,
    reference_logps: Tensor,
    desirable: Tensor,
    kl: Tensor,
    *,
    beta: float,
    desirable_weight: float,
    undesirable_weight: float,
) -> tuple[Tensor, Tensor]:
    """Kahneman-Tversky Optimization (Ethayarajh et al. 2024, arXiv:2402.01306), Eq. 8, on UNPAIRED
    data: each completion is only labelled desirable or undesirable. Its own signature (registry
    `unpaired=True`): there is no chosen/rejected pair to pass.

    r = policy_logps - reference_logps (log pi/pi_ref of each completion), z0 = max(0, kl) (the
    reference point: an estimate of KL(pi || pi_ref), detached);
    loss = lambda_D (1 - sigma(beta (r - z0))) for a desirable completion,
           lambda_U (1 - sigma(beta (z0 - r))) for an undesirable one.
    Intuition: a prospect-theory value of each completion's reward relative to what the policy
    gains on average (z0): push desirable rewards above it, undesirable ones below, no pairs
    needed. Typical beta 0.1; set the weights so that lambda_D n_D / (lambda_U n_U) is in [1, 4/3]
    (the paper's advice for imbalanced data). At policy = reference (r = 0, z0 = 0) every loss is
    lambda / 2.

    Args:
        policy_logps, reference_logps: Shape (n,), sequence log-probs of the completions.
        desirable: Shape (n,), bool: the completion's label.
        kl: Shape () or (1,): the mean policy-minus-reference log-ratio of MISMATCHED
            (prompt, completion) pairs (the trainer's estimate over the whole step, see
            BasicTrainer.kl_reference_point); clamped at 0 and detached here.

    Returns:
        (losses Shape (n,), rewards beta * r Shape (n,), detached).
    """
    z0 = kl.detach().clamp(min=0).reshape(())
    logratios = policy_logps - reference_logps
    desirable_losses = desirable_weight * (1 - torch.sigmoid(beta * (logratios - z0)))  # Eq. 8, y desirable
    undesirable_losses = undesirable_weight * (1 - torch.sigmoid(beta * (z0 - logratios)))  # Eq. 8, y undesirable
    losses = torch.where(desirable.bool(), desirable_losses, undesirable_losses)
    return losses, (beta * logratios).detach()


@dataclass(frozen=True)
class LossSpec:
    """A registered loss: its function, whether it compares against a reference model, its default
    sequence log-prob (False: sum over tokens, True: per-token mean), and whether it uses statistics
    of the whole batch (a sort, a mean), so that its value depends on how the step is split.

    The hyperparameters a loss reads are the keyword-only parameters of its function, each named as
    its `loss.<key>` in the config (chosen_nll excepted: compute_loss supplies it). That signature is
    the one declaration: compute_loss passes exactly those keys, and config.py reads the same
    signatures to refuse a key that no selected loss reads.
    """

    fn: Callable[..., LossReturn]
    needs_reference: bool
    average_log_prob: bool
    batch_statistics: bool = False
    # unpaired: the loss scores single labelled completions (KTO): fn(policy_logps, reference_logps,
    # desirable, kl, *, hyperparameters) -> (losses, rewards); the data are {prompt, completion, label}.
    unpaired: bool = False


# The one registry. compute_loss, the configs and the tests all read it.
LOSSES: dict[str, LossSpec] = {
    "sft": LossSpec(sft_loss, needs_reference=False, average_log_prob=True),
    "dpo": LossSpec(dpo_loss, needs_reference=True, average_log_prob=False),
    "cdpo": LossSpec(cdpo_loss, needs_reference=True, average_log_prob=False),
    "robust": LossSpec(robust_loss, needs_reference=True, average_log_prob=False),
    "ipo": LossSpec(ipo_loss, needs_reference=True, average_log_prob=True),
    "hinge": LossSpec(hinge_loss, needs_reference=True, average_log_prob=False),
    "simpo": LossSpec(simpo_loss, needs_reference=False, average_log_prob=True),
    "orpo": LossSpec(orpo_loss, needs_reference=False, average_log_prob=True),
    "rpo": LossSpec(rpo_loss, needs_reference=True, average_log_prob=False),
    "exo_pair": LossSpec(exo_pair_loss, needs_reference=True, average_log_prob=False),
    "nca_pair": LossSpec(nca_pair_loss, needs_reference=True, average_log_prob=False),
    "bco_pair": LossSpec(bco_pair_loss, needs_reference=True, average_log_prob=False, batch_statistics=True),
    "sppo_hard": LossSpec(sppo_hard_loss, needs_reference=True, average_log_prob=False),
    "apo_zero": LossSpec(apo_zero_loss, needs_reference=True, average_log_prob=False),
    "apo_down": LossSpec(apo_down_loss, needs_reference=True, average_log_prob=False),
    "discopop": LossSpec(discopop_loss, needs_reference=True, average_log_prob=False),
    "aot": LossSpec(aot_loss, needs_reference=True, average_log_prob=False, batch_statistics=True),
    "kto": LossSpec(kto_loss, needs_reference=True, average_log_prob=False, unpaired=True),
}


# ---------------------------------------------------------------------------------------------
# 4. The dispatcher
# ---------------------------------------------------------------------------------------------


class LossOutput(NamedTuple):
    losses: Tensor  # Shape (batch,): weighted sum over the named losses; differentiable
    chosen_rewards: Tensor | None  # Shape (batch,), detached; from the first loss with rewards
    rejected_rewards: Tensor | None
    metrics: dict[str, Tensor]  # per-example detached tensors; the trainer averages/gathers


def _as_names(names: str | list[str]) -> list[str]:
    return [names] if isinstance(names, str) else list(names)


def _spec(name: str) -> LossSpec:
    return _lookup(LOSSES, name, "loss name")


def is_sft_only(names: str | list[str]) -> bool:
    """True when the only loss is SFT: no rejected responses and no reference model are needed."""
    return set(_as_names(names)) == {"sft"}


def is_unpaired(names: str | list[str]) -> bool:
    """True when the losses score single labelled completions (KTO) rather than pairs."""
    return any(_spec(name).unpaired for name in _as_names(names))


def needs_reference(names: str | list[str], reference_free: bool) -> bool:
    """Whether the trainer must run a reference model for these losses."""
    return not reference_free and any(_spec(name).needs_reference for name in _as_names(names))


# Keyword-only parameters that compute_loss supplies from the batch, not from the config.
SUPPLIED = ("chosen_nll",)


@functools.cache
def _hyperparameters(fn: Callable) -> tuple[tuple[str, bool], ...]:
    """(name, required) of each keyword-only parameter of `fn`; inspected once per function."""
    return tuple(
        (p.name, p.default is inspect.Parameter.empty)
        for p in inspect.signature(fn).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    )


def _kwargs_for(name: str, fn: Callable, hparams, chosen_nll: Tensor) -> dict:
    """The hyperparameters `fn` declares, taken from hparams (None counts as unset)."""
    kwargs = {}
    for param, required in _hyperparameters(fn):
        value = chosen_nll if param == "chosen_nll" else hparams.get(param)
        if value is not None:
            kwargs[param] = value
        elif required:
            raise TypeError(f"loss {name!r} needs hyperparameter {param!r} (config key loss.{param})")
    return kwargs


def compute_loss(
    names: str | list[str],
    weights: list[float] | None,
    hparams,
    policy_chosen_sum: Tensor,
    policy_chosen_len: Tensor,
    policy_rejected_sum: Tensor | None = None,
    policy_rejected_len: Tensor | None = None,
    reference_chosen_sum: Tensor | None = None,
    reference_rejected_sum: Tensor | None = None,
    desirable: Tensor | None = None,
    kl: Tensor | None = None,
) -> LossOutput:
    """Weighted sum of the named losses, with the batch metrics. The only thing the trainer calls.

    Args:
        names: registered loss names, e.g. ["dpo"] or ["dpo", "sft"] (a single str is accepted).
        weights: one per name; None means all 1.0.
        hparams: mapping with .get (dict or the Config's loss section): the LossConfig keys
            the named losses read, reference_free (bool) and average_log_prob (None = each
            loss's own default).
        policy_*_sum, reference_*_sum: summed token log-probs per sequence, Shape (batch,).
        policy_*_len: scored tokens per sequence, Shape (batch,); the reference scores the same
            tokens, so its sums are normalized by the policy's lengths.
        desirable, kl: for an unpaired loss (KTO) only, see `_unpaired_loss`.

    Returns:
        LossOutput(losses, chosen_rewards, rejected_rewards, metrics); see LossOutput.
    """
    names, specs, weights = _selected(names, weights)
    if any(spec.unpaired for spec in specs):
        return _unpaired_loss(names, specs, weights, hparams, policy_chosen_sum, policy_chosen_len,
                              policy_rejected_sum, policy_rejected_len, reference_chosen_sum,
                              reference_rejected_sum, desirable, kl)
    paired = not is_sft_only(names)
    if paired and (policy_rejected_sum is None or policy_rejected_len is None):
        raise ValueError(f"losses {names} compare chosen with rejected; rejected log-probs are missing")
    reference_chosen_sum, reference_rejected_sum = _reference_sums(
        names, hparams, paired, policy_chosen_sum, policy_rejected_sum, reference_chosen_sum, reference_rejected_sum)
    chosen_nll = -sequence_logps(policy_chosen_sum, policy_chosen_len, average_log_prob=True)

    def normalize(logps_sum: Tensor | None, lengths: Tensor | None, average: bool) -> Tensor | None:
        return None if logps_sum is None else sequence_logps(logps_sum, lengths, average)

    total: Tensor | int = 0
    chosen_rewards = rejected_rewards = None
    for name, spec, weight in zip(names, specs, weights):
        average = average_log_prob(spec, hparams)
        losses, chosen, rejected = spec.fn(
            normalize(policy_chosen_sum, policy_chosen_len, average),
            normalize(policy_rejected_sum, policy_rejected_len, average),
            normalize(reference_chosen_sum, policy_chosen_len, average),
            normalize(reference_rejected_sum, policy_rejected_len, average),
            **_kwargs_for(name, spec.fn, hparams, chosen_nll),
        )
        total = total + weight * losses
        if chosen_rewards is None and chosen is not None:
            chosen_rewards, rejected_rewards = chosen, rejected

    metrics = _batch_metrics(total, chosen_nll, policy_chosen_sum, policy_rejected_sum if paired else None,
                             chosen_rewards, rejected_rewards)
    return LossOutput(total, chosen_rewards, rejected_rewards, metrics)


def _selected(names: str | list[str], weights: list[float] | None) -> tuple[list[str], list[LossSpec], list[float]]:
    """The names as a list, their registry entries, and one weight each (None: all 1.0)."""
    names = _as_names(names)
    weights = [1.0] * len(names) if weights is None else list(weights)
    if len(weights) != len(names):
        raise ValueError(f"got {len(weights)} weights for {len(names)} losses {names}")
    return names, [_spec(name) for name in names], weights


def average_log_prob(spec: LossSpec, hparams) -> bool:
    """Whether a loss sees per-token mean log-probs: loss.average_log_prob, or the loss's own default when null."""
    average = hparams.get("average_log_prob")
    return spec.average_log_prob if average is None else bool(average)


def _reference_sums(names: list[str], hparams, paired: bool, policy_chosen_sum: Tensor, policy_rejected_sum: Tensor | None,
                    reference_chosen_sum: Tensor | None, reference_rejected_sum: Tensor | None):
    """The reference sums the losses compare against: as given, or zeros with reference_free (the reference model
    is replaced by one that gives every sequence log p = 0). Raises when a loss needs them and they are missing."""
    reference_free = bool(hparams.get("reference_free") or False)
    if needs_reference(names, reference_free) and (
        reference_chosen_sum is None or reference_rejected_sum is None
    ):
        raise ValueError(
            f"losses {names} need reference log-probs (or set loss.reference_free=true)"
        )
    if reference_free:
        return torch.zeros_like(policy_chosen_sum), None if not paired else torch.zeros_like(policy_rejected_sum)
    return reference_chosen_sum, reference_rejected_sum


def _batch_metrics(total: Tensor, chosen_nll: Tensor, policy_chosen_sum: Tensor, policy_rejected_sum: Tensor | None,
                   chosen_rewards: Tensor | None, rejected_rewards: Tensor | None) -> dict[str, Tensor]:
    """Per-example detached metrics: log-probs, the chosen NLL, the loss, and the rewards of a paired loss
    (`policy_rejected_sum` None: not paired)."""
    metrics = {
        "logps/chosen": policy_chosen_sum.detach(),
        "nll/chosen": chosen_nll.detach(),
        "loss": total.detach(),
    }
    paired = policy_rejected_sum is not None
    if paired:
        metrics["logps/rejected"] = policy_rejected_sum.detach()
    if paired and chosen_rewards is not None:
        metrics["rewards/chosen"] = chosen_rewards
        metrics["rewards/rejected"] = rejected_rewards
        metrics["rewards/accuracies"] = (chosen_rewards > rejected_rewards).float()
        metrics["rewards/margins"] = chosen_rewards - rejected_rewards
    return metrics


def _unpaired_loss(names, specs, weights, hparams, policy_chosen_sum, policy_chosen_len, policy_rejected_sum,
                   policy_rejected_len, reference_chosen_sum, reference_rejected_sum, desirable, kl) -> LossOutput:
    """compute_loss for a loss on labelled completions (KTO).

    Unpaired batch: policy_chosen_* are the completions (n,), `desirable` (n,) bool their labels, the rejected
    arguments None. Paired batch (pairs evaluated with an unpaired loss): chosen and rejected (n,) each become
    completions, chosen desirable and rejected undesirable, and the pair metrics (accuracies, margins) are
    logged as for DPO. `kl`: Shape () or (1,), the trainer's KL estimate of the step (see kto_loss).

    Metrics per completion: rewards/chosen and logps/chosen on desirable completions, rewards/rejected and
    logps/rejected on undesirable ones, NaN on the others (the trainer's averages skip NaN); kl once per batch.
    """
    if len(names) != 1:
        raise ValueError(f"loss {names}: an unpaired loss (kto) cannot be combined with other losses")
    name, spec, weight = names[0], specs[0], weights[0]
    n = policy_chosen_sum.shape[0]
    paired = policy_rejected_sum is not None
    if paired:
        policy_sum = torch.cat([policy_chosen_sum, policy_rejected_sum])
        lengths = torch.cat([policy_chosen_len, policy_rejected_len])
        reference_sum = None if reference_chosen_sum is None else torch.cat([reference_chosen_sum, reference_rejected_sum])
        desirable = torch.arange(2 * n, device=policy_sum.device) < n
    else:
        if desirable is None:
            raise ValueError(f"loss {name!r} scores labelled completions: `desirable` (n,) is missing")
        policy_sum, lengths, reference_sum = policy_chosen_sum, policy_chosen_len, reference_chosen_sum
    if kl is None:
        raise ValueError(f"loss {name!r} needs the KL reference point `kl` (the trainer estimates it)")
    if bool(hparams.get("reference_free") or False):
        reference_sum = torch.zeros_like(policy_sum)
    elif reference_sum is None:
        raise ValueError(f"loss {name!r} needs reference log-probs (or set loss.reference_free=true)")
    average = average_log_prob(spec, hparams)
    kwargs = _kwargs_for(name, spec.fn, hparams, None)
    losses, rewards = spec.fn(sequence_logps(policy_sum, lengths, average),
                              sequence_logps(reference_sum, lengths, average), desirable, kl, **kwargs)
    total = weight * losses
    desirable = desirable.bool()
    nan = torch.full_like(rewards, float("nan"))
    logps = policy_sum.detach()
    metrics = {
        "loss": total.detach(),
        "rewards/chosen": torch.where(desirable, rewards, nan),
        "rewards/rejected": torch.where(desirable, nan, rewards),
        "logps/chosen": torch.where(desirable, logps, nan),
        "logps/rejected": torch.where(desirable, nan, logps),
        "kl": kl.detach().clamp(min=0).reshape(1).float().expand(len(total)),  # z0 as the loss uses it, per row
    }
    if paired:
        metrics["rewards/accuracies"] = (rewards[:n] > rewards[n:]).float()
        metrics["rewards/margins"] = rewards[:n] - rewards[n:]
    return LossOutput(total, rewards, None, metrics)
