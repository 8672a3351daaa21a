"""Semi-online DPO (online.py) as a user runs it: train.py on the toy model, rounds of 16 prompts x 4 samples scored
by the functions below (`online.scorer=python=test_online:<name>`: this directory is on the path), 8 pairs a step."""

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers

import online
import scorers
import run_manifest
import train as train_py
from config import ConfigError
from config_loader import load_config
from sharding import unwrap
from test_fsdp import gathered_units

from conftest import LOCAL_DIRS  # runs and caches in a temporary directory
from utils import get_open_port

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


def eleven(prompts, completions):
    """by_length's scores, but tied (no pair) for the toy questions numbered 0 to 4 modulo 16: with no penalty for a
    missing EOS, a round of 16 consecutive questions makes 11 pairs, not a multiple of the 8 a step takes."""
    tied = [int(re.search(r"Question (\d+)", p).group(1)) % 16 < 5 for p in prompts]
    return [0.5 if t else s for t, s in zip(tied, by_length(prompts, completions))]


def first_over_last(prompts, targets, samples, scores):
    """A pairing rule of the user's: every other prompt's first sample over its last, by index."""
    return [(0, len(s) - 1) if i % 2 == 0 else None for i, s in enumerate(samples)]


def one_entry(prompts, targets, samples, scores):
    return [(0, 1)]


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
    made = 0
    for r in (0, 1):
        rows = pairs(run_dir, r)
        assert rows and all(row["chosen_score"] > row["rejected_score"] and len(row["scores"]) == 4 for row in rows)
        assert online.finished_round(run_dir / "rounds" / str(r))["pairs"] == len(rows)  # round.json's sha256 matches
        assert f"round {r}: mean score" in result.stdout and f"{len(rows)} pairs of 16 prompts" in result.stdout
        made += len(rows)
    assert json.loads((run_dir / "self_check.json").read_text())["passed"]  # checked before its first round
    logged = records(run_dir)
    assert sum("loss/train" in rec for rec in logged) == made // 8 == 4  # one pass over each round, 8 pairs a step
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


def test_online_runs_print_the_rounds_geometry_not_the_datasets(online_run):
    """The datasets' 2000 training pairs are not what a semi-online run trains: no `train pairs 2000; total steps 250`
    (#53 item 3), but the rounds' line."""
    _, result = online_run
    geometry = next(line for line in result.stdout.splitlines() if line.startswith("batch geometry:"))
    assert "train pairs" not in geometry and "total steps" not in geometry and "eval pairs 16" in geometry
    assert "[data] toy/train" not in result.stdout
    assert "online: 2 rounds of 16 of 2000 prompts x 4 samples, paired by best_worst" in result.stdout
    assert "at most 4 steps" in result.stdout


def test_a_run_whose_rounds_make_no_pair_fails_naming_the_knob(tmp_path):
    """Every round starved by online.min_score_gap (the rule scores 0 or 1, less 1 for no EOS: no gap exceeds 5): the
    run exits 5, naming the knob, with nothing trained, evaluated or saved, and the rounds' files kept; so does a run
    on 2 spawned ranks (#53 item 2: such runs exited 0)."""
    prompts = tmp_path / "prompts.jsonl"  # prompt-only rows are read
    prompts.write_text(
        "".join(json.dumps({"prompt": f"\n\nHuman: Tell me about cats {i}.\n\nAssistant:"}) + "\n" for i in range(20))
    )
    starving = ["online.scorer=rule", "online.min_score_gap=5", f"online.prompts={prompts}"]
    result = train(tmp_path / "run", *starving, code=5)
    assert "0 pairs of 16 prompts" in result.stdout and "round 1:" in result.stdout
    assert "online: 2 rounds made 0 pairs and trained 0 in 0 steps; 2 rounds made no pair\n" in result.stdout
    assert "nothing was trained" in result.stderr and "online.min_score_gap=5.0" in result.stderr
    assert "2 rounds of online.prompts_per_round=16 prompts made 0 pairs" in result.stderr
    run_dir = tmp_path / "run"
    assert pairs(run_dir, 0) == pairs(run_dir, 1) == [] and not list(run_dir.glob("step-*"))
    assert not (run_dir / "metrics.jsonl").exists() or not any("loss/train" in rec for rec in records(run_dir))
    spawned = [*starving, "online.rounds=1", "trainer=FSDPTrainer", "fsdp.strategy=fsdp2", "n_workers=2"]
    result = train(tmp_path / "spawned", *spawned, code=5)
    assert "error: online.rounds=1: 1 rounds of" in result.stderr and "online.min_score_gap=5.0" in result.stderr


COUNTED = ("made", "dropped", "trained", "waiting")
SHORT = ["online.scorer=python=test_online:eleven", "online.unfinished_penalty=0", "scheduler=linear", "lr=1e-3"]


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    """Two rounds that come up short (`eleven`), shared by the tests that read or compare against it."""
    run_dir = tmp_path_factory.mktemp("short") / "run"
    return run_dir, train(run_dir, *SHORT)


def test_short_rounds_train_every_pair_and_the_schedule_ends_with_the_steps(short_run):
    """Rounds of 11 pairs (`eleven`), the loader dropping any with an empty reply: each round's rest waits for the next
    round's steps, the last round's rest is one smaller step; every pair made and kept is trained, counted in
    round.json and the metrics, and the linear schedule reaches 0 at the last step (#53 item 1: the rounds trained 8
    of their pairs each, dropping the rest, and the schedule planned for 4 steps ended at 2)."""
    run_dir, result = short_run
    made = [online.finished_round(run_dir / "rounds" / str(r)) for r in (0, 1)]
    assert [m["pairs"] for m in made] == [len(pairs(run_dir, r)) for r in (0, 1)] == [11, 11]
    kept = [m["pairs"] - m["pairs_dropped"] for m in made]
    total = sum(kept)
    assert kept[0] % 8 and total % 8  # some wait, and the last step is smaller
    assert [m["pairs_trained"] for m in made] == [kept[0] // 8 * 8, total - kept[0] // 8 * 8]
    assert made[1]["pairs_waited"] == made[0]["pairs_left"] == kept[0] % 8 and made[1]["pairs_left"] == 0
    logged = records(run_dir)
    steps = [rec for rec in logged if "loss/train" in rec]
    assert len(steps) == -(-total // 8) == steps[-1]["counters/updates"]  # the last: a smaller step of the rest
    assert steps[-1]["counters/examples"] == steps[-1]["step"] == total
    counted = {k: sum(rec[f"online/pairs_{k}"] for rec in logged if "online/round" in rec) for k in COUNTED}
    assert counted == dict(made=22, dropped=22 - total, trained=total, waiting=kept[0] % 8)
    assert steps[-1]["lr"] == 0.0 and all(a["lr"] > b["lr"] for a, b in zip(steps, steps[1:]))  # linear: ends at 0
    assert f"online: 2 rounds made 22 pairs and trained {total} in {len(steps)} steps" in result.stdout
    assert (run_dir / f"step-{total}").is_dir()  # the final checkpoint, after the smaller step


def test_resume_after_sigkill_mid_round_equals_the_uninterrupted_run(short_run, tmp_path):
    """Killed after the checkpoint at 8 pairs (round 0's one step; 3 of its pairs waiting), round 1's file left half
    written: the resume finds round 0's waiting pairs in its file, makes round 1 again from its seeds, trains both
    with the smaller last step, and ends bit-identical."""
    full, _ = short_run
    cut = tmp_path / "cut"
    cmd = [sys.executable, "-u", str(REPO / "train.py"), *FAST, f"run_dir={cut}", *SHORT]
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
    result = train(cut, *SHORT, f"resume_from={cut}")
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
    """Each group of prompts has its own stream, whichever rank samples it, with the policy gathered once for the
    round (sharding.sampling): round 0 (the starting weights) is the same file; the later round matches too as long as
    FSDP's training steps match one process bit for bit."""
    run_dir, _ = online_run
    train(tmp_path / "fsdp", SCORER, "trainer=FSDPTrainer", "fsdp.strategy=fsdp2", "n_workers=2")
    sharded, single = (d / "rounds" / "0" / "pairs.jsonl" for d in (tmp_path / "fsdp", run_dir))
    assert sharded.read_bytes() == single.read_bytes()


def rank_worker(rank: int, world_size: int, port: int, runs: list) -> None:
    """train.py as one torchrun rank, for each (run_dir, args, fits) in turn; fits=False: fsdp.free_memory says 0,
    so sampling gathers per forward. What rank 0 prints goes to run_dir/stdout.txt."""
    import fsdp

    free_memory = fsdp.free_memory
    for k, (run_dir, args, fits) in enumerate(runs):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port + k), RANK=str(rank), LOCAL_RANK=str(rank))
        os.environ["WORLD_SIZE"] = str(world_size)
        fsdp.free_memory = free_memory if fits else lambda device: 0
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            code = train_py.main([*FAST, f"run_dir={run_dir}", *args])
        if rank == 0:
            Path(run_dir, "stdout.txt").write_text(f"exit {code}\n" + printed.getvalue())


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
def test_fsdp_sampling_gathered_once_writes_the_round_file_gathering_per_forward_writes(tmp_path, strategy):
    """Round 0 on 2 ranks with the policy gathered once for the round, and as before sharding.sampling (each forward
    gathering its units: the free memory made 0): the same bytes (#52 G4), the fallback said. FSDP1's sampling need
    not match one process's (its flat parameters compute otherwise, before this change too)."""
    args = [SCORER, "trainer=FSDPTrainer", f"fsdp.strategy={strategy}", "online.rounds=1", "eval_every=16"]
    args += ["do_first_eval=false", "sample_during_eval=false"]
    runs = [(str(tmp_path / "once"), args, True), (str(tmp_path / "per_forward"), args, False)]
    mp.spawn(rank_worker, args=(2, get_open_port(), runs), nprocs=2, join=True)
    once, per_forward = ((tmp_path / name / "stdout.txt").read_text() for name in ("once", "per_forward"))
    assert once.startswith("exit 0") and per_forward.startswith("exit 0"), (once[-2000:], per_forward[-2000:])
    assert "does not fit" not in once and "gathered whole" in per_forward and "does not fit in 75% of" in per_forward
    assert (
        pairs(tmp_path / "once", 0)
        and (tmp_path / "once" / "rounds" / "0" / "pairs.jsonl").read_bytes()
        == (tmp_path / "per_forward" / "rounds" / "0" / "pairs.jsonl").read_bytes()
    )


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


def test_spin_pairs_the_data_target_over_the_policy_sample_and_replays(tmp_path):
    """online.pairing=spin: each prompt's pair is its target (the toy rows' sft_target) over the policy's one sample;
    nothing is scored; the manifest records the rule and --replay makes the same pairs (#53 item 8)."""
    run_dir = tmp_path / "spin"
    result = train(run_dir, "online.pairing=spin", "online.samples_per_prompt=1", "online.rounds=1")
    assert "round 0: 16 pairs of 16 prompts; trains" in result.stdout  # no score, no gap
    rows = [json.loads(line) for line in (REPO / "toy" / "data" / "train.jsonl").read_text().splitlines()]
    target = {row["prompt"]: row["sft_target"] for row in rows}
    made = pairs(run_dir, 0)
    assert len(made) == 16 and all(p["chosen"] == target[p["prompt"]] != p["rejected"] for p in made)
    assert not any("scores" in p for p in made)  # no scorer ran
    manifest = json.loads((run_dir / "run_manifest.json").read_text())["online"]
    assert manifest["settings"]["pairing"] == "spin" and manifest["scorer"] is None
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert train_py.main(["--replay", str(run_dir), f"run_dir={tmp_path / 'replay'}"]) == 0
    assert "online rounds: 1 compared, identical pairs in every round" in out.getvalue()


def test_a_pairing_function_of_the_users_makes_the_pairs_and_is_recorded(tmp_path):
    """online.pairing=python=<module>:<function>: its (chosen, rejected) sample indices become the pairs, with their
    scores; the manifest keeps the function's module, name and source hash, and a replay warns where it changed. A
    function returning the wrong shape stops the run with exit 2, naming it."""
    run_dir = tmp_path / "rule"
    train(run_dir, SCORER, "online.pairing=python=test_online:first_over_last", "online.rounds=1")
    made = pairs(run_dir, 0)
    assert [p["prompt_index"] % 2 for p in made] == [0] * 8
    assert all(p["chosen_score"] == p["scores"][0] and p["rejected_score"] == p["scores"][-1] for p in made)
    manifest = json.loads((run_dir / "run_manifest.json").read_text())
    record = manifest["online"]["pairing"]
    assert (record["module"], record["function"], len(record["source_sha256"])) == (
        "test_online",
        "first_over_last",
        64,
    )
    record["source_sha256"] = "0" * 64  # as if the function had changed since: a replay says so, and still replays
    (run_dir / "run_manifest.json").write_text(json.dumps(manifest))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert train_py.main(["--replay", str(run_dir), f"run_dir={tmp_path / 'replay'}"]) == 0
    assert "warning: the online pairing differs from the recorded run's" in err.getvalue()
    assert "online rounds: 1 compared, identical pairs in every round" in out.getvalue()
    result = train(tmp_path / "bad", SCORER, "online.pairing=python=test_online:one_entry", "online.rounds=1", code=2)
    assert "online.pairing=python=test_online:one_entry: returned 1 entries; expected one entry per prompt (16)" in (
        result.stderr
    )


def test_pairing_settings_are_checked_before_anything_loads(tmp_path):
    bad = {
        ("online.pairing=spin",): "online.pairing=spin pairs each prompt's target with the policy's one sample",
        ("online.pairing=spin", "online.samples_per_prompt=1", "online.min_score_gap=1"): "online.min_score_gap=1.0",
        ("online.samples_per_prompt=1",): "online.pairing=best_worst pairs a prompt's best sample with its worst",
        ("online.pairing=python=test_online:first_over_last", "online.min_score_gap=1"): "not read with",
        ("online.pairing=worst",): "best_worst, spin or python=<module>:<function>",
    }
    for args, message in bad.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config([*FAST, *args])
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "a"}\n')  # no target for spin
    spin = ["online.pairing=spin", "online.samples_per_prompt=1", f"online.prompts={tmp_path / 'prompts.jsonl'}"]
    result = train(tmp_path / "run", *spin, code=2)
    assert "online.pairing=spin" in result.stderr and "has no target" in result.stderr


# --- Sampling under FSDP: gathered once (sharding.sampling), or per forward where it does not fit ---------------
def sampling_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Each strategy, the tiny model sharded over 2 ranks: shared_prefix_generate inside sharding.sampling, the whole
    model fitting (gathered once) and not (fsdp.free_memory says 0: gathered per forward); records the tokens, the
    forwards and the all-gathers FSDP issued (FSDP1: a handle's, FSDP2: a parameter group's)."""
    import fsdp
    from torch.distributed.fsdp._flat_param import FlatParamHandle
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    gathers = []

    def counted(gather):
        def counting(*args, **kwargs):
            gathers.append(1)
            return gather(*args, **kwargs)

        return counting

    FlatParamHandle._all_gather_flat_param = counted(FlatParamHandle._all_gather_flat_param)
    _fsdp_param_group.foreach_all_gather = counted(_fsdp_param_group.foreach_all_gather)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    results = {}
    free_memory = fsdp.free_memory  # the real one, put back for each strategy
    try:
        for strategy in ("fsdp", "fsdp2"):
            cfg = load_config([*FAST, "trainer=FSDPTrainer", f"fsdp.strategy={strategy}", "n_workers=2"])[0]
            _, policy, _ = train_py.load_models(cfg, on_meta=rank != 0)
            sharding, policy, _, _ = fsdp.spread(policy, None, cfg, rank, world_size)
            ids, mask = prompt_batch()
            forwards = []
            unwrap(policy).get_output_embeddings().register_forward_hook(lambda *_: forwards.append(1))
            for mode, free in (("gathered", free_memory), ("per forward", lambda device: 0)):
                fsdp.free_memory = free
                sharding.reshard(policy)  # nothing gathered before
                gathers.clear()
                forwards.clear()
                printed = io.StringIO()
                with contextlib.redirect_stdout(printed), sharding.sampling(policy), torch.random.fork_rng():
                    torch.manual_seed(7)
                    new = online.shared_prefix_generate(sharding, policy, ids, mask, 3, **SAMPLING)
                results[strategy, mode] = dict(
                    tokens=new, forwards=len(forwards), gathers=len(gathers), printed=printed.getvalue()
                )
            policy(input_ids=ids, attention_mask=mask)  # out of the context: each unit reshards after its forward
            results[strategy, "after"] = gathered_units(policy)
    finally:
        if rank == 0:
            torch.save(results, Path(out_dir) / "sampling.pt")
        dist.destroy_process_group()


SAMPLING = dict(max_new_tokens=6, temperature=1.0, top_p=1.0, pad_token_id=0)


def prompt_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Two left-padded toy prompts of different lengths."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(REPO / "toy" / "tiny-llama", padding_side="left")
    tokenizer.pad_token = tokenizer.eos_token
    batch = tokenizer(["Hi", "Tell me about cats and the sea."], return_tensors="pt", padding=True)
    return batch["input_ids"], batch["attention_mask"]


def test_fsdp_sampling_gathers_once_or_per_forward_and_samples_what_one_process_samples(tmp_path):
    """FSDP1 and FSDP2 on 2 gloo ranks (#52 G4): inside sharding.sampling every unit stays gathered from the first
    forward on (one all-gather per unit for the call, not one per generated token), all resharded on exit; where the
    model does not fit (the free-memory figure made 0) it says so and gathers per forward, as training does; both
    sample the same tokens (FSDP2: those one process samples from the same seed)."""
    mp.spawn(sampling_worker, args=(2, get_open_port(), str(tmp_path)), nprocs=2, join=True)
    results = torch.load(tmp_path / "sampling.pt", weights_only=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(REPO / "toy" / "tiny-llama").eval()
    ids, mask = prompt_batch()
    one = type("OneProcess", (), {"generate": staticmethod(lambda m, **kwargs: m.generate(**kwargs))})()
    with torch.random.fork_rng():
        torch.manual_seed(7)
        expected = online.shared_prefix_generate(one, model, ids, mask, 3, **SAMPLING)
    units = model.config.num_hidden_layers + 1  # each block a unit, and the root
    for strategy in ("fsdp", "fsdp2"):
        gathered, per_forward = results[strategy, "gathered"], results[strategy, "per forward"]
        assert torch.equal(gathered["tokens"], per_forward["tokens"]), strategy
        assert strategy == "fsdp" or torch.equal(gathered["tokens"], expected)  # FSDP1's flat parameters: otherwise
        assert gathered["forwards"] == per_forward["forwards"] >= 2  # the prefill, then one per generated token
        assert gathered["gathers"] == units, (strategy, gathered)
        every = per_forward["forwards"]  # each block's all-gather every forward; the root's once (FSDP1) or every time
        assert per_forward["gathers"] in (1 + (units - 1) * every, units * every), (strategy, per_forward)
        assert gathered["printed"] == "" and "does not fit" in per_forward["printed"], strategy
        assert results[strategy, "after"] <= 1  # the root (FSDP1 keeps it after a forward), no block
