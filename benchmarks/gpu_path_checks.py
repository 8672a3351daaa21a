"""The five GPU checks of the second GPU-path review (shared/design/gpu-path-review-2.md, section 3), one script with
a timeout per check (about 8 minutes in all on one H100/H200). Each check prints its numbers; the script exits non-zero
when a check failed or ran out of time.

    python benchmarks/gpu_path_checks.py              # all five, on the first CUDA device
    python benchmarks/gpu_path_checks.py --only 2,3   # some of them
    python benchmarks/gpu_path_checks.py --cpu        # the script's own check: tiny sizes on CPU, nothing measured

1. flex: FlexAttention's first CUDA runs: tests/gpu's log-prob and flex tests (gradients included), then a 4-step
   FSDP2 bf16 run with prefix sharing and packing (its step-0 loss/eval must be ln 2) with recompiles logged.
2. head: the tiled LM head under BasicTrainer's bf16 autocast (N5) at Qwen2.5-0.5B's head (V 151936, H 896): pairs/s
   with tiled_lm_head true and false, and the dtypes of the head's matmul kernels from one profiled step.
3. attention: four bf16 Llama-8B-geometry layers at T = 4096 and 8192, forward + backward, peak memory and time with
   (a) a 2-D padding mask, (b) no mask (is_causal), (c) a dense (R,1,T,T) packed mask, (d) a FlexAttention BlockMask (N6/N7).
4. reference: precompute_ref_log_probs under BasicTrainer and FSDP1/FSDP2 (world 1): the bytes the reference pass frees
   and what stays allocated (N4), read from the run's own line.
5. estimate: `train.py --estimate` against torch.cuda.max_memory_allocated of a 3-step bf16 FSDP2 run (N8).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
TIMEOUTS = {1: 300, 2: 90, 3: 120, 4: 90, 5: 150}  # seconds per check
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled"}


def model_dir(root: Path, name: str, cpu: bool, **geometry) -> Path:
    """A random-init Llama-style model with the toy tokenizer (its 512 ids are a subset of any vocabulary)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = root / name
    if not (path / "config.json").exists():
        tiny = dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=1024,
        )
        config = LlamaConfig(**(tiny if cpu else geometry), max_position_embeddings=8192, tie_word_embeddings=False)
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(path)
        AutoTokenizer.from_pretrained(REPO / "toy" / "tiny-llama").save_pretrained(path)
    return path


def run(cmd: list[str], timeout: float, env: dict | None = None) -> str:
    """A command's output; raises on failure (the check fails), TimeoutExpired past its time."""
    out = subprocess.run(cmd, cwd=REPO, env=env or ENV, capture_output=True, text=True, timeout=timeout)
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd[:6])} ... exited {out.returncode}:\n{(out.stdout + out.stderr)[-3000:]}")
    return out.stdout + out.stderr


def train_args(model: Path, root: Path, name: str, steps: int, length: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-u",
        "train.py",
        f"model.name_or_path={model}",
        "datasets=[toy]",
        "loss=dpo",
        "optimizer=AdamW",
        "lr=1e-5",
        "warmup_steps=0",
        "batch_size=4",
        "eval_batch_size=4",
        "n_eval_examples=4",
        f"n_examples={4 * steps}",
        f"eval_every={4 * steps}",
        "n_epochs=null",
        f"max_length={length}",
        f"max_prompt_length={length // 2}",
        "do_first_eval=false",
        "sample_during_eval=false",
        "wandb.enabled=false",
        f"run_dir={root / 'runs' / name}",
        f"local_dirs=[{root}]",
        *extra,
    ]


def median_pairs_per_second(run_dir: Path) -> float:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    speeds = sorted(r["throughput/pairs_per_second"] for r in records if "throughput/pairs_per_second" in r)[1:]
    return speeds[len(speeds) // 2] if speeds else math.nan


def check_flex(root: Path, cpu: bool) -> None:
    if cpu:
        print("flex: CUDA only (tests/gpu skip without it)")
        return
    print(
        run(
            [
                sys.executable,
                "-m",
                "pytest",
                "tests/gpu/test_gpu_runs.py",
                "-q",
                "-k",
                "flex_attention or log_prob_paths",
            ],
            180,
        )
        .strip()
        .splitlines()[-1]
    )
    env = {
        **ENV,
        "TORCH_LOGS": "recompiles",
        "ONLY": "^fsdp2_bf16_shared_packed$",
        "STEPS": "4",
        "WORK": str(root / "gpu_check"),
    }
    out = run(["bash", "benchmarks/gpu_check.sh"], 110, env)
    logs = "".join(p.read_text() for p in (root / "gpu_check" / "logs").glob("*.log"))
    print(out.strip().splitlines()[-1], f"| recompiles logged: {logs.count('Recompiling')}")
    for run_dir in (root / "gpu_check" / "runs").iterdir():
        first = next(json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines())
        print(f"  {run_dir.name}: first loss/train {first.get('loss/train')} (ln 2 = {math.log(2):.6f})")


def check_head(root: Path, cpu: bool) -> None:
    """N5: under autocast the tiled head's matmuls must run in bf16, as the untiled head's do."""
    import torch

    model = model_dir(
        root,
        "qwen05-head",
        cpu,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=2,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
    )
    for tiled in ("true", "false"):
        name = f"head_tiled_{tiled}"
        run(train_args(model, root, name, 6, 512, "fsdp.mixed_precision=bf16", f"tiled_lm_head={tiled}"), 60)
        print(f"head: tiled_lm_head={tiled}: {median_pairs_per_second(root / 'runs' / name):.2f} pairs/s")
    import logps
    from transformers import AutoModelForCausalLM

    device = "cpu" if cpu else "cuda"
    policy = AutoModelForCausalLM.from_pretrained(model).to(device)
    ids = torch.randint(3, 500, (4, 512), device=device)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    activities = [torch.profiler.ProfilerActivity.CPU] + ([] if cpu else [torch.profiler.ProfilerActivity.CUDA])
    with (
        torch.profiler.profile(activities=activities, record_shapes=True) as prof,
        torch.autocast(device, torch.bfloat16),
    ):
        logps.forward_logps(policy, inputs, tiled=True)[0].sum().backward()
    kernels = sorted({e.key for e in prof.key_averages() if ("gemm" in e.key.lower() or e.key == "aten::mm")})
    print(
        "head: matmul kernels of one tiled forward + backward under bf16 autocast (f32/sgemm = N5 not fixed):",
        kernels[:8],
    )


def check_attention(root: Path, cpu: bool) -> None:
    """N6/N7: what each mask costs four real Llama layers, forward + backward."""
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    geometry = (
        dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
        if cpu
        else dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8)
    )
    device, dtype = ("cpu", torch.float32) if cpu else ("cuda", torch.bfloat16)

    def layers(kernel: str) -> torch.nn.ModuleList:
        config = LlamaConfig(**geometry, num_hidden_layers=4, attn_implementation=kernel, max_position_embeddings=8192)
        torch.manual_seed(0)
        return torch.nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(4)).to(device, dtype), config

    sdpa, config = layers("sdpa")
    flex = None if cpu else layers("flex_attention")[0]
    rotary = LlamaRotaryEmbedding(config).to(device)
    for T in (128,) if cpu else (4096, 8192):
        positions = torch.arange(T, device=device)[None]
        causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
        halves = (positions[0][:, None] < T // 2) == (positions[0][None, :] < T // 2)  # two packed sequences
        masks = {
            "padding_bias": (sdpa, torch.where(causal, 0.0, -math.inf).to(dtype)[None, None]),
            "none_is_causal": (sdpa, None),
            "packed_dense": (sdpa, (causal & halves)[None, None]),
        }
        if flex is not None:
            from torch.nn.attention.flex_attention import create_block_mask

            same = lambda b, h, q, k: (q >= k) & ((q < T // 2) == (k < T // 2))  # noqa: E731
            masks["packed_blockmask"] = (flex, create_block_mask(same, 1, None, T, T, device=device))
        for name, (stack, mask) in masks.items():
            torch.manual_seed(0)
            hidden = torch.randn(1, T, config.hidden_size, device=device, dtype=dtype, requires_grad=True)
            if not cpu:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start = time.time()
            x, embeddings = hidden, rotary(hidden, positions)
            for layer in stack:
                x = layer(x, attention_mask=mask, position_ids=positions, position_embeddings=embeddings)
                x = x[0] if isinstance(x, tuple) else x
            x.float().square().mean().backward()
            if not cpu:
                torch.cuda.synchronize()
            peak = 0 if cpu else torch.cuda.max_memory_allocated() / 2**30
            print(f"attention: T={T} {name:<15} {time.time() - start:7.3f} s  peak {peak:6.2f} GiB")


def check_reference(root: Path, cpu: bool) -> None:
    """N4: the precomputed reference's memory comes back."""
    model = model_dir(
        root,
        "llama-1b",
        cpu,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
    )
    for name, extra in (
        ("basic", []),
        ("fsdp1", ["trainer=FSDPTrainer", "fsdp.strategy=fsdp", "n_workers=1"]),
        ("fsdp2", ["trainer=FSDPTrainer", "fsdp.strategy=fsdp2", "n_workers=1"]),
    ):
        out = run(train_args(model, root, f"reference_{name}", 2, 256, "precompute_ref_log_probs=true", *extra), 60)
        print(
            f"reference: {name}: " + next((line for line in out.splitlines() if "reference model freed" in line), "?")
        )


def check_estimate(root: Path, cpu: bool) -> None:
    """N8: the estimate's peak against a real bf16 FSDP2 run's."""
    model = model_dir(
        root,
        "llama-1b",
        cpu,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
    )
    for accumulation, checkpointing in ((1, "false"), (2, "false"), (1, "true")):
        name = f"estimate_acc{accumulation}_ckpt{checkpointing}"
        args = train_args(
            model,
            root,
            name,
            3,
            2048,
            "trainer=FSDPTrainer",
            "fsdp.strategy=fsdp2",
            "n_workers=1",
            "fsdp.mixed_precision=bf16",
            f"gradient_accumulation_steps={accumulation}",
            f"activation_checkpointing={checkpointing}",
            "debug=true",
        )
        estimated = run([*args, "--estimate"] + ([] if cpu else ["gpu=H200"]), 60)
        peak = re.search(r"peak \(([^)]*)\)\s+([\d.]+) (MiB|GiB)", estimated)
        env = {
            **ENV,
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29517",
        }
        measured = run([sys.executable, "-c", MEASURE, *args[3:]], 90, env)  # as one torchrun rank, in this process
        got = re.findall(r"max_memory_allocated ([\d.]+) GiB", measured)
        said = f"{peak.group(2)} {peak.group(3)} ({peak.group(1)})" if peak else "?"
        print(f"estimate: {name}: estimated peak {said}, measured {got[-1] if got else '?'} GiB")


MEASURE = """import sys, torch; sys.path.insert(0, ".")
import train
code = train.main(sys.argv[1:])
peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
print(f"max_memory_allocated {peak:.2f} GiB")
sys.exit(code)
"""


CHECKS = {1: check_flex, 2: check_head, 3: check_attention, 4: check_reference, 5: check_estimate}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="1,2,3,4,5")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)  # set when the script runs one check itself
    args = parser.parse_args()
    if args.work is not None:
        CHECKS[int(args.only)](args.work, args.cpu)
        return 0
    failed, root = [], Path(tempfile.mkdtemp(prefix="gpu_path_checks."))
    for number in map(int, args.only.split(",")):
        start, cmd = time.time(), [sys.executable, "-u", __file__, "--only", str(number), "--work", str(root)]
        try:  # each check in a process of its own: its timeout holds, and its GPU memory is its own
            subprocess.run(cmd + ["--cpu"] * args.cpu, cwd=REPO, env=ENV, timeout=TIMEOUTS[number], check=True)
            print(f"check {number} ok ({time.time() - start:.0f} s)", flush=True)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            failed.append(number)
            print(f"check {number} FAILED ({time.time() - start:.0f} s): {type(e).__name__}", flush=True)
    print(f"gpu_path_checks: {len(failed)} failed {failed}; work dir {root}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
