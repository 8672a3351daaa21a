"""Sequence log-probs from a causal LM, the plain way: the model's own logits, log_softmax, the label's entry.

    log pi(y | x) = sum_t log softmax(logits_t)[y_t]   over the response's tokens (output t predicts token t+1)

`forward_logps` is the one path every trainer calls: chosen over rejected in one batch (`concatenated_inputs`), one
right-padded row per sequence (`padded_rows`), and per sequence the summed log-probs of its labelled tokens, their
count and their mean entropy. Three seams, each None on the default path, change how a number is computed, never what
it is (each is checked against this path, by the tests and by every run's self-check):
  layout  lays the sequences out otherwise than one padded row each: packing.Layout (packed rows, a pair's prompt
          shared, Ulysses' slices of every row)
  head    scores the labels otherwise than from the model's full logits: tiled_head.Head (the backbone, then the LM
          head in tiles on the scored positions), entropy_bonus.Head (a differentiable entropy)
  router  records a mixture of experts' routing per sequence: moe.Router
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100  # label of positions that are not scored (prompt, padding)
PADS = {"input_ids": 0, "attention_mask": 0, "labels": IGNORE_INDEX}
# Rows per tile of (rows, vocab) work (the tiled head, the plain head's logged statistics): at most 1024 (enough to
# keep a GPU busy), fewer where a tile's fp32 logits pass HEAD_TILE_BYTES: a tile's scratch is its only (rows, vocab)
# memory, so a fixed row count would grow with the vocabulary. 128 MiB is 1024 rows up to vocab 32768, 261 rows at
# Llama-3's 128256.
MAX_TILE_ROWS = 1024
HEAD_TILE_BYTES = 128 * 2**20


class SequenceLogps(NamedTuple):
    """forward_logps' result, one row per sequence of its inputs."""

    sums: Tensor  # (N,) summed log-probs of the labelled tokens
    counts: Tensor  # (N,) how many
    entropy: Optional[Tensor] = None  # (N,) their mean entropy (detached unless an entropy bonus asks)
    tokens: Optional[Tensor] = None  # (N, T) each labelled token's log-prob at its column, else 0, with `per_token`
    log_sum_sq: Optional[Tensor] = None  # (N,) summed log sum_v p_v^2 over them, detached, with `sum_sq` (WPO)
    routing: Optional[Tensor] = None  # (N, 2, E) a mixture of experts' picks and router probabilities (moe.Router)


class Rows(NamedTuple):
    """Sequences laid out in rows for one forward, targets aligned: position t holds the label output t predicts."""

    kwargs: dict  # the model's inputs: input_ids (R, T), and what a layout adds (positions, masks)
    targets: Tensor  # (R, T) the label position t predicts (its row's token t+1), IGNORE_INDEX where none
    owner: Tensor  # (R, T) the sequence that target belongs to, -1 where none
    column: Tensor  # (R, T) that target's column in its sequence's own row
    tokens: tuple  # (owner, column) of each input token, unshifted: what a router sees at position t
    extra: Optional[tuple] = None  # targets the rows cannot hold: (flat position, label, sequence, column)


# ---------- Inputs ----------
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


def pad_to_length(tensor: Tensor, length: int, pad_value: int) -> Tensor:  # right-pads the last dimension
    return F.pad(tensor, (0, max(0, length - tensor.size(-1))), value=pad_value)


def padded_inputs(inputs: dict[str, Tensor], multiple: int = 1) -> tuple[dict, Tensor, Tensor]:
    """Model kwargs, labels (R, T) and the sequence each token belongs to (R, T; -1 on padding): one row per
    sequence, right-padded, T rounded up to a multiple of `multiple` (the sequence-parallel size). No attention
    mask: causal attention never lets a token see the padding after it, and padding is never scored, so the model's
    own causal mask gives the same log-probs, and sdpa its causal kernel (a padding mask is a (R, 1, T, T) bias)."""
    t = -(-inputs["input_ids"].size(1) // multiple) * multiple
    ids, mask, labels = (pad_to_length(inputs[k], t, p) for k, p in PADS.items())
    owner = torch.where(mask.bool(), torch.arange(ids.size(0), device=ids.device)[:, None], -1)
    return {"input_ids": ids}, labels, owner


def aligned(kwargs: dict, labels: Tensor, owner: Tensor, column: Tensor, extra=None) -> Rows:
    """Rows whose targets, owners and columns are moved one position left: output t predicts token t+1, so position
    t then holds its own target, and a row can be cut into slices (Ulysses) without losing one."""
    targets, at_owner, at_column = (
        F.pad(x[:, 1:], (0, 1), value=v) for x, v in ((labels, IGNORE_INDEX), (owner, -1), (column, 0))
    )
    return Rows(kwargs, targets, at_owner, at_column, (owner, column), extra)


def padded_rows(model, inputs: dict[str, Tensor]) -> Rows:
    """The default layout: one right-padded row per sequence, each token at its own column."""
    kwargs, labels, owner = padded_inputs(inputs)
    return aligned(kwargs, labels, owner, torch.arange(labels.size(1), device=labels.device).expand_as(labels))


# ---------- Log-probs of labels ----------
def head_tile_rows(vocab: int, dtype: torch.dtype = torch.float32) -> int:
    """Rows per tile: MAX_TILE_ROWS, fewer where a tile of `dtype` (at least fp32) passes HEAD_TILE_BYTES."""
    return max(1, min(MAX_TILE_ROWS, HEAD_TILE_BYTES // (vocab * torch.promote_types(dtype, torch.float32).itemsize)))


def entropy(logits: Tensor) -> Tensor:
    """H(softmax(x)) in fp32 (fp64 stays), (rows, V) -> (rows,), as log s - sum exp(z) z / s with z = x - max(x),
    s = sum exp(z): both terms >= 0, nothing cancels (the textbook logsumexp(x) - sum softmax(x) x loses 3e-5 in fp32
    at V=50257)."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    shifted = x - x.amax(dim=-1, keepdim=True)
    exp = shifted.exp()
    total = exp.sum(dim=-1)
    return total.log() - (exp * shifted).sum(dim=-1) / total


def log_sum_sq(logits: Tensor) -> Tensor:
    """log sum_v p_v^2 of softmax(logits) in fp32, (rows, V) -> (rows,): logsumexp(2 x) - 2 logsumexp(x). WPO's
    alignment term: the log-prob a token would have if sampled from the policy itself, on average."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.logsumexp(2 * x, dim=-1) - 2 * torch.logsumexp(x, dim=-1)


def scored_logits(call, rows: Rows) -> tuple[Tensor, Tensor, Tensor]:
    """The model's logits at the scored positions (N, V) in row order, then at `rows.extra`'s; their labels (N,); the
    (R, T) mask of scored positions. The full (R, T, V) logits go as soon as the scored rows are taken."""
    logits = call(**rows.kwargs, use_cache=False).logits  # use_cache=False: training needs no KV cache
    if logits.shape[:-1] != rows.targets.shape:
        raise ValueError(f"the model's logits are {tuple(logits.shape)} for targets {tuple(rows.targets.shape)}")
    targets = rows.targets.to(logits.device)  # under device_map the head may sit on another GPU
    scored = targets != IGNORE_INDEX
    picked, labels = logits[scored], targets[scored]
    if rows.extra is not None:  # prefix sharing: the rejected's first tokens, from the prompts' last positions
        position, label = (x.to(logits.device) for x in rows.extra[:2])
        picked, labels = torch.cat([picked, logits.flatten(0, 1)[position]]), torch.cat([labels, label])
    return picked, labels, scored


def label_logps(model, call, rows: Rows, sum_sq: bool = False) -> tuple[Tensor, Tensor, Optional[Tensor], Tensor]:
    """The plain head: each scored target's log-prob, log_softmax of the logits in fp32 and the label's entry; the
    entropy of each scored position (detached: logged) and, with `sum_sq`, log sum_v p_v^2 (WPO); the scored mask."""
    logits, labels, scored = scored_logits(call, rows)
    with torch.no_grad():  # by tiles: whole, their three (N, V) fp32 temporaries set the step's peak
        tiles = logits.split(head_tile_rows(logits.shape[-1]))
        token_entropy = torch.cat([entropy(t) for t in tiles])
        token_sq = torch.cat([log_sum_sq(t) for t in tiles]) if sum_sq else None
    logps = logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(-1)
    return logps.gather(-1, labels[:, None])[:, 0], token_entropy, token_sq, scored


# ---------- Sequence log-probs ----------
def sequence_logps(logps_sum: Tensor, lengths: Tensor, average_log_prob: bool) -> Tensor:
    """A sequence's log-prob, Shape (batch,): the sum over its tokens (the original DPO), or the per-token mean
    (lengths clamped to >= 1, so an empty response gives 0, not NaN)."""
    return logps_sum / lengths.clamp(min=1).to(logps_sum.dtype) if average_log_prob else logps_sum


def forward_logps(
    model, inputs: dict[str, Tensor], call=None, *, layout=None, head=None, router=None, per_token=False, sum_sq=False
) -> SequenceLogps:
    """Per sequence of `inputs` ({input_ids, attention_mask, labels}, (N, T)): the summed log-probs of its labelled
    tokens (N,), their count (N,), their mean entropy (N,), and where asked each token's log-prob (`per_token`: (N, T),
    differentiable; LD-DPO), the summed log sum_v p_v^2 (`sum_sq`; WPO) and the routing (`router`). `call(**kwargs)`
    runs the model's full forward: the model itself, or under FSDP its class forward inside the root unit's forward
    (sharding.forward). The seams `layout`, `head`, `router`: see the module docstring."""
    n, width = inputs["input_ids"].shape
    rows = (layout or padded_rows)(model, inputs)
    with router.recording(model) if router else contextlib.nullcontext() as routed:
        logps, token_entropy, token_sq, scored = (head or label_logps)(model, call or model, rows, sum_sq)
    owner, column = rows.owner.to(scored.device)[scored], rows.column.to(scored.device)[scored]
    if rows.extra is not None:
        owner, column = (
            torch.cat([owner, rows.extra[2].to(owner.device)]),
            torch.cat([column, rows.extra[3].to(owner.device)]),
        )
    total = layout.total if layout else lambda x: x  # Ulysses: each rank scored a slice, the group sums them

    def per_sequence(values: Tensor) -> Tensor:
        return total(values.new_zeros(n).index_add(0, owner, values))

    counts = per_sequence(torch.ones_like(owner))
    tokens = total(logps.new_zeros(n, width).index_put((owner, column), logps)) if per_token else None
    return SequenceLogps(
        per_sequence(logps),
        counts,
        per_sequence(token_entropy) / counts.clamp(min=1),
        tokens,
        per_sequence(token_sq) if sum_sq else None,
        router.per_sequence(routed, rows, n, total) if router else None,
    )
