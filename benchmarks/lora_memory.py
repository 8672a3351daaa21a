"""Peak memory of LoRA DPO against full fine-tuning DPO, same model, same batch, same steps.

    python -u benchmarks/lora_memory.py                 # ~3 min on 2 CPU cores; prints one table
    python -u benchmarks/lora_memory.py --layers 4 --steps 1

Workload: a Llama-style model with random weights (hidden 768, 8 layers, MLP 2048, the toy tokenizer's 512
tokens: ~57M parameters, 228 MB in fp32) saved under --workdir; the toy pairs, batch 4, max_length 64; AdamW;
no evaluation, no sampling, no checkpoint (debug=true), so the peak is the training step's.

Each variant runs train.py in a fresh subprocess; its peak RSS is the child's ru_maxrss from os.wait4 (VmHWM).
  full   loss=dpo: policy + a reference copy + gradients + AdamW's two moments of every weight
  lora   loss=dpo lora.r=8: one copy of the weights (the reference is the base with the adapters off), gradients
         and AdamW moments of the adapters only
Goal (issue 16): lora peak <= 0.6 x full peak. The ratio printed is lora / full.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def build_model(workdir: Path, layers: int) -> Path:
    """A random Llama with the toy tokenizer's vocabulary, saved once (reused when already there)."""
    out = workdir / f"llama-h768-l{layers}"
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=layers,
        num_attention_heads=12,
        num_key_value_heads=12,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(out)
    return out


def run(name: str, model: Path, steps: int, extra: list[str], workdir: Path) -> tuple[int, float]:
    """(peak RSS in bytes, seconds) of one train.py run in a fresh process."""
    args = [
        sys.executable,
        "-u",
        str(REPO / "train.py"),
        "loss=dpo",
        f"model.name_or_path={model}",
        f"model.tokenizer_name_or_path={REPO / 'toy' / 'tiny-llama'}",
        "model.block_name=LlamaDecoderLayer",
        "model.reference_dtype=float32",
        "datasets=[toy]",
        "batch_size=4",
        "eval_batch_size=4",
        "n_eval_examples=4",
        "max_length=64",
        "max_prompt_length=32",
        "n_epochs=null",
        f"n_examples={4 * steps}",
        f"eval_every={4 * steps}",
        "do_first_eval=false",
        "sample_during_eval=false",
        "optimizer=AdamW",
        "lr=1e-4",
        "warmup_steps=0",
        "debug=true",
        "wandb.enabled=false",
        "fsdp.use_torch_compile=false",
        f"local_dirs=[{workdir / 'cache'}]",
        *extra,
    ]
    start = time.time()
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO)
    _, status, usage = os.wait4(proc.pid, 0)
    stderr = proc.stderr.read()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{name} failed:\n{stderr[-3000:]}")
    return usage.ru_maxrss * 1024, time.time() - start  # ru_maxrss is in KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=REPO / ".cache" / "bench_lora")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--lora-r", type=int, default=8)
    a = parser.parse_args()
    a.workdir.mkdir(parents=True, exist_ok=True)
    model = build_model(a.workdir, a.layers)
    results = {}
    for name, extra in (("full", []), ("lora", [f"lora.r={a.lora_r}", "lora.alpha=16"])):
        results[name] = run(name, model, a.steps, extra, a.workdir)
        print(f"{name:5s} peak_rss_mb={results[name][0] / 2**20:8.1f} seconds={results[name][1]:6.1f}", flush=True)
    ratio = results["lora"][0] / results["full"][0]
    print(f"lora_over_full_peak_rss_ratio={ratio:.3f} (goal <= 0.6: {'met' if ratio <= 0.6 else 'MISSED'})")


if __name__ == "__main__":
    main()
