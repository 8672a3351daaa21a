"""Score against KL over several runs, one curve per setting: the reward-KL frontier (the DPO paper's Figure 2 plots
reward against KL over beta), drawn from the files train.py writes into each run directory.

    python sweeps/plot_frontier.py .cache/runs --match 'sweep_loss.beta*' --out frontier.png
    python sweeps/plot_frontier.py RUN_DIR RUN_DIR ... --y samples/win_rate --annotate --out frontier.png

A RUN_DIR is a run (a folder holding config.yaml or metrics.jsonl) or a folder of runs: the runs directly under it whose
name matches --match (a glob; default *). Every run needs both files.

A point is one evaluation: x and y from the same metrics.jsonl record (step = training pairs seen); a run's points are
joined in step order. A value logged as null (non-finite) leaves its point out; a run with no point is left out, named.
A setting is the values of the config.yaml keys that differ between the plotted runs, leaving out where a run writes
and its seed (run_dir, exp_name, resume_from, local_dirs, fsdp_port, wandb.*, seed): runs that differ only in seed are
one setting, a line each in the setting's colour and one legend entry. The numbers plotted are printed first, as a
markdown table of setting, seed, step, x, y (for benchmarks/README.md).

matplotlib is optional (pip install matplotlib) and only this script needs it; without it the table is printed and the
script exits 2. Exit codes: 0 figure written; 2 bad input (a run without metrics.jsonl or config.yaml, a record that
is not JSON, a metric no run logs) or no matplotlib.
"""

import argparse
import json
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from config import flatten  # noqa: E402

# where a run writes and its seed: runs that differ only in these are one setting (wandb.* too)
NOT_A_SETTING = ("run_dir", "exp_name", "resume_from", "local_dirs", "fsdp_port", "seed")


class Refused(Exception):
    """Bad input; the message names the run directory, file or metric and what was expected."""


def find_runs(paths: list[str], match: str) -> list[Path]:
    """Each path a run, or a folder of runs (those directly under it named by the glob `match`)."""
    runs = []
    for path in map(Path, paths):
        if not path.is_dir():
            raise Refused(f"{path}: not a directory (expected a run directory or a folder of runs)")
        if (path / "config.yaml").is_file() or (path / "metrics.jsonl").is_file():
            runs.append(path)
            continue
        inside = [
            p for p in sorted(path.glob(match)) if (p / "config.yaml").is_file() or (p / "metrics.jsonl").is_file()
        ]
        if not inside:
            raise Refused(f"{path}: no metrics.jsonl in it, nor a run directly under it whose name matches {match!r}")
        runs += inside
    return list(dict.fromkeys(runs))  # a run named twice is plotted once


def read_run(run: Path) -> tuple[dict, list[dict]]:
    """The run's flat resolved config ({"loss.beta": 0.1, ...}) and its metrics.jsonl records."""
    for name in ("metrics.jsonl", "config.yaml"):
        if not (run / name).is_file():
            raise Refused(f"{run}: no {name} (train.py writes it into every run directory)")
    try:
        config = yaml.safe_load((run / "config.yaml").read_text())
    except yaml.YAMLError as e:
        raise Refused(f"{run / 'config.yaml'}: not YAML: {e}") from None
    if not isinstance(config, dict):
        raise Refused(f"{run / 'config.yaml'}: expected a mapping of config keys, got {type(config).__name__}")
    records = []
    for number, line in enumerate((run / "metrics.jsonl").read_text().splitlines(), start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise Refused(f"{run / 'metrics.jsonl'}:{number}: not JSON: {e}") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise Refused(f"{run / 'metrics.jsonl'}:{number}: expected an object with an integer step")
        records.append(record)
    return flatten(config), records


def points(records: list[dict], x: str, y: str) -> list[tuple[int, float, float]]:
    """(step, x, y) of the records that log both as numbers, in step order."""
    both = [r for r in records if isinstance(r.get(x), (int, float)) and isinstance(r.get(y), (int, float))]
    return sorted((r["step"], r[x], r[y]) for r in both)


def sort_key(value) -> tuple:
    """Numbers in numeric order, before anything else in text order: beta 0.01 < 0.03 < 0.1."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return (0, value, "") if number else (1, 0, str(value))


def settings_of(configs: dict[Path, dict]) -> tuple[list[str], dict[Path, str]]:
    """The config keys that differ between the runs, and each run's label: "loss.beta=0.1, lr=0.0001"."""
    keys = sorted({k for c in configs.values() for k in c if not k.startswith("wandb.") and k not in NOT_A_SETTING})
    differ = [k for k in keys if len({json.dumps(c.get(k), sort_keys=True) for c in configs.values()}) > 1]
    order = sorted(configs, key=lambda run: [sort_key(configs[run].get(k)) for k in differ])
    labels = {run: ", ".join(f"{k}={configs[run].get(k)}" for k in differ) or "all runs" for run in order}
    return differ, labels


def table(rows: list[tuple], x: str, y: str) -> str:
    lines = [f"| setting | seed | step | {x} | {y} |", "|---|---|---|---|---|"]
    lines += [f"| {label} | {seed} | {step} | {kx:.4g} | {ky:.4g} |" for label, seed, step, kx, ky in rows]
    return "\n".join(lines)


def draw(curves: dict[str, list[list[tuple]]], args) -> None:
    """One colour per setting (in the settings' order), a line per run, markers at its evaluations."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    colours = matplotlib.colormaps["viridis"]
    fig, ax = plt.subplots(figsize=(7, 5))
    for i, (label, runs) in enumerate(curves.items()):
        colour = colours(0.9 * i / max(len(curves) - 1, 1))  # the top of viridis, yellow, is unreadable on white
        for j, run in enumerate(runs):
            steps, xs, ys = zip(*run)
            ax.plot(xs, ys, marker="o", color=colour, label=label if j == 0 else "_nolegend_")
            for step, px, py in run if args.annotate else []:
                ax.annotate(str(step), (px, py), textcoords="offset points", xytext=(4, 4), fontsize=7, color=colour)
    ax.set_xlabel(args.x)
    ax.set_ylabel(args.y)
    ax.set_title(f"{args.y} against {args.x}, a point per evaluation" + (" (labels: step)" if args.annotate else ""))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(args.out, dpi=150)
    except ValueError as e:  # an unknown suffix: matplotlib picks the format by it
        raise Refused(f"--out {args.out}: {e}") from None
    plt.close(fig)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python sweeps/plot_frontier.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a run directory or a folder of runs")
    parser.add_argument(
        "--out", type=Path, required=True, metavar="FILE", help="the figure: .png (or .pdf, .svg: by its suffix)"
    )
    parser.add_argument(
        "--x", default="samples/kl", metavar="METRIC", help="metric on the x axis (default: %(default)s)"
    )
    parser.add_argument(
        "--y", default="samples/policy_score", metavar="METRIC", help="metric on the y axis (default: %(default)s)"
    )
    parser.add_argument(
        "--match", default="*", metavar="GLOB", help="glob of run names inside a folder of runs (default: %(default)s)"
    )
    parser.add_argument("--annotate", action="store_true", help="label each point with its step")
    args = parser.parse_args(argv)
    try:
        runs = {run: read_run(run) for run in find_runs(args.run_dirs, args.match)}
        for metric in (args.x, args.y):
            if not any(metric in r for _, records in runs.values() for r in records):
                names = ", ".join(map(str, runs))
                raise Refused(f"{metric}: logged by none of the runs (no metrics.jsonl record has it): {names}")
        plotted = {run: points(records, args.x, args.y) for run, (_, records) in runs.items()}
        for run in [run for run, p in plotted.items() if not p]:
            print(
                f"left out: {run}: no metrics.jsonl record with numbers for both {args.x} and {args.y}", file=sys.stderr
            )
            del plotted[run]
        if not plotted:
            raise Refused(f"{args.x}, {args.y}: no run logs both in one record: {', '.join(map(str, runs))}")
    except Refused as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    differ, labels = settings_of({run: runs[run][0] for run in plotted})
    curves = {}  # setting -> its runs' points
    for run, label in labels.items():
        curves.setdefault(label, []).append(plotted[run])
    rows = [(label, runs[run][0].get("seed"), *point) for run, label in labels.items() for point in plotted[run]]
    print(table(rows, args.x, args.y))
    try:
        draw(curves, args)
    except ImportError as e:
        print(f"error: drawing needs matplotlib ({e}): pip install matplotlib", file=sys.stderr)
        return 2
    except Refused as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    keys = ", ".join(differ) or "no config key differs"
    print(f"wrote {args.out}: {len(rows)} points, {len(plotted)} runs, {len(curves)} settings ({keys})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
