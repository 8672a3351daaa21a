#!/usr/bin/env bash
# Semi-online DPO on the toy task, with no preference pairs at all: from the SFT model, each round samples 4 answers to
# each of the next prompts, scores them with the toy rule (online.scorer=rule: the answer does not shout), pairs the best
# with the worst and trains on every pair (DPO; the SFT model stays the reference): a round's pairs that do not fill a
# step wait for the next round's, the last round's rest is one smaller step. The prompts come from a
# prompt-only file made of toy/data/train.jsonl's prompts; datasets=[toy] still names the evaluation pairs and the rule.
# SFT=<run dir>/LATEST/policy.pt reuses an SFT checkpoint (e.g. toy/main_job.sh's); without it, toy/main_job.sh's SFT
# stage runs first. Extra arguments go to every command (e.g. wandb.enabled=false, or trainer=FSDPTrainer
# fsdp.strategy=fsdp2 n_workers=2 for the online stage on 2 ranks).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-.cache/runs}
STAMP=$(date +%Y-%m-%d_%H-%M-%S_%6N)  # the default run directories' stamp: <local_dir>/runs/<exp_name>_<stamp>
COMMON="model=tiny datasets=[toy] optimizer=AdamW warmup_steps=10 batch_size=16 eval_batch_size=64 n_eval_examples=256 n_eval_model_samples=256 max_length=64 max_prompt_length=32 max_new_tokens=24"
if [ -z "${SFT:-}" ]; then
    python -u train.py loss=sft exp_name=toy_sft run_dir=$RUNS/toy_sft_$STAMP lr=1e-3 n_epochs=2 eval_every=2000 $COMMON "$@"
    SFT=$RUNS/toy_sft_$STAMP/LATEST/policy.pt
fi
mkdir -p $RUNS
python -c 'import json, sys; [print(json.dumps({"prompt": json.loads(row)["prompt"]})) for row in open(sys.argv[1])]' \
    toy/data/train.jsonl > $RUNS/toy_prompts.jsonl  # prompt-only rows: the answers are left out
# lr 3e-4, not the offline job's 1e-4: a round's pairs are few, and this job is timed against the offline one
# (benchmarks/README.md); evaluations at 0, 240 and 480 pairs, as many as toy/main_job.sh's DPO stage makes
python -u train.py loss=dpo exp_name=toy_online run_dir=$RUNS/toy_online_$STAMP lr=3e-4 loss.beta=0.1 eval_every=240 \
    online.rounds=12 online.prompts_per_round=128 online.samples_per_prompt=4 online.prompts_per_generate=64 \
    online.max_new_tokens=24 online.scorer=rule online.prompts=$RUNS/toy_prompts.jsonl model.archive=$SFT $COMMON "$@"
