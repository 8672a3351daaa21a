#!/bin/bash
# DPO on 2 nodes x 8 GPUs with FSDP2 under SLURM: sbatch examples/slurm_multinode.sh
#SBATCH --job-name=dpo
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1          # one torchrun per node; torchrun starts the 8 ranks
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=24:00:00
#SBATCH --signal=TERM@600            # SIGTERM to torchrun 10 min before the time limit: the ranks stop with a checkpoint
set -euo pipefail
MASTER_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
RUN_DIR=${RUN_DIR:-$PWD/.cache/runs/dpo_pythia69_$SLURM_JOB_ID}
# Requeued after preemption? The same command resumes exactly from RUN_DIR/LATEST.
RESUME=$([ -e "$RUN_DIR/LATEST" ] && echo "resume_from=$RUN_DIR" || echo "run_dir=$RUN_DIR")
# On SIGTERM torchrun passes it to the ranks and SIGKILLs them after --shutdown_timeout (default 30 s): give the
# stop checkpoint (sharded state only) the minutes a large model's write takes. A preemption's grace period is the
# cluster's (GraceTime): ask your admins for minutes, not seconds.
srun torchrun --nnodes "$SLURM_NNODES" --nproc_per_node 8 --rdzv_id "$SLURM_JOB_ID" \
    --rdzv_backend c10d --rdzv_endpoint "$MASTER_HOST:29500" --shutdown_timeout 540 \
    train.py trainer=FSDPTrainer fsdp.strategy=fsdp2 model=pythia69 datasets=[hh] loss=dpo loss.beta=0.1 \
    batch_size=64 gradient_accumulation_steps=1 model.fsdp_policy_mp=bfloat16 "$RESUME" \
    model.archive=/path/to/sft/LATEST/policy.pt
