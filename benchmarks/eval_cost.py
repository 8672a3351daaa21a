"""What scored evaluation (eval_scorer=rule) adds to one evaluation of the toy task's main job.

    python benchmarks/eval_cost.py SFT_POLICY_PT DPO_POLICY_PT [--repeats 4]

Both from `bash toy/main_job.sh` (`.cache/runs/toy_sft_*/LATEST/policy.pt`, `.cache/runs/toy_dpo_*/LATEST/policy.pt`):
the DPO run's last evaluation (256 held-out pairs, 256 sampled answers per model), its policy the DPO weights and its
reference the SFT model, timed with and without `eval_scorer=rule` in one process, the two alternating. Prints each
evaluation's seconds, the seconds inside scored_eval alone, and both evaluations' logged metrics."""

import argparse
import contextlib
import io
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.chdir(REPO)

import torch  # noqa: E402

import scored_eval  # noqa: E402
import train as train_py  # noqa: E402
import trainers  # noqa: E402
from config_loader import load_config  # noqa: E402

MAIN_JOB_DPO = (  # toy/main_job.sh's DPO stage
    "model=tiny datasets=[toy] optimizer=AdamW warmup_steps=10 batch_size=16 eval_batch_size=64 n_eval_examples=256 "
    "n_eval_model_samples=256 max_length=64 max_prompt_length=32 max_new_tokens=24 loss=dpo lr=1e-4 loss.beta=0.1 "
    "n_epochs=1 eval_every=1008 wandb.enabled=false"
).split()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sft", help="the SFT run's policy.pt (the reference)")
    ap.add_argument("dpo", help="the DPO run's policy.pt (the policy)")
    ap.add_argument("--repeats", type=int, default=4)
    a = ap.parse_args()
    scored = []
    original = scored_eval.ScoredEvaluation.__call__

    def timed(self, *args):  # the seconds inside scored evaluation alone
        start = time.perf_counter()
        try:
            return original(self, *args)
        finally:
            scored.append(time.perf_counter() - start)

    scored_eval.ScoredEvaluation.__call__ = timed
    out = Path(tempfile.mkdtemp(prefix="eval_cost-"))
    trainer = {}
    for name, extra in (("plain", []), ("scored", ["eval_scorer=rule"])):
        cfg, _ = load_config([*MAIN_JOB_DPO, *extra, f"model.archive={a.dpo}", f"run_dir={out / name}"])
        if not trainer:  # one pair of models for both: the scorer is the only difference
            tokenizer, policy, reference = train_py.load_models(cfg)
            reference.load_state_dict(torch.load(a.sft, weights_only=True)["state"])
        (out / name).mkdir(parents=True)
        with contextlib.redirect_stdout(io.StringIO()):
            trainer[name] = trainers.BasicTrainer(
                policy, cfg, cfg.seed, str(out / name), reference, tokenizer=tokenizer
            )
        trainer[name].state.example_counter = 2000
    seconds = {"plain": [], "scored": []}
    for repeat in range(a.repeats):
        for name in ("plain", "scored") if repeat % 2 == 0 else ("scored", "plain"):
            start = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()):
                trainer[name].evaluate_and_log()
            seconds[name].append(time.perf_counter() - start)
            print(f"{name} evaluation: {seconds[name][-1]:.2f} s", flush=True)
    mean = {name: sum(s) / len(s) for name, s in seconds.items()}
    print(
        f"mean seconds: plain {mean['plain']:.2f}, scored {mean['scored']:.2f} "
        f"(+{100 * (mean['scored'] / mean['plain'] - 1):.1f}%); inside scored_eval: "
        f"{', '.join(f'{s:.2f}' for s in scored)} s ({100 * sum(scored) / sum(seconds['scored']):.1f}% of scored)"
    )
    for name in seconds:
        print(f"{name} metrics:", (out / name / "metrics.jsonl").read_text().splitlines()[-1])


if __name__ == "__main__":
    main()
