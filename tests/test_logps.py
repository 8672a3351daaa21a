"""logps.py, the plain path: log_softmax of the model's own logits and the label's entry, shifted by one and masked,
against arithmetic by hand and fp64 (values and gradients, fp32 and bf16 logits); its detached statistics (entropy,
log sum p^2); its padded rows on real architectures. The seams are tested beside their files (tests/test_tiled_head.py,
tests/test_entropy_bonus.py; the layouts in tests/test_trainers.py, tests/test_architectures.py, tests/test_ulysses.py).
"""

import math
import re
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import architectures
import logps

ATOL = 1e-6


def given_logits(logits: torch.Tensor):
    """forward_logps' `call`: a model whose forward returns `logits` (B, T, V), whatever its inputs."""
    return lambda **kwargs: SimpleNamespace(logits=logits)


def rows_of(labels: torch.Tensor, mask: torch.Tensor | None = None) -> dict:
    """forward_logps' inputs for given logits: the ids are never read (the call ignores them)."""
    mask = torch.ones_like(labels) if mask is None else mask
    return {"input_ids": torch.zeros_like(labels), "attention_mask": mask, "labels": labels}


def plain_logps(logits, labels, dtype=torch.float64):
    """The reference: full log_softmax in `dtype`, gathered, at the label's own column (output t predicts token t+1),
    0 where unscored. Shapes (B, T, V), (B, T) -> (B, T)."""
    targets = labels[:, 1:]
    picked = logits[:, :-1].to(dtype).log_softmax(-1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    return F.pad(picked * (targets != -100), (1, 0))


def random_batch(vocab, dtype=torch.float32, batch=2, seq=5, seed=0, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    logits = (scale * torch.randn(batch, seq, vocab, generator=gen)).to(dtype)
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels[0, :2] = -100  # a prompt
    labels[1, -1] = -100  # padding
    return logits, labels


def test_plain_path_shifts_and_masks_by_hand():
    """Vocab 3. Row 0: labels [-100, 2, 1, -100]; outputs 0 and 1 predict tokens 1 (label 2) and 2 (label 1), output 2
    predicts an unscored token, output 3 nothing. Output 0 is uniform (log 1/3, entropy ln 3, log sum p^2 = -ln 3),
    output 1 puts p = 2/4 on token 1 (log 1/2, entropy 1.5 ln 2, log sum p^2 = ln 3/8). Row 1 is right-padded after 2
    tokens, its one labelled token predicted by a uniform output 0: log 1/3. The label's log-prob sits at its own
    column; unscored columns hold 0."""
    logits = torch.zeros(2, 4, 3)
    logits[0, 1, 1] = math.log(2.0)
    labels = torch.tensor([[-100, 2, 1, -100], [-100, 0, -100, -100]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    out = logps.forward_logps(None, rows_of(labels, mask), given_logits(logits), per_token=True, sum_sq=True)
    third, half = math.log(1 / 3), math.log(1 / 2)
    assert out.counts.tolist() == [2, 1]
    torch.testing.assert_close(out.sums, torch.tensor([third + half, third]), atol=ATOL, rtol=0)
    torch.testing.assert_close(out.tokens, torch.tensor([[0, third, half, 0], [0, third, 0, 0]]), atol=ATOL, rtol=0)
    entropy = torch.tensor([(math.log(3) + 1.5 * math.log(2)) / 2, math.log(3)])
    torch.testing.assert_close(out.entropy, entropy, atol=ATOL, rtol=0)
    torch.testing.assert_close(out.log_sum_sq, torch.tensor([math.log(1 / 8), -math.log(3)]), atol=ATOL, rtol=0)
    assert out.routing is None


def test_logits_not_shaped_as_the_rows_are_refused_naming_both_shapes():
    """A model whose logits do not have one row of vocabulary per input position (a vision model that prepends image
    tokens, a head that drops the last position) would score the wrong tokens: a ValueError naming both shapes
    (before: torch's IndexError from the mask, naming neither the logits nor the rows)."""
    labels = torch.tensor([[-100, 2, 1, 0]])
    for shape in ((1, 3, 3), (1, 5, 3), (2, 4, 3)):
        with pytest.raises(ValueError, match=re.escape(f"logits are {shape} for targets (1, 4)")):
            logps.forward_logps(None, rows_of(labels), given_logits(torch.zeros(shape)))


@pytest.mark.parametrize("vocab", [7, 50257])
def test_plain_logps_and_grad_match_fp64(vocab):
    """fp32 logits: the log-probs within 1e-6 of log_softmax evaluated in fp64 on the same logits (at vocab 50257 they
    lie in [-16, -8], where fp32 values are 9.5e-7 apart: only an fp64 reference can check 1e-6), and the gradient of
    the logits within 1e-6 of fp64's."""
    logits, labels = random_batch(vocab, scale=1.0)
    weights = torch.randn(2, 5, generator=torch.Generator().manual_seed(1))
    ours_in, exact_in = logits.clone().requires_grad_(), logits.double().requires_grad_()
    ours = logps.forward_logps(None, rows_of(labels), given_logits(ours_in), per_token=True).tokens
    exact = plain_logps(exact_in, labels)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, exact.float(), atol=1e-6, rtol=0)
    (ours * weights).sum().backward()
    (exact * weights.double()).sum().backward()
    assert ours_in.grad.dtype == torch.float32
    torch.testing.assert_close(ours_in.grad, exact_in.grad.float(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("vocab", [7, 50257])
def test_plain_logps_of_bf16_logits_in_fp32(vocab):
    """bf16 logits: the log-probs are computed in fp32 from the bf16 values, so they match the plain formula on those
    values (in fp64) to fp32 precision, 1e-5 at |log p| up to ~25, and are within bf16 rounding of a log_softmax done
    in bf16. The gradient comes back in bf16, within bf16 rounding of the exact one."""
    logits, labels = random_batch(vocab, dtype=torch.bfloat16)
    ours_in, exact_in = logits.clone().requires_grad_(), logits.double().requires_grad_()
    ours = logps.forward_logps(None, rows_of(labels), given_logits(ours_in), per_token=True).tokens
    assert ours.dtype == torch.float32
    exact = plain_logps(exact_in, labels)
    torch.testing.assert_close(ours, exact.float(), atol=1e-5, rtol=0)
    torch.testing.assert_close(ours, plain_logps(logits, labels, torch.bfloat16).float(), atol=2**-7, rtol=2**-7)
    ours.sum().backward()
    exact.sum().backward()
    assert ours_in.grad.dtype == torch.bfloat16
    torch.testing.assert_close(ours_in.grad.float(), exact_in.grad.float(), atol=1e-3, rtol=2**-7)


def test_gradient_at_unscored_positions_is_exactly_zero():
    """Only the scored positions' logits reach log_softmax: every other position (a prompt, padding, the last one,
    which predicts nothing) gets a gradient of exactly 0; every scored one a nonzero gradient."""
    logits, labels = random_batch(50257)
    logits.requires_grad_()
    out = logps.forward_logps(None, rows_of(labels), given_logits(logits), per_token=True)
    (out.tokens * torch.randn_like(out.tokens)).sum().backward()
    scored = F.pad(labels[:, 1:] != -100, (0, 1))  # output t scores label t+1; the last output: nothing
    assert scored.sum() == out.counts.sum() == 6
    assert (logits.grad[~scored] == 0).all()
    assert (logits.grad[scored] != 0).any(dim=-1).all()


def test_entropy_and_log_sum_sq_by_hand_and_against_fp64():
    """logps.entropy: uniform logits over vocab 4 have entropy ln 4, a row made certain ~0; at vocab 50257 it is
    within 1e-6 of -sum p log p in fp64 (the textbook formula in fp32 is itself ~2e-5 off there). logps.log_sum_sq:
    uniform over 4 gives log(4 / 16) = -ln 4; at vocab 50257 within 1e-5 of fp64's (logsumexp(2 x) - 2 logsumexp(x):
    two terms near 24 that cancel to near -4, where fp32 keeps about 2e-6)."""
    logits = torch.zeros(3, 4)
    logits[1] = torch.tensor([100.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(logps.entropy(logits), torch.tensor([math.log(4), 0.0, math.log(4)]), atol=ATOL, rtol=0)
    torch.testing.assert_close(logps.log_sum_sq(logits)[0], torch.tensor(-math.log(4)), atol=ATOL, rtol=0)
    big, _ = random_batch(50257)
    exact = big.double().log_softmax(-1)
    assert logps.entropy(big).dtype == torch.float32 and logps.entropy(big.double()).dtype == torch.float64
    torch.testing.assert_close(logps.entropy(big), -(exact.exp() * exact).sum(-1).float(), atol=1e-6, rtol=0)
    torch.testing.assert_close(logps.log_sum_sq(big), torch.logsumexp(2 * exact, -1).float(), atol=1e-5, rtol=0)


def test_sums_entropy_and_sum_sq_equal_the_models_own_logits():
    """forward_logps on a real tiny Llama: per-sequence sums, counts, mean entropy and summed log sum p^2 equal the
    plain computation from the model's own logits (1e-5); the entropy and log sum p^2 are statistics, detached (the
    entropy bonus, tests/test_entropy_bonus.py, differentiates the entropy); sums differentiable."""
    cls, kwargs, _ = architectures.ARCHITECTURES["llama"]
    torch.manual_seed(0)
    model = architectures.transformers.AutoModelForCausalLM.from_config(cls(**{**architectures.COMMON, **kwargs}))
    inputs = architectures.padded_batch(architectures.VOCAB)
    expected = {k: v.detach() for k, v in architectures.own_statistics(model, inputs).items()}
    out = logps.forward_logps(model, inputs, sum_sq=True)
    assert out.counts.tolist() == expected["counts"].long().tolist()
    for name in ("sums", "entropy", "log_sum_sq"):
        torch.testing.assert_close(getattr(out, name), expected[name], rtol=1e-5, atol=1e-5, msg=name)
    assert out.sums.requires_grad and not out.entropy.requires_grad and not out.log_sum_sq.requires_grad
    assert out.tokens is None and logps.forward_logps(model, inputs).log_sum_sq is None  # nothing kept unless asked


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neox", "llama", "qwen2", "gemma2", "mistral", "mistral-window"])
def test_padded_rows_reach_the_model_without_a_mask(arch):
    """Right-padded rows go to the model with no attention mask (its own causal mask: sdpa's causal kernel, not a
    (R, 1, T, T) bias; before: the 2-D padding mask); the labelled tokens' log-probs are those of each row scored
    alone (1e-5), for every family of tests/architectures.py, Gemma2 eager with its sliding window and softcap,
    Mistral also with a window (8) shorter than the rows."""
    cls, kwargs, _ = architectures.ARCHITECTURES[arch.split("-")[0]]
    kwargs = {**architectures.COMMON, **kwargs, **({"sliding_window": 8} if arch == "mistral-window" else {})}
    torch.manual_seed(0)
    model = architectures.transformers.AutoModelForCausalLM.from_config(cls(**kwargs)).eval()
    inputs, seen, attention = architectures.padded_batch(architectures.VOCAB), [], []
    model.register_forward_pre_hook(lambda _, args, kw: seen.append(kw.get("attention_mask")), with_kwargs=True)
    sdpa = F.scaled_dot_product_attention
    spy = lambda *a, **k: attention.append((k.get("attn_mask"), k.get("is_causal"))) or sdpa(*a, **k)  # noqa: E731
    with torch.no_grad(), mock.patch.object(F, "scaled_dot_product_attention", spy):
        out = logps.forward_logps(model, inputs, per_token=True)
        seen_by_padded, seen[:], attention_of_padded = seen[0], [], attention[:]
        expected = architectures.own_token_logps(model, inputs)
    assert seen_by_padded is None
    if model.config._attn_implementation == "sdpa" and arch != "mistral-window":
        assert attention_of_padded and all(m is None and causal for m, causal in attention_of_padded), arch
    torch.testing.assert_close(out.tokens, expected, rtol=1e-5, atol=1e-5)
