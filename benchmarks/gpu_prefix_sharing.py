"""prefix_sharing on a GPU: a random model of Llama-3.2-1B geometry (hidden 2048, 16 layers, 32 heads, 8 KV heads,
MLP 8192, vocab 128256), FSDP2 on one GPU, bf16 compute over fp32 weights, max_length 2048, HH-shaped pairs
(multi-turn prompts of 700-1500 tokens, responses of 150-400), padding-free rows (FlexAttention on CUDA), reference
log-probs precomputed; one run without prefix sharing and one with it, each in a fresh process. Prints pairs/s and
MFU (train.py's throughput/mfu: 6N FLOPs per real token, the shared prompt counted once, over the GPU's dense bf16
peak; medians over the steps after the first) and the peak GPU memory (nvidia-smi, polled every 0.2 s).

    python -u benchmarks/gpu_prefix_sharing.py             # on a GPU machine (~10 min with the model build)
    python -u benchmarks/gpu_prefix_sharing.py --dry-run   # the commands, nothing run
    python -u benchmarks/gpu_prefix_sharing.py --tiny      # the script's own check on CPU: a tiny model, 2 steps
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
LLAMA_1B = dict(
    hidden_size=2048,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=8192,
    vocab_size=128256,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)
TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=1000,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)


def build(work: Path, geometry: dict, n_pairs: int, scale: float) -> tuple[Path, Path]:
    """The model (random weights) and tokenizer in work/model, HH-shaped pairs in work/pairs.jsonl."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from bench_dpo import build_tokenizer

    model_dir = work / "model"
    if not (model_dir / "config.json").exists():
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**geometry, bos_token_id=1, eos_token_id=2, pad_token_id=3)).save_pretrained(
            model_dir
        )
        build_tokenizer(model_dir, geometry["vocab_size"])
    rng, rows = np.random.default_rng(0), []
    words = lambda n: " ".join(f"w{i}" for i in rng.integers(4, geometry["vocab_size"], n))  # noqa: E731
    for _ in range(n_pairs):
        turns = [int(t * scale) for t in rng.integers(60, 160, size=int(rng.integers(4, 9)))]  # ~700-1500 tokens
        prompt = " ".join(f"{'Human' if k % 2 == 0 else 'Assistant'}: {words(t)}" for k, t in enumerate(turns))
        chosen, rejected = (" " + words(int(int(rng.integers(150, 401)) * scale)) for _ in range(2))
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    data = work / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model_dir, data


def peak_memory_mib(stop: threading.Event, out: list) -> None:
    while not stop.is_set():
        used = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True,
            text=True,
        ).stdout.split()
        out.extend(int(u) for u in used)
        time.sleep(0.2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="a tiny model on CPU, 2 steps: checks the script, not speed")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--work", default="/tmp/gpu_prefix_sharing")
    args = ap.parse_args()
    steps, batch = (2, 4) if args.tiny else (args.steps, args.batch)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model_dir, data = (
        (work / "model", work / "pairs.jsonl")
        if args.dry_run
        else build(work, TINY if args.tiny else LLAMA_1B, steps * batch + 8, 0.1 if args.tiny else 1.0)
    )
    length = 256 if args.tiny else 2048
    common = [
        "loss=dpo",
        f"datasets=[{data}]",
        f"model.name_or_path={model_dir}",
        "trainer=FSDPTrainer",
        "fsdp.strategy=fsdp2",
        "n_workers=1",
        "optimizer=AdamW",
        "lr=1e-6",
        "warmup_steps=0",
        f"batch_size={batch}",
        f"eval_batch_size={batch}",
        "n_eval_examples=8",
        "n_epochs=null",
        f"n_examples={steps * batch}",
        f"eval_every={steps * batch}",
        f"max_length={length}",
        f"max_prompt_length={length * 3 // 4}",
        "padding_free=true",
        "precompute_ref_log_probs=true",
        "do_first_eval=false",
        "sample_during_eval=false",
        "minimum_log_interval_secs=0",
        "wandb.enabled=false",
        "fsdp.use_torch_compile=false",
        "debug=true",
        f"local_dirs=[{work / 'cache'}]",
    ]
    common += ["peak_tflops=1"] if args.tiny else ["fsdp.mixed_precision=bf16"]  # CPU: no known peak; GPU: the table's
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled")
    results = {}
    for shared in (False, True):
        run_dir = work / f"run_shared_{shared}"
        cmd = [sys.executable, "-u", "train.py", *common, f"prefix_sharing={str(shared).lower()}", f"run_dir={run_dir}"]
        if args.dry_run:
            print(" ".join(cmd))
            continue
        subprocess.run(["rm", "-rf", str(run_dir)])
        stop, used = threading.Event(), []
        poller = threading.Thread(target=peak_memory_mib, args=(stop, used), daemon=True)
        if not args.tiny:
            poller.start()
        with open(work / f"shared_{shared}.log", "w") as log:
            rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        stop.set()
        records = (
            [
                r
                for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
                if "throughput/pairs_per_second" in r
            ]
            if (run_dir / "metrics.jsonl").exists()
            else []
        )
        after_first = records[1:] or records
        median = lambda key: (
            statistics.median(r[key] for r in after_first) if after_first and key in after_first[0] else None
        )  # noqa: E731
        results[shared] = dict(
            rc=rc,
            pairs=median("throughput/pairs_per_second"),
            mfu=median("throughput/mfu"),
            peak_mib=max(used) if used else None,
        )
        print(
            f"prefix_sharing={shared}: rc {rc}, pairs/s {results[shared]['pairs']}, MFU {results[shared]['mfu']}, "
            f"peak GPU memory {results[shared]['peak_mib']} MiB (log: {work / f'shared_{shared}.log'})",
            flush=True,
        )
    if args.dry_run:
        return 0
    if all(r["rc"] == 0 and r["pairs"] for r in results.values()):
        print(f"prefix sharing / without: {results[True]['pairs'] / results[False]['pairs']:.2f}x pairs/s")
    return 0 if all(r["rc"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
