"""`train.py --estimate` against the measured peak RSS increase of real runs on this CPU.

    python benchmarks/estimate_vs_measured.py            # every configuration (a few minutes on 2 cores)
    python benchmarks/estimate_vs_measured.py --only 0,3 # some of them

Each configuration is a real `train.py` run (2 optimizer steps, then the final evaluation) on a random-init
Llama-style model written to a temporary directory, with data whose every sequence is truncated to exactly
max_length (the estimate's worst case is then the actual case). A run's memory is measured in its own process
(each rank's own process under FSDP, started as torchrun would): the peak RSS (ru_maxrss) at the end minus the
RSS after every import and a warm-up step on the 2 MB toy model (one-time costs of the libraries, ~120 MB
whatever the model size, belong to no estimate), before anything of the run is built. The estimate is computed from the config and config.json
alone, as `--estimate` does. debug=true: no checkpoints are written (their serialization is not a training
phase); torch.compile is off.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MODELS = {  # name: Llama-style geometry (the toy tokenizer's 512 ids are a subset of every vocabulary)
    "llama-4M": dict(
        hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4, vocab_size=4096
    ),
    "llama-21M": dict(
        hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8, vocab_size=8192
    ),
}
COMMON = [
    "datasets=[{data}/{{split}}.jsonl]",
    "optimizer=AdamW",
    "warmup_steps=0",
    "lr=1e-5",
    "debug=true",
    "do_first_eval=false",
    "sample_during_eval=false",
    "fsdp.use_torch_compile=false",
    "wandb.enabled=false",
    "n_epochs=null",
    "model.reference_dtype=float32",
    "minimum_log_interval_secs=0",
]
CONFIGS = [  # (model, arguments): model size, batch, length, checkpointing, FSDP, precomputed reference, accumulation
    ("llama-4M", ["loss=sft", "batch_size=4", "max_length=256"]),
    ("llama-4M", ["loss=dpo", "batch_size=4", "max_length=256"]),
    ("llama-4M", ["loss=dpo", "batch_size=4", "max_length=512", "activation_checkpointing=true"]),
    ("llama-4M", ["loss=dpo", "batch_size=4", "max_length=256", "tiled_lm_head=true"]),
    ("llama-4M", ["loss=dpo", "batch_size=4", "max_length=256", "trainer=FSDPTrainer", "n_workers=2"]),
    ("llama-21M", ["loss=sft", "batch_size=8", "max_length=256"]),
    ("llama-21M", ["loss=dpo", "batch_size=4", "max_length=256", "precompute_ref_log_probs=true"]),
    ("llama-21M", ["loss=dpo", "batch_size=4", "max_length=256", "padding_free=true"]),
    # gradient accumulation: the same batch in 1 and 4 micro-batches (the gradients of the earlier micro-batches
    # are held through the later ones), and under FSDP on 2 ranks (each rank holds its gradient shard)
    ("llama-21M", ["loss=dpo", "batch_size=8", "max_length=256", "gradient_accumulation_steps=1"]),
    ("llama-21M", ["loss=dpo", "batch_size=8", "max_length=256", "gradient_accumulation_steps=4"]),
    (
        "llama-21M",
        [
            "loss=dpo",
            "batch_size=8",
            "max_length=256",
            "gradient_accumulation_steps=4",
            "trainer=FSDPTrainer",
            "n_workers=2",
        ],
    ),
    # bf16 weights; fp32 weights under autocast (each linear keeps its bf16 input and weight copies); LoRA, whose
    # fp32 adapters take a copy of a bf16 block's inputs; an evaluation batch of full logits larger than training's
    ("llama-21M", ["loss=dpo", "batch_size=4", "max_length=256", "model.policy_dtype=bfloat16"]),
    ("llama-21M", ["loss=dpo", "batch_size=4", "max_length=256", "fsdp.mixed_precision=bf16"]),
    ("llama-21M", ["loss=dpo", "batch_size=4", "max_length=256", "lora.r=8"]),
    ("llama-21M", ["loss=dpo", "batch_size=4", "max_length=256", "lora.r=8", "model.policy_dtype=bfloat16"]),
    ("llama-4M", ["loss=dpo", "batch_size=2", "max_length=256", "tiled_lm_head=false", "eval_batch_size=16"]),
]


def make_model(root: Path, name: str) -> Path:
    """A random-init model directory (config.json, weights, the toy tokenizer)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = root / name
    if out.exists():
        return out
    config = AutoConfig.from_pretrained(REPO / "toy/tiny-llama")
    for k, v in MODELS[name].items():
        setattr(config, k, v)
    config.num_key_value_heads = config.num_attention_heads
    config.head_dim = config.hidden_size // config.num_attention_heads
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REPO / "toy/tiny-llama" / f, out / f)
    return out


def make_data(root: Path) -> Path:
    """Pairs whose prompt and responses are all longer than any max_length used: every sequence is truncated."""
    out = root / "data"
    out.mkdir(exist_ok=True)
    words = "rain falls on the cats and dogs while snow is white".split()
    text = lambda n, shift: " " + " ".join(words[(i + shift) % len(words)] for i in range(n))
    for split, n in (("train", 32), ("test", 16)):
        rows = [
            {
                "prompt": "\n\nHuman:" + text(600, i) + "\n\nAssistant:",
                "chosen": text(800, i + 1),
                "rejected": text(800, i + 2).upper(),
            }
            for i in range(n)
        ]
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def run_args(root: Path, model: str, args: list[str]) -> list[str]:
    batch = next(int(a.split("=")[1]) for a in args if a.startswith("batch_size="))
    length = next(int(a.split("=")[1]) for a in args if a.startswith("max_length="))
    evals = next((int(a.split("=")[1]) for a in args if a.startswith("eval_batch_size=")), batch)  # <= 16 test pairs
    return [
        *[c.format(data=root / "data") for c in COMMON],
        *args,
        f"model.name_or_path={root / model}",
        f"eval_batch_size={evals}",
        f"n_eval_examples={evals}",
        f"n_examples={2 * batch}",
        f"max_prompt_length={length // 2}",
        f"local_dirs=[{root / 'cache'}]",
        f"run_dir={root / 'runs' / os.urandom(4).hex()}",
    ]


def worker(args: list[str], out: str) -> None:
    """One process (or one rank): import everything, note the RSS, run train.py, note the peak."""
    import pandas  # noqa: F401  everything the run imports, before the baseline (pyarrow's data path: pandas)
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import logps
    import losses  # noqa: F401
    import tiled_head
    import train
    import trainers  # noqa: F401

    # Warm-up on the 2 MB toy model: load, one step. What a first step costs once whatever the model (lazily
    # imported modules, thread pools, kernels: ~120 MB, the same for a 4M- and a 21M-parameter model) is then in
    # the baseline, not in the run's increase.
    import gc

    model = transformers.AutoModelForCausalLM.from_pretrained(REPO / "toy/tiny-llama")
    inputs = {"chosen_input_ids": torch.randint(0, 512, (2, 16))}
    inputs = logps.concatenated_inputs(
        {
            **inputs,
            "chosen_attention_mask": torch.ones(2, 16, dtype=torch.long),
            "chosen_labels": inputs["chosen_input_ids"].clone(),
        }
    )
    opt = torch.optim.AdamW(model.parameters())
    for head in (None, tiled_head.Head()):  # both LM heads' first step: the plain (the default) and the tiled
        logps.forward_logps(model, inputs, head=head)[0].sum().backward()
    opt.step()
    del model, opt, inputs
    gc.collect()
    baseline = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")  # RSS now
    code = train.main(args)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    Path(out).write_text(json.dumps({"code": code, "increase": peak - baseline}))


def measure(root: Path, args: list[str]) -> float:
    """The largest peak RSS increase over the ranks of one run, in bytes."""
    import config_loader

    cfg, _ = config_loader.load_config(args)
    world = (cfg.n_workers or 2) if cfg.trainer == "FSDPTrainer" else 1
    # glibc keeps freed blocks below its (adaptive, up to 32 MiB) mmap threshold in the heap, so RSS would
    # count tensors long freed; a fixed 64 KiB threshold returns every freed tensor, and RSS follows live memory
    # as a GPU's allocated memory does. Arrow's own pool (the data cache) keeps freed buffers too: malloc instead.
    # Nothing else about the run changes.
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        WANDB_MODE="disabled",
        TOKENIZERS_PARALLELISM="false",
        MALLOC_MMAP_THRESHOLD_="65536",
        ARROW_DEFAULT_MEMORY_POOL="system",
    )
    if world > 1:  # torchrun's environment: each rank is its own process, measured on its own
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world))
    outs = [root / f"rank{r}-{os.urandom(4).hex()}.json" for r in range(world)]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", str(out), "--", *args],
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r)) if world > 1 else env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r, out in enumerate(outs)
    ]
    for p in procs:
        _, err = p.communicate()
        if p.returncode != 0:
            raise RuntimeError(f"run failed ({' '.join(args)}):\n{err[-3000:]}")
    results = [json.loads(o.read_text()) for o in outs]
    assert all(r["code"] == 0 for r in results), results
    return max(r["increase"] for r in results)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default=None, help="comma-separated indices of CONFIGS")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    opts, rest = parser.parse_known_args()
    if opts.worker:
        worker(rest[1:] if rest[:1] == ["--"] else rest, opts.worker)
        return
    import config_loader
    import estimate

    chosen = [int(i) for i in opts.only.split(",")] if opts.only else range(len(CONFIGS))
    root = Path(tempfile.mkdtemp(prefix="estimate_vs_measured_"))
    make_data(root)
    print(f"{'#':>2} {'model':<10} {'configuration':<72} {'estimate_MiB':>12} {'measured_MiB':>12} {'error':>7}")
    errors = []
    for i in chosen:
        model, extra = CONFIGS[i]
        make_model(root, model)
        args = run_args(root, model, extra)
        cfg, _ = config_loader.load_config(args)
        world = 1 if cfg.trainer != "FSDPTrainer" else cfg.n_workers or 2
        est = estimate.estimate(cfg, json.loads((root / model / "config.json").read_text()), world, "cpu")["peak"]
        measured = measure(root, args)
        errors.append(est / measured - 1)
        print(
            f"{i:>2} {model:<10} {' '.join(extra):<72} {est / 2**20:>12.1f} {measured / 2**20:>12.1f} {errors[-1]:>+7.1%}",
            flush=True,
        )
    print(
        f"within 15%: {sum(abs(e) <= 0.15 for e in errors)} of {len(errors)} configurations; "
        f"largest |error| {max(map(abs, errors)):.1%}"
    )
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
