"""Peak memory of the chunked kernel (logps.label_logps on logits) against the plain fp32 log_softmax gather.

Measures forward + backward of `sum of label log-probs` on bf16 logits that require grad, the
realistic case (the lm_head output of a bf16 model). Default: 8 sequences x 1024 tokens, vocab
128256 (Llama 3), i.e. 2.1 GB of bf16 logits. Goal: chunked / plain <= 0.3.

    python benchmarks/logps_memory.py                      # the default shape (needs ~20 GB free RAM on CPU)
    python benchmarks/logps_memory.py --seqs 2 --tokens 256  # quick

How it measures ("peak" = highest memory during forward + backward, minus the memory held right
before it, when the logits and labels already exist; so it counts the gradient of the logits,
which both variants must produce, and every temporary):
  - CUDA: torch.cuda.max_memory_allocated, both variants in this process, peak stats reset between.
  - CPU: each variant in a fresh subprocess; peak resident memory (VmHWM in /proc/self/status)
    after resetting it through /proc/self/clear_refs once the inputs exist, minus VmRSS then.
    Large tensors are mmap-ed and returned to the OS on free, so RSS follows the allocator.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere: import logps

from logps import DEFAULT_CHUNK_SIZE, IGNORE_INDEX, label_logps  # noqa: E402

GIB = 2**30


def plain_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The textbook path: fp32 copy of the logits, full log_softmax, gather. Shape (B, T-1)."""
    labels = labels[:, 1:]
    mask = labels != IGNORE_INDEX
    logps = logits[:, :-1].float().log_softmax(-1)
    return logps.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1) * mask


def chunked_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The same log-probs through the kernel forward_logps runs with tiled_lm_head=false, given the logits as its
    hidden states (weight None): targets shifted (position t's target is labels[t+1]), the logits whole (a [:, :-1]
    slice would be a copy); the last position is unscored. Shape (B, T)."""
    targets = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    return label_logps(logits.flatten(0, 1), targets.flatten(), chunk_size=DEFAULT_CHUNK_SIZE).view(targets.shape)


VARIANTS = {"plain": plain_logps, "chunked": chunked_logps}


def make_inputs(args, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(0)
    # normal_ in place: no fp32 temporary while the bf16 logits are built
    logits = torch.empty(args.seqs, args.tokens, args.vocab, dtype=getattr(torch, args.dtype), device=device)
    logits.normal_(generator=gen).requires_grad_()
    labels = torch.randint(0, args.vocab, (args.seqs, args.tokens), generator=gen, device=device)
    labels[:, : args.tokens // 4] = IGNORE_INDEX  # a prompt: the first quarter of each sequence is not scored
    return logits, labels


def read_kib(path: str, field: str) -> int:
    """A 'Field:  N kB' line of /proc/self/status or /proc/meminfo."""
    for line in Path(path).read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in {path}")


def status_kib(field: str) -> int:
    return read_kib("/proc/self/status", field)


def measure_cpu_child(args) -> None:
    """Runs in a fresh process: one variant, prints a JSON line."""
    torch.manual_seed(0)
    logits, labels = make_inputs(args, "cpu")
    fn = VARIANTS[args.child]
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = status_kib("VmRSS")
    start = time.perf_counter()
    fn(logits, labels).sum().backward()
    seconds = time.perf_counter() - start
    peak = status_kib("VmHWM")
    print(json.dumps({"peak_bytes": (peak - before) * 1024, "seconds": seconds}))


def measure_cpu(args, variant: str) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        variant,
        "--seqs",
        str(args.seqs),
        "--tokens",
        str(args.tokens),
        "--vocab",
        str(args.vocab),
        "--dtype",
        args.dtype,
    ]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"{variant} failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_cuda(args, variant: str) -> dict:
    logits, labels = make_inputs(args, "cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    VARIANTS[variant](logits, labels).sum().backward()
    torch.cuda.synchronize()
    result = {"peak_bytes": torch.cuda.max_memory_allocated() - before, "seconds": time.perf_counter() - start}
    del logits, labels
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--child", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        measure_cpu_child(args)
        return

    logits_bytes = (
        args.seqs * args.tokens * args.vocab * torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    )
    if args.device == "cpu":
        available = read_kib("/proc/meminfo", "MemAvailable") * 1024
        if available < 10 * logits_bytes:
            raise SystemExit(
                f"needs ~{10 * logits_bytes / GIB:.1f} GiB free RAM for the plain variant, "
                f"{available / GIB:.1f} GiB available; try --tokens 256"
            )
    measure = measure_cuda if args.device == "cuda" else measure_cpu
    print(
        f"device={args.device} shape=({args.seqs}, {args.tokens}, {args.vocab}) dtype={args.dtype} "
        f"logits={logits_bytes / GIB:.3f} GiB  method="
        + ("torch.cuda.max_memory_allocated" if args.device == "cuda" else "fresh subprocess, VmHWM - VmRSS")
    )
    results = {variant: measure(args, variant) for variant in ("plain", "chunked")}
    for variant, result in results.items():
        print(
            f"{variant}_peak_gib={result['peak_bytes'] / GIB:.3f}  "
            f"{variant}_peak_over_logits={result['peak_bytes'] / logits_bytes:.2f}x  "
            f"{variant}_seconds={result['seconds']:.2f}"
        )
    ratio = results["chunked"]["peak_bytes"] / results["plain"]["peak_bytes"]
    print(f"chunked_over_plain_ratio={ratio:.3f}  (goal <= 0.3)")


if __name__ == "__main__":
    main()
