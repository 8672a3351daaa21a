#!/usr/bin/env bash
# The offline main job: SFT the tiny model on the toy data, then DPO from the SFT checkpoint.
# Each step is a plain train.py command; extra arguments go to both (e.g. wandb.enabled=false).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-.cache/runs}
STAMP=$(date +%Y-%m-%d_%H-%M-%S_%6N)  # the default run directories' stamp: <local_dir>/runs/<exp_name>_<stamp>
COMMON="model=tiny datasets=[toy] optimizer=AdamW warmup_steps=10 batch_size=16 eval_batch_size=64 n_eval_examples=256 n_eval_model_samples=256 max_length=64 max_prompt_length=32 max_new_tokens=24"
python -u train.py loss=sft exp_name=toy_sft run_dir=$RUNS/toy_sft_$STAMP lr=1e-3 n_epochs=2 eval_every=2000 $COMMON "$@"
python -u train.py loss=dpo exp_name=toy_dpo run_dir=$RUNS/toy_dpo_$STAMP lr=1e-4 loss.beta=0.1 n_epochs=1 eval_every=1008 \
    model.archive=$RUNS/toy_sft_$STAMP/LATEST/policy.pt $COMMON "$@"
