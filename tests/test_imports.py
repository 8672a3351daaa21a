"""The shape of the house: a default run imports only core files, each option is imported only when it is on, and no
module imports another in a circle (lazy imports and the option tables included)."""

import ast
import json
import subprocess
import sys
from pathlib import Path

from conftest import LOCAL_DIRS  # runs and caches in a temporary directory

REPO = Path(__file__).resolve().parent.parent
# What a default run reads (README: "core"); every other root module is an option, imported at its call site when on
CORE = {
    "train",
    "config",
    "config_loader",
    "trainers",
    "checkpoints",
    "losses",
    "logps",
    "preference_datasets",
    "sources",
    "self_check",
    "run_manifest",
    "sharding",
    "utils",
}
MODULES = {p.stem for p in REPO.glob("*.py")}
OPTIONS = MODULES - CORE


def test_every_option_file_named_in_the_readme_table():
    readme = (REPO / "README.md").read_text()
    assert OPTIONS >= {"fsdp", "ulysses", "online", "estimate", "tiled_head", "packing", "modifiers", "moe", "lora"}
    assert [m for m in sorted(MODULES) if f"`{m}.py`" not in readme] == []


def test_a_default_toy_dpo_run_imports_no_option_file(tmp_path):
    """The run's own process: a short toy DPO run, then the project's modules in sys.modules."""
    args = ["loss=dpo", "n_epochs=null", "n_examples=8", "batch_size=4", "eval_batch_size=4", "n_eval_examples=4"]
    args += ["wandb.enabled=false", "sample_during_eval=false", "debug=true", f"run_dir={tmp_path / 'run'}", LOCAL_DIRS]
    code = (
        "import json, sys, train; assert train.main(sys.argv[1:]) == 0; "
        f"print(json.dumps(sorted(n for n, m in sys.modules.items() if getattr(m, '__file__', '') and "
        f"m.__file__.startswith({str(REPO)!r} + '/') and m.__file__.count('/') == {str(REPO).count('/') + 1})))"
    )
    result = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    imported = set(json.loads(result.stdout.strip().splitlines()[-1]))
    assert imported & OPTIONS == set(), f"option files a default run imported: {sorted(imported & OPTIONS)}"
    assert {"train", "trainers", "losses", "logps", "config", "config_loader"} <= imported


def imports(module: str) -> set[str]:
    """The project modules `module` imports anywhere (inside functions too), and those its option tables name."""
    tree = ast.parse((REPO / f"{module}.py").read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Dict) and node.values and all(isinstance(v, ast.Lambda) for v in node.values):
            names |= {k.value for k in node.keys if isinstance(k, ast.Constant)}  # a {module: switch} table
    return names & MODULES - {module}


def test_no_import_circle():
    graph = {m: imports(m) for m in MODULES}
    assert graph["config_loader"] >= {"lora", "packing", "modifiers"}  # the option tables count as imports

    def circle(start: str, path: list[str]) -> list[str] | None:
        for nxt in sorted(graph[path[-1]]):
            if nxt == start:
                return path + [start]
            if nxt not in path and (found := circle(start, path + [nxt])):
                return found
        return None

    circles = [c for m in sorted(MODULES) if (c := circle(m, [m]))]
    assert circles == [], " -> ".join(circles[0])
