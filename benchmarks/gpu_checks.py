"""The GPU checks that matter most, in one entry point sized for a short GPU loan: each check runs with a time budget,
the budgets (with imports, model builds, compiles and a margin) sum to at most LIMIT_S on one H100, and one table
ends the run. The exit code is non-zero when a check failed or ran out of time.

    python benchmarks/gpu_checks.py                  # the default checks, on the first CUDA device
    python benchmarks/gpu_checks.py --dry-run        # the plan: each check, what it runs, its budget, the total
    python benchmarks/gpu_checks.py --only flex,mfu  # some of them (names or numbers)
    python benchmarks/gpu_checks.py --cpu            # the script's own check: tiny sizes on CPU, nothing measured

1. flex: a Llama-style model, FSDP2 in bf16 (a world of 1 over NCCL), prefix_sharing and padding_free: its packed,
   shared rows attend through FlexAttention, forward and backward (calls counted), and its first loss is ln 2.
2. self_check: the self-check on CUDA in bf16 at Llama-3's vocabulary and prompts longer than 300 tokens: a correct
   run passes (no false alarm), a run whose LM head output is scaled after the head (what the tiled head cannot know)
   stops with exit code 4 before any optimizer step, naming tiled_lm_head.
3. head_dtype: under BasicTrainer's bf16 autocast, the dtypes of the LM head's matmuls as each one is called
   (forward and backward), with tiled_lm_head true and false.
4. mfu: FSDP2 bf16 at the Llama-3.2-1B geometry, random weights built once: pairs/s, tokens/s and train.py's MFU
   over the steps after a warm-up.
5. qlora: DPO at the same geometry under BasicTrainer, LoRA r=16 on a bf16 base against QLoRA (the same with
   model.quantization=nf4): each one's peak memory, pairs/s after the warm-up and step-0 loss (ln 2: the reference is
   the base with the adapters off); QLoRA must peak lower. Opt-in (--only qlora) until a GPU run has measured it:
   the default checks fill LIMIT_S.
Opt-in, outside the budget: qlora and flex_tests (tests/gpu's Llama log-prob and FlexAttention tests). The long matrix
of every architecture, trainer and FSDP knob is benchmarks/gpu_check.sh, a separate opt-in script.

Each check runs as a child process leading a process group of its own; at its budget the whole group is killed
(os.killpg), so no training run, rank or pytest it started outlives it. Every train.py run is driven through
train.main with its command-line arguments, in the check's own process (as one torchrun rank for FSDPTrainer, so
the check's instruments see the ranks' work), on local random models with the toy tokenizer, offline, with
debug=true (no checkpoints written).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
# At most this much for the whole entry point on one H100: about half of a 15-minute loan, the rest for the
# machine's start and one rerun.
LIMIT_S = 480
MARGIN_S = 40  # the parent's CUDA probe, each child's start and the gaps between checks
CPU_BUDGET_FACTOR = 3  # --cpu: each H100 budget times this (tiny sizes, but CPU cores, perhaps shared)
ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "WANDB_MODE": "disabled",
    "TOKENIZERS_PARALLELISM": "false",
}
LLAMA3_VOCAB = 128256
LN2 = math.log(2)
COMMON = [  # every train.py run here: DPO, no W&B, no checkpoints, no sampling; tiled_lm_head is always given
    "loss=dpo",
    "optimizer=AdamW",
    "lr=1e-5",
    "warmup_steps=0",
    "n_epochs=null",
    "do_first_eval=false",
    "sample_during_eval=false",
    "wandb.enabled=false",
    "debug=true",
]
FSDP2_BF16 = ["trainer=FSDPTrainer", "fsdp.strategy=fsdp2", "fsdp.mixed_precision=bf16"]


@dataclass(frozen=True)
class Result:
    passed: bool
    numbers: str  # the key numbers, one line; a part that cannot apply on CPU says "n/a on CPU"


def train_args(work: Path, name: str, model: str, data: str, batch: int, steps: int, length: tuple, *extra) -> list:
    """train.py's arguments for a run of `steps` steps of `batch` pairs of at most `length` = (max_length,
    max_prompt_length) tokens, into work/runs/<name>."""
    return [
        f"model.name_or_path={work / 'models' / model}",
        f"datasets=[{data if data == 'toy' else work / 'data' / data}]",
        *COMMON,
        f"batch_size={batch}",
        f"eval_batch_size={batch}",
        f"n_eval_examples={batch}",
        f"n_examples={batch * steps}",
        f"eval_every={batch * steps}",
        f"max_length={length[0]}",
        f"max_prompt_length={length[1]}",
        f"local_dirs=[{work}]",
        f"run_dir={work / 'runs' / name}",
        *extra,
    ]


# What each check builds and runs: on one H100, and tiny on CPU (the script's own check, nothing measured). Checks 2
# and 3 use a small Llama with a large head; on the GPU it has Llama-3's vocabulary and the long prompts are past the
# ~261 columns at which the head check compared nothing at V=128256 (G1), with a control below; on CPU the vocabulary
# is cut to 8192 (the head's full logits are what costs there), which leaves both prompt lengths inside the cut.
SIZES = {
    "gpu": dict(
        llama="small",  # benchmarks/gpu_models.py's
        vocab=LLAMA3_VOCAB,
        hidden=512,
        mlp=1408,
        prompts=dict(short=200, long=320),
        mfu_geometry=dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
        ),
        mfu_vocab=LLAMA3_VOCAB,
        mfu_batch=8,
        mfu_steps=8,
        mfu_warmup=3,  # steps left out of the timing: cuBLAS and NCCL start, the allocator's growth, first calls
        mfu_length=(1024, 512),
        mfu_words=250,  # ~2 toy tokens a word: prompts and responses fill max_prompt_length and max_length
    ),
    "cpu": dict(
        llama="tiny",
        vocab=8192,
        hidden=64,
        mlp=128,
        prompts=dict(short=40, long=80),
        mfu_geometry=dict(
            hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
        ),
        mfu_vocab=512,
        mfu_batch=4,
        mfu_steps=3,
        mfu_warmup=1,
        mfu_length=(128, 64),
        mfu_words=30,
    ),
}


def sizes(cpu: bool) -> dict:
    return SIZES["cpu" if cpu else "gpu"]


def mode(cpu: bool) -> str:  # in model names: a work directory can hold both modes' models
    return "cpu" if cpu else "gpu"


# ---------- the checks: each (work, cpu) -> Result, in its own process; *_runs give the plan its arguments ----------
FLEX_STEPS = 4


def flex_runs(work: Path, cpu: bool) -> dict:
    packed = [*FSDP2_BF16, "prefix_sharing=true", "padding_free=true", "tiled_lm_head=true"]
    model = f"llama-{mode(cpu)}"
    return {"flex": train_args(work, "flex", model, "toy", 8, FLEX_STEPS, (256, 128), *packed)}


def check_flex(work: Path, cpu: bool) -> Result:
    """FlexAttention's forward and backward inside a real FSDP2 bf16 run, and the run's step-0 loss."""
    import torch
    from transformers.integrations import flex_attention

    import gpu_models

    build_model(work, f"llama-{mode(cpu)}", lambda: gpu_models.configs(sizes(cpu)["llama"])["llama"])
    calls = {"forward": 0, "forward_with_grad": 0, "backward": 0}
    forward = flex_attention.flex_attention_forward

    def backward_seen(grad):
        calls["backward"] += 1

    def counted(*args, **kwargs):
        out = forward(*args, **kwargs)
        calls["forward"] += 1
        if out[0].requires_grad:
            calls["forward_with_grad"] += 1
            out[0].register_hook(backward_seen)
        return out

    flex_attention.flex_attention_forward = counted  # logps looks it up on the module at each call
    try:
        code = train(flex_runs(work, cpu)["flex"], ranks=True)
    finally:
        flex_attention.flex_attention_forward = forward
    run = work / "runs" / "flex"
    losses = [r["loss/train"] for r in records(run) if "loss/train" in r]
    report = self_check_report(run)
    step0 = losses[0] if losses else math.nan
    finite = len(losses) == FLEX_STEPS and all(v is not None and math.isfinite(v) for v in losses)
    if torch.cuda.is_available():
        flex = f"FlexAttention {calls['forward']} forwards ({calls['forward_with_grad']} with grad), "
        flex += f"{calls['backward']} backwards"
        flex_ok = calls["forward_with_grad"] > 0 and calls["backward"] > 0
    else:  # packed rows keep the dense mask on CPU (logps.FLEX_DEVICES): nothing to count
        flex, flex_ok = f"FlexAttention n/a on CPU ({calls['forward']} calls: dense mask)", calls["forward"] == 0
    ln2 = abs(step0 - LN2) < 1e-2  # policy = reference at step 0, both in bf16
    numbers = (
        f"exit {code}; step-0 loss {step0:.6f} (ln 2 = {LN2:.6f}); {len(losses)} steps"
        f"{'' if finite else ' (NOT all finite)'}; {flex}; self-check {differences(report)}"
    )
    return Result(code == 0 and ln2 and finite and flex_ok and bool(report and report["passed"]), numbers)


HEAD_SCALE = 1.1  # the broken head: its output logits x this, after the head (as a wrong HEAD_POSTPROCESSING entry)


def self_check_runs(work: Path, cpu: bool) -> dict:
    prompts = sizes(cpu)["prompts"]
    lengths = {"self_check_correct": prompts["long"]}
    lengths |= {f"self_check_broken_{k}": n for k, n in prompts.items()}
    extra = [*FSDP2_BF16, "tiled_lm_head=true"]
    model, data = f"llama-head-{mode(cpu)}", "long_pairs.jsonl"
    # up to 32 response tokens after the prompt; 4 pairs: the self-check's probe (8 rows)
    return {name: train_args(work, name, model, data, 4, 1, (n + 32, n), *extra) for name, n in lengths.items()}


def check_self_check(work: Path, cpu: bool) -> Result:
    """No false alarm on a correct bf16 run; exit 4 before any step on a head scaled after the head's matmul, at
    prompts below and above the width G1's head check cut to."""
    import transformers

    build_model(work, f"llama-head-{mode(cpu)}", lambda: head_config(cpu), head_std=8.0)
    write_pairs(work / "data" / "long_pairs.jsonl", 16, prompt_words=250, response_words=40)
    runs = self_check_runs(work, cpu)
    prompts = sizes(cpu)["prompts"]
    correct, broken = "self_check_correct", [n for n in runs if n != "self_check_correct"]
    codes = {correct: train(runs[correct], ranks=True)}
    for name in broken:
        with scaled_heads(transformers, HEAD_SCALE):
            codes[name] = train(runs[name], ranks=True)
    report = self_check_report(work / "runs" / correct)
    passed = codes[correct] == 0 and bool(report and report["passed"])
    parts = [f"correct, prompts {prompts['long']}: exit {codes[correct]}, {differences(report)}"]
    for name in broken:
        run = work / "runs" / name
        report = self_check_report(run) or {}
        named = "tiled_lm_head" in (report.get("failure") or "")
        steps = sum("loss/train" in r for r in records(run))
        passed &= codes[name] == 4 and named and steps == 0
        head = next((c for c in report.get("checks", []) if c["check"] == "head"), {})
        stop = "stopped" if codes[name] == 4 else "NOT stopped"
        stop += "" if named or codes[name] != 4 else ", NOT naming tiled_lm_head"
        parts.append(
            f"head x{HEAD_SCALE}, prompts {prompts[name.rpartition('_')[2]]}: exit {codes[name]} ({stop}), head "
            f"{head.get('difference', math.nan):.2e}, {steps} steps"
        )
    return Result(passed, "; ".join(parts))


def head_dtype_runs(work: Path, cpu: bool) -> dict:
    autocast = ["trainer=BasicTrainer", "fsdp.mixed_precision=bf16", "self_check=false"]
    model = f"llama-head-{mode(cpu)}"
    return {
        f"head_dtype_tiled_{t}": train_args(
            work, f"head_dtype_tiled_{t}", model, "toy", 4, 2, (128, 64), *autocast, f"tiled_lm_head={t}"
        )
        for t in ("true", "false")
    }


def check_head_dtype(work: Path, cpu: bool) -> Result:
    """Each matmul with an operand of the vocabulary's size, as dispatched (after autocast's casts, backward
    included): its operands' dtypes. Under bf16 autocast both heads must run their matmuls in bf16."""
    build_model(work, f"llama-head-{mode(cpu)}", lambda: head_config(cpu), head_std=8.0)
    parts, passed = [], True
    for name, args in head_dtype_runs(work, cpu).items():
        with head_matmuls(sizes(cpu)["vocab"]) as seen:
            code = train(args, ranks=False)
        calls = ", ".join(f"{op} {' x '.join(dtypes)}: {n}" for (op, dtypes), n in sorted(seen.calls.items()))
        passed &= code == 0 and bool(seen.calls) and all(set(d) == {"bfloat16"} for _, d in seen.calls)
        parts.append(f"{name.removeprefix('head_dtype_')}: exit {code}, {calls or 'no head matmul seen'}")
    return Result(passed, "; ".join(parts))


def mfu_runs(work: Path, cpu: bool) -> dict:
    s = sizes(cpu)
    extra = [*FSDP2_BF16, "tiled_lm_head=true", "self_check=false"]  # the self-check is check 2's
    model, data = f"llama-1b-{mode(cpu)}", "mfu_pairs.jsonl"
    return {"mfu": train_args(work, "mfu", model, data, s["mfu_batch"], s["mfu_steps"], s["mfu_length"], *extra)}


def check_mfu(work: Path, cpu: bool) -> Result:
    """train.py's own throughput records of the steps after the warm-up: medians of pairs/s, tokens/s and MFU."""
    import torch

    s = sizes(cpu)
    model = build_model(work, f"llama-1b-{mode(cpu)}", lambda: llama_1b_config(cpu))
    write_pairs(work / "data" / "mfu_pairs.jsonl", 80, prompt_words=s["mfu_words"], response_words=s["mfu_words"])
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()  # the build's peak is not the run's
    code = train(mfu_runs(work, cpu)["mfu"], ranks=True)
    # the run's peak (its one rank is this process), to read against train.py --estimate's
    peak = f"peak allocated {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if torch.cuda.is_available() else ""
    steps = [r for r in records(work / "runs" / "mfu") if "throughput/pairs_per_second" in r]
    timed = steps[s["mfu_warmup"] :]
    median = lambda key: statistics.median(r[key] for r in timed) if timed else math.nan
    mfus = [r["throughput/mfu"] for r in timed if r.get("throughput/mfu") is not None]
    # train.py's convention (trainers.py): MFU = (6 + 2 for the live reference's forward) x N x tokens/s / (peak x
    # world size); N: the parameters outside the input embedding (the tied head is that embedding: not counted), no
    # attention FLOPs; peak: estimate.DEVICES' dense bf16 (H100, H200: 989 TFLOP/s)
    if mfus:
        mfu = f"MFU {100 * statistics.median(mfus):.1f}% (8 N FLOPs a token, N = {n_params(model) / 1e6:.0f}M)"
    else:
        mfu = "MFU n/a on CPU" if cpu else "MFU not logged (a GPU not in estimate.DEVICES: set peak_tflops)"
    finite = len(steps) == s["mfu_steps"] and all(r.get("loss/train") is not None for r in steps)
    numbers = (
        f"exit {code}; {len(timed)} steps timed after {s['mfu_warmup']}: "
        f"{median('throughput/pairs_per_second'):.2f} pairs/s, {median('throughput/tokens_per_second'):.0f} tokens/s, "
        f"{mfu}" + (f"; {peak}" if peak else "; peak memory n/a on CPU")
    )
    return Result(code == 0 and finite and bool(timed) and (cpu or bool(mfus)), numbers)


# LoRA on a bf16 base, its blocks recomputed (QLoRA's recipe: the weights then weigh in the peak, not activations)
QLORA = ["fsdp.model_dtype=bf16", "lora.r=16", "lora.alpha=32", "activation_checkpointing=true", "tiled_lm_head=true"]


def qlora_runs(work: Path, cpu: bool) -> dict:
    s = sizes(cpu)
    shape = (f"llama-1b-{mode(cpu)}", "mfu_pairs.jsonl", s["mfu_batch"], s["mfu_steps"], s["mfu_length"])
    return {
        "qlora_lora_bf16": train_args(work, "qlora_lora_bf16", *shape, *QLORA),
        "qlora_nf4": train_args(work, "qlora_nf4", *shape, *QLORA, "model.quantization=nf4"),
    }


def check_qlora(work: Path, cpu: bool) -> Result:
    """Each run's peak allocated memory (reset before it; this process is its one process), the median pairs/s of
    its steps after the warm-up and its step-0 loss. Passes when both runs end, start at ln 2 (float32) and QLoRA's
    peak is the lower one."""
    import gc

    import torch

    s = sizes(cpu)
    build_model(work, f"llama-1b-{mode(cpu)}", lambda: llama_1b_config(cpu))
    write_pairs(work / "data" / "mfu_pairs.jsonl", 80, prompt_words=s["mfu_words"], response_words=s["mfu_words"])
    parts, peaks, passed = [], {}, True
    for name, args in qlora_runs(work, cpu).items():
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        code = train(args, ranks=False)
        if torch.cuda.is_available():
            peaks[name] = torch.cuda.max_memory_allocated() / 2**30
        gc.collect()  # the run's models, before the next one's peak is measured
        torch.cuda.empty_cache()  # a no-op without CUDA
        steps = [r for r in records(work / "runs" / name) if "throughput/pairs_per_second" in r]
        timed = steps[s["mfu_warmup"] :]
        first = steps[0]["loss/train"] if steps else math.nan
        pairs = statistics.median(r["throughput/pairs_per_second"] for r in timed) if timed else math.nan
        passed &= code == 0 and len(steps) == s["mfu_steps"] and abs(first - LN2) < 1e-6
        passed &= all(math.isfinite(r["loss/train"]) for r in steps)
        peak = f"peak allocated {peaks[name]:.2f} GiB" if name in peaks else "peak memory n/a on CPU"
        parts.append(
            f"{name.removeprefix('qlora_')}: exit {code}, step-0 loss {first:.6f}, {pairs:.2f} pairs/s, {peak}"
        )
    if peaks:
        passed &= peaks["qlora_nf4"] < peaks["qlora_lora_bf16"]
    return Result(passed, "; ".join(parts))


FLEX_TESTS = [sys.executable, "-m", "pytest", "tests/gpu/test_gpu_runs.py", "-q", "-k", "llama and (flex or log_prob)"]


def check_flex_tests(work: Path, cpu: bool) -> Result:
    """tests/gpu's Llama log-prob paths (fp32, bf16) and FlexAttention test, a pytest of their own (on CPU they skip)."""
    out = subprocess.run(FLEX_TESTS, cwd=REPO, capture_output=True, text=True)
    print(out.stdout + out.stderr, flush=True)
    last = (out.stdout.strip().splitlines() or ["no output"])[-1]
    return Result(out.returncode == 0, ("n/a on CPU: " if cpu else "") + last)


@dataclass(frozen=True)
class Check:
    name: str
    budget_s: int | None  # seconds on one H100: imports, model builds, compiles and runs; None: not yet built
    what: str  # for the plan; {names} are the mode's SIZES
    run: Callable[[Path, bool], Result] | None
    runs: Callable[[Path, bool], dict] | None = None  # the train.py runs, for the plan
    default: bool = True  # in the default set (LIMIT_S); else opt-in by --only


CHECKS = [
    Check(
        "flex",
        150,
        "a random Llama (benchmarks/gpu_models.py, {llama}); FSDP2 bf16 (world 1), prefix_sharing and padding_free: "
        "FlexAttention's forward and backward calls counted, step-0 loss = ln 2, self-check passed",
        check_flex,
        flex_runs,
    ),
    Check(
        "self_check",
        110,
        "a random Llama at V={vocab} (head scaled to logits of std 8, as trained); FSDP2 bf16, tiled_lm_head=true: a "
        f"correct run passes; with the head's output x{HEAD_SCALE} (a forward hook set as transformers loads the "
        "model), prompts of {prompts[short]} and {prompts[long]} tokens: exit 4, no step, naming tiled_lm_head",
        check_self_check,
        self_check_runs,
    ),
    Check(
        "head_dtype",
        60,
        "the V={vocab} Llama under BasicTrainer with bf16 autocast, tiled_lm_head true and false: the operand dtypes "
        "of each matmul with a vocabulary-sized operand, recorded as dispatched (forward and backward)",
        check_head_dtype,
        head_dtype_runs,
    ),
    Check(
        "mfu",
        120,
        "random weights built once: hidden {mfu_geometry[hidden_size]}, {mfu_geometry[num_hidden_layers]} layers, "
        "{mfu_geometry[num_attention_heads]}/{mfu_geometry[num_key_value_heads]} heads, MLP "
        "{mfu_geometry[intermediate_size]}, V={mfu_vocab}, tied (on the GPU Llama-3.2-1B's geometry); "
        "FSDP2 bf16, {mfu_steps} steps of {mfu_batch} pairs x {mfu_length[0]} tokens: medians of pairs/s, tokens/s "
        "and MFU over the steps after the first {mfu_warmup}",
        check_mfu,
        mfu_runs,
    ),
    # Opt-in until measured on a GPU: the four default checks' budgets fill LIMIT_S, and taking its budget from them
    # needs their measured times
    Check(
        "qlora",
        90,
        "opt-in, outside the default budget: the mfu model and pairs under BasicTrainer, {mfu_steps} steps of "
        "{mfu_batch} pairs x {mfu_length[0]} tokens, LoRA r=16 on a bf16 base vs QLoRA (model.quantization=nf4): "
        "peak memory, median pairs/s after the first {mfu_warmup} steps, step-0 loss = ln 2; QLoRA peaks lower",
        check_qlora,
        qlora_runs,
        default=False,
    ),
    Check(
        "flex_tests",
        150,
        "opt-in, outside the default budget: pytest tests/gpu/test_gpu_runs.py -k '" + FLEX_TESTS[-1] + "'",
        check_flex_tests,
        default=False,
    ),
]


# ---------- what the checks share ----------
def train(args: list[str], ranks: bool) -> int:
    """train.main(args) in this process; `ranks`: as the one rank of a torchrun world of 1 (FSDPTrainer: NCCL on
    CUDA, gloo on CPU), so that what this process instruments is what the rank runs."""
    import utils

    import train as train_py

    world = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(utils.get_open_port()), RANK="0", LOCAL_RANK="0")
    keys = [*world, "WORLD_SIZE"]
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update({**world, "WORLD_SIZE": "1"} if ranks else {})
    try:
        print(f"train.py {' '.join(args)}", flush=True)
        return train_py.main(args)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        sys.stdout.flush()


@contextlib.contextmanager
def scaled_heads(transformers, factor: float):
    """Every model transformers loads gets a forward hook scaling its LM head's output by `factor`: the model's own
    forward runs it, the tiled head (which reads the head's weight) cannot. Set at the library, not in the project's
    modules, so it holds wherever the project's code moves."""
    from unittest import mock

    load = transformers.AutoModelForCausalLM.from_pretrained

    def loaded(*args, **kwargs):
        model = load(*args, **kwargs)
        model.get_output_embeddings().register_forward_hook(lambda module, inputs, out: out * factor)
        return model

    with mock.patch.object(transformers.AutoModelForCausalLM, "from_pretrained", loaded):
        yield


MATMULS = {"mm", "addmm", "addmm_", "bmm", "baddbmm"}  # as dispatched: F.linear and @ arrive as these


def head_matmuls(vocab: int):
    """A TorchDispatchMode counting (op, operand dtypes) of each matmul with an operand that has a dimension of
    `vocab`: the LM head's forward (n, H) x (H, V) and its backward (n, V) x (V, H), (V, n) x (n, H). Recorded as
    each one is dispatched, after autocast has cast the operands, so it is the dtype the matmul runs in; a record at
    F.linear would see the fp32 weight that autocast is about to cast."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class HeadMatmuls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            op = func.overloadpacket.__name__
            operands = [a for a in args if isinstance(a, torch.Tensor)][-2:]  # addmm's (bias, mat1, mat2): the last 2
            if op in MATMULS and any(vocab in a.shape for a in operands):
                key = (op, tuple(str(a.dtype).removeprefix("torch.") for a in operands))
                self.calls[key] = self.calls.get(key, 0) + 1
            return func(*args, **(kwargs or {}))

    return HeadMatmuls()


def build_model(work: Path, name: str, config: Callable, head_std: float | None = None) -> Path:
    """A random-weight model with the toy tokenizer (its 512 ids are valid in any larger vocabulary), built once in
    work/models/<name> (on the GPU where there is one) and kept for the checks after. `head_std`: the untied head
    scaled so that its logits have about this std, as a trained model's (a random head's logits are near 0, where a
    scaled head changes almost nothing)."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    path = work / "models" / name
    if (path / "config.json").exists():
        return path
    cfg = config()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    if head_std is not None:
        with torch.no_grad():
            model.lm_head.weight.normal_(0.0, head_std / cfg.hidden_size**0.5)  # final RMSNorm: unit-scale states
    partial = path.with_name(path.name + ".partial")  # a killed build leaves no model that looks whole
    model.to(torch.bfloat16).save_pretrained(partial)  # train.py loads it in its model dtype
    AutoTokenizer.from_pretrained(REPO / "toy" / "tiny-llama").save_pretrained(partial)
    os.replace(partial, path)
    del model
    torch.cuda.empty_cache()  # the run in this process loads its own copies (a no-op without CUDA)
    return path


def head_config(cpu: bool):
    """A small Llama with a large head (checks 2 and 3), untied."""
    from transformers import LlamaConfig

    s = sizes(cpu)
    return LlamaConfig(
        hidden_size=s["hidden"],
        intermediate_size=s["mlp"],
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=s["vocab"],
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
    )


def llama_1b_config(cpu: bool):
    """Llama-3.2-1B's geometry (tied embeddings, its RoPE base); tiny on CPU."""
    from transformers import LlamaConfig

    s = sizes(cpu)
    return LlamaConfig(
        **s["mfu_geometry"],
        vocab_size=s["mfu_vocab"],
        max_position_embeddings=131072,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=1,
    )


def n_params(model: Path) -> int:
    """train.py's N (trainers.flops_params) of the model's config, counted on the meta device."""
    import torch
    import trainers
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return trainers.flops_params(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model)))


WORDS = "rain snow cats mice chase winter white river stone light dark green field bird song over under".split()


def write_pairs(path: Path, n: int, prompt_words: int, response_words: int) -> None:
    """`n` random-word pairs as a .jsonl (train and test alike), prompts cueing the reply ("\\n\\nAssistant:": cut
    keep_end, so they keep max_prompt_length tokens); about 2 toy tokens a word."""
    if path.exists():
        return
    rng = random.Random(0)
    say = lambda k: " " + " ".join(rng.choice(WORDS) for _ in range(k))
    rows = [
        {
            "prompt": f"\n\nHuman:{say(prompt_words)}\n\nAssistant:",
            "chosen": say(response_words),
            "rejected": say(response_words),
        }
        for _ in range(n)
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def self_check_report(run_dir: Path) -> dict | None:
    path = run_dir / "self_check.json"
    return json.loads(path.read_text()) if path.exists() else None


def differences(report: dict | None) -> str:
    """The self-check's differences, one per check ('head 1.2e-02/0.2': difference over tolerance)."""
    if report is None:
        return "no self_check.json"
    parts = [f"{c['check']} {c['difference']:.1e}/{c['tolerance']:g}" for c in report["checks"] if "difference" in c]
    return ("passed: " if report["passed"] else "FAILED: ") + ", ".join(parts)


# ---------- the parent: plan, process groups, table ----------
def run_in_group(cmd: list[str], timeout_s: float, log: Path, env: dict | None = None) -> int | None:
    """`cmd` as the leader of a new session (its own process group), output to `log`; its exit code, or None when it
    ran past `timeout_s`. Then the whole group is killed: on a timeout the training run, ranks and pytest it started
    (subprocess.run(timeout=) kills only the direct child, and the GPU stays busy), after a normal exit whatever it
    left behind, on Ctrl-C or SIGTERM here (stop_on_signals) all of it: its own session does not get them."""
    with open(log, "w") as out:
        child = subprocess.Popen(
            cmd, cwd=REPO, env=env or ENV, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            return child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None
        finally:
            with contextlib.suppress(ProcessLookupError):  # none of the group left
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()


def stop_on_signals() -> None:
    """SIGTERM and SIGHUP (a scheduler's or a remote shell's end) raise here as Ctrl-C does, so that run_in_group
    kills the running check's group before this process exits; by default they would end it at once and leave the
    check, in its own session, running on the GPU."""

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stop)


def run_check(check: Check, work: Path, cpu: bool) -> tuple[str, str, float]:
    """(verdict, key numbers, seconds) of one check, run as a child process group with the check's budget."""
    log, result = work / f"{check.name}.log", work / f"{check.name}.json"
    cmd = [sys.executable, "-u", __file__, "--child", check.name, "--work", str(work)] + ["--cpu"] * cpu
    env = {**ENV, "CUDA_VISIBLE_DEVICES": ""} if cpu else ENV  # --cpu on a GPU node: train.py must not see the GPU
    print(f"[{check.name}] running, budget {budget(check, cpu)} s, log {log}", flush=True)
    start = time.time()
    code = run_in_group(cmd, budget(check, cpu), log, env)
    seconds = time.time() - start
    if code is None:
        verdict, numbers = "TIMEOUT", f"killed at its budget ({budget(check, cpu)} s) with its whole process group"
    elif result.exists():
        got = json.loads(result.read_text())
        verdict, numbers = ("pass" if got["passed"] else "FAIL"), got["numbers"]
    else:
        verdict, numbers = "FAIL", f"exit {code}: {last_error(log)}"
    print(f"[{check.name}] {verdict} in {seconds:.0f} s", flush=True)
    if verdict != "pass":  # the log's end, where the reason is
        print("".join(f"    {line}\n" for line in log.read_text().splitlines()[-15:]), end="", flush=True)
    return verdict, numbers, seconds


def budget(check: Check, cpu: bool) -> int | None:
    return None if check.budget_s is None else check.budget_s * (CPU_BUDGET_FACTOR if cpu else 1)


def last_error(log: Path) -> str:
    lines = log.read_text().splitlines() if log.exists() else []
    errors = [line for line in lines if "Error" in line or line.startswith("error:")]
    return (errors or lines or ["no output"])[-1][:200]


def selected(only: str | None) -> list[Check]:
    """The checks `--only` names (names or 1-based numbers, comma-separated), else the default set; a name that
    is not a check, or a check not yet built, is refused."""
    if only is None:
        return [c for c in CHECKS if c.default]
    by_name = {c.name: c for c in CHECKS} | {str(i): c for i, c in enumerate(CHECKS, 1)}
    picked = []
    for key in only.split(","):
        if key.strip() not in by_name:
            raise SystemExit(f"--only {only}: {key.strip()!r} is not a check; expected names or numbers of: " + names())
        picked.append(by_name[key.strip()])
    if unbuilt := [c.name for c in picked if c.run is None]:
        raise SystemExit(f"--only {only}: {', '.join(unbuilt)} is not yet built (a slot in CHECKS)")
    return picked


def names() -> str:
    return ", ".join(f"{i} {c.name}" for i, c in enumerate(CHECKS, 1))


def plan(checks: list[Check], cpu: bool) -> str:
    """The checks' plan: each one's content, its train.py runs (beyond COMMON) and budget; the total against
    LIMIT_S."""
    work = Path("$WORK")
    lines = [
        f"gpu_checks plan ({'CPU, tiny sizes' if cpu else 'one H100'}); every train.py run also gets: {' '.join(COMMON)}"
    ]
    for i, c in enumerate(CHECKS, 1):
        chosen = c in checks
        seconds = "-" if c.budget_s is None else f"{budget(c, cpu)} s"
        mark = "" if chosen else ("  (not selected)" if c.run is not None else "")
        lines.append(f"{i}. {c.name:<11} budget {seconds:>6}{mark}: {c.what.format(**sizes(cpu))}")
        for name, args in (c.runs(work, cpu) if c.runs else {}).items():
            lines.append(f"     {name}: train.py " + " ".join(a for a in args if a not in COMMON))
    total = sum(budget(c, cpu) for c in checks)
    if cpu:
        lines.append(f"total: {len(checks)} checks, budgets {total} s (each H100 budget x {CPU_BUDGET_FACTOR} on CPU)")
    else:
        verdict = "within" if total + MARGIN_S <= LIMIT_S else "OVER"
        lines.append(
            f"total: {len(checks)} checks, budgets {total} s + margin {MARGIN_S} s = {total + MARGIN_S} s "
            f"({(total + MARGIN_S) / 60:.1f} min), {verdict} the limit of {LIMIT_S} s"
        )
    return "\n".join(lines)


def table(rows: list[tuple[Check, str, str, float]], cpu: bool) -> str:
    lines = [f"{'check':<11} {'verdict':<8} {'seconds':>13}  key numbers"]
    for check, verdict, numbers, seconds in rows:
        lines.append(f"{check.name:<11} {verdict:<8} {f'{seconds:.0f} of {budget(check, cpu)}':>13}  {numbers}")
    return "\n".join(lines)


def cuda_devices() -> int:
    """CUDA devices, counted by a child process: the parent never holds a CUDA context the checks would share."""
    probe = [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"]
    out = subprocess.run(probe, capture_output=True, text=True, env=ENV, timeout=120)
    return int(out.stdout.strip() or 0)


def child(name: str, work: Path, cpu: bool) -> int:
    """One check, in this process (the leader of its group): its Result as work/<name>.json."""
    check = next(c for c in CHECKS if c.name == name)
    if not cpu:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: use --cpu or --dry-run")
    got = check.run(work, cpu)
    (work / f"{name}.json").write_text(json.dumps(dict(passed=got.passed, numbers=got.numbers)))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help=f"comma-separated names or numbers ({names()}); default: the default set")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and its time budget, run nothing")
    parser.add_argument("--cpu", action="store_true", help="tiny sizes on CPU: the script's own check")
    parser.add_argument("--work", type=Path, help="the work directory (models, data, runs, logs); default: a new one")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # set when the script runs one check itself
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child, args.work, args.cpu)
    checks = selected(args.only)
    if args.dry_run:
        print(plan(checks, args.cpu))
        return 0
    if not args.cpu and cuda_devices() < 1:
        print("error: no CUDA device: use --cpu or --dry-run", file=sys.stderr)
        return 2
    stop_on_signals()
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu_checks."))
    work.mkdir(parents=True, exist_ok=True)
    budgets = sum(budget(c, args.cpu) for c in checks)
    on = "CPU, tiny sizes" if args.cpu else "CUDA"
    print(f"gpu_checks: {', '.join(c.name for c in checks)} on {on}; budgets {budgets} s; work dir {work}", flush=True)
    rows = [(c, *run_check(c, work, args.cpu)) for c in checks]
    print(table(rows, args.cpu))
    failed = [c.name for c, verdict, _, _ in rows if verdict != "pass"]
    print(
        f"gpu_checks: {len(rows) - len(failed)} of {len(rows)} passed"
        + (f"; not: {', '.join(failed)}" if failed else "")
        + f"; work dir {work}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
