"""DPO training speed and memory: ours (train.py, BasicTrainer) against TRL's DPOTrainer, side by side.

One run of this script builds the workload, measures this machine's fp32 matmul peak, then trains each
variant in a fresh subprocess, alternating ours and TRL, and prints one table:

    python -u benchmarks/bench_dpo.py                       # everything: ~17 min on 2 idle CPU cores (TRL's variants
                                                            # are skipped when trl is not installed)
    python -u benchmarks/bench_dpo.py --which ours --rounds 1
    python -u benchmarks/bench_dpo.py --profile-only        # the one-step profile of ours, nothing else
    python -u benchmarks/bench_dpo.py --which ours --variants ours_best --trainer FSDPTrainer   # 2 ranks, FSDP2
    python -u benchmarks/bench_dpo.py --variants ours_best,ours_fsdp --rounds 3   # one process vs 2 ranks, alternating
    python -u benchmarks/bench_dpo.py --workload hh --variants ours_best,ours_shared --rounds 3   # prefix sharing A/B
    python -u benchmarks/bench_dpo.py --workload hh --layout-flops   # the work prefix sharing removes, by row layout

Order with the default --rounds 2: ours_best > trl_best > ours_padded > ours_online > ours_best > trl_best >
ours_padded > ours_online > ours_best (ours_best before and after each TRL run). Steps per run (warmup +
timed): ours_best 2+5, TRL 1+3 (a TRL step is ~35 s here), ours_padded/ours_online 1+3. A one-step
profile of ours_best follows when a goal is missed (--profile always|never to force).

Workload (built under --workdir, reused when already there):
  - model: a Llama-style causal LM with random weights, 49.5M parameters (hidden 512, 4 layers, 8 heads,
    MLP 2048, vocab 32000, untied head), saved with save_pretrained, fp32 everywhere;
  - tokenizer: a WordLevel tokenizer with exactly 32000 entries (<unk> <s> </s> <pad> w4 ... w31999),
    Llama-style (BOS prepended), saved as a PreTrainedTokenizerFast; one word = one token, which makes
    sequence lengths exact by construction;
  - data: 8 pairs {prompt, chosen, rejected} per step of a run; EVERY step holds 7 short pairs (60-150
    tokens per sequence) and 1 long pair (470-510 tokens per sequence): length-skewed, and the same mix in
    every step, so warmup and timed steps cost alike. Both trainers see exactly the same 8 pairs at each
    step: for a run of k steps, the rows of pairs_k.jsonl are placed where our shuffle (seed 0) of k*8 rows
    reads them (checked against preference_datasets' own iterator at start), and TRL reads the same pairs
    in step order (pairs_k_in_step_order.jsonl) with train_sampling_strategy="sequential". Each side
    precomputes reference log-probs for exactly the pairs it trains on.

Variants (each a fresh process; peak RSS = the child's ru_maxrss from wait4, i.e. its VmHWM):
  ours_best    train.py padding_free=true precompute_ref_log_probs=true tiled_lm_head=true (defaults otherwise)
  ours_padded  the same with padding_free=false                                  (P4: padding-free speedup)
  ours_online  the same with precompute_ref_log_probs=false (reference forward every step)  (P5)
  ours_fsdp    ours_best under FSDPTrainer (2 ranks, --fsdp-strategy) on the same cores and global batch, with the
               steps of ours_best (P6: its pairs/s over ours_best's; the per-round ratios pair the runs of one round,
               which ran back to back)
  ours_shared  ours_best with prefix_sharing=true; ours_fsdp_shared: ours_fsdp with it (P7, P8: pairs/s and peak
               RSS over the unshared variant's, per round; goal 1.15x on the skewed workload, 1.4x on --workload hh)
  trl_best     DPOTrainer, precompute_ref_log_probs=True, padding_free=True (TRL 1.16 warns and falls back
               to padding: recorded), its always-on fused LM head, optim=adamw_torch_fused (its default),
               gradient_checkpointing=False (TRL's default True recomputes the forward: slower), fp32
  trl_online   (optional, --variants) TRL without precompute

Timing. Steps are timed end to end, loop iteration to loop iteration (data collation, forward, backward,
clip, optimizer, logging), excluding startup and the reference precompute pass (reported separately):
  ours: from run_dir/metrics.jsonl, logged every step (minimum_log_interval_secs=0); each record has
        step = pairs seen and examples_per_second = step / (seconds since the loop started), so the end
        time of step k is exactly step_k / examples_per_second_k and a step lasts the difference of two.
  TRL:  a TrainerCallback; a step lasts from one on_step_end to the next (the first from on_train_begin).
        on_step_begin -> on_step_end (the compute part only) is reported as well.
The warmup steps of every run are dropped; the rest of all rounds are pooled (median and mean). The
reference precompute pass is timed from our own progress lines ("reference log-probs of train" to "... of
test": the train split only) and, for TRL, around DPOTrainer._precompute_ref_logps; shown as pairs/s.

MFU (P3): model FLOPs per step / step time / peak, peak = the best fp32 torch.mm throughput on this
machine (square 1024-4096, 2 threads) measured in this run. Model FLOPs count real (non-pad) tokens only:
6 N per trained token (N = all parameters but the input embedding: the layers and the LM head) + causal
attention 12 h s(s+1)/2 per layer and sequence of s tokens, plus 2 N + 4 h s(s+1)/2 per layer per
reference token when the reference runs online (0 when precomputed). "exec" is the same with the LM head
counted only on the positions that are scored (the response tokens), i.e. what a tiled head must compute.
Both are this script's own count (train.py logs throughput/mfu only for GPUs of known peak).

This machine may be shared: every run reports the CPU time used by other processes while it ran
("bg cores"), from /proc/stat minus the child's own CPU time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
GIB = 1024**3
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "WANDB_MODE": "disabled",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
}

MODEL = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=2048,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)
BATCH = 8
MAX_LENGTH, MAX_PROMPT_LENGTH = 512, 256
SHORT_PER_STEP, LONG_PER_STEP = 7, 1
SEED = 0

OURS_VARIANTS = {
    "ours_best": dict(padding_free=True, precompute=True),
    "ours_padded": dict(padding_free=False, precompute=True),
    "ours_online": dict(padding_free=True, precompute=False),
    # ours_best under FSDPTrainer (--fsdp-strategy, 2 ranks): with ours_best in --variants the two alternate, and
    # the report prints their ratio round by round (the sharding overhead on the same cores and global batch)
    "ours_fsdp": dict(padding_free=True, precompute=True, trainer="FSDPTrainer"),
    # prefix_sharing=true on top of ours_best, and of ours_fsdp (P7, P8: their pairs/s over the unshared variant's)
    "ours_shared": dict(padding_free=True, precompute=True, shared=True),
    "ours_fsdp_shared": dict(padding_free=True, precompute=True, trainer="FSDPTrainer", shared=True),
}
LONG_RUNS = (
    "ours_best",
    "ours_fsdp",
    "ours_shared",
    "ours_fsdp_shared",
)  # --warmup + --steps; the other variants of ours: --aux-warmup + --aux-steps
TRL_VARIANTS = {"trl_best": dict(precompute=True), "trl_online": dict(precompute=False)}
PROFILE_STEPS = 4  # the profile's run: 2 untimed steps, 1 timed by phase, 1 under torch.profiler


# ---------------------------------------------------------------------------------------------------------
# The workload
# ---------------------------------------------------------------------------------------------------------
def build_tokenizer(out: Path, vocab_size: int = MODEL["vocab_size"]):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    fast.save_pretrained(out)
    return fast


def words(rng, n: int) -> str:
    # Zipf-like ids over the 31996 ordinary words: a few frequent, a long tail (looks like text to the model).
    ids = 4 + (rng.zipf(1.2, size=n) - 1) % (MODEL["vocab_size"] - 4)
    return " ".join(f"w{i}" for i in ids)


def design_pairs(n_steps: int, seed: int, workload: str = "skewed") -> list[dict]:
    """Pairs in step order. skewed: each step = SHORT_PER_STEP short pairs and LONG_PER_STEP long pairs (shuffled
    within the step); lengths are in tokens of the whole sequence: BOS + prompt + response + EOS. hh: HH-shaped,
    multi-turn prompts of 180-380 tokens ("Human: ... Assistant: ..." turns) before responses of 40-110 tokens:
    the prompt is on average ~3.7x a response."""
    import numpy as np

    rng = np.random.default_rng(seed)
    pairs, seen = [], set()
    for step in range(n_steps):
        kinds = ["short"] * SHORT_PER_STEP + ["long"] * LONG_PER_STEP if workload == "skewed" else ["hh"] * BATCH
        rng.shuffle(kinds)
        for kind in kinds:
            while True:
                if kind == "hh":
                    p = int(rng.integers(180, 381))
                    lo, hi = 40, 110
                elif kind == "short":
                    p = int(rng.integers(15, 46))
                    lo, hi = max(1, 60 - 2 - p), 150 - 2 - p
                else:
                    p = int(rng.integers(180, 241))
                    lo, hi = 470 - 2 - p, 510 - 2 - p
                c, r = (int(x) for x in rng.integers(lo, hi + 1, size=2))
                prompt = words(rng, p)
                if prompt in seen:
                    continue
                chosen, rejected = " " + words(rng, c), " " + words(rng, r)
                if chosen != rejected:
                    break
            seen.add(prompt)
            pairs.append(dict(prompt=prompt, chosen=chosen, rejected=rejected, kind=kind, step=step, tokens=(p, c, r)))
    return pairs


def our_order(n: int) -> list[list[int]]:
    """The row indices of each of our training batches (train.py seed 0, one epoch, batch 8)."""
    from preference_datasets import iter_batch_indices

    return list(iter_batch_indices(n, batch_size=BATCH, shuffle=True, seed=SEED, n_examples=n))


def build_workload(workdir: Path, n_steps: int, sizes: list[int], workload: str = "skewed") -> dict:
    """Model dir, tokenizer, data files; returns the per-step token statistics used for FLOPs.

    For each run length k in `sizes` (steps): pairs_k.jsonl (the designed steps 0..k-1, each row where our
    shuffle of k*8 rows reads it) and pairs_k_in_step_order.jsonl (the same pairs in step order, for TRL)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    model_dir = workdir / "model"
    meta_path = workdir / "workload.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if (
            meta.get("n_steps") == n_steps
            and meta.get("workload", "skewed") == workload
            and (model_dir / "config.json").exists()
            and all(str(k) in meta["data"] for k in sizes)
        ):
            return meta
    shutil.rmtree(model_dir, ignore_errors=True)
    model_dir.mkdir(parents=True)
    build_tokenizer(model_dir)
    torch.manual_seed(SEED)
    config = LlamaConfig(**MODEL, bos_token_id=1, eos_token_id=2, pad_token_id=3)
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(model_dir, safe_serialization=True)
    del model

    pairs = design_pairs(n_steps, SEED, workload)
    fields = ("prompt", "chosen", "rejected")
    data, in_order = {}, {}
    for k in sorted(set(sizes)):
        mine = pairs[: k * BATCH]
        rows = [None] * len(mine)
        for j, row in enumerate(
            i for b in our_order(len(mine)) for i in b
        ):  # designed pair j goes where our j-th draw reads
            rows[row] = mine[j]
        assert all(r is not None for r in rows)
        data[str(k)], in_order[str(k)] = (
            str(workdir / f"pairs_{k}.jsonl"),
            str(workdir / f"pairs_{k}_in_step_order.jsonl"),
        )
        Path(data[str(k)]).write_text("".join(json.dumps({f: r[f] for f in fields}) + "\n" for r in rows))
        Path(in_order[str(k)]).write_text("".join(json.dumps({f: p[f] for f in fields}) + "\n" for p in mine))

    # token counts with the real tokenizer, as train.py builds sequences: BOS + prompt + response + EOS
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert len(tok) == MODEL["vocab_size"], len(tok)
    steps = []
    for s in range(n_steps):
        seqs = []
        for p in pairs[s * BATCH : (s + 1) * BATCH]:
            n_prompt = len(tok(p["prompt"])["input_ids"])  # BOS included
            for side in ("chosen", "rejected"):
                n_resp = len(tok(p[side], add_special_tokens=False)["input_ids"]) + 1  # + EOS
                assert n_resp - 1 == p["tokens"][1 if side == "chosen" else 2]
                seqs.append([n_prompt, n_resp])
        steps.append(seqs)
    meta = dict(
        n_steps=n_steps,
        workload=workload,
        n_pairs=len(pairs),
        n_params=n_params,
        model_dir=str(model_dir),
        data=data,
        data_in_step_order=in_order,
        steps=steps,
    )
    meta_path.write_text(json.dumps(meta))
    return meta


def verify_our_batches(meta: dict, workdir: Path) -> str:
    """Check that our batch iterator yields the designed steps (same prompts), using a scratch cache."""
    try:
        import preference_datasets as pd
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(meta["model_dir"])
        for k, path in meta["data"].items():
            designed = [json.loads(line)["prompt"] for line in open(meta["data_in_step_order"][k])]
            examples = pd.load_tokenized(
                [path],
                tok,
                "train",
                max_length=MAX_LENGTH,
                max_prompt_length=MAX_PROMPT_LENGTH,
                cache_dir=str(workdir / "verify_cache"),
            )
            it = pd.get_batch_iterator(
                examples, tok.pad_token_id, batch_size=BATCH, shuffle=True, seed=SEED, n_examples=len(designed)
            )
            for s, batch in enumerate(it):
                if sorted(batch["prompt"]) != sorted(designed[s * BATCH : (s + 1) * BATCH]):
                    return f"MISMATCH in pairs_{k}.jsonl at step {s}: our batches differ from the designed order"
        shutil.rmtree(workdir / "verify_cache", ignore_errors=True)
        return "ok: our batches = the designed steps = TRL's batches (every data file checked)"
    except Exception as e:
        return f"not verified ({type(e).__name__}: {e})"


# ---------------------------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------------------------
def step_flops(seqs: list[list[int]], n_params: int, online_reference: bool, shared: bool = False) -> dict:
    """seqs: [prompt, response] tokens of each sequence, chosen then rejected of each pair. shared (prefix sharing):
    each pair's prompt counted once; its rejected attends to the prompt and to itself."""
    h, L, V = MODEL["hidden_size"], MODEL["num_hidden_layers"], MODEL["vocab_size"]
    n = n_params - V * h  # everything but the input embedding (a lookup, no matmul)
    n_head = V * h
    tokens = sum(p + r for p, r in seqs) - shared * sum(p for p, _ in seqs[1::2])
    scored = sum(r for _, r in seqs)  # positions whose next token is scored (response incl. EOS)
    pairs_causal = sum((p + r) * (p + r + 1) / 2 for p, r in seqs)  # attended (query, key) pairs
    pairs_causal -= shared * sum(p * (p + 1) / 2 for p, _ in seqs[1::2])  # the rejected's prompt, computed once
    attn_fwd = 4 * h * pairs_causal * L
    train = 6 * n * tokens + 3 * attn_fwd
    ref = (2 * n * tokens + attn_fwd) if online_reference else 0.0
    executed = 6 * (n - n_head) * tokens + 6 * n_head * scored + 3 * attn_fwd
    executed_ref = (2 * (n - n_head) * tokens + 2 * n_head * scored + attn_fwd) if online_reference else 0.0
    return dict(
        model=train + ref,
        executed=executed + executed_ref,
        tokens=tokens,
        scored=scored,
        padded_slots=len(seqs) * max(p + r for p, r in seqs),
    )


LAYOUTS = (
    "rows of max_length, dense mask (CPU; eager attention)",
    "rows of max_length, block-sparse attention (CUDA FlexAttention)",
    "one row a step, block-sparse attention (no padding)",
)


def layout_flops(meta: dict) -> list[tuple[str, float, float]]:
    """(layout, unshared, shared) executed GFLOP of one policy forward + backward, mean over the workload's steps:
    layers on every slot of the rows (padding included), the LM head on scored positions only (tiled), attention
    on each row's whole T x T where the mask is dense (the kernel computes masked pairs too), else only on the
    (query, key) pairs the mask allows (block granularity ignored). Rows as packing.packed_rows packs them, to
    max_length (a shared pair longer than that widens every row of its step), all 8 pairs of a step in one process.
    What it shows: how much work prefix sharing removes in each layout; a device's timing follows it only as far
    as its kernels run every shape equally fast."""
    from packing import packed_rows

    h, L, V = MODEL["hidden_size"], MODEL["num_hidden_layers"], MODEL["vocab_size"]
    layer, attention = 6 * (meta["n_params"] - 2 * V * h), 3 * 4 * h * L  # untied: input embedding + LM head
    totals = {(lay, shared): 0.0 for lay in LAYOUTS for shared in (False, True)}
    for seqs in meta["steps"]:
        for shared in (False, True):
            units = [c[0] + c[1] + r[1] for c, r in zip(seqs[0::2], seqs[1::2])] if shared else [p + r for p, r in seqs]
            f = step_flops(seqs, meta["n_params"], False, shared)
            allowed = sum((p + r) * (p + r + 1) / 2 for p, r in seqs) - shared * sum(
                p * (p + 1) / 2 for p, _ in seqs[1::2]
            )
            rows = packed_rows(units, MAX_LENGTH)
            width = max(sum(units[u] for u in row) for row in rows)
            slots, squares = len(rows) * width, len(rows) * width**2
            head = 6 * V * h * f["scored"]
            for lay, flops in zip(
                LAYOUTS,
                (
                    layer * slots + attention * squares,
                    layer * slots + attention * allowed,
                    layer * f["tokens"] + attention * allowed,
                ),
            ):
                totals[lay, shared] += (flops + head) / 1e9 / len(meta["steps"])
    return [(lay, totals[lay, False], totals[lay, True]) for lay in LAYOUTS]


def layout_lines(meta: dict) -> list[str]:
    lines = [
        f"{'executed GFLOP per step by layout (policy forward + backward)':<66} {'unshared':>9} {'shared':>9} {'ratio':>7}"
    ]
    lines += [f"{lay:<66} {u:>9.1f} {s:>9.1f} {u / s:>6.3f}x" for lay, u, s in layout_flops(meta)]
    return lines


# ---------------------------------------------------------------------------------------------------------
# Machine: matmul peak and background load
# ---------------------------------------------------------------------------------------------------------
def busy_seconds() -> float:
    """CPU seconds all processes have spent busy (user+nice+system+irq+softirq+steal), machine-wide."""
    parts = open("/proc/stat").readline().split()[1:]
    v = [int(x) for x in parts]
    busy = v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)
    return busy / os.sysconf("SC_CLK_TCK")


def wait_for_quiet(max_wait: float, threshold: float = 0.3, window: float = 2.0) -> tuple[float, float]:
    """Wait (up to max_wait s) until other processes use < threshold cores over a window; (waited, last bg)."""
    t0 = time.perf_counter()
    bg = 0.0
    while True:
        b0, c0, w0 = busy_seconds(), time.process_time(), time.perf_counter()
        time.sleep(window)
        bg = max(0.0, (busy_seconds() - b0 - (time.process_time() - c0)) / (time.perf_counter() - w0))
        if bg < threshold or time.perf_counter() - t0 >= max_wait:
            return time.perf_counter() - t0, bg


def matmul_peak(seconds_per_size: float = 3.0) -> dict:
    import torch

    torch.set_num_threads(os.cpu_count() or 2)
    out = {}
    b0, w0 = busy_seconds(), time.perf_counter()
    c0 = time.process_time()
    for n in (1024, 2048, 4096):
        a, b = torch.randn(n, n), torch.randn(n, n)
        torch.mm(a, b)
        rates = []
        end = time.perf_counter() + seconds_per_size
        while time.perf_counter() < end or len(rates) < 3:
            t = time.perf_counter()
            torch.mm(a, b)
            rates.append(2 * n**3 / (time.perf_counter() - t))
        out[n] = dict(best=max(rates), median=statistics.median(rates))
    wall = time.perf_counter() - w0
    bg = max(0.0, (busy_seconds() - b0 - (time.process_time() - c0)) / wall)
    peak = max(v["best"] for v in out.values())
    return dict(peak=peak, sizes=out, bg_cores=bg, threads=torch.get_num_threads())


# ---------------------------------------------------------------------------------------------------------
# Running one variant in a fresh process
# ---------------------------------------------------------------------------------------------------------
class ChildRun:
    """Popen + timestamped output (chunks split on \\r and \\n) + wait4 rusage + background CPU."""

    def __init__(self, cmd: list[str], log: Path, timeout: float):
        self.cmd, self.log_path, self.timeout = cmd, log, timeout
        self.lines: list[tuple[float, str]] = []

    def run(self) -> dict:
        env = dict(os.environ, **OFFLINE_ENV)
        busy0, t0 = busy_seconds(), time.perf_counter()
        p = subprocess.Popen(self.cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        timer = threading.Timer(self.timeout, lambda: p.kill())  # only our own child, by its handle
        timer.start()
        buf = b""
        with open(self.log_path, "wb") as log:
            while True:
                chunk = os.read(p.stdout.fileno(), 65536)
                if not chunk:
                    break
                now = time.perf_counter() - t0
                log.write(chunk)
                buf += chunk
                *parts, buf = re.split(rb"[\r\n]", buf)
                self.lines += [(now, x.decode(errors="replace")) for x in parts if x.strip()]
        if buf.strip():
            self.lines.append((time.perf_counter() - t0, buf.decode(errors="replace")))
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        timer.cancel()
        wall = time.perf_counter() - t0
        child_cpu = usage.ru_utime + usage.ru_stime
        bg = max(0.0, (busy_seconds() - busy0 - child_cpu) / wall)
        return dict(
            rc=p.returncode,
            wall=wall,
            peak_rss_gib=usage.ru_maxrss * 1024 / GIB,
            child_cpu=child_cpu,
            child_sys=usage.ru_stime,
            bg_cores=bg,
            timed_out=wall >= self.timeout,
        )

    def first(self, pattern: str):
        rx = re.compile(pattern)
        return next((t for t, line in self.lines if rx.search(line)), None)

    def tail(self, n: int = 25) -> str:
        return "\n".join(line for _, line in self.lines[-n:])


def our_args(
    data: str,
    n_pairs: int,
    model_dir: str,
    padding_free: bool,
    precompute: bool,
    trainer: str,
    local_dir: Path,
    run_dir: Path,
    shared: bool = False,
) -> list[str]:
    """train.py's arguments for a run of ours (and the profile's trainer): DPO, AdamW, evaluation only at the end."""
    return [
        "loss=dpo",
        f"datasets=[{data}]",
        f"model.name_or_path={model_dir}",
        "model.reference_dtype=float32",
        f"trainer={trainer}",
        "optimizer=AdamW",
        f"batch_size={BATCH}",
        f"eval_batch_size={BATCH}",
        f"max_length={MAX_LENGTH}",
        f"max_prompt_length={MAX_PROMPT_LENGTH}",
        "sample_during_eval=false",
        "do_first_eval=false",
        "n_eval_examples=8",
        f"eval_every={BATCH * 100000}",
        "wandb.enabled=false",
        "fsdp.use_torch_compile=false",
        "debug=true",
        "n_epochs=null",
        f"n_examples={n_pairs}",
        "warmup_steps=0",
        "minimum_log_interval_secs=0",
        "tiled_lm_head=true",
        f"padding_free={str(padding_free).lower()}",
        f"precompute_ref_log_probs={str(precompute).lower()}",
        f"prefix_sharing={str(shared).lower()}",
        f"seed={SEED}",
        f"local_dirs=[{local_dir}]",
        f"run_dir={run_dir}",
    ]


def run_length(name: str, args) -> tuple[int, int]:
    """(warmup, timed) steps of each run of variant `name`."""
    if name in TRL_VARIANTS:
        return args.trl_warmup, args.trl_steps
    return (args.warmup, args.steps) if name in LONG_RUNS else (args.aux_warmup, args.aux_steps)


def run_variant(name: str, meta: dict, workdir: Path, round_idx: int, args) -> dict:
    """One run of `name` in a fresh process and a fresh runs/<name>_r<round> directory."""
    rdir = workdir / "runs" / f"{name}_r{round_idx}"
    shutil.rmtree(rdir, ignore_errors=True)
    rdir.mkdir(parents=True)
    warmup, timed = run_length(name, args)
    res = (run_trl if name in TRL_VARIANTS else run_ours)(name, meta, rdir, args, warmup + timed)
    res.update(
        name=name,
        round=round_idx,
        warmup=warmup,
        n_steps=warmup + timed,
        log=str(rdir / "output.log"),
        precompute_pairs=(warmup + timed) * BATCH,
    )
    return res


def run_ours(name: str, meta: dict, rdir: Path, args, n_steps: int) -> dict:
    spec, n = OURS_VARIANTS[name], n_steps * BATCH
    trainer = spec.get("trainer", args.trainer)
    cmd = [
        sys.executable,
        "-u",
        "train.py",
        *our_args(
            meta["data"][str(n_steps)],
            n,
            meta["model_dir"],
            spec["padding_free"],
            spec["precompute"],
            trainer,
            rdir / "cache",
            rdir / "run",
            spec.get("shared", False),
        ),
        *([f"fsdp.strategy={args.fsdp_strategy}"] if trainer == "FSDPTrainer" else []),
        f"exp_name={name}",
        *args.set,
    ]
    child = ChildRun(cmd, rdir / "output.log", args.run_timeout)
    res = dict(child.run(), side="ours", cmd=" ".join(cmd), timing_method="metrics.jsonl")
    # per-step end times from metrics.jsonl (exact: step / examples_per_second; eval records have neither)
    mfile = rdir / "run" / "metrics.jsonl"
    records = [json.loads(line) for line in mfile.read_text().splitlines()] if mfile.exists() else []
    ends = [r["step"] / r["examples_per_second"] for r in records if r.get("examples_per_second")]
    if res["rc"] != 0 or len(ends) != n_steps:
        res["error"] = f"{len(ends)} of {n_steps} steps in {mfile}\n{child.tail()}"
        return res
    res["step_times"] = [b - a for a, b in zip([0.0] + ends[:-1], ends)]
    # the reference precompute pass, from our progress lines: the train split, then the eval split
    t_train, t_test = child.first(r"reference log-probs of train"), child.first(r"reference log-probs of test")
    t_done = child.first(r"reference log-probs ready")
    if t_train is not None and t_test is not None:
        res["precompute_train_s"] = t_test - t_train
    if t_train is not None and t_done is not None:
        res["precompute_all_s"] = t_done - t_train
    res["startup_s"] = child.first(r"batch geometry")
    return res


def run_trl(name: str, meta: dict, rdir: Path, args, n_steps: int) -> dict:
    child_spec = dict(
        TRL_VARIANTS[name],
        model_dir=meta["model_dir"],
        data=meta["data_in_step_order"][str(n_steps)],
        out=str(rdir),
        max_steps=n_steps,
        optim=args.trl_optim,
        gradient_checkpointing=args.trl_gradient_checkpointing,
        padding_free=args.trl_padding_free,
    )
    cmd = [sys.executable, "-u", str(Path(__file__).resolve()), "--_child", "trl", "--_spec", json.dumps(child_spec)]
    child = ChildRun(cmd, rdir / "output.log", args.run_timeout)
    res = dict(child.run(), side="trl", cmd=" ".join(cmd[:4]) + " '<spec>'", spec=child_spec)
    out = rdir / "result.json"
    if res["rc"] != 0 or not out.exists():
        res["error"] = child.tail()
        return res
    r = json.loads(out.read_text())
    res.update(
        step_times=r["step_times"],
        compute_times=r["compute_times"],
        precompute_train_s=r.get("precompute_s"),
        timing_method="TrainerCallback on_step_end -> on_step_end",
        startup_s=r.get("startup_s"),
        trl_notes=r.get("notes", []),
    )
    return res


def trl_child(spec: dict) -> None:
    """Runs in a fresh process: TRL's DPOTrainer on the workload; writes result.json."""
    t_start = time.perf_counter()
    import warnings
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    notes = []
    out = Path(spec["out"])

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.begin, self.end, self.train_begin = [], [], None

        def on_train_begin(self, args, state, control, **kw):
            self.train_begin = time.perf_counter()

        def on_step_begin(self, args, state, control, **kw):
            self.begin.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            self.end.append(time.perf_counter())

    precompute_s = []
    original = DPOTrainer._precompute_ref_logps

    def timed_precompute(self, dataset, name, batch_size):
        t = time.perf_counter()
        result = original(self, dataset, name, batch_size)
        precompute_s.append(time.perf_counter() - t)
        return result

    DPOTrainer._precompute_ref_logps = timed_precompute
    tok = AutoTokenizer.from_pretrained(spec["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    ds = load_dataset("json", data_files=spec["data"], split="train", cache_dir=str(out / "hf_datasets"))
    config = DPOConfig(
        output_dir=str(out / "trl_out"),
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=1,
        max_length=MAX_LENGTH,
        max_steps=spec["max_steps"],
        learning_rate=5e-7,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=10.0,
        optim=spec["optim"],
        beta=0.1,
        loss_type=["sigmoid"],
        precompute_ref_log_probs=spec["precompute"],
        precompute_ref_batch_size=BATCH,
        padding_free=spec["padding_free"],
        gradient_checkpointing=spec["gradient_checkpointing"],
        bf16=False,
        fp16=False,
        use_cpu=True,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        train_sampling_strategy="sequential",
        seed=SEED,
    )
    timer = StepTimer()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = DPOTrainer(
            model=model, ref_model=None, args=config, train_dataset=ds, processing_class=tok, callbacks=[timer]
        )
    for w in caught:
        text = str(w.message)
        if "padding_free" in text or "padding-free" in text:
            notes.append(f"TRL warning: {text.strip()[:300]}")
    if spec["padding_free"] and not getattr(trainer, "padding_free", False):
        notes.append("TRL padding_free=True was turned off by DPOTrainer (falls back to padding)")
    notes.append(
        f"TRL optimizer: {spec['optim']}; gradient_checkpointing={spec['gradient_checkpointing']}; "
        "fused LM head: always on in TRL 1.16 (add_fused_lm_head)"
    )
    notes.append(
        f"TRL model.is_gradient_checkpointing={getattr(trainer.model, 'is_gradient_checkpointing', '?')}, "
        f"attn_implementation={trainer.model.config._attn_implementation}, precompute={spec['precompute']}"
    )
    startup = time.perf_counter() - t_start
    trainer.train()
    ends = [timer.train_begin] + timer.end
    result = dict(
        step_times=[b - a for a, b in zip(ends[:-1], ends[1:])],
        compute_times=[e - b for b, e in zip(timer.begin, timer.end)],
        precompute_s=sum(precompute_s) if precompute_s else None,
        startup_s=startup,
        notes=notes,
    )
    (out / "result.json").write_text(json.dumps(result))
    print(json.dumps(result))


# ---------------------------------------------------------------------------------------------------------
# Profile of one step of ours (in a fresh process)
# ---------------------------------------------------------------------------------------------------------
def profile_child(spec: dict) -> None:
    """Builds our trainer as train.py does, runs 2 steps, then times one step by phase (wall clock) and
    profiles one more with torch.profiler for the LM head, attention and matmul shares."""
    import tempfile

    os.chdir(REPO)
    from torch.profiler import ProfilerActivity, profile, record_function
    import tiled_head
    import trainers
    from config_loader import load_config
    from train import load_models
    from utils import seed_everything

    tmp = Path(tempfile.mkdtemp(prefix="bench_profile_"))
    cfg, _ = load_config(
        our_args(
            spec["data"],
            spec["n_pairs"],
            spec["model_dir"],
            spec["padding_free"],
            True,
            "BasicTrainer",
            tmp,
            tmp / "run",
        )
    )
    seed_everything(cfg.seed, cfg.fsdp.full_determinism)
    tokenizer, policy, reference = load_models(cfg)
    trainer = trainers.BasicTrainer(
        policy, cfg, cfg.seed, str(tmp / "run"), reference_model=reference, tokenizer=tokenizer
    )
    trainer.build_optimizer()
    if cfg.precompute_ref_log_probs:
        trainer.cache.precompute(trainer)
    batches = trainer.train_batches()

    # wrap the tiled LM head's kernel (looked up on its class at each call) so that its forward shows as one range
    original_head = tiled_head._LabelLogProbs.apply

    def head(*a, **kw):
        with record_function("lm_head.forward"):
            return original_head(*a, **kw)

    tiled_head._LabelLogProbs.apply = head

    def step(batch):  # BasicTrainer.train_step's phases for one micro-batch, timed apart
        trainer.policy.train()
        t0 = time.perf_counter()
        with record_function("phase.forward"):
            loss, _ = trainer.batch_metrics(batch, "train")
        t1 = time.perf_counter()
        with record_function("phase.backward"):
            loss.backward()
        t2 = time.perf_counter()
        with record_function("phase.clip"):
            trainer.sharding.clip(trainer.policy, cfg.max_grad_norm)
        t3 = time.perf_counter()
        with record_function("phase.optimizer"):
            trainer.sharding.step(trainer.optimizer)
            trainer.optimizer.zero_grad(set_to_none=True)
        t4 = time.perf_counter()
        return dict(forward=t1 - t0, backward=t2 - t1, clip=t3 - t2, optimizer=t4 - t3, total=t4 - t0)

    step(next(batches))  # warmup (allocates the optimizer state)
    step(next(batches))
    walls = [step(next(batches)) for _ in range(PROFILE_STEPS - 3)]
    wall = {k: statistics.mean(w[k] for w in walls) for k in walls[0]}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        prof_wall = step(next(batches))
    events = prof.key_averages()

    def total(pred):  # CPU total (inclusive) time of the matching events, seconds
        return sum(e.cpu_time_total for e in events if pred(e.key)) / 1e6

    def self_total(pred):
        return sum(e.self_cpu_time_total for e in events if pred(e.key)) / 1e6

    # inclusive times of non-nested ranges/ops
    head_fwd = total(lambda k: k == "lm_head.forward")
    head_bwd = total(lambda k: "evaluate_function" in k and "_LabelLogProbsBackward" in k)
    attn_fwd = total(lambda k: k == "aten::scaled_dot_product_attention")
    attn_bwd = total(lambda k: "evaluate_function" in k and ("ScaledDotProduct" in k or "Attention" in k))
    mm_self = self_total(lambda k: k in ("aten::mm", "aten::addmm", "aten::bmm", "aten::_mm", "aten::baddbmm"))
    phase = {k: total(lambda x, k=k: x == f"phase.{k}") for k in ("forward", "backward", "clip", "optimizer")}
    prof_total = sum(phase.values())
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
    result = dict(
        wall=wall,
        n_timed=len(walls),
        prof_wall=prof_wall,
        phase_prof=phase,
        prof_total=prof_total,
        lm_head=dict(forward=head_fwd, backward=head_bwd),
        attention=dict(forward=attn_fwd, backward=attn_bwd),
        matmul_self=mm_self,
        top_self=[(e.key, e.self_cpu_time_total / 1e6, e.count) for e in top],
    )
    print("PROFILE_RESULT " + json.dumps(result))
    shutil.rmtree(tmp, ignore_errors=True)


def run_profile(meta: dict, workdir: Path, args) -> dict:
    spec = dict(
        model_dir=meta["model_dir"],
        data=meta["data"][str(PROFILE_STEPS)],
        n_pairs=PROFILE_STEPS * BATCH,
        padding_free=True,
    )
    rdir = workdir / "runs" / "profile"
    rdir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-u", str(Path(__file__).resolve()), "--_child", "profile", "--_spec", json.dumps(spec)]
    child = ChildRun(cmd, rdir / "output.log", args.run_timeout)
    res = child.run()
    for _, line in child.lines:
        if line.startswith("PROFILE_RESULT "):
            res.update(json.loads(line[len("PROFILE_RESULT ") :]))
    if "wall" not in res:
        res["error"] = child.tail()
    return res


# ---------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------
def summarize(name: str, runs: list[dict], meta: dict, peak: float, max_bg: float) -> dict:
    ok = [r for r in runs if r.get("rc") == 0 and r.get("step_times")]
    if not ok:
        return dict(name=name, error=(runs[0].get("error") if runs else "not run"))
    clean = [r for r in ok if r["bg_cores"] <= max_bg]
    excluded = len(ok) - len(clean) if clean else 0
    ok = clean or ok  # runs that other processes slowed down count only when there is no other
    online = name in ("ours_online", "trl_online")
    times, flops, flops_exec, tokens = [], [], [], []
    for r in ok:
        warmup = r["warmup"]
        for k, t in enumerate(r["step_times"]):
            if k >= warmup:
                f = step_flops(meta["steps"][k], meta["n_params"], online, "shared" in name)
                times.append(t)
                flops.append(f["model"])
                flops_exec.append(f["executed"])
                tokens.append(f["tokens"])
    mean_t = statistics.mean(times)
    pre = [r["precompute_train_s"] for r in ok if r.get("precompute_train_s") is not None]
    pre_rate = [r["precompute_pairs"] / r["precompute_train_s"] for r in ok if r.get("precompute_train_s")]
    out = dict(
        name=name,
        n=len(times),
        s_step_median=statistics.median(times),
        s_step_mean=mean_t,
        s_step_min=min(times),
        s_step_max=max(times),
        pairs_s=BATCH / statistics.median(times),
        pairs_s_mean=BATCH / mean_t,
        tokens_s=sum(tokens) / sum(times),
        peak_rss_gib=max(r["peak_rss_gib"] for r in ok),
        peak_rss_each=[round(r["peak_rss_gib"], 3) for r in ok],
        mfu=sum(flops) / sum(times) / peak,
        mfu_exec=sum(flops_exec) / sum(times) / peak,
        model_gflop_step=statistics.mean(flops) / 1e9,
        precompute_s=statistics.mean(pre) if pre else None,
        precompute_pairs_s=statistics.mean(pre_rate) if pre_rate else None,
        steps_desc=sorted({f"{r['warmup']}+{len(r['step_times']) - r['warmup']}" for r in ok}),
        bg_cores=[round(r["bg_cores"], 2) for r in ok],
        wall=[round(r["wall"], 1) for r in ok],
        per_round=[
            round(statistics.median(r["step_times"][r["warmup"] :]), 3) if len(r["step_times"]) > r["warmup"] else None
            for r in ok
        ],
        excluded_busy=excluded,
        all_busy=not clean,
        timing_method=ok[0].get("timing_method"),
        notes=sorted({n for r in ok for n in r.get("trl_notes", [])}),
    )
    if any(r.get("compute_times") for r in ok):
        ct = [t for r in ok for t in r.get("compute_times", [])[r["warmup"] :]]
        out["compute_s_median"] = statistics.median(ct) if ct else None
    return out


def fmt(x, spec=".2f", none="-"):
    return none if x is None else format(x, spec)


def succeeded(summary: dict, name: str) -> Optional[dict]:
    """The summary of variant `name`; None when it was not run or failed."""
    s = summary.get(name)
    return s if s and "error" not in s else None


def goals(summary: dict, workload: str = "skewed") -> list[tuple[str, float, str, Optional[bool]]]:
    """(label, value, goal, met) of each goal the summary can answer; met None: information only."""
    g = lambda name: succeeded(summary, name)  # noqa: E731
    rows = []
    if g("ours_best") and g("trl_best"):
        r = g("ours_best")["pairs_s"] / g("trl_best")["pairs_s"]
        rows.append(("P1 throughput ours_best / trl_best", r, ">= 2.0x", r >= 2.0))
        m = g("ours_best")["peak_rss_gib"] / g("trl_best")["peak_rss_gib"]
        rows.append(("P2 peak RSS ours_best / trl_best", m, "<= 0.6x", m <= 0.6))
    if g("ours_best"):
        rows.append(("P3 MFU ours_best (model FLOPs)", g("ours_best")["mfu"], ">= 40%", g("ours_best")["mfu"] >= 0.40))
    if g("ours_best") and g("ours_padded"):
        r = g("ours_best")["pairs_s"] / g("ours_padded")["pairs_s"]
        rows.append(("P4 padding-free / padded (ours)", r, ">= 1.5x", r >= 1.5))
    if g("ours_best") and g("ours_online"):
        r = g("ours_best")["pairs_s"] / g("ours_online")["pairs_s"]
        rows.append(("P5 precomputed / online reference (ours)", r, ">= 1.25x", r >= 1.25))
    if g("ours_best") and g("ours_fsdp"):  # per round: the runs of one round ran back to back
        r = g("ours_best")["s_step_median"] / g("ours_fsdp")["s_step_median"]
        rounds = [f"{a / b:.2f}x" for a, b in zip(g("ours_best")["per_round"], g("ours_fsdp")["per_round"])]
        rows.append((f"P6 ours_fsdp / ours_best pairs/s (rounds: {', '.join(rounds)})", r, ">= 0.8x", r >= 0.8))
    for label, shared, base in (("P7", "ours_shared", "ours_best"), ("P8", "ours_fsdp_shared", "ours_fsdp")):
        if g(shared) and g(base):  # per round, as P6
            r, goal = g(shared)["s_step_median"], {"skewed": 1.15, "hh": 1.4}[workload]
            r = g(base)["s_step_median"] / r
            rounds = [f"{b / a:.2f}x" for a, b in zip(g(shared)["per_round"], g(base)["per_round"])]
            rows.append(
                (f"{label} {shared} / {base} pairs/s (rounds: {', '.join(rounds)})", r, f">= {goal}x", r >= goal)
            )
            m = g(shared)["peak_rss_gib"] / g(base)["peak_rss_gib"]
            rows.append((f"{label} peak RSS {shared} / {base}", m, "<= 1.0x", m <= 1.0))
    if g("trl_best") and g("trl_online"):
        r = g("trl_best")["pairs_s"] / g("trl_online")["pairs_s"]
        rows.append(("(TRL precomputed / online)", r, "info", None))
    return rows


def report(summary: dict, meta: dict, machine: dict, args, started: float, profile: dict | None) -> str:
    lines = []
    add = lines.append
    st = meta["steps"][0]
    f0 = step_flops(st, meta["n_params"], False)
    add("=" * 110)
    add(f"DPO speed benchmark  {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}  host {platform.node()}")
    add(
        f"machine: {machine['cpu']}, {os.cpu_count()} cores, {machine['ram_gib']:.1f} GiB RAM; python {platform.python_version()}, "
        f"torch {machine['torch']}, transformers {machine['transformers']}, trl {machine['trl']}; torch threads {machine['threads']}"
    )
    pk = machine["peak"]
    sizes = ", ".join(
        f"{n}: best {v['best'] / 1e9:.1f} / median {v['median'] / 1e9:.1f}" for n, v in pk["sizes"].items()
    )
    add(
        f"fp32 matmul peak (torch.mm, {pk['threads']} threads): {pk['peak'] / 1e9:.1f} GFLOP/s best "
        f"[{sizes}]"
        f"; bg cores {pk['bg_cores']:.2f}"
    )
    if machine.get("peak_after"):
        pa = machine["peak_after"]
        add(
            "  after the runs: "
            + ", ".join(
                f"{n}: best {v['best'] / 1e9:.1f} / median {v['median'] / 1e9:.1f}" for n, v in pa["sizes"].items()
            )
            + f"; bg cores {pa['bg_cores']:.2f}"
            + f"  -> peak used for MFU: {pk['peak'] / 1e9:.1f} GFLOP/s (the best of both)"
        )
    add(
        f"model: Llama {MODEL['num_hidden_layers']}L h{MODEL['hidden_size']} mlp{MODEL['intermediate_size']} vocab {MODEL['vocab_size']}, "
        f"{meta['n_params'] / 1e6:.2f}M params, fp32; batch {BATCH} pairs, max_length {MAX_LENGTH}; AdamW"
    )
    shape = (
        f"every step {SHORT_PER_STEP} short + {LONG_PER_STEP} long pairs"
        if args.workload == "skewed"
        else "HH-shaped: multi-turn prompts of 180-380 tokens, responses of 40-110"
    )
    fs = step_flops(st, meta["n_params"], False, shared=True)
    add(
        f"data: {meta['n_pairs']} pairs, {shape}; step 0: {f0['tokens']} real tokens ({fs['tokens']} with prefix sharing, "
        f"{f0['tokens'] / fs['tokens']:.2f}x fewer) "
        f"in 16 sequences (padded: {f0['padded_slots']} slots, {f0['padded_slots'] / f0['tokens']:.2f}x), {f0['scored']} scored"
    )
    add(
        f"steps (warmup+timed): ours_best/ours_fsdp {args.warmup}+{args.steps}, TRL {args.trl_warmup}+{args.trl_steps}, "
        f"ours_padded/online {args.aux_warmup}+{args.aux_steps}; {args.rounds} round(s), order {' > '.join(args.order)}; "
        f"s/step = median of the pooled timed steps (mean in brackets)"
    )
    add(
        f"our trainer: {args.trainer}"
        + (f" ({args.fsdp_strategy}, 2 ranks)" if args.trainer == "FSDPTrainer" else " (one process)")
        + (f"; ours_fsdp: FSDPTrainer ({args.fsdp_strategy}, 2 ranks)" if "ours_fsdp" in summary else "")
        + (f"; overrides {' '.join(args.set)}" if args.set else "")
    )
    add("-" * 110)
    add(
        f"{'variant':<12} {'pairs/s':>8} {'s/step':>15} {'min-max':>12} {'tok/s':>7} {'peakRSS GiB':>11} {'MFU':>6} {'MFU exec':>8} "
        f"{'precomp pairs/s':>15} {'bg cores':>12}  per-run s/step"
    )
    for name, s in summary.items():
        if "error" in s:
            add(f"{name:<12} FAILED: {(s['error'] or '')[-600:]}")
            continue
        add(
            f"{name:<12} {s['pairs_s']:>8.3f} {s['s_step_median']:>7.3f} [{s['s_step_mean']:>5.2f}] "
            f"{s['s_step_min']:>5.2f}-{s['s_step_max']:<6.2f} {s['tokens_s']:>7.0f} {s['peak_rss_gib']:>11.3f} "
            f"{s['mfu'] * 100:>5.1f}% {s['mfu_exec'] * 100:>7.1f}% {fmt(s['precompute_pairs_s'], '.2f'):>15} "
            f"{','.join(str(b) for b in s['bg_cores']):>12}  {s['per_round']}"
        )
    add("-" * 110)
    g = lambda name: succeeded(summary, name)  # noqa: E731
    for label, value, goal, met in goals(summary, args.workload):
        shown = f"{value * 100:.1f}%" if "MFU" in label else f"{value:.2f}x"
        add(f"{label:<45} {shown:>8}   goal {goal:<9} {'' if met is None else ('MET' if met else 'MISSED')}")
    if "ours_shared" in summary:  # the work each layout removes, one process (P7)
        lines += layout_lines(meta)
    if g("trl_best") and g("trl_best").get("compute_s_median") is not None:
        add(
            f"(TRL on_step_begin->on_step_end median {g('trl_best')['compute_s_median']:.3f} s; its full loop step {g('trl_best')['s_step_median']:.3f} s)"
        )
    for name, s in summary.items():
        if s.get("excluded_busy"):
            add(
                f"note {name}: {s['excluded_busy']} run(s) left out: other processes used > {args.max_bg} cores meanwhile"
            )
        if s.get("all_busy"):
            add(f"note {name}: WARNING every run of it shared the CPUs with other processes (bg cores column)")
        for n in s.get("notes") or []:
            add(f"note {name}: {n}")
    add(
        f"timing: ours {g('ours_best')['timing_method'] if g('ours_best') else '-'}; TRL {g('trl_best')['timing_method'] if g('trl_best') else '-'}"
    )
    if profile:
        add("-" * 110)
        if "wall" in profile:
            w = profile["wall"]
            add(
                f"profile of one ours_best step (wall, mean of {profile.get('n_timed', 1)} step(s), no profiler): total {w['total']:.3f} s = forward {w['forward']:.3f} "
                f"({w['forward'] / w['total'] * 100:.0f}%) + backward {w['backward']:.3f} ({w['backward'] / w['total'] * 100:.0f}%) "
                f"+ clip {w['clip']:.3f} ({w['clip'] / w['total'] * 100:.0f}%) + optimizer {w['optimizer']:.3f} "
                f"({w['optimizer'] / w['total'] * 100:.0f}%)"
            )
            T = profile["prof_total"]
            lm, at = profile["lm_head"], profile["attention"]
            add(
                f"  torch.profiler step ({T:.3f} s under the profiler): LM head fwd {lm['forward']:.3f} + bwd {lm['backward']:.3f} s "
                f"= {(lm['forward'] + lm['backward']) / T * 100:.0f}%; attention (SDPA) fwd {at['forward']:.3f} + bwd {at['backward']:.3f} s "
                f"= {(at['forward'] + at['backward']) / T * 100:.0f}%; all matmul kernels (self) {profile['matmul_self']:.3f} s "
                f"= {profile['matmul_self'] / T * 100:.0f}%"
            )
            add(
                "  top ops by self CPU time: " + "; ".join(f"{k} {t:.3f}s x{c}" for k, t, c in profile["top_self"][:10])
            )
        else:
            add(f"profile FAILED: {profile.get('error', '')[-800:]}")
    add(f"benchmark wall time: {(time.perf_counter() - started) / 60:.1f} min; logs under {args.workdir}/runs/")
    add("=" * 110)
    return "\n".join(lines)


def machine_info() -> dict:
    import torch
    import transformers

    try:
        import trl

        trl_version = trl.__version__
    except Exception:
        trl_version = "not installed"
    cpu = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
        platform.processor(),
    )
    ram = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal")) * 1024 / GIB
    return dict(
        cpu=cpu,
        ram_gib=ram,
        torch=torch.__version__,
        transformers=transformers.__version__,
        trl=trl_version,
        threads=torch.get_num_threads(),
    )


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=5, help="timed steps of each ours_best run (after --warmup)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps at the start of each ours_best run")
    ap.add_argument(
        "--trl-steps", type=int, default=3, help="timed steps of each TRL run (its steps are ~10x ours here)"
    )
    ap.add_argument("--trl-warmup", type=int, default=1)
    ap.add_argument("--aux-steps", type=int, default=3, help="timed steps of ours_padded / ours_online runs")
    ap.add_argument("--aux-warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2, help="times the variant sequence runs")
    ap.add_argument(
        "--no-bracket",
        dest="bracket",
        action="store_false",
        help="do not run ours_best once more at the end (so that it runs before and after TRL)",
    )
    ap.add_argument(
        "--idle-wait",
        type=float,
        default=20.0,
        help="before each run, wait up to this many seconds for other processes to leave the CPUs",
    )
    ap.add_argument("--which", choices=("all", "ours", "trl"), default="all")
    ap.add_argument(
        "--trainer",
        choices=("BasicTrainer", "FSDPTrainer"),
        default="BasicTrainer",
        help="our trainer: FSDPTrainer starts 2 ranks on CPU (n_workers), the same global batch of 8 pairs",
    )
    ap.add_argument(
        "--fsdp-strategy",
        choices=("fsdp", "fsdp2"),
        default="fsdp2",
        help="the FSDP of ours_fsdp, and of every run of ours with --trainer FSDPTrainer",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a train.py override added to every run of ours (e.g. fsdp.reshard_after_forward=false)",
    )
    ap.add_argument(
        "--variants",
        default=None,
        help=f"comma-separated subset/extension of {','.join([*OURS_VARIANTS, *TRL_VARIANTS])} "
        "(default: all but ours_fsdp and trl_online, filtered by --which)",
    )
    ap.add_argument(
        "--workload",
        choices=("skewed", "hh"),
        default="skewed",
        help="skewed: 7 short + 1 long pair a step; hh: multi-turn prompts ~3.7x the responses",
    )
    ap.add_argument(
        "--workdir",
        default=None,
        help="model, tokenizer, data and every run's logs (default "
        "/tmp/bench_dpo, /tmp/bench_dpo_hh for --workload hh)",
    )
    ap.add_argument(
        "--profile",
        choices=("auto", "always", "never"),
        default="auto",
        help="one-step profile of ours_best: auto = when a goal is missed",
    )
    ap.add_argument("--profile-only", action="store_true")
    ap.add_argument(
        "--layout-flops",
        action="store_true",
        help="only print the workload's executed GFLOP per step "
        "by row layout, unshared and with prefix sharing (layout_flops), and run nothing",
    )
    ap.add_argument(
        "--trl-optim", default="adamw_torch_fused", help="TRL optimizer (transformers' default on torch>=2.8)"
    )
    ap.add_argument(
        "--trl-gradient-checkpointing", action="store_true", help="TRL's own default is True; off is faster"
    )
    ap.add_argument(
        "--no-trl-padding-free",
        dest="trl_padding_free",
        action="store_false",
        help="do not ask TRL for padding_free (1.16 ignores it anyway, with a warning)",
    )
    ap.add_argument("--run-timeout", type=float, default=900, help="seconds before a run is killed")
    ap.add_argument(
        "--max-bg",
        type=float,
        default=0.3,
        help="a run during which other processes used more CPU cores than this (on average) is left out "
        "of the summary when the variant has a run without",
    )
    ap.add_argument("--json", default=None, help="also write every number here")
    ap.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_spec", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    for k, v in OFFLINE_ENV.items():
        os.environ.setdefault(k, v)
    if args._child == "trl":
        trl_child(json.loads(args._spec))
        return 0
    if args._child == "profile":
        profile_child(json.loads(args._spec))
        return 0

    started = time.perf_counter()
    args.workdir = args.workdir or "/tmp/bench_dpo" + "_hh" * (args.workload == "hh")
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    sizes = [PROFILE_STEPS, *(sum(run_length(n, args)) for n in (*OURS_VARIANTS, *TRL_VARIANTS))]
    meta = build_workload(workdir, max(sizes), sizes, args.workload)
    print(
        f"[bench] workload in {workdir}: {meta['n_pairs']} pairs, {meta['n_params'] / 1e6:.2f}M params; "
        f"{verify_our_batches(meta, workdir)}",
        flush=True,
    )
    if args.layout_flops:
        print("\n".join(layout_lines(meta)))
        return 0
    machine = machine_info()
    args.order = []
    if args.profile_only:
        prof = run_profile(meta, workdir, args)
        print(json.dumps({k: v for k, v in prof.items() if k != "top_self"}, indent=1))
        print(report({}, meta, dict(machine, peak=matmul_peak(2.0)), args, started, prof))
        return 0
    machine["peak"] = matmul_peak()
    print(
        f"[bench] fp32 matmul peak {machine['peak']['peak'] / 1e9:.1f} GFLOP/s (bg cores {machine['peak']['bg_cores']:.2f})",
        flush=True,
    )

    if args.variants:
        names = [v.strip() for v in args.variants.split(",") if v.strip()]
        unknown = [n for n in names if n not in OURS_VARIANTS and n not in TRL_VARIANTS]
        if unknown:
            ap.error(f"unknown variant(s) {unknown}; known: {[*OURS_VARIANTS, *TRL_VARIANTS]}")
    else:
        names = [
            n
            for n in ("ours_best", "trl_best", "ours_padded", "ours_online")
            if args.which == "all" or n.startswith(args.which)
        ]
    if machine["trl"] == "not installed" and any(n in TRL_VARIANTS for n in names):
        print(f"[bench] trl is not installed: skipping {[n for n in names if n in TRL_VARIANTS]}", flush=True)
        names = [n for n in names if n not in TRL_VARIANTS]
    # alternating: ours_best, TRL, the other variants of ours, (next round), then ours_best once more
    runs: dict[str, list[dict]] = {n: [] for n in names}
    order = [(r, n) for r in range(args.rounds) for n in names]
    if args.bracket and "ours_best" in names and any(n.startswith("trl") for n in names):
        order.append((args.rounds, "ours_best"))
    args.order = [n for _, n in order]
    for r, name in order:
        t = time.perf_counter()
        waited, bg_before = wait_for_quiet(args.idle_wait)
        res = dict(run_variant(name, meta, workdir, r, args), idle_waited_s=waited, bg_cores_before=bg_before)
        runs[name].append(res)
        steps = res.get("step_times") or []
        print(
            f"[bench] round {r} {name}: rc {res['rc']}, {time.perf_counter() - t:.0f} s (waited {waited:.0f} s for "
            f"quiet CPUs, bg {bg_before:.2f} cores then), steps "
            f"{[round(x, 2) for x in steps]}, peak RSS {res['peak_rss_gib']:.3f} GiB, bg cores {res['bg_cores']:.2f}, "
            f"CPU {res['child_cpu']:.0f} s of which system {res['child_sys']:.0f} s (the whole run, all its processes)"
            + (f", precompute {res['precompute_train_s']:.1f} s" if res.get("precompute_train_s") else "")
            + (f"\n{res['error'][-1500:]}" if res.get("error") else ""),
            flush=True,
        )
    machine["peak_after"] = matmul_peak(2.0)
    peak = max(machine["peak"]["peak"], machine["peak_after"]["peak"])
    machine["peak"]["peak"] = peak
    summary = {n: summarize(n, runs[n], meta, peak, args.max_bg) for n in names}

    missed = any(
        met is False
        for label, _, _, met in goals(summary, args.workload)
        if label[:2] in ("P1", "P2", "P3", "P4", "P5")
    )
    prof = None
    if args.profile == "always" or (args.profile == "auto" and missed and "ours_best" in names):
        print("[bench] profiling one step of ours_best", flush=True)
        prof = run_profile(meta, workdir, args)
    text = report(summary, meta, machine, args, started, prof)
    print(text)
    (workdir / "report.txt").write_text(text)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                dict(
                    summary=summary,
                    machine=machine,
                    profile=prof,
                    runs={n: [{k: v for k, v in r.items() if k != "error"} for r in rs] for n, rs in runs.items()},
                ),
                indent=1,
                default=str,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
