"""Semi-online DPO (online.py) as a user runs it: train.py on the toy model, rounds of 16 prompts x 4 samples scored
by the functions below (`online.scorer=python=test_online:<name>`: this directory is on the path), 8 pairs a step."""

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

import online
import scorers
import run_manifest
import train as train_py
from config import ConfigError
from config_loader import load_config

from conftest import LOCAL_DIRS  # runs and caches in a temporary directory

REPO = Path(__file__).resolve().parent.parent
FAST = [
    "model=tiny",
    "datasets=[toy]",
    "loss=dpo",
    "optimizer=AdamW",
    "warmup_steps=0",
    "lr=1e-4",
    "batch_size=8",
    "eval_batch_size=8",
    "n_eval_examples=16",
    "n_eval_model_samples=4",
    "max_length=64",
    "max_prompt_length=32",
    "max_new_tokens=8",
    "wandb.enabled=false",
    "eval_every=8",
    "online.rounds=2",
    "online.prompts_per_round=16",
    "online.max_new_tokens=8",
    LOCAL_DIRS,
]
SCORER = "online.scorer=python=test_online:by_length"


def by_length(prompts, completions):
    """Distinct completions score apart: every prompt gives a pair."""
    return [len(x) + sum(map(ord, x)) % 997 / 1000 for x in completions]


def tied(prompts, completions):
    return [0.5] * len(completions)


def one_short(prompts, completions):
    return [1.0] * (len(completions) - 1)


def not_a_number(prompts, completions):
    return [float("nan")] * len(completions)


def words(prompts, completions):
    return ["high"] * len(completions)


def train(run_dir, *args, code: int = 0) -> subprocess.CompletedProcess:
    """train.py in this process (its imports cost ~10 s per subprocess), what it prints captured."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        result = subprocess.CompletedProcess(
            args, train_py.main([*FAST, f"run_dir={run_dir}", *args]), out.getvalue(), err.getvalue()
        )
    assert result.returncode == code, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def pairs(run_dir, r: int) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "rounds" / str(r) / "pairs.jsonl").read_text().splitlines()]


def policy(run_dir) -> dict:
    return torch.load(Path(run_dir) / "LATEST" / "policy.pt", weights_only=True)["state"]


@pytest.fixture(scope="module")
def online_run(tmp_path_factory):
    """Two rounds of one process, shared by the tests that compare against it."""
    run_dir = tmp_path_factory.mktemp("online") / "run"
    return run_dir, train(run_dir, SCORER)


def test_two_rounds_write_their_pair_files_and_train_on_them(online_run):
    run_dir, result = online_run
    steps = 0
    for r in (0, 1):
        rows = pairs(run_dir, r)
        assert rows and all(row["chosen_score"] > row["rejected_score"] and len(row["scores"]) == 4 for row in rows)
        assert online.finished_round(run_dir / "rounds" / str(r))["pairs"] == len(rows)  # round.json's sha256 matches
        assert f"round {r}: mean score" in result.stdout and f"{len(rows)} pairs of 16 prompts" in result.stdout
        steps += len(rows) // 8
    assert json.loads((run_dir / "self_check.json").read_text())["passed"]  # checked before its first round
    logged = records(run_dir)
    assert sum("loss/train" in rec for rec in logged) == steps == 4  # one pass over each round, 8 pairs a step
    rounds = [rec for rec in logged if "online/round" in rec]
    assert [rec["online/round"] for rec in rounds] == [0, 1] and [rec["step"] for rec in rounds] == [0, 16]
    for key in (
        "online/mean_score",
        "online/pairs_kept_per_prompt",
        "online/mean_score_gap",
        "online/length_ratio",
        "throughput/generated_tokens_per_second",
    ):
        assert all(rec[key] > 0 for rec in rounds), key
    assert sum("throughput/generation_share" in rec for rec in logged) == 2
    scorer = json.loads((run_dir / "run_manifest.json").read_text())["online"]["scorer"]
    assert (scorer["module"], scorer["function"], len(scorer["source_sha256"])) == ("test_online", "by_length", 64)


def test_a_round_of_ties_is_skipped_with_a_line_and_prompt_only_rows_are_read(tmp_path):
    prompts = tmp_path / "prompts.jsonl"  # prompt-only rows: no pairs anywhere
    prompts.write_text(
        "".join(json.dumps({"prompt": f"\n\nHuman: Tell me about cats {i}.\n\nAssistant:"}) + "\n" for i in range(20))
    )
    result = train(tmp_path / "run", "online.scorer=python=test_online:tied", f"online.prompts={prompts}")
    assert "0 pairs of 16 prompts" in result.stdout  # every score 0.5, less the penalty for no EOS
    assert "round 0: skipped: 0 pairs over online.min_score_gap, fewer than a batch" in result.stdout
    assert "round 1: skipped" in result.stdout
    assert pairs(tmp_path / "run", 0) == [] and not any("loss/train" in rec for rec in records(tmp_path / "run"))


def test_resume_after_sigkill_mid_round_equals_the_uninterrupted_run(online_run, tmp_path):
    """Killed after the checkpoint at 8 pairs (inside round 0), round 1's file left half written: the resume trains
    the rest of round 0 from its file, makes round 1 again from its seeds, and ends bit-identical."""
    full, _ = online_run
    cut = tmp_path / "cut"
    cmd = [sys.executable, "-u", str(REPO / "train.py"), *FAST, f"run_dir={cut}", SCORER]
    env = dict(os.environ, PYTHONPATH=str(REPO / "tests"))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env)
    for line in proc.stdout:
        if "checkpoint written" in line:
            proc.send_signal(signal.SIGKILL)
            break
    assert proc.wait(timeout=60) == -signal.SIGKILL and (cut / "LATEST").resolve().name == "step-8"
    (cut / "rounds" / "1").mkdir(parents=True, exist_ok=True)
    half = (full / "rounds" / "1" / "pairs.jsonl").read_text()
    (cut / "rounds" / "1" / "pairs.jsonl").write_text(half[: len(half) // 2])
    (cut / "rounds" / "1" / "round.json").unlink(missing_ok=True)
    result = train(cut, SCORER, f"resume_from={cut}")
    assert "at 8 examples" in result.stdout and "round 0:" not in result.stdout and "round 1: mean" in result.stdout
    for r in (0, 1):
        assert pairs(cut, r) == pairs(full, r)
    a, b = policy(full), policy(cut)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    timing = ("throughput/", "examples_per_second")  # wall-clock metrics differ between any two runs
    same = lambda run: [{k: v for k, v in rec.items() if not k.startswith(timing)} for rec in records(run)]  # noqa: E731
    assert same(full) == same(cut)


def test_replay_regenerates_identical_pairs(online_run, tmp_path):
    run_dir, _ = online_run
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert train_py.main(["--replay", str(run_dir), f"run_dir={tmp_path / 'replay'}"]) == 0
    assert "online rounds: 2 compared, identical pairs in every round" in out.getvalue()
    assert "replay identical" in out.getvalue()
    (tmp_path / "replay" / "rounds" / "1" / "pairs.jsonl").write_text("{}\n")  # a pair sampled otherwise
    report = run_manifest.report(run_dir, tmp_path / "replay")
    assert "online rounds: 2 compared, rounds 1 differ" in report
    # the metrics' verdict is its own (it once took the differing rounds for metrics: "differs in 1 metric(s): 1")
    assert report.splitlines()[-1].startswith("replay identical")


def test_fsdp2_on_two_ranks_writes_the_same_round_file_as_one_process(online_run, tmp_path):
    """Each group of prompts has its own stream, whichever rank samples it: round 0 (the starting weights) is the same
    file; the later round matches too as long as FSDP's training steps match one process bit for bit."""
    run_dir, _ = online_run
    train(tmp_path / "fsdp", SCORER, "trainer=FSDPTrainer", "fsdp.strategy=fsdp2", "n_workers=2")
    sharded, single = (d / "rounds" / "0" / "pairs.jsonl" for d in (tmp_path / "fsdp", run_dir))
    assert sharded.read_bytes() == single.read_bytes()


def test_bad_scorer_output_stops_the_run_naming_the_scorer(tmp_path):
    result = train(tmp_path / "run", "online.scorer=python=test_online:not_a_number", code=2)
    assert "online.scorer=python=test_online:not_a_number: returned nan for completion 0" in result.stderr
    for name, problem in (("one_short", "returned 3 scores"), ("words", "returned 'high' for completion 0")):
        expected = f"online.scorer=python=test_online:{name}: {problem}; expected a list of 4"
        with pytest.raises(ConfigError, match=expected):
            scorers.checked(
                f"online.scorer=python=test_online:{name}", globals()[name], ["p"] * 4, ["a", "b", "c", "d"]
            )


def test_each_scorer(tmp_path):
    """rule: the toy rule; python: the user's function; reward_model: a tiny random sequence-classification model,
    each text's score batched as alone."""
    cfg = lambda scorer: load_config([*FAST, f"online.scorer={scorer}"])[0]  # noqa: E731
    texts = [" cats purr and nap.", " CATS PURR AND NAP.", " dogs bark"]
    assert scorers.make("online.scorer", "rule", cfg("rule"))(["p"] * 3, texts) == [1.0, 0.0, 1.0]
    assert (
        scorers.make("online.scorer", "python=test_online:by_length", cfg("python=test_online:by_length")) is by_length
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(REPO / "toy" / "tiny-llama")
    torch.manual_seed(0)
    model = transformers.LlamaForSequenceClassification(
        transformers.LlamaConfig(
            vocab_size=512,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_labels=1,
        )
    )
    model.save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    score = scorers.make(
        "online.scorer", f"reward_model={tmp_path / 'rm'}", cfg(f"reward_model={tmp_path / 'rm'}"), torch.device("cpu")
    )
    batched = score(["\n\nHuman: Hi\n\nAssistant:"] * 3, texts)
    alone = [score(["\n\nHuman: Hi\n\nAssistant:"], [x])[0] for x in texts]
    assert len(set(batched)) == 3 and batched == pytest.approx(alone, abs=1e-5)
    with pytest.raises(ConfigError, match="online.scorer=python=no_such_module:f: cannot import f from no_such_module"):
        scorers.make("online.scorer", "python=no_such_module:f", cfg("python=no_such_module:f"))


def test_shared_prefix_sampling_draws_the_tokens_plain_sampling_draws():
    """The prompt prefilled once and its cache repeated n times samples what num_return_sequences (n prefills)
    samples from the same seed: left-padded prompts of three lengths, 3 samples each."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(REPO / "toy" / "tiny-llama", padding_side="left")
    tokenizer.pad_token = tokenizer.eos_token  # as train.py gives a tokenizer without one
    model = transformers.AutoModelForCausalLM.from_pretrained(REPO / "toy" / "tiny-llama").eval()
    prompts = ["Hi", "Tell me about cats.", "What do you know about the sea and its ships?"]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    sampling = dict(max_new_tokens=10, temperature=1.0, top_p=0.9, pad_token_id=0)
    torch.manual_seed(3)
    plain = model.generate(**batch, do_sample=True, num_return_sequences=3, **sampling)[:, batch["input_ids"].size(1) :]
    torch.manual_seed(3)
    sharding = type("OneProcess", (), {"generate": staticmethod(lambda m, **kwargs: m.generate(**kwargs))})()
    shared = online.shared_prefix_generate(sharding, model, batch["input_ids"], batch["attention_mask"], 3, **sampling)
    assert torch.equal(plain, shared)


def test_online_settings_are_checked_before_anything_loads(tmp_path):
    bad = {
        "loss=sft": "does not train on pairs",
        "precompute_ref_log_probs=true": "do not exist before training",
        "online.prompts_per_round=4": "fewer than batch_size=8",
        "online.max_new_tokens=40": "would be cut in training",
    }
    for arg, message in bad.items():
        with pytest.raises(ConfigError, match=message):
            load_config([*FAST, arg])
    with pytest.raises(ConfigError, match="online.samples_per_prompt=8: read only with online.rounds set"):
        load_config([*FAST, "online.rounds=null", "online.samples_per_prompt=8"])
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "a"}\n{"question": "b"}\n')
    result = train(tmp_path / "run", SCORER, f"online.prompts={tmp_path / 'prompts.jsonl'}", code=2)
    assert (
        'prompts.jsonl, line 2: expected {"prompt": a string or messages}' in result.stderr
        and not (tmp_path / "run").exists()
    )
