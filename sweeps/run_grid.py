"""Run a W&B grid sweep file offline: every grid point as a plain train.py run (W&B off), then a table of the
sweep's target metric (its last logged value in each run's metrics.jsonl).

    python sweeps/run_grid.py sweeps/dpo_beta_lr.yaml [extra key=value ...]

The sweep file stays the one source of truth: its fixed command arguments, its grid and its metric.
"""
import itertools
import json
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent


def main(path: str, extra: list[str]) -> int:
    sweep = yaml.safe_load(Path(path).read_text())
    if sweep.get("method") != "grid":
        raise SystemExit(f"{path}: method={sweep.get('method')!r}; this runner runs grid sweeps only")
    fixed = [a for a in sweep["command"] if not str(a).startswith("${") and a not in ("python", "-u")]
    names = list(sweep["parameters"])
    metric = sweep["metric"]["name"]
    rows = []
    for values in itertools.product(*(sweep["parameters"][n]["values"] for n in names)):
        point = [f"{n}={v}" for n, v in zip(names, values)]
        run_dir = REPO / ".cache" / "runs" / ("sweep_" + "_".join(f"{n}{v}" for n, v in zip(names, values)))
        cmd = [sys.executable, "-u", str(REPO / sweep["program"]), *fixed, *point, "wandb.enabled=false",
               f"run_dir={run_dir}", *extra]
        print("+", " ".join(cmd[2:]), flush=True)
        if not (run_dir / "LATEST").exists():  # a finished point is read, not run again
            subprocess.run(cmd, check=True, cwd=REPO)
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        rows.append((point, next((r[metric] for r in reversed(records) if metric in r), None)))
    print(f"\n{metric} ({sweep['metric']['goal']}):")
    sign = -1 if sweep["metric"]["goal"] == "maximize" else 1  # best first
    for point, value in sorted(rows, key=lambda r: (r[1] is None, sign * (r[1] or 0))):
        print(f"  {' '.join(point):40s} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
