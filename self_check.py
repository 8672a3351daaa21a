"""Every run checks itself: before the first optimizer step, on a few of its own pairs, with its own model, options,
precision and device, the run compares each number it is about to optimise with the plain path that defines it:

  head       tiled_lm_head: the tiled head's log-probs and entropies = log_softmax of the model's own forward().logits
  layout     padding_free, prefix_sharing, Ulysses: the run's rows = plain padded rows (counts, per-token log-probs)
  reference  at step 0, a reference whose weights are the policy's (compared, not assumed) gives the policy's log-probs,
             so the first loss is the loss's own value at zero margin (ln 2 for DPO; computed by the loss)
  cache      precompute_ref_log_probs: the cached table's values = a live reference forward

One line per check, naming the scored tokens it compared (none: a failure, never a pass); run_dir/self_check.json (its
own file: it survives a failed run) and the W&B summary hold it all.
A failure raises SelfCheckError (train.py: exit code 4) naming the check, the difference, the tolerance and the key
that avoids it. `self_check=false` turns it off. Cost: a few forwards of at most PROBE_PAIRS pairs, no backward.
"""

import contextlib
import dataclasses
import json
import math
import time

import torch

import losses
from logps import SequenceLogps, concatenated_inputs, forward_logps
from config import dtype_of
from utils import atomic_write_text, clean_name, rank0_print

REPORT = "self_check.json"  # in run_dir, beside run_manifest.json
PROBE_PAIRS = 4  # per rank: enough sequences to fill packed rows, few enough to cost a fraction of a step
# Nats per scored token, by compute dtype. Measured on six of tests/architectures.py's models and the toy model, heads
# scaled to a trained model's logits (std 8), packed and shared-prefix vs padded rows: fp32 differs by at most 2e-5
# (1e-3: 50x that), bf16 by up to 7e-2 (its 8-bit mantissa rounds a logit of 16 in steps of 0.06; 0.2: 3x that);
# fp16's 3 more bits make its steps 8x finer. Faults sit far above: a 1.1x logit scale or attention leaking between
# packed sequences moves those models by 1.7 to 11 nats per token in bf16. The matrix's own runs: <= 1e-6 (fp32),
# 4e-5 (bf16).
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 2e-1, torch.float16: 3e-2}
# The head check's, tighter: both paths share the hidden states and differ only where the model's forward rounds its
# logits' scaling or cap in the compute dtype (Gemma-2's soft cap in bf16: steps of 0.125 near the cap of 30, about
# 0.03 per token); a logit temperature 10% off moves a trained model's tokens by 0.1 to 0.3.
HEAD_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 6e-2, torch.float16: 1e-2}


class SelfCheckError(RuntimeError):
    """A self-check failed: the run stopped before its first optimizer step (train.py's exit code 4)."""


def run(t) -> None:
    """The checks that apply to trainer `t`'s run, on every rank (every rank runs the same forwards: collectives
    under FSDP), before its first optimizer step and while its reference model exists; raises SelfCheckError."""
    c = t.config
    batch = next(iter(t.train_batches()), None) if c.self_check else None
    if batch is None:  # off, or a resume with no step left
        return
    start = time.time()
    probe = probe_pairs(t, batch)
    inputs = {k: v.to(t.device) for k, v in concatenated_inputs(probe).items()}
    dtype = compute_dtype(c, True, c.fsdp.model_dtype)
    with torch.no_grad(), t.sharding.params_on_device(t.policy):
        ours = policy_logps(t, inputs, layout=t.layout, head=t.policy_head)  # the run's own path
        checks = []
        for option in filter(None, (t.head, t.layout, t.cache)):  # each option's probe, beside its code
            checks += option.probe(t, probe, inputs, ours, dtype)
        checks += reference(t, probe, inputs, ours)
    t.sharding.reshard(t.policy)
    finish(t, checks, time.time() - start, probe["example_index"].tolist())


def probe_pairs(t, batch: dict) -> dict:
    """This rank's first pairs of its first step: at most PROBE_PAIRS and at most a micro-batch's (the probe's
    forwards never hold more than the run's), each side cut to its longest sequence."""
    c = t.config
    n = len(batch["chosen_input_ids"])
    per_micro = n if c.max_tokens_per_microbatch else n // c.gradient_accumulation_steps
    probe = {k: v[: max(1, min(PROBE_PAIRS, per_micro))] for k, v in batch.items() if not k.startswith("kl_")}
    for side in ("chosen", "rejected"):
        width = int(probe[f"{side}_attention_mask"].sum(1).max()) if f"{side}_attention_mask" in probe else 0
        for k in ("input_ids", "attention_mask", "labels") if width else ():
            probe[f"{side}_{k}"] = probe[f"{side}_{k}"][:, :width]
    return probe


def policy_logps(t, inputs: dict, layout=None, head=None) -> SequenceLogps:
    """The policy's log-probs, entropies and per-token log-probs of `inputs` in the run's precision; without a
    `layout`, whole padded rows through plain attention on every rank (Ulysses paused)."""
    plain = t.sp.paused() if t.sp and layout is None else contextlib.nullcontext()
    with t.autocast(), plain:
        return t.sharding.forward(t.policy, forward_logps, inputs, layout=layout, head=head, per_token=True)


def reference(t, probe: dict, inputs: dict, ours: SequenceLogps) -> list[dict]:
    c = t.config
    ref = t.reference
    if ref.model is None or c.loss.reference_free:
        return []
    dtype = compute_dtype(c, ref.mixed, c.model.reference_dtype or c.fsdp.model_dtype)
    live = ref.forward(inputs)
    checks = []
    if not starts_as_policy(t):  # nothing to compare at step 0
        why = "the reference's weights are not the policy's (another archive or dtype, or a resumed run)"
        return checks + [dict(check="reference", passed=True, skipped=why)]
    check = compare(t, "reference", "the reference vs the policy at step 0", live, ours, dtype, None)
    step0, closed = (zero_margin_loss(t, probe, ours, sums) for sums in (live.sums, ours.sums))
    return checks + [dict(check, step0_loss=step0, zero_margin_loss=closed)]


def starts_as_policy(t) -> bool:
    """Whether the reference holds the policy's weights (this rank's shards, element by element: both models are
    sharded alike) and computes in the same precision; one answer for all ranks."""
    ref = t.reference
    local = lambda p: p.to_local() if hasattr(p, "to_local") else p  # FSDP2's DTensor shard
    if ref.lora:  # the policy with its adapters off: the same function while every adapter's B is zero (peft's init)
        same = all(not local(p).any() for name, p in t.policy.named_parameters() if "lora_B" in name)
    else:
        policy = {clean_name(k): local(p) for k, p in t.policy.named_parameters()}
        refs = {clean_name(k): local(p) for k, p in ref.model.named_parameters()}
        same = policy.keys() == refs.keys() and all(
            p.dtype == refs[k].dtype and torch.equal(p, refs[k].to(p.device))  # equal compares shapes, not dtypes
            for k, p in policy.items()
        )
    return t.sharding.all_true(same and ref.mixed == (t.config.fsdp.mixed_precision is not None))


def zero_margin_loss(t, probe: dict, ours: SequenceLogps, ref: torch.Tensor) -> float:
    """The run's loss on the probe (mean over all ranks) with `ref` as the reference's sums; the policy's own sums
    give its value at zero margin. Modifiers weighing tokens or pairs by the policy alone are left out: equal on both
    sides."""
    c = t.config
    kl = ours.sums.new_zeros(1) if t.unpaired else None  # KTO: the KL reference point is 0 where reference = policy
    hp = dataclasses.replace(c.loss, wpo=False, ld_alpha=1.0)
    paired = "rejected_input_ids" in probe
    desirable = probe.get("desirable")
    out = losses.compute_loss(
        c.loss_names, c.loss.weights, hp, ours, SequenceLogps(ref, None), paired=paired, desirable=desirable, kl=kl
    )
    return t.sharding.gather(out.losses.mean().float().reshape(1)).mean().item()


def compute_dtype(c, mixed: bool, weights: str) -> torch.dtype:
    """The dtype a model computes in: fsdp.mixed_precision's param_dtype where it applies, else its weights'."""
    mp = c.fsdp.mixed_precision_dtypes()
    return dtype_of(mp["param_dtype"] if mixed and mp is not None else weights)


def difference(a: SequenceLogps, b: SequenceLogps) -> torch.Tensor:
    """This rank's (summed |a - b| over the scored tokens, their count, the largest mean |a - b| per token of a
    sequence), each the larger of the log-probs' (each token's where both have them, else the sums') and the mean
    entropies' (weighted by count); inf where the scored-token counts differ. A non-finite value counts 0 here and is
    never silent: the non-finite guard (max_nonfinite_steps) skips its step and stops the run."""
    counts = b.counts.float()
    if not torch.equal(a.counts.cpu(), b.counts.cpu()):
        return torch.stack([counts.new_tensor(math.inf), counts.sum(), counts.new_tensor(math.inf)])
    gap = lambda x, y: torch.where(x.isfinite() & y.isfinite(), (x - y).abs(), 0.0)
    both = a.tokens is not None and b.tokens is not None
    parts = [gap(a.tokens, b.tokens).sum(1) if both else gap(a.sums, b.sums)]  # per sequence, summed over its tokens
    if a.entropy is not None and b.entropy is not None:
        parts.append(gap(a.entropy, b.entropy) * counts)
    stats = [torch.stack([p.sum(), counts.sum(), (p / counts.clamp(min=1)).max()]).float() for p in parts]
    return torch.stack(stats).amax(0)


def compare(
    t,
    name: str,
    what: str,
    ours: SequenceLogps,
    plain: SequenceLogps,
    dtype: torch.dtype,
    fix,
    tolerance=None,
    mean=False,
) -> dict:
    """One check's record over all ranks (each rank probed its own pairs) against `tolerance` (else TOLERANCE) for
    `dtype`: with `mean` the mean |difference| per scored token (paths that round differently; a fault moves every
    token), else the largest mean per sequence (paths that must agree; a fault may sit in one sequence). A check that
    compared no scored token fails."""
    summed, tokens, largest = t.sharding.gather(difference(ours, plain).to(t.device)[None]).T
    n, measure = int(tokens.sum()), "mean" if mean else "largest"
    record = dict(check=name, what=what, tokens=n, mean=summed.sum().item() / max(n, 1), largest=largest.max().item())
    worst, tol = record[measure], (tolerance or TOLERANCE)[dtype]
    passed = n > 0 and worst <= tol
    return record | dict(measure=measure, difference=worst, tolerance=tol, dtype=str(dtype)[6:], passed=passed, fix=fix)


def finish(t, checks: list[dict], seconds: float, probe: list[int]) -> None:
    """Print one line per check, write run_dir/self_check.json and the W&B summary (rank 0), raise on a failure."""
    for c in checks:
        if "skipped" in c:
            rank0_print(f"self-check {c['check']}: skipped: {c['skipped']}")
            continue
        loss = "step0_loss" in c and f"; step-0 loss {c['step0_loss']:.6f}, at zero margin {c['zero_margin_loss']:.6f}"
        rank0_print(
            f"self-check {c['check']}: {c['what']}: {measured(c)} (tolerance {c['tolerance']:g}, {c['dtype']})"
            f"{loss or ''}: {'ok' if c['passed'] else 'FAILED'}"
        )
    failed = [c for c in checks if not c["passed"]]
    rank0_print(
        f"self-check: {len(checks) - len(failed)} of {len(checks)} passed on {len(probe)} examples per rank "
        f"in {seconds:.2f} s (self_check=false turns it off)"
    )
    message = "; ".join(map(failure_line, failed)) + f". Nothing was trained; the report: {t.run_dir / REPORT}"
    if t.rank == 0:
        strict = lambda v: str(v) if isinstance(v, float) and not math.isfinite(v) else v  # JSON: no inf
        as_json = [{k: strict(v) for k, v in c.items()} for c in checks]
        record = dict(passed=not failed, seconds=round(seconds, 3), example_index=probe, checks=as_json)
        record["failure"] = message if failed else None
        atomic_write_text(t.run_dir / REPORT, json.dumps(record, indent=1) + "\n")
        if t.log.wandb_run is not None:
            summary = {f"self_check/{c['check']}": c["difference"] for c in checks if "difference" in c}
            t.log.wandb_run.summary.update(summary | {"self_check/passed": not failed, "self_check/seconds": seconds})
    if failed:
        raise SelfCheckError(message)


def failure_line(c: dict) -> str:
    fix = f"set {c['fix']}" if c["fix"] else "no key avoids it (the reference's path differs from the policy's: a bug)"
    return (
        f"self-check failed: {c['check']} ({c['what']}): {measured(c)}, tolerance {c['tolerance']:g} for "
        f"{c['dtype']}; {fix} (self_check=false trains anyway)"
    )


def measured(c: dict) -> str:
    """A check's difference in words: its measure over the tokens it compared, then the other measure (largest: the
    largest mean per sequence)."""
    if not c["tokens"]:
        return "compared no scored token (nothing checked)"
    other = "mean" if c["measure"] == "largest" else "largest"
    return (
        f"{c['measure']} difference {c['difference']:.3g} nats per token over {c['tokens']} scored tokens, "
        f"{other} {c[other]:.3g}"
    )


def failure(run_dir) -> str:
    """The failure recorded in run_dir's report (the launcher of several processes reads it: they exit with code 4)."""
    return json.loads((run_dir / REPORT).read_text())["failure"]
