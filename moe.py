"""A mixture of experts (a model whose config has num_experts_per_tok): its routers recorded in every policy forward,
per sequence (logged as router_aux_loss), and with loss.router_aux_loss Switch's load-balancing loss added to the loss;
MFU counts the parameters a token runs through. Imported only for a model with experts (BasicTrainer.__init__) and by
train.check_inputs when loss.router_aux_loss is set.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch import Tensor

from config import ConfigError
from utils import rank0_print


def check(cfg, config) -> None:
    """loss.router_aux_loss balances the routers of a mixture of experts: refused, from config.json alone (`config`),
    for a model without experts, and `model` for one whose config has no router_aux_loss_coef."""
    value = cfg.loss.router_aux_loss
    if expert_share(config) == 1:
        raise ConfigError(
            [
                f"loss.router_aux_loss={value}: model type {config.model_type!r} (model.name_or_path="
                f"{cfg.model.name_or_path!r}) has no experts (num_experts_per_tok), so no router to balance; set "
                "loss.router_aux_loss=null"
            ]
        )
    if value == "model" and getattr(config, "router_aux_loss_coef", None) is None:
        raise ConfigError(
            [
                f"loss.router_aux_loss=model: the config of model type {config.model_type!r} has no "
                "router_aux_loss_coef; set a number"
            ]
        )


def expert_share(config) -> float:
    """The fraction of a mixture of experts' expert parameters a token runs through (top_k / experts); 1 if dense."""
    k = getattr(config, "num_experts_per_tok", None)
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    return k / experts if k and experts else 1.0


def active_parameters(model: nn.Module, n: int) -> int:
    """MFU's N of a mixture of experts: `n` (the parameters outside the input embedding) with each `experts` module's
    counted at top_k / num_experts (expert_share), as a token runs through top_k experts (its memory holds them all)."""
    experts = [p for name, m in model.named_modules() if name.rpartition(".")[2] == "experts" for p in m.parameters()]
    share = expert_share(model.config)
    active = n - round((1 - share) * sum(p.numel() for p in experts))
    rank0_print(
        f"mixture of experts: MFU counts the {active / 1e6:.2f}M active parameters (each expert's x {share:g}: top-k "
        "of the experts run per token); memory holds all of them"
    )
    return active


class Router:
    """forward_logps' `router` seam: records the routers' logits during the policy's forward and sums them per
    sequence; `add_loss` logs router_aux_loss and adds loss.router_aux_loss (a number; null: 0, logged only; model:
    the model config's router_aux_loss_coef, which train.check_inputs checked exists) times it to the loss."""

    def __init__(self, config, setting, shared_prefix: bool):
        self.config = config
        self.coef = float(self.config.router_aux_loss_coef if setting == "model" else setting or 0.0)
        self.shared_prefix = shared_prefix

    def recording(self, model: nn.Module):
        return _router_logits(model)

    def per_sequence(self, logits: list[Tensor], rows, n: int, total) -> Tensor:
        """(n, 2, E) routing per sequence (_routing), differentiable when the loss weighs it."""
        owner, column = rows.tokens
        return _routing(logits, owner, column, n, self.shared_prefix, self.config, self.coef > 0, total)

    def add_loss(self, loss: Tensor, routing: Tensor, n: int, paired: bool, metrics: dict) -> Tensor:
        """The loss with coef x the mean load-balancing loss, per example (a pair: its two sequences' mean), weighted
        like the loss; metrics["router_aux_loss"] logged."""
        aux = load_balancing_loss(routing)
        aux = (aux[:n] + aux[n:]) / 2 if paired else aux
        metrics["router_aux_loss"] = aux.detach()
        return loss + self.coef * aux.mean() if self.coef else loss


def load_balancing_loss(routing: Tensor) -> Tensor:
    """Switch Transformer's auxiliary load-balancing loss (Fedus et al. 2021, arXiv:2101.03961, Eq. 4-6) of each
    sequence over its own real tokens and routed layers: E sum_e f_e P_e, with f_e the top-k picks of expert e per
    (token, layer) and P_e its mean router probability; top_k when routing is uniform. For one sequence alone it is
    transformers' load_balancing_loss_func. Per sequence, the mean over a step's sequences is the same however they
    are grouped into micro-batches, packed rows and ranks (a micro-batch's f and P are not). routing: (N, 2, E), each
    sequence's picks and summed probabilities (logps.SequenceLogps.routing). Returns Shape (N,)."""
    picks, probs = routing.unbind(1)
    slots = probs.detach().sum(-1).round().clamp(min=1)  # (token, layer) pairs: each one's probabilities sum to 1
    return probs.size(-1) * (picks * probs).sum(-1) / slots**2


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


def _routing(logits: list[Tensor], owner: Tensor, column: Tensor, n: int, shared_prefix: bool, config, grad, total):
    """(n, 2, E): per sequence, how often each expert is among a token's top_k and its summed router probability,
    over the sequence's real tokens (owner (R, T): its index, -1 on padding) and every routed layer (logits: one
    (R * T, E) per layer), as load_balancing_loss_func counts them (softmax over all experts, top-k of it). Shared
    rows (chosen, then the rejected of the same pairs) hold a pair's prompt once: it counts for both sequences.
    Differentiable with `grad`; under Ulysses each rank routed a slice of the tokens: `total` sums its group's."""
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
        return total(out)
