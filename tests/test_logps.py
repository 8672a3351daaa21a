"""logps.py's kernels against the plain computation: chunked log-probs (values and gradients, fp32 and bf16), the
entropy, and the tiled LM head (every head variant, memory, autocast, a real tiny Llama). The sequence-level paths
(padded, packed, tiled, under FSDP and Ulysses) are compared in tests/test_trainers.py and tests/test_ulysses.py."""

import contextlib
import functools
import math
import os
import re
import shutil
import warnings
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import logps
from logps import DEFAULT_CHUNK_SIZE, HEAD_TILE_BYTES, entropy_from_logits, head_tile_rows

ATOL = 1e-6


def per_token_logps(logits, labels, chunk_size=DEFAULT_CHUNK_SIZE):
    """log p(labels[t+1] | logits[t]) and its mask, (B, T-1) each: the kernel (logps._LabelLogProbs) on the logits
    themselves (weight None), the labels shifted by one."""
    targets = F.pad(labels[:, 1:], (0, 1), value=-100)
    flat = logps.label_logps(logits.flatten(0, 1), targets.flatten(), chunk_size=chunk_size)
    return flat.view(targets.shape)[:, :-1], targets[:, :-1] != -100


def plain_logps(logits, labels, dtype=torch.float32):
    """The reference: full log_softmax in `dtype`, gathered. Shapes (B, T, V), (B, T) -> (B, T-1) x2."""
    logits = logits[:, :-1].to(dtype)
    labels = labels[:, 1:]
    mask = labels != -100
    logps = logits.log_softmax(-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return logps * mask, mask


def random_batch(vocab, dtype=torch.float32, batch=2, seq=5, seed=0, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    logits = (scale * torch.randn(batch, seq, vocab, generator=gen)).to(dtype)
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels[0, :2] = -100  # a prompt
    labels[1, -1] = -100  # padding
    return logits, labels


def test_per_token_logps_shift_and_mask_by_hand():
    """vocab 3, logits at position t put all mass (logit 0 vs -inf-ish) on token t+1's label when
    the label is the 'right' one: row t = [0, 0, 0] gives log(1/3) for any label.
    labels [-100, 2, 1, -100]: positions 0 and 1 are scored (predict tokens 2 and 1), 2 is not
    (its next label is -100), and the last position has no next token."""
    logits = torch.zeros(1, 4, 3)
    logits[0, 1, 1] = math.log(2.0)  # position 1 predicts token 1 with p = 2/4
    labels = torch.tensor([[-100, 2, 1, -100]])
    out, mask = per_token_logps(logits, labels, chunk_size=2)
    assert out.shape == mask.shape == (1, 3)
    assert mask.tolist() == [[True, True, False]]
    torch.testing.assert_close(out, torch.tensor([[math.log(1 / 3), math.log(0.5), 0.0]]), atol=ATOL, rtol=0)


@pytest.mark.parametrize("vocab", [7, 50257])
def test_chunked_logps_and_grad_match_plain_fp32(vocab):
    """fp32 logits, chunks of 3 rows (10 rows: 3 + 3 + 3 + 1). The plain log_softmax gather is
    evaluated in fp64 on the same fp32 logits: at vocab 50257 the log-probs lie in [-16, -8], where
    fp32 values are 9.5e-7 apart, and the plain fp32 log_softmax is itself up to ~2e-6 from the
    exact value, so only an fp64 reference can check 1e-6. Against the plain fp32 path we allow
    2 fp32 ulps."""
    logits, labels = random_batch(vocab, scale=1.0)
    weights = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    chunked_in = logits.clone().requires_grad_()
    exact_in = logits.double().requires_grad_()
    plain_fp32_in = logits.clone().requires_grad_()
    chunked, chunked_mask = per_token_logps(chunked_in, labels, chunk_size=3)
    exact, exact_mask = plain_logps(exact_in, labels, dtype=torch.float64)
    plain_fp32, _ = plain_logps(plain_fp32_in, labels)
    assert chunked.dtype == torch.float32
    assert torch.equal(chunked_mask, exact_mask)
    torch.testing.assert_close(chunked, exact.float(), atol=1e-6, rtol=0)
    torch.testing.assert_close(chunked, plain_fp32, atol=1e-6, rtol=2 * 2**-23)
    for out in (chunked, exact, plain_fp32):
        (out * weights.to(out.dtype)).sum().backward()
    torch.testing.assert_close(chunked_in.grad, exact_in.grad.float(), atol=1e-6, rtol=0)
    torch.testing.assert_close(chunked_in.grad, plain_fp32_in.grad, atol=1e-6, rtol=0)


@pytest.mark.parametrize("vocab", [7, 50257])
def test_chunked_logps_bf16(vocab):
    """bf16 logits: the log-probs are computed in fp32 from the bf16 values, so they match the
    plain formula on those values (in fp64) to fp32 precision, 1e-5 at |log p| up to ~25, and are
    within bf16 rounding of a plain log_softmax done in bf16. The gradient comes back in bf16,
    within bf16 rounding of the exact one."""
    logits, labels = random_batch(vocab, dtype=torch.bfloat16)
    chunked_in = logits.clone().requires_grad_()
    chunked, _ = per_token_logps(chunked_in, labels, chunk_size=4)
    assert chunked.dtype == torch.float32
    exact_in = logits.double().requires_grad_()
    reference, mask = plain_logps(exact_in, labels, dtype=torch.float64)
    reference = reference.float()
    torch.testing.assert_close(chunked, reference, atol=1e-5, rtol=0)
    bf16_plain = logits[:, :-1].log_softmax(-1).gather(-1, labels[:, 1:].clamp(min=0).unsqueeze(-1))
    torch.testing.assert_close(chunked, bf16_plain.squeeze(-1).float() * mask, atol=2**-7, rtol=2**-7)
    chunked.sum().backward()
    reference.sum().backward()
    assert chunked_in.grad.dtype == torch.bfloat16
    torch.testing.assert_close(chunked_in.grad.float(), exact_in.grad.float(), atol=1e-3, rtol=2**-7)


def test_gradient_at_masked_tokens_is_exactly_zero():
    logits, labels = random_batch(50257)
    logits.requires_grad_()
    logps, mask = per_token_logps(logits, labels, chunk_size=3)
    (logps * torch.randn_like(logps)).sum().backward()
    scored_positions = torch.cat([mask, torch.zeros(2, 1, dtype=torch.bool)], dim=1)  # last: no next token
    assert (logits.grad[~scored_positions] == 0).all()
    assert (logits.grad[scored_positions] != 0).any(dim=-1).all()


# ---------------------------------------------------------------------------------------------
# Entropy
# ---------------------------------------------------------------------------------------------


def plain_entropy(logits, dtype=torch.float32):
    """-sum softmax * log_softmax, in `dtype`."""
    logits = logits.to(dtype)
    return -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)


@pytest.mark.parametrize("chunking,checkpointing", [(False, False), (True, False), (False, True), (True, True)])
def test_entropy_matches_plain_formula(chunking, checkpointing):
    """Vocab 50257, chunks of 5 rows (12 rows: 5 + 5 + 2). The plain formula is evaluated in fp64:
    in fp32 it is itself ~2e-5 off here (losses._entropy_chunk says why); ours is within 1e-6."""
    logits, _ = random_batch(50257, seq=6)
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
    wrapper = logps._CompileOnFirstCall(logps._entropy_chunk)
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
    logits, _ = random_batch(97, seq=6)
    ours_in = logits.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a fallback would be a failure here
        ours = entropy_from_logits(ours_in, chunking=True, checkpointing=True, use_compile=True, chunk_size=5)
    assert logps._COMPILED_ENTROPY_CHUNK.impl is not logps._entropy_chunk
    plain_in = logits.double().requires_grad_()
    plain = plain_entropy(plain_in, dtype=torch.float64)
    torch.testing.assert_close(ours, plain.float(), atol=1e-6, rtol=0)
    ours.sum().backward()
    plain.sum().backward()
    torch.testing.assert_close(ours_in.grad, plain_in.grad.float(), atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------
# The LM head in tiles: the kernel against the plain path
# ---------------------------------------------------------------------------------------------


HEAD_PARAMS = ("hidden", "weight", "bias")  # the differentiable inputs of the head's kernel


def head_kernel(hidden, weight, labels, bias=None, **options):
    """The tiled head, logps.label_logps with a weight (V, H), in run_head's order of parameters."""
    return logps.label_logps(hidden, labels, weight, bias, **options)


def test_label_logps_argument_errors_name_every_shape():
    hidden, weight, labels = torch.zeros(4, 8), torch.zeros(7, 8), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match=re.escape("got x (4, 8), weight (7, 16), labels (4,)")):
        logps.label_logps(hidden, labels, torch.zeros(7, 16))
    with pytest.raises(ValueError, match=re.escape("got x (2, 4, 8), weight (7, 8)")):
        logps.label_logps(torch.zeros(2, 4, 8), labels, weight)
    with pytest.raises(ValueError, match=re.escape("labels (5,)")):
        logps.label_logps(hidden, torch.zeros(5, dtype=torch.long), weight)
    with pytest.raises(ValueError, match=re.escape("bias (6,)")):
        logps.label_logps(hidden, labels, weight, torch.zeros(6))
    with pytest.raises(TypeError, match="torch.bfloat16, torch.float32"):
        logps.label_logps(hidden.bfloat16(), labels, weight)
    with pytest.raises(ValueError, match="softcap"):
        logps.label_logps(hidden, labels, weight, softcap=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        logps.label_logps(hidden, labels, chunk_size=0)


def plain_head(hidden, weight, labels, bias=None, dtype=torch.float64, logit_scale=1.0, softcap=None):
    """The reference: the full (N, V) logits F.linear(hidden, weight, bias) in the inputs' dtype,
    then in `dtype`: scale, softcap, log_softmax, gather, 0 at -100. Returns (logps, entropy)."""
    logits = F.linear(hidden, weight, bias).to(dtype) * logit_scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    log_probs = logits.log_softmax(-1)
    logps = log_probs.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1) * (labels != -100)
    return logps, -(log_probs.exp() * log_probs).sum(-1)


def head_inputs(vocab, dtype=torch.float32, rows=10, hidden_size=16, seed=0):
    """hidden (10, 16) ~ N(0, 1), weight (V, 16) ~ N(0, 1/16) (logits ~ N(0, 1), as at init),
    bias ~ N(0, 0.25), labels with row 3 masked (-100), and an upstream gradient (10,)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, hidden_size, generator=gen)
    weight = torch.randn(vocab, hidden_size, generator=gen) / math.sqrt(hidden_size)
    bias = 0.5 * torch.randn(vocab, generator=gen)
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    labels[3] = -100
    upstream = torch.randn(rows, generator=gen)
    return [x.to(dtype) for x in (hidden, weight, bias)], labels, upstream


def run_head(fn, params, labels, upstream, **kwargs):
    """fn(hidden, weight, labels, bias, **kwargs) on leaf copies of params; (out, entropy, grads)."""
    leaves = [p.detach().clone().requires_grad_() for p in params]
    out = fn(leaves[0], leaves[1], labels, leaves[2], **kwargs)
    logps, entropy = out[:2] if isinstance(out, tuple) else (out, None)
    (logps * upstream.to(logps.dtype)).sum().backward()
    return logps, entropy, [leaf.grad for leaf in leaves]


@pytest.mark.parametrize(
    "vocab,chunk_size,logit_scale,softcap",
    [
        (7, 3, 1.0, None),
        (7, 5, 1.0, None),
        (7, 1024, 1.0, None),
        (7, 3, 0.5, 3.0),
        (50257, 3, 1.0, None),
        (50257, 5, 1.0, None),
        (50257, 3, 0.5, None),
        (50257, 3, 1.0, 2.0),
        (50257, 5, 0.5, 3.0),
    ],
)
def test_head_kernel_matches_plain_path_fp32(vocab, chunk_size, logit_scale, softcap):
    """10 rows in tiles of 3 (3 + 3 + 3 + 1), 5 (5 + 5) and 1024 (one tile); plain, Cohere-like
    scaling, Gemma-like softcap (small, so that tanh bends) and both. Log-probs and the gradients
    w.r.t. hidden, weight and bias against the plain fp32 path within 1e-5; those and the entropy
    against the plain path in fp64 within 2e-6 (2 fp32 ulps at |log p| ~ 13; the plain fp32 path
    is itself up to ~8e-6 from it in its hidden gradient, a sum over V terms, and ~1e-5 in its
    entropy)."""
    params, labels, upstream = head_inputs(vocab)
    kwargs = dict(logit_scale=logit_scale, softcap=softcap)
    ours, entropy, grads = run_head(
        head_kernel, params, labels, upstream, chunk_size=chunk_size, with_entropy=True, **kwargs
    )
    plain, _, plain_grads = run_head(
        functools.partial(plain_head, dtype=torch.float32, **kwargs), params, labels, upstream
    )
    exact, exact_entropy, exact_grads = run_head(plain_head, [p.double() for p in params], labels, upstream, **kwargs)
    assert ours.shape == entropy.shape == (10,) and ours.dtype == entropy.dtype == torch.float32
    assert ours[3] == 0 and not entropy.requires_grad
    torch.testing.assert_close(ours, plain, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours, exact.float(), atol=2e-6, rtol=0)
    # entropy: fp64 only; the textbook formula in fp32 is itself ~1e-5 off here (see _entropy_chunk)
    torch.testing.assert_close(entropy, exact_entropy.detach().float(), atol=2e-6, rtol=0)
    for name, grad, plain_grad, exact_grad in zip(HEAD_PARAMS, grads, plain_grads, exact_grads):
        assert grad.dtype == torch.float32, name
        torch.testing.assert_close(grad, plain_grad, atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(grad, exact_grad.float(), atol=2e-6, rtol=0, msg=lambda m: f"{name}: {m}")
    assert (grads[0][3] == 0).all()  # the masked row gets no gradient


def test_head_kernel_bf16_within_bf16_rounding():
    """bf16 hidden/weight/bias, vocab 50257: the logits are the bf16 matmul, upcast, so the
    log-probs equal the plain path on the same bf16 logits to fp32 precision (1e-5), and are
    within the bf16 rounding of those logits (|logit| < 6, half an ulp 2^-7 at most) of the exact
    values. Gradients come back in bf16, within bf16 rounding (rtol 2^-7, and atol 2^-7 of the
    largest entry) of the exact ones, and no further from them than the plain bf16 path's."""
    params, labels, upstream = head_inputs(50257, dtype=torch.bfloat16)
    ours, _, grads = run_head(head_kernel, params, labels, upstream, chunk_size=4)
    plain, _, plain_grads = run_head(functools.partial(plain_head, dtype=torch.float32), params, labels, upstream)
    exact, _, exact_grads = run_head(plain_head, [p.double() for p in params], labels, upstream)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, plain, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours, exact.float(), atol=2 * 2**-7, rtol=0)
    for name, grad, plain_grad, exact_grad in zip(HEAD_PARAMS, grads, plain_grads, exact_grads):
        assert grad.dtype == torch.bfloat16, name
        bound = 2**-7 * exact_grad.abs().max().item()
        torch.testing.assert_close(grad.double(), exact_grad, atol=bound, rtol=2**-7, msg=lambda m: f"{name}: {m}")
        ours_err = (grad.double() - exact_grad).abs().max()
        assert ours_err <= (plain_grad.double() - exact_grad).abs().max() * 1.01, name


def test_head_kernel_saves_nothing_of_rows_by_vocab():
    """What autograd keeps for backward: hidden (N, H), weight (V, H), bias (V,), and per-row
    labels, mask, logsumexp (N,); never an (N, V) tensor, which the plain path does keep."""
    params, labels, _ = head_inputs(50257)
    leaves = [p.clone().requires_grad_() for p in params]

    def saved_shapes(fn):
        shapes = set()
        record = lambda x: shapes.add(tuple(x.shape)) or x  # noqa: E731
        with torch.autograd.graph.saved_tensors_hooks(record, lambda x: x):
            fn(leaves[0], leaves[1], labels, leaves[2])
        return shapes

    tiled = saved_shapes(functools.partial(head_kernel, chunk_size=3, with_entropy=True))
    assert tiled == {(10, 16), (50257, 16), (50257,), (10,)}, tiled
    assert (10, 50257) in saved_shapes(functools.partial(plain_head, dtype=torch.float32))


def test_head_kernel_tiles_by_bytes_at_llama3_vocab():
    """At Llama-3's vocab 128256 the default tile is head_tile_rows = 128 MiB / (128256 x 4 B) = 261
    rows, not 1024: with 600 scored rows a 1024-row tile would be one (600, 128256) fp32 tensor of
    294 MiB. Every tensor an op creates in forward and backward stays within HEAD_TILE_BYTES, and
    log-probs and gradients equal one 600-row tile's (the same sums, in tiles of 261 + 261 + 78)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class LargestOutput(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    LargestOutput.largest = max(LargestOutput.largest, t.numel() * t.element_size())
            return out

    vocab = 128256
    params, labels, upstream = head_inputs(vocab, rows=600, hidden_size=8)
    with LargestOutput():
        logps, _, grads = run_head(head_kernel, params, labels, upstream)
    assert LargestOutput.largest <= 128 * 2**20, f"{LargestOutput.largest / 2**20:.0f} MiB"
    assert HEAD_TILE_BYTES == 128 * 2**20
    assert head_tile_rows(vocab) == 261 and head_tile_rows(32000) == DEFAULT_CHUNK_SIZE
    one_tile, _, one_tile_grads = run_head(head_kernel, params, labels, upstream, chunk_size=600)
    torch.testing.assert_close(logps, one_tile, rtol=0, atol=0)  # rows are independent: bit-identical
    # the gradients' sums run over 128256 vocabulary entries in matmuls blocked by the tile's row count (the BLAS
    # picks kernels by shape): equal to fp32 rounding, seen 1.8e-7 apart on an entry of 7.5e-3
    for name, got, expected in zip(HEAD_PARAMS, grads, one_tile_grads):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_head_kernel_ignores_autocast():
    """Under autocast the forward and the backward's recomputation must see the same logits, so
    autocast is switched off inside: fp32 inputs give the fp32 result, gradients included."""
    params, labels, upstream = head_inputs(7)
    expected, _, expected_grads = run_head(head_kernel, params, labels, upstream, chunk_size=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _, grads = run_head(head_kernel, params, labels, upstream, chunk_size=3)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, atol=0, rtol=0)


@pytest.mark.parametrize("needs", ["hidden", "weight", "bias", "hidden+weight", "none"])
def test_head_kernel_with_only_some_inputs_requiring_grad(needs):
    """Gradients only for the inputs that require them, equal to the all-grad run's; with none,
    the output needs no grad and backward is never called (also under torch.no_grad)."""
    params, labels, upstream = head_inputs(7)
    _, _, all_grads = run_head(head_kernel, params, labels, upstream, chunk_size=3)
    leaves = [p.clone().requires_grad_(name in needs) for p, name in zip(params, HEAD_PARAMS)]
    out = head_kernel(leaves[0], leaves[1], labels, leaves[2], chunk_size=3)
    if needs == "none":
        assert not out.requires_grad
    else:
        (out * upstream).sum().backward()
    for leaf, grad, name in zip(leaves, all_grads, HEAD_PARAMS):
        if name in needs:
            torch.testing.assert_close(leaf.grad, grad, atol=0, rtol=0)
        else:
            assert leaf.grad is None
    with torch.no_grad():
        torch.testing.assert_close(head_kernel(*params[:2], labels, params[2]), out.detach())
    no_bias = head_kernel(params[0], params[1], labels)  # bias=None
    torch.testing.assert_close(
        no_bias, plain_head(params[0], params[1], labels, dtype=torch.float32)[0], atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("tied", [False, True])
def test_head_kernel_on_tiny_llama_matches_per_token_logps(tied):
    """A real 2-layer LlamaForCausalLM (vocab 64), two sequences: a 3-token prompt, then the
    response; the second right-padded by 2. Plain: per_token_logps on model(...).logits. Tiled:
    model.model(...) for the hidden states, select_scored_positions, lm_head.weight in tiles of 5
    rows. Same log-probs at the scored positions, same per-sequence sums and token counts, and
    the same gradient of every parameter for a DPO-like loss (sum of chosen - 0.5 rejected).
    Tied: lm_head.weight is the embedding matrix, so its gradient has two sources."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=tied,
        attn_implementation="eager",
    )
    model = transformers.LlamaForCausalLM(config)
    input_ids = torch.randint(0, 64, (2, 9))
    attention_mask = torch.ones(2, 9, dtype=torch.long)
    attention_mask[1, -2:] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :3] = -100
    sequence_weights = torch.tensor([1.0, -0.5])
    params = [p for p in model.parameters()]

    plain, mask = per_token_logps(model(input_ids=input_ids, attention_mask=attention_mask).logits, labels)
    plain_sums = plain.sum(-1)
    plain_grads = torch.autograd.grad((plain_sums * sequence_weights).sum(), params)

    hidden = model.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    rows, targets, rows_mask = hidden[:, :-1][mask], labels[:, 1:][mask], mask  # the scored positions
    logps = head_kernel(rows, model.lm_head.weight, targets, chunk_size=5)
    sums = logps.new_zeros(mask.shape).masked_scatter(mask, logps).sum(-1)
    grads = torch.autograd.grad((sums * sequence_weights).sum(), params)

    assert torch.equal(rows_mask, mask) and rows.shape == (mask.sum().item(), 16)
    assert mask.sum(-1).tolist() == [6, 4]  # positions 2..7 predict tokens 3..8; 2 fewer padded
    torch.testing.assert_close(logps, plain[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(sums, plain_sums, atol=1e-5, rtol=0)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    for (name, _), grad, plain_grad in zip(model.named_parameters(), grads, plain_grads):
        torch.testing.assert_close(grad, plain_grad, atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------------------------------------
# forward_logps on real tiny models: the tiled head as the model's own head, autocast, padded rows
# ---------------------------------------------------------------------------------------------


def tiny(config_class, **kwargs):
    """A random 2-layer model of `config_class` (vocab 256, hidden 64), fp32, in eval mode."""
    transformers = pytest.importorskip("transformers")
    sizes = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**sizes, **kwargs})
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def padded_rows(vocab=256):
    """Three rows of 24 tokens, the last two right-padded (to 18 and 11), 4 prompt tokens unscored."""
    ids = torch.randint(3, vocab, (3, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 18:] = mask[2, 11:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :4] = -100
    return {"input_ids": ids * mask, "attention_mask": mask, "labels": labels}


def own_token_logps(model, inputs):
    """Each labelled token's log-prob from log_softmax(model(...).logits), 0 elsewhere, (N, T): each row alone."""
    out = torch.zeros(inputs["labels"].shape)
    for i, n in enumerate(inputs["attention_mask"].sum(1).tolist()):
        ids = inputs["input_ids"][i : i + 1, :n]
        logp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)[0]
        out[i, 1:n] = logp[:-1].gather(-1, ids[0, 1:, None])[:, 0] * (inputs["labels"][i, 1:n] != -100)
    return out


@pytest.mark.parametrize(
    "config_class,head",
    [
        ("GraniteConfig", dict(logits_scaling=4.0)),
        ("HyperCLOVAXConfig", dict(logits_scaling=0.25)),
        ("FalconH1Config", dict(lm_head_multiplier=0.25)),
        ("CohereConfig", dict(logit_scale=0.25)),
        (
            "RecurrentGemmaConfig",
            dict(
                logits_soft_cap=2.0,
                num_hidden_layers=3,
                attention_window_size=16,
                lru_width=64,
                block_types=["recurrent", "recurrent", "attention"],
            ),
        ),
    ],
)
def test_tiled_head_gives_the_log_probs_of_the_models_own_logits(config_class, head):
    """The tiled head redoes each head's post-processing, by model type: Granite divides by logits_scaling,
    HyperCLOVAX multiplies by it, Falcon-H1 multiplies by lm_head_multiplier, Cohere by logit_scale, RecurrentGemma
    caps with tanh at logits_soft_cap (2: the cap bends these logits). Per token, the log-probs of the model's own
    logits (1e-5). Before: HyperCLOVAX divided, Falcon-H1 and RecurrentGemma did nothing."""
    model = tiny(config_class, **head)
    inputs = padded_rows()
    with torch.no_grad():
        expected = own_token_logps(model, inputs)
        for tiled in (False, True):
            out = logps.forward_logps(model, inputs, tiled=tiled, per_token=True)
            torch.testing.assert_close(out.tokens, expected, rtol=1e-5, atol=1e-5, msg=f"tiled={tiled}")


def test_tiled_head_refuses_heads_it_does_not_reproduce():
    """A head key that the model type's entry does not apply (logits_scaling on a Llama; MPT's logit_scale, which
    transformers' MPT ignores; Inkling's width multiplier), or the model's own code: a ValueError that names the
    type and the way out, from the config alone and again at the first tiled forward. A CausalLM computing its
    logits with more than its output embeddings (BERT's prediction transform), or with a LoRA adapter on its head
    (the tiled head would read the base weight alone), is refused at the first forward."""
    transformers = pytest.importorskip("transformers")
    assert logps.tiled_head(transformers.LlamaConfig()) == (1.0, None)
    assert logps.tiled_head(transformers.GraniteConfig(logits_scaling=4.0)) == (0.25, None)
    assert logps.tiled_head(transformers.Gemma2Config(final_logit_softcapping=30.0)) == (1.0, 30.0)
    for config, found in (
        (transformers.LlamaConfig(logits_scaling=2.0), "'llama' has logits_scaling=2.0"),
        (transformers.MptConfig(logit_scale=0.5), "'mpt' has logit_scale=0.5"),
        (transformers.AutoConfig.for_model("inkling_text"), "logits_mup_width_multiplier=24.0"),
        (transformers.LlamaConfig(auto_map={"AutoModelForCausalLM": "my.Model"}), "its own code"),
    ):
        with pytest.raises(ValueError, match=f"{re.escape(found)}.*set tiled_lm_head=false"):
            logps.tiled_head(config)
    llama = tiny("LlamaConfig")
    llama.config.logits_scaling = 2.0
    with pytest.raises(ValueError, match="'llama' has logits_scaling=2.0"):
        logps.forward_logps(llama, padded_rows(), tiled=True)
    bert = tiny("BertConfig", is_decoder=True)
    with pytest.raises(ValueError, match="BertLMHeadModel computes its logits with cls too.*set tiled_lm_head=false"):
        logps.forward_logps(bert, padded_rows(), tiled=True)
    peft = pytest.importorskip("peft")
    adapted = peft.get_peft_model(tiny("LlamaConfig"), peft.LoraConfig(r=4, target_modules=["lm_head"]))
    with pytest.raises(ValueError, match="LlamaForCausalLM has a LoRA adapter on its LM head.*set tiled_lm_head=false"):
        logps.forward_logps(adapted, padded_rows(), tiled=True)


def test_tiled_head_under_autocast_multiplies_in_the_autocast_dtype():
    """Under autocast (BasicTrainer's fsdp.mixed_precision), fp32 parameters: the tiles' matmuls run in bf16, as the
    model's own head does (before: fp32, autocast being off inside the tiles), so the two paths agree (1e-5 on
    sums here); the gradients come back in fp32, within bf16 rounding of the untiled path's."""
    model = tiny("LlamaConfig").train()
    inputs, head, seen, linear = padded_rows(), model.get_output_embeddings(), [], F.linear

    def spy(x, weight, bias=None):  # the head's matmuls: forward, and the backward's recomputation
        if weight.shape == head.weight.shape:
            seen.append((x.dtype, weight.dtype))
        return linear(x, weight, bias)

    results = {}
    for tiled in (True, False):
        model.zero_grad()
        spying = mock.patch.object(F, "linear", spy) if tiled else contextlib.nullcontext()
        with torch.autocast("cpu", dtype=torch.bfloat16), spying:
            sums = logps.forward_logps(model, inputs, tiled=tiled).sums
            sums.sum().backward()
        results[tiled] = sums.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
    assert seen and set(seen) == {(torch.bfloat16, torch.bfloat16)}, seen
    torch.testing.assert_close(results[True][0], results[False][0], rtol=1e-5, atol=1e-5)
    for name, grad in results[True][1].items():
        assert grad.dtype == torch.float32, name
        untiled = results[False][1][name]
        torch.testing.assert_close(grad, untiled, rtol=2**-7, atol=2**-7 * untiled.abs().max().item(), msg=name)


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neox", "llama", "qwen2", "gemma2", "mistral", "mistral-window"])
def test_padded_rows_reach_the_model_without_a_mask(arch):
    """Right-padded rows go to the model with no attention mask (its own causal mask: sdpa's causal kernel, not a
    (R, 1, T, T) bias; before: the 2-D padding mask); the labelled tokens' log-probs are those of each row scored
    alone (1e-5), for every family of tests/architectures.py, Gemma2 eager with its sliding window and softcap,
    Mistral also with a window (8) shorter than the rows."""
    import architectures

    transformers = pytest.importorskip("transformers")
    cls, kwargs, _ = architectures.ARCHITECTURES[arch.split("-")[0]]
    kwargs = {**architectures.COMMON, **kwargs, **({"sliding_window": 8} if arch == "mistral-window" else {})}
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cls(**kwargs)).eval()
    inputs, seen, attention = padded_rows(architectures.VOCAB), [], []
    model.register_forward_pre_hook(lambda _, args, kw: seen.append(kw.get("attention_mask")), with_kwargs=True)
    sdpa = F.scaled_dot_product_attention
    spy = lambda *a, **k: attention.append((k.get("attn_mask"), k.get("is_causal"))) or sdpa(*a, **k)  # noqa: E731
    with torch.no_grad(), mock.patch.object(F, "scaled_dot_product_attention", spy):
        out = logps.forward_logps(model, inputs, per_token=True)
        seen_by_padded, seen[:], attention_of_padded = seen[0], [], attention[:]
        expected = own_token_logps(model, inputs)
    assert seen_by_padded is None
    if model.config._attn_implementation == "sdpa" and arch != "mistral-window":
        assert attention_of_padded and all(m is None and causal for m, causal in attention_of_padded), arch
    torch.testing.assert_close(out.tokens, expected, rtol=1e-5, atol=1e-5)


def test_one_kernel_for_tiled_and_untiled_rows_and_the_entropy_bonus():
    """forward_logps' per-sequence sums, mean entropy and summed log sum p^2 equal the plain computation from the
    model's own logits (log_softmax over every position, then the scored ones), tiled or not: both go through
    _LabelLogProbs on the scored rows. The entropy bonus (untiled, `entropy_grad`) is differentiable and its
    gradient is that of the plain entropy."""
    import architectures

    transformers = pytest.importorskip("transformers")
    cls, kwargs, _ = architectures.ARCHITECTURES["llama"]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cls(**{**architectures.COMMON, **kwargs}))
    inputs = padded_rows(architectures.VOCAB)
    logp = torch.log_softmax(model(input_ids=inputs["input_ids"]).logits.float(), -1)[:, :-1]
    targets = inputs["labels"][:, 1:]
    scored = (targets != -100).float()
    token = logp.gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    entropy = -(logp.exp() * logp).sum(-1)
    sum_sq = torch.logsumexp(2 * logp, -1)
    counts = scored.sum(1)
    plain_entropy = (entropy * scored).sum(1) / counts
    (plain_grad,) = torch.autograd.grad(plain_entropy.sum(), model.lm_head.weight)
    for options in (dict(tiled=True), dict(tiled=False), dict(tiled=False, entropy_grad=True)):
        out = logps.forward_logps(model, inputs, entropy={}, sum_sq=True, **options)
        assert out.counts.tolist() == counts.long().tolist(), options
        torch.testing.assert_close(out.sums, (token * scored).sum(1), rtol=1e-5, atol=1e-5, msg=str(options))
        torch.testing.assert_close(out.entropy, plain_entropy, rtol=1e-5, atol=1e-5, msg=str(options))
        torch.testing.assert_close(out.log_sum_sq, (sum_sq * scored).sum(1), rtol=1e-5, atol=1e-5, msg=str(options))
        assert out.entropy.requires_grad == bool(options.get("entropy_grad")), options
    (grad,) = torch.autograd.grad(out.entropy.sum(), model.lm_head.weight)
    torch.testing.assert_close(grad, plain_grad, rtol=1e-4, atol=1e-6)
