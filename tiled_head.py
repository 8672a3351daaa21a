"""tiled_lm_head: the backbone, then only the scored (response) positions through the LM head, in tiles of at most
HEAD_TILE_BYTES with their own backward: never the (tokens, vocab) logits the plain path holds. The log-probs are the
model's own (logps.label_logps); the head's logit scaling or soft cap is redone by model type (HEAD_POSTPROCESSING),
and a head it does not know is refused. Every run with it checks, before its first step, that its log-probs and
entropies equal log_softmax of the model's own logits (`Head.probe`). Imported only when tiled_lm_head=true.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

import self_check
from config import ConfigError
from logps import IGNORE_INDEX, Rows, entropy, head_tile_rows, label_logps, log_sum_sq
from sharding import unwrap

# The self-check holds the model's own logits at the scored positions it compares, what the tiled head exists to avoid:
# each row's first scored tokens, at most this many bytes of fp32 logits in all (1 GiB: 261 of each of 4 pairs' 8 rows
# at Llama-3's vocabulary of 128256).
HEAD_LOGITS_BYTES = 2**30


def check(cfg, config) -> None:
    """From config.json alone (`config`; train.check_inputs, before any model loads): a head the tiled path does not
    reproduce is refused (postprocessing; the first tiled forward refuses it too)."""
    try:
        postprocessing(config)
    except ValueError as e:
        raise ConfigError([f"model.name_or_path={cfg.model.name_or_path!r}: {e}"]) from None


class Head:
    """The tiled head as forward_logps' `head` seam (logps.label_logps is the plain one)."""

    def __call__(self, model, call, rows: Rows, sum_sq: bool = False):
        """Each scored target's log-prob (the scored positions in row order, then `rows.extra`'s), their entropies
        (detached), with `sum_sq` log sum_v p_v^2, and the (R, T) mask of scored positions: the backbone's hidden
        states at the scored positions through the LM head, by the kernel. Under FSDP this runs inside the root unit's
        forward (sharding.forward), which has gathered the embeddings, the final norm and the head."""
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
        scale, softcap = postprocessing(lm.config)
        hidden = backbone(**rows.kwargs, use_cache=False).last_hidden_state  # training needs no KV cache
        weight, bias = head.weight, head.bias
        if torch.is_autocast_enabled(hidden.device.type):  # the tiles' matmuls in its dtype, as the model's own head
            dtype = torch.get_autocast_dtype(hidden.device.type)  # (the casts' backward: grads in the params' dtype)
            weight, bias = weight.to(dtype), None if bias is None else bias.to(dtype)
        # under device_map the LM head may sit on another GPU than the backbone's output
        hidden = hidden.to(device=weight.device, dtype=weight.dtype)
        targets = rows.targets.to(hidden.device)
        scored = targets != IGNORE_INDEX
        picked, labels = hidden[scored], targets[scored]
        if rows.extra is not None:  # prefix sharing: the rejected's first tokens, from the prompts' last positions
            position, label = (x.to(hidden.device) for x in rows.extra[:2])
            picked, labels = torch.cat([picked, hidden.flatten(0, 1)[position]]), torch.cat([labels, label])
        chunk = head_tile_rows(weight.shape[0], weight.dtype)
        logps, token_entropy, token_sq = _LabelLogProbs.apply(
            picked, weight, bias, labels, chunk, scale, softcap, True, sum_sq
        )
        return logps, token_entropy, token_sq if sum_sq else None, scored

    def probe(self, t, pairs: dict, inputs: dict, ours, dtype) -> list[dict]:
        """The self-check's `head`: this head's log-probs and entropies vs log_softmax of the model's own logits, on
        each row's first scored tokens (HEAD_LOGITS_BYTES), prompts of any length: every compared token is scored."""
        config = unwrap(t.policy).config
        vocab = (getattr(config, "text_config", None) or config).vocab_size
        labels = inputs["labels"]
        keep = max(1, HEAD_LOGITS_BYTES // (len(labels) * vocab * 4))
        first = dict(inputs, labels=labels.masked_fill((labels != IGNORE_INDEX).cumsum(1) > keep, IGNORE_INDEX))
        tiled, own = self_check.policy_logps(t, first, head=self), self_check.policy_logps(t, first, head=own_logps)
        what = "the tiled LM head vs log_softmax of the model's own forward().logits"
        tolerance = self_check.HEAD_TOLERANCE
        return [self_check.compare(t, "head", what, tiled, own, dtype, "tiled_lm_head=false", tolerance, mean=True)]


def own_logps(model, call, rows: Rows, sum_sq: bool = False):
    """logps.label_logps of the model's own forward (its scaling or capping after the LM head included), whose LM head
    is fed the scored positions' hidden states alone: (1, scored, vocab) logits, never (rows, positions, vocab)."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft
    scored = rows.targets != IGNORE_INDEX
    only_scored = lambda module, args: (args[0][scored.to(args[0].device)][None], *args[1:])
    hook = lm.get_output_embeddings().register_forward_pre_hook(only_scored)
    try:
        *out, _ = label_logps(model, call, rows._replace(targets=rows.targets[scored][None]), sum_sq)
    finally:
        hook.remove()
    return *out, scored


def postprocessing(config) -> tuple[float, Optional[float]]:
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


def _chunks(n: int, size: int) -> list[slice]:
    return [slice(start, start + size) for start in range(0, n, size)]


def _tile_logits(hidden, weight, bias, logit_scale: float, softcap, dtype: torch.dtype) -> Tensor:
    """One tile's logits (n, V) in `dtype`: the LM head (weight (V, H), bias (V,) or None) on hidden (n, H), the
    matmul in the inputs' dtype (bf16 on tensor cores, as the model's own head), then scale and softcap (None: none)
    after the upcast."""
    logits = F.linear(hidden, weight, bias).to(dtype)
    if logit_scale != 1.0:
        logits.mul_(logit_scale)  # Cohere: logits * logit_scale (Granite: 1 / logits_scaling)
    if softcap is not None:
        logits.div_(softcap).tanh_().mul_(softcap)  # Gemma-2/3: cap * tanh(logits / cap)
    return logits


class _LabelLogProbs(torch.autograd.Function):
    """log softmax(logits)[label] per row of hidden states, a tile of rows at a time (logits: _tile_logits). Forward
    keeps only the per-row logsumexp (N,); backward recomputes each tile's logits (one extra matmul) and turns
    d out / d logits straight into the inputs' gradients. The only (rows, V) memory is a few fp32 tiles."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk_size, logit_scale, softcap, with_entropy, with_sum_sq=False):
        dtype = torch.promote_types(hidden.dtype, torch.float32)  # fp64 stays
        mask = labels != IGNORE_INDEX
        safe = labels.masked_fill(~mask, 0).long()  # any valid index: masked out below
        out = torch.empty(hidden.shape[0], dtype=dtype, device=hidden.device)
        lse = torch.empty_like(out)
        entropies = torch.empty_like(out) if with_entropy else out.new_empty(0)
        sums_sq = torch.empty_like(out) if with_sum_sq else out.new_empty(0)
        # autocast off: the forward and the backward's recomputation must see identical logits
        with torch.autocast(hidden.device.type, enabled=False):
            for rows in _chunks(hidden.shape[0], chunk_size):
                logits = _tile_logits(hidden[rows], weight, bias, logit_scale, softcap, dtype)
                if with_entropy:
                    entropies[rows] = entropy(logits)
                if with_sum_sq:
                    sums_sq[rows] = log_sum_sq(logits)
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
        ctx.mark_non_differentiable(entropies, sums_sq)
        return out.masked_fill_(~mask, 0.0), entropies, sums_sq

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
