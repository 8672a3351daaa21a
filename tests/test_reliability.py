"""Reliability, as a user meets it: real train.py subprocesses, real SIGKILL, real damaged files.

R1  SIGKILL at 10 seeded points of a run (loading, evaluation with sampling, checkpoint write, training), each
    followed by the same command (+ resume_from=<run dir> once a checkpoint exists): the final weights and
    optimizer state are bit-identical to an uninterrupted run.
R2  A kill during a checkpoint write leaves LATEST on the previous checkpoint; a damaged checkpoint (truncated
    or flipped file, lost manifest, dangling LATEST) is refused with a message naming the file, never loaded.
R3  Malformed data fails through train.py with exit 2, file/line/field on stderr, no traceback, no model loaded.
    (All 42 files of tests/data/bad_data are checked in-process by test_preference_datasets.py; 5 here.)
R4  Every line of tests/data/bad_configs.tsv fails through train.py with exit 2 and its message, before any model
    loads (the time each took is printed, not asserted).
R5  A non-finite loss or gradient skips the step (parameters, optimizer state, schedule untouched), is counted
    in metrics.jsonl as nonfinite_steps; more than max_nonfinite_steps in a row stops with a checkpoint.
R7  Checkpoints load with weights_only=True, exports are safetensors, trust_remote_code is off unless asked,
    no secret from the environment is printed or saved, and a checkpoint or archive of another run or
    architecture is refused before anything is loaded.

Every subprocess runs with OMP_NUM_THREADS=1: two runs share the two cores of a CI machine without
oversubscription (which makes a step ~10x slower), and bit-identity does not depend on the core count.
"""

import copy
import json
import math
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from queue import Empty, Queue

import pytest
import torch

from test_preference_datasets import BAD_CASES  # the expected message fragments of every bad data file

from conftest import LOCAL_DIRS  # runs and caches in a temporary directory

REPO = Path(__file__).resolve().parent.parent
BAD_DATA = REPO / "tests" / "data" / "bad_data"
BAD_CONFIGS = REPO / "tests" / "data" / "bad_configs.tsv"
SLOW = REPO / "tests" / "data" / "slow_checkpoint.py"  # train.py with a large model's slow checkpoint and step

# 12 steps of 8 pairs; evaluation (with sampling) and a checkpoint every 2 steps: 6 checkpoints to kill around.
RUN = [
    "loss=dpo",
    "model=tiny",
    "datasets=[toy]",
    "n_epochs=null",
    "n_examples=96",
    "batch_size=8",
    "eval_batch_size=8",
    "eval_every=16",
    "lr=1e-4",
    "warmup_steps=2",
    "n_eval_examples=16",
    "n_eval_model_samples=4",
    "max_length=64",
    "max_prompt_length=32",
    "max_new_tokens=8",
    "sample_during_eval=true",
    "minimum_log_interval_secs=0",
    "wandb.enabled=false",
    "fsdp.use_torch_compile=false",
    LOCAL_DIRS,
]
SECRETS = {
    "WANDB_API_KEY": "wandbkey-3f9c1e7a5b2d4c6e8a0b1c2d3e4f5a6b7c8d9e0f",
    "HF_TOKEN": "hf_SeCrEtToKeN9271xQzLpWv",
}
ENV = {**os.environ, "OMP_NUM_THREADS": "1", **SECRETS}
STATE_FILES = ("policy.pt", "optimizer.pt", "scheduler.pt", "trainer_state.pt", "rng-0.pt")


def train_cmd(run_dir, *extra) -> list[str]:
    return [sys.executable, "-u", str(REPO / "train.py"), *RUN, f"run_dir={run_dir}", *extra]


def run_train(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -u train.py <args>` to completion, its output captured."""
    return subprocess.run(
        [sys.executable, "-u", str(REPO / "train.py"), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=ENV,
        timeout=timeout,
    )


def run_resumed(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    """The run's own command plus resume_from=<run dir>, as a user resumes it."""
    return run_train([*RUN, f"run_dir={run_dir}", f"resume_from={run_dir}", *extra])


def latest(run_dir: Path, name: str):
    return torch.load(run_dir / "LATEST" / name, map_location="cpu", weights_only=True)


def assert_bit_identical(a, b, where: str = "") -> None:
    """Nested dicts/lists of tensors and numbers: equal keys, torch.equal tensors, equal everything else."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys {sorted(a)} vs {sorted(b)}"
        for k in a:
            assert_bit_identical(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bit_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)  # LATEST stays a relative link into the copy
    return dst


# ---------------------------------------------------------------------------------------------------------
# The uninterrupted run: R1's reference, and the run R2 and R7 damage copies of. It starts in the background
# so that it runs beside R1's kill chain (one core each).
# ---------------------------------------------------------------------------------------------------------
class Background:
    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.out, self.err = run_dir.parent / "reference.out", run_dir.parent / "reference.err"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(train_cmd(run_dir), stdout=out, stderr=err, text=True, cwd=REPO, env=ENV)
        self.done = False

    def wait(self) -> Path:
        if not self.done:
            self.proc.wait(timeout=600)
            self.done = True
        assert self.proc.returncode == 0, self.out.read_text()[-3000:] + self.err.read_text()[-3000:]
        return self.run_dir


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    background = Background(tmp_path_factory.mktemp("reference") / "run")
    yield background
    if background.proc.poll() is None:
        background.proc.kill()
        background.proc.wait()


# ---------------------------------------------------------------------------------------------------------
# R4: bad configs through train.py
# ---------------------------------------------------------------------------------------------------------
def bad_config_cases() -> list[tuple[str, str]]:
    cases = []
    for line in BAD_CONFIGS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            args, fragment = line.split("\t")
            cases.append((args, fragment))
    return cases


def test_every_bad_config_fails_with_its_message_through_train_py_before_a_model_loads():
    cases = bad_config_cases()
    assert len(cases) >= 20

    def attempt(case):
        args, fragment = case
        start = time.perf_counter()
        result = run_train(shlex.split(args), timeout=60)
        return args, fragment, result, time.perf_counter() - start

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(attempt, cases))
    failures = []
    for args, fragment, result, seconds in results:
        problems = [
            p
            for p, bad in [
                (f"exit {result.returncode}, expected 2", result.returncode != 2),
                (f"{fragment!r} not on stderr", fragment not in result.stderr),
                ("a Traceback", "Traceback" in result.stderr + result.stdout),
                ("a model was loaded", "loading policy" in result.stdout),
            ]
            if bad
        ]
        if problems:
            failures.append(f"{args}: {', '.join(problems)}\n    stderr: {result.stderr.strip()[-400:]}")
    print(f"\nR4: {len(cases)} bad configs tried, slowest {max(r[3] for r in results):.2f} s")
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------------------------------------------------
# R3: bad data through train.py (the full set of 42 is tested in-process in test_preference_datasets.py)
# ---------------------------------------------------------------------------------------------------------
# One of each kind: broken JSON, a missing field, a wrongly typed field, bad bytes, a broken chat message.
BAD_DATA_THROUGH_TRAIN = [
    "not_json.jsonl",
    "missing_chosen.jsonl",
    "chosen_number.jsonl",
    "invalid_utf8.jsonl",
    "chat_reply_not_assistant.jsonl",
]


def test_bad_data_fails_through_train_py_naming_file_line_and_field(tmp_path):
    assert len(BAD_CASES) >= 25 and all((BAD_DATA / name).exists() for name in BAD_DATA_THROUGH_TRAIN)

    def attempt(name):
        path = BAD_DATA / name
        return name, path, run_train([f"datasets=[{path}]", "model=tiny", f"run_dir={tmp_path / name}"], timeout=120)

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(attempt, BAD_DATA_THROUGH_TRAIN))
    for name, path, result in results:
        assert result.returncode == 2, (name, result.stderr[-2000:])
        assert "Traceback" not in result.stderr, (name, result.stderr[-2000:])
        assert result.stderr.startswith("error: ") and str(path) in result.stderr, (name, result.stderr)
        for fragment in BAD_CASES[name]:
            assert fragment in result.stderr, (name, fragment, result.stderr)
        assert "loading policy" not in result.stdout and not (tmp_path / name).exists()  # before any model or run dir
    print(
        f"\nR3: {len(BAD_CASES)} bad data files in-process (test_preference_datasets.py), "
        f"{len(BAD_DATA_THROUGH_TRAIN)} through train.py"
    )


# ---------------------------------------------------------------------------------------------------------
# R1: ten seeded SIGKILLs, then the resumed run ends bit-identical to the uninterrupted one
# ---------------------------------------------------------------------------------------------------------
KILL_SEED = 1234
# Where to aim each kill: (what the test waits for, then a seeded random delay in seconds).
#   load  after "run directory:" is printed: imports, model loading, tokenized data
#   eval  after "Running evaluation after N": eval metrics, then sampling from policy and reference
#   ckpt  once step-N.tmp/ appears after "eval after N:": the checkpoint is being written
#   train after "checkpoint written": optimizer steps
KILL_AIMS = {"load": (0.0, 3.0), "eval": (0.0, 0.25), "ckpt": (0.0, 0.02), "train": (0.05, 0.4)}


class Watched:
    """A train.py process whose stdout lines arrive on a queue (stderr, tqdm's bars, goes to a file)."""

    def __init__(self, cmd: list[str], err_path: Path):
        self.err = open(err_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.err, text=True, cwd=REPO, env=ENV)
        self.lines: list[str] = []
        self.queue: Queue = Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.queue.put(line)
        self.queue.put(None)

    def wait_for(self, predicate, timeout: float = 300) -> str | None:
        """The first new line that satisfies `predicate`; None if the process ended first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.queue.get(timeout=0.5)
            except Empty:
                continue
            if line is None:
                self.queue.put(None)
                return None
            self.lines.append(line)
            if predicate(line):
                return line
        raise TimeoutError(f"no expected line within {timeout} s; last lines: {self.lines[-5:]}")

    def finish(self, kill: bool) -> int:
        if kill:
            self.proc.send_signal(signal.SIGKILL)
        code = self.proc.wait(timeout=300)
        self.reader.join(timeout=60)
        while True:
            line = self.queue.get()
            if line is None:
                break
            self.lines.append(line)
        self.err.close()
        return code


def kill_somewhere(watched: Watched, run_dir: Path, aim: str, delay: float) -> bool:
    """Wait for the aim's trigger, sleep `delay`, SIGKILL. False if the run ended before the trigger."""
    if aim == "load":
        found = watched.wait_for(lambda line: line.startswith("run directory:"))
    elif aim == "eval":
        found = watched.wait_for(lambda line: line.startswith("Running evaluation after"))
    elif aim == "train":
        found = watched.wait_for(lambda line: line.startswith("checkpoint written:"))
    else:  # ckpt: the eval line that precedes the write, then the write's directory
        found = watched.wait_for(lambda line: re.match(r"eval after [1-9]\d*:", line) is not None)
        if found is not None:
            step = re.match(r"eval after (\d+)", found).group(1)
            tmp = run_dir / f"step-{step}.tmp"
            deadline = time.monotonic() + 30
            while not tmp.exists() and watched.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.0005)
    if found is None or watched.proc.poll() is not None:
        return False
    time.sleep(delay)
    return watched.proc.poll() is None


def where_it_died(lines: list[str], run_dir: Path) -> str:
    """Which phase the kill landed in, read from the last progress markers the run printed."""
    markers = [
        line
        for line in lines
        if line.startswith(
            ("batch geometry", "Running evaluation after", "eval after", "checkpoint written:", "resumed from")
        )
    ]
    if not any(line.startswith("batch geometry") for line in markers):
        return "loading"
    last = markers[-1]
    if last.startswith("Running evaluation after"):
        return "evaluation"
    if last.startswith("eval after"):
        step = re.match(r"eval after (\d+)", last).group(1)
        if step != "0":
            return "checkpoint write" if (run_dir / f"step-{step}.tmp").exists() else "checkpoint rename"
    return "training"


def test_sigkill_at_ten_seeded_points_then_resume_is_bit_identical(reference, tmp_path):
    rng = random.Random(KILL_SEED)
    aims = ["load", "load", "eval", "eval", "eval", "ckpt", "ckpt", "ckpt", "train", "train"]
    rng.shuffle(aims)
    if aims[0] == "train":  # the first kill must land before the first checkpoint: a restart from scratch
        swap = next(i for i, aim in enumerate(aims) if aim != "train")
        aims[0], aims[swap] = aims[swap], aims[0]
    run_dir = tmp_path / "run"
    survived, log = 0, []
    started = time.monotonic()
    for i, aim in enumerate(aims):
        resume = (run_dir / "LATEST").exists()
        watched = Watched(train_cmd(run_dir, *([f"resume_from={run_dir}"] if resume else [])), tmp_path / f"err-{i}")
        delay = rng.uniform(*KILL_AIMS[aim])
        killed = kill_somewhere(watched, run_dir, aim, delay)
        code = watched.finish(kill=killed)
        assert killed and code == -signal.SIGKILL, (
            f"kill {i} ({aim}) never landed: exit {code}\n{''.join(watched.lines[-20:])}"
            f"{(tmp_path / f'err-{i}').read_text()[-2000:]}"
        )
        phase = where_it_died(watched.lines, run_dir)
        after = os.readlink(run_dir / "LATEST") if (run_dir / "LATEST").is_symlink() else "none"
        resumed_at = next((line.strip() for line in watched.lines if line.startswith("resumed from")), "")
        log.append(
            f"kill {i}: aimed at {aim:5s} +{delay:.3f}s, landed in {phase:17s} "
            f"({'resumed' if resume else 'from scratch'}; LATEST after kill: {after}) {resumed_at}"
        )
        survived += 1
        # Whatever the kill interrupted, LATEST names a complete checkpoint (or there is none yet).
        if (run_dir / "LATEST").exists():
            assert (run_dir / "LATEST" / "manifest.json").exists()
    final = run_resumed(run_dir)
    assert final.returncode == 0, final.stdout[-3000:] + final.stderr[-3000:]
    print(f"\nR1: {survived} kill points survived in {time.monotonic() - started:.0f} s\n  " + "\n  ".join(log))
    phases = " ".join(log)
    assert "landed in evaluation" in phases, "\n".join(log)
    assert "landed in checkpoint write" in phases, "\n".join(log)
    assert "from scratch" in phases, "\n".join(log)
    reference_dir = reference.wait()
    assert os.readlink(run_dir / "LATEST") == os.readlink(reference_dir / "LATEST") == "step-96"
    assert_bit_identical(latest(reference_dir, "policy.pt")["state"], latest(run_dir, "policy.pt")["state"], "policy")
    assert_bit_identical(latest(reference_dir, "optimizer.pt"), latest(run_dir, "optimizer.pt"), "optimizer")
    assert_bit_identical(latest(reference_dir, "scheduler.pt"), latest(run_dir, "scheduler.pt"), "scheduler")


def test_resume_from_a_run_killed_before_its_first_checkpoint_says_to_start_again(tmp_path):
    """Such a run is restarted with its own command (no resume_from), as R1 does; resume_from says so at once."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("seed: 0\n")  # all a run killed while loading leaves behind
    result = run_train([*RUN, f"resume_from={run}"], timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"resume_from={run}: no LATEST checkpoint there" in result.stderr and "loading policy" not in result.stdout


# ---------------------------------------------------------------------------------------------------------
# R2: what a kill during a checkpoint write leaves behind, and damaged checkpoints
# ---------------------------------------------------------------------------------------------------------
def point_latest(run_dir: Path, name: str) -> None:
    link = run_dir / "LATEST.tmp"
    link.symlink_to(name)
    os.replace(link, run_dir / "LATEST")


def test_a_kill_during_a_checkpoint_write_resumes_from_the_previous_checkpoint(reference, tmp_path):
    """What a kill while step-96 is written leaves: step-96.tmp/ with a truncated policy.pt and no manifest, and
    LATEST on step-80. The resume ignores the leftover, starts at 80, rewrites step-96 and ends bit-identical."""
    run = copy_run(reference.wait(), tmp_path / "run")
    os.replace(run / "step-96", run / "step-96.tmp")
    (run / "step-96.tmp" / "manifest.json").unlink()
    policy = run / "step-96.tmp" / "policy.pt"
    os.truncate(policy, policy.stat().st_size // 2)
    point_latest(run, "step-80")
    result = run_resumed(run)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"resumed from {(run / 'step-80').resolve()} at 80 examples" in result.stdout
    assert not (run / "step-96.tmp").exists() and os.readlink(run / "LATEST") == "step-96"
    assert_bit_identical(latest(reference.run_dir, "policy.pt")["state"], latest(run, "policy.pt")["state"], "policy")


def test_a_truncated_file_in_latest_is_refused_through_train_py_and_nothing_runs(reference, tmp_path):
    run = copy_run(reference.wait(), tmp_path / "run")
    optimizer = run / "step-96" / "optimizer.pt"
    size = optimizer.stat().st_size
    os.truncate(optimizer, size - 100)
    before = sorted(p.name for p in run.iterdir()), (run / "metrics.jsonl").read_bytes()
    result = run_resumed(run)
    assert result.returncode == 2 and "resumed from" not in result.stdout and "Traceback" not in result.stderr
    for fragment in (
        "cannot resume",
        "is damaged, nothing was loaded",
        "earlier checkpoints",
        f"optimizer.pt: {size - 100} bytes, the manifest says {size}",
        f"ln -sfn step-80 {run / 'LATEST'}",
    ):
        assert fragment in result.stderr, (fragment, result.stderr[-2000:])
    assert "step skipped" not in result.stdout and "Running evaluation" not in result.stdout
    after = (
        sorted(p.name for p in run.iterdir() if p.name != "config.resumed.yaml"),
        (run / "metrics.jsonl").read_bytes(),
    )
    assert after == before and os.readlink(run / "LATEST") == "step-96"


def _flip_a_byte(ckpt: Path) -> None:
    path = ckpt / "policy.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size: only the checksum can tell
    path.write_bytes(bytes(data))


DAMAGES = {  # what is done to LATEST's checkpoint -> what the refusal must say
    "flipped byte": (_flip_a_byte, ["policy.pt: sha256 differs from the manifest"]),
    "missing file": (lambda c: (c / "rng-0.pt").unlink(), ["rng-0.pt: missing"]),
    "truncated safetensors": (
        lambda c: os.truncate(c / "hf" / "model.safetensors", 10),
        ["hf/model.safetensors: 10 bytes"],
    ),
    "no manifest": (lambda c: (c / "manifest.json").unlink(), ["has no manifest.json"]),
    "garbled manifest": (
        lambda c: (c / "manifest.json").write_text('{"format": 1, "fil'),
        ["manifest.json is unreadable"],
    ),
    "dangling LATEST": (lambda c: shutil.rmtree(c), ["LATEST -> step-96 is not a checkpoint directory"]),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_checkpoint_is_refused_naming_the_file(reference, tmp_path, damage):
    import checkpoints

    ref = reference.wait()
    run = tmp_path / "run"
    run.mkdir()
    for step in ("step-80", "step-96"):
        shutil.copytree(ref / step, run / step)
    point_latest(run, "step-96")
    assert checkpoints.validate_checkpoint(run / "LATEST") == run / "LATEST"  # intact: accepted
    do, fragments = DAMAGES[damage]
    do(run / "step-96")
    with pytest.raises((ValueError, FileNotFoundError)) as refused:
        checkpoints.validate_checkpoint(run / "LATEST")
    message = str(refused.value)
    for fragment in [*fragments, "cannot resume", f"ln -sfn step-80 {run / 'LATEST'}"]:
        assert fragment in message, (fragment, message)


# ---------------------------------------------------------------------------------------------------------
# In-process trainers, built the way train.py's worker_main builds them
# ---------------------------------------------------------------------------------------------------------
def build_trainer(run_dir: Path, *overrides: str):
    import config_loader
    import train
    import trainers
    from utils import seed_everything

    cfg, _ = config_loader.load_config([*RUN, f"run_dir={run_dir}", *overrides])
    run_dir, _ = train.prepare_run_dir(cfg)
    seed_everything(cfg.seed, cfg.fsdp.full_determinism)
    tokenizer, policy, reference_model = train.load_models(cfg)
    return trainers.BasicTrainer(
        policy, cfg, cfg.seed, str(run_dir), reference_model=reference_model, tokenizer=tokenizer
    )


def snapshot(trainer) -> tuple:
    return (
        {k: v.detach().clone() for k, v in trainer.policy.state_dict().items()},
        copy.deepcopy(trainer.optimizer.state_dict()),
        copy.deepcopy(trainer.scheduler.state_dict()),
    )


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------------------------------------------------
# R5: non-finite steps
# ---------------------------------------------------------------------------------------------------------
def nan_embeddings(module, inputs, output):
    return output * float("nan")  # every later activation, the loss and every gradient become NaN for real


def test_a_nonfinite_loss_or_gradient_skips_the_step_and_changes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    trainer = build_trainer(tmp_path / "run", "do_first_eval=false")
    trainer.build_optimizer()
    batches = iter(trainer.train_batches())
    trainer.train_step(next(batches))  # a normal step first: the optimizer now has state to protect
    before = snapshot(trainer)

    hook = trainer.policy.get_input_embeddings().register_forward_hook(nan_embeddings)
    metrics = trainer.train_step(next(batches))  # 1. a non-finite loss
    hook.remove()
    assert math.isnan(metrics["loss/train"]) and metrics["nonfinite_steps"] == 1
    assert_bit_identical(before, snapshot(trainer), "after a NaN loss")
    assert all(p.grad is None for p in trainer.policy.parameters())  # no NaN gradient lingers into the next step

    weight = trainer.policy.get_output_embeddings().weight
    hook = weight.register_hook(lambda grad: grad * float("inf"))
    metrics = trainer.train_step(next(batches))  # 2. a finite loss with a non-finite gradient
    hook.remove()
    assert math.isfinite(metrics["loss/train"]) and not math.isfinite(metrics["grad_norm"])
    assert metrics["nonfinite_steps"] == 2 and trainer.state.nonfinite_in_a_row == 2
    assert_bit_identical(before, snapshot(trainer), "after an inf gradient")

    metrics = trainer.train_step(next(batches))  # 3. finite again: the step is taken, the streak ends
    after = snapshot(trainer)
    assert (
        trainer.state.nonfinite_in_a_row == 0 and trainer.state.nonfinite_total == 2 and metrics["nonfinite_steps"] == 2
    )
    assert not torch.equal(after[0]["lm_head.weight"], before[0]["lm_head.weight"])
    assert after[2]["last_epoch"] == before[2]["last_epoch"] + 1


def test_more_than_max_nonfinite_steps_in_a_row_stop_the_run_with_a_checkpoint(tmp_path, monkeypatch):
    import trainers

    monkeypatch.chdir(REPO)
    trainer = build_trainer(tmp_path / "run", "max_nonfinite_steps=2", "do_first_eval=false", "eval_every=96")
    initial = {k: v.detach().clone() for k, v in trainer.policy.state_dict().items()}
    trainer.policy.get_input_embeddings().register_forward_hook(nan_embeddings)
    stop = r"3 non-finite steps in a row \(max_nonfinite_steps=2\); checkpoint saved"
    with pytest.raises(trainers.NonFiniteError, match=stop):
        trainer.train()
    run = trainer.run_dir
    assert os.readlink(run / "LATEST") == "step-24"
    state = latest(run, "trainer_state.pt")
    assert state["nonfinite_in_a_row"] == state["nonfinite_total"] == 3 and state["batch_counter"] == 3
    assert_bit_identical(initial, latest(run, "policy.pt")["state"], "policy")  # no skipped step touched it
    assert [r["nonfinite_steps"] for r in read_metrics(run) if "nonfinite_steps" in r] == [1.0, 2.0, 3.0]


def test_a_diverging_run_stops_through_train_py_with_a_checkpoint_and_a_message(tmp_path):
    """lr=1e30: the first step is finite, then the weights overflow and every loss is NaN."""
    run = tmp_path / "run"
    result = run_train(
        [
            *RUN,
            f"run_dir={run}",
            "lr=1e30",
            "warmup_steps=0",
            "max_nonfinite_steps=2",
            "do_first_eval=false",
            "eval_every=96",
        ]
    )
    assert result.returncode == 3 and "Traceback" not in result.stderr
    assert "non-finite loss or gradient at step 1: step skipped (1 in a row, 1 in total)" in result.stdout
    assert "3 non-finite steps in a row (max_nonfinite_steps=2); checkpoint saved" in result.stderr
    assert os.readlink(run / "LATEST") == "step-32" and latest(run, "trainer_state.pt")["nonfinite_in_a_row"] == 3
    assert [r["nonfinite_steps"] for r in read_metrics(run)] == [0.0, 1.0, 2.0, 3.0]


# ---------------------------------------------------------------------------------------------------------
# R7: safe loading, no secrets, refusing what belongs to another run
# ---------------------------------------------------------------------------------------------------------
def test_checkpoints_load_weights_only_and_exports_are_safetensors(reference):
    from safetensors.torch import load_file

    ref = reference.wait()
    steps = sorted(ref.glob("step-*"))
    assert len(steps) == 6
    for step in steps:
        for name in STATE_FILES:
            torch.load(step / name, map_location="cpu", weights_only=True)
        exported = load_file(step / "hf" / "model.safetensors")
        state = torch.load(step / "policy.pt", weights_only=True)["state"]
        assert_bit_identical({k: state[k] for k in exported}, exported, f"{step.name}/hf")
    assert not [p for p in ref.rglob("*") if p.suffix == ".bin" or p.name.startswith("pytorch_model")]


class Payload:
    """What a hostile checkpoint carries: unpickling it makes a directory (a stand-in for any command)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_a_hostile_pickle_is_never_executed_as_archive_or_checkpoint(reference, tmp_path, monkeypatch):
    import train

    monkeypatch.chdir(REPO)
    marker = tmp_path / "payload-ran"
    archive = tmp_path / "policy.pt"
    torch.save({"step_idx": 0, "state": Payload(marker), "metrics": {}}, archive)
    with pytest.raises(ValueError, match="not a policy.pt checkpoint"):
        train.load_archive(str(archive), torch.nn.Linear(1, 1))
    assert not marker.exists()
    # A checkpoint whose manifest vouches for a hostile trainer_state.pt (an attacker rewrites both).
    import checkpoints

    run = copy_run(reference.wait(), tmp_path / "run")
    torch.save({"format": 1, "payload": Payload(marker)}, run / "step-96" / "trainer_state.pt")
    checkpoints.write_manifest(run / "step-96", 0, 1)
    trainer = build_trainer(tmp_path / "other", f"resume_from={run}")
    trainer.build_optimizer()
    with pytest.raises(Exception, match="[Ww]eights only load failed|Unsupported global"):
        trainer.resume()
    assert not marker.exists()


def test_trust_remote_code_is_off_unless_asked():
    import ast
    import config
    import config_loader
    import yaml

    assert config.ModelConfig().trust_remote_code is False
    for path in [REPO / "config" / "config.yaml", *sorted((REPO / "config" / "model").glob("*.yaml"))]:
        text = yaml.safe_load(path.read_text()) or {}
        assert (text.get("model", text) or {}).get("trust_remote_code", False) is False, path
        name = path.stem
        if path.parent.name == "model":
            cfg, _ = config_loader.load_config(
                [f"model={name}", "model.name_or_path=some/model", "model.block_name=Block"]
            )
            assert cfg.model.trust_remote_code is False, name
    calls = []
    for source in sorted(REPO.glob("*.py")):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "from_pretrained":
                given = {k.arg: k.value for k in node.keywords}
                calls.append(f"{source.name}:{node.lineno}")
                assert "trust_remote_code" in given, f"{calls[-1]} calls from_pretrained without trust_remote_code"
                value = given["trust_remote_code"]
                assert not (isinstance(value, ast.Constant) and value.value), (
                    f"{calls[-1]} hard-codes trust_remote_code"
                )
    assert len(calls) >= 2, calls  # the tokenizer and the model in train.py


def test_no_secret_from_the_environment_is_printed_or_saved(reference):
    ref = reference.wait()
    cfg_output = run_train([*RUN, "--cfg"], timeout=60)
    seen = [
        ("stdout+stderr", reference.out.read_bytes() + reference.err.read_bytes()),
        ("--cfg output", (cfg_output.stdout + cfg_output.stderr).encode()),
    ]
    seen += [(str(p), p.read_bytes()) for p in ref.rglob("*") if p.is_file()]
    assert any(name.endswith("config.yaml") for name, _ in seen) and any(
        name.endswith("metrics.jsonl") for name, _ in seen
    )
    for name, content in seen:
        for key, secret in SECRETS.items():
            assert secret.encode() not in content, f"{key} leaked into {name}"


@pytest.fixture(scope="module")
def resumable(reference, tmp_path_factory):
    """A copy of the finished reference run that the refusal tests resume from."""
    return copy_run(reference.wait(), tmp_path_factory.mktemp("resumable") / "run")


def other_architecture(tmp_path: Path) -> Path:
    """A 1-layer, 64-wide Llama with the toy tokenizer: loads fine on its own, fits nothing of the toy model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path / "other-llama"
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        bos_token_id=0,
        eos_token_id=1,
    )
    LlamaForCausalLM(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REPO / "toy" / "tiny-llama" / name, out / name)
    return out


@pytest.mark.parametrize(
    "change, message",
    [
        ("batch_size=16", "batch_size: checkpoint has 8, this run has 16"),
        ("seed=1", "seed: checkpoint has 0, this run has 1"),
        # the same toy files under another name (quoted: unquoted, YAML reads `[.../{split}.jsonl]` as a string)
        ("datasets=['{repo}/toy/data/{{split}}.jsonl']", "datasets: checkpoint has ['toy'], this run has"),
        ("model.name_or_path={other}", "model: checkpoint has 'toy/tiny-llama', this run has"),
        ("loss.beta=0.5", "loss.beta: the run was started with 0.1"),
        ("model.archive={sft}", "model.archive: the run was started with None"),
    ],
)
def test_a_checkpoint_of_another_run_is_refused_before_anything_is_loaded(
    resumable, tmp_path, monkeypatch, change, message
):
    monkeypatch.chdir(REPO)
    other = other_architecture(tmp_path) if "{other}" in change else None
    change = change.format(repo=REPO, other=other, sft=resumable / "step-16" / "policy.pt")
    trainer = build_trainer(tmp_path / "unused", change, f"resume_from={resumable}")
    trainer.build_optimizer()
    before = snapshot(trainer)
    with pytest.raises(ValueError, match="cannot resume: the checkpoint belongs to a different run") as refused:
        trainer.resume()
    assert message in str(refused.value), str(refused.value)
    assert_bit_identical(before, snapshot(trainer), "refused resume")  # never half-loaded
    assert trainer.state.example_counter == 0 and trainer.state.batch_counter == 0


def test_the_same_run_is_accepted_by_the_checks_that_refuse_others(resumable, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    trainer = build_trainer(tmp_path / "unused", f"resume_from={resumable}", "lr=2e-4", "eval_every=32")
    trainer.build_optimizer()
    trainer.resume()  # lr and eval_every may change on resume
    assert trainer.state.example_counter == 96
    assert_bit_identical(
        latest(resumable, "policy.pt")["state"], {k: v for k, v in trainer.policy.state_dict().items()}
    )


def test_an_archive_of_another_architecture_is_refused_with_a_clear_message(tmp_path, monkeypatch):
    import config_loader
    import train
    from transformers import AutoModelForCausalLM

    monkeypatch.chdir(REPO)
    archive = tmp_path / "policy.pt"
    model = AutoModelForCausalLM.from_pretrained(other_architecture(tmp_path))
    torch.save({"step_idx": 8, "state": model.state_dict(), "metrics": {}}, archive)
    cfg, _ = config_loader.load_config([*RUN, f"model.archive={archive}"])
    with pytest.raises(ValueError) as refused:
        train.load_models(cfg)
    message = str(refused.value)
    for fragment in (
        f"model.archive={archive} does not fit model LlamaForCausalLM",
        "missing ['model.layers.1.",
        "shape mismatches ['model.embed_tokens.weight: (512, 64) vs (512, 128)",
    ):
        assert fragment in message, (fragment, message)


# ---------------------------------------------------------------------------------------------------------
# Interrupts: SIGTERM (a scheduler's preemption) and SIGINT (Ctrl-C) stop after the step with a checkpoint
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "trainer, sig, to_group",
    [
        ("BasicTrainer", signal.SIGINT, True),
        ("BasicTrainer", signal.SIGTERM, False),
        ("FSDPTrainer", signal.SIGTERM, False),
        ("FSDPTrainer", signal.SIGINT, True),
    ],
)
def test_a_signal_stops_after_the_step_with_a_checkpoint_and_says_how_to_resume(tmp_path, trainer, sig, to_group):
    """A real signal mid-run: to train.py alone (SIGTERM: a scheduler's `kill`; under FSDP the launcher passes it to
    its ranks) or to the whole process group (SIGINT: Ctrl-C in a terminal). Every rank finishes the step, one
    checkpoint is written, the exit is 128 + the signal, and stderr prints the command that resumes, which runs
    (before: a raw KeyboardInterrupt traceback, or a silent exit 143 with no checkpoint)."""
    run_dir = tmp_path / "run"
    args = [
        *RUN,
        "n_examples=4000",
        "eval_every=4000",
        "sample_during_eval=false",
        "do_first_eval=false",
        f"trainer={trainer}",
        f"run_dir={run_dir}",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-u", str(REPO / "train.py"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=ENV,
        start_new_session=True,
    )
    deadline = time.time() + 240
    while time.time() < deadline and not (
        (run_dir / "metrics.jsonl").exists() and "loss/train" in (run_dir / "metrics.jsonl").read_text()
    ):
        time.sleep(0.2)
    (os.killpg if to_group else os.kill)(proc.pid, sig)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 128 + sig, (proc.returncode, out[-2000:], err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    stopped = next(line for line in err.splitlines() if line.startswith("interrupted at step "))
    examples = int(os.readlink(run_dir / "LATEST").split("-")[1])
    assert f"interrupted at step {examples // 8} ({examples} pairs, {signal.Signals(sig).name})" in stopped
    command = stopped.split("resume with: ", 1)[1]
    assert command.endswith(f"resume_from={run_dir}")
    resumed = subprocess.run(
        [sys.executable, *shlex.split(command)[1:], f"n_examples={examples + 8}"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=ENV,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"at {examples} examples" in resumed.stdout


def started(run_dir: Path, proc: subprocess.Popen) -> None:
    """Wait until the run has logged a training step."""
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if (run_dir / "metrics.jsonl").exists() and "loss/train" in (run_dir / "metrics.jsonl").read_text():
            return
        time.sleep(0.2)
    raise AssertionError(f"no training step logged (exit {proc.poll()})")


@pytest.mark.parametrize("trainer", ["BasicTrainer", "FSDPTrainer"])
def test_a_second_ctrl_c_stops_at_once_with_one_line_not_a_traceback(tmp_path, trainer):
    """Ctrl-C, then Ctrl-C again within the step (steps take 4 s here): the run stops at once without a checkpoint,
    exit 130, and says so in one line with the command that continues from the latest checkpoint or starts again
    (before: a KeyboardInterrupt traceback, one per rank under FSDP)."""
    run_dir = tmp_path / "run"
    args = [
        *RUN,
        "n_examples=4000",
        "eval_every=4000",
        "sample_during_eval=false",
        "do_first_eval=false",
        f"trainer={trainer}",
        f"run_dir={run_dir}",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-u", str(SLOW), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**ENV, "SLOW_STEP_SECS": "4"},
        start_new_session=True,
    )
    started(run_dir, proc)
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(1)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 128 + signal.SIGINT, (proc.returncode, out[-2000:], err[-3000:])
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    said = [line for line in err.splitlines() if line.startswith("interrupted")]
    assert len(said) == 1 and ("start again with" in said[0] or "resume with" in said[0]), err[-3000:]


def test_under_torchrun_a_sigterm_stop_writes_a_lean_checkpoint_before_the_shutdown_timeout(tmp_path):
    """torchrun passes SIGTERM (a scheduler's preemption, Ctrl-C) to its ranks and SIGKILLs them 30 s later
    (--shutdown_timeout). The stop checkpoint holds only what a resume needs: with a consolidated state dict and
    an HF export that take 90 s each (a large model's), it is still written in time, and the run resumes from it
    (before: the ranks were killed mid-checkpoint and the work since the last checkpoint was lost)."""
    run_dir = tmp_path / "run"
    args = [
        *RUN,
        "n_examples=4000",
        "eval_every=4000",
        "sample_during_eval=false",
        "do_first_eval=false",
        "trainer=FSDPTrainer",
        "fsdp.strategy=fsdp2",
        f"run_dir={run_dir}",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(SLOW), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**ENV, "SLOW_CHECKPOINT_SECS": "90"},
        start_new_session=True,
    )
    started(run_dir, proc)
    os.kill(proc.pid, signal.SIGTERM)
    start = time.time()
    out, err = proc.communicate(timeout=240)
    assert time.time() - start < 30 and "forcefully exiting" not in err, err[-3000:]
    assert "interrupted at step" in err and "lean" in out, out[-2000:] + err[-3000:]
    ckpt = (run_dir / "LATEST").resolve()
    record = json.loads((ckpt / "manifest.json").read_text())
    assert (
        record["sha256"] == {} and "policy.pt" not in record["files"] and "hf" not in {p.name for p in ckpt.iterdir()}
    )
    examples = int(ckpt.name.split("-")[1])
    resumed = run_train([*args, "n_workers=2", f"resume_from={run_dir}", f"n_examples={examples + 8}"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"at {examples} examples" in resumed.stdout
    assert (run_dir / "LATEST" / "policy.pt").is_file()  # the next full checkpoint writes what the lean one left out
