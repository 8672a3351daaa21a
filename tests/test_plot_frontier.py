"""sweeps/plot_frontier.py as a user runs it, on runs written by train.py's own writers (config.yaml by config_loader.to_yaml,
metrics.jsonl by trainers.RunLog): the figure, the table of its numbers, one setting per differing config key, and
bad input refused with exit 2 naming the run directory or the metric, with no matplotlib needed for those."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from config_loader import load_config, to_yaml
from trainers import RunLog

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "sweeps" / "plot_frontier.py"
STEPS = (0, 8, 16)


def kl(beta: float, seed: int, step: int) -> float:
    """A made-up frontier: a smaller beta drifts further; seed 1 a little further than seed 0."""
    return step * (1 + seed / 4) / (8 * beta)


def score(beta: float, seed: int, step: int) -> float:
    return 0.5 + step * (1 + seed) / (64 * (1 + beta))


def write_run(run_dir: Path, beta: float, seed: int = 0, nan_at: int | None = None) -> Path:
    """A DPO run's config.yaml and metrics.jsonl: a training record and an evaluation record per step in STEPS."""
    cfg, _ = load_config(["loss=dpo", f"loss.beta={beta}", f"seed={seed}", f"run_dir={run_dir}", "wandb.enabled=false"])
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    log = RunLog(run_dir, 0, cfg)
    for step in STEPS:
        log(step, {"loss/train": 0.69, "rewards_train/accuracies": 0.5})  # no sample metrics: not a point
        samples = {"samples/kl": math.nan if step == nan_at else kl(beta, seed, step), "samples/win_rate": 0.5 + beta}
        log(step, {"loss/eval": 0.6, "samples/policy_score": score(beta, seed, step), **samples})
    return run_dir


def plot(*args, no_matplotlib: Path | None = None) -> subprocess.CompletedProcess:
    """The script in a fresh process; no_matplotlib: a folder whose matplotlib package fails to import, put first on
    the path, so the run sees what a machine without matplotlib would."""
    env = {"PYTHONPATH": str(no_matplotlib)} if no_matplotlib else {}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        cwd=REPO,
    )


@pytest.fixture
def no_matplotlib(tmp_path) -> Path:
    folder = tmp_path / "no_matplotlib"
    (folder / "matplotlib").mkdir(parents=True)
    (folder / "matplotlib" / "__init__.py").write_text("raise ImportError('no matplotlib here (the test hides it)')\n")
    return folder


@pytest.fixture
def sweep(tmp_path) -> Path:
    """A sweep's folder of runs: beta 0.01, 0.1 (two seeds) and 1.0, and an SFT run its glob does not name."""
    runs = tmp_path / "runs"
    for beta in (1.0, 0.01, 0.1):
        write_run(runs / f"sweep_loss.beta{beta}_0", beta)
    write_run(runs / "sweep_loss.beta0.1_1", 0.1, seed=1)
    write_run(runs / "sft", 0.5)
    return runs


def rows(out: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in out.splitlines() if line.startswith("| ")]


def test_the_figure_and_its_table_one_setting_per_beta(sweep, tmp_path):
    image = pytest.importorskip("matplotlib.image")
    out = tmp_path / "figs" / "frontier.png"
    done = plot(sweep, "--match", "sweep_loss.beta*", "--annotate", "--out", out)
    assert done.returncode == 0, done.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width = image.imread(out).shape[:2]
    assert height > 0 and width > 0
    table = rows(done.stdout)
    assert table[0] == ["setting", "seed", "step", "samples/kl", "samples/policy_score"]
    expected = [
        [f"loss.beta={beta}", str(seed), str(step), f"{kl(beta, seed, step):.4g}", f"{score(beta, seed, step):.4g}"]
        for beta, seed in ((0.01, 0), (0.1, 0), (0.1, 1), (1.0, 0))  # settings in beta's numeric order, steps in order
        for step in STEPS
    ]
    assert table[1:] == expected  # the sft run (not matched) is not in it; seed and run_dir are not settings
    assert f"wrote {out}: 12 points, 4 runs, 3 settings (loss.beta)" in done.stdout


def test_any_logged_metric_on_y_and_runs_named_one_by_one(tmp_path):
    pytest.importorskip("matplotlib")
    a = write_run(tmp_path / "a", 0.1)
    b = write_run(tmp_path / "b", 0.3, nan_at=8)  # a non-finite kl is logged as null: that point is left out
    done = plot(a, b, "--y", "samples/win_rate", "--out", tmp_path / "win.png")
    assert done.returncode == 0, done.stderr
    table = rows(done.stdout)
    assert table[0][3:] == ["samples/kl", "samples/win_rate"]
    assert [r[0] for r in table[1:]] == ["loss.beta=0.1"] * 3 + ["loss.beta=0.3"] * 2
    assert [r[2] for r in table[1:]] == ["0", "8", "16", "0", "16"]
    assert table[2][4] == "0.6"


def test_without_matplotlib_the_table_then_exit_2_naming_the_install(sweep, tmp_path, no_matplotlib):
    done = plot(sweep, "--match", "sweep_loss.beta*", "--out", tmp_path / "f.png", no_matplotlib=no_matplotlib)
    assert done.returncode == 2
    assert "pip install matplotlib" in done.stderr
    assert len(rows(done.stdout)) == 1 + 12 and not (tmp_path / "f.png").exists()


def test_a_run_without_metrics_jsonl_is_refused_by_name(sweep, tmp_path, no_matplotlib):
    (sweep / "sweep_loss.beta1.0_0" / "metrics.jsonl").unlink()
    done = plot(sweep, "--match", "sweep_loss.beta*", "--out", tmp_path / "f.png", no_matplotlib=no_matplotlib)
    assert done.returncode == 2 and done.stdout == ""
    assert f"{sweep / 'sweep_loss.beta1.0_0'}: no metrics.jsonl" in done.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    done = plot(empty, "--out", tmp_path / "f.png", no_matplotlib=no_matplotlib)
    assert done.returncode == 2 and f"{empty}: no metrics.jsonl in it" in done.stderr


def test_a_metric_no_run_logs_is_refused_naming_it_and_the_runs(sweep, tmp_path, no_matplotlib):
    a, b = sweep / "sweep_loss.beta0.01_0", sweep / "sweep_loss.beta1.0_0"
    done = plot(a, b, "--y", "samples/policy_scor", "--out", tmp_path / "f.png", no_matplotlib=no_matplotlib)
    assert done.returncode == 2 and done.stdout == ""
    assert f"samples/policy_scor: logged by none of the runs (no metrics.jsonl record has it): {a}, {b}" in done.stderr


def test_a_record_that_is_not_json_is_refused_by_file_and_line(sweep, tmp_path, no_matplotlib):
    metrics = sweep / "sft" / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"step": 24, "loss/train": 0.6\n')  # a line cut short
    done = plot(sweep / "sft", "--out", tmp_path / "f.png", no_matplotlib=no_matplotlib)
    assert done.returncode == 2 and f"{metrics}:{2 * len(STEPS) + 1}: not JSON" in done.stderr


def test_help_exits_0_without_matplotlib(no_matplotlib):
    done = plot("--help", no_matplotlib=no_matplotlib)
    assert done.returncode == 0 and "RUN_DIR" in done.stdout and "--match" in done.stdout


def test_the_frontier_sweep_resolves_with_several_evaluations_per_run():
    """sweeps/dpo_beta_frontier.yaml's command at every beta passes train.py's loader (as run_grid.py loads it), and
    each run evaluates at step 0 and at least four times more: five points of its curve. eval_scorer is left out here:
    the trainer's key, which its own tests check."""
    sweep = yaml.safe_load((REPO / "sweeps" / "dpo_beta_frontier.yaml").read_text())
    fixed = [a for a in sweep["command"] if not str(a).startswith("${") and a not in ("python", "-u")]
    assert "eval_scorer=rule" in fixed and sweep["metric"] == {"name": "samples/win_rate", "goal": "maximize"}
    for beta in sweep["parameters"]["loss.beta"]["values"]:
        cfg, _ = load_config([a for a in fixed if a != "eval_scorer=rule"] + [f"loss.beta={beta}"])
        assert cfg.loss.name == "dpo" and cfg.loss.beta == beta and cfg.do_first_eval
        assert cfg.n_examples // cfg.eval_every >= 4 and cfg.n_examples % cfg.eval_every == 0
