"""Tests for losses.py: every loss against numbers worked by hand, the modifiers, and the dispatcher's plumbing
(the chunked log-probs are tests/test_logps.py's).

Shared pair batch (used unless a test says otherwise), chosen/rejected log-ratios a and b:
    reference chosen  [-10, -20, -30], policy chosen   [-10, -15, -20]  ->  a = [0, 5, 10]
    reference rejected [-15, -25, -35], policy rejected [-15, -30, -45]  ->  b = [0, -5, -10]
    DPO margin h = a - b = [0, 10, 20].
Expected values are computed in each test with plain `math`, from the formula in its docstring.
"""

import inspect
import math
import os
import re
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import pytest
import torch
import yaml

import losses
import modifiers
from config import LossConfig
from logps import IGNORE_INDEX, SequenceLogps
from logps import sequence_logps
from losses import LOSSES, needs_reference

ATOL = 1e-6
REF_CHOSEN = [-10.0, -20.0, -30.0]
REF_REJECTED = [-15.0, -25.0, -35.0]
POLICY_CHOSEN = [-10.0, -15.0, -20.0]
POLICY_REJECTED = [-15.0, -30.0, -45.0]
A = [0.0, 5.0, 10.0]  # chosen log-ratios
B = [0.0, -5.0, -10.0]  # rejected log-ratios
# every config key a loss may read, at its declared default (label_smoothing: exo_pair needs it > 0)
ALL_HPARAMS = dict(LossConfig(), label_smoothing=0.1)
CONFIG_KEYS = set(LossConfig())
KL = torch.tensor(2.0, dtype=torch.float64)  # KTO's KL reference point where a test passes pairs to every loss
CONFIG_DIR = Path(__file__).resolve().parents[1] / "config" / "loss"


def t(values):
    return torch.tensor(values, dtype=torch.float64)


def compute_loss(
    names,
    weights,
    hparams,
    policy_chosen_sum,
    policy_chosen_len,
    policy_rejected_sum=None,
    policy_rejected_len=None,
    reference_chosen_sum=None,
    reference_rejected_sum=None,
    policy_tokens=None,
    reference_tokens=None,
    scored=None,
    policy_sum_sq=None,
    **kwargs,
):
    """losses.compute_loss on a batch written per side, as the tests below write it: chosen and rejected sums and
    counts become the rows of one SequenceLogps (chosen then rejected), hparams a dict of config keys (the rest at
    their defaults), `scored` the labels of its scored tokens."""
    paired = policy_rejected_sum is not None
    cat = lambda chosen, rejected: chosen if not paired else torch.cat([chosen, rejected])  # noqa: E731
    policy = SequenceLogps(
        cat(policy_chosen_sum, policy_rejected_sum),
        cat(policy_chosen_len, policy_rejected_len),
        tokens=policy_tokens,
        log_sum_sq=policy_sum_sq,
    )
    reference = None
    if reference_chosen_sum is not None and (reference_rejected_sum is not None or not paired):
        reference = SequenceLogps(cat(reference_chosen_sum, reference_rejected_sum), None, tokens=reference_tokens)
    labels = None if scored is None else torch.where(scored, 0, IGNORE_INDEX)
    hp = SimpleNamespace(**hparams)
    return losses.compute_loss(names, weights, hp, policy, reference, paired=paired, labels=labels, **kwargs)


def neg_log_sigmoid(x):
    return math.log1p(math.exp(-x))


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def run(
    name,
    policy_chosen=POLICY_CHOSEN,
    policy_rejected=POLICY_REJECTED,
    reference_chosen=REF_CHOSEN,
    reference_rejected=REF_REJECTED,
    **hparams,
):
    """Call a registered loss function directly on the shared batch."""
    return LOSSES[name].fn(t(policy_chosen), t(policy_rejected), t(reference_chosen), t(reference_rejected), **hparams)


def close(tensor, expected, atol=ATOL):
    torch.testing.assert_close(tensor, t(expected), atol=atol, rtol=0, check_dtype=False)


# ---------------------------------------------------------------------------------------------
# Losses, one hand-worked example each
# ---------------------------------------------------------------------------------------------


def test_dpo_hand_worked():
    """h = [0, 10, 20], beta = 0.1 -> beta h = [0, 1, 2]; loss = -log sigma = [ln 2, 0.3133, 0.1269].
    Rewards beta a = [0, 0.5, 1] (positive: chosen became likelier), beta b = [0, -0.5, -1]."""
    losses_, chosen, rejected = run("dpo", beta=0.1)
    close(losses_, [neg_log_sigmoid(z) for z in (0.0, 1.0, 2.0)])
    close(chosen, [0.0, 0.5, 1.0])
    close(rejected, [0.0, -0.5, -1.0])


def test_dpo_policy_equals_reference_is_ln2_with_zero_rewards():
    """policy = reference -> every log-ratio 0 -> loss -log sigma(0) = ln 2, rewards 0, for every
    f-divergence (each transform is shifted so that g(0) = 0)."""
    for divergence in losses.F_DIVERGENCES:
        out, chosen, rejected = run(
            "dpo", POLICY_CHOSEN, POLICY_REJECTED, POLICY_CHOSEN, POLICY_REJECTED, beta=0.1, f_divergence=divergence
        )
        close(out, [math.log(2)] * 3)
        close(chosen, [0.0] * 3)
        close(rejected, [0.0] * 3)


def test_dpo_f_divergences_hand_worked():
    """beta = 0.1, a = [0, 5, 10], b = [0, -5, -10]; loss = -log sigma(beta (g(a) - g(b))) with
    forward_kl g(x) = 1 - e^-x:            a=5, b=-5: g = 1 - e^-5 = 0.99326, 1 - e^5 = -147.41;
    js_divergence g(x) = log sigma(x) + ln 2;  alpha_divergence g(x) = (1 - e^(-alpha x)) / alpha."""
    transforms = {
        "reverse_kl": lambda x: x,
        "forward_kl": lambda x: 1 - math.exp(-x),
        "js_divergence": lambda x: -neg_log_sigmoid(x) + math.log(2),
        "alpha_divergence": lambda x: (1 - math.exp(-0.3 * x)) / 0.3,
    }
    for name, g in transforms.items():
        out, chosen, rejected = run("dpo", beta=0.1, f_divergence=name, f_alpha=0.3)
        close(out, [neg_log_sigmoid(0.1 * (g(a) - g(b))) for a, b in zip(A, B)])
        close(chosen, [0.1 * g(a) for a in A])
        close(rejected, [0.1 * g(b) for b in B])


def test_alpha_divergence_at_one_is_forward_kl():
    """f'(u) = (1 - u^-alpha) / alpha at alpha = 1 is 1 - 1/u, the forward-KL transform."""
    forward, *_ = run("dpo", beta=0.1, f_divergence="forward_kl")
    alpha_one, *_ = run("dpo", beta=0.1, f_divergence="alpha_divergence", f_alpha=1.0)
    torch.testing.assert_close(alpha_one, forward, atol=ATOL, rtol=0)


def test_cdpo_hand_worked_and_zero_smoothing_is_dpo():
    """cDPO is dpo with label_smoothing (config/loss/cdpo.yaml): eps = 0.1, beta h = [0, 1, 2]: loss = 0.9 (-log
    sigma(z)) + 0.1 (-log sigma(-z)) = [ln 2, 0.4133, 0.3269]; with eps = 0 it is exactly DPO."""
    out, *_ = run("dpo", beta=0.1, label_smoothing=0.1)
    close(out, [0.9 * neg_log_sigmoid(z) + 0.1 * neg_log_sigmoid(-z) for z in (0.0, 1.0, 2.0)])
    cdpo_zero = run("dpo", beta=0.1, label_smoothing=0.0)
    dpo = run("dpo", beta=0.1)
    for got, want in zip(cdpo_zero, dpo):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_dpo_label_smoothing_is_cdpo_as_in_the_original_code():
    """The original DPO code's `loss=dpo loss.label_smoothing=eps` is conservative DPO:
    eps = 0.3, beta h = [0, 1, 2]: loss = 0.7 (-log sigma(z)) + 0.3 (-log sigma(-z))
    = [ln 2, 0.5133, 0.5269], through the real config loader and the dispatcher."""
    import config_loader

    cfg, _ = config_loader.load_config(["loss=dpo", "loss.label_smoothing=0.3"])
    out = compute_loss(cfg.loss_names, cfg.loss.weights, cfg.loss, **pair_inputs())
    expected = [0.7 * neg_log_sigmoid(z) + 0.3 * neg_log_sigmoid(-z) for z in (0.0, 1.0, 2.0)]
    close(out.losses, expected)
    cfg, _ = config_loader.load_config(["loss=cdpo", "loss.label_smoothing=0.3"])  # the preset: dpo, eps
    assert cfg.loss_names == ["dpo"]
    close(compute_loss(cfg.loss_names, cfg.loss.weights, cfg.loss, **pair_inputs()).losses, expected)


@pytest.mark.parametrize(
    "divergence,f_alpha", [("forward_kl", 0.5), ("alpha_divergence", 1.0), ("alpha_divergence", 0.5)]
)
def test_f_divergences_stay_finite_in_fp32_far_from_the_reference(divergence, f_alpha):
    """forward_kl's beta (1 - e^-a) at a = -90 needs e^90 = 1.2e39 > fp32's 3.4e38: written as
    beta * exp(-a) it overflowed to inf and the gradient was NaN. In the form beta - exp(log beta - a)
    a = -90 is exact (0.1 e^90 = 1.2e38 fits) and matches float64; further out the exponent is capped
    (loss finite, no NaN in any gradient)."""
    chosen_ratios = torch.tensor([-90.0, -100.0, -1000.0, -2.0])
    rejected_ratios = torch.tensor([-1.0, 3.0, -1000.0, -95.0])
    hp = dict(beta=0.1, f_divergence=divergence, f_alpha=f_alpha)
    for dtype in (torch.float32, torch.float64):
        policy_chosen = chosen_ratios.to(dtype, copy=True).requires_grad_(True)
        policy_rejected = rejected_ratios.to(dtype, copy=True).requires_grad_(True)
        zeros = torch.zeros(4, dtype=dtype)
        out, chosen, rejected = losses.dpo_loss(policy_chosen, policy_rejected, zeros, zeros, **hp)
        out.sum().backward()
        for name, x in [
            ("loss", out),
            ("chosen_rewards", chosen),
            ("rejected_rewards", rejected),
            ("grad chosen", policy_chosen.grad),
            ("grad rejected", policy_rejected.grad),
        ]:
            assert torch.isfinite(x).all(), f"{dtype} {name}: {x}"
        if dtype is torch.float32:
            fp32 = (out.detach(), policy_chosen.grad.clone(), policy_rejected.grad.clone())
    if divergence == "forward_kl":  # at a = -90 (index 0) and b = -95 (index 3, 0.1 e^95 > fp32 max: capped)
        # rtol: the fp32 exponent 87.7 carries half an ulp (3.8e-6), and exp turns that into relative error
        torch.testing.assert_close(fp32[0][0].double(), out[0].detach(), rtol=1e-5, atol=0)
        torch.testing.assert_close(fp32[1][0].double(), policy_chosen.grad[0], rtol=1e-5, atol=0)


def test_f_alpha_is_one_minus_trls_alpha_divergence_coefficient():
    """TRL 1.x's alpha divergence: score(x) = (exp((c - 1) x) - 1) / (c - 1) with c =
    f_alpha_divergence_coef (c = 1 is reverse KL), loss = -log sigma(beta (score(a) - score(b))). Ours at
    f_alpha = 1 - c is the same loss; TRL's first f-DPO code wrote (exp(-c b) - exp(-c a)) / c, which is
    ours at f_alpha = c. c = 0.3 and 0.7, a = [0, 5, 10], b = [0, -5, -10], beta = 0.1."""
    for c in (0.3, 0.7):
        score = lambda x: (math.exp((c - 1) * x) - 1) / (c - 1)
        trl = [neg_log_sigmoid(0.1 * (score(a) - score(b))) for a, b in zip(A, B)]
        close(run("dpo", beta=0.1, f_divergence="alpha_divergence", f_alpha=1 - c)[0], trl)
        old_trl = [neg_log_sigmoid(0.1 * (math.exp(-c * b) - math.exp(-c * a)) / c) for a, b in zip(A, B)]
        close(run("dpo", beta=0.1, f_divergence="alpha_divergence", f_alpha=c)[0], old_trl)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_batch_statistics_flag_is_true_exactly_when_splitting_the_batch_changes_the_loss(name):
    """Each loss on the 3-pair batch vs on [pair 0] and [pairs 1, 2] separately: equal for per-example
    losses, different for aot (sort over the batch) and bco_pair (mean reward of the batch). The flag is
    what config.py uses to refuse gradient accumulation / micro-batches / several ranks for them.
    Reference chosen [-10, -30, -25] here, so the reference margins [5, -5, 10] sort differently from
    the policy's [5, 15, 25] and the 6 rewards have mean 5/6, not 0 (with the shared batch both the
    sort and bco_pair's mean would match the split by chance)."""
    hp = dict(ALL_HPARAMS, beta=1.0)
    inputs = dict(pair_inputs(), reference_chosen_sum=t([-10.0, -30.0, -25.0]))
    whole = compute_loss(name, None, hp, **inputs, kl=KL).losses
    parts = [
        compute_loss(name, None, hp, **{k: v[rows] for k, v in inputs.items()}, kl=KL).losses
        for rows in (slice(0, 1), slice(1, 3))
    ]
    if LOSSES[name].unpaired:  # kto lists chosen completions then rejected ones: compare in one order
        whole, parts = whole.sort().values, [torch.cat(parts).sort().values]
    split_equal = torch.allclose(whole, torch.cat(parts), atol=1e-9)
    assert split_equal != LOSSES[name].batch_statistics, (name, whole, parts)


def test_robust_hand_worked():
    """eps = 0.1, beta h = [0, 1, 2]: loss = (0.9 l(z) - 0.1 l(-z)) / 0.8, l(z) = -log sigma(z)
    = [ln 2, 0.1883, -0.1231] (the unbiased estimate may be negative); eps = 0 is DPO."""
    out, chosen, _ = run("robust", beta=0.1, label_smoothing=0.1)
    close(out, [(0.9 * neg_log_sigmoid(z) - 0.1 * neg_log_sigmoid(-z)) / 0.8 for z in (0.0, 1.0, 2.0)])
    close(chosen, [0.0, 0.5, 1.0])
    torch.testing.assert_close(run("robust", beta=0.1, label_smoothing=0.0)[0], run("dpo", beta=0.1)[0])


def test_ipo_hand_worked():
    """beta (tau) = 0.5 -> target 1 / (2 tau) = 1; h = [0, 10, 20]: loss = (h - 1)^2 = [1, 81, 361].
    Rewards beta a = [0, 2.5, 5]."""
    out, chosen, rejected = run("ipo", beta=0.5)
    close(out, [(h - 1.0) ** 2 for h in (0.0, 10.0, 20.0)])
    close(chosen, [0.0, 2.5, 5.0])
    close(rejected, [0.0, -2.5, -5.0])


def test_hinge_hand_worked():
    """beta = 0.05, h = [0, 10, 20] -> beta h = [0, 0.5, 1]; loss = max(0, 1 - beta h) = [1, 0.5, 0]."""
    out, chosen, _ = run("hinge", beta=0.05)
    close(out, [1.0, 0.5, 0.0])
    close(chosen, [0.0, 0.25, 0.5])


def test_simpo_hand_worked():
    """Per-token mean log-probs chosen [-0.5, -0.5], rejected [-0.75, -1.5]; beta = 2, gamma = 1:
    beta (w - l) - gamma = [2 * 0.25 - 1, 2 * 1.0 - 1] = [-0.5, 1] -> loss [0.9741, 0.3133].
    Rewards beta * logp: [-1, -1] and [-1.5, -3]; no reference is read (None is fine)."""
    out, chosen, rejected = LOSSES["simpo"].fn(t([-0.5, -0.5]), t([-0.75, -1.5]), None, None, beta=2.0, gamma=1.0)
    close(out, [neg_log_sigmoid(-0.5), neg_log_sigmoid(1.0)])
    close(chosen, [-1.0, -1.0])
    close(rejected, [-1.5, -3.0])


def test_orpo_hand_worked():
    """Per-token mean log-probs chosen -0.5, rejected -1.0; log odds = lp - log(1 - e^lp):
    chosen -0.5 + 0.9328 = 0.4328, rejected -1.0 + 0.4587 = -0.5413, log odds ratio 0.9741;
    loss = nll 0.5 + 0.1 * (-log sigma(0.9741)) = 0.5 + 0.1 * 0.3216 = 0.5320."""
    log_odds = lambda lp: lp - math.log(1 - math.exp(lp))  # noqa: E731
    out, chosen, rejected = LOSSES["orpo"].fn(t([-0.5]), t([-1.0]), None, None, orpo_lambda=0.1, chosen_nll=t([0.5]))
    close(out, [0.5 + 0.1 * neg_log_sigmoid(log_odds(-0.5) - log_odds(-1.0))])
    close(chosen, [log_odds(-0.5)])
    close(rejected, [log_odds(-1.0)])


def test_rpo_preset_hand_worked():
    """loss=rpo (config/loss/rpo.yaml) is [dpo, sft] weighted [1, alpha]: alpha = 2: DPO losses [ln 2, 0.3133,
    0.1269] + 2 * the per-token mean nll [5, 3, 2] of pair_inputs' chosen responses; rewards dpo's."""
    import config_loader

    cfg, _ = config_loader.load_config(["loss=rpo", "loss.weights=[1.0,2.0]"])
    assert cfg.loss_names == ["dpo", "sft"]
    out = compute_loss(cfg.loss_names, cfg.loss.weights, cfg.loss, **pair_inputs())
    close(out.losses, [neg_log_sigmoid(z) + 2.0 * nll for z, nll in zip((0.0, 1.0, 2.0), (5.0, 3.0, 2.0))])
    close(out.chosen_rewards, [0.0, 0.5, 1.0])


def test_exo_pair_hand_worked():
    """eps = 1e-3, z = beta h = [0, 1, 2]:
    loss = sigma(z) (log sigma(z) - log(1 - eps)) + sigma(-z) (log sigma(-z) - log eps)
    at z = 0: 0.5 (ln 0.5 - ln 0.999) + 0.5 (ln 0.5 - ln 0.001) = 2.7612; z=1: 1.2763; z=2: 0.4590."""
    eps = 1e-3
    expected = [
        sigmoid(z) * (-neg_log_sigmoid(z) - math.log(1 - eps)) + sigmoid(-z) * (-neg_log_sigmoid(-z) - math.log(eps))
        for z in (0.0, 1.0, 2.0)
    ]
    out, *_ = run("exo_pair", beta=0.1, label_smoothing=eps)
    close(out, expected)
    with pytest.raises(ValueError, match="label_smoothing"):
        run("exo_pair", beta=0.1, label_smoothing=0.0)


def test_nca_pair_hand_worked():
    """beta = 0.1: r_w = beta a = [0, 0.5, 1], r_l = beta b = [0, -0.5, -1];
    loss = -log sigma(r_w) - 0.5 log sigma(-r_w) - 0.5 log sigma(-r_l) = [2 ln 2, 1.1982, 1.1265]."""
    out, chosen, rejected = run("nca_pair", beta=0.1)
    close(
        out,
        [
            neg_log_sigmoid(w) + 0.5 * neg_log_sigmoid(-w) + 0.5 * neg_log_sigmoid(-l)
            for w, l in ((0.0, 0.0), (0.5, -0.5), (1.0, -1.0))
        ],
    )
    close(chosen, [0.0, 0.5, 1.0])
    close(rejected, [0.0, -0.5, -1.0])


def test_bco_pair_hand_worked():
    """beta = 0.1: r_w = [0, 0.5, 1], r_l = [0, -0.5, -1]; delta = mean of all six = 0;
    loss = -log sigma(r_w) - log sigma(-r_l) = [2 ln 2, 0.9482, 0.6265].
    Shifting every log-ratio by +10 shifts every reward by 1 and delta by 1: the loss is unchanged."""
    out, *_ = run("bco_pair", beta=0.1)
    expected = [neg_log_sigmoid(w) + neg_log_sigmoid(-l) for w, l in ((0.0, 0.0), (0.5, -0.5), (1.0, -1.0))]
    close(out, expected)
    shifted, *_ = run("bco_pair", [p + 10 for p in POLICY_CHOSEN], [p + 10 for p in POLICY_REJECTED], beta=0.1)
    close(shifted, expected)


def test_sppo_hard_hand_worked():
    """beta = 0.1 -> targets +-1/(2 beta) = +-5; loss = (a - 5)^2 + (b + 5)^2 = [50, 0, 50]."""
    out, *_ = run("sppo_hard", beta=0.1)
    close(out, [50.0, 0.0, 50.0])


def test_apo_zero_hand_worked():
    """beta = 0.1: loss = 1 - sigma(beta a) + sigma(beta b) = [1, 1 - sigma(.5) + sigma(-.5), ...]
    = [1, 0.7551, 0.5379]."""
    out, *_ = run("apo_zero", beta=0.1)
    close(out, [1 - sigmoid(0.1 * a) + sigmoid(0.1 * b) for a, b in zip(A, B)])


def test_apo_down_hand_worked():
    """beta = 0.1: loss = sigma(beta a) + 1 - sigma(beta (a - b)) = [1, sigma(.5) + 1 - sigma(1), ...]
    = [1, 0.8914, 0.8503]."""
    out, *_ = run("apo_down", beta=0.1)
    close(out, [sigmoid(0.1 * a) + 1 - sigmoid(0.1 * (a - b)) for a, b in zip(A, B)])


def test_discopop_hand_worked():
    """beta = 0.1, tau = 0.05, z = beta h = [0, 1, 2], rho = sigma(z / tau):
    loss = (1 - rho) (-log sigma(z)) + rho e^-z = [0.5 ln 2 + 0.5, ~e^-1, ~e^-2]; and no NaN at
    z = -1000, where rho underflows to 0 and e^-z overflows."""
    out, *_ = run("discopop", beta=0.1, discopop_tau=0.05)
    close(
        out, [(1 - sigmoid(z / 0.05)) * neg_log_sigmoid(z) + sigmoid(z / 0.05) * math.exp(-z) for z in (0.0, 1.0, 2.0)]
    )
    extreme, *_ = run("discopop", [0.0], [10000.0], [0.0], [0.0], beta=0.1, discopop_tau=0.05)
    assert torch.isfinite(extreme).all()
    close(extreme, [1000.0], atol=1e-4)


def kto(policy, reference, desirable, kl, beta=0.1, desirable_weight=1.0, undesirable_weight=1.0):
    return LOSSES["kto"].fn(
        t(policy),
        t(reference),
        torch.tensor(desirable),
        t(kl),
        beta=beta,
        desirable_weight=desirable_weight,
        undesirable_weight=undesirable_weight,
    )


def test_kto_hand_worked():
    """beta 0.1, log-ratios r = [0, 10, -10, 10] (policy [-10, 0, -30, -10] minus reference
    [-10, -10, -20, -20]), labels [D, D, U, U], KL estimate 2 (z0 = 2), lambda_D = 2, lambda_U = 1:
    desirable  loss = 2 (1 - sigma(0.1 (r - 2))): r = 0 -> 2 (1 - sigma(-0.2)), r = 10 -> 2 (1 - sigma(0.8));
    undesirable loss = 1 (1 - sigma(0.1 (2 - r))): r = -10 -> 1 - sigma(1.2), r = 10 -> 1 - sigma(-0.8).
    Rewards are beta r = [0, 1, -1, 1], whatever the label."""
    losses_, rewards = kto(
        [-10.0, 0.0, -30.0, -10.0], [-10.0, -10.0, -20.0, -20.0], [True, True, False, False], 2.0, desirable_weight=2.0
    )
    close(losses_, [2 * (1 - sigmoid(-0.2)), 2 * (1 - sigmoid(0.8)), 1 - sigmoid(1.2), 1 - sigmoid(-0.8)])
    close(rewards, [0.0, 1.0, -1.0, 1.0])
    assert not rewards.requires_grad


def test_kto_negative_kl_is_clamped_to_zero_and_carries_no_gradient():
    """z0 = max(0, KL): a KL estimate of -5 gives the losses of KL 0: 1 - sigma(0.1 r) for r = [10] (D),
    1 - sigma(-0.1 r) for r = [-10] (U), i.e. 1 - sigma(1) both. The reference point is detached."""
    kl = t(-5.0).requires_grad_()
    losses_, _ = LOSSES["kto"].fn(
        t([0.0, -20.0]),
        t([-10.0, -10.0]),
        torch.tensor([True, False]),
        kl,
        beta=0.1,
        desirable_weight=1.0,
        undesirable_weight=1.0,
    )
    close(losses_, [1 - sigmoid(1.0), 1 - sigmoid(1.0)])
    assert kl.grad is None and not losses_.requires_grad  # nothing upstream of the losses but the detached kl
    positive = t(3.0).requires_grad_()
    policy = t([0.0]).requires_grad_()
    LOSSES["kto"].fn(
        policy, t([0.0]), torch.tensor([True]), positive, beta=0.1, desirable_weight=1.0, undesirable_weight=1.0
    )[0].sum().backward()
    assert positive.grad is None and policy.grad is not None


@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.33, 0.5)])
def test_kto_at_policy_equals_reference_is_half_the_weight(weights):
    """The ln-2 invariant of KTO: policy = reference gives r = 0 and (the mismatched pairs' log-ratios
    being 0 too) KL = 0, so every loss is lambda (1 - sigma(0)) = lambda / 2 and every reward 0."""
    lambda_d, lambda_u = weights
    logps = [-12.5, -3.0, -40.0, -7.25]
    losses_, rewards = kto(
        logps, logps, [True, False, True, False], 0.0, desirable_weight=lambda_d, undesirable_weight=lambda_u
    )
    close(losses_, [lambda_d / 2, lambda_u / 2, lambda_d / 2, lambda_u / 2])
    close(rewards, [0.0] * 4)


def test_kto_matches_the_papers_value_function_written_independently():
    """Eq. 8 of the KTO paper as written there: L = E[lambda_y - v(x, y)] with
    v = lambda_D sigma(beta (r - z0)) for desirable y, lambda_U sigma(beta (z0 - r)) for undesirable y,
    r = log pi/pi_ref, z0 = KL(pi || pi_ref) >= 0; computed here per example with math, on random inputs."""
    gen = torch.Generator().manual_seed(0)
    policy, reference = (
        torch.randn(16, generator=gen, dtype=torch.float64) * 20 - 30,
        torch.randn(16, generator=gen, dtype=torch.float64) * 20 - 30,
    )
    desirable = torch.rand(16, generator=gen) < 0.5
    beta, lambda_d, lambda_u, kl = 0.3, 1.2, 0.8, 1.7
    losses_, _ = LOSSES["kto"].fn(
        policy, reference, desirable, t(kl), beta=beta, desirable_weight=lambda_d, undesirable_weight=lambda_u
    )
    expected = []
    for p_, r_, d in zip(policy.tolist(), reference.tolist(), desirable.tolist()):
        reward = p_ - r_
        value = lambda_d * sigmoid(beta * (reward - kl)) if d else lambda_u * sigmoid(beta * (kl - reward))
        expected.append((lambda_d if d else lambda_u) - value)
    close(losses_, expected, atol=1e-12)


def test_kto_through_the_dispatcher_unpaired_and_paired():
    """Unpaired: completions with labels, metrics rewards/chosen on desirable (NaN elsewhere), rewards/rejected
    on undesirable, kl (the raw estimate) and kl_clamped (z0) on every row. Paired (pairs evaluated with kto):
    chosen = desirable, rejected = undesirable, so the 3 pairs are 6 completions, and accuracies/margins compare
    each pair as DPO does: rewards
    [0, .5, 1] vs [0, -.5, -1] -> accuracies [0, 1, 1], margins [0, 1, 2]."""
    unpaired = compute_loss(
        "kto",
        None,
        dict(ALL_HPARAMS),
        policy_chosen_sum=t([-10.0, -20.0]),
        policy_chosen_len=torch.tensor([3, 4]),
        reference_chosen_sum=t([-20.0, -10.0]),
        desirable=torch.tensor([True, False]),
        kl=t(0.0),
    )
    close(unpaired.losses, [1 - sigmoid(1.0), 1 - sigmoid(1.0)])
    m = unpaired.metrics
    assert m["rewards/chosen"][0].item() == pytest.approx(1.0) and m["rewards/chosen"][1].isnan()
    assert m["rewards/rejected"][1].item() == pytest.approx(-1.0) and m["rewards/rejected"][0].isnan()
    assert m["kl"].shape == (2,) and "rewards/accuracies" not in m  # per completion, as every metric
    clamped = compute_loss(
        "kto",
        None,
        dict(ALL_HPARAMS),
        policy_chosen_sum=t([-10.0, -20.0]),
        policy_chosen_len=torch.tensor([3, 4]),
        reference_chosen_sum=t([-20.0, -10.0]),
        desirable=torch.tensor([True, False]),
        kl=t(-0.5),
    )
    assert clamped.metrics["kl"].tolist() == [-0.5, -0.5]  # logged as estimated, negative too
    assert clamped.metrics["kl_clamped"].tolist() == [0.0, 0.0]  # z0 = max(0, kl): what the loss used
    paired = compute_loss("kto", None, dict(ALL_HPARAMS), **pair_inputs(), kl=t(0.0))
    a, b = t(A), t(B)
    close(paired.losses, torch.cat([1 - torch.sigmoid(0.1 * a), 1 - torch.sigmoid(-0.1 * b)]).tolist())
    close(paired.metrics["rewards/accuracies"], [0.0, 1.0, 1.0])
    close(paired.metrics["rewards/margins"], [0.0, 1.0, 2.0])
    with pytest.raises(ValueError, match="KL reference point"):
        compute_loss("kto", None, dict(ALL_HPARAMS), **pair_inputs())


def test_aot_hand_worked():
    """beta = 1; policy margins (chosen - rejected) [3, 1, 2] sort to [1, 2, 3]; reference margins
    [0, 2, -1] sort to [-1, 0, 2]; quantile gaps [2, 2, 1]; loss = -log sigma = [0.1269, 0.1269, 0.3133].
    At batch size 1 AOT is DPO."""
    out, *_ = run("aot", [3.0, 1.0, 2.0], [0.0, 0.0, 0.0], [0.0, 2.0, -1.0], [0.0, 0.0, 0.0], beta=1.0)
    close(out, [neg_log_sigmoid(2.0), neg_log_sigmoid(2.0), neg_log_sigmoid(1.0)])
    one = run("aot", [-3.0], [-5.0], [-4.0], [-4.5], beta=0.1)
    dpo = run("dpo", [-3.0], [-5.0], [-4.0], [-4.5], beta=0.1)
    for got, want in zip(one, dpo):
        torch.testing.assert_close(got, want)


def test_sft_hand_worked():
    """sft loss = -log-prob of the chosen response: [0.5, 2] for log-probs [-0.5, -2]; no rewards."""
    out, chosen, rejected = LOSSES["sft"].fn(t([-0.5, -2.0]))
    close(out, [0.5, 2.0])
    assert chosen is None and rejected is None


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_every_loss_runs_through_dispatcher_and_rewards_carry_no_grad(name):
    policy_chosen = t(POLICY_CHOSEN).requires_grad_()
    policy_rejected = t(POLICY_REJECTED).requires_grad_()
    hparams = dict(ALL_HPARAMS, label_smoothing=1e-3)
    out = compute_loss(
        [name],
        None,
        hparams,
        policy_chosen,
        t([4, 5, 6]),
        policy_rejected,
        t([5, 6, 7]),
        t(REF_CHOSEN),
        t(REF_REJECTED),
        kl=KL,
    )
    # kto scores the 3 pairs as 6 labelled completions (chosen desirable, rejected undesirable)
    assert out.losses.shape == ((6,) if LOSSES[name].unpaired else (3,)) and out.losses.requires_grad
    assert torch.isfinite(out.losses).all()
    out.losses.sum().backward()
    assert policy_chosen.grad is not None
    if name != "sft":
        assert out.chosen_rewards is not None and not out.chosen_rewards.requires_grad
        assert LOSSES[name].unpaired or (out.rejected_rewards is not None and not out.rejected_rewards.requires_grad)
    assert all(not m.requires_grad for m in out.metrics.values())


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_every_loss_is_documented(name):
    """Paper with arXiv id (cDPO: the note's URL), the equation written out, shapes, intuition,
    typical hyperparameter range. A failure names the function and each part it lacks."""
    fn = LOSSES[name].fn
    doc = inspect.getdoc(fn) or ""
    words = ["Shape", "Intuition"] + ["Typical", "loss = "] * (name != "sft")  # sft: no hyperparameter to range
    missing = [f"'{word}'" for word in words if word not in doc]
    missing += ["a paper's arXiv:NNNN.NNNNN"] * (not re.search(r"arXiv:\d{4}\.\d{5}|ericmitchell\.ai", doc))
    assert not missing, (
        f"{fn.__name__}'s docstring lacks {', '.join(missing)} (loss {name!r}; README, Adding a "
        "loss: the paper, the 'loss = ' equation, 'Shape', 'Intuition', the 'Typical' range)"
    )


def test_a_loss_docstring_failure_names_the_function_and_what_it_lacks(monkeypatch):
    def margin_dpo_loss(
        policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps, *, beta: float
    ):
        """DPO, offset (arXiv:2402.10571). loss = -log sigma(beta h - 1). Intuition: a margin. Typical beta 0.1."""

    spec = losses.LossSpec(margin_dpo_loss, needs_reference=True, average_log_prob=False)
    monkeypatch.setitem(LOSSES, "margin_dpo", spec)
    with pytest.raises(AssertionError, match="margin_dpo_loss's docstring lacks 'Shape' \\(loss 'margin_dpo'"):
        test_every_loss_is_documented("margin_dpo")


# ---------------------------------------------------------------------------------------------
# Dispatcher
# ---------------------------------------------------------------------------------------------


def pair_inputs(requires_grad=False):
    """Sums and lengths: chosen sums [-10, -15, -20] over [2, 5, 10] tokens, rejected sums
    [-15, -30, -45] over [3, 6, 9] tokens, reference sums as in the module docstring."""
    policy_chosen = t(POLICY_CHOSEN).requires_grad_(requires_grad)
    policy_rejected = t(POLICY_REJECTED).requires_grad_(requires_grad)
    return dict(
        policy_chosen_sum=policy_chosen,
        policy_chosen_len=torch.tensor([2, 5, 10]),
        policy_rejected_sum=policy_rejected,
        policy_rejected_len=torch.tensor([3, 6, 9]),
        reference_chosen_sum=t(REF_CHOSEN),
        reference_rejected_sum=t(REF_REJECTED),
    )


def test_dispatcher_dpo_sums_and_metrics():
    """DPO uses sums by default: same numbers as test_dpo_hand_worked. Metrics under the original
    DPO names: rewards [0, .5, 1] vs [0, -.5, -1] -> accuracies [0, 1, 1], margins [0, 1, 2];
    logps are the policy sums; nll/chosen = -sum/len = [5, 3, 2]."""
    out = compute_loss(["dpo"], None, {"beta": 0.1}, **pair_inputs())
    close(out.losses, [neg_log_sigmoid(z) for z in (0.0, 1.0, 2.0)])
    assert set(out.metrics) == {
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
        "nll/chosen",
        "loss",
    }
    close(out.metrics["rewards/accuracies"], [0.0, 1.0, 1.0])
    close(out.metrics["rewards/margins"], [0.0, 1.0, 2.0])
    close(out.metrics["logps/chosen"], POLICY_CHOSEN)
    close(out.metrics["logps/rejected"], POLICY_REJECTED)
    close(out.metrics["nll/chosen"], [5.0, 3.0, 2.0])
    close(out.metrics["loss"], out.losses.tolist())


def test_dispatcher_sum_vs_mean_selection():
    """average_log_prob: None -> the loss's default (dpo: sum, ipo: mean); True/False override.
    Means: policy chosen [-5, -3, -2], rejected [-5, -5, -5], reference chosen [-5, -4, -3],
    reference rejected [-5, -25/6, -35/9]; margins h = (pc - rc) - (pr - rr)."""
    inputs = pair_inputs()
    pc = [-10 / 2, -15 / 5, -20 / 10]
    pr = [-15 / 3, -30 / 6, -45 / 9]
    rc = [-10 / 2, -20 / 5, -30 / 10]
    rr = [-15 / 3, -25 / 6, -35 / 9]
    mean_h = [(a - c) - (b - d) for a, b, c, d in zip(pc, pr, rc, rr)]
    sum_h = [0.0, 10.0, 20.0]
    dpo_mean = compute_loss(["dpo"], None, {"beta": 0.1, "average_log_prob": True}, **inputs)
    close(dpo_mean.losses, [neg_log_sigmoid(0.1 * h) for h in mean_h])
    ipo_default = compute_loss(["ipo"], None, {"beta": 0.5, "average_log_prob": None}, **inputs)
    close(ipo_default.losses, [(h - 1.0) ** 2 for h in mean_h])
    ipo_sum = compute_loss(["ipo"], None, {"beta": 0.5, "average_log_prob": False}, **inputs)
    close(ipo_sum.losses, [(h - 1.0) ** 2 for h in sum_h])
    assert LOSSES["dpo"].average_log_prob is False and LOSSES["ipo"].average_log_prob is True


def test_dispatcher_weighted_sum_equals_hand_sum():
    """names [dpo, sft], weights [1, 0.5]: dpo [ln 2, 0.3133, 0.1269] + 0.5 * sft nll [5, 3, 2]
    (sft's default is the per-token mean). Rewards come from dpo, the first loss with rewards."""
    out = compute_loss(["sft", "dpo"], [0.5, 1.0], {"beta": 0.1}, **pair_inputs())
    close(out.losses, [neg_log_sigmoid(z) + 0.5 * nll for z, nll in zip((0.0, 1.0, 2.0), (5.0, 3.0, 2.0))])
    close(out.chosen_rewards, [0.0, 0.5, 1.0])


def test_dispatcher_reference_free_equals_zero_reference():
    inputs = pair_inputs()
    free = compute_loss(["dpo"], None, {"beta": 0.1, "reference_free": True}, **inputs)
    zeros = compute_loss(
        ["dpo"],
        None,
        {"beta": 0.1},
        **dict(
            inputs,
            reference_chosen_sum=torch.zeros(3, dtype=torch.float64),
            reference_rejected_sum=torch.zeros(3, dtype=torch.float64),
        ),
    )
    for key in zeros.metrics:
        torch.testing.assert_close(free.metrics[key], zeros.metrics[key])
    # and no reference log-probs are needed at all when reference_free
    no_ref = compute_loss(
        ["dpo"],
        None,
        {"beta": 0.1, "reference_free": True},
        **dict(inputs, reference_chosen_sum=None, reference_rejected_sum=None),
    )
    torch.testing.assert_close(no_ref.losses, zeros.losses)
    # h = (pc - pr) = [5, 15, 25] -> loss -log sigma(0.1 h)
    close(free.losses, [neg_log_sigmoid(0.1 * (c - r)) for c, r in zip(POLICY_CHOSEN, POLICY_REJECTED)])


def test_dispatcher_sft_only_without_rejected():
    """sft-only: nll = -sum/len = [5, 3, 2] is the loss; only three metrics; no rewards."""
    out = compute_loss(["sft"], None, {}, t(POLICY_CHOSEN), torch.tensor([2, 5, 10]))
    close(out.losses, [5.0, 3.0, 2.0])
    assert out.chosen_rewards is None and out.rejected_rewards is None
    assert set(out.metrics) == {"logps/chosen", "nll/chosen", "loss"}


def test_dispatcher_errors():
    with pytest.raises(KeyError, match=r"unknown loss name 'dpoo'.*'dpo'.*'sft'"):
        compute_loss(["dpoo"], None, {"beta": 0.1}, **pair_inputs())
    with pytest.raises(TypeError, match="needs hyperparameter 'gamma'"):
        compute_loss(["simpo"], None, {"beta": 2.0, "gamma": None}, **pair_inputs())
    with pytest.raises(ValueError, match="rejected"):
        compute_loss(["dpo"], None, {"beta": 0.1}, t(POLICY_CHOSEN), torch.tensor([2, 5, 10]))
    with pytest.raises(ValueError, match="reference"):
        compute_loss(["dpo"], None, {"beta": 0.1}, **dict(pair_inputs(), reference_chosen_sum=None))


def test_dispatcher_passes_only_declared_hyperparameters():
    """Every config key in hparams, plus unknown extras, is fine: each fn gets only its own."""
    hparams = dict(
        ALL_HPARAMS, name="simpo", weights=None, reference_free=False, average_log_prob=None, something_else=1
    )
    out = compute_loss("simpo", None, hparams, **pair_inputs())
    assert out.losses.shape == (3,)


def test_needs_reference():
    assert needs_reference(["dpo"], reference_free=False)
    assert not needs_reference(["dpo"], reference_free=True)
    assert not needs_reference(["simpo", "sft"], reference_free=False)
    assert needs_reference(["sft", "dpo"], reference_free=False)
    with pytest.raises(KeyError, match="valid"):
        needs_reference(["nope"], reference_free=False)


def test_sequence_logps_sum_or_mean():
    """sums [-6, -3] over [3, 0] tokens: sum -> [-6, -3]; mean -> [-2, -3] (0 tokens counts as 1)."""
    sums, lengths = t([-6.0, -3.0]), torch.tensor([3, 0])
    close(sequence_logps(sums, lengths, average_log_prob=False), [-6.0, -3.0])
    close(sequence_logps(sums, lengths, average_log_prob=True), [-2.0, -3.0])


# ---------------------------------------------------------------------------------------------
# config/loss/*.yaml
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_every_loss_has_a_commented_config(name):
    path = CONFIG_DIR / f"{name}.yaml"
    assert path.exists(), f"missing {path}"
    config = yaml.safe_load(path.read_text())
    assert config["name"] == name
    assert set(config) <= CONFIG_KEYS, set(config) - CONFIG_KEYS
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith(("#", "name:")):
            assert "#" in line, f"{path.name}: uncommented line {line!r}"
    # every hyperparameter the loss requires has a value in its config
    for param, required in losses._hyperparameters(LOSSES[name].fn):
        if required and param != "chosen_nll":
            assert param in config, f"{path.name} lacks {param}"
    hparams = dict(ALL_HPARAMS, **{k: v for k, v in config.items() if k != "name"})
    out = compute_loss(name, config.get("weights"), hparams, **pair_inputs(), kl=KL)
    assert torch.isfinite(out.losses).all()


def test_every_config_names_registered_losses():
    for path in CONFIG_DIR.glob("*.yaml"):
        config = yaml.safe_load(path.read_text())
        assert set(config) <= CONFIG_KEYS, (path.name, set(config) - CONFIG_KEYS)
        names = config["name"] if isinstance(config["name"], list) else [config["name"]]
        assert all(n in LOSSES for n in names), path.name
        if "weights" in config:
            assert len(config["weights"]) == len(names), path.name


# ---------------------------------------------------------------------------------------------
# Modifiers of the paired losses (compute_loss): DPOP, LD-DPO, WPO
# ---------------------------------------------------------------------------------------------
def pairs_loss(hparams, policy_chosen, policy_rejected, reference_chosen, reference_rejected, lengths=(1, 1), **kwargs):
    ones = torch.ones(len(policy_chosen), dtype=torch.float64)
    return compute_loss(
        ["dpo"],
        None,
        dict(LossConfig(), **hparams),
        t(policy_chosen),
        ones * lengths[0],
        t(policy_rejected),
        ones * lengths[1],
        t(reference_chosen),
        t(reference_rejected),
        **kwargs,
    )


def test_dpop_hand_worked():
    """pi_c [-10, -20], pi_r [-15, -18], ref_c [-12, -15], ref_r [-14, -19]: a = [2, -5], b = [-1, 1]; beta 0.1,
    lambda 2: the penalty max(0, ref_c - pi_c) = [0, 5] enters the logit, beta (a - b - 2 [0, 5]) = [0.3, -1.6]."""
    out = pairs_loss(dict(beta=0.1, dpop_lambda=2.0), [-10, -20], [-15, -18], [-12, -15], [-14, -19])
    close(out.losses, [neg_log_sigmoid(0.3), neg_log_sigmoid(-1.6)])
    plain = pairs_loss(dict(beta=0.1), [-10, -20], [-15, -18], [-12, -15], [-14, -19])
    close(plain.losses, [neg_log_sigmoid(0.3), neg_log_sigmoid(-0.6)])  # pair 0, above its reference: unchanged
    close(out.metrics["rewards/chosen"], [0.2, -0.5])  # logged without the penalty: beta a


def ld_batch():
    """2 pairs, one prompt column, then responses: chosen 0 [-1, -2, -3], rejected 0 [-1, -1]; chosen 1 [-2],
    rejected 1 [-1, -4, -2]. Public lengths 2 and 1."""
    tokens = torch.zeros(4, 5, dtype=torch.float64)
    for row, values in enumerate(([-1, -2, -3], [-2], [-1, -1], [-1, -4, -2])):
        tokens[row, 1 : 1 + len(values)] = t(values)
    scored = tokens != 0
    return tokens, scored


def test_ld_dpo_hand_worked():
    """alpha 0.5: chosen 0 = -1 - 2 + 0.5 (-3) = -4.5, rejected 0 = -2; chosen 1 = -2, rejected 1 = -1 + 0.5 (-6) = -4.
    Reference tokens all 0, beta 0.1: logits 0.1 [-4.5 + 2, -2 + 4] = [-0.25, 0.2]."""
    tokens, scored = ld_batch()
    close(modifiers.length_desensitized_logps(tokens, scored, 0.5), [-4.5, -2, -2, -4])
    sums = tokens.sum(1)
    out = pairs_loss(
        dict(beta=0.1, ld_alpha=0.5),
        sums[:2].tolist(),
        sums[2:].tolist(),
        [0, 0],
        [0, 0],
        policy_tokens=tokens,
        reference_tokens=torch.zeros_like(tokens),
        scored=scored,
    )
    close(out.losses, [neg_log_sigmoid(-0.25), neg_log_sigmoid(0.2)])
    close(out.metrics["logps/chosen"], sums[:2].tolist())  # logged: the plain sums


def test_wpo_hand_worked():
    """chosen sums [-2, -4] over [2, 4] tokens with summed log sum p^2 [-1, -2]: means (-2 + 1) / 2 = -0.5 and
    (-4 + 2) / 4 = -0.5; rejected [-3, -1] over [3, 1] with [-3, -0.5]: means 0 and -0.5. Weights exp(-0.5) and
    exp(-1), each multiplying its pair's DPO loss; one pair above 1 is clamped to 1."""
    w = modifiers.wpo_weights(t([-2, -4]), t([-3, -1]), t([-1, -2]), t([-3, -0.5]), t([2, 4]), t([3, 1]))
    close(w, [math.exp(-0.5), math.exp(-1)])
    close(modifiers.wpo_weights(t([-1]), t([-1]), t([-2]), t([-2]), t([1]), t([1])), [1.0])  # exp(2), clamped
    ones = torch.ones(2, dtype=torch.float64)
    out = compute_loss(
        ["dpo"],
        None,
        dict(LossConfig(), beta=0.1, wpo=True),
        t([-2, -4]),
        ones * t([2, 4]),
        t([-3, -1]),
        ones * t([3, 1]),
        t([-2, -5]),
        t([-2, -1]),
        policy_sum_sq=t([-1, -2, -3, -0.5]),
    )
    close(out.losses, [math.exp(-0.5) * neg_log_sigmoid(0.1 * (0 + 1)), math.exp(-1) * neg_log_sigmoid(0.1 * (1 - 0))])
    close(out.metrics["wpo/weights"], [math.exp(-0.5), math.exp(-1)])


def test_modifiers_equal_an_independent_per_token_implementation():
    """Random per-token log-probs and log sum p^2 of 3 pairs (responses of 1-7 tokens after 0-3 prompt columns):
    LD-DPO's sums written as the paper's two sums in a loop, WPO's weights as TRL computes them from per-token
    values (the mean of logp - log sum p^2 over each response), DPOP's logit as the paper writes it; compute_loss
    with all three at once equals -log sigmoid(beta (a - b - lambda max(0, -a))) times the weight."""
    g = torch.Generator().manual_seed(0)
    n, width, alpha, lam, beta = 3, 12, 0.3, 5.0, 0.1
    tokens, ref_tokens, sq = (-torch.rand(2 * n, width, generator=g, dtype=torch.float64) * 3 for _ in range(3))
    scored = torch.zeros(2 * n, width, dtype=torch.bool)
    for row in range(2 * n):
        start, length = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(1, 8, (1,), generator=g))
        scored[row, start : start + length] = True
    tokens, ref_tokens, sq = tokens * scored, ref_tokens * scored, sq * scored
    lengths = scored.sum(1).double()

    def ld(values, row):  # sum_{i <= l_p} + alpha sum_{i > l_p}, l_p the pair's shorter response
        public = min(int(lengths[row % n]), int(lengths[row % n + n]))
        picked = values[row][scored[row]].tolist()
        return sum(picked[:public]) + alpha * sum(picked[public:])

    pol = [ld(tokens, r) for r in range(2 * n)]
    ref = [ld(ref_tokens, r) for r in range(2 * n)]
    mean = [((tokens[r] - sq[r]) * scored[r]).sum().item() / lengths[r].item() for r in range(2 * n)]
    expected = []
    for i in range(n):
        a, b = pol[i] - ref[i], pol[n + i] - ref[n + i]
        weight = min(1.0, math.exp(mean[i] + mean[n + i]))
        expected.append(weight * neg_log_sigmoid(beta * (a - b - lam * max(0.0, -a))))
    sums, ref_sums = tokens.sum(1), ref_tokens.sum(1)
    out = compute_loss(
        ["dpo"],
        None,
        dict(LossConfig(), beta=beta, ld_alpha=alpha, dpop_lambda=lam, wpo=True),
        sums[:n],
        lengths[:n],
        sums[n:],
        lengths[n:],
        ref_sums[:n],
        ref_sums[n:],
        policy_tokens=tokens,
        reference_tokens=ref_tokens,
        scored=scored,
        policy_sum_sq=sq.sum(1),
    )
    close(out.losses, expected, atol=1e-9)


def test_modifiers_at_their_defaults_change_nothing():
    """ld_alpha 1, dpop_lambda 0, wpo false (the defaults) give the bit-identical loss of a config without them, for
    every paired loss, even with the per-token inputs given."""
    tokens, scored = ld_batch()
    sums = tokens.sum(1)
    for name, spec in LOSSES.items():
        if spec.unpaired:
            continue
        args = (
            sums[:2],
            torch.tensor([3.0, 1.0], dtype=torch.float64),
            sums[2:],
            torch.tensor([2.0, 3.0], dtype=torch.float64),
            sums[:2] - 1,
            sums[2:] + 1,
        )
        without = {k: v for k, v in ALL_HPARAMS.items() if k not in ("wpo", "ld_alpha", "dpop_lambda")}
        plain = compute_loss([name], None, without, *args)
        defaults = compute_loss(
            [name],
            None,
            ALL_HPARAMS,
            *args,
            policy_tokens=tokens,
            reference_tokens=tokens,
            scored=scored,
            policy_sum_sq=sums,
        )
        assert torch.equal(plain.losses, defaults.losses), name


def test_beta_dpo_hand_worked():
    """Margins M = [1, 3], beta 0.1, alpha 0.5. First batch: M_0 = mean 2, sigma = std 1.4142 (unbiased), beta_batch
    = 0.1 (1 + 0.5 (2 - 2)) = 0.1. With running (1, 1): M_0 = 0.9 + 0.2 = 1.1, sigma = 0.9 + 0.1 x 1.4142, beta_batch
    = 0.1 (1 + 0.5 (2 - 1.1)) = 0.145; DPO on h = [1, 3] with it. Filtering half: one pair kept, drawn with weights
    exp(-(M - 1.1)^2 / 2 sigma^2) = [0.9954, 0.1893]: pair 0 with probability 0.840; beta_batch from the kept margin
    alone, and compute_loss's mean is the kept pair's loss."""
    margins = t([1.0, 3.0])
    beta, keep, running = modifiers.beta_dpo(margins, 0.1, 0.5, None)
    assert beta == pytest.approx(0.1) and keep.all() and running == pytest.approx((2.0, math.sqrt(2)))
    beta, keep, running = modifiers.beta_dpo(margins, 0.1, 0.5, (1.0, 1.0))
    assert beta == pytest.approx(0.145) and running == pytest.approx((1.1, 0.9 + 0.1 * math.sqrt(2)))
    beta_dpo = modifiers.BetaDPO()
    beta_dpo.load_state_dict({"beta_dpo_running": (1.0, 1.0)})
    out = pairs_loss(dict(beta=0.1, dynamic_beta=0.5), [1, 3], [0, 0], [0, 0], [0, 0], beta_dpo=beta_dpo, step=0)
    close(out.losses, [neg_log_sigmoid(0.145), neg_log_sigmoid(0.435)])
    close(out.metrics["beta_dpo/beta"], [0.145, 0.145])
    assert beta_dpo.state_dict()["beta_dpo_running"] == pytest.approx(running)  # a training step moved them
    sigma = 0.9 + 0.1 * math.sqrt(2)
    density = [math.exp(-0.5 * ((m - 1.1) / sigma) ** 2) for m in (1.0, 3.0)]
    draws = [
        modifiers.beta_dpo(margins, 0.1, 0.5, (1.0, 1.0), 0.5, torch.Generator().manual_seed(s)) for s in range(2000)
    ]
    first = sum(bool(k[0]) for _, k, _ in draws) / len(draws)
    assert all(int(k.sum()) == 1 for _, k, _ in draws)
    assert first == pytest.approx(density[0] / sum(density), abs=0.03)  # 0.840
    for b, k, _ in draws[:5]:
        assert b == pytest.approx(0.1 * (1 + 0.5 * ((1.0 if k[0] else 3.0) - 1.1)))
    kept = lambda margins, hp, step: (0.1, torch.tensor([True, False]))  # noqa: E731 - the filter kept pair 0
    out = pairs_loss(dict(beta=0.1, dynamic_beta=0.5), [1, 3], [0, 0], [0, 0], [0, 0], beta_dpo=kept)
    close(out.losses, [2 * neg_log_sigmoid(0.1), 0.0])  # its mean: pair 0's loss
    close(out.metrics["beta_dpo/kept"], [1.0, 0.0])


def test_beta_dpo_state_moves_in_training_only_and_its_filter_repeats_for_a_step():
    """BetaDPO (the trainer's one instance): an evaluation batch (step None) reads the running statistics and
    filters nothing; a training step moves them, and its filter's draw depends only on (seed, step), so a resumed
    run (load_state_dict of the saved state_dict) redraws it exactly. Margins [1, 3, 5, 7], filter 0.5."""
    hp = SimpleNamespace(beta=0.1, dynamic_beta=0.5, dynamic_beta_filter=0.5)
    margins, beta_dpo = t([1.0, 3.0, 5.0, 7.0]), modifiers.BetaDPO(seed=3)
    beta_dpo.load_state_dict({"beta_dpo_running": (2.0, 1.0)})
    _, keep = beta_dpo(margins, hp, None)
    assert keep.all() and beta_dpo.running == (2.0, 1.0)
    _, keep = beta_dpo(margins, hp, 7)
    assert int(keep.sum()) == 2 and beta_dpo.running != (2.0, 1.0)
    resumed = modifiers.BetaDPO(seed=3)
    resumed.load_state_dict({"beta_dpo_running": (2.0, 1.0)})
    assert torch.equal(resumed(margins, hp, 7)[1], keep) and resumed.state_dict() == beta_dpo.state_dict()
    assert modifiers.BetaDPO().state_dict() == {"beta_dpo_running": None}  # the checkpoint's key, None before a step


def test_modifiers_reach_only_losses_with_a_reference_and_rewards_keep_their_meaning():
    """DPOP's penalty and LD-DPO's weighting change the log-ratios of losses that compare with a reference, not the
    SFT term: [dpo, sft] weighted [0, 1] is the plain per-token NLL. The logged rewards are beta a and beta b: DPOP's penalty and beta-DPO's beta_batch stay out."""
    tokens, scored = ld_batch()
    sums, lengths = tokens.sum(1), scored.sum(1).double()
    mods = dict(ld_alpha=0.5, dpop_lambda=2.0)
    args = (sums[:2], lengths[:2], sums[2:], lengths[2:], sums[:2] + 0.5, sums[2:] - 0.5)
    extra = dict(policy_tokens=tokens, reference_tokens=tokens + 0.1 * scored, scored=scored)
    sft_only = compute_loss(["dpo", "sft"], [0.0, 1.0], dict(LossConfig(), **mods), *args, **extra)
    close(sft_only.losses, (-sums[:2] / lengths[:2]).tolist())
    beta_batch = lambda margins, hp, step: (0.3, torch.ones(2, dtype=torch.bool))  # noqa: E731 - beta-DPO's beta 0.3
    hparams = dict(beta=0.1, dpop_lambda=2.0, dynamic_beta=0.5)
    out = pairs_loss(hparams, [-10, -20], [-15, -18], [-12, -15], [-14, -19], beta_dpo=beta_batch)
    close(out.metrics["rewards/chosen"], [0.2, -0.5])  # 0.1 a, a = [2, -5]: no penalty, the configured beta
    close(out.losses, [neg_log_sigmoid(0.3 * 3), neg_log_sigmoid(0.3 * -16)])  # beta_batch and the penalty in the loss


def test_beta_dpo_skips_non_finite_margins():
    """A batch with a NaN margin (its step will be skipped) leaves the running statistics as they were and gets the
    configured beta; the next finite batch continues from them."""
    beta, keep, running = modifiers.beta_dpo(
        t([1.0, float("nan")]), 0.1, 0.5, (1.0, 1.0), 0.5, torch.Generator().manual_seed(0)
    )
    assert beta == 0.1 and keep.all() and running == (1.0, 1.0)
    assert modifiers.beta_dpo(t([1.0, float("nan")]), 0.1, 0.5, None)[2] is None
