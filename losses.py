"""The math of preference optimization: one pure function per loss, one registry (`LOSSES`), one dispatcher.

Each loss has the original DPO signature `(policy_chosen_logps, policy_rejected_logps, reference_chosen_logps,
reference_rejected_logps, *, <hyperparameters named as their config keys>) -> (losses, chosen_rewards,
rejected_rewards)`, each Shape (batch,). `compute_loss`, the trainer's loss step, takes the log-probs as logps.py
hands them over (SequenceLogps; per token or WPO's statistic where `logps_needed` asks), applies the modifiers
(LD-DPO, WPO, DPOP, beta-DPO), gives each loss the sums or per-token means it wants, and returns the weighted sum
with the batch metrics.

To add a loss: README, "Adding a loss". A loss's keyword-only parameters are the config keys it reads: config.py
refuses a changed key that no selected loss reads (`loss=ipo loss.label_smoothing=0.1`), so none is silently ignored.

Departures from the papers and from the original DPO code, numbered:
  1. `sft` defaults to the per-token mean NLL of the chosen response (the original summed): its scale does not
     depend on length and equals the NLL term of RPO/ORPO, so RPO is `names=[dpo, sft]` (config/loss/rpo.yaml).
  2. `bco_pair` shifts by the detached mean reward of the batch, not the paper's running mean: no state across steps.
  3. f-DPO's transforms drop f'(u)'s additive constants (they cancel in the loss): reward 0 when policy = reference.
  4. `simpo`'s `gamma` is the margin itself; the SimPO code base exposes gamma / beta.
  5. `exo_pair` raises on label_smoothing == 0 (its loss is infinite there) instead of replacing it with 1e-3.
  6. `chosen_nll` is each sequence's own per-token mean, averaged over the batch by the trainer.
  7. f-DPO's exp(-alpha log u) terms are computed as exp(log beta - alpha log u), capped one e below overflow
     (`_exp_capped`, as TRL's cap_exp): exact as far as the dtype holds it, flat (zero gradient) beyond.
  8. `aot` and `bco_pair` use whole-batch statistics (`batch_statistics=True`): config.py refuses them, rather than
     approximate them, when a step is split (accumulation, token budget, several ranks).
  9. `kto`'s KL reference point is estimated by the trainer over the mismatched rows of the whole step, not per
     micro-batch as HALOs does, so the loss does not depend on the split; clamped at 0 and detached, as in the paper.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from logps import SequenceLogps, sequence_logps  # the hand-off: what forward_logps returns, its unscored label


# --- The losses ---
# Notation: a = policy_chosen_logps - reference_chosen_logps and b = policy_rejected_logps - reference_rejected_logps
# are the log-ratios log pi/pi_ref, h = a - b the DPO margin, each Shape (batch,). Rewards are the implicit rewards
# beta * a, beta * b unless a docstring says otherwise, always detached.
LossReturn = tuple[Tensor, Tensor | None, Tensor | None]


def sft_loss(
    policy_chosen_logps, policy_rejected_logps=None, reference_chosen_logps=None, reference_rejected_logps=None
) -> LossReturn:
    """Supervised fine-tuning: the SFT stage of Ouyang et al. 2022 (arXiv:2203.02155), the generation term of RPO/MPO.
    Loss = -log pi(y_w | x), Shape (batch,); per-token mean by default (departure 1). No rewards (None, None).
    Intuition: imitate the preferred response, ignore the rejected one. No hyperparameters."""
    return -policy_chosen_logps, None, None


def _exp_capped(x: Tensor) -> Tensor:
    """exp(x), capped one e below the dtype's overflow (headroom for the difference that follows): departure 7."""
    return torch.exp(x.clamp(max=math.log(torch.finfo(x.dtype).max) - 1.0))


# f-DPO (Wang et al. 2023, "Beyond Reverse KL", arXiv:2309.16240): (log u, beta, alpha = f_alpha) -> beta * g(log u),
# g = f' shifted so that g(0) = 0 (departure 3). beta is applied inside, for the form exp(log beta - log u) of
# departure 7: in fp32 exp overflows at 88.7, and the gradient of an overflowed exp is NaN.
F_DIVERGENCES: dict[str, Callable[[Tensor, float, float], Tensor]] = {
    # f(u) = u log u, f'(u) = log u + 1: plain DPO
    "reverse_kl": lambda log_u, beta, alpha: beta * log_u,
    # f(u) = -log u, f'(u) = -1/u: beta (1 - exp(-log u)) in the stable form beta - exp(log beta - log u)
    "forward_kl": lambda log_u, beta, alpha: beta - _exp_capped(math.log(beta) - log_u),
    # f(u) = u log u - (u + 1) log((u + 1) / 2), f'(u) = log(2u / (1 + u)) = log 2 + log sigmoid(log u)
    "js_divergence": lambda log_u, beta, alpha: beta * (F.logsigmoid(log_u) + math.log(2.0)),
    # f'(u) = (1 - u^-alpha) / alpha, alpha in (0, 1] (Wang et al.'s): alpha -> 0 is reverse KL, alpha = 1 forward KL.
    # TRL 1.x writes (u^(c-1) - 1) / (c - 1), c = f_alpha_divergence_coef (c = 1: reverse KL), so f_alpha = 1 - c;
    # TRL's first f-DPO code used our alpha directly (tests/test_losses.py checks both). Stable form as forward_kl.
    "alpha_divergence": lambda log_u, beta, alpha: beta / alpha - _exp_capped(math.log(beta / alpha) - alpha * log_u),
}


def dpo_loss(
    policy_chosen_logps,
    policy_rejected_logps,
    reference_chosen_logps,
    reference_rejected_logps,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    f_divergence: str = "reverse_kl",
    f_alpha: float = 0.5,
) -> LossReturn:
    """Direct Preference Optimization (Rafailov et al. 2023, arXiv:2305.18290), Eq. 7, with the original code's label
    smoothing (cDPO) and f-DPO's divergences g = f' (F_DIVERGENCES; reverse_kl, g(a) = a, is plain DPO).
    z = beta (g(a) - g(b)); loss = -(1 - eps) log sigma(z) - eps log sigma(-z), eps = label_smoothing in [0, 0.5),
    Shape (batch,). Rewards: beta g(a), beta g(b). Intuition: raise the chosen log-ratio above the rejected one; beta
    sets how far from the reference the policy may move. Typical beta 0.1-0.5; f_alpha in (0, 1]."""
    g = F_DIVERGENCES[f_divergence]
    chosen = g(policy_chosen_logps - reference_chosen_logps, beta, f_alpha)  # beta * g(a)
    rejected = g(policy_rejected_logps - reference_rejected_logps, beta, f_alpha)
    logits = chosen - rejected
    # Eq. 7 of the DPO paper; with eps > 0 the labels are assumed flipped with probability eps (cDPO)
    losses = -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    return losses, chosen.detach(), rejected.detach()


def robust_loss(
    policy_chosen_logps,
    policy_rejected_logps,
    reference_chosen_logps,
    reference_rejected_logps,
    *,
    beta: float,
    label_smoothing: float,
) -> LossReturn:
    """Robust DPO (Chowdhury, Kini & Natarajan 2024, "Provably Robust DPO", arXiv:2403.00409), the de-biased loss.
    loss = [(1 - eps) l(beta h) - eps l(-beta h)] / (1 - 2 eps), l(z) = -log sigma(z), eps = label_smoothing in
    [0, 0.5), Shape (batch,). Intuition: an unbiased estimate of the clean-label DPO loss when each label is flipped
    with known probability eps (cDPO's optimum moves with eps). Typical beta 0.1, eps the data's flip rate 0.1-0.4."""
    a, b = policy_chosen_logps - reference_chosen_logps, policy_rejected_logps - reference_rejected_logps
    z = beta * (a - b)
    eps = label_smoothing
    losses = (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)  # the de-biased loss
    return losses, (beta * a).detach(), (beta * b).detach()


def ipo_loss(
    policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps, *, beta: float
) -> LossReturn:
    """Identity Preference Optimization (Azar et al. 2023, arXiv:2310.12036), Eq. 17 with tau = beta.
    loss = (h - 1 / (2 beta))^2, Shape (batch,); per-token mean log-probs by default, as the IPO authors recommend for
    LLMs (`average_log_prob: false` gives the summed form the equation writes).
    Intuition: regress the margin to a finite target instead of pushing it to infinity, so the policy cannot drift
    arbitrarily far on deterministic preferences. Typical beta (tau) 0.01-1.0; smaller beta, larger target margin."""
    a, b = policy_chosen_logps - reference_chosen_logps, policy_rejected_logps - reference_rejected_logps
    losses = (a - b - 1 / (2 * beta)) ** 2  # Eq. 17 of the IPO paper
    return losses, (beta * a).detach(), (beta * b).detach()


def hinge_loss(
    policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps, *, beta: float
) -> LossReturn:
    """Hinge loss: SLiC's calibration loss (Zhao et al. 2023, arXiv:2305.10425) in the reference-normalized
    "hinge-norm" form of RSO (Liu et al. 2023, arXiv:2309.06657). loss = max(0, 1 - beta h), Shape (batch,).
    Intuition: a margin classifier; pairs already separated by 1/beta contribute no gradient.
    Typical beta 0.1-0.5 (1/beta is the required margin in log-ratio units)."""
    a, b = policy_chosen_logps - reference_chosen_logps, policy_rejected_logps - reference_rejected_logps
    losses = torch.relu(1 - beta * (a - b))
    return losses, (beta * a).detach(), (beta * b).detach()


def simpo_loss(
    policy_chosen_logps,
    policy_rejected_logps,
    reference_chosen_logps=None,
    reference_rejected_logps=None,
    *,
    beta: float,
    gamma: float,
) -> LossReturn:
    """Simple Preference Optimization (Meng, Xia & Chen 2024, arXiv:2405.14734), Eq. 6; no reference model.
    loss = -log sigma(beta (logp_w / |y_w| - logp_l / |y_l|) - gamma), Shape (batch,), on per-token mean log-probs.
    Intuition: the reward is the length-normalized likelihood the model generates with, and the chosen one must win
    by a margin gamma. Typical beta 2.0-2.5, gamma 0.3-1.6 (departure 4). Rewards: beta logp / |y|."""
    chosen_rewards, rejected_rewards = beta * policy_chosen_logps, beta * policy_rejected_logps
    losses = -F.logsigmoid(chosen_rewards - rejected_rewards - gamma)  # Eq. 6 of the SimPO paper
    return losses, chosen_rewards.detach(), rejected_rewards.detach()


def _log_odds(logps: Tensor) -> Tensor:
    """log(p / (1 - p)) from log p. The clamp keeps p < 1, where the odds are infinite."""
    logps = logps.clamp(max=-1e-6)
    return logps - torch.log(-torch.expm1(logps))


def orpo_loss(
    policy_chosen_logps,
    policy_rejected_logps,
    reference_chosen_logps=None,
    reference_rejected_logps=None,
    *,
    orpo_lambda: float,
    chosen_nll: Tensor,
) -> LossReturn:
    """Odds Ratio Preference Optimization (Hong, Lee & Thorne 2024, arXiv:2403.07691), Eqs. 6-7; no reference model.
    loss = chosen_nll - lambda log sigma(log odds(y_w) - log odds(y_l)), odds = p / (1 - p), p = exp(per-token mean
    log-prob), Shape (batch,). Intuition: SFT on the chosen response plus a push of its odds above the rejected one's,
    in one stage. Typical lambda 0.1-1.0. Rewards: log odds(y_w), log odds(y_l)."""
    chosen, rejected = _log_odds(policy_chosen_logps), _log_odds(policy_rejected_logps)
    odds_ratio_loss = -F.logsigmoid(chosen - rejected)  # Eq. 7 of the ORPO paper
    return chosen_nll + orpo_lambda * odds_ratio_loss, chosen.detach(), rejected.detach()  # Eq. 6


def exo_pair_loss(
    policy_chosen_logps,
    policy_rejected_logps,
    reference_chosen_logps,
    reference_rejected_logps,
    *,
    beta: float,
    label_smoothing: float,
) -> LossReturn:
    """Efficient Exact Optimization, pairwise (Ji et al. 2024, arXiv:2402.00856), Eq. 16 with K = 2: the KL from
    p_theta = (sigma(z), sigma(-z)), z = beta h, to p_label = (1 - eps, eps), eps = label_smoothing in (0, 1):
    loss = sigma(z) (log sigma(z) - log(1 - eps)) + sigma(-z) (log sigma(-z) - log eps), Shape (batch,).
    Intuition: the mode-seeking (reverse KL) counterpart of DPO, minimal at a finite margin log((1 - eps) / eps) / beta.
    Typical beta 0.1, eps 1e-3 (departure 5)."""
    if not 0.0 < label_smoothing < 1.0:
        raise ValueError(f"exo_pair needs 0 < label_smoothing < 1 (EXO uses 1e-3), got {label_smoothing}")
    a, b = policy_chosen_logps - reference_chosen_logps, policy_rejected_logps - reference_rejected_logps
    z = beta * (a - b)
    chosen = torch.sigmoid(z) * (F.logsigmoid(z) - math.log1p(-label_smoothing))
    losses = chosen + torch.sigmoid(-z) * (F.logsigmoid(-z) - math.log(label_smoothing))  # Eq. 16 of the EXO paper
    return losses, (beta * a).detach(), (beta * b).detach()


def nca_pair_loss(
    policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps, *, beta: float
) -> LossReturn:
    """Noise Contrastive Alignment, pairwise (Chen et al. 2024, arXiv:2402.05369), the NCA loss with K = 2.
    loss = -log sigma(r_w) - 1/2 log sigma(-r_w) - 1/2 log sigma(-r_l), r = beta * log-ratio, Shape (batch,).
    Intuition: classify each response's absolute reward, not only their difference, so unlike DPO the chosen
    likelihood is not pushed down along with the rejected. Typical beta 0.01-0.1."""
    chosen_rewards = beta * (policy_chosen_logps - reference_chosen_logps)
    rejected_rewards = beta * (policy_rejected_logps - reference_rejected_logps)
    losses = -F.logsigmoid(chosen_rewards) - 0.5 * F.logsigmoid(-chosen_rewards) - 0.5 * F.logsigmoid(-rejected_rewards)
    return losses, chosen_rewards.detach(), rejected_rewards.detach()


def bco_pair_loss(
    policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps, *, beta: float
) -> LossReturn:
    """Binary Classifier Optimization on pairs (Jung et al. 2024, arXiv:2404.04656), with reward shift delta.
    loss = -log sigma(r_w - delta) - log sigma(-(r_l - delta)), r = beta * log-ratio, Shape (batch,), delta = the
    detached mean of the batch's 2 * batch rewards (departures 2, 8). Intuition: a binary classifier labelling chosen
    responses 1 and rejected 0, delta centring the logits. Typical beta 0.1."""
    chosen_rewards = beta * (policy_chosen_logps - reference_chosen_logps)
    rejected_rewards = beta * (policy_rejected_logps - reference_rejected_logps)
    delta = torch.cat([chosen_rewards, rejected_rewards]).mean().detach()
    losses = -F.logsigmoid(chosen_rewards - delta) - F.logsigmoid(-(rejected_rewards - delta))
    return losses, chosen_rewards.detach(), rejected_rewards.detach()


def sppo_hard_loss(
    policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps, *, beta: float
) -> LossReturn:
    """Self-Play Preference Optimization, hard labels (Wu et al. 2024, arXiv:2405.00675), Algorithm 1's square loss
    with P(y_w wins) = 1, eta = 1/beta. loss = (a - 1/(2 beta))^2 + (b + 1/(2 beta))^2, Shape (batch,).
    Intuition: regress each log-ratio to its own target, not only their difference as IPO does.
    Typical beta 0.001-0.1 (the reference is the previous self-play iterate)."""
    a, b = policy_chosen_logps - reference_chosen_logps, policy_rejected_logps - reference_rejected_logps
    losses = (a - 0.5 / beta) ** 2 + (b + 0.5 / beta) ** 2
    return losses, (beta * a).detach(), (beta * b).detach()


def apo_zero_loss(
    policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps, *, beta: float
) -> LossReturn:
    """Anchored Preference Optimization, APO-zero (D'Oosterlinck et al. 2024, arXiv:2408.06266), Eq. 7.
    loss = (1 - sigma(beta a)) + sigma(beta b), Shape (batch,). Intuition: raise the chosen likelihood and lower the
    rejected one, for data whose chosen answers beat the model's own. Typical beta 0.1-0.2."""
    a, b = policy_chosen_logps - reference_chosen_logps, policy_rejected_logps - reference_rejected_logps
    losses = (1 - torch.sigmoid(beta * a)) + torch.sigmoid(beta * b)  # Eq. 7
    return losses, (beta * a).detach(), (beta * b).detach()


def apo_down_loss(
    policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps, *, beta: float
) -> LossReturn:
    """Anchored Preference Optimization, APO-down (D'Oosterlinck et al. 2024, arXiv:2408.06266), Eq. 8.
    loss = sigma(beta a) + (1 - sigma(beta (a - b))), Shape (batch,). Intuition: lower both likelihoods, the
    rejected more, for data whose chosen answers are worse than the model's own. Typical beta 0.1-0.2."""
    a, b = policy_chosen_logps - reference_chosen_logps, policy_rejected_logps - reference_rejected_logps
    losses = torch.sigmoid(beta * a) + (1 - torch.sigmoid(beta * (a - b)))  # Eq. 8
    return losses, (beta * a).detach(), (beta * b).detach()


def discopop_loss(
    policy_chosen_logps,
    policy_rejected_logps,
    reference_chosen_logps,
    reference_rejected_logps,
    *,
    beta: float,
    discopop_tau: float,
) -> LossReturn:
    """DiscoPOP, the log-ratio modulated loss (Chris Lu et al. 2024, arXiv:2406.08414), Eq. 5.
    z = beta h, rho = sigma(z / tau); loss = (1 - rho) (-log sigma(z)) + rho exp(-z), Shape (batch,).
    Intuition: logistic (DPO) loss for negative margins, exponential for positive ones, blended by a sigmoid of the
    margin; found by LLM-driven search. Typical beta 0.05, tau 0.05."""
    a, b = policy_chosen_logps - reference_chosen_logps, policy_rejected_logps - reference_rejected_logps
    z = beta * (a - b)
    # rho exp(-z) as exp(log rho - z): rho underflows to 0 exactly where exp(-z) overflows, and 0 * inf is NaN
    rho_exp = torch.exp(F.logsigmoid(z / discopop_tau) - z)
    losses = (1 - torch.sigmoid(z / discopop_tau)) * -F.logsigmoid(z) + rho_exp  # Eq. 5 of the DiscoPOP paper
    return losses, (beta * a).detach(), (beta * b).detach()


def aot_loss(
    policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps, *, beta: float
) -> LossReturn:
    """Alignment via Optimal Transport, paired (Melnyk et al. 2024, arXiv:2406.05882). u = sort(policy_chosen -
    policy_rejected), v = sort(reference_chosen - reference_rejected) over the batch (departure 8);
    loss = -log sigma(beta (u - v)), Shape (batch,), indexed by quantile, not by example; at batch size 1 it is DPO.
    Intuition: first-order stochastic dominance of the policy's margin distribution over the reference's, whose 1-D
    optimal transport plan is the sorted matching. Typical beta 0.01-0.1. Rewards: the per-example beta a, beta b."""
    policy_margins, _ = torch.sort(policy_chosen_logps - policy_rejected_logps)
    reference_margins, _ = torch.sort(reference_chosen_logps - reference_rejected_logps)
    losses = -F.logsigmoid(beta * (policy_margins - reference_margins))
    a, b = policy_chosen_logps - reference_chosen_logps, policy_rejected_logps - reference_rejected_logps
    return losses, (beta * a).detach(), (beta * b).detach()


def kto_loss(
    policy_logps, reference_logps, desirable, kl, *, beta: float, desirable_weight: float, undesirable_weight: float
) -> tuple[Tensor, Tensor]:
    """Kahneman-Tversky Optimization (Ethayarajh et al. 2024, arXiv:2402.01306), Eq. 8, on UNPAIRED completions,
    each labelled desirable or not (`desirable`, bool): hence its own signature (registry `unpaired=True`).
    r = policy_logps - reference_logps, z0 = max(0, kl), detached; kl, Shape () or (1,), is the trainer's mean
    log-ratio of mismatched (prompt, completion) pairs over the whole step (departure 9).
    loss = lambda_D (1 - sigma(beta (r - z0))) if desirable, else lambda_U (1 - sigma(beta (z0 - r))), Shape (n,).
    Intuition: push desirable rewards above what the policy gains on average (z0), undesirable ones below; no pairs
    needed. Typical beta 0.1, lambda_D n_D / (lambda_U n_U) in [1, 4/3]. Rewards beta r; lambda / 2 at policy = ref."""
    z0 = kl.detach().clamp(min=0).reshape(())
    logratios = policy_logps - reference_logps
    desirable_losses = desirable_weight * (1 - torch.sigmoid(beta * (logratios - z0)))  # Eq. 8, y desirable
    undesirable_losses = undesirable_weight * (1 - torch.sigmoid(beta * (z0 - logratios)))  # Eq. 8, y undesirable
    return torch.where(desirable.bool(), desirable_losses, undesirable_losses), (beta * logratios).detach()


@dataclass(frozen=True)
class LossSpec:
    """A registered loss; the keyword-only parameters of `fn` (SUPPLIED excepted) are the `loss.<key>`s it reads."""

    fn: Callable[..., LossReturn]
    needs_reference: bool
    average_log_prob: bool  # default sequence log-prob: the per-token mean (True) or the sum (False)
    batch_statistics: bool = False  # a sort or mean over the batch: depends on how a step is split
    unpaired: bool = False  # scores labelled completions (kto_loss's signature)

    @property
    def reads(self) -> list[str]:
        """The `loss.<key>`s the function reads (config_keys)."""
        return config_keys(self.fn)

    def average(self, hp) -> bool:
        """Whether the loss sees per-token mean log-probs: loss.average_log_prob, or its own default when null."""
        chosen = getattr(hp, "average_log_prob", None)
        return self.average_log_prob if chosen is None else bool(chosen)


# The one registry: compute_loss, config.py and the tests read it.
LOSSES: dict[str, LossSpec] = {
    "sft": LossSpec(sft_loss, needs_reference=False, average_log_prob=True),
    "dpo": LossSpec(dpo_loss, needs_reference=True, average_log_prob=False),
    "robust": LossSpec(robust_loss, needs_reference=True, average_log_prob=False),
    "ipo": LossSpec(ipo_loss, needs_reference=True, average_log_prob=True),
    "hinge": LossSpec(hinge_loss, needs_reference=True, average_log_prob=False),
    "simpo": LossSpec(simpo_loss, needs_reference=False, average_log_prob=True),
    "orpo": LossSpec(orpo_loss, needs_reference=False, average_log_prob=True),
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


# --- The dispatcher ---
class LossOutput(NamedTuple):
    losses: Tensor  # Shape (batch,): weighted sum over the named losses; differentiable
    chosen_rewards: Tensor | None  # Shape (batch,), detached; from the first loss with rewards
    rejected_rewards: Tensor | None
    metrics: dict[str, Tensor]  # per-example detached tensors; the trainer averages/gathers


def _specs(names: str | list[str]) -> tuple[list[str], list[LossSpec]]:
    """The names as a list (a str is one name) and their specs."""
    names = [names] if isinstance(names, str) else list(names)
    for name in names:
        if name not in LOSSES:
            raise KeyError(f"unknown loss name {name!r}; valid: {sorted(LOSSES)}")
    return names, [LOSSES[name] for name in names]


def needs_reference(names: str | list[str], reference_free: bool) -> bool:
    """Whether the trainer must run a reference model for these losses."""
    return not reference_free and any(spec.needs_reference for spec in _specs(names)[1])


SUPPLIED = ("chosen_nll",)  # keyword-only parameters that compute_loss supplies from the batch, not the config


@functools.cache
def _hyperparameters(fn: Callable) -> tuple[tuple[str, bool], ...]:
    """(name, required) per keyword-only parameter of `fn`, inspected once."""
    return tuple(
        (p.name, p.default is inspect.Parameter.empty)
        for p in inspect.signature(fn).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    )


def config_keys(fn: Callable) -> list[str]:
    """The `loss.<key>`s a loss function reads: its keyword-only parameters, SUPPLIED excepted (config.py's registry
    and its refusal of keys no selected loss reads come from here)."""
    return [name for name, _ in _hyperparameters(fn) if name not in SUPPLIED]


def _kwargs_for(name: str, fn: Callable, hp, given: dict) -> dict:
    """The keyword-only parameters `fn` declares: from `given` (SUPPLIED, beta-DPO's beta), else from hp; None
    counts as unset."""
    kwargs = {}
    for param, required in _hyperparameters(fn):
        value = given[param] if given.get(param) is not None else getattr(hp, param, None)
        if value is not None:
            kwargs[param] = value
        elif required:
            raise TypeError(f"loss {name!r} needs hyperparameter {param!r} (config key loss.{param})")
    return kwargs


def compute_loss(
    names: str | list[str],
    weights: list[float] | None,
    hp,
    policy: SequenceLogps,
    reference: SequenceLogps | None = None,
    *,
    paired: bool = True,
    labels: Tensor | None = None,
    desirable: Tensor | None = None,
    kl: Tensor | None = None,
    beta_dpo=None,
    step: int | None = None,
) -> LossOutput:
    """Weighted sum of the named losses (e.g. ["dpo", "sft"]; a str is one name; weights None: all 1.0), with the
    batch metrics (per example, detached).

    hp: the config's loss section (any object; a key left out takes its default). policy, reference: forward_logps'
    results over the batch's rows, chosen then rejected when `paired`, else one row per example; the policy's counts
    normalize both. No reference (reference_free, or None where no loss needs one): log p = 0. desirable, kl: KTO's
    (_unpaired_loss). labels (N, T), beta_dpo and step (None in evaluation): the modifiers' (modifiers.py)."""
    names, specs = _specs(names)
    weights = [1.0] * len(names) if weights is None else list(weights)
    unpaired = any(spec.unpaired for spec in specs)
    sft_only = set(names) == {"sft"}  # sft alone: no rejected
    if not (paired or sft_only or unpaired):
        raise ValueError(f"losses {names} compare chosen with rejected; rejected log-probs are missing")
    if getattr(hp, "reference_free", False):
        reference = None
    elif reference is None and any(spec.needs_reference for spec in specs):
        raise ValueError(f"losses {names} need reference log-probs (or set loss.reference_free=true)")
    sums, counts = policy.sums, policy.counts
    ref = torch.zeros_like(sums) if reference is None else reference.sums.to(sums.device)
    if unpaired:
        return _unpaired_loss(names[0], weights[0], hp, sums, counts, ref, paired, desirable, kl)
    n = len(sums) // 2 if paired else len(sums)
    chosen_nll = -sequence_logps(sums[:n], counts[:n], average_log_prob=True)
    modifiers = None
    if modified(hp):
        import modifiers as applied  # WPO, LD-DPO, DPOP, beta-DPO

        modifiers = applied.Modifiers(hp, policy, reference, labels, beta_dpo, step, specs, n)
    total, chosen_rewards, rejected_rewards = 0, None, None
    for name, spec, weight in zip(names, specs, weights, strict=True):
        policy_logps, reference_logps = (sequence_logps(x, counts, spec.average(hp)) for x in (sums, ref))
        logps = [policy_logps[:n], policy_logps[n:], reference_logps[:n], reference_logps[n:]]
        kwargs = _kwargs_for(name, spec.fn, hp, {"chosen_nll": chosen_nll})
        if modifiers is None:
            losses, chosen, rejected = spec.fn(*logps, **kwargs)
            total = total + weight * losses
        else:
            losses, chosen, rejected = modifiers.loss(spec, logps, kwargs)
            total = total + modifiers.weigh(weight * losses)
        if chosen_rewards is None and chosen is not None:
            chosen_rewards, rejected_rewards = chosen, rejected
    extra = {}
    if modifiers is not None:
        total = modifiers.total(total, extra)
    metrics = {"logps/chosen": sums[:n].detach(), "nll/chosen": chosen_nll.detach(), "loss": total.detach()}
    if not sft_only:
        metrics["logps/rejected"] = sums[n:].detach()
    if chosen_rewards is not None:
        metrics["rewards/chosen"], metrics["rewards/rejected"] = chosen_rewards, rejected_rewards
        metrics["rewards/accuracies"] = (chosen_rewards > rejected_rewards).float()
        metrics["rewards/margins"] = chosen_rewards - rejected_rewards
    return LossOutput(total, chosen_rewards, rejected_rewards, metrics | extra)


def modified(hp) -> bool:
    """Whether a modifier of the paired losses is on: WPO, LD-DPO, DPOP or beta-DPO (modifiers.py)."""
    return bool(
        getattr(hp, "wpo", False)
        or getattr(hp, "ld_alpha", 1.0) != 1
        or getattr(hp, "dpop_lambda", 0.0)
        or getattr(hp, "dynamic_beta", 0.0)
    )


def _unpaired_loss(name, weight, hp, sums, counts, ref, paired, desirable, kl) -> LossOutput:
    """compute_loss for a loss on labelled completions (KTO), checks done.

    Unpaired batch: the rows are completions (n,), `desirable` (n,) bool their labels. Paired batch (eval of pairs):
    chosen (desirable) and rejected (undesirable) are 2n completions, and accuracies and margins compare each pair
    as for DPO. `kl`: the trainer's KL estimate of the step, see kto_loss.
    Metrics per completion: rewards/ and logps/chosen on desirable completions, rewards/ and logps/rejected on
    undesirable ones, NaN on the others (the trainer's averages skip NaN); on every row kl, the raw estimate, and
    kl_clamped, the z0 = max(0, kl) the loss uses."""
    spec = LOSSES[name]
    n = len(sums) // 2
    if paired:
        desirable = torch.arange(2 * n, device=sums.device) < n
    elif desirable is None:
        raise ValueError(f"loss {name!r} scores labelled completions: `desirable` (n,) is missing")
    if kl is None:
        raise ValueError(f"loss {name!r} needs the KL reference point `kl` (the trainer estimates it)")
    average = spec.average(hp)
    desirable = desirable.to(sums.device).bool()
    kl = kl.to(sums.device)
    policy_logps, reference_logps = (sequence_logps(x, counts, average) for x in (sums, ref))
    losses, rewards = spec.fn(policy_logps, reference_logps, desirable, kl, **_kwargs_for(name, spec.fn, hp, {}))
    total = weight * losses
    nan = torch.full_like(rewards, float("nan"))
    logps = sums.detach()
    metrics = {
        "loss": total.detach(),
        "rewards/chosen": torch.where(desirable, rewards, nan),
        "rewards/rejected": torch.where(desirable, nan, rewards),
        "logps/chosen": torch.where(desirable, logps, nan),
        "logps/rejected": torch.where(desirable, nan, logps),
        # raw: a mean log-ratio of mismatched pairs, not a true KL, so often negative, where the clamped value hides it
        "kl": kl.detach().reshape(1).float().expand(len(total)),
        "kl_clamped": kl.detach().clamp(min=0).reshape(1).float().expand(len(total)),  # z0 as the loss uses it
    }
    if paired:
        metrics["rewards/accuracies"] = (rewards[:n] > rewards[n:]).float()
        metrics["rewards/margins"] = rewards[:n] - rewards[n:]
    return LossOutput(total, rewards, None, metrics)
