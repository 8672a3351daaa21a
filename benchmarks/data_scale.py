"""Preference data at the size people train on: setup time to the first step and memory per rank, N pairs.

    python benchmarks/data_scale.py                                      # N = 100k and 1M, this checkout
    python benchmarks/data_scale.py --sizes 100000 --tree /tmp/base .    # a baseline checkout and this one, in turn

For each N it writes N generated HH-like pairs ({split}.jsonl: N train, N/20 test; multi-turn prompts ending in
"\\n\\nAssistant:", lognormal lengths) once under --work, then runs train.py of --tree (a one-step DPO run of the
tiny model, max_length 512) for 1 process (BasicTrainer) and for 2 ranks (FSDPTrainer on gloo, started as torchrun
starts them): cold (an empty cache) then warm (the same cache). Each rank reports, at its first train_step, the
seconds since its start, its peak RSS (getrusage) and its peak PSS (/proc/self/smaps_rollup, sampled every 50 ms:
pages several ranks map count once in their sum). The toy task, run the same way, is the reference: the table gives
each figure and what N pairs add over the toy task. Anon: peak anonymous memory (RssAnon in /proc/self/status,
sampled likewise): what a rank holds of its own, mapped files' pages left out.
"""

import argparse
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
WORDS = (
    "the a of to and in is it you that he was for on are with as I his they be at one have this from or had by "
    "word but what some we can out other were all there when up use your how said an each she which do their time "
    "if will way about many then them write would like so these her long make thing see him two has look more day "
    "could go come did number sound no most people my over know water than call first who may down side been now "
    "find any new work part take get place made live where after back little only round man year came show every "
    "good me give our under name very through just form sentence great think say help low line differ turn cause "
    "much mean before move right boy old too same tell does set three want air well also play small end put home "
    "read hand port large spell add even land here must big high such follow act why ask men change went light "
    "kind off need house picture try us again animal point mother world near build self earth father"
).split()
RUN = [
    "loss=dpo",
    "model=tiny",
    "n_epochs=null",
    "batch_size=8",
    "n_examples=8",
    "eval_batch_size=8",
    "n_eval_examples=8",
    "max_length=512",
    "max_prompt_length=256",
    "warmup_steps=0",
    "do_first_eval=false",
    "sample_during_eval=false",
    "wandb.enabled=false",
    "optimizer=AdamW",
]


def write_pairs(path: Path, n: int, seed: int) -> None:
    """n {prompt, chosen, rejected} rows: 1-3 turns of history (~70 words a prompt), replies of ~35 and ~30 words,
    every length lognormal (a long tail, as real conversations); a sentence ends every ~12 words."""
    rng, vocab = np.random.default_rng(seed), np.array(WORDS + [w + "." for w in WORDS[: len(WORDS) // 11]])

    def texts(mean_words: float, count: int) -> list[str]:
        lengths = np.maximum(1, rng.lognormal(np.log(mean_words), 0.6, count).astype(int))
        words, ends = vocab[rng.integers(0, len(vocab), lengths.sum())].tolist(), np.cumsum(lengths)
        return [" ".join(words[end - length : end]) for end, length in zip(ends, lengths)]

    first, turns = texts(25, n), rng.integers(0, 3, n)
    replies, follow_ups = iter(texts(20, int(turns.sum()))), iter(texts(12, int(turns.sum())))
    chosen, rejected = texts(35, n), texts(30, n)
    with open(path.with_suffix(".tmp"), "w") as f:
        for i in range(n):
            history = "".join(f"\n\nAssistant: {next(replies)}\n\nHuman: {next(follow_ups)}" for _ in range(turns[i]))
            row = {
                "prompt": f"\n\nHuman: {i}. {first[i]}{history}\n\nAssistant:",
                "chosen": " " + chosen[i],
                "rejected": " " + rejected[i],
            }
            f.write(json.dumps(row) + "\n")
    os.replace(path.with_suffix(".tmp"), path)


def dataset(work: Path, n: int) -> str:
    folder = work / f"pairs-{n}"
    folder.mkdir(parents=True, exist_ok=True)
    for split, size, seed in (("train", n, 0), ("test", max(8, n // 20), 1)):
        if not (folder / f"{split}.jsonl").exists():
            write_pairs(folder / f"{split}.jsonl", size, seed)
    return str(folder / "{split}.jsonl")


def worker(tree: str, out: str, argv: list[str]) -> None:
    """One rank: train.py's main with train_step replaced by a probe that reports and exits at the first step."""
    peak = {"pss": 0, "anon": 0}

    def sample():  # PSS and RssAnon have no kernel high-water mark: sample them
        while True:
            pss = next(int(line.split()[1]) for line in open("/proc/self/smaps_rollup") if line.startswith("Pss:"))
            anon = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("RssAnon:"))
            peak["pss"] = max(peak["pss"], pss)
            peak["anon"] = max(peak["anon"], anon)
            time.sleep(0.05)

    threading.Thread(target=sample, daemon=True).start()
    sys.path.insert(0, tree)
    os.chdir(tree)
    import train
    import trainers

    def first_step(self, batch):
        rank = int(os.environ.get("RANK", 0))
        usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process (the tokenizer's too)
        record = dict(
            rank=rank,
            at=time.time(),
            rss_mb=usage.ru_maxrss / 1024,
            pss_mb=peak["pss"] / 1024,
            anon_mb=peak["anon"] / 1024,
            cpu=usage.ru_utime + usage.ru_stime,
        )
        Path(f"{out}.{rank}.json").write_text(json.dumps(record))
        os._exit(0)

    trainers.BasicTrainer.train_step = first_step
    sys.exit(train.main(argv))


def run(tree: str, source: str, ranks: int, cache: Path, tmp: Path, name: str) -> dict:
    """Seconds to the first step (the slowest rank), peak RSS and PSS per rank (the largest) and summed, in MB."""
    out = tmp / name
    args = [*RUN, f"datasets=[{source}]", f"local_dirs=[{cache}]", f"run_dir={tmp / (name + '-run')}"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    if ranks > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        args.append("trainer=FSDPTrainer")
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(ranks))
    start, procs = time.time(), []
    for rank in range(ranks):
        rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank)) if ranks > 1 else env
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, "--worker", tree, str(out), *args],
                env=rank_env,
                stdout=open(f"{out}.{rank}.log", "w"),
                stderr=subprocess.STDOUT,
            )
        )
    if any(p.wait() for p in procs):
        raise SystemExit(f"{name}: a rank failed; see {out}.*.log")
    records = [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in range(ranks)]
    return dict(
        seconds=max(r["at"] for r in records) - start,
        cpu=max(r["cpu"] for r in records),
        rss=max(r["rss_mb"] for r in records),
        pss=max(r["pss_mb"] for r in records),
        pss_sum=sum(r["pss_mb"] for r in records),
        anon=max(r["anon_mb"] for r in records),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tree", nargs="+", default=[str(REPO)], help="checkouts whose train.py runs, each in turn")
    ap.add_argument("--work", default="/tmp/data_scale", help="generated data, caches and logs")
    a = ap.parse_args()
    work, trees = Path(a.work), {Path(t).resolve().name: str(Path(t).resolve()) for t in a.tree}
    work.mkdir(parents=True, exist_ok=True)
    print(
        f"{os.cpu_count()} CPUs; seconds from start to the first step (slowest rank) and CPU seconds of the busiest "
        "rank until then (a loaded machine stretches the first, hardly the second); peak MB per rank (largest); "
        "+: over the toy task, same tree and ranks; PSS summed over the ranks"
    )
    print(
        f"{'tree':>8} {'pairs':>9} {'ranks':>5} {'cache':>5} {'seconds':>8} {'+s':>7} {'cpu s':>7} {'+cpu':>7} "
        f"{'RSS':>7} {'+RSS':>7} {'PSS':>7} {'+PSS':>7} {'PSS sum':>8} {'Anon':>7} {'+Anon':>7}",
        flush=True,
    )
    toy = {}
    for ranks in a.ranks:
        for n in [0, *a.sizes]:
            source = "toy" if n == 0 else dataset(work, n)
            for label, tree in trees.items():  # interleaved: a loaded machine slows both alike
                cache = work / f"cache-{label}-{n}-{ranks}"
                for old in (cache, *(work / f"{label}-{n}-{ranks}-{kind}-run" for kind in ("cold", "warm"))):
                    shutil.rmtree(old, ignore_errors=True)
                for state in ("cold", "warm"):
                    r = run(tree, source, ranks, cache, work, f"{label}-{n}-{ranks}-{state}")
                    toy[label, ranks] = r if n == 0 and state == "warm" else toy.get((label, ranks))
                    base = toy[label, ranks] if n else r
                    added = {k: r[k] - base[k] for k in ("seconds", "cpu", "rss", "pss", "anon")}
                    print(
                        f"{label:>8} {n or 'toy':>9} {ranks:>5} {state:>5} {r['seconds']:8.1f} "
                        f"{added['seconds']:+7.1f} {r['cpu']:7.1f} {added['cpu']:+7.1f} {r['rss']:7.0f} "
                        f"{added['rss']:+7.0f} {r['pss']:7.0f} {added['pss']:+7.0f} {r['pss_sum']:8.0f} "
                        f"{r['anon']:7.0f} {added['anon']:+7.0f}",
                        flush=True,
                    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        main()
