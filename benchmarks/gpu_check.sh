#!/usr/bin/env bash
# The long GPU matrix of issue 11, a separate opt-in script: for a short GPU loan run `python benchmarks/gpu_checks.py`
# instead (the checks that matter most within its budget; `--dry-run` prints the plan). This one trains every
# architecture with every trainer, precision and FSDP knob: one run per (architecture, setting), about a hundred on
# one GPU, far past a short loan; on one GPU narrow it with ARCHS and ONLY (ARCHS=llama ONLY='^fsdp2_bf16$').
#
# Small random GPT-2 / Llama / Qwen2 / Qwen3-MoE / gpt-oss models (benchmarks/gpu_models.py; gpt-oss at gpt-oss-20b's
# attention geometry: sinks, 64 x 64 query heads, alternating 128-token windows) trained with DPO on 1 GPU and on all
# GPUs of this node (nccl; train.py starts one process per GPU), fp32 and bf16, under BasicTrainer, FSDP1 and FSDP2
# with each FSDP knob. Prints one row per run (pairs/s and MFU: medians over the steps after the first) and exits
# non-zero when any run failed; each run's log is under $WORK/logs/.
#
#   bash benchmarks/gpu_check.sh                 # everything on this node's GPUs
#   bash benchmarks/gpu_check.sh --dry-run       # print the commands, run nothing
#   bash benchmarks/gpu_check.sh --cpu           # the script's own check on CPU: tiny Llama, 1 process + 2 gloo ranks
# Then python -u benchmarks/gpu_prefix_sharing.py: prefix_sharing at Llama-3.2-1B geometry, with and without.
#
# The mixtures of experts also run with the router's load-balancing loss (loss.router_aux_loss=model, *_router_aux).
# Environment: ARCHS ("gpt2 llama qwen2 qwen3_moe gpt_oss"), SIZE (small; tiny on CPU), STEPS (5), PEAK_TFLOPS
# (the GPU's bf16 matmul peak for MFU, e.g. 989 for an H100 SXM; unset = estimate.DEVICES' entry for a known
# GPU, else MFU shows "-"), WORK (a temporary directory), RUN_TIMEOUT (seconds per run and for the closing pytest,
# 900; then SIGTERM to the run's whole process group, SIGKILL 30 s later), ONLY (a regular expression: run only the
# settings whose name matches it).
set -uo pipefail
cd "$(dirname "$0")/.."

MODE=gpu
case "${1:-}" in
  --dry-run) MODE=dry ;;
  --cpu) MODE=cpu ;;
  "") ;;
  *) echo "usage: $0 [--dry-run|--cpu]" >&2; exit 2 ;;
esac

if [ "$MODE" = cpu ]; then
  NGPU=0; ARCHS=${ARCHS:-llama}; SIZE=${SIZE:-tiny}
else
  NGPU=$(python -c "import torch; print(torch.cuda.device_count())") || exit 1
  if [ "$MODE" = gpu ] && [ "$NGPU" -lt 1 ]; then echo "no CUDA device: use --cpu or --dry-run" >&2; exit 1; fi
  [ "$NGPU" -lt 1 ] && NGPU=8  # --dry-run without GPUs: show the commands of an 8-GPU node
  ARCHS=${ARCHS:-gpt2 llama qwen2 qwen3_moe gpt_oss}; SIZE=${SIZE:-small}
fi
STEPS=${STEPS:-5}
WORK=${WORK:-$(mktemp -d /tmp/gpu_check.XXXXXX)}
RUN_TIMEOUT=${RUN_TIMEOUT:-900}
mkdir -p "$WORK/logs" "$WORK/runs"

WORLD=$(( NGPU > 1 ? NGPU : 1 )); [ "$MODE" = cpu ] && WORLD=2  # the CPU check runs 2 gloo ranks
BATCH=$(( 4 * WORLD ))
COMMON=(datasets=[toy] model.tokenizer_name_or_path=toy/tiny-llama model.block_name=null model.policy_dtype=float32
        model.reference_dtype=float32 loss=dpo loss.beta=0.1 optimizer=AdamW lr=1e-5 warmup_steps=0
        batch_size=$BATCH eval_batch_size=$BATCH n_eval_examples=$BATCH n_examples=$(( BATCH * STEPS ))
        eval_every=$(( BATCH * STEPS )) n_epochs=null max_length=256 max_prompt_length=128 do_first_eval=false
        sample_during_eval=false minimum_log_interval_secs=0 wandb.enabled=false)
[ -n "${PEAK_TFLOPS:-}" ] && COMMON+=(peak_tflops=$PEAK_TFLOPS)
BF16_MP="fsdp.mixed_precision={param_dtype: bf16, reduce_dtype: fp32}"

# name | GPUs used ("1" or "all") | arguments, separated by ';'
SETTINGS=()
if [ "$MODE" = cpu ]; then
  SETTINGS+=("basic_fp32|1|trainer=BasicTrainer"
             "fsdp2_fp32|all|trainer=FSDPTrainer;fsdp.strategy=fsdp2;n_workers=2"
             "fsdp1_knobs|all|trainer=FSDPTrainer;fsdp.strategy=fsdp;n_workers=2;activation_checkpointing=true;fsdp.optimizer_offload=true")
else
  SETTINGS+=("basic_fp32|1|trainer=BasicTrainer" "basic_bf16|1|trainer=BasicTrainer;fsdp.mixed_precision={param_dtype: bf16}")
  [ "$NGPU" -gt 1 ] && SETTINGS+=("basic_device_map_tiled|all|trainer=BasicTrainer;tiled_lm_head=true")
  for s in fsdp fsdp2; do
    offload=$([ $s = fsdp ] && echo fsdp.param_offload=true || echo fsdp.offload_policy=true)
    SETTINGS+=("${s}_fp32|all|trainer=FSDPTrainer;fsdp.strategy=$s"
               "${s}_bf16|all|trainer=FSDPTrainer;fsdp.strategy=$s;$BF16_MP"
               "${s}_bf16_no_reshard|all|trainer=FSDPTrainer;fsdp.strategy=$s;$BF16_MP;fsdp.reshard_after_forward=false"
               "${s}_bf16_prefetch|all|trainer=FSDPTrainer;fsdp.strategy=$s;$BF16_MP;fsdp.forward_prefetch=true"
               "${s}_bf16_act_ckpt|all|trainer=FSDPTrainer;fsdp.strategy=$s;$BF16_MP;activation_checkpointing=true"
               "${s}_bf16_offload|all|trainer=FSDPTrainer;fsdp.strategy=$s;$BF16_MP;$offload;fsdp.optimizer_offload=true"
               "${s}_bf16_precomputed_packed|all|trainer=FSDPTrainer;fsdp.strategy=$s;$BF16_MP;precompute_ref_log_probs=true;padding_free=true"
               "${s}_bf16_shared_packed|all|trainer=FSDPTrainer;fsdp.strategy=$s;$BF16_MP;prefix_sharing=true;padding_free=true;activation_checkpointing=true")
    [ "$NGPU" -gt 1 ] && SETTINGS+=("${s}_bf16_replicate|all|trainer=FSDPTrainer;fsdp.strategy=$s;$BF16_MP;fsdp.fsdp_size=1")
    [ $(( NGPU % 2 )) -eq 0 ] && SETTINGS+=("${s}_bf16_ulysses|all|trainer=FSDPTrainer;fsdp.strategy=$s;$BF16_MP;fsdp.ulysses_sequence_parallel_size=2")
    # mixtures of experts only: the router's logits from inside recomputed blocks, on packed rows
    SETTINGS+=("${s}_bf16_router_aux|all|trainer=FSDPTrainer;fsdp.strategy=$s;$BF16_MP;loss.router_aux_loss=model;activation_checkpointing=true;padding_free=true")
  done
  SETTINGS+=("fsdp_bf16_orig_params|all|trainer=FSDPTrainer;fsdp.strategy=fsdp;$BF16_MP;fsdp.use_orig_params=true")
fi

if [ "$MODE" = dry ]; then
  MODELS=$(for a in $ARCHS; do printf '%s\t%s\n' "$a" "$WORK/models/$a-$SIZE"; done)
else
  MODELS=$(python benchmarks/gpu_models.py build "$WORK/models" --size "$SIZE") || { echo "building the models failed" >&2; exit 1; }
fi

echo "gpu_check: mode $MODE, $NGPU GPU(s), world $WORLD for 'all', archs [$ARCHS], size $SIZE, $STEPS steps, work dir $WORK"
printf '%-8s %-28s %-5s %-6s %10s %8s\n' arch setting gpus status pairs/s MFU
failed=0
while IFS=$'\t' read -r arch path; do
  [[ " $ARCHS " == *" $arch "* ]] || continue
  for setting in "${SETTINGS[@]}"; do
    IFS='|' read -r name gpus args <<< "$setting"
    [[ -z "${ONLY:-}" || "$name" =~ $ONLY ]] || continue
    [[ "$name" != *router_aux* || "$arch" == qwen3_moe || "$arch" == gpt_oss ]] || continue  # refused for dense models
    run_dir="$WORK/runs/$arch-$name"
    IFS=';' read -ra argv <<< "$args"
    cmd=(python -u train.py "${COMMON[@]}" "model.name_or_path=$path" "run_dir=$run_dir" "${argv[@]}")
    visible=$([ "$gpus" = 1 ] && [ "$MODE" = gpu ] && echo "CUDA_VISIBLE_DEVICES=0" || echo "")
    if [ "$MODE" = dry ]; then
      printf '%s ' $visible; printf '%q ' "${cmd[@]}"; echo
      continue
    fi
    rm -rf "$run_dir"
    # timeout signals the run's whole process group (train.py's ranks too); a run that ignores SIGTERM is killed
    if env $visible timeout --kill-after=30 "$RUN_TIMEOUT" "${cmd[@]}" > "$WORK/logs/$arch-$name.log" 2>&1 \
       && numbers=$(python benchmarks/gpu_models.py summarize "$run_dir" 2>>"$WORK/logs/$arch-$name.log"); then
      IFS=$'\t' read -r pairs mfu <<< "$numbers"
      printf '%-8s %-28s %-5s %-6s %10s %8s\n' "$arch" "$name" "$gpus" ok "$pairs" "$mfu"
    else
      failed=$((failed + 1))
      printf '%-8s %-28s %-5s %-6s %10s %8s   (%s)\n' "$arch" "$name" "$gpus" FAIL - - "$(grep -m1 -E '(Error|Exception|what\(\)):' "$WORK/logs/$arch-$name.log" | cut -c1-160)"
    fi
  done
done <<< "$MODELS"

# every run above checked itself (self_check.py); its own CUDA test adds the faults it must catch
if [ "$MODE" = dry ]; then echo "python -m pytest tests/gpu/test_self_check_gpu.py -q"
elif [ "$MODE" = gpu ]; then
  timeout --kill-after=30 "$RUN_TIMEOUT" python -m pytest tests/gpu/test_self_check_gpu.py -q -s || failed=$((failed + 1))
fi
[ "$MODE" = dry ] && exit 0
echo "gpu_check: $failed run(s) failed; logs in $WORK/logs"
[ "$failed" -eq 0 ]
