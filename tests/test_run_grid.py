"""sweeps/run_grid.py on a real 2-point grid of the toy task: results are reused only for the same resolved config,
a changed command runs again into a folder of its own, and a run stopped before its end is resumed."""

import contextlib
import io
import json
import shutil
import subprocess
import sys
import types
from pathlib import Path

import yaml

import train as train_py

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


def test_a_point_is_reused_only_for_its_resolved_config_and_an_unfinished_one_resumes(tmp_path, monkeypatch, capsys):
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump(SWEEP))
    runs, local = [], f"local_dirs=[{tmp_path / 'cache'}]"

    def run_in_process(cmd, **_):  # train.py's main without a subprocess (its imports cost ~10 s each)
        runs.append(cmd[3:])
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return subprocess.CompletedProcess(cmd, train_py.main(cmd[3:]))

    monkeypatch.setattr(run_grid, "subprocess", types.SimpleNamespace(run=run_in_process))  # run_grid's alone

    def grid(*extra) -> str:
        runs.clear()
        assert run_grid.main(str(sweep), [local, *extra]) == 0
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
    assert ["loss.beta=0.1", str(evals(dirs[0])[16])] in [line.split() for line in out.splitlines()]  # new table
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
