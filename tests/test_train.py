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

import train as train_py

REPO = Path(__file__).resolve().parent.parent
# Small and fast: 8-pair steps, short sequences, no torch.compile warm-up, no W&B.
FAST = ["model=tiny", "datasets=[toy]", "optimizer=AdamW", "warmup_steps=0", "batch_size=8", "eval_batch_size=8",
        "n_eval_examples=16", "n_eval_model_samples=4", "max_length=64", "max_prompt_length=32", "max_new_tokens=8",
        "fsdp.use_torch_compile=false", "wandb.enabled=false", "n_epochs=null"]


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
    assert first_train["step"] == 8 and abs(first_train["loss/train"] - math.log(2)) < 1e-4  # computed before the update
    assert first_eval["rewards_eval/margins"] == 0.0


def test_documented_files_are_written(dpo_run):
    run_dir, result = dpo_run
    assert f"run directory: {run_dir}" in result.stdout and f"done; run directory: {run_dir}" in result.stdout
    assert "batch geometry: 8 pairs per step" in result.stdout
    assert (run_dir / "config.yaml").exists() and (run_dir / "metrics.jsonl").exists()
    assert sorted(p.name for p in run_dir.glob("step-*")) == ["step-16", "step-32"]
    assert (run_dir / "LATEST").resolve() == (run_dir / "step-32").resolve()
    for name in ("policy.pt", "optimizer.pt", "scheduler.pt", "trainer_state.pt", "rng-0.pt", "manifest.json",
                 "hf/config.json", "hf/model.safetensors", "hf/tokenizer.json"):
        assert (run_dir / "step-32" / name).exists(), name
    records = metrics(run_dir)
    for key in ("rewards_train/chosen", "rewards_train/accuracies", "logps_train/rejected", "grad_norm", "lr",
                "examples_per_second"):
        assert any(key in r for r in records), key
    last_eval = [r for r in records if "loss/eval" in r][-1]
    assert last_eval["step"] == 32 and "samples/policy_rule_rate" in last_eval and "samples/reference_rule_rate" in last_eval


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
    train(run_dir, "loss=dpo", f"datasets=[{pairs}]", "lr=1e-3", "n_examples=80", "eval_every=80",
          "sample_during_eval=false", "minimum_log_interval_secs=0")
    losses = [r["loss/train"] for r in metrics(run_dir) if "loss/train" in r]
    assert len(losses) == 10 and abs(losses[0] - math.log(2)) < 1e-4
    assert losses[-1] < 0.05 < losses[0]


def test_resumed_run_ends_exactly_like_an_uninterrupted_one(tmp_path):
    args = ["loss=dpo", "lr=1e-4", "n_examples=48", "eval_every=16", "minimum_log_interval_secs=0"]
    train(tmp_path / "full", *args)
    # The same run, killed right after its first checkpoint, then resumed.
    cmd = [sys.executable, "-u", str(REPO / "train.py"), *FAST, f"run_dir={tmp_path / 'cut'}", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    for line in proc.stdout:
        if "checkpoint written" in line:
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert (tmp_path / "cut" / "LATEST").resolve().name == "step-16"
    result = train(tmp_path / "cut2", *args, f"resume_from={tmp_path / 'cut'}")
    assert "resumed from" in result.stdout and "at 16 examples" in result.stdout
    assert_states_equal(final_state(tmp_path / "full"), final_state(tmp_path / "cut"))


def test_batch_8_accumulation_1_equals_batch_8_accumulation_4_after_one_step(tmp_path):
    """One step over the same 8 pairs: one micro-batch of 8, or 4 micro-batches of 2 with summed gradients.
    SGD with lr 1 makes the parameter change the gradient itself (Adam's first step, lr * g / |g|, would
    amplify float noise wherever g is near 0)."""
    common = ["loss=dpo", "optimizer=SGD", "lr=1.0", "n_examples=8", "eval_every=8", "sample_during_eval=false", "do_first_eval=false"]
    train(tmp_path / "a", *common, "gradient_accumulation_steps=1")
    train(tmp_path / "b", *common, "gradient_accumulation_steps=4")
    before = AutoModelForCausalLM.from_pretrained(REPO / "toy" / "tiny-llama").state_dict()
    a, b = final_state(tmp_path / "a"), final_state(tmp_path / "b")
    assert not torch.equal(a["lm_head.weight"], before["lm_head.weight"])
    assert_states_equal(a, b, atol=1e-6)


def test_debug_writes_no_checkpoint(tmp_path):
    result = train(tmp_path / "run", "loss=sft", "lr=1e-3", "n_examples=16", "eval_every=8", "debug=true",
                   "sample_during_eval=false")
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
    train(tmp_path / "dpo", *common, "loss=dpo", "lr=1e-4", "n_examples=8", "eval_every=8",
          f"model.archive={tmp_path / 'sft' / 'LATEST' / 'policy.pt'}")
    first = next(r for r in metrics(tmp_path / "dpo") if "loss/eval" in r)
    assert abs(first["loss/eval"] - math.log(2)) < 1e-4
    sft_evals = [r for r in metrics(tmp_path / "sft") if "logps_eval/chosen" in r]
    assert abs(first["logps_eval/chosen"] - sft_evals[-1]["logps_eval/chosen"]) < 1e-4  # the archive was loaded
    assert abs(first["logps_eval/chosen"] - sft_evals[0]["logps_eval/chosen"]) > 0.1   # and it is not the base model


def test_run_dir_with_a_run_is_not_overwritten(tmp_path):
    train(tmp_path / "run", "loss=sft", "lr=1e-3", "n_examples=8", "eval_every=8", "sample_during_eval=false")
    again = train(tmp_path / "run", "loss=sft", "n_examples=8", check=False)
    assert again.returncode != 0 and "already holds a run" in again.stderr


def test_activation_checkpointing_in_one_process_gives_the_same_step(tmp_path):
    common = ["loss=dpo", "optimizer=SGD", "lr=1.0", "n_examples=8", "eval_every=8", "sample_during_eval=false",
              "do_first_eval=false"]
    train(tmp_path / "plain", *common)
    result = train(tmp_path / "checkpointed", *common, "activation_checkpointing=true")
    assert "activation checkpointing (NO_REENTRANT) on 2 blocks of LlamaDecoderLayer" in result.stdout
    assert_states_equal(final_state(tmp_path / "plain"), final_state(tmp_path / "checkpointed"), atol=1e-6)


def test_forward_only_evaluates_once_and_trains_nothing(tmp_path):
    result = train(tmp_path / "run", "loss=dpo", "n_examples=16", "eval_every=8", "fsdp.forward_only=true",
                   "sample_during_eval=false")
    records = metrics(tmp_path / "run")
    assert len(records) == 1 and records[0]["step"] == 0 and abs(records[0]["loss/eval"] - math.log(2)) < 1e-4
    assert not list((tmp_path / "run").glob("step-*")) and "Running evaluation after 0" in result.stdout


def test_full_determinism_switches_on_deterministic_algorithms(tmp_path):
    try:
        a = train(tmp_path / "a", "loss=dpo", "lr=1e-4", "n_examples=8", "eval_every=8", "sample_during_eval=false",
                  "fsdp.full_determinism=true")
        assert torch.are_deterministic_algorithms_enabled()
        b = train(tmp_path / "b", "loss=dpo", "lr=1e-4", "n_examples=8", "eval_every=8", "sample_during_eval=false",
                  "fsdp.full_determinism=true")
        assert a.returncode == b.returncode == 0
        assert_states_equal(final_state(tmp_path / "a"), final_state(tmp_path / "b"))
    finally:
        torch.use_deterministic_algorithms(False)


def reference_state(run_dir) -> dict:
    return torch.load(Path(run_dir) / "LATEST" / "reference.pt", weights_only=True)


def test_tr_dpo_hard_update_every_step_keeps_the_loss_at_ln2_and_soft_update_mixes(tmp_path):
    """Hard update (alpha 1) every step: each step starts with reference = policy, so every step's DPO loss is
    ln 2 (plain DPO's second step is not). Soft update (alpha 0.6) after one SGD step: the saved reference is
    0.6 * policy + 0.4 * the original weights, parameter by parameter."""
    common = ["loss=dpo", "optimizer=SGD", "lr=1.0", "sample_during_eval=false", "do_first_eval=false",
              "minimum_log_interval_secs=0"]
    train(tmp_path / "hard", *common, "n_examples=16", "eval_every=16", "ref_update.tau=1", "ref_update.alpha=1.0")
    losses = [r["loss/train"] for r in metrics(tmp_path / "hard") if "loss/train" in r]
    assert len(losses) == 2 and all(abs(x - math.log(2)) < 1e-6 for x in losses)
    assert_states_equal(reference_state(tmp_path / "hard"), final_state(tmp_path / "hard"))
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
    cmd = [sys.executable, "-u", str(REPO / "train.py"), *FAST, f"run_dir={tmp_path / 'cut'}", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    for line in proc.stdout:
        if "checkpoint written" in line:
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
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
    args = ["loss=dpo", "lr=1e-3", "n_examples=32", "eval_every=16", "sample_during_eval=false",
            "minimum_log_interval_secs=0", *LORA]
    train(tmp_path / "full", *args)
    losses = [r["loss/train"] for r in metrics(tmp_path / "full") if "loss/train" in r]
    assert abs(losses[0] - math.log(2)) < 1e-6 and losses[-1] < losses[0]
    cmd = [sys.executable, "-u", str(REPO / "train.py"), *FAST, f"run_dir={tmp_path / 'cut'}", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    for line in proc.stdout:
        if "checkpoint written" in line:
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    result = train(tmp_path / "cut2", *args, f"resume_from={tmp_path / 'cut'}")
    assert "at 16 examples" in result.stdout
    full, cut = final_state(tmp_path / "full"), final_state(tmp_path / "cut")
    assert_states_equal(full, cut)
    original = AutoModelForCausalLM.from_pretrained(REPO / "toy" / "tiny-llama").state_dict()
    base_keys = {k: k.removeprefix("base_model.model.").replace(".base_layer.", ".") for k in full if ".lora_" not in k}
    assert all(torch.equal(full[k], original[v]) for k, v in base_keys.items())  # the base weights never moved
    latest = tmp_path / "full" / "LATEST"
    exported = AutoModelForCausalLM.from_pretrained(latest / "hf")
    with_adapter = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(REPO / "toy" / "tiny-llama"),
                                                  latest / "adapter")
    ids = torch.tensor([[0, 200, 200, 269, 27, 316, 340, 15]])
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, with_adapter(ids).logits, atol=1e-5, rtol=0)
        with with_adapter.disable_adapter():
            assert not torch.allclose(exported(ids).logits, with_adapter(ids).logits, atol=1e-3)


def test_lora_without_peft_says_how_to_install_it_before_loading_a_model(monkeypatch, capsys):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
    assert train_py.main([*FAST, "loss=dpo", "lora.r=8", "n_examples=8"]) == 2
    assert "pip install peft" in capsys.readouterr().err
