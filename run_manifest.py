"""What exactly produced a run, and running it again: run_dir/run_manifest.json and `train.py --replay`.

Written when a run starts: the resolved config, git commit and dirty flag (the diff in run_manifest.diff), versions,
device, world size and a fingerprint of each split's and source's tokenized data. A resume or replay checks it
first: other data refuses (exit 2, nothing loaded or written), other code warns. `train.py --replay <run_dir>` runs
<run_dir>/config.yaml again into a new run directory and prints each logged metric's largest difference against
<run_dir>/metrics.jsonl, over the steps both runs logged. (Not step-N/manifest.json: a checkpoint's file list.)
With model.quantization it also records bitsandbytes' settings and the versions of bitsandbytes, peft and accelerate.
"""

import hashlib
import json
import platform
import subprocess
import sys
from dataclasses import asdict
from datetime import datetime, timezone
from importlib.metadata import version  # not `import datasets`: that would load pyarrow for two version strings
from pathlib import Path

import torch
import yaml

import config
import config_loader
import utils

REPO = Path(__file__).resolve().parent
MANIFEST, DIFF = "run_manifest.json", "run_manifest.diff"  # in run_dir, side by side
FORMAT = 1
# A replay repeats the recorded config; only keys that cannot change a number may be given again.
REPLAY_KEYS = ("run_dir", "exp_name", "wandb.enabled", "wandb.entity", "wandb.project", "fsdp_port", "local_dirs")
TIMING = ("throughput/", "examples_per_second")  # wall-clock metrics: they differ between any two runs


class ManifestError(ValueError):
    """A resume or replay whose data is not the data of the recorded run."""


def git_state() -> tuple[dict, str]:
    """({commit, dirty, diff_sha256, untracked}, diff text) of the repository this file lives in."""
    git = lambda *args: subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True)
    try:
        commit = git("rev-parse", "HEAD").stdout.strip()
        diff = git("diff", "HEAD").stdout
        untracked = git("ls-files", "--others", "--exclude-standard").stdout.split()
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (a copied tree): say so, do not guess
        return {"commit": None, "dirty": None, "diff_sha256": None, "untracked": []}, ""
    sha = hashlib.sha256(diff.encode()).hexdigest()
    return {"commit": commit, "dirty": bool(diff or untracked), "diff_sha256": sha, "untracked": untracked}, diff


def write(run_dir, cfg, splits: dict, world_size: int) -> None:
    """run_dir/run_manifest.json (+ run_manifest.diff when the tree is dirty), once, by rank 0 at the start."""
    code, diff = git_state()
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if cuda else platform.processor() or platform.machine()
    versions = {name: version(name) for name in ("transformers", "datasets")}
    manifest = {
        "format": FORMAT,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": cfg.to_dict(),
        "code": code,
        "versions": {"python": platform.python_version(), "torch": torch.__version__, **versions},
        "device": {"type": "cuda" if cuda else "cpu", "name": device},
        "world_size": world_size,
        "data": {split: loaded.keys for split, loaded in splits.items()},
        "data_counts": {
            split: [dict(asdict(s), cache=None) for s in loaded.stats]  # kept, dropped, truncated
            for split, loaded in splits.items()
        },
    }
    if cfg.model.quantization:  # QLoRA: bitsandbytes' settings and the versions of the libraries that quantize
        import lora

        manifest["quantization"] = lora.record(cfg)
    if cfg.online.rounds:  # semi-online DPO: what regenerates its rounds (sampling, seeds, prompts, scorer)
        import online

        manifest["online"] = online.record(cfg)
    if cfg.eval_scorer:  # what scores the evaluations' samples (a function's source, a reward model's files)
        import scorers

        manifest["eval_scorer"] = scorers.record("eval_scorer", cfg.eval_scorer, cfg)
    if diff:
        utils.atomic_write_text(Path(run_dir) / DIFF, diff)
    utils.atomic_write_text(Path(run_dir) / MANIFEST, json.dumps(manifest, indent=1) + "\n")


def check_against(recorded_dir, cfg, splits: dict, what: str) -> None:
    """Before any model loads: refuse (ManifestError) when the data of `cfg` differs from recorded_dir's manifest,
    warn on stderr when the code differs. A run older than manifests is not checked."""
    path = Path(recorded_dir) / MANIFEST
    if not path.is_file():
        print(
            f"warning: {path} does not exist (a run from before run manifests): data and code not checked",
            file=sys.stderr,
        )
        return
    try:
        recorded = json.loads(path.read_text())
        then = recorded["data"]
        recorded_code = recorded["code"]
    except (ValueError, KeyError) as e:
        raise ManifestError(
            f"{path}: unreadable run manifest ({type(e).__name__}: {e}); expected the JSON that "
            "train.py writes at the start of a run"
        ) from None
    now = {split: loaded.keys for split, loaded in splits.items()}  # preference_datasets' cache keys
    drift = [
        f"{split}/{name}: recorded {then.get(split, {}).get(name, 'absent')[:16]}, now {fp[:16]}"
        for split, names in now.items()
        for name, fp in names.items()
        if then.get(split, {}).get(name) != fp
    ]
    drift += [
        f"{split}/{name}: recorded, now absent"
        for split, names in then.items()
        for name in names
        if name not in now.get(split, {})
    ]
    if drift:
        raise ManifestError(
            f"cannot {what}: the tokenized data differs from the data recorded in {path} (the "
            "fingerprint hashes the raw file, the tokenizer, the lengths and the truncation); nothing "
            "was loaded or written:\n  " + "\n  ".join(drift)
        )
    if cfg.online.rounds and "online" in recorded:  # a scorer or pairing whose code or weights changed: other pairs
        import online

        now = online.record(cfg)
        for key in ("scorer", "pairing"):
            if now.get(key) != recorded["online"].get(key):
                print(
                    f"warning: the online {key} differs from the recorded run's ({path}): the rounds' pairs will "
                    f"differ:\n  then {recorded['online'].get(key)}\n  now  {now.get(key)}",
                    file=sys.stderr,
                )
    if cfg.eval_scorer and "eval_scorer" in recorded:  # a scorer whose code or weights changed scores otherwise
        import scorers

        if (now_scorer := scorers.record("eval_scorer", cfg.eval_scorer, cfg)) != recorded["eval_scorer"]:
            print(
                f"warning: eval_scorer differs from the recorded run's ({path}): the evaluations' scores will "
                f"differ:\n  then {recorded['eval_scorer']}\n  now  {now_scorer}",
                file=sys.stderr,
            )
    code, _ = git_state()
    if (code["commit"], code["diff_sha256"]) != (recorded_code.get("commit"), recorded_code.get("diff_sha256")):
        print(
            f"warning: the code differs from the recorded run's ({path}): commit {recorded_code.get('commit')} "
            f"dirty={recorded_code.get('dirty')} then, {code['commit']} dirty={code['dirty']} now; "
            f"the recorded diff is in {Path(recorded_dir) / DIFF}",
            file=sys.stderr,
        )


def replay_config(original_dir, overrides: list[str]):
    """(the config recorded in original_dir/config.yaml with `overrides` of REPLAY_KEYS only, into a new run dir
    (default: <original_dir>-replay-<time>); the flags among the overrides, e.g. --cfg). Raises ConfigError."""
    path = Path(original_dir) / "config.yaml"
    if not path.is_file():
        raise config.ConfigError([f"--replay {original_dir}: no config.yaml there (expected a train.py run directory)"])
    keys = config.schema()
    # config.yaml is already resolved (renamed keys, derived eval_every): rebuilt as it is, over the defaults
    flat = {**{k: d for k, (_, d, _) in keys.items()}, **config.flatten(yaml.safe_load(path.read_text()))}
    _, given, flags, problems = config_loader.parse_argv(overrides)
    problems += [
        f"--replay repeats the recorded config; {raw!r} cannot be given (only {', '.join(REPLAY_KEYS)})"
        for key, _, raw in given
        if key not in REPLAY_KEYS
    ]
    if not problems:
        flat.update(
            resume_from=None, run_dir=f"{Path(original_dir).resolve()}-replay-{datetime.now():%Y%m%d_%H%M%S_%f}"
        )
        flat.update({key: config_loader.typed(keys, key, value, raw) for key, value, raw in given})
        cfg = config_loader.build(config.Config, flat, "", problems)
    if not problems:  # types must be right before the cross-field rules can read them
        problems = config_loader.validate(cfg, config_loader.known_world_size(cfg))
    if problems:
        raise config.ConfigError(problems)
    return cfg, flags


def metric_differences(original_dir, replay_dir) -> dict[str, tuple[float, int, int]]:
    """{metric: (largest |difference|, steps compared, steps of one run only)}, records matched by step. A metric
    logged as null (non-finite) matches only null; a value against null counts as an infinite difference."""

    def read(run_dir) -> dict[str, dict[int, float]]:  # {metric: {step: value}}
        records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
        return {k: {r["step"]: r[k] for r in records if k in r} for k in {k for r in records for k in r} - {"step"}}

    a, b = read(original_dir), read(replay_dir)
    out = {}
    for name in sorted(set(a) | set(b)):
        sa, sb = a.get(name, {}), b.get(name, {})
        pairs = [(sa[s], sb[s]) for s in set(sa) & set(sb)]  # the steps both runs logged
        diffs = [abs(x - y) if None not in (x, y) else 0.0 if x is y else float("inf") for x, y in pairs]
        out[name] = (max(diffs, default=0.0), len(pairs), len(set(sa) ^ set(sb)))
    return out


def report(original_dir, replay_dir) -> str:
    """The table `--replay` prints, and how many training steps and evaluations it compared. Records are matched by
    step; a metric no step of both runs holds is listed as not comparable (a run with another log_every_steps)."""
    rows = metric_differences(original_dir, replay_dir)
    differ = [n for n, (d, common, _) in rows.items() if not n.startswith(TIMING) and common and d != 0]
    apart = [n for n, (_, common, _) in rows.items() if not n.startswith(TIMING) and not common]
    lines = [
        f"replay of {original_dir} in {replay_dir}: largest |difference| per logged metric (matched by step)",
        f"  {'metric':<40} {'max_abs_diff':>14} {'steps_compared':>15} {'steps_in_one_run_only':>22}",
    ]
    lines += [
        f"  {name:<40} {d:>14.3e} {n:>15d} {only:>22d}"
        + ("  (wall-clock time: differs by nature)" if name.startswith(TIMING) else "")
        for name, (d, n, only) in rows.items()
    ]
    if apart:
        lines.append(f"not comparable (no step logged by both runs): {', '.join(apart)}")
    steps = {split: rows.get(f"loss/{split}", (0, 0, 0))[1:] for split in ("train", "eval")}
    lines.append(
        f"compared {steps['train'][0]} training steps ({steps['train'][1]} in one run only) and "
        f"{steps['eval'][0]} evaluations ({steps['eval'][1]} in one run only)"
    )
    if rounds := sorted(Path(original_dir).glob("rounds/*/pairs.jsonl")):  # semi-online DPO: the pairs, sampled again
        again = [Path(replay_dir) / p.relative_to(original_dir) for p in rounds]
        other = [p.parent.name for p, q in zip(rounds, again) if not q.is_file() or p.read_bytes() != q.read_bytes()]
        lines.append(
            f"online rounds: {len(rounds)} compared, "
            + (f"rounds {', '.join(other)} differ" if other else "identical pairs in every round")
        )
    lines.append(
        f"replay differs in {len(differ)} metric(s): {', '.join(differ)}"
        if differ
        else "replay identical: every metric that is not wall-clock time matches exactly at every step both runs logged"
    )
    return "\n".join(lines)
