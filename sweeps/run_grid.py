"""Run a W&B grid sweep file offline: every grid point as a plain train.py run (W&B off), then a table of the
sweep's target metric (its last logged value in each run's metrics.jsonl).

    python sweeps/run_grid.py sweeps/dpo_beta_lr.yaml [extra key=value ...]

The sweep file stays the one source of truth: its fixed command arguments, its grid and its metric. A point runs into
<local_dirs[0]>/runs/sweep_<point>_<hash of its resolved config>. Its results are reused only when that run finished
and its config.yaml (the resolved config train.py wrote) equals this command's, run_dir aside; a run stopped before
its end is resumed from its last checkpoint, one stopped before its first checkpoint starts again. The code and the
contents of model.archive are not part of the config: after changing either, delete the old runs.
"""

import hashlib
import itertools
import json
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
        at = " ".join(point)
        args = [*fixed, *point, "wandb.enabled=false", *extra]
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
        rows.append((point, next((r[metric] for r in reversed(records) if metric in r), None)))
    print(f"\n{metric} ({sweep['metric']['goal']}):")
    sign = -1 if sweep["metric"]["goal"] == "maximize" else 1  # best first
    for point, value in sorted(rows, key=lambda r: (r[1] is None, sign * (r[1] or 0))):
        print(f"  {' '.join(point):40s} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
