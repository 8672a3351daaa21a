"""Evaluation's samples (trainers.sample_and_log) and their scored evaluation (scored_eval.py, eval_scorer): policy and
reference sample from common seeds, so equal weights draw equal samples at every evaluation; the scores, win rate,
lengths and sequence KL are what plain computations give; KL 0 and win rate 0.5 at step 0; without a reference only the
policy's; a resume after SIGKILL and a replay log the same; the scorer is recorded in the run manifest; bad settings
and a bad scorer are refused naming eval_scorer. `python=test_evaluation:<name>` scorers are the functions below."""

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

import run_manifest
import scored_eval
import train as train_py
import trainers
from config import ConfigError
from config_loader import load_config
from utils import sampling_seed

from conftest import LOCAL_DIRS  # runs and caches in a temporary directory

REPO = Path(__file__).resolve().parent.parent
FAST = [
    "model=tiny",
    "datasets=[toy]",
    "loss=dpo",
    "optimizer=AdamW",
    "warmup_steps=0",
    "batch_size=8",
    "eval_batch_size=8",
    "n_eval_examples=16",
    "n_eval_model_samples=16",
    "max_length=64",
    "max_prompt_length=32",
    "max_new_tokens=8",
    "wandb.enabled=false",
    "n_epochs=null",
    LOCAL_DIRS,
]
SCORED = [*FAST, "eval_scorer=rule", "lr=1e-3", "n_examples=32", "eval_every=16"]
TIMING = ("throughput/", "examples_per_second")  # wall-clock metrics differ between any two runs
SCORES = ("samples/policy_score", "samples/reference_score", "samples/win_rate")
LENGTHS = ("samples/policy_length", "samples/reference_length")


def by_length(prompts, completions):
    """Distinct completions score apart (ties are rare)."""
    return [len(x) + sum(map(ord, x)) % 997 / 1000 for x in completions]


def by_vowels(prompts, completions):
    return [float(sum(x.count(v) for v in "aeiou")) for x in completions]


def not_a_number(prompts, completions):
    return [float("nan")] * len(completions)


def train(run_dir, *args, code: int = 0) -> subprocess.CompletedProcess:
    """train.py in this process (its imports cost ~10 s per subprocess), what it prints captured."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        result = subprocess.CompletedProcess(args, train_py.main([*args, f"run_dir={run_dir}"]), out.getvalue(), "")
    result.stderr = err.getvalue()
    assert result.returncode == code, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def evaluations(run_dir) -> list[dict]:
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "loss/eval" in r]


def samples(run_dir) -> dict[int, list[dict]]:
    out = {}
    for line in (Path(run_dir) / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        out.setdefault(row["step"], []).append(row)
    return out


@pytest.fixture(scope="module")
def scored_run(tmp_path_factory):
    """A toy DPO run scored by the rule: evaluations at 0, 16 and 32 pairs, 16 prompts each."""
    run_dir = tmp_path_factory.mktemp("scored") / "run"
    return run_dir, train(run_dir, *SCORED)


def test_a_scored_dpo_run_logs_kl_0_and_win_rate_half_first_and_kl_above_0_last(scored_run):
    """The issue's bar: every evaluation logs the scores, win rate, lengths and KL; the first (policy = reference,
    both sampled from one seed: the same completions) KL exactly 0 and win rate exactly 0.5; the last KL > 0. The rule
    scorer's means are the toy's rule rates."""
    run_dir, _ = scored_run
    evals = evaluations(run_dir)
    assert [r["step"] for r in evals] == [0, 16, 32]
    for record in evals:
        assert set(SCORES + LENGTHS + ("samples/kl",)) <= set(record)
        assert record["samples/policy_score"] == record["samples/policy_rule_rate"]
        assert record["samples/reference_score"] == record["samples/reference_rule_rate"]
        assert all(1 <= record[k] <= 8 for k in LENGTHS)  # max_new_tokens=8, EOS counted
    first, last = evals[0], evals[-1]
    assert first["samples/kl"] == 0.0 and first["samples/win_rate"] == 0.5
    assert first["samples/policy_score"] == first["samples/reference_score"]
    assert last["samples/kl"] > 0.5


def test_the_win_rate_is_each_prompts_comparison_of_the_logged_samples_ties_half(scored_run):
    """samples.jsonl holds each prompt's two completions: the rule applied to them gives the logged win rate."""
    import sources

    rule = sources.sample_rule(["toy"])
    run_dir, _ = scored_run
    by_step = samples(run_dir)
    for record in evaluations(run_dir):
        rows = by_step[record["step"]]
        assert len(rows) == 16
        wins = [
            1.0 if rule(r["policy"]) > rule(r["reference"]) else 0.5 if rule(r["policy"]) == rule(r["reference"]) else 0
            for r in rows
        ]
        assert record["samples/win_rate"] == pytest.approx(sum(wins) / 16, abs=1e-12)


def noisy_trainer(run_dir, *args) -> trainers.BasicTrainer:
    """A trainer in this process whose reference is the policy with noise added (their log-ratios are far from 0),
    scored by by_length."""
    cfg, _ = load_config([*FAST, "n_examples=16", "eval_scorer=python=test_evaluation:by_length", *args])
    tokenizer, policy, reference = train_py.load_models(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    with contextlib.redirect_stdout(io.StringIO()):
        t = trainers.BasicTrainer(policy, cfg, cfg.seed, str(run_dir), reference, tokenizer=tokenizer)
    t.policy.eval()
    return t


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    return noisy_trainer(tmp_path_factory.mktemp("trainer"))


def plain_logp(model, prompt_ids: torch.Tensor, completion: list[int]) -> float:
    """log p(completion | prompt) from one unpadded forward: log_softmax at each completion token, summed."""
    ids = torch.tensor([prompt_ids.tolist() + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    positions = range(len(prompt_ids) - 1, ids.size(1) - 1)  # output t predicts token t+1
    return sum(logits[t].log_softmax(-1)[ids[0, t + 1]].item() for t in positions)


def test_the_kl_scores_and_lengths_are_plain_computations_on_the_samples(trainer):
    """Against plain computations on completions drawn again from the same seeds: the KL is the mean of log pi(y|x) -
    log pi_ref(y|x), each an unpadded forward of prompt + completion (up to its EOS); the scores are by_length's,
    the lengths the tokens generated; the win rate from those scores."""
    t = trainer
    with contextlib.redirect_stdout(io.StringIO()):
        got = t.sample_and_log()
    ratios, lengths, wins, scores = [], [], [], []
    for group, batch in t.sample_batches:
        seed = sampling_seed(t.seed, t.state.example_counter, group)
        (policy_ids, policy_texts), (reference_ids, reference_texts) = (
            t.sample(model, batch, seed) for model in (t.policy, t.reference.model)
        )
        for i, prompt in enumerate(batch["prompt_input_ids"]):
            prompt = prompt[batch["prompt_attention_mask"][i].bool()]
            tokens = policy_ids[i].tolist()
            end = tokens.index(1) + 1 if 1 in tokens else len(tokens)  # the toy tokenizer's EOS is 1
            ratios.append(
                plain_logp(t.policy, prompt, tokens[:end]) - plain_logp(t.reference.model, prompt, tokens[:end])
            )
            lengths.append(end)
        p, r = by_length(None, policy_texts), by_length(None, reference_texts)
        scores += p
        wins += [1.0 if a > b else 0.5 if a == b else 0.0 for a, b in zip(p, r)]
    assert len(ratios) == 16 and abs(sum(ratios) / 16) > 1.0  # the noisy reference is far from the policy
    assert got["samples/kl"] == pytest.approx(sum(ratios) / 16, abs=1e-4)
    assert got["samples/policy_score"] == pytest.approx(sum(scores) / 16, abs=1e-12)
    assert got["samples/policy_length"] == sum(lengths) / 16
    assert got["samples/win_rate"] == sum(wins) / 16


@pytest.mark.parametrize("options", [["padding_free=true", "tiled_lm_head=true"], ["prefix_sharing=true"]])
def test_the_kl_is_the_same_through_packed_rows_the_tiled_head_and_a_shared_prefix_run(trainer, tmp_path, options):
    """The KL forwards take the run's log-prob path: packed rows and the tiled head give the plain path's KL; under
    prefix_sharing (whose layout lays out pairs sharing a prompt) the single completions go as plain rows."""
    with contextlib.redirect_stdout(io.StringIO()):
        plain = trainer.sample_and_log()["samples/kl"]
        fast = noisy_trainer(tmp_path, *options)
        assert fast.layout is not None
        assert fast.sample_and_log()["samples/kl"] == pytest.approx(plain, abs=1e-4)


def test_completion_rows_label_the_completion_up_to_its_first_stop_and_drop_the_prompts_padding():
    """Left-padded prompts [_, 5, 6] and [7, 8, 9]; completions [10, 1, 0, 0] (EOS 1, then generate's padding) and
    [11, 12, 13, 14] (never stopped): rows 5 6 10 1 and 7 8 9 11 12 13 14, labelled on the completion only."""
    batch = {
        "prompt_input_ids": torch.tensor([[0, 5, 6], [7, 8, 9]]),
        "prompt_attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]),
    }
    inputs, lengths = scored_eval.completions(batch, torch.tensor([[10, 1, 0, 0], [11, 12, 13, 14]]), {1})
    assert lengths == [2, 4]
    assert inputs["input_ids"].tolist() == [[5, 6, 10, 1, 0, 0, 0], [7, 8, 9, 11, 12, 13, 14]]
    assert inputs["attention_mask"].tolist() == [[1, 1, 1, 1, 0, 0, 0], [1] * 7]
    assert inputs["labels"].tolist() == [[-100, -100, 10, 1, -100, -100, -100], [-100, -100, -100, 11, 12, 13, 14]]


def test_equal_weights_sample_equal_completions_at_every_evaluation_not_only_the_first(trainer):
    """Both models sample from the seed of (seed, pairs seen, group): with the reference's weights copied into the
    policy, an evaluation after 16 pairs gives the two the same completions (before, the reference always drew from
    the step-0 seed: an unpaired comparison)."""
    t = trainer
    policy_state = {k: v.clone() for k, v in t.policy.state_dict().items()}
    t.policy.load_state_dict(t.reference.model.state_dict())
    t.state.example_counter = 16
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            got = t.sample_and_log()
        rows = [r for r in map(json.loads, (t.run_dir / "samples.jsonl").read_text().splitlines()) if r["step"] == 16]
    finally:
        t.policy.load_state_dict(policy_state)
        t.state.example_counter = 0
    assert len(rows) == 16 and all(r["policy"] == r["reference"] for r in rows)
    assert got["samples/kl"] == 0.0 and got["samples/win_rate"] == 0.5


def test_a_scorer_returning_nan_stops_the_evaluation_naming_eval_scorer(trainer, monkeypatch):
    monkeypatch.setattr(trainer.scored, "score", not_a_number)
    with pytest.raises(
        ConfigError, match=r"eval_scorer=python=test_evaluation:by_length: returned nan for completion 0"
    ):
        with contextlib.redirect_stdout(io.StringIO()):
            trainer.sample_and_log()


def test_without_a_reference_only_the_policys_score_and_length_are_logged(tmp_path):
    """precompute_ref_log_probs frees the reference before the first evaluation: nothing samples against the policy,
    so no reference score, win rate or KL; the policy's score and length at every evaluation."""
    run_dir = tmp_path / "run"
    train(run_dir, *FAST, "eval_scorer=rule", "precompute_ref_log_probs=true", "n_examples=8", "eval_every=8")
    evals = evaluations(run_dir)
    assert len(evals) == 2
    for record in evals:
        assert {k for k in record if k.startswith("samples/")} == {
            "samples/policy_rule_rate",
            "samples/policy_score",
            "samples/policy_length",
        }


def test_lora_compares_the_policy_with_its_adapters_off(tmp_path):
    """Under LoRA the reference is the policy with its adapters off: the same model at step 0 (adapters start at 0),
    KL 0 and win rate 0.5, then the adapters move it away."""
    pytest.importorskip("peft")
    run_dir = tmp_path / "run"
    train(run_dir, *FAST, "eval_scorer=rule", "lora.r=4", "lora.alpha=8", "lr=1e-2", "n_examples=16", "eval_every=16")
    first, last = evaluations(run_dir)
    assert first["samples/kl"] == 0.0 and first["samples/win_rate"] == 0.5
    assert last["samples/kl"] > 0


def test_a_resume_after_sigkill_logs_the_same_scored_evaluations(scored_run, tmp_path):
    """The scored run killed right after its first checkpoint (16 pairs), then resumed: every record equal to the
    uninterrupted run's (wall-clock metrics aside), the scores, win rates, lengths and KL of each evaluation included."""
    full, _ = scored_run
    cut = tmp_path / "cut"
    cmd = [sys.executable, "-u", str(REPO / "train.py"), *SCORED, f"run_dir={cut}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    for line in proc.stdout:
        if "checkpoint written" in line:
            proc.send_signal(signal.SIGKILL)
            break
    assert proc.wait(timeout=60) == -signal.SIGKILL and (cut / "LATEST").resolve().name == "step-16"
    train(cut, *SCORED, f"resume_from={cut}")
    same = lambda run: [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in evaluations(run)]  # noqa: E731
    assert [r["step"] for r in same(cut)] == [0, 16, 32]
    assert same(cut) == same(full) and "samples/kl" in same(cut)[-1]


def test_a_replay_scores_again_with_the_recorded_scorer_and_finds_the_same_numbers(scored_run, tmp_path):
    run_dir, _ = scored_run
    manifest = json.loads((run_dir / "run_manifest.json").read_text())
    assert manifest["eval_scorer"] == {"spec": "rule", "datasets": ["toy"]}
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert train_py.main(["--replay", str(run_dir), f"run_dir={tmp_path / 'replay'}"]) == 0
    report = out.getvalue()
    for metric in (*SCORES, *LENGTHS, "samples/kl"):
        assert f"  {metric:<40} {0.0:>14.3e} {3:>15d}" in report
    assert "replay identical" in report


def test_the_manifest_records_a_python_scorer_by_its_source_and_warns_when_it_changed(tmp_path, capsys):
    """The function's module, name and source sha256: a resume or replay with another function (same key, other
    code) is warned about, naming eval_scorer."""
    args = [*FAST, "n_examples=8", f"run_dir={tmp_path}"]
    cfg, _ = load_config([*args, "eval_scorer=python=test_evaluation:by_length"])
    run_manifest.write(tmp_path, cfg, {}, 1)
    scorer = json.loads((tmp_path / "run_manifest.json").read_text())["eval_scorer"]
    assert scorer["spec"] == "python=test_evaluation:by_length" and scorer["function"] == "by_length"
    assert scorer["module"] == "test_evaluation" and len(scorer["source_sha256"]) == 64
    run_manifest.check_against(tmp_path, cfg, {}, "resume")
    assert "eval_scorer differs" not in capsys.readouterr().err
    other, _ = load_config([*args, "eval_scorer=python=test_evaluation:by_vowels"])
    run_manifest.check_against(tmp_path, other, {}, "resume")
    assert "warning: eval_scorer differs from the recorded run's" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, problem",
    [
        (["eval_scorer=rules"], "eval_scorer='rules': expected rule, reward_model=<directory> or python=<module>:"),
        (["eval_scorer=rule", "sample_during_eval=false"], "eval_scorer=rule: sample_during_eval=false"),
        (["eval_scorer=rule", "n_eval_model_samples=0"], "n_eval_model_samples=0: no samples to score"),
        (["eval_scorer=rule", "datasets=[examples/pairs.jsonl]"], "eval_scorer=rule: datasets=['examples/pairs.jsonl'"),
        (["eval_scorer=python=no_such_module:f"], "eval_scorer=python=no_such_module:f: cannot import f"),
        (["eval_scorer=reward_model=/no/such/dir"], "eval_scorer=reward_model=/no/such/dir: cannot load its config"),
    ],
)
def test_bad_eval_scorer_settings_are_refused_naming_the_key(args, problem):
    with pytest.raises(ConfigError) as e:
        load_config([*FAST, "n_examples=8", *args])
    assert any(problem in p for p in e.value.problems), e.value.problems


def test_fsdp2_on_two_ranks_scores_each_ranks_share_as_one_process_does(tmp_path):
    """24 prompts: three groups of 8 over two ranks (rank 1 repeats a group to keep the collectives in step). The
    step-0 evaluation of FSDP2 equals one process's: each group samples from its own seed on whichever rank, and the
    gathered scores, lengths, win rate and KL are the same numbers in the same order."""
    args = [*FAST, "eval_scorer=python=test_evaluation:by_length", "n_eval_model_samples=24", "n_examples=8"]
    args += ["eval_every=8", "lr=1e-3", "n_eval_examples=24"]
    train(tmp_path / "one", *args)
    train(tmp_path / "fsdp", *args, "trainer=FSDPTrainer", "fsdp.strategy=fsdp2", "n_workers=2")
    one, sharded = evaluations(tmp_path / "one"), evaluations(tmp_path / "fsdp")
    assert samples(tmp_path / "one")[0] == samples(tmp_path / "fsdp")[0]
    for key in (*SCORES, *LENGTHS, "samples/kl"):
        assert sharded[0][key] == one[0][key], key
    assert sharded[-1]["samples/kl"] == pytest.approx(one[-1]["samples/kl"], abs=1e-3)
    assert not math.isnan(sharded[-1]["samples/win_rate"])
