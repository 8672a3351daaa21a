"""Checkpoints: run_dir/step-N written whole or not at all, checked before a resume trusts it, and what stops a run.

A checkpoint is written as step-N.tmp and renamed when complete; LATEST is swapped atomically; manifest.json (every
file's size and sha256) is written last and checked at resume. It holds policy.pt (the original's format), an HF export,
the optimizer and scheduler state, each rank's RNG, TR-DPO's reference, and trainer_state.pt: the run's TrainState and
what it must match to be resumed. SIGTERM and SIGINT stop a run after its step, with a lean checkpoint (Interrupted).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shlex
import shutil
import signal
import threading
from pathlib import Path

import torch
import yaml

import utils
from config import flatten
from sharding import unwrap
from utils import rank0_print

CHECKPOINT_FORMAT = 1  # bumped when the files of a checkpoint change meaning


@dataclasses.dataclass
class TrainState:
    """What a run changes besides weights, optimizer and schedule, kept in trainer_state.pt (its keys unchanged)."""

    example_counter: int = 0  # training pairs seen: the step of metrics.jsonl, the name of step-N
    batch_counter: int = 0  # optimizer steps taken, a skipped non-finite one included
    nonfinite_in_a_row: int = 0
    nonfinite_total: int = 0
    wandb_id: str | None = None  # the W&B run a resume continues
    beta_dpo_running: tuple | None = None  # beta-DPO's running (M_0, sigma) (modifiers.BetaDPO)


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from: damaged, incomplete or of another run. Nothing was loaded."""


class Interrupted(Exception):
    """SIGTERM or SIGINT: the run stopped after a step and wrote a checkpoint to resume from (`at_once`: a second
    Ctrl-C stopped it without one; `step` and `examples` are then LATEST's, or None before the first checkpoint)."""

    def __init__(self, signum: int, step: int | None, examples: int | None, run_dir: Path, at_once: bool = False):
        super().__init__(f"{signal.Signals(signum).name}: stopped at step {step} ({examples} pairs)")
        self.signum = signum
        self.step = step
        self.examples = examples
        self.run_dir = run_dir
        self.at_once = at_once


@contextlib.contextmanager
def stop_on_signals(stop: dict):
    """Inside, SIGTERM (how SLURM and most schedulers preempt) and SIGINT (Ctrl-C) set stop["signal"] instead of
    ending the process: the loop finishes its step, writes a checkpoint and raises Interrupted. A second SIGINT
    stops at once, without a checkpoint. Outside the main thread (where Python delivers signals) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if stop["signal"] is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        stop["signal"] = signum
        rank0_print(
            f"{signal.Signals(signum).name}: stopping after this step, with a checkpoint "
            "(Ctrl-C again: now, without one)"
        )

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


class Checkpoints:
    """Writes and reads run_dir/step-N for one rank of a run; the trainer hands it the values to save or fill."""

    def __init__(self, run_dir: Path, config, sharding, rank: int, world_size: int, tokenizer):
        self.run_dir = Path(run_dir)
        self.config = config
        self.sharding = sharding
        self.rank = rank
        self.world_size = world_size
        self.tokenizer = tokenizer

    def save(self, state: TrainState, policy, optimizer, scheduler, reference=None, metrics=None, lean=False) -> None:
        """A checkpoint of everything a resume needs (`reference`: TR-DPO's, trained state). `lean` (the stop on a
        signal, whose grace period a scheduler or torchrun cuts short): no consolidated policy.pt where the sharded
        state holds the weights, no HF export, no sha256 (sizes only); the next full checkpoint writes them."""
        c, sharding = self.config, self.sharding
        if c.debug:
            return rank0_print("debug=true: skipping checkpoint")
        final, tmp = self.run_dir / f"step-{state.example_counter}", self.run_dir / f"step-{state.example_counter}.tmp"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        sharding.barrier()
        sharding.save(policy, optimizer, tmp)  # what a resume needs of each rank (one process: optimizer.pt)
        torch.save(utils.get_rng_state(), tmp / f"rng-{self.rank}.pt")
        if reference is not None:
            sharding.save(reference, None, tmp)
        consolidate = not (lean and sharding.saves_weights)  # one process: policy.pt is the resume's weights
        weights = sharding.full_state_dict(policy) if consolidate else {}  # a collective under FSDP: rank 0 keeps it
        if self.rank == 0:
            if consolidate:
                record = {"step_idx": state.example_counter, "state": weights, "metrics": metrics or {}}
                torch.save(record, tmp / "policy.pt")
            torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
            run = dict(model=c.model.name_or_path, datasets=list(c.datasets), seed=c.seed, batch_size=c.batch_size)
            saved = {"format": CHECKPOINT_FORMAT, **dataclasses.asdict(state), **run, "world_size": self.world_size}
            torch.save(saved, tmp / "trainer_state.pt")
            if not lean:
                self.export_hf(policy, weights, tmp / "hf")
        del weights
        sharding.barrier()
        write_manifest(tmp, self.rank, self.world_size, hashes=not lean)
        if self.rank == 0:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            link = self.run_dir / "LATEST.tmp"
            link.unlink(missing_ok=True)
            link.symlink_to(final.name)
            os.replace(link, self.run_dir / "LATEST")
            utils.fsync_dir(self.run_dir)
            note = " (lean: no policy.pt, HF export or sha256)" if lean else ""
            print(f"checkpoint written: {final}{note}", flush=True)
        sharding.barrier()

    def export_hf(self, policy, weights: dict, out: Path) -> None:
        """A Hugging Face directory (safetensors + tokenizer) that plain `from_pretrained` loads (LoRA: lora.export)."""
        model = unwrap(policy)
        if self.config.lora.r is not None:
            import lora  # the adapter, and the base with the adapters merged

            model, weights = lora.export(model, weights, self.config.lora, out.parent / "adapter")
        model.save_pretrained(out, state_dict=weights, safe_serialization=True)
        self.tokenizer.save_pretrained(out)

    def resume(self, state: TrainState, policy, optimizer, scheduler, reference=None) -> None:
        """Weights, optimizer, schedule (this run's lr and schedule from the loaded step), RNG and `state` from
        run_dir/LATEST (resume_from set; validated before any model loaded: train.check_inputs)."""
        c = self.config
        ckpt = Path(c.resume_from) / "LATEST"
        saved = torch.load(ckpt / "trainer_state.pt", weights_only=True)
        check_compatible(saved, c, self.world_size)
        self.sharding.load(policy, optimizer, ckpt)
        if reference is not None:
            self.sharding.load(reference, None, ckpt)
        scheduler.load_state_dict(torch.load(ckpt / "scheduler.pt", weights_only=True))
        before = [g["lr"] for g in optimizer.param_groups]  # the saved state holds the lr the run was started with
        scheduler.base_lrs = [c.lr] * len(before)
        for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
            group["initial_lr"], group["lr"] = c.lr, c.lr * factor(scheduler.last_epoch)
        scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]
        if before != scheduler._last_lr:
            rank0_print(
                f"resume: lr {before[0]:.6g} -> {scheduler._last_lr[0]:.6g} at step {scheduler.last_epoch} "
                f"(lr={c.lr:g}, scheduler={c.scheduler}, warmup_steps={c.warmup_steps})"
            )
        for field in dataclasses.fields(state):
            setattr(state, field.name, saved.get(field.name))
        utils.set_rng_state(torch.load(ckpt / f"rng-{self.rank}.pt", weights_only=True))
        rank0_print(f"resumed from {ckpt.resolve()} at {state.example_counter} examples ({state.batch_counter} steps)")


def write_manifest(ckpt: Path, rank: int, world_size: int, hashes: bool = True) -> None:
    """manifest.json: the size (and with `hashes` the sha256) of every file of the checkpoint, written last, each
    file fsynced as it is read: a crash, a full disk or a later bit flip shows up at resume as a mismatch, never as
    wrong weights. The ranks share the files, largest first, so hashing takes 1/world_size of the time."""
    files = [p for p in ckpt.rglob("*") if p.is_file() and p.name != "manifest.json"]
    files.sort(key=lambda p: (-p.stat().st_size, str(p)))
    sha256 = {}
    for p in files[rank::world_size]:
        with open(p, "rb") as f:
            os.fsync(f.fileno())
            if hashes:
                sha256[str(p.relative_to(ckpt))] = hashlib.file_digest(f, "sha256").hexdigest()
    sha256 = dict(sorted(kv for part in utils.all_gather_object(sha256, slow=True) for kv in part.items()))
    if rank == 0:
        sizes = {str(p.relative_to(ckpt)): p.stat().st_size for p in sorted(files)}
        record = {"format": CHECKPOINT_FORMAT, "files": sizes, "sha256": sha256}
        utils.atomic_write_text(ckpt / "manifest.json", json.dumps(record, indent=1))


def validate_checkpoint(ckpt: Path, hashes: bool = True) -> Path:
    """The checkpoint directory, after checking every file of its manifest (there, its size, and with `hashes` its
    sha256). Nothing is loaded from one that fails; the message names each bad file and the run's earlier complete
    checkpoints. It runs once per resume: in the launcher, or on rank 0 of a torchrun job (train.py)."""
    run_dir = ckpt.parent
    earlier = [  # complete checkpoints (a manifest: a directory), newest first
        p.name
        for p in run_dir.glob("step-*")
        if not p.name.endswith(".tmp") and (p / "manifest.json").exists() and p.resolve() != ckpt.resolve()
    ]
    earlier.sort(key=lambda n: int(n.split("-")[1]) if n.split("-")[1].isdigit() else -1, reverse=True)
    hint = ""
    if earlier:
        hint = (
            f"\nearlier checkpoints in {run_dir}: {', '.join(earlier)}; to resume from one, point LATEST at it:"
            f" ln -sfn {earlier[0]} {run_dir / 'LATEST'}"
        )
    if not ckpt.is_dir():
        raise CheckpointError(
            f"cannot resume: {ckpt}{f' -> {os.readlink(ckpt)}' if ckpt.is_symlink() else ''} is not a "
            f"checkpoint directory{hint}"
        )
    if not (ckpt / "manifest.json").exists():
        raise CheckpointError(f"cannot resume: {ckpt} has no manifest.json (no complete checkpoint there){hint}")
    try:
        record = json.loads((ckpt / "manifest.json").read_text())
        listed, sums = dict(record["files"]), dict(record.get("sha256", {}))
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"cannot resume: {ckpt / 'manifest.json'} is unreadable ({type(e).__name__}: {e}){hint}"
        ) from None
    problems = []
    for name, size in listed.items():
        path = ckpt / name
        if not path.is_file():
            problems.append(f"{name}: missing")
        elif path.stat().st_size != size:
            problems.append(f"{name}: {path.stat().st_size} bytes, the manifest says {size} (truncated or overwritten)")
        elif hashes and name in sums and utils.file_sha256(path) != sums[name]:
            problems.append(f"{name}: sha256 differs from the manifest (same size, other bytes: corrupted)")
    if problems:
        raise CheckpointError(
            f"cannot resume: the checkpoint {ckpt.resolve()} is damaged, nothing was loaded:\n  "
            + "\n  ".join(problems)
            + hint
        )
    return ckpt


# What a resume may change; any other key changes what the saved state means.
RESUME_MAY_CHANGE = (
    ("lr", "scheduler", "warmup_steps")  # applied after loading, printed
    + ("n_epochs", "n_examples")  # the run's length
    + ("eval_every", "n_eval_examples", "eval_batch_size", "do_first_eval")  # evaluation
    + ("sample_during_eval", "n_eval_model_samples", "max_new_tokens", "temperature", "top_p")  # sampling
    + ("minimum_log_interval_secs", "log_every_steps", "wandb.", "debug", "exp_name")  # logging
    + ("local_dirs", "run_dir", "resume_from")  # file places
    + ("collective_timeout_secs", "fsdp_port", "n_workers", "max_nonfinite_steps", "peak_tflops")  # launch, guards
    # knobs that change memory or speed, not numbers; the self-check before the first step
    + ("activation_checkpointing", "fsdp.param_offload", "fsdp.optimizer_offload", "fsdp.offload_policy")
    + ("fsdp.forward_prefetch", "fsdp.entropy_from_logits_with_chunking", "fsdp.entropy_checkpointing")
    + ("fsdp.use_torch_compile", "self_check")
)


def check_compatible(state: dict, config, world_size: int) -> None:
    """Refuse, before anything is loaded, to resume a checkpoint of another model, data, geometry or objective."""
    expected = {
        "model": config.model.name_or_path,
        "datasets": list(config.datasets),
        "seed": config.seed,
        "batch_size": config.batch_size,
        "world_size": world_size,
    }
    wrong = [
        f"{k}: checkpoint has {state.get(k)!r}, this run has {v!r}" for k, v in expected.items() if state.get(k) != v
    ]
    if state.get("format") != CHECKPOINT_FORMAT:
        wrong.append(f"format: checkpoint has {state.get('format')!r}, this code reads {CHECKPOINT_FORMAT}")
    original = Path(config.resume_from or "") / "config.yaml"
    if config.resume_from and original.is_file():  # what the run was started with: any other change is refused
        saved, now = flatten(yaml.safe_load(original.read_text()) or {}), flatten(config.to_dict())
        wrong += [
            f"{key}: the run was started with {saved.get(key)!r} ({original}), this run has {now.get(key)!r} (a resume "
            f"may change only {', '.join(RESUME_MAY_CHANGE)})"
            for key in sorted(set(saved) | set(now))
            if saved.get(key) != now.get(key) and not key.startswith(RESUME_MAY_CHANGE)
        ]
    if wrong:
        raise CheckpointError(
            "cannot resume: the checkpoint belongs to a different run (nothing was loaded):\n  " + "\n  ".join(wrong)
        )


def resume_run_dir(resume_from: str) -> str:
    """The run directory a resume continues, from what users copy: the run directory, its LATEST, or the step-N
    checkpoint LATEST points at (an earlier one would have its later checkpoints overwritten: refused)."""
    path = Path(resume_from)
    latest = path.parent / "LATEST"
    if (path / "LATEST").exists():
        return str(path)
    if latest.exists() and (path.name == "LATEST" or path.resolve() == latest.resolve()):
        return str(path.parent)
    if latest.exists() and path.name.startswith("step-"):
        raise FileNotFoundError(
            f"resume_from={resume_from}: not the run's latest checkpoint ({latest} -> {latest.resolve().name});"
            f" a resume continues from LATEST and would overwrite the later checkpoints. To go back to"
            f" {path.name}: ln -sfn {path.name} {latest}"
        )
    if (path / "config.yaml").is_file():
        raise FileNotFoundError(
            f"resume_from={resume_from}: no LATEST checkpoint there: the run stopped before its first"
            " checkpoint; start it again with the same command, without resume_from"
        )
    raise FileNotFoundError(
        f"resume_from={resume_from}: no checkpoint there; expected a run directory holding LATEST "
        "(or its LATEST, or the step-N checkpoint LATEST points at)"
    )


def checkpoint_problem(ckpt: Path) -> str | None:
    """validate_checkpoint's message for a damaged checkpoint, None for a sound one (a verdict to broadcast)."""
    try:
        validate_checkpoint(ckpt)
    except CheckpointError as e:
        return str(e)
    return None


def interrupted(signum: int, run_dir: Path, batch_size: int, at_once: bool = False) -> Interrupted:
    """The Interrupted that the ranks' exit (or a second Ctrl-C) means, at the run's LATEST checkpoint if any."""
    latest = run_dir / "LATEST"
    examples = int(os.readlink(latest).split("-")[1]) if latest.is_symlink() else None
    return Interrupted(signum, examples and examples // batch_size, examples, run_dir, at_once)


def interrupt_message(e: Interrupted, argv: list[str]) -> str:
    """One line: where the run stopped and the command that continues it (as given, resume_from replaced)."""
    kept = [a for a in argv if not a.lstrip("-").startswith("resume_from=")]
    name = signal.Signals(e.signum).name
    if e.examples is None:
        return (
            f"interrupted ({name}) before the first checkpoint: start again with: python -u train.py {shlex.join(kept)}"
        )
    resume = f"resume with: python -u train.py {shlex.join([*kept, f'resume_from={e.run_dir}'])}"
    if e.at_once:
        latest = f"the latest is step {e.step} ({e.examples} pairs)"
        return f"interrupted ({name}) at once, without a checkpoint; {latest}: {resume}"
    return f"interrupted at step {e.step} ({e.examples} pairs, {name}); {resume}"
