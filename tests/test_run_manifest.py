"""run_dir/run_manifest.json and `train.py --replay`: written at the start, checked on resume, a replay that matches."""

import contextlib
import io
import json
import subprocess

import pytest
import torch

import config
import preference_datasets as data
import run_manifest
from test_train import REPO, metrics, train, train_py

SFT = ["loss=sft", "n_examples=16", "eval_every=8"]  # default logging: every step, whatever the clock


def test_manifest_written_and_resume_refuses_on_data_drift_warns_on_code_drift(tmp_path):
    """A run on a local copy of the toy data; then its train file changes by one line: the resume refuses (exit 2)
    before anything is loaded or written. With the data restored and the recorded commit altered, it warns and runs."""
    for split in ("train", "test"):
        lines = (REPO / "toy" / "data" / f"{split}.jsonl").read_text().splitlines()[:64]
        (tmp_path / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    source = str(tmp_path / "{split}.jsonl")
    run_dir = tmp_path / "run"
    train(run_dir, *SFT, f"datasets=[{source}]")

    manifest = json.loads((run_dir / "run_manifest.json").read_text())
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert manifest["code"]["commit"] == head and isinstance(manifest["code"]["dirty"], bool)
    diff = subprocess.run(["git", "-C", str(REPO), "diff", "HEAD"], capture_output=True, text=True).stdout
    assert (run_dir / "run_manifest.diff").exists() == bool(diff)  # the uncommitted changes, saved beside it
    assert manifest["versions"]["torch"] == torch.__version__ and manifest["world_size"] == 1
    assert manifest["device"]["type"] == "cpu" and manifest["config"]["datasets"] == [source]
    assert set(manifest["data"]) == {"train", "test"} and all(len(fp[source]) == 64 for fp in manifest["data"].values())
    assert (run_dir / "step-8" / "manifest.json").exists()  # the checkpoint's own manifest is another file

    # data drift: one changed line of the train split
    original = (tmp_path / "train.jsonl").read_text()
    rows = original.splitlines()
    rows[3] = rows[3].replace("Question", "Query")
    (tmp_path / "train.jsonl").write_text("\n".join(rows) + "\n")
    before = {p.name: p.stat().st_mtime_ns for p in run_dir.iterdir()}
    result = train(run_dir, *SFT, f"datasets=[{source}]", f"resume_from={run_dir}", check=False)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "cannot resume: the tokenized data differs" in result.stderr and f"train/{source}" in result.stderr
    assert f"test/{source}" not in result.stderr  # the test split did not change
    assert "loading policy" not in result.stdout  # refused before any model was loaded
    assert {p.name: p.stat().st_mtime_ns for p in run_dir.iterdir()} == before  # nothing written or overwritten

    # same data, other code: a warning, and the resume runs
    (tmp_path / "train.jsonl").write_text(original)
    manifest["code"]["commit"] = "0" * 40
    (run_dir / "run_manifest.json").write_text(json.dumps(manifest))
    result = train(run_dir, *SFT, f"datasets=[{source}]", f"resume_from={run_dir}")
    assert "warning: the code differs" in result.stderr and "resumed from" in result.stdout
    assert json.loads((run_dir / "run_manifest.json").read_text())["code"]["commit"] == "0" * 40  # kept, not rewritten


def test_replay_of_the_toy_sft_run_matches_exactly(tmp_path):
    original, replay = tmp_path / "run", tmp_path / "replay"
    train(original, *SFT)
    assert train_py.main(["--replay", str(original), "lr=1.0"]) == 2  # a replay cannot change what it repeats
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = train_py.main(["--replay", str(original), f"run_dir={replay}"])
    assert code == 0, out.getvalue()[-2000:] + err.getvalue()[-2000:]
    assert "replay identical" in out.getvalue() and "loss/train" in out.getvalue()
    # a step cadence, not the clock: both steps logged in both runs, and the table says so (before:
    # records at most once a second, so `replay identical` could rest on a few of the steps)
    assert [r["step"] for r in metrics(original) if "loss/train" in r] == [8, 16]
    assert "compared 2 training steps (0 in one run only) and 3 evaluations (0 in one run only)" in out.getvalue()
    differences = run_manifest.metric_differences(original, replay)
    exact = {name: v for name, v in differences.items() if not name.startswith(run_manifest.TIMING)}
    assert {"loss/train", "loss/eval", "grad_norm", "logps_train/chosen"} <= set(exact)
    assert all(d == 0.0 and compared > 0 and only == 0 for d, compared, only in exact.values()), exact
    assert len(metrics(replay)) == len(metrics(original))
    assert (
        json.loads((replay / "run_manifest.json").read_text())["data"]
        == json.loads((original / "run_manifest.json").read_text())["data"]
    )

    # a step one run logged and the other did not (another log_every_steps) is counted apart, not a difference
    records = metrics(original)
    dropped = next(i for i, r in enumerate(records) if "loss/train" in r)
    (original / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for i, r in enumerate(records) if i != dropped)
    )
    table = run_manifest.report(original, replay)
    assert "replay identical" in table and "replay differs" not in table, table

    # --replay with --cfg checks and prints the recorded config, and runs nothing (before: the whole replay ran)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert train_py.main(["--replay", str(original), f"run_dir={tmp_path / 'not_run'}", "--cfg"]) == 0
    assert "loss:" in out.getvalue() and not (tmp_path / "not_run").exists()
    cfg, _ = run_manifest.replay_config(original, ["exp_name=null", "wandb.project=007"])  # typed as on a command line
    assert cfg.exp_name is None and cfg.wandb.project == "007"
    # a hand-edited config.yaml of the wrong type: ConfigError naming the key, not a TypeError from the rules
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.yaml").write_text((original / "config.yaml").read_text().replace("batch_size: ", "batch_size: x"))
    with pytest.raises(config.ConfigError, match="batch_size"):
        run_manifest.replay_config(broken, [])

    # the comparison can fail: one altered value of the original shows up as that metric's difference
    first = next(r for r in records if "loss/train" in r)
    first["loss/train"] += 0.5
    (original / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert "replay differs in 1 metric(s): loss/train" in run_manifest.report(original, replay)
    assert abs(run_manifest.metric_differences(original, replay)["loss/train"][0] - 0.5) < 1e-9


def test_data_fingerprint_is_the_cache_key_of_what_tokenization_depends_on(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(REPO / "toy" / "tiny-llama")
    keys = lambda **kw: data.load_tokenized(["toy"], tokenizer, "train", max_prompt_length=32, **kw).keys
    a = keys(max_length=64)
    assert a == keys(max_length=64) and a != keys(max_length=65) and a != keys(max_length=64, sft_mode=True)
