"""Peak host memory per rank of one FSDP2 training step on ONE long pair: Ulysses SP=2 against SP=1, on 2 ranks.

The pair is what a rank processes per micro-batch: its chosen and rejected rows of --length tokens each. With
SP=1 each rank holds a whole pair (its own, as data parallelism does); with SP=2 both ranks hold the same pair and
each runs the model on half of every row's positions (ulysses.py), attention seeing whole rows for half the
heads. Both shard the model with fully_shard over the 2 ranks (each block, then the root, as fsdp.FSDP2 does)
and run ONE forward + backward of the pair's summed log-probs through logps.forward_logps (the tiled LM head,
tiled_lm_head=true; SP=2: packing.Layout's slices of the padded rows, as trainers.BasicTrainer.log_prob_paths builds
it). The model is a random Llama (hidden --hidden, --layers layers, --heads heads, fp32, sdpa).

Peak = VmHWM after resetting it through /proc/self/clear_refs once the model is sharded and the inputs exist,
minus VmRSS then: what the step itself adds, per rank. The pair's log-probs under SP=2 are printed beside SP=1's.
As benchmarks/estimate_vs_measured.py, the ranks run with glibc's mmap threshold fixed at 64 KiB, so that freed
tensors leave RSS (as on a GPU's allocator); --glibc-default measures with glibc's adaptive threshold instead,
where freed blocks up to 32 MiB stay in the heap and count towards the peak.

    python benchmarks/ulysses_memory.py               # ~2 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fsdp_memory import join_two_ranks, measured_step, pair_rows, random_llama  # noqa: E402
import packing  # noqa: E402
import tiled_head  # noqa: E402
import ulysses  # noqa: E402
from utils import get_open_port  # noqa: E402


def rank_step(rank: int, port: int, args, sp_size: int, out: str) -> None:
    join_two_ranks(rank, port)
    sp = ulysses.make_group(torch.device("cpu"), 2, sp_size) if sp_size > 1 else None
    model = random_llama(
        args.vocab,
        args.hidden,
        args.layers,
        args.length,
        heads=args.heads,
        install=(lambda m: ulysses.install(m, sp)) if sp else None,
    )
    # SP=1: each rank its own pair; SP=2: the group's one pair (the ranks of a group read the same pairs)
    inputs = pair_rows(rank // sp_size, 2, args.length, args.vocab, args.prompt)
    layout = packing.Layout(None, False, sp) if sp else None
    mean_logps, step = measured_step(model, inputs, layout=layout, head=tiled_head.Head())
    result = {"rank": rank, "sp": sp_size, **step, "mean_logp": mean_logps.tolist()}
    Path(out, f"sp{sp_size}-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--length", type=int, default=4096, help="tokens of each row (chosen and rejected) of the pair")
    ap.add_argument("--prompt", type=int, default=1024, help="unscored leading tokens of each row")
    ap.add_argument("--out", default="/tmp/ulysses_memory")
    ap.add_argument("--glibc-default", action="store_true", help="do not fix glibc's mmap threshold (see above)")
    args = ap.parse_args()
    if not args.glibc_default:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by glibc when each spawned rank starts
    Path(args.out).mkdir(parents=True, exist_ok=True)
    results = {}
    for sp_size in (1, 2):
        mp.spawn(rank_step, args=(get_open_port(), args, sp_size, args.out), nprocs=2, join=True)
        results[sp_size] = [json.loads(Path(args.out, f"sp{sp_size}-{r}.json").read_text()) for r in range(2)]
    print(
        f"FSDP2, 2 gloo ranks, Llama hidden {args.hidden}, {args.layers} layers, {args.heads} heads, vocab {args.vocab},"
        f" tiled LM head; one pair per rank of 2 x {args.length} tokens ({args.prompt} prompt tokens per row unscored);"
        f" glibc mmap threshold {'adaptive (default)' if args.glibc_default else '64 KiB'}"
    )
    for sp_size in (1, 2):
        for r in results[sp_size]:
            print(
                f"  sp={sp_size}  rank {r['rank']}  step_peak_gib={r['peak_gib']:.3f}  rss_before_gib={r['base_gib']:.3f}"
                f"  step_seconds={r['seconds']:.2f}  mean_logp={[round(x, 5) for x in r['mean_logp']]}"
            )
    # the same pair: SP=2's log-probs equal SP=1 rank 0's (the pair of group 0), within fp32 summation noise
    diff = max(abs(a - b) for a, b in zip(results[2][0]["mean_logp"], results[1][0]["mean_logp"]))
    ratio = max(r["peak_gib"] for r in results[2]) / max(r["peak_gib"] for r in results[1])
    print(f"max_abs_mean_logp_difference_sp2_vs_sp1={diff:.2e}")
    print(f"sp2_over_sp1_peak_ratio={ratio:.3f} (goal <= 0.65)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
