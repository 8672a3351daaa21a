"""Peak host memory per rank of one FSDP2 training step at Llama-3's vocabulary (128256): tiled LM head vs full logits.

Each variant runs in a fresh pair of gloo ranks (torch.multiprocessing.spawn). Every rank builds the same
random Llama-style model (hidden --hidden, --layers layers, untied head, vocab --vocab, fp32), shards each block
and then the root with fully_shard (as fsdp.FSDP2 does), and runs ONE forward + backward of the sum of
sequence log-probs through logps.forward_logps, the trainers' one log-prob path, as the root unit's forward
(fsdp.FSDP2.forward, as the trainer calls it): the plain head (full logits) against tiled_head.Head. Each rank holds --rows sequences of --length tokens, the first --prompt of each unscored (as a
DPO prompt).

Peak = VmHWM after resetting it through /proc/self/clear_refs once the model is sharded and the inputs exist,
minus VmRSS then: what the step itself adds, per rank.

A variant whose 2 ranks would need more than MemAvailable (the full path: ~3x its fp32 logits per rank) is not
run; the ratio is then bounded by the full path's logits plus their gradient.

    python benchmarks/fsdp_memory.py                  # 4 x 512 tokens per rank, ~2 min on 2 CPU cores
    python benchmarks/fsdp_memory.py --length 2048    # the issue's 8 x 2048 tokens over 2 ranks (full: not on 23 GiB)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lm_head_memory import GIB, read_kib, status_kib  # noqa: E402  (it also puts the repo on sys.path)
import fsdp  # noqa: E402
import logps  # noqa: E402
import tiled_head  # noqa: E402
from utils import get_open_port  # noqa: E402


def join_two_ranks(rank: int, port: int) -> None:
    """This process as rank `rank` of 2 gloo ranks sharing the two cores (also used by ulysses_memory.py)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=600))
    torch.set_num_threads(1)  # two ranks share the two cores


def random_llama(vocab: int, hidden: int, layers: int, length: int, heads: int = 8, install=None):
    """The same random fp32 Llama on every rank (untied head, sdpa), `install(model)` applied before sharding,
    then each block and the root fully_shard-ed over the ranks, as fsdp.FSDP2 does."""
    import transformers
    from torch.distributed.fsdp import fully_shard

    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        intermediate_size=4 * hidden,
        max_position_embeddings=length,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    if install is not None:
        install(model)
    for block in model.model.layers:
        fully_shard(block)
    fully_shard(model)
    return model


def pair_rows(seed: int, rows: int, length: int, vocab: int, prompt: int) -> dict[str, torch.Tensor]:
    """`rows` random full-length sequences, the first `prompt` tokens of each unscored."""
    ids = torch.randint(4, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[:, :prompt] = logps.IGNORE_INDEX
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def measured_step(model, inputs: dict, **seams) -> tuple[torch.Tensor, dict]:
    """One forward + backward of the mean log-probs through logps.forward_logps with `seams` (layout, head), as the
    sharded root's forward (fsdp.FSDP2.forward: it gathers the embeddings, final norm and LM head the tiled head
    reads); returns them and the step's memory: VmHWM reset through /proc/self/clear_refs first, peak = VmHWM -
    VmRSS before (GiB), and its seconds."""
    sharding = object.__new__(fsdp.FSDP2)  # its forward alone: no config, mesh or sharding of its own here
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    base = status_kib("VmRSS")
    start = time.time()
    sums, counts, _, *_ = sharding.forward(model, logps.forward_logps, inputs, **seams)
    (sums / counts).sum().backward()
    seconds = time.time() - start
    peak = status_kib("VmHWM") - base
    return (sums / counts).detach(), {"peak_gib": peak * 1024 / GIB, "base_gib": base * 1024 / GIB, "seconds": seconds}


def rank_step(rank: int, port: int, args, tiled: bool, out: str) -> None:
    join_two_ranks(rank, port)
    model = random_llama(args.vocab, args.hidden, args.layers, args.length)
    inputs = pair_rows(rank, args.rows, args.length, args.vocab, args.prompt)
    _, step = measured_step(model, inputs, head=tiled_head.Head() if tiled else None)
    result = {"rank": rank, "tiled": tiled, **step}
    Path(out, f"{'tiled' if tiled else 'full'}-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rows", type=int, default=4, help="sequences per rank")
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--prompt", type=int, default=128, help="unscored leading tokens of each sequence")
    ap.add_argument("--out", default="/tmp/fsdp_memory")
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    logits_gib = args.rows * args.length * args.vocab * 4 / GIB
    # The full path holds the fp32 logits, their gradient and a third copy's worth at its peak (2.9x the logits
    # measured at 4 x 512 tokens): two ranks that need more than this machine has would be killed, or kill others.
    full_need_gib = 2 * (3 * logits_gib + 1.0)
    available_gib = read_kib("/proc/meminfo", "MemAvailable") * 1024 / GIB
    results = {}
    for tiled in (False, True):
        if not tiled and full_need_gib > available_gib:
            print(
                f"full: NOT RUN: 2 ranks need ~{full_need_gib:.1f} GiB (3 x {logits_gib:.2f} GiB of fp32 logits + 1 GiB, "
                f"each), MemAvailable is {available_gib:.1f} GiB"
            )
            continue
        mp.spawn(rank_step, args=(get_open_port(), args, tiled, args.out), nprocs=2, join=True)
        results[tiled] = [
            json.loads(Path(args.out, f"{'tiled' if tiled else 'full'}-{r}.json").read_text()) for r in range(2)
        ]
    print(
        f"FSDP2, 2 gloo ranks, vocab {args.vocab}, hidden {args.hidden}, {args.layers} layers, {args.rows} x "
        f"{args.length} tokens per rank ({args.prompt} prompt tokens unscored); full fp32 logits per rank = {logits_gib:.2f} GiB"
    )
    for tiled in results:
        for r in results[tiled]:
            print(
                f"  {'tiled' if tiled else 'full '}  rank {r['rank']}  step_peak_gib={r['peak_gib']:.3f}  "
                f"rss_before_gib={r['base_gib']:.3f}  step_seconds={r['seconds']:.2f}"
            )
    tiled_peak = max(r["peak_gib"] for r in results[True])
    if False in results:
        ratio = tiled_peak / max(r["peak_gib"] for r in results[False])
        print(f"tiled_over_full_peak_ratio={ratio:.3f} (goal <= 0.35)")
    else:  # the full path's logits and their gradient exist together in its backward: a floor of its peak
        print(
            f"tiled_over_full_peak_ratio<={tiled_peak / (2 * logits_gib):.3f} (goal <= 0.35; full not run: its peak is "
            f"at least the logits plus their gradient, 2 x {logits_gib:.2f} GiB)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
