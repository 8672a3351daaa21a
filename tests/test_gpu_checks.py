"""benchmarks/gpu_checks.py on CPU: its plan fits the GPU budget and names runs train.py accepts, a timed-out check
leaves no process of its group behind, and its instruments (the head's matmul dtypes as dispatched, the scaled head
set at load) see what they claim to. The checks themselves need CUDA; `python benchmarks/gpu_checks.py --cpu` runs
them at tiny sizes (longer than a unit test)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import config_loader  # noqa: E402
import gpu_checks  # noqa: E402
from conftest import LOCAL_DIRS  # noqa: E402


def test_dry_run_prints_the_plan_within_the_limit():
    out = subprocess.run(
        [sys.executable, "benchmarks/gpu_checks.py", "--dry-run"], cwd=REPO, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    plan = out.stdout
    defaults = [c for c in gpu_checks.CHECKS if c.default]
    assert [c.name for c in defaults] == ["flex", "self_check", "head_dtype", "mfu"]
    total = sum(c.budget_s for c in defaults) + gpu_checks.MARGIN_S
    assert total <= gpu_checks.LIMIT_S == 480  # 8 minutes on one H100
    assert f"= {total} s" in plan and "within the limit of 480 s" in plan
    for c in defaults:
        assert f"{c.name:<11} budget {c.budget_s:>4} s:" in plan
    assert "5. qlora       budget   90 s  (not selected)" in plan and "model.quantization=nf4" in plan
    assert "flex_tests" in plan and "(not selected)" in plan


@pytest.mark.parametrize("cpu", [False, True])
def test_every_planned_run_is_a_config_train_py_accepts(cpu):
    """Each run's arguments load (a mistyped key or a bad value would fail only on the GPU); tiled_lm_head is given
    explicitly (its default is changing) and no run writes a checkpoint."""
    runs = {name: args for c in gpu_checks.CHECKS if c.runs for name, args in c.runs(Path("/work"), cpu).items()}
    assert set(runs) >= {"flex", "self_check_correct", "self_check_broken_long", "head_dtype_tiled_false", "mfu"}
    assert set(runs) >= {"qlora_lora_bf16", "qlora_nf4"}
    for name, args in runs.items():
        cfg, _ = config_loader.load_config(args)
        assert any(a.startswith("tiled_lm_head=") for a in args) and cfg.debug, name
    prompts = gpu_checks.sizes(cpu)["prompts"]
    if not cpu:  # past the ~261 columns G1's head check kept at V=128256, with a control below
        assert gpu_checks.sizes(cpu)["vocab"] == 128256 and prompts["long"] > 300 > 261 > prompts["short"]


def test_the_mfu_run_fits_an_h100_by_the_estimate(tmp_path, monkeypatch, capsys):
    """The Llama-3.2-1B-geometry run of check 4 as train.py --estimate sizes it from config.json alone, at the world
    of 1 the check runs."""
    import train as train_py

    gpu_checks.llama_1b_config(False).save_pretrained(tmp_path / "models" / "llama-1b-gpu")
    gpu_checks.write_pairs(tmp_path / "data" / "mfu_pairs.jsonl", 80, 250, 250)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert train_py.main([*gpu_checks.mfu_runs(tmp_path, False)["mfu"], "--estimate", "gpu=H100"]) == 0
    printed = capsys.readouterr().out
    assert "1235.81M parameters" in printed and "micro-batch 16384 tokens" in printed
    assert printed.rstrip().endswith("fits"), printed


GRANDCHILD = """
import os, subprocess, sys, time
sleeper = subprocess.Popen(["sleep", "60"])  # the training run a check starts
open(sys.argv[1], "w").write(f"{os.getpid()} {sleeper.pid}")
time.sleep(60)
"""


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, killed and waiting for its reaper, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def group_members(pgid: int) -> list[int]:
    """The live processes of process group `pgid`."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except FileNotFoundError:  # ended while listed
            continue
        if int(group) == pgid and state != "Z":
            members.append(int(stat.parent.name))
    return members


def leftovers(pid_file: Path) -> list[int]:
    """The processes pid_file names still running after up to 5 s (SIGKILL is delivered at once; their reaper may
    take a moment); each one found is killed here, so that a failing test leaves nothing behind."""
    deadline = time.time() + 30
    while not (pid_file.exists() and pid_file.read_text()) and time.time() < deadline:
        time.sleep(0.05)
    pids = [int(p) for p in pid_file.read_text().split()]
    deadline = time.time() + 5
    while any(map(alive, pids)) and time.time() < deadline:
        time.sleep(0.05)
    left = [p for p in pids if alive(p)]
    for p in left:
        os.kill(p, 9)
    return left


def test_a_timed_out_check_leaves_no_process_of_its_group(tmp_path):
    """A check whose child starts a grandchild that sleeps: at the timeout the whole group is killed, the grandchild
    too (subprocess.run(timeout=) killed only the child: the training run kept the GPU)."""
    pids = tmp_path / "pids"
    start = time.time()
    code = gpu_checks.run_in_group([sys.executable, "-c", GRANDCHILD, str(pids)], 3, tmp_path / "log", dict(os.environ))
    assert code is None and time.time() - start < 30
    child = int(pids.read_text().split()[0])
    assert leftovers(pids) == [] and group_members(child) == []


def test_a_check_that_ends_takes_its_leftovers_with_it(tmp_path):
    """A child that exits while a grandchild it started still runs: the group is killed after the exit as well."""
    pids = tmp_path / "pids"
    leaver = "import subprocess, sys; open(sys.argv[1], 'w').write(str(subprocess.Popen(['sleep', '60']).pid))"
    code = gpu_checks.run_in_group([sys.executable, "-c", leaver, str(pids)], 30, tmp_path / "log", dict(os.environ))
    assert code == 0 and leftovers(pids) == []


DRIVER = """
import sys
sys.path.insert(0, "benchmarks")
import gpu_checks
gpu_checks.stop_on_signals()
gpu_checks.run_in_group([sys.executable, "-c", sys.argv[1], sys.argv[2]], 60, gpu_checks.Path(sys.argv[3]))
"""


def test_a_terminated_entry_point_takes_the_running_check_with_it(tmp_path):
    """SIGTERM to the entry point (a scheduler, the end of a loan's command): the running check's group is killed
    before it exits; its own session would otherwise keep it running."""
    pids = tmp_path / "pids"
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, GRANDCHILD, str(pids), str(tmp_path / "log")], cwd=REPO)
    deadline = time.time() + 30
    while not (pids.exists() and pids.read_text()) and time.time() < deadline:
        time.sleep(0.05)
    driver.terminate()
    code = driver.wait(timeout=30)
    assert leftovers(pids) == [] and code == 128 + 15


def test_only_refuses_unknown_names_and_an_unbuilt_slot(monkeypatch):
    assert [c.name for c in gpu_checks.selected("2,mfu")] == ["self_check", "mfu"]
    assert [c.name for c in gpu_checks.selected("qlora")] == ["qlora"]  # opt-in, outside the default budget
    with pytest.raises(SystemExit, match="'fast' is not a check"):
        gpu_checks.selected("flex,fast")
    slot = gpu_checks.Check("later", None, "NOT YET BUILT: a slot", None, default=False)
    monkeypatch.setattr(gpu_checks, "CHECKS", [*gpu_checks.CHECKS, slot])
    with pytest.raises(SystemExit, match="later is not yet built"):
        gpu_checks.selected("later")


def test_head_matmuls_record_the_dtype_autocast_runs_the_head_in():
    """The toy model's head (V=512) under bf16 autocast: its matmuls run in bf16 although the weight is fp32 (what a
    record at F.linear would report), forward and backward; without autocast in fp32; the backbone's are not counted."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(REPO / "toy" / "tiny-llama")
    ids = torch.randint(2, 500, (2, 16))

    def calls(autocast: bool) -> dict:
        with gpu_checks.head_matmuls(512) as seen, torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            model(input_ids=ids).logits.float().logsumexp(-1).sum().backward()
        return seen.calls

    assert calls(True) == {("mm", ("bfloat16", "bfloat16")): 3}  # forward, grad of input, grad of weight
    assert calls(False) == {("mm", ("float32", "float32")): 3}


def test_scaled_heads_scale_every_loaded_models_logits():
    import transformers

    path = REPO / "toy" / "tiny-llama"
    ids = torch.randint(2, 500, (1, 8))
    plain = transformers.AutoModelForCausalLM.from_pretrained(path)(input_ids=ids).logits
    with gpu_checks.scaled_heads(transformers, 1.1):
        scaled = transformers.AutoModelForCausalLM.from_pretrained(path)(input_ids=ids).logits
    again = transformers.AutoModelForCausalLM.from_pretrained(path)(input_ids=ids).logits  # unpatched after
    torch.testing.assert_close(scaled, plain * 1.1)
    torch.testing.assert_close(again, plain)


def test_a_scaled_head_stops_a_one_rank_fsdp_run_in_this_process(tmp_path):
    """Check 2's mechanism on the toy model: gpu_checks.train runs FSDPTrainer as the one rank of a world of 1 (gloo
    here, NCCL on CUDA) in this process, so the head scaled at load reaches the rank: exit 4 before any step, naming
    tiled_lm_head (a spawned rank would load an unscaled head and train). The rendezvous variables are unset after."""
    import transformers

    before = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    run_dir = tmp_path / "run"
    args = [
        "model=tiny",
        "datasets=[toy]",
        *gpu_checks.COMMON,
        "trainer=FSDPTrainer",
        "fsdp.strategy=fsdp2",
        "tiled_lm_head=true",
        "batch_size=4",
        "eval_batch_size=4",
        "n_eval_examples=4",
        "n_examples=4",
        "eval_every=4",
        "max_length=64",
        "max_prompt_length=32",
        LOCAL_DIRS,
        f"run_dir={run_dir}",
    ]
    with gpu_checks.scaled_heads(transformers, gpu_checks.HEAD_SCALE):
        code = gpu_checks.train(args, ranks=True)
    report = gpu_checks.self_check_report(run_dir)
    assert code == 4 and "set tiled_lm_head=false" in report["failure"]
    assert not any("loss/train" in r for r in gpu_checks.records(run_dir))
    assert {k: os.environ.get(k) for k in before} == before
