"""train.py end to end, as a user runs it: subprocesses on the project's 2-layer toy model (vocab 512)."""

import contextlib
import io
import json
import math
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import sources
import train as train_py

from conftest import LOCAL_DIRS  # runs and caches in a temporary directory

REPO = Path(__file__).resolve().parent.parent
# Small and fast: 8-pair steps, short sequences, no torch.compile warm-up, no W&B.
FAST = [
    "model=tiny",
    "datasets=[toy]",
    "optimizer=AdamW",
    "warmup_steps=0",
    "batch_size=8",
    "eval_batch_size=8",
    "n_eval_examples=16",
    "n_eval_model_samples=4",
    "max_length=64",
    "max_prompt_length=32",
    "max_new_tokens=8",
    "fsdp.use_torch_compile=false",
    "wandb.enabled=false",
    "n_epochs=null",
    LOCAL_DIRS,
]


def train(run_dir, *args, check=True) -> subprocess.CompletedProcess:
    """Run train.py in this process (its imports cost ~10 s per subprocess) and capture what it prints."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = train_py.main([*FAST, f"run_dir={run_dir}", *args])
    result = subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())
    if check:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def final_state(run_dir) -> dict:
    return torch.load(Path(run_dir) / "LATEST" / "policy.pt", weights_only=True)["state"]


def assert_states_equal(a: dict, b: dict, atol: float = 0.0):
    assert a.keys() == b.keys()
    for k in a:
        if atol == 0.0:
            assert torch.equal(a[k], b[k]), k
        else:
            torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0, msg=k)


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory):
    """One short DPO run, shared by the tests that only read what it wrote."""
    run_dir = tmp_path_factory.mktemp("dpo") / "run"
    result = train(run_dir, "loss=dpo", "lr=1e-4", "n_examples=32", "eval_every=16")
    return run_dir, result


def test_step0_dpo_loss_is_ln2_when_policy_equals_reference(dpo_run):
    run_dir, _ = dpo_run
    records = metrics(run_dir)
    first_eval = next(r for r in records if "loss/eval" in r)
    first_train = next(r for r in records if "loss/train" in r)
    assert first_eval["step"] == 0 and abs(first_eval["loss/eval"] - math.log(2)) < 1e-4
    assert (
        first_train["step"] == 8 and abs(first_train["loss/train"] - math.log(2)) < 1e-4
    )  # computed before the update
    assert first_eval["rewards_eval/margins"] == 0.0


def test_documented_files_are_written(dpo_run):
    run_dir, result = dpo_run
    assert f"run directory: {run_dir}" in result.stdout and f"done; run directory: {run_dir}" in result.stdout
    assert "batch geometry: 8 pairs per step" in result.stdout
    assert "train pairs 2000 (32 trained: n_examples); total steps 4;" in result.stdout  # not the set's 250
    assert (run_dir / "config.yaml").exists() and (run_dir / "metrics.jsonl").exists()
    assert sorted(p.name for p in run_dir.glob("step-*")) == ["step-16", "step-32"]
    assert (run_dir / "LATEST").resolve() == (run_dir / "step-32").resolve()
    for name in (
        "policy.pt",
        "optimizer.pt",
        "scheduler.pt",
        "trainer_state.pt",
        "rng-0.pt",
        "manifest.json",
        "hf/config.json",
        "hf/model.safetensors",
        "hf/tokenizer.json",
    ):
        assert (run_dir / "step-32" / name).exists(), name
    records = metrics(run_dir)
    for key in (
        "rewards_train/chosen",
        "rewards_train/accuracies",
        "logps_train/rejected",
        "grad_norm",
        "lr",
        "examples_per_second",
    ):
        assert any(key in r for r in records), key
    last_eval = [r for r in records if "loss/eval" in r][-1]
    assert (
        last_eval["step"] == 32
        and "samples/policy_rule_rate" in last_eval
        and "samples/reference_rule_rate" in last_eval
    )


def test_policy_pt_is_the_original_format_and_loads_weights_only(dpo_run):
    run_dir, _ = dpo_run
    ckpt = torch.load(run_dir / "LATEST" / "policy.pt", weights_only=True)
    assert set(ckpt) == {"step_idx", "state", "metrics"} and ckpt["step_idx"] == 32
    assert "loss/eval" in ckpt["metrics"]
    for name in ("optimizer.pt", "scheduler.pt", "trainer_state.pt", "rng-0.pt"):
        torch.load(run_dir / "LATEST" / name, weights_only=True)


def test_hf_export_loads_in_plain_transformers_with_the_trained_logits(dpo_run):
    run_dir, _ = dpo_run
    exported = AutoModelForCausalLM.from_pretrained(run_dir / "LATEST" / "hf")
    trained = AutoModelForCausalLM.from_pretrained(REPO / "toy" / "tiny-llama")
    trained.load_state_dict(final_state(run_dir))
    original = AutoModelForCausalLM.from_pretrained(REPO / "toy" / "tiny-llama")
    ids = torch.tensor([[0, 200, 200, 269, 27, 316, 340, 15]])
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, trained(ids).logits)
        assert not torch.allclose(exported(ids).logits, original(ids).logits)  # training changed something


def test_loss_falls_when_overfitting_eight_pairs(tmp_path):
    pairs = tmp_path / "eight.jsonl"
    rows = [json.loads(line) for line in (REPO / "toy" / "data" / "train.jsonl").read_text().splitlines()[:8]]
    pairs.write_text("".join(json.dumps({k: r[k] for k in ("prompt", "chosen", "rejected")}) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    train(
        run_dir,
        "loss=dpo",
        f"datasets=[{pairs}]",
        "lr=1e-3",
        "n_examples=80",
        "eval_every=80",
        "sample_during_eval=false",
        "minimum_log_interval_secs=0",
    )
    losses = [r["loss/train"] for r in metrics(run_dir) if "loss/train" in r]
    assert len(losses) == 10 and abs(losses[0] - math.log(2)) < 1e-4
    assert losses[-1] < 0.05 < losses[0]


def kill_after_first_checkpoint(run_dir, *args) -> None:
    """train.py with `args` into `run_dir`, SIGKILLed as soon as it prints that a checkpoint was written."""
    cmd = [sys.executable, "-u", str(REPO / "train.py"), *FAST, f"run_dir={run_dir}", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    for line in proc.stdout:
        if "checkpoint written" in line:
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL


def test_resumed_run_ends_exactly_like_an_uninterrupted_one(tmp_path):
    args = ["loss=dpo", "lr=1e-4", "n_examples=48", "eval_every=16", "minimum_log_interval_secs=0"]
    full = train(tmp_path / "full", *args)
    # The same run, killed right after its first checkpoint, then resumed.
    kill_after_first_checkpoint(tmp_path / "cut", *args)
    assert (tmp_path / "cut" / "LATEST").resolve().name == "step-16"
    result = train(tmp_path / "cut2", *args, f"resume_from={tmp_path / 'cut'}")
    assert "resumed from" in result.stdout and "at 16 examples" in result.stdout
    assert_states_equal(final_state(tmp_path / "full"), final_state(tmp_path / "cut"))
    # samples and their rule rates too: sampling draws from its own stream seeded by (seed, examples seen)
    full_samples, resumed_samples = sample_lines(full.stdout), sample_lines(result.stdout)
    assert sorted(resumed_samples) == [32, 48]
    assert all(resumed_samples[s] == full_samples[s] for s in resumed_samples)
    sampled = lambda run: [r for r in metrics(tmp_path / run) if any(k.startswith("samples/") for k in r)]  # noqa: E731
    assert sampled("full") == sampled("cut")


def test_a_resume_applies_a_changed_lr_and_refuses_other_changes_by_name(tmp_path):
    """Resuming with lr=5e-5 (the run had 1e-3) trains on at 5e-5 from the checkpoint, says so, and logs it (before:
    the loaded optimizer and scheduler state overwrote it silently); a key a resume may not change is refused by
    name before anything loads."""
    args = [
        "loss=dpo",
        "lr=1e-3",
        "n_examples=32",
        "eval_every=16",
        "minimum_log_interval_secs=0",
        "sample_during_eval=false",
    ]
    kill_after_first_checkpoint(tmp_path / "run", *args)
    refused = train(tmp_path / "x", *args, "max_grad_norm=1.0", f"resume_from={tmp_path / 'run'}", check=False)
    assert refused.returncode == 2 and "max_grad_norm: the run was started with 10.0" in refused.stderr, refused.stderr
    result = train(tmp_path / "x", *[a.replace("lr=1e-3", "lr=5e-5") for a in args], f"resume_from={tmp_path / 'run'}")
    assert "resume: lr 0.001 -> 5e-05 at step 2" in result.stdout, result.stdout
    lrs = [(r["step"], r["lr"]) for r in metrics(tmp_path / "run") if "lr" in r]
    assert lrs == [(8, 1e-3), (16, 1e-3), (24, 5e-5), (32, 5e-5)]


def test_resume_from_takes_the_run_dir_its_latest_or_the_latest_step(tmp_path):
    """What users copy: <run>, <run>/LATEST or <run>/step-N (the one LATEST points at) all resume the run (before:
    "no LATEST checkpoint there" for the last two); an earlier step-N would have later checkpoints overwritten."""
    args = ["loss=dpo", "n_examples=32", "eval_every=8", "sample_during_eval=false"]
    kill_after_first_checkpoint(tmp_path / "run", *args)
    (tmp_path / "run" / "step-0").mkdir()  # an earlier checkpoint directory
    for given in ("run", "run/LATEST", "run/step-8"):
        assert train(tmp_path / "x", *args, f"resume_from={tmp_path / given}", "--cfg").returncode == 0, given
    refused = train(tmp_path / "x", *args, f"resume_from={tmp_path / 'run' / 'step-0'}", check=False)
    assert refused.returncode == 2 and "not the run's latest checkpoint" in refused.stderr, refused.stderr


def test_chat_data_with_a_tokenizer_without_a_template_takes_model_chat_template(tmp_path):
    """The toy tokenizer has no chat template: chat-form rows are refused with the key that fixes it (before: advice
    to set tokenizer.chat_template, which no command-line key could follow); model.chat_template=chatml trains."""
    rows = [json.loads(line) for line in (REPO / "toy" / "data" / "test.jsonl").read_text().splitlines()[:32]]
    chat = [
        {
            "prompt": [{"role": "user", "content": r["prompt"].split("Human:")[-1].split("Assistant:")[0].strip()}],
            "chosen": [{"role": "assistant", "content": r["chosen"].strip()}],
            "rejected": [{"role": "assistant", "content": r["rejected"].strip()}],
        }
        for r in rows
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in chat))
    args = ["loss=dpo", f"datasets=[{path}]", "n_examples=8", "sample_during_eval=false"]
    refused = train(tmp_path / "a", *args, check=False)
    assert refused.returncode == 2 and "set model.chat_template=chatml" in refused.stderr, refused.stderr
    template = tmp_path / "template.jinja"
    template.write_text(sources.CHAT_TEMPLATES["chatml"])
    import config_loader
    import preference_datasets as data

    for given in ("chatml", str(template)):
        train(tmp_path / given.replace("/", "_"), *args, f"model.chat_template={given}")
        cfg, _ = config_loader.load_config([*FAST, *args, f"model.chat_template={given}"])
        first = data.load_tokenized(cfg.datasets, train_py.load_tokenizer(cfg), "train")[0]
        assert first.prompt.startswith("<|im_start|>user\n") and first.prompt.endswith("<|im_start|>assistant\n")


def test_a_warmup_as_long_as_the_run_is_warned_about(tmp_path):
    """The original's warmup_steps=150 on a 50-step run never reaches lr (before: a run that silently barely
    trained); the check runs with every command, --cfg too."""
    result = train(tmp_path / "run", "loss=sft", "batch_size=4", "n_examples=200", "warmup_steps=150", "--cfg")
    assert "warning: warmup_steps=150 >= the run's 50 steps" in result.stderr, result.stderr
    assert (
        "warning: warmup" not in train(tmp_path / "run", "loss=sft", "batch_size=4", "n_examples=200", "--cfg").stderr
    )


def test_batch_8_accumulation_1_equals_batch_8_accumulation_4_after_one_step(tmp_path):
    """One step over the same 8 pairs: one micro-batch of 8, or 4 micro-batches of 2 with summed gradients.
    SGD with lr 1 makes the parameter change the gradient itself (Adam's first step, lr * g / |g|, would
    amplify float noise wherever g is near 0)."""
    common = [
        "loss=dpo",
        "optimizer=SGD",
        "lr=1.0",
        "n_examples=8",
        "eval_every=8",
        "sample_during_eval=false",
        "do_first_eval=false",
    ]
    train(tmp_path / "a", *common, "gradient_accumulation_steps=1")
    train(tmp_path / "b", *common, "gradient_accumulation_steps=4")
    before = AutoModelForCausalLM.from_pretrained(REPO / "toy" / "tiny-llama").state_dict()
    a, b = final_state(tmp_path / "a"), final_state(tmp_path / "b")
    assert not torch.equal(a["lm_head.weight"], before["lm_head.weight"])
    assert_states_equal(a, b, atol=1e-6)


def test_debug_writes_no_checkpoint(tmp_path):
    result = train(
        tmp_path / "run",
        "loss=sft",
        "lr=1e-3",
        "n_examples=16",
        "eval_every=8",
        "debug=true",
        "sample_during_eval=false",
    )
    assert "debug=true: skipping checkpoint" in result.stdout
    assert not list((tmp_path / "run").glob("step-*")) and not (tmp_path / "run" / "LATEST").exists()


def test_sft_then_dpo_from_the_archive(tmp_path):
    """The original pipeline: model.archive loads the SFT policy into policy and reference (DPO starts at ln 2).
    Rows without `sft_target` make the SFT target the chosen response, so both runs score the same tokens."""
    pairs = tmp_path / "pairs.jsonl"
    rows = [json.loads(line) for line in (REPO / "toy" / "data" / "test.jsonl").read_text().splitlines()[:16]]
    pairs.write_text("".join(json.dumps({k: r[k] for k in ("prompt", "chosen", "rejected")}) + "\n" for r in rows))
    common = [f"datasets=[{pairs}]", "sample_during_eval=false"]
    train(tmp_path / "sft", *common, "loss=sft", "lr=1e-3", "n_examples=16", "eval_every=16")
    train(
        tmp_path / "dpo",
        *common,
        "loss=dpo",
        "lr=1e-4",
        "n_examples=8",
        "eval_every=8",
        f"model.archive={tmp_path / 'sft' / 'LATEST' / 'policy.pt'}",
    )
    first = next(r for r in metrics(tmp_path / "dpo") if "loss/eval" in r)
    assert abs(first["loss/eval"] - math.log(2)) < 1e-4
    sft_evals = [r for r in metrics(tmp_path / "sft") if "logps_eval/chosen" in r]
    assert abs(first["logps_eval/chosen"] - sft_evals[-1]["logps_eval/chosen"]) < 1e-4  # the archive was loaded
    assert abs(first["logps_eval/chosen"] - sft_evals[0]["logps_eval/chosen"]) > 0.1  # and it is not the base model


def test_run_dir_with_a_run_is_not_overwritten(tmp_path):
    train(tmp_path / "run", "loss=sft", "lr=1e-3", "n_examples=8", "eval_every=8", "sample_during_eval=false")
    again = train(tmp_path / "run", "loss=sft", "n_examples=8", check=False)
    assert again.returncode != 0 and "already holds a run" in again.stderr


def test_activation_checkpointing_in_one_process_gives_the_same_step(tmp_path):
    common = [
        "loss=dpo",
        "optimizer=SGD",
        "lr=1.0",
        "n_examples=8",
        "eval_every=8",
        "sample_during_eval=false",
        "do_first_eval=false",
    ]
    train(tmp_path / "plain", *common)
    result = train(tmp_path / "checkpointed", *common, "activation_checkpointing=true")
    assert "activation checkpointing (NO_REENTRANT) on 2 blocks of LlamaDecoderLayer" in result.stdout
    assert_states_equal(final_state(tmp_path / "plain"), final_state(tmp_path / "checkpointed"), atol=1e-6)


def test_forward_only_evaluates_once_and_trains_nothing(tmp_path):
    result = train(
        tmp_path / "run",
        "loss=dpo",
        "n_examples=16",
        "eval_every=8",
        "fsdp.forward_only=true",
        "sample_during_eval=false",
    )
    records = metrics(tmp_path / "run")
    assert len(records) == 1 and records[0]["step"] == 0 and abs(records[0]["loss/eval"] - math.log(2)) < 1e-4
    assert not list((tmp_path / "run").glob("step-*")) and "Running evaluation after 0" in result.stdout


def test_full_determinism_is_on_where_the_step_runs_only_when_asked(tmp_path, monkeypatch):
    """On CPU two runs give equal weights with or without the flag, so equal weights cannot test it. What can:
    inside a training step, deterministic algorithms are on and cuBLAS has its fixed workspace with the flag,
    and neither without it."""
    import os

    import trainers

    seen = []
    step = trainers.BasicTrainer.train_step

    def recorded(self, batch):
        seen.append((torch.are_deterministic_algorithms_enabled(), os.environ.get("CUBLAS_WORKSPACE_CONFIG")))
        return step(self, batch)

    monkeypatch.setattr(trainers.BasicTrainer, "train_step", recorded)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    args = ["loss=dpo", "lr=1e-4", "n_examples=8", "eval_every=8", "sample_during_eval=false", "do_first_eval=false"]
    try:
        train(tmp_path / "off", *args)
        train(tmp_path / "on", *args, "fsdp.full_determinism=true")
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = False, False
    assert seen == [(False, None), (True, ":4096:8")]


# ---------------------------------------------------------------------------------------------------------
# Bad input fails before any model is loaded, and a failed run leaves nothing behind (issue 12, items 5-7, 9)
# ---------------------------------------------------------------------------------------------------------
def toy_rows(n: int, same: bool = False) -> str:
    rows = [json.loads(line) for line in (REPO / "toy" / "data" / "test.jsonl").read_text().splitlines()[:n]]
    return "".join(
        json.dumps({"prompt": r["prompt"], "chosen": r["chosen"], "rejected": r["chosen"] if same else r["rejected"]})
        + "\n"
        for r in rows
    )


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model fails the test: the checks under test must come first."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was reported")

    monkeypatch.setattr(train_py, "load_models", refuse)


@pytest.mark.parametrize("case", ["offline_hub", "missing_archive", "all_filtered", "all_filtered_cfg"])
def test_bad_input_fails_before_any_model_is_loaded_and_leaves_no_run_dir(tmp_path, no_model, case):
    same = tmp_path / "same.jsonl"
    same.write_text(toy_rows(8, same=True))  # chosen == rejected: every pair is dropped
    args, expected = {
        "offline_hub": (["datasets=[hh]"], ["dataset 'Anthropic/hh-rlhf'", "not available offline"]),
        "missing_archive": (
            [f"model.archive={tmp_path / 'nope.pt'}"],
            [f"model.archive={tmp_path / 'nope.pt'}: no such file"],
        ),
        "all_filtered": (
            [f"datasets=[{same}]"],
            [
                f"datasets=['{same}'] split 'train': 0 pairs left after filtering",
                "fewer than batch_size=8",
                "chosen_equals_rejected=8",
            ],
        ),
        "all_filtered_cfg": (
            [f"datasets=[{same}]", "--cfg"],
            ["0 pairs left after filtering", "chosen_equals_rejected=8"],
        ),
    }[case]
    result = train(tmp_path / "run", "loss=dpo", "n_examples=8", *args, check=False)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    for fragment in expected:
        assert fragment in result.stderr, (fragment, result.stderr)
    assert not (tmp_path / "run").exists()  # nothing was created for a run that never started


def test_cfg_refuses_what_the_run_refuses(tmp_path):
    result = train(tmp_path / "run", "datasets=[nonexistent]", "n_examples=8", "--cfg", check=False)
    assert result.returncode == 2 and "unknown dataset 'nonexistent'" in result.stderr
    assert result.stdout == "" and not (tmp_path / "run").exists()


def test_a_run_failing_before_training_removes_only_the_directory_it_created(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise OSError("disk on fire")  # any failure while loading

    monkeypatch.setattr(train_py, "load_models", broken)
    with pytest.raises(OSError):
        train(tmp_path / "new", "loss=sft", "n_examples=8")
    assert not (tmp_path / "new").exists()  # no orphan holding only config.yaml
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("the user's")
    with pytest.raises(OSError):
        train(tmp_path / "mine", "loss=sft", "n_examples=8")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "the user's"  # existed before: never deleted
    with pytest.raises(OSError):
        train_py.main([*FAST, "loss=sft", "n_examples=8", f"local_dirs=[{tmp_path / 'dirs'}]"])
    assert list((tmp_path / "dirs" / "runs").iterdir()) == []  # the timestamped directory went too


def test_a_refused_resume_leaves_config_resumed_yaml_alone(dpo_run, tmp_path, no_model):
    import shutil

    run_dir = shutil.copytree(dpo_run[0], tmp_path / "run", symlinks=True)
    (run_dir / "config.resumed.yaml").write_text("# the last accepted resume\n")
    result = train(
        run_dir,
        "loss=dpo",
        "lr=1e-4",
        "n_examples=48",
        "eval_every=16",
        "seed=1",
        f"resume_from={run_dir}",
        check=False,
    )
    assert result.returncode == 2 and "seed: checkpoint has 0, this run has 1" in result.stderr, result.stderr
    assert (run_dir / "config.resumed.yaml").read_text() == "# the last accepted resume\n"


def test_a_six_pair_file_trains_with_batch_size_2_and_says_how_many_eval_pairs_exist(tmp_path):
    six = tmp_path / "six.jsonl"
    six.write_text(toy_rows(6))  # one file serves both splits (no {split} in the path)
    result = train(
        tmp_path / "run",
        "loss=dpo",
        f"datasets=[{six}]",
        "batch_size=2",
        "eval_batch_size=16",
        "n_eval_examples=256",
        "n_examples=4",
        "eval_every=4",
        "sample_during_eval=false",
    )
    assert "eval pairs 6 in batches of 6" in result.stdout, result.stdout
    assert (
        f"datasets: {six} has no {{split}} in its path: the same pairs serve training and evaluation" in result.stdout
    )


# ---------------------------------------------------------------------------------------------------------
# Samples come from their own seeded stream (issue 12, item 10)
# ---------------------------------------------------------------------------------------------------------
def sample_lines(stdout: str) -> dict[int, dict[str, list[str]]]:
    """{examples seen at the eval: {'policy'/'reference': the printed sample lines}}."""
    out, step = {}, None
    for line in stdout.splitlines():
        if line.startswith("Running evaluation after "):
            step = int(line.split()[3])
            out[step] = {"policy": [], "reference": []}
        elif " sample | " in line and step is not None:
            who = line.split()[0]
            out[step][who].append(line)
    return out


def test_policy_and_reference_sample_from_each_evaluations_seeds_equal_at_step_0(dpo_run):
    """Each evaluation draws the policy's and the reference's samples from the same seeds (a paired comparison), so at
    step 0, where the weights are equal, the two sample the same completions."""
    samples = sample_lines(dpo_run[1].stdout)
    assert sorted(samples) == [0, 16, 32]
    assert all(len(samples[s]["reference"]) == len(samples[s]["policy"]) == 3 for s in samples)
    as_policy = lambda s: [line.replace("reference", "policy", 1) for line in samples[s]["reference"]]
    assert as_policy(0) == samples[0]["policy"]  # equal weights, equal seeds


def test_a_log_file_gets_plain_progress_lines_not_tqdm_redraws(dpo_run):
    """Output captured (not a terminal): no \\r bar redraws, a plain named progress line instead."""
    result = dpo_run[1]
    assert "\r" not in result.stdout and "\r" not in result.stderr
    assert "progress: step 4/4, pairs seen 32, pairs/s " in result.stdout


def test_mfu_is_the_6n_rule_over_peak_tflops_and_absent_without_a_peak(dpo_run, tmp_path):
    """MFU = (6 N + 2 N for the online reference) x tokens/s / peak, N the parameters outside the input embedding; on
    a device without a known peak (a CPU) it is not logged unless peak_tflops says what the peak is."""
    assert not any("throughput/mfu" in r for r in metrics(dpo_run[0]))
    train(tmp_path / "run", "loss=dpo", "n_examples=16", "peak_tflops=0.5", "minimum_log_interval_secs=0")
    model = AutoModelForCausalLM.from_pretrained(REPO / "toy" / "tiny-llama")
    n = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    steps = [r for r in metrics(tmp_path / "run") if "throughput/mfu" in r]
    assert steps and all(
        r["throughput/mfu"] == pytest.approx(8 * n * r["throughput/tokens_per_second"] / 0.5e12, rel=1e-6)
        for r in steps
    )


def reference_state(run_dir) -> dict:
    return torch.load(Path(run_dir) / "LATEST" / "reference.pt", weights_only=True)


def test_tr_dpo_hard_update_every_step_keeps_the_loss_at_ln2_and_soft_update_mixes(tmp_path):
    """Hard update (alpha 1) every step: each step starts with reference = policy, so every step's DPO loss is
    ln 2 (plain DPO's second step is not). Soft update (alpha 0.6) after one SGD step: the saved reference is
    0.6 * policy + 0.4 * the original weights, parameter by parameter."""
    common = [
        "loss=dpo",
        "optimizer=SGD",
        "lr=1.0",
        "sample_during_eval=false",
        "do_first_eval=false",
        "minimum_log_interval_secs=0",
    ]
    train(tmp_path / "hard", *common, "n_examples=16", "eval_every=16", "ref_update.tau=1", "ref_update.alpha=1.0")
    losses = [r["loss/train"] for r in metrics(tmp_path / "hard") if "loss/train" in r]
    assert len(losses) == 2 and all(abs(x - math.log(2)) < 1e-6 for x in losses)
    assert_states_equal(reference_state(tmp_path / "hard"), final_state(tmp_path / "hard"))
    # activation checkpointing wraps the policy's blocks only: the update still pairs every parameter by name
    train(
        tmp_path / "hard_ac",
        *common,
        "n_examples=16",
        "eval_every=16",
        "ref_update.tau=1",
        "ref_update.alpha=1.0",
        "activation_checkpointing=true",
    )
    assert [r["loss/train"] for r in metrics(tmp_path / "hard_ac") if "loss/train" in r] == pytest.approx(
        losses, abs=1e-6
    )
    assert_states_equal(final_state(tmp_path / "hard_ac"), final_state(tmp_path / "hard"), atol=1e-6)
    train(tmp_path / "soft", *common, "n_examples=8", "eval_every=8", "ref_update.tau=1")
    original = AutoModelForCausalLM.from_pretrained(REPO / "toy" / "tiny-llama").state_dict()
    policy, reference = final_state(tmp_path / "soft"), reference_state(tmp_path / "soft")
    assert max((policy[k] - original[k]).abs().max().item() for k in policy) > 1e-3  # a real step
    assert_states_equal(reference, {k: 0.6 * policy[k] + 0.4 * original[k] for k in policy}, atol=1e-6)


def test_tr_dpo_resumed_after_a_kill_ends_exactly_like_an_uninterrupted_run(tmp_path):
    """Soft updates every 2 steps, killed after the first checkpoint (step 2, right after an update), resumed:
    policy AND reference end bit-identical (the reference's weights are in the checkpoint)."""
    args = ["loss=dpo", "lr=1e-3", "n_examples=32", "eval_every=16", "ref_update.tau=2", "sample_during_eval=false"]
    train(tmp_path / "full", *args)
    kill_after_first_checkpoint(tmp_path / "cut", *args)
    assert (tmp_path / "cut" / "step-16" / "reference.pt").is_file()
    result = train(tmp_path / "cut2", *args, f"resume_from={tmp_path / 'cut'}")
    assert "at 16 examples" in result.stdout
    assert_states_equal(final_state(tmp_path / "full"), final_state(tmp_path / "cut"))
    assert_states_equal(reference_state(tmp_path / "full"), reference_state(tmp_path / "cut"))
    original = AutoModelForCausalLM.from_pretrained(REPO / "toy" / "tiny-llama").state_dict()
    assert not torch.equal(reference_state(tmp_path / "full")["lm_head.weight"], original["lm_head.weight"])


LORA = ["lora.r=4", "lora.alpha=8"]


def test_lora_dpo_resumed_after_a_kill_is_exact_and_exports_merged_weights(tmp_path):
    """LoRA DPO: the reference is the base model with the adapters off (step-0 loss ln 2, B = 0 at start); only
    the adapters train; a kill after the first checkpoint then a resume ends bit-identical; the checkpoint holds
    the adapter (peft format) and an HF export of merged weights that plain from_pretrained loads and that
    computes what base + adapter computes."""
    import peft

    args = [
        "loss=dpo",
        "lr=1e-3",
        "n_examples=32",
        "eval_every=16",
        "sample_during_eval=false",
        "minimum_log_interval_secs=0",
        *LORA,
    ]
    train(tmp_path / "full", *args)
    losses = [r["loss/train"] for r in metrics(tmp_path / "full") if "loss/train" in r]
    assert abs(losses[0] - math.log(2)) < 1e-6 and losses[-1] < losses[0]
    kill_after_first_checkpoint(tmp_path / "cut", *args)
    result = train(tmp_path / "cut2", *args, f"resume_from={tmp_path / 'cut'}")
    assert "at 16 examples" in result.stdout
    full, cut = final_state(tmp_path / "full"), final_state(tmp_path / "cut")
    assert_states_equal(full, cut)
    original = AutoModelForCausalLM.from_pretrained(REPO / "toy" / "tiny-llama").state_dict()
    base_keys = {k: k.removeprefix("base_model.model.").replace(".base_layer.", ".") for k in full if ".lora_" not in k}
    assert all(torch.equal(full[k], original[v]) for k, v in base_keys.items())  # the base weights never moved
    latest = tmp_path / "full" / "LATEST"
    exported = AutoModelForCausalLM.from_pretrained(latest / "hf")
    with_adapter = peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(REPO / "toy" / "tiny-llama"), latest / "adapter"
    )
    ids = torch.tensor([[0, 200, 200, 269, 27, 316, 340, 15]])
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, with_adapter(ids).logits, atol=1e-5, rtol=0)
        with with_adapter.disable_adapter():
            assert not torch.allclose(exported(ids).logits, with_adapter(ids).logits, atol=1e-3)


def test_lora_loads_without_library_warnings():
    """peft's get_peft_model asks transformers a deprecated question: a FutureWarning on every LoRA run (before)."""
    import warnings
    from config_loader import load_config

    cfg, _ = load_config([*FAST, "loss=dpo", "n_examples=8", *LORA])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_py.load_models(cfg)
    assert not [w for w in caught if issubclass(w.category, FutureWarning)], [str(w.message) for w in caught]


def test_a_fresh_start_in_a_used_run_dir_begins_clean_logs_and_keeps_the_old_ones(tmp_path):
    """An earlier start that stopped before its first checkpoint (debug=true writes none) left metrics.jsonl: the
    same command again (what the resume error advises) logs into a clean file, the old files moved to previous-1/
    (before: appended, two runs' records and two step-0 rows in one file). The defaults taken from the original
    are named where the run starts; --cfg refuses a run_dir holding a checkpoint, as the run does."""
    run_dir = tmp_path / "run"
    original = ["optimizer=RMSprop", "lr=5e-7", "warmup_steps=150", "debug=true", "n_examples=16", "eval_every=8"]
    first = train(run_dir, *original)
    assert (
        "optimizer RMSprop, lr 5e-07, warmup_steps 150, scheduler constant (the original DPO code's defaults"
        in first.stdout
    )
    second = train(run_dir, *original)
    assert f"its files moved to {run_dir / 'previous-1'}" in second.stderr
    assert [r["step"] for r in metrics(run_dir) if "loss/eval" in r] == [0, 8, 16]
    timeless = lambda records: [
        {k: v for k, v in r.items() if not k.startswith(("throughput", "examples_per"))} for r in records
    ]
    assert timeless(metrics(run_dir / "previous-1")) == timeless(metrics(run_dir))  # the first start's, kept
    assert {p.name for p in run_dir.iterdir()} >= {"previous-1", "config.yaml", "metrics.jsonl"}
    done = tmp_path / "done"
    train(done, "n_examples=8", "eval_every=8", "sample_during_eval=false")
    refused = train(done, "n_examples=8", "--cfg", check=False)
    assert refused.returncode == 2 and f"run_dir={done} already holds a run" in refused.stderr


def test_a_precomputed_reference_is_freed_for_real(tmp_path, monkeypatch, capsys):
    """precompute_ref_log_probs promises one model in memory while training: right after the reference pass no other
    causal LM than the policy is alive (before: train.worker_main's local kept the whole reference), and the freed
    bytes are printed."""
    import gc
    import transformers
    import reference_cache
    from config_loader import load_config

    seen = {}
    precompute = reference_cache.precompute

    def precompute_then_look(t):
        precompute(t)
        gc.collect()
        inside = {id(m) for m in t.policy.modules()}
        seen["alive"] = [
            type(o).__name__
            for o in gc.get_objects()
            if isinstance(o, transformers.PreTrainedModel) and id(o) not in inside
        ]

    monkeypatch.setattr(reference_cache, "precompute", precompute_then_look)
    cfg, _ = load_config(
        [
            *FAST,
            "loss=dpo",
            "n_examples=8",
            "precompute_ref_log_probs=true",
            "sample_during_eval=false",
            f"run_dir={tmp_path / 'run'}",
        ]
    )
    (tmp_path / "run").mkdir()
    train_py.worker_main(0, 1, cfg, str(tmp_path / "run"))
    assert seen["alive"] == []
    freed = float(capsys.readouterr().out.split("reference model freed (")[1].split(" MiB")[0])
    weights = AutoModelForCausalLM.from_pretrained(REPO / "toy" / "tiny-llama").state_dict().values()
    assert freed == pytest.approx(sum(w.numel() * w.element_size() for w in weights) / 2**20, abs=0.05)


def test_kto_from_pairs_says_an_epoch_has_twice_the_steps(tmp_path):
    """pairs_to_unpaired makes each pair two completions: the printed geometry says why the steps double."""
    result = train(tmp_path / "run", "loss=kto", "pairs_to_unpaired=true", "n_examples=8", "sample_during_eval=false")
    assert "(pairs_to_unpaired: 2 per pair, so an epoch has twice a paired loss's steps)" in result.stdout


def test_lora_without_peft_says_how_to_install_it_before_loading_a_model(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
    assert train_py.main([*FAST, "loss=dpo", "lora.r=8", "n_examples=8"]) == 2
    assert "pip install peft" in capsys.readouterr().err


def test_a_run_sized_by_its_gpus_is_checked_at_their_count_before_anything_loads(monkeypatch, capsys):
    """FSDPTrainer without n_workers or torchrun: one rank per GPU, a count the config cannot know; train.main checks
    the world-size rules at it before --cfg, --estimate or a run go on (load_config checked the rest). BasicTrainer
    under torchrun is refused: every rank would train its own copy into one run directory."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for flag in ("--cfg", "--estimate"):
        assert train_py.main(["trainer=FSDPTrainer", "loss=dpo", flag]) == 2
        error = capsys.readouterr().err
        assert "batch_size=4: expected divisible by gradient_accumulation_steps=1 x world size=8" in error
    monkeypatch.setenv("WORLD_SIZE", "8")  # torchrun's 8 ranks, each about to train the whole model alone
    assert train_py.main(["loss=dpo", "--cfg"]) == 2
    assert (
        "trainer=BasicTrainer trains in one process, but WORLD_SIZE=8 (torchrun started 8)" in capsys.readouterr().err
    )


OFFLINE_PROBE = """
import socket, sys
def unreachable(address, timeout=None):
    print(f"probe {address} timeout={timeout}", file=sys.stderr)
    raise OSError("Network is unreachable")
socket.create_connection = unreachable  # no packet leaves this machine
sys.path.insert(0, sys.argv[1])
import train
sys.exit(train.main(sys.argv[2:]))
"""


def test_an_unreachable_hub_is_found_once_and_the_run_fails_at_once_from_the_cache(tmp_path):
    """No HF_HUB_OFFLINE and no network: one 3-second probe finds the hub unreachable, the run works from the local
    cache and fails at once when the cache lacks the model (before: 27-49 s of "Retrying in 8s" per hub access)."""
    env = {
        k: v
        for k, v in __import__("os").environ.items()
        if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
    }
    env["HF_HOME"] = str(tmp_path / "hf")  # an empty cache
    result = subprocess.run(
        [sys.executable, "-c", OFFLINE_PROBE, str(REPO), "model=pythia28", "loss=dpo", "datasets=[toy]", "--cfg"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.count("probe ('huggingface.co', 443) timeout=3") == 1
    assert "the Hugging Face hub is unreachable" in result.stderr and "Retrying" not in result.stderr
    assert "cannot load a tokenizer" in result.stderr and "Traceback" not in result.stderr


def test_estimate_of_a_hub_model_asks_for_its_config_json_alone_when_the_hub_is_unreachable(tmp_path):
    """The README's `model=pythia28 --estimate` with an empty cache and no hub: exit 2 with what to fetch and how
    (before: a message that contradicted the README); with the hub, only config.json is downloaded."""
    env = {
        k: v
        for k, v in __import__("os").environ.items()
        if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
    }
    env["HF_HOME"] = str(tmp_path / "hf")
    result = subprocess.run(
        [sys.executable, "-c", OFFLINE_PROBE, str(REPO), "model=pythia28", "loss=dpo", "--estimate"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "--estimate reads only its config.json" in result.stderr
    assert "hf download EleutherAI/pythia-2.8b config.json" in result.stderr and "Traceback" not in result.stderr
