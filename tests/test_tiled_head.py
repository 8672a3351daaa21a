"""tiled_head.py: the kernel (_LabelLogProbs: the LM head on hidden states a tile of rows at a time) against the plain
full-logits computation, values and gradients in fp32 and bf16, every head variant (scale, softcap, bias), its memory
(no (rows, vocab) tensor kept; tiles within HEAD_TILE_BYTES), autocast; and the tiled head as forward_logps' `head`
seam on real tiny models: the log-probs, entropies and log sum p^2 of the model's own logits, refusals of the heads it
does not reproduce, autocast's dtype."""

import contextlib
import functools
import math
import re
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import architectures
import logps
import tiled_head
from config import ConfigError
from logps import HEAD_TILE_BYTES, MAX_TILE_ROWS, head_tile_rows
from tiled_head import _LabelLogProbs

HEAD_PARAMS = ("hidden", "weight", "bias")  # the differentiable inputs of the head's kernel


def head_kernel(
    hidden, weight, labels, bias=None, *, chunk_size=None, logit_scale=1.0, softcap=None, with_entropy=False
):
    """The kernel, in run_head's order of parameters: log-probs (N,), and their entropies with `with_entropy`; tiles of
    head_tile_rows rows (as the tiled head picks them) unless `chunk_size` says."""
    chunk_size = head_tile_rows(weight.shape[0], hidden.dtype) if chunk_size is None else chunk_size
    out, entropy, _ = _LabelLogProbs.apply(hidden, weight, bias, labels, chunk_size, logit_scale, softcap, with_entropy)
    return (out, entropy) if with_entropy else out


def plain_logps(logits, labels, dtype=torch.float32):
    """Full log_softmax in `dtype`, gathered. Shapes (B, T, V), (B, T) -> (B, T-1) x2 (output t predicts t+1)."""
    logits = logits[:, :-1].to(dtype)
    labels = labels[:, 1:]
    mask = labels != -100
    logps = logits.log_softmax(-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return logps * mask, mask


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
    # entropy: fp64 only; the textbook formula in fp32 is itself ~1e-5 off here (see logps.entropy)
    torch.testing.assert_close(entropy, exact_entropy.detach().float(), atol=2e-6, rtol=0)
    for name, grad, plain_grad, exact_grad in zip(HEAD_PARAMS, grads, plain_grads, exact_grads):
        assert grad.dtype == torch.float32, name
        torch.testing.assert_close(grad, plain_grad, atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(grad, exact_grad.float(), atol=2e-6, rtol=0, msg=lambda m: f"{name}: {m}")
    assert (grads[0][3] == 0).all()  # the masked row gets no gradient


@pytest.mark.parametrize("logit_scale,softcap", [(1.0, None), (0.5, 3.0)])
def test_head_kernel_log_sum_sq_matches_fp64(logit_scale, softcap):
    """with_sum_sq (WPO's statistic): log sum_v p_v^2 of each row's (scaled, capped) logits, detached, within 1e-5 of
    logsumexp(2 x) - 2 logsumexp(x) in fp64 at vocab 50257 (two terms near 20 that cancel: fp32 keeps ~2e-6); the
    log-probs are those of the kernel without it, bit for bit."""
    (hidden, weight, bias), labels, _ = head_inputs(50257)
    options = (3, logit_scale, softcap, False)
    out, _, sum_sq = _LabelLogProbs.apply(hidden, weight.requires_grad_(), bias, labels, *options, True)
    alone, _, nothing = _LabelLogProbs.apply(hidden, weight, bias, labels, *options, False)
    logits = F.linear(hidden.double(), weight.double(), bias.double()) * logit_scale
    logits = logits if softcap is None else softcap * torch.tanh(logits / softcap)
    exact = torch.logsumexp(2 * logits.log_softmax(-1), -1)
    assert sum_sq.shape == (10,) and not sum_sq.requires_grad and nothing.numel() == 0
    torch.testing.assert_close(sum_sq, exact.float(), atol=1e-5, rtol=0)
    assert torch.equal(out, alone)


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
    assert head_tile_rows(vocab) == 261 and head_tile_rows(32000) == MAX_TILE_ROWS
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
def test_head_kernel_on_tiny_llama_matches_the_plain_log_probs(tied):
    """A real 2-layer LlamaForCausalLM (vocab 64), two sequences: a 3-token prompt, then the
    response; the second right-padded by 2. Plain: log_softmax of model(...).logits, gathered. Tiled:
    model.model(...) for the hidden states at the scored positions, lm_head.weight in tiles of 5
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

    plain, mask = plain_logps(model(input_ids=input_ids, attention_mask=attention_mask).logits, labels)
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
# The tiled head as forward_logps' `head` on real tiny models
# ---------------------------------------------------------------------------------------------
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
    model = architectures.tiny(config_class, **head)
    inputs = architectures.padded_batch()
    with torch.no_grad():
        expected = architectures.own_token_logps(model, inputs)
        for head in (None, tiled_head.Head()):
            out = logps.forward_logps(model, inputs, head=head, per_token=True)
            torch.testing.assert_close(out.tokens, expected, rtol=1e-5, atol=1e-5, msg=f"head={head}")


def test_tiled_head_refuses_heads_it_does_not_reproduce():
    """A head key that the model type's entry does not apply (logits_scaling on a Llama; MPT's logit_scale, which
    transformers' MPT ignores; Inkling's width multiplier), or the model's own code: a ValueError that names the
    type and the way out, from the config alone (at train.check_inputs, a ConfigError naming model.name_or_path too)
    and again at the first tiled forward. A CausalLM computing its
    logits with more than its output embeddings (BERT's prediction transform), or with a LoRA adapter on its head
    (the tiled head would read the base weight alone), is refused at the first forward."""
    transformers = architectures.transformers
    assert tiled_head.postprocessing(transformers.LlamaConfig()) == (1.0, None)
    assert tiled_head.postprocessing(transformers.GraniteConfig(logits_scaling=4.0)) == (0.25, None)
    assert tiled_head.postprocessing(transformers.Gemma2Config(final_logit_softcapping=30.0)) == (1.0, 30.0)
    cfg = SimpleNamespace(model=SimpleNamespace(name_or_path="my/llama"))
    for config, found in (
        (transformers.LlamaConfig(logits_scaling=2.0), "'llama' has logits_scaling=2.0"),
        (transformers.MptConfig(logit_scale=0.5), "'mpt' has logit_scale=0.5"),
        (transformers.AutoConfig.for_model("inkling_text"), "logits_mup_width_multiplier=24.0"),
        (transformers.LlamaConfig(auto_map={"AutoModelForCausalLM": "my.Model"}), "its own code"),
    ):
        with pytest.raises(ValueError, match=f"{re.escape(found)}.*set tiled_lm_head=false"):
            tiled_head.postprocessing(config)
        with pytest.raises(ConfigError, match=f"model.name_or_path='my/llama': .*{re.escape(found)}"):
            tiled_head.check(cfg, config)
    tiled_head.check(cfg, transformers.GraniteConfig(logits_scaling=4.0))  # a head it knows: no error
    llama = architectures.tiny("LlamaConfig")
    llama.config.logits_scaling = 2.0
    with pytest.raises(ValueError, match="'llama' has logits_scaling=2.0"):
        logps.forward_logps(llama, architectures.padded_batch(), head=tiled_head.Head())
    bert = architectures.tiny("BertConfig", is_decoder=True)
    with pytest.raises(ValueError, match="BertLMHeadModel computes its logits with cls too.*set tiled_lm_head=false"):
        logps.forward_logps(bert, architectures.padded_batch(), head=tiled_head.Head())
    peft = pytest.importorskip("peft")
    adapted = peft.get_peft_model(architectures.tiny("LlamaConfig"), peft.LoraConfig(r=4, target_modules=["lm_head"]))
    with pytest.raises(ValueError, match="LlamaForCausalLM has a LoRA adapter on its LM head.*set tiled_lm_head=false"):
        logps.forward_logps(adapted, architectures.padded_batch(), head=tiled_head.Head())


def test_tiled_head_under_autocast_multiplies_in_the_autocast_dtype():
    """Under autocast (BasicTrainer's fsdp.mixed_precision), fp32 parameters: the tiles' matmuls run in bf16, as the
    model's own head does (before: fp32, autocast being off inside the tiles), so the two paths agree (1e-5 on
    sums here); the gradients come back in fp32, within bf16 rounding of the untiled path's."""
    model = architectures.tiny("LlamaConfig").train()
    inputs, head, seen, linear = architectures.padded_batch(), model.get_output_embeddings(), [], F.linear

    def spy(x, weight, bias=None):  # the head's matmuls: forward, and the backward's recomputation
        if weight.shape == head.weight.shape:
            seen.append((x.dtype, weight.dtype))
        return linear(x, weight, bias)

    results = {}
    for tiled in (True, False):
        model.zero_grad()
        spying = mock.patch.object(F, "linear", spy) if tiled else contextlib.nullcontext()
        with torch.autocast("cpu", dtype=torch.bfloat16), spying:
            sums = logps.forward_logps(model, inputs, head=tiled_head.Head() if tiled else None).sums
            sums.sum().backward()
        results[tiled] = sums.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
    assert seen and set(seen) == {(torch.bfloat16, torch.bfloat16)}, seen
    torch.testing.assert_close(results[True][0], results[False][0], rtol=1e-5, atol=1e-5)
    for name, grad in results[True][1].items():
        assert grad.dtype == torch.float32, name
        untiled = results[False][1][name]
        torch.testing.assert_close(grad, untiled, rtol=2**-7, atol=2**-7 * untiled.abs().max().item(), msg=name)


def test_tiled_sums_entropy_and_sum_sq_equal_the_models_own_logits():
    """Through the tiled head, forward_logps' per-sequence sums, counts, mean entropy and summed log sum p^2 equal the
    plain computation from the model's own logits (1e-5), the entropy and log sum p^2 detached (logged statistics),
    and the sums' gradient the plain path's (1e-5)."""
    cls, kwargs, _ = architectures.ARCHITECTURES["llama"]
    torch.manual_seed(0)
    model = architectures.transformers.AutoModelForCausalLM.from_config(cls(**{**architectures.COMMON, **kwargs}))
    inputs = architectures.padded_batch(architectures.VOCAB)
    expected = architectures.own_statistics(model, inputs)
    out = logps.forward_logps(model, inputs, head=tiled_head.Head(), sum_sq=True)
    assert out.counts.tolist() == expected["counts"].long().tolist()
    for name in ("sums", "entropy", "log_sum_sq"):
        torch.testing.assert_close(getattr(out, name), expected[name].detach(), rtol=1e-5, atol=1e-5, msg=name)
    assert not out.entropy.requires_grad and not out.log_sum_sq.requires_grad
    (grad,) = torch.autograd.grad(out.sums.sum(), model.lm_head.weight)
    (plain_grad,) = torch.autograd.grad(expected["sums"].sum(), model.lm_head.weight)
    torch.testing.assert_close(grad, plain_grad, rtol=1e-5, atol=1e-6)
