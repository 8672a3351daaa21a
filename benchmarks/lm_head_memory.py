"""Peak memory and time of the LM head + label log-probs: tiled (tiled_head's kernel, as tiled_lm_head runs) vs plain.

Measures forward + backward of `sum of label log-probs` of N already-selected positions through an
LM head weight (V, H), hidden and weight both requiring grad (the weight gradient (V, H) is made by
both variants, so it is in both peaks).
  plain: logits = hidden @ W.T (N, V), then log_softmax and gather in fp32 (logps.label_logps' path).
  tiled: the kernel the tiled head runs (tiled_head._LabelLogProbs), `chunk_size` rows at a time
         (default: tiled_head.head_tile_rows, as training uses); never holds (N, V).
Default: N = 4096 positions, H = 512, V = 32000 (Llama 2), fp32, i.e. 0.49 GiB of logits.

    python benchmarks/lm_head_memory.py                              # the default shape, ~1 min on 2 cores
    python benchmarks/lm_head_memory.py --rows 1024 --vocab 128256 --chunk-size 256

How it measures (benchmarks/fsdp_memory.py imports its /proc helpers):
  - CPU: each variant in a fresh subprocess; peak = VmHWM after resetting it through
    /proc/self/clear_refs once the inputs exist, minus VmRSS then. That first call is cold;
    `seconds` is the fastest of `--repeats` calls (the first included).
  - CUDA: torch.cuda.max_memory_allocated minus memory_allocated before, both in this process.
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
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere: import tiled_head

from tiled_head import _LabelLogProbs, head_tile_rows  # noqa: E402

GIB = 2**30


def read_kib(path: str, field: str) -> int:
    """A 'Field:  N kB' line of /proc/self/status or /proc/meminfo."""
    for line in Path(path).read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in {path}")


def status_kib(field: str) -> int:
    return read_kib("/proc/self/status", field)


def plain_logps(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int):
    """The textbook path: full (N, V) logits, fp32 log_softmax, gather. Shape (N,); no tiles."""
    logits = F.linear(hidden, weight).float()
    return logits.log_softmax(-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def tiled_logps(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int):
    """The tiled head's kernel: no bias, scale or softcap, no entropy or log sum p^2. Shape (N,)."""
    return _LabelLogProbs.apply(hidden, weight, None, labels, chunk_size, 1.0, None, False, False)[0]


VARIANTS = {"plain": plain_logps, "tiled": tiled_logps}


def make_inputs(args, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = getattr(torch, args.dtype)
    hidden = torch.randn(args.rows, args.hidden, generator=gen, device=device).to(dtype).requires_grad_()
    weight = torch.randn(args.vocab, args.hidden, generator=gen, device=device) / args.hidden**0.5
    weight = weight.to(dtype).requires_grad_()
    labels = torch.randint(0, args.vocab, (args.rows,), generator=gen, device=device)
    return hidden, weight, labels


def forward_backward(fn, hidden, weight, labels, chunk_size: int) -> float:
    """Seconds for one forward + backward; leaves the gradients cleared for the next call."""
    start = time.perf_counter()
    fn(hidden, weight, labels, chunk_size).sum().backward()
    if hidden.is_cuda:
        torch.cuda.synchronize()  # note: a CPU-GPU sync point, so the time covers the kernels
    seconds = time.perf_counter() - start
    hidden.grad = weight.grad = None
    return seconds


def measure_cpu_child(args) -> None:
    """Runs in a fresh process: one variant, prints a JSON line."""
    hidden, weight, labels = make_inputs(args, "cpu")
    fn = VARIANTS[args.child]
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = status_kib("VmRSS")
    times = [forward_backward(fn, hidden, weight, labels, args.chunk_size)]
    peak = status_kib("VmHWM")  # read after the first (cold) call only
    times += [forward_backward(fn, hidden, weight, labels, args.chunk_size) for _ in range(args.repeats - 1)]
    print(json.dumps({"peak_bytes": (peak - before) * 1024, "seconds": min(times)}))


def measure_cpu(args, variant: str) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        variant,
        "--rows",
        str(args.rows),
        "--hidden",
        str(args.hidden),
        "--vocab",
        str(args.vocab),
        "--dtype",
        args.dtype,
        "--chunk-size",
        str(args.chunk_size),
        "--repeats",
        str(args.repeats),
    ]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"{variant} failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_cuda(args, variant: str) -> dict:
    hidden, weight, labels = make_inputs(args, "cuda")
    fn = VARIANTS[variant]
    forward_backward(fn, hidden, weight, labels, args.chunk_size)  # warm-up: cuBLAS handles, kernels
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    times = [forward_backward(fn, hidden, weight, labels, args.chunk_size) for _ in range(args.repeats)]
    result = {"peak_bytes": torch.cuda.max_memory_allocated() - before, "seconds": min(times)}
    del hidden, weight, labels
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096, help="scored positions N")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtype", default="float32", choices=["bfloat16", "float16", "float32"])
    parser.add_argument(
        "--chunk-size", type=int, default=None, help="rows per tile; default: tiled_head.head_tile_rows"
    )
    parser.add_argument("--repeats", type=int, default=2, help="timed calls; the fastest is reported")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--child", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.chunk_size is None:
        args.chunk_size = head_tile_rows(args.vocab, getattr(torch, args.dtype))
    if args.child:
        measure_cpu_child(args)
        return

    element = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    logits_bytes = args.rows * args.vocab * element
    if args.device == "cpu":
        available = read_kib("/proc/meminfo", "MemAvailable") * 1024
        if available < 6 * logits_bytes:
            raise SystemExit(
                f"needs ~{6 * logits_bytes / GIB:.1f} GiB free RAM for the plain variant, "
                f"{available / GIB:.1f} GiB available; try --rows 1024"
            )
    measure = measure_cuda if args.device == "cuda" else measure_cpu
    print(
        f"device={args.device} rows={args.rows} hidden={args.hidden} vocab={args.vocab} dtype={args.dtype} "
        f"chunk_size={args.chunk_size} logits={logits_bytes / GIB:.3f} GiB "
        f"weight={args.vocab * args.hidden * element / GIB:.3f} GiB  method="
        + ("torch.cuda.max_memory_allocated" if args.device == "cuda" else "fresh subprocess, VmHWM - VmRSS")
    )
    results = {variant: measure(args, variant) for variant in ("plain", "tiled")}
    for variant, result in results.items():
        print(
            f"{variant}_peak_gib={result['peak_bytes'] / GIB:.3f}  "
            f"{variant}_peak_over_logits={result['peak_bytes'] / logits_bytes:.2f}x  "
            f"{variant}_seconds={result['seconds']:.3f}"
        )
    print(
        f"tiled_over_plain_peak={results['tiled']['peak_bytes'] / results['plain']['peak_bytes']:.3f}  "
        f"tiled_over_plain_seconds={results['tiled']['seconds'] / results['plain']['seconds']:.3f}"
    )


if __name__ == "__main__":
    main()
