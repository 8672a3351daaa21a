"""gloo's own all-gather and reduce-scatter against FSDP2's CPU collectives (trainers.PairwiseAllGather and
PairwiseReduceScatter: direct sends between the ranks, or shared-memory mailboxes, what train.py uses when the
ranks share a machine), on 2 ranks of this machine, at the size of bench_dpo.py's root unit (33M fp32
parameters: embeddings and LM head). Prints the wall and CPU milliseconds per call (rank 0, mean of --reps calls
after one warm-up call). Run it with the glibc variables train.py gives its ranks, as the rows of the README:
GOMP_SPINCOUNT=3000 MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=1073741824.

    python benchmarks/gloo_collectives.py [--numel 33000000] [--reps 6]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def rank_main(rank: int, world_size: int, port: int, numel: int, reps: int) -> None:
    import torch
    import torch.distributed as dist
    import trainers
    warnings.filterwarnings("ignore", category=FutureWarning)  # reduce_scatter_tensor's rename
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    group, n = dist.group.WORLD, numel // world_size
    full, shard, gathered = torch.randn(n * world_size), torch.randn(n), torch.empty(n * world_size)
    gather, scatter = trainers.PairwiseAllGather(), trainers.PairwiseReduceScatter()
    mailboxes = trainers.SharedMailboxes()
    shared_gather, shared_scatter = trainers.PairwiseAllGather(mailboxes), trainers.PairwiseReduceScatter(mailboxes)
    calls = {
        "all-gather: gloo (all_gather_into_tensor)": lambda: dist.all_gather_into_tensor(gathered, shard),
        "all-gather: direct sends": lambda: gather(gathered, shard, group),
        "all-gather: shared-memory mailboxes": lambda: shared_gather(gathered, shard, group),
        "reduce-scatter: gloo (reduce_scatter_tensor)": lambda: dist.reduce_scatter_tensor(shard, full),
        "reduce-scatter: direct sends": lambda: scatter(shard, full, group),
        "reduce-scatter: shared-memory mailboxes": lambda: shared_scatter(shard, full, group),
    }
    for name, call in calls.items():
        call()
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(reps):
            call()
        dist.barrier()
        if rank == 0:
            print(f"{name:<46} {(time.perf_counter() - wall) / reps * 1e3:7.0f} ms wall {(time.process_time() - cpu) / reps * 1e3:7.0f} ms CPU", flush=True)
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=int, default=33_000_000, help="elements all-gathered / reduce-scattered (fp32)")
    ap.add_argument("--reps", type=int, default=6)
    args = ap.parse_args()
    import torch.multiprocessing as mp
    from utils import get_open_port
    print(f"2 gloo ranks, {args.numel / 1e6:.0f}M fp32 elements ({args.numel * 4 / 1e6:.0f} MB) per call")
    mp.spawn(rank_main, args=(2, get_open_port(), args.numel, args.reps), nprocs=2, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
