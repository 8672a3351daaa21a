"""sweeps/run_grid.py on real 2-point grids of the toy task: results are reused only for the same resolved config,
a changed command runs again into a folder of its own, a run stopped before its end is resumed; the table gives a rate
over samples with its counts and standard error and marks the points the data cannot tell from the best; --help and
bad arguments answer as a command line should."""

import contextlib
import copy
import io
import json
import math
import shutil
import subprocess
import sys
import types
from pathlib import Path

import yaml

import train as train_py
from sources import sample_rule

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "sweeps"))
import run_grid  # noqa: E402

SWEEP = {
    "program": "train.py",
    "method": "grid",
    "metric": {"name": "loss/eval", "goal": "minimize"},
    "parameters": {"loss.beta": {"values": [0.1, 0.2]}},
    "command": [
        "${env}",
        "python",
        "-u",
        "${program}",
        "loss=dpo",
        "model=tiny",
        "datasets=[toy]",
        "optimizer=AdamW",
        "warmup_steps=0",
        "n_epochs=null",
        "n_examples=8",
        "batch_size=4",
        "eval_every=8",
        "do_first_eval=false",
        "eval_batch_size=8",
        "n_eval_examples=8",
        "n_eval_model_samples=0",
        "max_length=64",
        "max_prompt_length=32",
        "fsdp.use_torch_compile=false",
        "${args}",
    ],
}


def in_process(monkeypatch) -> list[list[str]]:
    """run_grid's train.py runs in this process (its imports cost ~10 s a subprocess); returns their arguments."""
    runs = []

    def run_in_process(cmd, **_):
        runs.append(cmd[3:])
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return subprocess.CompletedProcess(cmd, train_py.main(cmd[3:]))

    monkeypatch.setattr(run_grid, "subprocess", types.SimpleNamespace(run=run_in_process))  # run_grid's alone
    return runs


def test_a_point_is_reused_only_for_its_resolved_config_and_an_unfinished_one_resumes(tmp_path, monkeypatch, capsys):
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump(SWEEP))
    runs, local = in_process(monkeypatch), f"local_dirs=[{tmp_path / 'cache'}]"

    def grid(*extra) -> str:
        runs.clear()
        assert run_grid.main([str(sweep), local, *extra]) == 0
        return capsys.readouterr().out

    def evals(run_dir) -> dict[int, float]:  # step -> loss/eval
        records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        return {r["step"]: r["loss/eval"] for r in records if "loss/eval" in r}

    grid()  # the smoke run: 8 pairs a point
    assert len(runs) == 2
    out = grid()
    assert runs == [] and out.count("reused: loss.beta=") == 2 and "equals this command's resolved config" in out
    out = grid("n_examples=16")  # the real grid: not the smoke run's table
    assert len(runs) == 2 and out.count("n_examples: 8 -> 16") == 2
    dirs = sorted(
        p
        for p in (tmp_path / "cache" / "runs").iterdir()
        if yaml.safe_load((p / "config.yaml").read_text())["n_examples"] == 16
    )  # beta 0.1, 0.2
    assert len(dirs) == 2 and all(list(evals(d)) == [8, 16] for d in dirs)
    assert ["loss.beta=0.1", f"{evals(dirs[0])[16]:.4g}", "-", "-"] in [line.split() for line in out.splitlines()]
    assert "loss/eval: no counts in samples.jsonl where '-', so no standard error known: ranked by value alone" in out
    for d in dirs:  # as a SIGKILL leaves them: beta 0.1 after its step-8 checkpoint, beta 0.2 before its first
        (d / run_grid.FINISHED).unlink()
        (d / "LATEST").unlink()
    (dirs[0] / "LATEST").symlink_to("step-8")
    for step in dirs[1].glob("step-*"):
        shutil.rmtree(step)
    out = grid("n_examples=16")
    assert runs[0][-1] == f"resume_from={dirs[0]}" and f"resuming: loss.beta=0.1: {dirs[0]} stopped at step-8" in out
    assert "resume_from" not in runs[1][-1] and f"restarting: loss.beta=0.2: {dirs[1]}" in out
    assert all(list(evals(d)) == [8, 16] and (d / run_grid.FINISHED).is_file() for d in dirs)  # no record twice


def test_a_rate_over_samples_shows_k_of_n_its_standard_error_and_the_points_tied_with_the_best(
    tmp_path, monkeypatch, capsys
):
    """A real 2-point grid sampling 8 answers a point: each row's k of n are the answers in samples.jsonl that follow
    the toy rule at the last evaluation, with sqrt(p (1 - p) / n). Then the last evaluations are rewritten in train.py's
    format to 32 samples each: 32 of 32 against 16 of 32 is 'worse' (difference 0.5; pooled rate 0.75, 2 pooled
    standard errors 2 sqrt(0.75 * 0.25 * 2/32) = 0.22), 30 of 32 against 32 of 32 a 'tie' (difference 0.0625; pooled
    rate 62/64, 2 standard errors 0.087)."""
    sweep = copy.deepcopy(SWEEP)
    sweep["metric"] = {"name": "samples/policy_rule_rate", "goal": "maximize"}
    sweep["command"][sweep["command"].index("n_eval_model_samples=0")] = "n_eval_model_samples=8"
    sweep["command"].insert(-1, "max_new_tokens=8")
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(sweep))
    runs, local, follows = in_process(monkeypatch), f"local_dirs=[{tmp_path / 'cache'}]", sample_rule(["toy"])

    def table() -> dict[str, list[str]]:  # point -> its row's words after the point
        runs.clear()
        assert run_grid.main([str(tmp_path / "sweep.yaml"), local]) == 0
        out = capsys.readouterr().out
        assert "samples/policy_rule_rate (maximize), each run's last evaluation, best first:" in out
        assert "point value k of n standard error versus the best" in " ".join(out.split())
        return {
            words[0]: words[1:]
            for words in map(str.split, out.splitlines())
            if words[:1] in (["loss.beta=0.1"], ["loss.beta=0.2"])
        }

    rows = table()
    assert len(runs) == 2
    dirs = {f"loss.beta={b}": next((tmp_path / "cache" / "runs").glob(f"sweep_loss.beta{b}_*")) for b in (0.1, 0.2)}
    for point, run_dir in dirs.items():  # counted here from samples.jsonl, by the toy rule itself
        answers = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
        answers = [a["policy"] for a in answers if a["step"] == 8]
        k, n = sum(map(follows, answers)), len(answers)
        assert n == 8 and rows[point][1:4] == [str(k), "of", "8"]
        assert rows[point][0] == f"{k / n:.4g}" and rows[point][4] == f"{math.sqrt(k / n * (1 - k / n) / n):.3f}"

    def rewrite(run_dir, k: int, n: int) -> None:  # the last evaluation: n answers, k of them calm, its rate k / n
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        records[-1]["samples/policy_rule_rate"] = k / n
        answers = [
            {"step": 8, "prompt": f"Q{i}", "policy": "calm." if i < k else "LOUD.", "reference": "x"} for i in range(n)
        ]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        (run_dir / "samples.jsonl").write_text("".join(json.dumps(a) + "\n" for a in answers))

    rewrite(dirs["loss.beta=0.1"], 16, 32)
    rewrite(dirs["loss.beta=0.2"], 32, 32)
    rows = table()
    assert runs == [] and rows["loss.beta=0.2"] == ["1", "32", "of", "32", "0.000", "best"]
    assert rows["loss.beta=0.1"] == ["0.5", "16", "of", "32", "0.088", "worse"]
    rewrite(dirs["loss.beta=0.1"], 30, 32)
    assert table()["loss.beta=0.1"] == ["0.9375", "30", "of", "32", "0.043", "tie"]


def test_help_exits_0_and_bad_arguments_exit_2_with_a_message(tmp_path):
    def grid(*args) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(REPO / "sweeps" / "run_grid.py"), *args], capture_output=True, text=True
        )

    done = grid("--help")
    assert done.returncode == 0 and done.stdout.startswith(
        "usage: python sweeps/run_grid.py [-h] sweep [key=value ...]"
    )
    assert "binomial standard error" in done.stdout
    done = grid()
    assert done.returncode == 2 and "error: the following arguments are required: sweep" in done.stderr
    done = grid(str(tmp_path / "missing.yaml"))
    assert done.returncode == 2 and f"{tmp_path / 'missing.yaml'}: cannot read a sweep file" in done.stderr
    (tmp_path / "random.yaml").write_text(yaml.safe_dump({**SWEEP, "method": "random"}))
    done = grid(str(tmp_path / "random.yaml"))
    assert done.returncode == 2 and "method='random'; this runner runs grid sweeps only" in done.stderr
