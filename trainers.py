"""The training machinery: the step, the loop, evaluation and sampling, the reference model, checkpoints.

`BasicTrainer` trains in one process (several GPUs: naive model parallel through `device_map`); `FSDPTrainer` is the
same trainer with policy and reference sharded. Where several processes differ from one (gradient sync, clipping,
the non-finite decision, gathering, state dicts) the loop calls `self.sharding`, built once by `spread` (sharding.py;
FSDPTrainer's: fsdp.py).

A step: the rank's pairs are split into micro-batches (gradient_accumulation_steps, or groups within the token
budget); each runs ONE policy forward over chosen and rejected concatenated (and one reference forward, or a table
lookup), its loss weighted by its share of the rank's pairs, so that the summed gradient is that of the batch's mean
loss; then clip, one decision on non-finite values for all ranks, step.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import signal
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn as nn
import tqdm

import losses
import preference_datasets as data
import self_check
import sources
from config import dtype_of
from logps import SequenceLogps, concatenated_inputs, forward_logps, sequence_logps
from checkpoints import Checkpoints, Interrupted, TrainState, stop_on_signals
from sharding import OneProcess, unwrap
import utils
from utils import clean_name, rank0_print, sampling_seed

OPTIMIZERS = {
    "RMSprop": lambda params, cfg: torch.optim.RMSprop(params, lr=cfg.lr),
    "AdamW": lambda params, cfg: torch.optim.AdamW(
        params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=cfg.fused_optimizer or None
    ),
    "SGD": lambda params, cfg: torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay),  # for exact checks
}
DECAYS = {  # fraction of the peak learning rate after warmup, as a function of progress in [0, 1]
    "constant": lambda progress: 1.0,
    "linear": lambda progress: max(0.0, 1.0 - progress),
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))),
}


class NonFiniteError(RuntimeError):
    """More than max_nonfinite_steps non-finite steps in a row: the run stops (after a checkpoint)."""


class NothingTrained(RuntimeError):
    """The loop ended without one optimizer step: semi-online rounds that made fewer pairs than a step (offline data
    always fills one: preference_datasets.num_steps refuses less). Nothing evaluated or saved after it."""


class BasicTrainer:
    """The loop: micro-batches, loss, guarded optimizer step, logging, evaluation and checkpoint cadence. The
    reference is `self.reference`, checkpoints `self.checkpoints`, records `self.log`, the models' placement over
    processes `self.sharding` (from `spread`, the one step FSDPTrainer overrides)."""

    def __init__(
        self,
        policy: nn.Module,
        config,
        seed: int,
        run_dir: str,
        reference_model: nn.Module | None = None,
        rank: int = 0,
        world_size: int = 1,
        tokenizer=None,
        splits: dict | None = None,
    ):
        c = self.config = config
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.router = None  # a mixture of experts' routing (moe.py)
        n_params = flops_params(policy)  # MFU's N, counted before any sharding (meta tensors know their shapes too)
        if getattr(policy.config, "num_experts_per_tok", None):
            import moe

            self.router = moe.Router(policy.config, c.loss.router_aux_loss, c.prefix_sharing)
            n_params = moe.active_parameters(policy, n_params)
        self.sharding, self.policy, reference_model, self.sp = self.spread(policy, reference_model)
        self.sp_size = self.sp.size if self.sp else 1  # the ranks of a sequence-parallel group read the same pairs
        self.dp_rank, self.dp_size = rank // self.sp_size, world_size // self.sp_size
        self.run_dir = Path(run_dir)
        self.tokenizer = tokenizer
        self.device = self.sharding.device
        self.unpaired = c.unpaired_loss  # KTO: completions, not pairs
        utils.use_shape_free_attention(self.device)
        mixed = c.fsdp.mixed_precision_dtypes()  # in one process by torch.autocast (FSDP casts the parameters itself)
        self.autocast = contextlib.nullcontext
        if mixed and self.sharding.autocasts:
            self.autocast = functools.partial(torch.autocast, self.device.type, dtype=dtype_of(mixed["param_dtype"]))
        self.state = TrainState()  # the counters a checkpoint keeps
        self.train_seconds = 0.0  # seconds in step_and_log since the loop began (online.py's generation share)
        self.stop = {"signal": None}
        self.log = RunLog(self.run_dir, rank, config)
        self.bars = rank == 0 and sys.stderr.isatty()  # tqdm bars only on a terminal (in a log: \r-redraw noise)
        self.splits = splits or data.load_splits(c, tokenizer)  # train.py hands on what its checks loaded
        self.n_train_pairs = len(self.splits["train"])
        self.total_steps = data.num_steps(
            self.n_train_pairs, batch_size=c.batch_size, n_epochs=c.n_epochs, n_examples=c.n_examples
        )
        self.evaluation_batches()
        self.log_prob_paths()
        self.reference = Reference(self, reference_model)
        self.cache = None  # precompute_ref_log_probs: reference_cache.py
        if c.precompute_ref_log_probs:
            import reference_cache as cache

            self.cache = cache
        self.checkpoints = Checkpoints(self.run_dir, c, self.sharding, rank, world_size, tokenizer)
        # MFU's FLOPs: 6 N per trained token, 2 N more through an online reference, over the device's dense bf16 peak
        online = self.reference.model is not None and not c.precompute_ref_log_probs
        self.flops_per_token = (6 + 2 * online) * n_params
        gpu = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else ""
        peak = next((bf16 for name, (bf16, _, _) in utils.DEVICES.items() if gpu and name in gpu), 0.0)
        self.peak_flops = 1e12 * (c.peak_tflops or peak)  # peak_tflops wins
        self.describe()

    def evaluation_batches(self) -> None:
        """The first n_eval_examples test pairs, each once (repeats completing the last batch are left out), in this
        rank's shares; KTO needs >= 2 rows per rank for its KL estimate. The prompts sampled at each evaluation."""
        c, test = self.config, self.splits["test"]
        self.n_eval_pairs = min(len(test), c.n_eval_examples)
        per_rank = max(2 if self.unpaired else 1, -(-self.n_eval_pairs // self.dp_size))
        self.eval_batch_size = min(c.eval_batch_size, per_rank * self.dp_size)
        shares = dict(pad_token_id=self.tokenizer.pad_token_id, rank=self.dp_rank, world_size=self.dp_size)
        self.eval_batches = data.get_eval_batches(
            test, batch_size=self.eval_batch_size, n_examples=c.n_eval_examples, kl_rows=self.unpaired, **shares
        )
        self.sample_batches = data.get_sample_batches(
            test, n_examples=c.n_eval_model_samples * c.sample_during_eval, **shares
        )
        self.scored = None  # eval_scorer: the samples scored, and the policy's KL on them
        if c.eval_scorer:
            import scored_eval

            self.scored = scored_eval.ScoredEvaluation(c, self.device, self.tokenizer, self.policy)

    def log_prob_paths(self) -> None:
        """How log-probs are computed (never what they are; logps.py), each None on the plain path: the row layout,
        the label head (the reference's, and the policy's unless an entropy bonus needs the full logits)."""
        c = self.config
        self.layout = self.head = None
        if c.padding_free or c.prefix_sharing or self.sp:
            import packing

            self.layout = packing.Layout(c.max_length if c.padding_free else None, c.prefix_sharing, self.sp)
        if c.tiled_lm_head:
            import tiled_head

            self.head = tiled_head.Head()
        self.needed, self.beta_dpo = {}, None  # what the loss modifiers read beyond sums; beta-DPO's statistics
        if losses.modified(c.loss):
            import modifiers

            self.needed = modifiers.logps_needed(c.loss)
            self.beta_dpo = modifiers.BetaDPO(self.seed) if c.loss.dynamic_beta else None
        self.policy_head = self.head
        if c.loss.entropy_coeff:
            import entropy_bonus

            self.policy_head = entropy_bonus.Head(c.fsdp, self.device)

    def describe(self) -> None:
        """What the run derived, printed as nanoGPT prints its tokens per iteration: data, geometry, optimizer."""
        c = self.config
        if not c.online.rounds:  # semi-online DPO trains on its rounds' pairs, not the datasets' (online.batches)
            rank0_print(data.dataset_summary(self.splits["train"].stats))
        unit = "completions" if self.unpaired else "pairs"
        ranks = f"world size {self.world_size}"
        doubled = ""
        if self.sp_size > 1:
            ranks = f"data-parallel {self.dp_size} ({ranks} = dp {self.dp_size} x sequence-parallel {self.sp_size})"
        if c.pairs_to_unpaired:
            doubled = " (pairs_to_unpaired: 2 per pair, so an epoch has twice a paired loss's steps)"
        micro = c.batch_size // self.dp_size // c.gradient_accumulation_steps
        drawn = f" ({c.n_examples} trained: n_examples)" if c.n_examples else ""  # or more: the set repeats
        trained = f"train {unit} {self.n_train_pairs}{doubled}{drawn}; total steps {self.total_steps}; "
        rank0_print(
            f"batch geometry: {c.batch_size} {unit} per step = {ranks} x accumulation "
            f"{c.gradient_accumulation_steps} x micro-batch {micro}; {'' if c.online.rounds else trained}"
            f"eval pairs {self.n_eval_pairs} in batches of {self.eval_batch_size}"
        )
        config = unwrap(self.policy).config
        vocab = (getattr(config, "text_config", None) or config).vocab_size
        if self.head is None and vocab >= 65536:  # the plain path's fp32 (tokens, vocab) tensors: estimate._logits
            held = 3 * micro * (1 + c.trains_on_pairs) * c.max_length * vocab * 4 / 2**30
            rank0_print(
                f"LM head: up to {held:.1f} GiB per micro-batch at max_length={c.max_length} (vocabulary {vocab}) for "
                "the fp32 log-softmax and its gradients; tiled_lm_head=true holds tiles of at most 128 MiB instead "
                "(self-checked against this path before the first step)"
            )
        original = ""
        if (c.optimizer, c.lr, c.warmup_steps) == ("RMSprop", 5e-7, 150):
            original = " (the original DPO code's defaults; set optimizer=, lr=, warmup_steps= to change them)"
        rank0_print(
            f"optimizer {c.optimizer}, lr {c.lr:g}, warmup_steps {c.warmup_steps}, scheduler {c.scheduler}{original}"
        )

    def spread(self, policy: nn.Module, reference_model: nn.Module | None) -> tuple:
        """How the models are spread over processes: the sharding object the loop calls, and the policy and reference
        to train with, and a Ulysses group or None. One process: `OneProcess`, the models as they are; FSDPTrainer
        shards them."""
        return OneProcess(policy, self.config), policy, reference_model, None

    # --- the loss of a micro-batch ---------------------------------------------------------------------------
    def batch_metrics(self, batch: dict, split: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Mean loss of `batch` and its per-example metrics, named as the original (`rewards_train/chosen`)."""
        inputs = {k: v.to(self.device) for k, v in concatenated_inputs(batch).items()}
        n = batch["chosen_input_ids"].size(0)
        paired = "rejected_input_ids" in batch
        c = self.config
        paths = dict(layout=self.layout, head=self.policy_head, router=self.router)
        with self.autocast():
            policy = self.sharding.forward(self.policy, forward_logps, inputs, **paths, **self.needed)
        kl = None
        if self.unpaired:  # KTO's reference point: the step's (step_statistics), or this evaluation batch's
            kl = batch["kl_reference_point"][:1] if "kl_reference_point" in batch else self.reference.kl_point(batch)
        out = losses.compute_loss(
            c.loss_names,
            c.loss.weights,
            c.loss,
            policy,
            self.reference.logps(batch, inputs, split, per_token=self.needed.get("per_token", False)),
            paired=paired,
            labels=inputs["labels"],
            desirable=batch.get("desirable"),
            kl=kl,
            beta_dpo=self.beta_dpo,
            step=self.state.batch_counter if split == "train" else None,
        )
        metrics = dict(out.metrics, **{"entropy/chosen": policy.entropy[:n].detach()})
        if paired:
            metrics["entropy/rejected"] = policy.entropy[n:].detach()
        loss = out.losses.mean()
        if c.loss.entropy_coeff:  # an entropy bonus, as verl's entropy_coeff: loss - c * H
            loss = loss - c.loss.entropy_coeff * policy.entropy.mean()
        if self.router:  # a mixture of experts: router_aux_loss logged, and weighted into the loss as asked
            loss = self.router.add_loss(loss, policy.routing, n, paired, metrics)
        # 'rewards/chosen' -> 'rewards_train/chosen'; 'loss' -> 'loss/train' (the original's metric names)
        return loss, {k.replace("/", f"_{split}/", 1) if "/" in k else f"{k}/{split}": v for k, v in metrics.items()}

    def step_statistics(self, batch: dict) -> dict:
        """What a loss needs from the whole step before it is split: KTO's KL reference point, stored per row (split
        like any other column), its kl_* rows dropped."""
        kl = self.reference.kl_point(batch).cpu().expand(len(batch["chosen_input_ids"])).clone()
        return dict({k: v for k, v in batch.items() if not k.startswith("kl_")}, kl_reference_point=kl)

    # --- one optimizer step ----------------------------------------------------------------------------------
    def train_step(self, batch: dict) -> dict[str, float]:
        """Accumulate gradients over the micro-batches of this rank's pairs, then one guarded step."""
        c, sharding = self.config, self.sharding
        self.policy.train()
        if self.unpaired:  # KTO: its KL reference point, from the whole step
            batch = self.step_statistics(batch)
        micro, real = micro_batches(batch, c, sharding)
        collected = defaultdict(list)
        per_rank = c.batch_size / self.dp_size
        for i, mb in enumerate(micro):
            # gradients are reduce-scattered after every micro-batch (each rank keeps its shard) unless
            # no_sync_accumulation: then after the last only, every rank holding all gradients meanwhile
            with sharding.gradient_sync(self.policy, i == len(micro) - 1 or not c.no_sync_accumulation):
                loss, metrics = self.batch_metrics(mb, "train")
                (loss * (len(mb["chosen_input_ids"]) / per_rank if i < real else 0.0)).backward()  # a repeat: weight 0
            for name, v in metrics.items() if i < real else ():
                collected[name].append(v.detach())
        grad_norm = sharding.clip(self.policy, c.max_grad_norm)
        finite = math.isfinite(grad_norm) and all(
            torch.isfinite(torch.cat(v)).all() for k, v in collected.items() if k.startswith("loss")
        )
        if sharding.all_true(finite):  # every rank steps, or every rank skips
            sharding.step(self.optimizer)
            self.scheduler.step()
            self.state.nonfinite_in_a_row = 0
        else:  # skip: parameters, optimizer state and schedule stay as they were
            self.state.nonfinite_in_a_row += 1
            self.state.nonfinite_total += 1
            rank0_print(
                f"non-finite loss or gradient at step {self.state.batch_counter}: step skipped "
                f"({self.state.nonfinite_in_a_row} in a row, {self.state.nonfinite_total} in total)"
            )
        self.optimizer.zero_grad(set_to_none=True)
        # nanmean: a metric that does not apply to an example is NaN there (KTO's rewards/chosen on undesirable ones)
        mean = {k: sharding.gather(torch.cat(v).float()).nanmean().item() for k, v in collected.items()}
        tokens = pair_tokens(batch, c.prefix_sharing).sum()
        tokens = sharding.gather(tokens.reshape(1).float().to(self.device)).sum().item() / self.sp_size
        lr = self.scheduler.get_last_lr()[0]
        return dict(mean, tokens=tokens, grad_norm=grad_norm, lr=lr, nonfinite_steps=float(self.state.nonfinite_total))

    # --- the loop --------------------------------------------------------------------------------------------
    def train(self) -> None:
        """Train until the data runs out; evaluate and checkpoint every eval_every pairs and at the end."""
        c = self.config
        rounds = None
        if c.fsdp.forward_only:  # no optimizer: evaluate (and sample) the loaded weights once
            self.log.start(None)
            return self.evaluate_and_log()
        if c.online.rounds:  # semi-online DPO: the pairs come from rounds of sampling and scoring (online.py)
            import online

            rounds = online.batches(self)  # before the optimizer: it sets the schedule's length
        self.build_optimizer()
        if c.resume_from:
            self.resume()
        self.log.start(self.state.wandb_id)
        self.state.wandb_id = getattr(self.log.wandb_run, "id", None)
        self.sharding.barrier()  # W&B starts on rank 0 alone (up to minutes online): the others wait here
        self_check.run(self)  # on the resumed weights, before the first step and before precompute frees the reference
        if self.cache:
            self.cache.precompute(self)
        resumed_at = (
            self.state.example_counter if c.resume_from else None
        )  # its evaluation and checkpoint already happened
        self.loop_start = (time.time(), self.state.example_counter)
        progress = dict(total=self.total_steps, initial=self.state.batch_counter, unit="step", disable=not self.bars)
        with stop_on_signals(self.stop), tqdm.tqdm(**progress, dynamic_ncols=True) as bar:
            for batch in self.train_batches() if rounds is None else rounds:
                if self.state.example_counter % c.eval_every == 0 and self.state.example_counter != resumed_at:
                    if self.state.example_counter > 0 or c.do_first_eval:
                        self.evaluate_and_log()
                    if self.state.example_counter > 0:
                        self.save_checkpoint()
                self.step_and_log(batch, bar)
        if rounds is not None and not self.state.batch_counter:  # the rounds made fewer pairs than one step
            raise NothingTrained(online.starved(c, self.run_dir))
        if self.state.example_counter != resumed_at:
            self.evaluate_and_log()
            self.save_checkpoint()

    def save_checkpoint(self, lean: bool = False) -> None:
        """run_dir/step-N of this run's state (checkpoints.py); TR-DPO's moving reference is trained state too."""
        self.state.beta_dpo_running = self.beta_dpo and self.beta_dpo.running
        metrics = getattr(self, "last_eval_metrics", {})
        args = self.state, self.policy, self.optimizer, self.scheduler, self.trained_reference(), metrics
        self.checkpoints.save(*args, lean=lean)

    def resume(self) -> None:
        """This run's state from its LATEST checkpoint; the records written after it go (the run writes them again)."""
        self.checkpoints.resume(self.state, self.policy, self.optimizer, self.scheduler, self.trained_reference())
        if self.beta_dpo:
            self.beta_dpo.running = self.state.beta_dpo_running
        self.log.truncate(self.state.example_counter)

    def trained_reference(self) -> nn.Module | None:
        return self.reference.model if self.config.ref_update.tau is not None else None

    def build_optimizer(self) -> None:
        """The optimizer of the trainable parameters; its schedule: linear warmup from 0 to the peak over warmup_steps,
        then DECAYS[scheduler] until the last step (self.total_steps, read at every step: semi-online rounds learn
        theirs round by round)."""
        c = self.config
        warmup = c.warmup_steps
        self.optimizer = OPTIMIZERS[c.optimizer]([p for p in self.policy.parameters() if p.requires_grad], c)

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / (warmup + 1)
            return DECAYS[c.scheduler]((step - warmup) / max(1, self.total_steps - warmup))

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, factor)

    def train_batches(self):
        """This rank's share of every step's pairs, from where the run stands (a resume continues the order)."""
        c = self.config
        return data.get_batch_iterator(
            self.splits["train"],
            self.tokenizer.pad_token_id,
            batch_size=c.batch_size,
            n_epochs=c.n_epochs,
            n_examples=c.n_examples,
            rank=self.dp_rank,
            world_size=self.dp_size,
            seed=self.seed,
            start_example=self.state.example_counter,
            balance=c.balance_batch,
            kl_rows=self.unpaired,
            shared_prompt=c.prefix_sharing,
        )

    def step_and_log(self, batch: dict, bar) -> None:
        """One step, its metrics and throughput logged; then a requested stop or too many non-finite steps."""
        c = self.config
        start = time.time()
        with self.sharding.params_on_device(self.policy):
            metrics = self.train_step(batch)
        seconds = time.time() - start
        pairs = len(batch["chosen_input_ids"]) * self.dp_size  # batch_size; fewer in a semi-online run's last step
        self.state.batch_counter += 1
        self.state.example_counter += pairs
        if c.ref_update.tau is not None:  # TR-DPO
            self.reference.update()
        tokens = metrics.pop("tokens")
        metrics["throughput/pairs_per_second"] = pairs / seconds
        metrics["throughput/tokens_per_second"] = tokens / seconds
        # the original's name: pairs over seconds since the loop started
        started, examples_then = self.loop_start
        metrics["examples_per_second"] = (self.state.example_counter - examples_then) / (time.time() - started)
        metrics["counters/examples"], metrics["counters/updates"] = self.state.example_counter, self.state.batch_counter
        if self.peak_flops:  # model FLOPs utilization
            metrics["throughput/mfu"] = self.flops_per_token * tokens / seconds / (self.peak_flops * self.world_size)
        self.log.progress(bar, metrics, self.state.batch_counter, self.total_steps, self.state.example_counter)
        if self.state.batch_counter % c.log_every_steps == 0 or self.state.batch_counter == self.total_steps:
            self.log(self.state.example_counter, metrics)  # a step cadence: the same config logs the same steps
        if self.sharding.any_true(self.stop["signal"] is not None):  # a signal on any rank: all stop after this step
            self.save_checkpoint(lean=True)
            raise Interrupted(
                self.stop["signal"] or signal.SIGTERM,
                self.state.batch_counter,
                self.state.example_counter,
                self.run_dir,
            )
        if self.state.nonfinite_in_a_row > c.max_nonfinite_steps:
            self.save_checkpoint()
            raise NonFiniteError(
                f"{self.state.nonfinite_in_a_row} non-finite steps in a row (max_nonfinite_steps="
                f"{c.max_nonfinite_steps}); checkpoint saved at {self.run_dir / 'LATEST'}"
            )
        self.train_seconds += time.time() - start  # online.py weighs a round's sampling against its steps

    # --- evaluation and sampling -----------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate_and_log(self) -> None:
        """Metrics averaged over exactly the eval pairs (all ranks), then samples from policy and reference."""
        rank0_print(f"Running evaluation after {self.state.example_counter} train examples")
        self.policy.eval()
        collected = defaultdict(list)
        with self.sharding.params_on_device(self.policy):
            bar = tqdm.tqdm(self.eval_batches, desc="Computing eval metrics", disable=not self.bars, leave=False)
            for batch in bar:
                _, metrics = self.batch_metrics(batch, "eval")
                valid = batch["valid"].to(self.device)
                for name, v in metrics.items():  # per row (or completion); the repeats completing a batch are left out
                    collected[name].append(torch.where(valid.repeat(len(v) // len(valid)), v, float("nan")))
            mean = {name: self.sharding.gather(torch.cat(v)).float().nanmean().item() for name, v in collected.items()}
            mean.update(self.sample_and_log() if self.sample_batches else {})
        self.sharding.reshard(self.policy)
        rank0_print(f"eval after {self.state.example_counter}: {utils.formatted_dict(mean)}")
        self.log(self.state.example_counter, mean)
        self.last_eval_metrics = mean

    def sample(self, model: nn.Module, batch: dict, seed: int) -> tuple[torch.Tensor, list[str]]:
        """Completions of the batch's (left-padded) prompts, drawn from their own stream (a function of weights,
        prompts and seed; the training RNG untouched): their new tokens (B, new; padding after a completion's end)
        and their text."""
        ids = batch["prompt_input_ids"].to(self.sharding.input_device(model))
        with torch.random.fork_rng(devices=range(torch.cuda.device_count()) if torch.cuda.is_available() else ()):
            torch.manual_seed(seed)  # seeds the CPU and every CUDA generator, restored on exit
            out = self.sharding.generate(
                model,
                input_ids=ids,
                attention_mask=batch["prompt_attention_mask"].to(ids.device),
                max_new_tokens=self.config.max_new_tokens,
                do_sample=True,
                temperature=self.config.temperature,
                top_p=self.config.top_p,
                pad_token_id=self.tokenizer.pad_token_id,
            )
        new = out[:, ids.size(1) :]
        return new, self.tokenizer.batch_decode(new, skip_special_tokens=True)

    def sample_and_log(self) -> dict[str, float]:
        """Samples of policy and reference for the first n_eval_model_samples prompts, in groups seeded on their own
        (alike at any world size); three printed, all in samples.jsonl (and W&B); where the data has a checkable rule
        (the toy task), the rate samples follow it; with eval_scorer, their scores and KL (scored_eval.py)."""
        rows, drawn = [], []
        for group, batch in self.sample_batches:  # as many on every rank: each generate is a collective under FSDP
            # both models from one seed: the comparison is paired (equal weights draw equal samples, at step 0 too)
            seed = sampling_seed(self.seed, self.state.example_counter, max(group, 0))
            policy = self.sample(self.policy, batch, seed)
            reference = self.reference.sample(batch, seed)
            drawn.append((group, batch, policy, reference))
            texts = zip(batch["prompt"], policy[1], reference[1] if reference else [None] * len(policy[1]))
            rows += [(group, *row) for row in texts] if group >= 0 else []
        rows = [row[1:] for row in sorted(self.sharding.gather_objects(rows, self.sp_size), key=lambda row: row[0])]
        rule = sources.sample_rule(self.config.datasets)
        metrics = {}
        for who, column in (("policy", 1), ("reference", 2)):
            samples = [row[column] for row in rows if row[column] is not None]
            if samples and rule is not None:
                metrics[f"samples/{who}_rule_rate"] = sum(map(rule, samples)) / len(samples)
            for row in rows[:3] if samples and self.rank == 0 else []:
                print(f"  {who} sample | {row[0]!r} -> {row[column]!r}")
        self.log.samples(self.state.example_counter, rows)
        return dict(metrics, **self.scored(self, drawn)) if self.scored else metrics


class RunLog:
    """Where records go (rank 0 only): run_dir/metrics.jsonl and samples.jsonl, one JSON line each (NaN and inf as
    null), and Weights & Biases (step = training pairs seen) when enabled and not debug=true."""

    def __init__(self, run_dir: Path, rank: int, config):
        self.run_dir = run_dir
        self.rank = rank
        self.config = config
        self.wandb_run = None
        self.last_progress = time.time()

    def start(self, resumed_wandb_id: str | None) -> None:
        c = self.config
        if self.rank == 0 and not c.debug and c.wandb.enabled:
            import wandb  # seconds to import: only runs that log to it pay

            online = bool(os.environ.get("WANDB_API_KEY")) or Path("~/.netrc").expanduser().exists()
            self.wandb_run = wandb.init(
                entity=c.wandb.entity,
                project=c.wandb.project,
                name=c.exp_name,
                dir=str(self.run_dir),
                mode=os.environ.get("WANDB_MODE") or ("online" if online else "offline"),
                config=c.to_dict(),
                id=resumed_wandb_id or None,
                resume="allow" if resumed_wandb_id else None,
            )

    def __call__(self, step: int, metrics: dict[str, float]) -> None:
        """One record, at `step` (training pairs seen)."""
        if self.rank == 0:
            record = {"step": step, **{k: v if math.isfinite(v) else None for k, v in metrics.items()}}
            self._append("metrics.jsonl", [record])
            if self.wandb_run is not None:
                self.wandb_run.log(metrics, step=step)

    def progress(self, bar, metrics: dict[str, float], step: int, total: int, examples: int) -> None:
        """tqdm's bar; without a terminal, a plain line at most every minimum_log_interval_secs (and at the end)."""
        speed = f"{metrics['throughput/pairs_per_second']:.2f}"
        loss = f"{metrics.get('loss/train', math.nan):.4f}"
        bar.update(1)
        bar.set_postfix(pairs_per_s=speed, loss=loss)
        due = time.time() - self.last_progress >= self.config.minimum_log_interval_secs or step == total
        if bar.disable and self.rank == 0 and due:
            print(
                f"progress: step {step}/{total}, pairs seen {examples}, pairs/s {speed}, loss/train {loss}", flush=True
            )
            self.last_progress = time.time()

    def samples(self, step: int, rows: list[tuple]) -> None:
        if self.rank == 0:
            records = [{"step": step, "prompt": p, "policy": s, "reference": r} for p, s, r in rows]
            self._append("samples.jsonl", records)
            if self.wandb_run is not None:
                import wandb

                table = wandb.Table(
                    columns=["step", "prompt", "policy", "reference"], data=[[step, *row] for row in rows]
                )
                self.wandb_run.log({"samples": table}, step=step)

    def truncate(self, step: int) -> None:
        """On resume: drop the records written after the checkpoint's step (the resumed run writes them again)."""
        for path in (self.run_dir / "metrics.jsonl", self.run_dir / "samples.jsonl"):
            if self.rank == 0 and path.exists():
                kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
                utils.atomic_write_text(path, "".join(line + "\n" for line in kept))

    def _append(self, name: str, records: list[dict]) -> None:
        with open(self.run_dir / name, "a") as f:
            f.writelines(json.dumps(r, allow_nan=False) + "\n" for r in records)


# --- The reference model ---
class Reference:
    """The reference log-probs: a forward of the reference model (LoRA: the policy with its adapters off), or a
    table precomputed over the data (precompute_ref_log_probs); and TR-DPO's updates of the reference."""

    def __init__(self, trainer: BasicTrainer, model: nn.Module | None):
        c = trainer.config
        self.trainer = trainer
        self.tables = {}  # split -> (n_examples, 2) precomputed sums
        self.lora = c.lora.r is not None
        self.model = (
            trainer.policy if self.lora and losses.needs_reference(c.loss_names, c.loss.reference_free) else model
        )
        self.mixed = c.reference_mixed

    def context(self):
        """Entered around every use of the model: under LoRA it is the policy, with its adapters off."""
        return unwrap(self.model).disable_adapter() if self.lora else contextlib.nullcontext()

    @torch.no_grad()
    def forward(self, inputs: dict[str, torch.Tensor], per_token: bool = False, **paths) -> SequenceLogps | None:
        """The reference log-probs of `inputs`' sequences (forward_logps), or None without a reference model; `paths`
        (layout, head) instead of the run's."""
        t = self.trainer
        if self.model is None or t.config.loss.reference_free:
            return None
        inputs = {k: v.to(t.sharding.input_device(self.model)) for k, v in inputs.items()}
        paths = {"layout": t.layout, "head": t.head, **paths}
        with t.autocast() if self.mixed else contextlib.nullcontext(), self.context():
            out = t.sharding.forward(self.model, forward_logps, inputs, per_token=per_token, **paths)
        t.sharding.reshard(self.model)  # forward only: no backward to keep gathered parameters for
        return out

    def logps(self, batch: dict, inputs: dict, split: str, per_token: bool = False) -> SequenceLogps | None:
        """Reference log-probs of chosen then rejected (2B,): from the precomputed table (sums only), or a forward."""
        if self.tables:
            table = self.tables["test" if split == "eval" else "train"][batch["example_index"]]  # (B, 2)
            sums = table[:, 0] if "rejected_input_ids" not in batch else table.T.reshape(-1)  # chosen then rejected
            return SequenceLogps(sums, None)
        return self.forward(inputs, per_token)

    @torch.no_grad()
    def kl_point(self, batch: dict) -> torch.Tensor:
        """KTO's z0 before clamping, Shape (1,): the mean policy-minus-reference log-ratio of the step's mismatched
        (prompt, completion) rows (kl_* keys) on ALL ranks, in its micro-batches; detached, so one value per step."""
        t, c = self.trainer, self.trainer.config
        average = losses.LOSSES[c.loss_names[0]].average(c.loss)
        rows = {f"chosen_{k}": batch[f"kl_{k}"] for k in ("input_ids", "attention_mask", "labels")}
        parts, real = micro_batches(rows, c, t.sharding)
        total = torch.zeros(2, dtype=torch.float64, device=t.device)  # (sum of log-ratios, rows)
        for i, part in enumerate(parts):
            chunk = {k.removeprefix("chosen_"): v.to(t.device) for k, v in cut_padding(part).items()}
            with t.autocast():
                sums, counts, *_ = t.sharding.forward(t.policy, forward_logps, chunk, layout=t.layout, head=t.head)
            ref = self.forward(chunk)
            if i < real:
                ref_sums = 0 if ref is None else ref.sums.to(sums.device)
                logratios = sequence_logps(sums - ref_sums, counts, average)
                n = torch.tensor(float(len(logratios)), device=sums.device)
                total += torch.stack([logratios.double().sum(), n]).to(total.device)
        total = t.sharding.gather(total[None]).sum(0)
        return (total[0] / total[1]).float().reshape(1)

    def sample(self, batch: dict, seed: int) -> tuple[torch.Tensor, list[str]] | None:
        """BasicTrainer.sample's completions from the reference model; None without one."""
        if self.model is None:
            return None
        with self.context():
            out = self.trainer.sample(self.model, batch, seed)
        self.trainer.sharding.reshard(self.model)
        return out

    @torch.no_grad()
    def update(self) -> None:
        """TR-DPO (Gorbatovski et al. 2024, Eq. 4-5), every ref_update.tau steps: ref <- alpha * policy + (1 - alpha)
        * ref, in place. Both are sharded alike: local shards match element by element (no gather); names lose the
        wrapper prefixes (activation checkpointing wraps the policy's blocks only)."""
        c = self.trainer.config.ref_update
        if self.trainer.state.batch_counter % c.tau:
            return
        policy = {clean_name(k): v for k, v in self.trainer.policy.named_parameters()}
        reference = {clean_name(k): v for k, v in self.model.named_parameters()}
        if policy.keys() != reference.keys():
            raise RuntimeError(
                f"ref_update: policy and reference parameters differ: {sorted(policy.keys() ^ reference.keys())[:5]}"
            )
        for name, ref in reference.items():  # this rank's shards: FSDP2's DTensor local part, FSDP1's flat ones
            ref, pol = (p.to_local() if hasattr(p, "to_local") else p for p in (ref, policy[name]))
            if ref.shape != pol.shape:
                raise RuntimeError(
                    f"ref_update: {name} is {tuple(pol.shape)} in the policy, {tuple(ref.shape)} in the reference"
                )
            ref.lerp_(pol.to(ref.device, ref.dtype), c.alpha)  # ref + alpha (policy - ref)


# --- Small pure helpers ---
def flops_params(model: nn.Module) -> int:
    """N of the 6N-FLOPs-per-token rule: the parameters outside the input embedding (a lookup, not a matmul); a
    mixture of experts counts its active ones (moe.active_parameters); a 4-bit weight (model.quantization) counts its
    shape's, not its packed bytes'."""
    numel = lambda p: p.quant_state.shape.numel() if getattr(p, "quant_state", None) is not None else p.numel()
    return sum(map(numel, model.parameters())) - model.get_input_embeddings().weight.numel()


def micro_batches(batch: dict, c, sharding: OneProcess) -> tuple[list[dict], int]:
    """The rows in micro-batches (token budget, else gradient_accumulation_steps slices) and how many are real: every
    forward and backward is a collective under FSDP, so a rank with fewer repeats its last one."""
    if c.max_tokens_per_microbatch:
        micro = split_by_tokens(batch, c.max_tokens_per_microbatch, shared_prefix=c.prefix_sharing)
    else:
        micro = split_batch(batch, c.gradient_accumulation_steps)
    return micro + micro[-1:] * (sharding.agree_max(len(micro)) - len(micro)), len(micro)


def pair_tokens(batch: dict, shared_prefix: bool = False) -> torch.Tensor:
    """(B,) real tokens of the rows each example becomes (preference_datasets.row_tokens), from the attention masks."""
    sides = [batch[f"{s}_attention_mask"].sum(1) for s in ("chosen", "rejected") if f"{s}_attention_mask" in batch]
    return data.row_tokens(sides, batch["prompt_attention_mask"].sum(1) if shared_prefix else 0, shared_prefix)


def split_by_tokens(batch: dict, max_tokens: int, shared_prefix: bool = False) -> list[dict]:
    """Micro-batches of consecutive pairs whose real tokens (pair_tokens) stay within `max_tokens` (a larger pair goes
    alone), each cut to its own longest sequence: a long pair costs what it weighs, not everyone's padding."""
    groups = [[]]
    load = 0
    for i, size in enumerate(pair_tokens(batch, shared_prefix).tolist()):
        if groups[-1] and load + size > max_tokens:
            groups.append([])
            load = 0
        groups[-1].append(i)
        load += size
    micro = [
        {k: v[group] if torch.is_tensor(v) else [v[i] for i in group] for k, v in batch.items()} for group in groups
    ]
    return [cut_padding(rows) for rows in micro]


def cut_padding(rows: dict) -> dict:
    """The rows with each side's (chosen, rejected) sequences cut to that side's longest real tokens: they are
    right-padded, so no forward runs over padding columns only."""
    cut = dict(rows)
    for side in ("chosen", "rejected"):
        if f"{side}_attention_mask" in rows:
            width = int(rows[f"{side}_attention_mask"].sum(1).max())
            for k in ("input_ids", "attention_mask", "labels"):
                cut[f"{side}_{k}"] = rows[f"{side}_{k}"][:, :width]
    return cut


def split_batch(batch: dict, k: int) -> list[dict]:
    """k consecutive micro-batches whose sizes differ by at most one (empty ones when there are fewer rows than k)."""
    n = len(batch["chosen_input_ids"])
    return [{key: v[i * n // k : (i + 1) * n // k] for key, v in batch.items()} for i in range(k)]


class FSDPTrainer(BasicTrainer):
    """BasicTrainer with policy and reference sharded as the original FSDPTrainer did (each block a unit, FULL_SHARD,
    BACKWARD_PRE prefetch, MixedPrecision, NO_REENTRANT checkpointing): `self.sharding` (fsdp.py) does the rest."""

    def spread(self, policy: nn.Module, reference_model: nn.Module | None) -> tuple:
        """The engine fsdp.strategy names and both models sharded by it (fsdp.spread)."""
        import fsdp  # the FSDP engines: a one-process run never imports them

        return fsdp.spread(policy, reference_model, self.config, self.rank, self.world_size)
