"""Modifiers of every paired loss, composable, applied by losses.compute_loss around whichever losses are named:
  WPO (loss.wpo)             each pair's losses weighted by the policy's probability of generating it
  LD-DPO (loss.ld_alpha)     tokens past the shorter response down-weighted in the log-ratios
  DPOP (loss.dpop_lambda)    a penalty inside the chosen log-ratio when the chosen log-prob falls below the reference's
  beta-DPO (loss.dynamic_beta, loss.dynamic_beta_filter)  a batch beta from the margins' running mean; a filter
The logged rewards stay without DPOP's penalty and at the configured beta; logps/* stay the sums. Imported only when a
modifier is on (losses.modified).
"""

from __future__ import annotations

import torch
from torch import Tensor

from logps import IGNORE_INDEX, sequence_logps


def rules(c, world: int) -> list[str]:
    """The config's problems with the modifiers (config_loader.validate calls this when one is set)."""
    loss = c.loss
    compares = any(spec.needs_reference for spec in c.loss_specs)  # a selected loss compares with a reference
    keeps = round(c.batch_size * (1 - loss.dynamic_beta_filter))
    problems = [
        f"loss.{key}={loss[key]}: a modifier of paired losses; loss.name={loss.name!r} scores one completion per prompt"
        for key, on in (
            ("wpo", loss.wpo),
            ("ld_alpha", loss.ld_alpha != 1),
            ("dpop_lambda", loss.dpop_lambda > 0),
            ("dynamic_beta", loss.dynamic_beta > 0),
        )
        if on and not c.trains_on_pairs
    ]
    if loss.dynamic_beta > 0 and not any("beta" in spec.reads for spec in c.loss_specs):
        problems.append(
            f"loss.dynamic_beta={loss.dynamic_beta}: beta-DPO scales loss.beta, which no selected loss reads "
            f"(loss.name={loss.name!r})"
        )
    if loss.dynamic_beta_filter > 0 and not loss.dynamic_beta:
        problems.append(
            f"loss.dynamic_beta_filter={loss.dynamic_beta_filter}: read only with loss.dynamic_beta > 0 (beta-DPO)"
        )
    if loss.dynamic_beta_filter > 0 and c.batch_size > 0 and keeps == c.batch_size:
        problems.append(
            f"loss.dynamic_beta_filter={loss.dynamic_beta_filter}: keeps round({c.batch_size} x (1 - "
            f"{loss.dynamic_beta_filter})) = all {c.batch_size} pairs of a step (batch_size={c.batch_size}); expected "
            "a fraction that leaves at least one out"
        )
    if loss.ld_alpha != 1 and not compares:
        problems.append(
            f"loss.ld_alpha={loss.ld_alpha}: LD-DPO weighs the log-probs of losses that compare "
            f"with a reference, and loss.name={loss.name!r} has none"
        )
    if loss.dpop_lambda > 0 and (loss.reference_free or not compares):
        problems.append(
            f"loss.dpop_lambda={loss.dpop_lambda}: DPOP penalizes "
            f"the chosen log-prob falling below the reference's, and loss.name={loss.name!r} runs no reference"
        )
    return problems


def logps_needed(hp) -> dict:
    """What the modifiers read of the log-probs beyond sums and counts, as forward_logps' options: each token's
    log-prob (LD-DPO) and WPO's statistic."""
    return {"per_token": getattr(hp, "ld_alpha", 1.0) != 1, "sum_sq": bool(getattr(hp, "wpo", False))}


class Modifiers:
    """The modifiers of one batch, for compute_loss: the log-probs a loss that compares with a reference sees
    (LD-DPO, DPOP), its beta (beta-DPO), the weights of its pairs (WPO, beta-DPO's filter), their metrics."""

    def __init__(self, hp, policy, reference, labels, beta_dpo, step, specs, n: int):
        sums, counts = policy.sums, policy.counts
        self.hp = hp
        self.counts = counts
        self.ref = torch.zeros_like(sums) if reference is None else reference.sums.to(sums.device)
        self.dpop = getattr(hp, "dpop_lambda", 0.0)
        self.wpo = None
        if getattr(hp, "wpo", False):
            self.wpo = wpo_weights(
                sums[:n], sums[n:], policy.log_sum_sq[:n], policy.log_sum_sq[n:], counts[:n], counts[n:]
            )
        self.ld_sums = None
        ld_alpha = getattr(hp, "ld_alpha", 1.0)
        if ld_alpha != 1.0:  # LD-DPO: the same pairs' sums, tokens past the public length down-weighted
            device = sums.device
            # output t predicts token t+1: a row's first token is never scored
            scored = (labels.to(device) != IGNORE_INDEX) & (torch.arange(labels.size(1), device=device) > 0)
            ref = self.ref  # no reference: its sums stay 0
            if reference is not None:
                ref = length_desensitized_logps(reference.tokens.to(device), scored, ld_alpha)
            self.ld_sums = (length_desensitized_logps(policy.tokens, scored, ld_alpha), ref)
        self.beta = self.keep = None
        if beta_dpo is not None and getattr(hp, "dynamic_beta", 0.0):  # the margins of the first loss that reads beta
            average = next(s for s in specs if "beta" in s.reads).average(hp)
            ratios = sequence_logps(sums - self.ref, counts, average).detach()
            self.beta, self.keep = beta_dpo(ratios[:n] - ratios[n:], hp, step)

    def loss(self, spec, logps: list, kwargs: dict) -> tuple:
        """spec's (losses, chosen rewards, rejected rewards) under the modifiers, from the plain paired log-probs
        `logps` (LD-DPO: from its own sums). The rewards: without DPOP's penalty, at the configured beta (a second
        call, without gradients, where either differs)."""
        if spec.needs_reference and self.ld_sums is not None:
            n = len(logps[0])
            average = spec.average(self.hp)
            policy_logps, reference_logps = (sequence_logps(x, self.counts, average) for x in self.ld_sums)
            logps = [policy_logps[:n], policy_logps[n:], reference_logps[:n], reference_logps[n:]]
        penalized = logps
        if self.dpop and spec.needs_reference:  # DPOP: the penalty inside the chosen log-ratio
            penalized = [dpop_chosen_logps(logps[0], logps[2], self.dpop), *logps[1:]]
        given = dict(kwargs, beta=self.beta) if self.beta is not None and "beta" in kwargs else kwargs
        losses, chosen, rejected = spec.fn(*penalized, **given)
        if chosen is not None and (penalized is not logps or given is not kwargs):
            with torch.no_grad():
                _, chosen, rejected = spec.fn(*logps, **kwargs)
        return losses, chosen, rejected

    def weigh(self, losses: Tensor) -> Tensor:
        """One loss's weighted losses, each pair times its WPO weight."""
        return losses if self.wpo is None else losses * self.wpo

    def total(self, total: Tensor, metrics: dict) -> Tensor:
        """The batch's losses with beta-DPO's filter (the mean loss becomes the kept pairs' mean); metrics added."""
        if self.wpo is not None:
            metrics["wpo/weights"] = self.wpo
        if self.keep is None:
            return total
        metrics["beta_dpo/beta"] = torch.full_like(self.keep, self.beta, dtype=torch.float)
        metrics["beta_dpo/kept"] = self.keep.float()
        return total * self.keep * (len(self.keep) / self.keep.sum())


def length_desensitized_logps(tokens: Tensor, scored: Tensor, alpha: float) -> Tensor:
    """LD-DPO (Liu et al. 2024, arXiv:2409.06411, Eq. 9): a response's log-prob with the tokens beyond the pair's
    shorter response ("public length" l_p = min(l_w, l_l)) down-weighted, log p = sum_{i <= l_p} log p_i + alpha
    sum_{i > l_p} log p_i, so that a longer response is not preferred for its length alone. alpha = 1 is plain DPO;
    the paper finds 0.2-0.8 best. tokens, scored: (2B, T), chosen rows then the rejected rows of the same pairs,
    each token's log-prob and whether it is scored. Returns Shape (2B,)."""
    n = tokens.size(0) // 2
    scored = scored.to(tokens.dtype)
    public = torch.minimum(scored[:n].sum(1), scored[n:].sum(1)).repeat(2)
    weight = torch.full_like(tokens, alpha).masked_fill_(scored.cumsum(1) <= public[:, None], 1.0)  # cumsum: 1-based
    return (tokens * scored * weight).sum(1)


def dpop_chosen_logps(policy_chosen_logps: Tensor, reference_chosen_logps: Tensor, lam: float) -> Tensor:
    """DPO-Positive (Pal et al. 2024, arXiv:2402.13228, Eq. 3): log pi(y_w) - lam * max(0, log pi_ref(y_w) - log
    pi(y_w)), Shape (batch,). Used as the chosen log-prob, it puts the penalty inside every loss's log-ratio: DPO's
    logit becomes beta (a - b - lam max(0, -a)), so the chosen response's likelihood may not fall below the
    reference's for free. The paper uses lam = 50 (5-500)."""
    return policy_chosen_logps - lam * (reference_chosen_logps - policy_chosen_logps).clamp(min=0)


def wpo_weights(chosen_sum, rejected_sum, chosen_sum_sq, rejected_sum_sq, chosen_len, rejected_len) -> Tensor:
    """WPO (Zhou et al. 2024, arXiv:2406.11827, Eq. 4 with its sampling alignment, as TRL's use_weighting): each
    pair's weight min(1, exp(mean_t [log p_t - log sum_v p_v^2] over the chosen + the same over the rejected)),
    detached: pairs the current policy would itself likely generate weigh more (off-policy data made closer to
    on-policy). *_sum: summed log-probs; *_sum_sq: summed log sum_v p_v^2 of the same tokens (logps.log_sum_sq);
    *_len: their counts; all Shape (batch,). Returns Shape (batch,)."""
    chosen = (chosen_sum - chosen_sum_sq) / chosen_len.clamp(min=1)
    rejected = (rejected_sum - rejected_sum_sq) / rejected_len.clamp(min=1)
    return torch.exp(chosen + rejected).clamp(max=1).detach()


def beta_dpo(
    margins: Tensor,
    beta: float,
    alpha: float,
    running: tuple[float, float] | None,
    drop: float = 0.0,
    generator: torch.Generator | None = None,
) -> tuple[float, Tensor, tuple[float, float]]:
    """beta-DPO (Wu et al. 2024, arXiv:2407.08639, Eq. 7 and Algorithm 1): a batch-level beta from the pairs' reward
    discrepancies M_i = log pi/pi_ref (y_w) - log pi/pi_ref (y_l), Shape (batch,), detached. The running threshold
    M_0 and spread sigma move toward the batch's mean and standard deviation (momentum m = 0.9; `running`
    None: they start at the first batch's). With `drop` > 0 the paper's filter keeps round((1 - drop) batch) pairs,
    drawn without replacement (`generator`) with probability exp(-(M_i - M_0)^2 / 2 sigma^2): outliers, likely
    mislabelled or uninformative, are left out. beta_batch = beta (1 + alpha (mean of the kept M_i - M_0)), at least
    1e-3, detached: a batch of larger discrepancies than usual gets a larger beta, so the policy stays nearer the
    reference where the data is easy. alpha 0 is DPO; the paper's alpha is 0.2-1, its filter drops 20%.
    Returns (beta_batch, keep (batch,) bool, the updated (M_0, sigma)); a batch of non-finite margins (a step the
    trainer will skip) changes nothing and gets beta."""
    if not torch.isfinite(margins).all():
        return beta, torch.ones_like(margins, dtype=torch.bool), running
    mean, std = margins.mean().item(), (margins.std().item() if len(margins) > 1 else 0.0)
    m = 0.9  # M_0 and sigma move 10% toward each batch's mean and spread
    m0, sigma = (mean, std) if running is None else (m * running[0] + (1 - m) * mean, m * running[1] + (1 - m) * std)
    keep = torch.ones_like(margins, dtype=torch.bool)
    if drop > 0:
        density = torch.exp(-0.5 * ((margins.double().cpu() - m0) / max(sigma, 1e-12)) ** 2) + 1e-300  # never all 0
        n_kept = max(1, round(len(margins) * (1 - drop)))
        kept = torch.multinomial(density, n_kept, replacement=False, generator=generator)
        keep = torch.zeros_like(keep).index_fill_(0, kept.to(keep.device), True)
    return max(1e-3, beta * (1 + alpha * (margins[keep].mean().item() - m0))), keep, (m0, sigma)


class BetaDPO:
    """beta-DPO's running threshold and spread (M_0, sigma) across steps: the trainer holds one, its checkpoint keeps
    it (state_dict), and compute_loss calls it with each batch's margins (the whole step's: config.py refuses a split
    step)."""

    def __init__(self, seed: int = 0):
        self.seed = seed
        self.running = None

    def state_dict(self) -> dict:
        return {"beta_dpo_running": self.running}

    def load_state_dict(self, state: dict) -> None:
        self.running = state.get("beta_dpo_running")

    def __call__(self, margins: Tensor, hp, step: int | None) -> tuple[float, Tensor]:
        """beta_batch and the filter's `keep` (beta_dpo). A training step (`step`) draws the filter, seeded by (seed,
        step) so that a resume redraws it exactly, and moves the running statistics; evaluation (None) reads them."""
        draw = None if step is None else torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        drop = 0.0 if step is None else hp.dynamic_beta_filter
        beta, keep, running = beta_dpo(margins, hp.beta, hp.dynamic_beta, self.running, drop, draw)
        self.running = self.running if step is None else running
        return beta, keep
