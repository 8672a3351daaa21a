"""What exactly produced a run, and running it again: run_dir/run_manifest.json and `train.py --replay`.

Two manifests, not to be confused:
  - run_dir/run_manifest.json (this file's): written once when a run starts; the resolved config, the git commit
    and dirty flag (the diff beside it in run_manifest.diff), library versions, device and world size, and a
    fingerprint of the tokenized data of each split and source. A resume compares it with the resumed run:
    different data refuses (exit 2, nothing loaded or written), different code warns.
  - run_dir/step-N/manifest.json (trainers.write_manifest): size and sha256 of every file of one checkpoint.

Replay: `python -u train.py --replay <run_dir>` reads <run_dir>/config.yaml, runs it into a new run directory
(checking the data fingerprints first, exactly as a resume does), then prints the largest difference of every
logged metric against <run_dir>/metrics.jsonl.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import platform
import subprocess
import sys
from datetime import datetime, timezone
from importlib.metadata import version  # not `import datasets`: that costs ~1 s and tens of MB of pyarrow
from pathlib import Path

import yaml

import config
from config import ConfigError, OnFirstUse

# Deferred: these import torch (seconds), and train.py imports this file before a config is read (--replay).
torch = OnFirstUse("torch")
losses = OnFirstUse("losses")
data = OnFirstUse("preference_datasets")
utils = OnFirstUse("utils")

REPO = Path(__file__).resolve().parent
MANIFEST = "run_manifest.json"
DIFF = "run_manifest.diff"
FORMAT = 1
# A replay repeats the recorded config; only keys that cannot change a number may be given again.
REPLAY_KEYS = ("run_dir", "exp_name", "wandb.enabled", "wandb.entity", "wandb.project", "fsdp_port", "local_dirs")
# Metrics measured in wall-clock time: they differ between any two runs, and are reported apart.
TIMING = ("throughput/", "examples_per_second")


class ManifestError(ValueError):
    """A resume or replay whose data is not the data of the recorded run."""


# ------------------------------------------------------------------------------------------------------
# Writing
# ------------------------------------------------------------------------------------------------------
def git_state() -> tuple[dict, str]:
    """({commit, dirty, diff_sha256, untracked}, diff text) of the repository this file lives in."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True).stdout
    try:
        commit = git("rev-parse", "HEAD").strip()
        diff = git("diff", "HEAD")
        untracked = git("ls-files", "--others", "--exclude-standard").split()
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (a copied tree): say so, do not guess
        return {"commit": None, "dirty": None, "diff_sha256": None, "untracked": []}, ""
    return {"commit": commit, "dirty": bool(diff or untracked), "diff_sha256": hashlib.sha256(diff.encode()).hexdigest(),
            "untracked": untracked}, diff


def fingerprints(cfg, tokenizer) -> dict[str, dict[str, str]]:
    """{split: {source: sha256 of what its tokenized data depends on}} (preference_datasets' cache key)."""
    kwargs = dict(max_length=cfg.max_length, max_prompt_length=cfg.max_prompt_length,
                  sft_mode=losses.is_sft_only(cfg.loss_names), truncation_mode=cfg.truncation_mode)
    # KTO reads labelled completions (pairs_to_unpaired: training splits each pair in two; eval keeps the pairs)
    modes = {"train": dict(unpaired=cfg.unpaired_loss, pairs_to_unpaired=cfg.pairs_to_unpaired),
             "test": dict(unpaired=cfg.unpaired_loss and not cfg.pairs_to_unpaired)}
    return {split: data.data_fingerprints(cfg.datasets, tokenizer, split, **kwargs, **modes[split]) for split in ("train", "test")}


def build(cfg, tokenizer, world_size: int) -> tuple[dict, str]:
    """The manifest of a run starting now, and the diff of the working tree (saved beside it)."""
    code, diff = git_state()
    device = {"type": "cuda" if torch.cuda.is_available() else "cpu",
              "name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or platform.machine()}
    return {"format": FORMAT, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "config": cfg.to_dict(), "code": code,
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         **{name: version(name) for name in ("transformers", "datasets")}},
            "device": device, "world_size": world_size, "data": fingerprints(cfg, tokenizer)}, diff


def write(run_dir, cfg, tokenizer, world_size: int) -> None:
    """run_dir/run_manifest.json (+ run_manifest.diff when the tree is dirty), once, by rank 0 at the start."""
    manifest, diff = build(cfg, tokenizer, world_size)
    if diff:
        utils.atomic_write_text(Path(run_dir) / DIFF, diff)
    utils.atomic_write_text(Path(run_dir) / MANIFEST, json.dumps(manifest, indent=1) + "\n")


# ------------------------------------------------------------------------------------------------------
# Checking (resume and replay), before any model is loaded
# ------------------------------------------------------------------------------------------------------
def check_against(recorded_dir, cfg, tokenizer, what: str) -> None:
    """Refuse (ManifestError) when the data of `cfg` differs from the data recorded in recorded_dir's manifest;
    warn on stderr when the code differs. A run without a manifest (older than manifests) is not checked."""
    path = Path(recorded_dir) / MANIFEST
    if not path.is_file():
        print(f"warning: {path} does not exist (a run from before run manifests): data and code not checked", file=sys.stderr)
        return
    try:
        recorded = json.loads(path.read_text())
        recorded_data, recorded_code = recorded["data"], recorded["code"]
    except (ValueError, KeyError) as e:
        raise ManifestError(f"{path}: unreadable run manifest ({type(e).__name__}: {e}); expected the JSON that "
                            "train.py writes at the start of a run") from None
    now = fingerprints(cfg, tokenizer)
    drift = [f"{split}/{name}: recorded {recorded_data.get(split, {}).get(name, 'absent')[:16]}, now {fp[:16]}"
             for split, names in now.items() for name, fp in names.items() if recorded_data.get(split, {}).get(name) != fp]
    drift += [f"{split}/{name}: recorded, now absent" for split, names in recorded_data.items() for name in names
              if name not in now.get(split, {})]
    if drift:
        raise ManifestError(f"cannot {what}: the tokenized data differs from the data recorded in {path} (the "
                            "fingerprint hashes the raw file, the tokenizer, the lengths and the truncation); nothing "
                            "was loaded or written:\n  " + "\n  ".join(drift))
    code, _ = git_state()
    if (code["commit"], code["diff_sha256"]) != (recorded_code.get("commit"), recorded_code.get("diff_sha256")):
        print(f"warning: the code differs from the recorded run's ({path}): commit {recorded_code.get('commit')} "
              f"dirty={recorded_code.get('dirty')} then, {code['commit']} dirty={code['dirty']} now; "
              f"the recorded diff is in {Path(recorded_dir) / DIFF}", file=sys.stderr)


# ------------------------------------------------------------------------------------------------------
# Replay
# ------------------------------------------------------------------------------------------------------
def replay_config(original_dir, overrides: list[str]):
    """(the config recorded in original_dir/config.yaml, with `overrides` from REPLAY_KEYS only, into a new run dir
    (default: <original_dir>-replay-<time>); the flags among the overrides, e.g. --cfg). Raises ConfigError."""
    path = Path(original_dir) / "config.yaml"
    if not path.is_file():
        raise ConfigError([f"--replay {original_dir}: no config.yaml there (expected the run directory of a train.py run)"])
    keys = config.schema()
    flat = {k: d for k, (_, d, _) in keys.items()}

    def walk(tree: dict, prefix: str = "") -> None:
        for k, v in tree.items():
            if isinstance(v, dict) and prefix + k not in keys:
                walk(v, prefix + k + ".")
            else:
                flat[prefix + k] = v
    walk(yaml.safe_load(path.read_text()))  # already resolved (aliases, derived eval_every): rebuilt as it is
    _, given, flags, problems = config.parse_argv(overrides)
    problems += [f"--replay repeats the recorded config; {raw!r} cannot be given (only {', '.join(REPLAY_KEYS)})"
                 for key, _, raw in given if key not in REPLAY_KEYS]
    if problems:
        raise ConfigError(problems)
    flat.update(resume_from=None, run_dir=None)
    flat.update({key: raw if config._is_text(keys[key][0]) else value for key, value, raw in given})
    cfg = config._build(config.Config, flat, "", problems)
    problems += config.validate(cfg)
    if problems:
        raise ConfigError(problems)
    if cfg.run_dir is None:
        stamp = datetime.now().strftime("%Y%m%d_%H%M%S_%f")
        cfg = dataclasses.replace(cfg, run_dir=str(Path(original_dir).resolve()) + f"-replay-{stamp}")
    return cfg, flags


def metric_differences(original_dir, replay_dir) -> dict[str, tuple[float, int, int]]:
    """{metric: (largest |difference|, records compared, records of one run only)}, records matched by step.

    A metric logged as null (non-finite) matches only null; a value against null counts as an infinite difference."""
    def read(d) -> dict[str, dict[int, float]]:
        series: dict[str, dict[int, float]] = {}
        for line in (Path(d) / "metrics.jsonl").read_text().splitlines():
            record = json.loads(line)
            for k, v in record.items():
                if k != "step":
                    series.setdefault(k, {})[record["step"]] = v
        return series
    a, b = read(original_dir), read(replay_dir)
    out = {}
    for name in sorted(set(a) | set(b)):
        sa, sb = a.get(name, {}), b.get(name, {})
        common = sorted(set(sa) & set(sb))
        diffs = [0.0 if x is None and y is None else math.inf if x is None or y is None else abs(x - y)
                 for x, y in ((sa[s], sb[s]) for s in common)]
        out[name] = (max(diffs, default=0.0), len(common), len(set(sa) ^ set(sb)))
    return out


def report(original_dir, replay_dir) -> str:
    """The table `--replay` prints: every logged metric, its largest difference over the steps both runs logged
    (training records are written at most every minimum_log_interval_secs of wall-clock time, so the two runs may
    log different steps: those are counted, not compared), wall-clock metrics apart."""
    rows = metric_differences(original_dir, replay_dir)
    differ = [n for n, (d, common, _) in rows.items() if not n.startswith(TIMING) and common and d != 0]
    apart = [n for n, (_, common, _) in rows.items() if not n.startswith(TIMING) and not common]
    lines = [f"replay of {original_dir} in {replay_dir}: largest |difference| per logged metric (matched by step)",
             f"  {'metric':<40} {'max_abs_diff':>14} {'steps_compared':>15} {'steps_in_one_run_only':>22}"]
    for name, (d, n, only) in rows.items():
        note = "  (wall-clock time: differs by nature)" if name.startswith(TIMING) else ""
        lines.append(f"  {name:<40} {d:>14.3e} {n:>15d} {only:>22d}{note}")
    if apart:
        lines.append(f"not comparable (no step logged by both runs): {', '.join(apart)}")
    lines.append(f"replay differs in {len(differ)} metric(s): {', '.join(differ)}" if differ else
                 "replay identical: every metric that is not wall-clock time matches exactly at every step both runs logged")
    return "\n".join(lines)
