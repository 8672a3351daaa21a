"""entropy_bonus.py: the differentiable entropy of loss.entropy_coeff > 0 (entropy_from_logits: chunked, checkpointed,
compiled) against the plain formula in fp64, values and gradients; the compile fallback; and its `head` seam on a real
tiny model: the plain log-probs, an entropy whose gradient is the plain entropy's, detached again in evaluation."""

import math
import os
import shutil
import warnings
from types import SimpleNamespace

import pytest
import torch

import architectures
import entropy_bonus
import logps
from entropy_bonus import entropy_from_logits


def random_logits(vocab, seq=6, seed=0):
    """(2, seq, vocab) fp32 logits ~ N(0, 9)."""
    return 3.0 * torch.randn(2, seq, vocab, generator=torch.Generator().manual_seed(seed))


def plain_entropy(logits, dtype=torch.float32):
    """-sum softmax * log_softmax, in `dtype`."""
    logits = logits.to(dtype)
    return -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)


@pytest.mark.parametrize("chunking,checkpointing", [(False, False), (True, False), (False, True), (True, True)])
def test_entropy_matches_plain_formula(chunking, checkpointing):
    """Vocab 50257, chunks of 5 rows (12 rows: 5 + 5 + 2). The plain formula is evaluated in fp64:
    in fp32 it is itself ~2e-5 off here (logps.entropy says why); ours is within 1e-6."""
    logits = random_logits(50257)
    ours_in = logits.clone().requires_grad_()
    plain_in = logits.double().requires_grad_()
    ours = entropy_from_logits(ours_in, chunking=chunking, checkpointing=checkpointing, chunk_size=5)
    plain = plain_entropy(plain_in, dtype=torch.float64)
    assert ours.shape == (2, 6) and ours.dtype == torch.float32
    torch.testing.assert_close(ours, plain.float(), atol=1e-6, rtol=0)
    weights = torch.randn(2, 6, generator=torch.Generator().manual_seed(2))
    (ours * weights).sum().backward()
    (plain * weights.double()).sum().backward()
    torch.testing.assert_close(ours_in.grad, plain_in.grad.float(), atol=1e-6, rtol=0)


def test_entropy_by_hand():
    """Uniform logits over vocab 4 have entropy ln 4; a row made certain has entropy ~0."""
    logits = torch.zeros(1, 4, 4)
    logits[0, 1] = torch.tensor([100.0, 0.0, 0.0, 0.0])
    out = entropy_from_logits(logits, chunking=True, chunk_size=3)
    torch.testing.assert_close(out, torch.tensor([[math.log(4), 0.0, math.log(4), math.log(4)]]), atol=1e-6, rtol=0)


def test_compile_falls_back_with_warning_when_unavailable(monkeypatch):
    def broken_compile(*args, **kwargs):
        raise RuntimeError("no compiler in this test")

    monkeypatch.setattr(torch, "compile", broken_compile)
    wrapper = entropy_bonus._CompileOnFirstCall(logps.entropy)
    x = torch.randn(3, 7)
    with pytest.warns(RuntimeWarning, match="torch.compile is unavailable"):
        out = wrapper(x)
    torch.testing.assert_close(out, plain_entropy(x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wrapper(x)  # warns once only


@pytest.mark.skipif(
    os.environ.get("RUN_SLOW") != "1" or shutil.which(os.environ.get("CXX", "g++")) is None,
    reason="torch.compile on CPU builds C++ kernels (~30 s cold on 2 cores); set RUN_SLOW=1 "
    "(needs a C++ compiler) to run it",
)
def test_entropy_with_torch_compile_on_cpu():
    logits = random_logits(97)
    ours_in = logits.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a fallback would be a failure here
        ours = entropy_from_logits(ours_in, chunking=True, checkpointing=True, use_compile=True, chunk_size=5)
    assert entropy_bonus._COMPILED_ENTROPY.impl is not logps.entropy
    plain_in = logits.double().requires_grad_()
    plain = plain_entropy(plain_in, dtype=torch.float64)
    torch.testing.assert_close(ours, plain.float(), atol=1e-6, rtol=0)
    ours.sum().backward()
    plain.sum().backward()
    torch.testing.assert_close(ours_in.grad, plain_in.grad.float(), atol=1e-6, rtol=0)


def test_head_options_follow_the_fsdp_config_and_compile_by_default_only_on_cuda():
    """fsdp.entropy_from_logits_with_chunking, fsdp.entropy_checkpointing and fsdp.use_torch_compile become the
    entropy's options; use_torch_compile null compiles on CUDA only, a value set is honoured on any device."""
    fsdp = SimpleNamespace(entropy_from_logits_with_chunking=True, entropy_checkpointing=False, use_torch_compile=None)
    assert entropy_bonus.Head(fsdp, torch.device("cpu")).options == dict(
        chunking=True, checkpointing=False, use_compile=False
    )
    assert entropy_bonus.Head(fsdp, torch.device("cuda", 0)).options["use_compile"] is True
    for value in (True, False):
        for device in ("cpu", "cuda"):
            fsdp.use_torch_compile = value
            assert entropy_bonus.Head(fsdp, torch.device(device)).options["use_compile"] is value


@pytest.mark.parametrize("chunking,checkpointing", [(False, False), (True, True)])
def test_head_gives_the_plain_log_probs_and_a_differentiable_entropy(chunking, checkpointing):
    """forward_logps with the bonus's head on a real tiny Llama: per-sequence sums, counts, mean entropy and summed
    log sum p^2 equal the plain computation from the model's own logits (1e-5); the entropy is differentiable and its
    gradient (here on the LM head's weight) is that of the plain entropy, chunked and checkpointed or not; the
    statistic log sum p^2 stays detached. Under torch.no_grad (evaluation) the head is the plain one: nothing to
    differentiate, the same values."""
    cls, kwargs, _ = architectures.ARCHITECTURES["llama"]
    torch.manual_seed(0)
    model = architectures.transformers.AutoModelForCausalLM.from_config(cls(**{**architectures.COMMON, **kwargs}))
    inputs = architectures.padded_batch(architectures.VOCAB)
    expected = architectures.own_statistics(model, inputs)
    fsdp = SimpleNamespace(
        entropy_from_logits_with_chunking=chunking, entropy_checkpointing=checkpointing, use_torch_compile=False
    )
    head = entropy_bonus.Head(fsdp, torch.device("cpu"))
    out = logps.forward_logps(model, inputs, head=head, sum_sq=True)
    assert out.counts.tolist() == expected["counts"].long().tolist()
    for name in ("sums", "entropy", "log_sum_sq"):
        torch.testing.assert_close(getattr(out, name), expected[name].detach(), rtol=1e-5, atol=1e-5, msg=name)
    assert out.entropy.requires_grad and not out.log_sum_sq.requires_grad
    (grad,) = torch.autograd.grad(out.entropy.sum(), model.lm_head.weight)
    (plain_grad,) = torch.autograd.grad(expected["entropy"].sum(), model.lm_head.weight)
    assert plain_grad.abs().max() > 0
    torch.testing.assert_close(grad, plain_grad, rtol=1e-4, atol=1e-6)
    with torch.no_grad():
        evaluated = logps.forward_logps(model, inputs, head=head)
    assert not evaluated.entropy.requires_grad
    torch.testing.assert_close(evaluated.entropy, out.entropy.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(evaluated.sums, out.sums.detach(), rtol=1e-6, atol=1e-6)
