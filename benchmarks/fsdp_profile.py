"""Where one FSDP step's time goes, per rank: compute vs gloo collectives vs copies, on bench_dpo.py's workload.

Starts 2 gloo ranks (torch.multiprocessing.spawn) that build the FSDPTrainer exactly as train.py's workers do
(same config as bench_dpo.py's ours_best: tiled LM head, padding-free, precomputed reference, AdamW, fp32),
run --warmup steps, time --steps steps by phase (wall clock: forward, backward, clip, optimizer), then
profile one more with torch.profiler. `--world-size 1` runs the same steps in one process with BasicTrainer
(bench_dpo.py's ours_best), the baseline that 2-rank FSDP's pairs/s is compared with. Per rank it prints:
  - each timed step: wall seconds, CPU seconds (user, system) and minor page faults. glibc's heap settles after
    about 3 steps here (fewer faults each step, then mostly none), so take --warmup 3 for the steady state;
  - the phases' wall seconds, the rank's tokens (its share of the global batch of 8 pairs);
  - seconds inside FSDP's collective ranges (all-gather, reduce-scatter) and the c10d/gloo waits in them,
    the copy-in/copy-out around them;
  - per timed step, the bytes, calls and wall seconds of FSDP2's CPU all-gathers and reduce-scatters
    (trainers.PairwiseAllGather, PairwiseReduceScatter: shared-memory mailboxes, else direct sends), counted by
    wrapping them here;
  - the top ops by self CPU time.
`--set key=value` passes train.py overrides (e.g. fsdp.reshard_after_forward=false); `--threads N` sets each
rank's torch threads (default: torch's, as train.py's workers). The ranks get train.py's SHARED_CPU_ENVIRONMENT
(GOMP_SPINCOUNT, glibc's MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_) unless the environment sets them.

    python -u benchmarks/bench_dpo.py --which ours --variants ours_best --rounds 1 --steps 1   # builds /tmp/bench_dpo
    python -u benchmarks/fsdp_profile.py [--workdir /tmp/bench_dpo] [--set fsdp.reshard_after_forward=false]
    python -u benchmarks/fsdp_profile.py --world-size 1   # the same steps in one process (BasicTrainer)
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def rank_main(rank: int, world_size: int, port: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function
    import bench_dpo
    import trainers
    import utils
    from config import load_config
    from train import load_models

    if args.threads:
        torch.set_num_threads(args.threads)
    sharded = world_size > 1
    if sharded:
        utils.init_distributed(300, cuda=False)
    direct_sends = meter_direct_sends(trainers)
    meta = json.loads((Path(args.workdir) / "workload.json").read_text())
    n_steps = args.warmup + args.steps + 1
    key = max((k for k in meta["data"] if int(k) >= n_steps), key=int, default=None)
    if key is None:
        raise SystemExit(f"{args.workdir}: no data file with >= {n_steps} steps; run bench_dpo.py with --steps {n_steps}")
    tmp = Path(tempfile.mkdtemp(prefix="fsdp_profile_"))
    argv = ["loss=dpo", f"datasets=[{meta['data'][key]}]", f"model.name_or_path={meta['model_dir']}",
            "model.reference_dtype=float32", "optimizer=AdamW",
            *(["trainer=FSDPTrainer", "fsdp.strategy=fsdp2"] if sharded else ["trainer=BasicTrainer"]),
            f"batch_size={bench_dpo.BATCH}", f"eval_batch_size={bench_dpo.BATCH}", f"max_length={bench_dpo.MAX_LENGTH}",
            f"max_prompt_length={bench_dpo.MAX_PROMPT_LENGTH}", "sample_during_eval=false", "do_first_eval=false",
            "n_eval_examples=8", "wandb.enabled=false", "fsdp.use_torch_compile=false", "debug=true", "n_epochs=null",
            f"n_examples={int(key) * bench_dpo.BATCH}", "warmup_steps=0", "tiled_lm_head=true", "padding_free=true",
            "precompute_ref_log_probs=true", f"seed={bench_dpo.SEED}", f"local_dirs=[{tmp}]", f"run_dir={tmp / 'run'}",
            *args.set]
    cfg, _ = load_config(argv, world_size=world_size)
    utils.seed_everything(cfg.seed, cfg.fsdp.full_determinism)
    tokenizer, policy, reference = load_models(cfg, None, on_meta=rank != 0)
    if sharded:
        utils.wait_for_rank0()
    trainer = getattr(trainers, cfg.trainer)(policy, cfg, cfg.seed, str(tmp / "run"), reference_model=reference, rank=rank,
                                   world_size=world_size, tokenizer=tokenizer)
    trainer.build_optimizer()
    trainer.precompute_reference()
    batches = trainer.train_batches()

    def step(batch):
        trainer.policy.train()
        usage = resource.getrusage(resource.RUSAGE_SELF)
        t = [time.perf_counter()]
        with record_function("phase.forward"):
            loss, _ = trainer.get_batch_metrics(batch, "train")
        t.append(time.perf_counter())
        with record_function("phase.backward"):
            loss.backward()
        t.append(time.perf_counter())
        with record_function("phase.clip"):
            trainer.clip_gradient()
        t.append(time.perf_counter())
        with record_function("phase.optimizer"):
            trainer.optimizer.step()
            trainer.optimizer.zero_grad(set_to_none=True)
        t.append(time.perf_counter())
        if sharded:  # every rank ends the step here, so that the next step's phases are not charged with the other's lag
            torch.distributed.barrier()
        t.append(time.perf_counter())
        names = ("forward", "backward", "clip", "optimizer", "wait_for_other_rank")
        out = {n: b - a for n, a, b in zip(names, t, t[1:])}
        out["total"] = t[-1] - t[0]
        after = resource.getrusage(resource.RUSAGE_SELF)
        # CPU seconds of this process (all its threads) and page faults: fresh large buffers are zeroed page by page
        out.update(user_s=after.ru_utime - usage.ru_utime, sys_s=after.ru_stime - usage.ru_stime,
                   minor_faults=after.ru_minflt - usage.ru_minflt)
        out["tokens"] = int(sum(batch[f"{s}_attention_mask"].sum() for s in ("chosen", "rejected")))
        return out

    for _ in range(args.warmup):
        step(next(batches))
    direct_sends.clear()
    walls = [step(next(batches)) for _ in range(args.steps)]
    direct_sends_per_step = {k: v / args.steps for k, v in direct_sends.items()}
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        prof_wall = step(next(batches))
    result = dict(rank=rank, threads=torch.get_num_threads(), overrides=args.set,
                  wall={k: statistics.mean(w[k] for w in walls) for k in walls[0]}, steps=walls, prof_wall=prof_wall,
                  direct_sends=direct_sends_per_step,
                  **summarize_profile(prof))
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    if sharded:
        utils.destroy_distributed()


def meter_direct_sends(trainers) -> dict:
    """Wrap the CPU collectives' __call__ (mailboxes or direct sends) in this process: running totals of their bytes
    (all-gather output, reduce-scatter input), calls and wall seconds (an asynchronous all-gather's wait is not
    included)."""
    totals = defaultdict(float)
    for name, cls in (("all_gather", trainers.PairwiseAllGather), ("reduce_scatter", trainers.PairwiseReduceScatter)):
        def metered(self, output_tensor, input_tensor, *args, _call=cls.__call__, _name=name, **kwargs):
            start = time.perf_counter()
            result = _call(self, output_tensor, input_tensor, *args, **kwargs)
            moved = output_tensor if _name == "all_gather" else input_tensor
            totals[f"{_name}_s"] += time.perf_counter() - start
            totals[f"{_name}_bytes"] += moved.numel() * moved.element_size()
            totals[f"{_name}_calls"] += 1
            return result
        cls.__call__ = metered
    return totals


def summarize_profile(prof) -> dict:
    """One profiled step: inclusive seconds of FSDP's ranges and of the c10d/gloo ops, and the top ops by self CPU
    time. (Bytes are not read from the recorded shapes: c10d's ops take tensor lists, which the profiler records
    without shapes.)"""
    events = prof.key_averages()

    def inclusive(key):
        return sum(e.cpu_time_total for e in events if e.key == key) / 1e6

    comm = sorted({e.key for e in events if e.key.startswith(("c10d::", "gloo:", "record_param_comms"))})
    return dict(fsdp={k: inclusive(k) for k in sorted({e.key for e in events if e.key.startswith("FSDP::")})},
                comm={k: inclusive(k) for k in comm},
                top_self=[(e.key, round(e.self_cpu_time_total / 1e6, 3), e.count)
                          for e in sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:18]])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default="/tmp/bench_dpo", help="bench_dpo.py's workdir (model, data)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--world-size", type=int, default=2, help="ranks (FSDPTrainer); 1 = one process, BasicTrainer")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: torch's default, as train.py)")
    ap.add_argument("--set", action="append", default=[], help="a train.py override, e.g. fsdp.reshard_after_forward=false")
    ap.add_argument("--out", default="/tmp/fsdp_profile")
    args = ap.parse_args()
    for k, v in {"HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}.items():
        os.environ.setdefault(k, v)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    import torch.multiprocessing as mp
    from utils import get_open_port
    from train import shared_cpu_environment
    # with --world-size 1 the one process gets the same variables: the allocator is held equal (bench_dpo.py's ours_best_glibc)
    os.environ.update(shared_cpu_environment())  # what train.py's spawned ranks get (user-set values win)
    mp.spawn(rank_main, args=(args.world_size, get_open_port(), args), nprocs=args.world_size, join=True)
    for rank in range(args.world_size):
        r = json.loads(Path(args.out, f"rank{rank}.json").read_text())
        w = r["wall"]
        for i, step in enumerate(r["steps"]):
            print(f"rank {rank} timed step {i}: {step['total']:.2f} s, CPU user {step['user_s']:.2f} s, sys "
                  f"{step['sys_s']:.2f} s, minor page faults {step['minor_faults']}, tokens {step['tokens']}")
        print(f"rank {rank} ({r['threads']} threads, {' '.join(f'{k}={os.environ[k]}' for k in sorted(os.environ) if k.startswith(('MALLOC_', 'GOMP_')))}, overrides {r['overrides']}): tokens {w['tokens']:.0f}, step "
              f"{w['total']:.2f} s = " + ", ".join(f"{k} {w[k]:.2f}" for k in ("forward", "backward", "clip", "optimizer",
                                                                               "wait_for_other_rank")) + " (means of the timed steps)")
        f = r["fsdp"]
        gather = sum(v for k, v in f.items() if k.startswith("FSDP::all_gather") and "copy" not in k)
        reduce = sum(v for k, v in f.items() if k.startswith("FSDP::post_backward_reduce"))
        print(f"  profiled step {r['prof_wall']['total']:.2f} s: FSDP all-gathers {gather:.2f} s, reduce-scatters "
              f"{reduce:.2f} s (inclusive: waits, copy-in/out, gloo); CPU user {w['user_s']:.2f} s, sys {w['sys_s']:.2f} s, "
              f"minor page faults {w['minor_faults']:.0f} per timed step")
        print("  FSDP ranges over 0.05 s (inclusive s, profiled step): "
              + ", ".join(f"{k[6:]} {v:.2f}" for k, v in r["fsdp"].items() if v > 0.05))
        print("  c10d/gloo (inclusive s): " + ", ".join(f"{k} {v:.3f}" for k, v in r["comm"].items()))
        d = r["direct_sends"]
        if d:
            print("  CPU collectives per timed step: " + ", ".join(
                f"{n.replace('_', '-')}s {d[n + '_bytes'] / 2**20:.0f} MiB in {d[n + '_calls']:.0f} calls, {d[n + '_s']:.2f} s"
                for n in ("all_gather", "reduce_scatter") if n + "_calls" in d))
        print("  top self CPU s: " + "; ".join(f"{k} {s} (x{c})" for k, s, c in r["top_self"][:12]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
