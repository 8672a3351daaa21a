"""Run a W&B grid sweep file offline: every grid point as a plain train.py run (W&B off), then a table of the
sweep's target metric (its last logged value in each run's metrics.jsonl), best first.

    python sweeps/run_grid.py sweeps/dpo_beta_lr.yaml [extra key=value ...]

A rate over sampled answers (samples/<who>_rule_rate) comes with its counts from the run's samples.jsonl: k of n
answers follow the rule at that evaluation, and the binomial standard error sqrt(p (1 - p) / n). A point is a tie
with the best when a two-proportion z-test cannot tell them apart: the difference of the two rates is within 2 of
its standard errors, sqrt(q (1 - q) (1/n1 + 1/n2)) with q the pooled rate (about a 5% two-sided test; the best is
the best of many points, so a tie is the honest reading, a "worse" one a hint). Any other metric has no standard
error known here and is ranked by its value alone.

The sweep file stays the one source of truth: its fixed command arguments, its grid and its metric. A point runs into
<local_dirs[0]>/runs/sweep_<point>_<hash of its resolved config>. Its results are reused only when that run finished
and its config.yaml (the resolved config train.py wrote) equals this command's, run_dir aside; a run stopped before
its end is resumed from its last checkpoint, one stopped before its first checkpoint starts again. The code and the
contents of model.archive are not part of the config: after changing either, delete the old runs.
"""

import argparse
import hashlib
import itertools
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from config import ConfigError  # noqa: E402
from config import flatten  # noqa: E402
from config_loader import load_config, to_yaml  # noqa: E402

FINISHED = "FINISHED"  # written when train.py exits 0, i.e. ran to its end (an interrupted run exits 130 or 143)


def without_run_dir(tree: dict) -> dict:
    """The flat config, run_dir left out: the folder is named after the rest, so run_dir cannot be in it."""
    return {k: v for k, v in flatten(tree).items() if k != "run_dir"}


def saved_config(run_dir: Path) -> dict | None:
    """What train.py wrote as the run's resolved config, None if it wrote nothing."""
    file = run_dir / "config.yaml"
    return without_run_dir(yaml.safe_load(file.read_text()) or {}) if file.is_file() else None


def differences(old: dict, new: dict) -> str:
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    return ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys)


def read_sweep(path: str) -> dict:
    """The sweep file, or a ValueError naming what is wrong with it."""
    try:
        sweep = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"{path}: cannot read a sweep file: {e}") from None
    keys = {"program": str, "method": str, "metric": dict, "parameters": dict, "command": list}
    wrong = [k for k, kind in keys.items() if not isinstance(sweep, dict) or not isinstance(sweep.get(k), kind)]
    if wrong:
        raise ValueError(f"{path}: expected a W&B sweep file with {', '.join(keys)}; missing or mistyped: {wrong}")
    if sweep["method"] != "grid":
        raise ValueError(f"{path}: method={sweep['method']!r}; this runner runs grid sweeps only")
    if "name" not in sweep["metric"] or sweep["metric"].get("goal") not in ("maximize", "minimize"):
        raise ValueError(f"{path}: metric: expected a name and goal: maximize or minimize, got {sweep['metric']}")
    for name, values in sweep["parameters"].items():
        if not isinstance(values, dict) or not isinstance(values.get("values"), list):
            raise ValueError(f"{path}: parameters.{name}: expected values: [...] (a grid), got {values}")
    return sweep


def counts(run_dir: Path, metric: str, step: int, rate: float | None) -> tuple[int, int] | None:
    """(k, n) behind a rate over sampled answers: n answers of <who> in samples.jsonl at `step`, k = rate * n of
    them follow the rule. None for a metric that is not such a rate (no counts, so no standard error)."""
    who, file = re.fullmatch(r"samples/(\w+)_rule_rate", metric), run_dir / "samples.jsonl"
    if who is None or rate is None or not file.is_file():
        return None
    records = map(json.loads, file.read_text().splitlines())
    n = sum(r["step"] == step and r.get(who[1]) is not None for r in records)
    if n == 0 or abs(rate * n - round(rate * n)) > 1e-6:  # the rate was computed as k / n over these records
        raise SystemExit(f"{file}: {metric}={rate} at step {step} is no count over its {n} samples of {who[1]}")
    return round(rate * n), n


def tied(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Whether k of n counts a and b cannot be told apart: |difference of rates| <= 2 pooled standard errors."""
    (k1, n1), (k2, n2) = a, b
    q = (k1 + k2) / (n1 + n2)
    return abs(k1 / n1 - k2 / n2) <= 2 * math.sqrt(q * (1 - q) * (1 / n1 + 1 / n2))


def print_table(metric: str, goal: str, rows: list[tuple[str, float | None, tuple[int, int] | None]]) -> None:
    """rows: (point, value, counts or None), printed best first with k of n, standard error and tie marks."""
    sign = -1 if goal == "maximize" else 1
    rows = sorted(rows, key=lambda r: (r[1] is None, sign * (r[1] or 0)))
    best = rows[0][2]
    print(f"\n{metric} ({goal}), each run's last evaluation, best first:")
    print(f"  {'point':40s} {'value':>8s} {'k of n':>12s} {'standard error':>15s}  versus the best")
    for i, (point, value, c) in enumerate(rows):
        shown = "not logged" if value is None else f"{value:.4g}"
        k_of_n = f"{c[0]} of {c[1]}" if c else "-"
        se = f"{math.sqrt(value * (1 - value) / c[1]):.3f}" if c else "-"
        versus = "best" if i == 0 else ""  # stays "" without counts to compare
        if i > 0 and c and best:
            versus = "tie" if tied(best, c) else "worse"
        print(f"  {point:40s} {shown:>8s} {k_of_n:>12s} {se:>15s}  {versus}")
    if best:
        ties = sum(c is not None and tied(best, c) for _, _, c in rows[1:])
        print(
            f"tie: {ties} of {len(rows) - 1} other points cannot be told apart from the best (difference of rates "
            "within 2 pooled standard errors); worse: told apart"
        )
    if not all(c for _, _, c in rows):
        print(f"{metric}: no counts in samples.jsonl where '-', so no standard error known: ranked by value alone")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python sweeps/run_grid.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("sweep", help="a W&B sweep file with method: grid, e.g. sweeps/dpo_beta_lr.yaml")
    parser.add_argument(
        "extra", nargs="*", default=[], metavar="key=value", help="train.py arguments for every point, last"
    )
    options = parser.parse_args(argv)
    try:
        sweep = read_sweep(options.sweep)
    except ValueError as e:
        parser.error(str(e))  # exits 2, as for a missing argument
    fixed = [a for a in sweep["command"] if not str(a).startswith("${") and a not in ("python", "-u")]
    names = list(sweep["parameters"])
    metric = sweep["metric"]["name"]
    rows = []
    for values in itertools.product(*(sweep["parameters"][n]["values"] for n in names)):
        point = [f"{n}={v}" for n, v in zip(names, values)]
        at = " ".join(point)
        args = [*fixed, *point, "wandb.enabled=false", *options.extra]
        try:  # train.py's own loader: the config it will write, every default and derived value included
            cfg, _ = load_config(args)
        except ConfigError as e:
            raise SystemExit(f"error: {at}: {e}") from None
        config = without_run_dir(yaml.safe_load(to_yaml(cfg)))  # through YAML, as config.yaml is read back
        name, runs = "sweep_" + "_".join(f"{n}{v}" for n, v in zip(names, values)), REPO / cfg.local_dirs[0] / "runs"
        run_dir = runs / f"{name}_{hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:8]}"
        for other in sorted(runs.glob(name + "*")):  # this point's runs under other configs: say why they are not used
            ours = re.fullmatch(re.escape(name) + r"(_[0-9a-f]{8})?", other.name)  # not another point's longer name
            if other != run_dir and ours and (old := saved_config(other)) is not None:
                print(f"not reused: {other}: {differences(old, config) or 'same config, not known to have finished'}")
        cmd = [sys.executable, "-u", str(REPO / sweep["program"]), *args, f"run_dir={run_dir}"]
        if (run_dir / FINISHED).is_file() and saved_config(run_dir) == config:
            print(f"reused: {at}: {run_dir} finished, its config.yaml equals this command's resolved config")
        else:
            if (run_dir / "LATEST").exists():  # stopped before its end: train.py refuses a resume of another config
                print(f"resuming: {at}: {run_dir} stopped at {os.readlink(run_dir / 'LATEST')} before finishing")
                cmd.append(f"resume_from={run_dir}")
            elif run_dir.exists():  # no checkpoint to resume; its partial metrics.jsonl would mix with the new run's
                print(f"restarting: {at}: {run_dir} stopped before its first checkpoint")
                shutil.rmtree(run_dir)
            print("+", shlex.join(cmd[2:]), flush=True)
            if code := subprocess.run(cmd, cwd=REPO).returncode:
                raise SystemExit(f"{at}: train.py exited with {code}; run this command again to resume")
            (run_dir / FINISHED).write_text(shlex.join(cmd[2:]) + "\n")
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        last = next((r for r in reversed(records) if metric in r), {"step": None})  # the last evaluation's record
        rows.append((at, last.get(metric), counts(run_dir, metric, last["step"], last.get(metric))))
    print_table(metric, sweep["metric"]["goal"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
