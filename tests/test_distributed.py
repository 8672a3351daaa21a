"""What two ranks must agree on, with real gloo processes: the collective helpers, one non-finite decision for
all ranks, and rank 0's lone slow work (loading weights, writing and hashing checkpoints) under a short
collective_timeout_secs.

As tests/test_fsdp.py, ONE pair of processes (~15 s of imports) runs every scenario in turn, each through
train.py's own distributed_worker (its process group, its run directory) on its own port; each rank saves what
it saw and the tests read it.
"""

import contextlib
import io
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

import train as train_py
from conftest import LOCAL_DIRS  # runs and caches in a temporary directory
import checkpoints
import reference_cache
import trainers
import utils
from config_loader import load_config

REPO = Path(__file__).resolve().parent.parent
FAST = [
    LOCAL_DIRS,
    "model=tiny",
    "datasets=[toy]",
    "warmup_steps=0",
    "batch_size=8",
    "eval_batch_size=8",
    "n_eval_examples=8",
    "max_length=64",
    "max_prompt_length=32",
    "fsdp.use_torch_compile=false",
    "wandb.enabled=false",
    "n_epochs=null",
    "loss=dpo",
    "do_first_eval=false",
    "sample_during_eval=false",
    "minimum_log_interval_secs=0",
    "optimizer=SGD",
    "lr=1.0",
    "n_examples=8",
    "eval_every=8",
    "trainer=FSDPTrainer",
]
TIMEOUT_SECS, SLOW_SECS = 3, 6  # rank 0's slow work takes twice collective_timeout_secs


def helpers(rank: int, world_size: int) -> dict:
    """utils' collective helpers on CPU tensors, in a process group made as train.py makes it."""
    utils.init_distributed(30, cuda=False)
    try:
        values = torch.arange(3.0) + 10 * rank
        gathered = utils.all_gather_if_needed(values, rank, world_size)
        return {
            "backend": dist.get_backend_config(),
            "gathered": gathered,
            "gathered_device": str(gathered.device),
            "all_true_when_one_false": utils.all_ranks_true(rank == 0, torch.device("cpu")),
            "all_true_when_all_true": utils.all_ranks_true(True, torch.device("cpu")),
        }
    finally:
        utils.destroy_distributed()


def slow_rank0(rank: int, run_dir: Path) -> dict:
    """Rank 0 takes SLOW_SECS to load the weights and SLOW_SECS to hash each checkpoint while the other rank waits;
    collective_timeout_secs is TIMEOUT_SECS. The run must complete."""
    load_models, write_manifest = train_py.load_models, checkpoints.write_manifest

    def slow(fn):
        def run(*args, **kwargs):
            if rank == 0:
                time.sleep(SLOW_SECS)
            return fn(*args, **kwargs)

        return run

    train_py.load_models, checkpoints.write_manifest = slow(load_models), slow(write_manifest)
    cfg, _ = load_config([*FAST, "fsdp.strategy=fsdp", f"collective_timeout_secs={TIMEOUT_SECS}", f"run_dir={run_dir}"])
    start = time.time()
    try:
        train_py.distributed_worker(cfg, None)
        return {"completed": True, "seconds": time.time() - start}
    except Exception as e:  # recorded for the test to show; the other rank fails the same way
        return {"completed": False, "error": f"{type(e).__name__}: {e}"[:500]}
    finally:
        train_py.load_models, checkpoints.write_manifest = load_models, write_manifest


def nan_on_rank1(rank: int, run_dir: Path) -> dict:
    """Rank 1's loss is NaN at the one step (its gradient stays finite: a NaN constant added to the loss), rank 0's
    is finite. Both ranks must skip the step."""
    batch_metrics, train_step = trainers.BasicTrainer.batch_metrics, trainers.BasicTrainer.train_step
    seen = {}

    def poisoned(self, batch, split):
        loss, metrics = batch_metrics(self, batch, split)
        if rank == 1 and split == "train":
            nan = torch.tensor(float("nan"))
            loss = loss + nan
            metrics = {k: v + nan if k.startswith("loss") else v for k, v in metrics.items()}
        return loss, metrics

    def recorded(self, batch):
        out = train_step(self, batch)
        seen["nonfinite_steps"] = out["nonfinite_steps"]
        return out

    trainers.BasicTrainer.batch_metrics, trainers.BasicTrainer.train_step = poisoned, recorded
    cfg, _ = load_config([*FAST, "fsdp.strategy=fsdp2", f"run_dir={run_dir}"])
    start = time.time()
    try:
        train_py.distributed_worker(cfg, None)
        return {**seen, "seconds": time.time() - start}
    finally:
        trainers.BasicTrainer.batch_metrics, trainers.BasicTrainer.train_step = batch_metrics, train_step


def node_local_cache(rank: int, out: Path, second_port: int) -> dict:
    """precompute_ref_log_probs with node-local local_dirs (each rank its own, as on two nodes): a first run fills
    rank 0's cache; a second run with one more eval pair finds it there, and rank 1's disk has nothing. Rank 0
    decides (one pair to compute, fewer than the 2 ranks) and both ranks run the same forwards."""
    local = f"local_dirs=[{out / f'local{rank}'}]"
    args = [*FAST, local, "fsdp.strategy=fsdp2", "precompute_ref_log_probs=true", "collective_timeout_secs=120"]
    for name, extra in (("first", []), ("second", ["n_eval_examples=9"])):
        if name == "second":  # a rank done with the first run early must not meet the other's old store on its port
            os.environ["MASTER_PORT"] = str(second_port)
        cfg, _ = load_config([*args, *extra, f"run_dir={out / name}"])
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            train_py.distributed_worker(cfg, None)
    return {
        "printed": printed.getvalue(),
        "tables": sorted(p.name for p in (out / f"local{rank}").rglob("reference_logps/*.pt")),
    }


def node_local_run_dir(rank: int, run_dir: Path) -> dict:
    """Rank 1 cannot see the run directory rank 0 made (a node-local disk on another node, simulated by hiding
    its files from rank 1): every rank stops at startup with one clear error (before: rank 1 failed writing its
    shards into a directory that did not exist, at the first checkpoint)."""
    is_file = Path.is_file
    hidden = lambda self: False if rank == 1 and str(self).startswith(str(run_dir)) else is_file(self)
    cfg, _ = load_config([*FAST, "fsdp.strategy=fsdp2", f"run_dir={run_dir}"])
    try:
        Path.is_file = hidden
        train_py.distributed_worker(cfg, None)
        return {"completed": True}
    except Exception as e:  # the expected refusal
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        Path.is_file = is_file


def hash_once(rank: int, run_dir: Path, second_port: int) -> dict:
    """As torchrun runs train.py (train.main in every rank): a run with one checkpoint, then a resume that writes a
    second. Each file a checkpoint holds is hashed once over the ranks when written, and once, by rank 0, when a
    resume checks it (before: rank 0 hashed every file at every save, every rank twice at a resume)."""
    import hashlib

    digest, hashed = hashlib.file_digest, []

    def counted(f, *args, **kwargs):
        if (path := Path(f.name).resolve()).is_relative_to(run_dir):  # not the data files the cache fingerprints
            hashed.append(str(path.relative_to(run_dir)).replace(".tmp/", "/"))  # LATEST, step-N.tmp
        return digest(f, *args, **kwargs)

    args = [*FAST, "fsdp.strategy=fsdp2", f"run_dir={run_dir}"]
    phases = {}
    hashlib.file_digest = counted
    try:
        assert train_py.main(args) == 0
        phases["first"], hashed[:] = list(hashed), []
        os.environ["MASTER_PORT"] = str(second_port)  # as node_local_cache: a fresh store for the second run
        assert train_py.main([*args, "n_examples=16", f"resume_from={run_dir}"]) == 0
        phases["resumed"] = list(hashed)
    finally:
        hashlib.file_digest = digest
    return phases


def worker(rank, world_size, ports, out_dir):
    from datetime import timedelta

    utils.RANK0_WORK_TIMEOUT = timedelta(seconds=300)  # a rank left alone by a failed peer ends the test, not CI
    out = Path(out_dir)
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    results = {}
    scenarios = {
        "helpers": lambda: helpers(rank, world_size),
        "slow_rank0": lambda: slow_rank0(rank, out / "slow"),
        "nan_on_rank1": lambda: nan_on_rank1(rank, out / "nan"),
        "node_local_run_dir": lambda: node_local_run_dir(rank, out / "node_local_run"),
        "hash_once": lambda: hash_once(rank, out / "hash_once", ports[-2]),
        "node_local_cache": lambda: node_local_cache(rank, out / "node_local", ports[-1]),
    }
    for (name, scenario), port in zip(scenarios.items(), ports):
        os.environ["MASTER_PORT"] = str(port)
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                results[name] = scenario()
        except Exception as e:  # recorded for the test to show; a failed collective ends the scenario's group
            results[name] = {"error": f"{type(e).__name__}: {e}"[:1000]}
            if dist.is_initialized():
                dist.destroy_process_group()
    torch.save(results, out / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def distributed_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("distributed")
    ports = [utils.get_open_port() for _ in range(8)]  # one a scenario; hash_once's and node_local_cache's second runs
    mp.spawn(worker, args=(2, ports, str(out)), nprocs=2, join=True)
    return out, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_process_group_backend_gives_cpu_tensors_gloo_next_to_nccl():
    assert utils.process_group_backend(cuda=True) == "cpu:gloo,cuda:nccl"
    assert utils.process_group_backend(cuda=False) == "gloo"


def test_helpers_gather_on_the_inputs_device_and_agree_on_one_flag(distributed_results):
    _, ranks = distributed_results
    for r in ranks:
        assert r["helpers"]["backend"] == "cpu:gloo,cuda:gloo"
        assert r["helpers"]["gathered"].tolist() == [0.0, 1.0, 2.0, 10.0, 11.0, 12.0]
        assert r["helpers"]["gathered_device"] == "cpu"
        assert r["helpers"]["all_true_when_one_false"] is False and r["helpers"]["all_true_when_all_true"] is True


def test_slow_rank0_loading_and_hashing_do_not_trip_a_short_collective_timeout(distributed_results):
    out, ranks = distributed_results
    for r in ranks:
        assert r["slow_rank0"]["completed"], r["slow_rank0"].get("error")
        assert r["slow_rank0"]["seconds"] > 2 * SLOW_SECS  # the slow work really happened: load + one checkpoint
    assert (out / "slow" / "LATEST" / "manifest.json").is_file()


def test_one_rank_nan_skips_the_step_on_every_rank(distributed_results):
    """SGD, one step: skipped everywhere means the gathered weights are exactly the initial ones (rank 0 stepping
    its own shard alone would change half of them)."""
    out, ranks = distributed_results
    assert [r["nan_on_rank1"]["nonfinite_steps"] for r in ranks] == [1.0, 1.0]
    initial = AutoModelForCausalLM.from_pretrained(REPO / "toy" / "tiny-llama").state_dict()
    final = torch.load(out / "nan" / "LATEST" / "policy.pt", weights_only=True)["state"]
    assert final.keys() == initial.keys()
    changed = [k for k in initial if not torch.equal(initial[k], final[k])]
    assert not changed, f"parameters changed by a step that one rank skipped: {changed[:4]}"


def test_node_local_reference_cache_is_decided_by_rank_0_and_one_missing_pair_is_shared(distributed_results):
    """Before: rank 1, whose disk lacked the table, ran the reference alone and timed out in its collectives;
    and one missing pair on 2 ranks left rank 1 an empty share (torch.cat([]))."""
    _, results = distributed_results
    for rank in (0, 1):
        assert "error" not in results[rank]["node_local_cache"], results[rank]["node_local_cache"]["error"]
    assert "reference log-probs of test: 8 cached" in results[0]["node_local_cache"]["printed"]
    assert results[1]["node_local_cache"]["tables"] == []  # only rank 0 writes: rank 1's disk never had it


def test_rank_shares_are_equal_and_never_empty():
    assert [reference_cache.rank_share([7], r, 2) for r in (0, 1)] == [[7], [7]]
    assert [reference_cache.rank_share([1, 2, 3, 4, 5], r, 2) for r in (0, 1)] == [[1, 3, 5], [2, 4, 1]]
    assert reference_cache.rank_share([], 0, 2) == []


def test_a_run_dir_that_other_nodes_cannot_see_stops_every_rank_at_startup(distributed_results):
    out, ranks = distributed_results
    for r in ranks:
        assert "ConfigError" in r["node_local_run_dir"].get("error", ""), r["node_local_run_dir"]
        assert (
            "do not see it" in r["node_local_run_dir"]["error"]
            and "shared filesystem" in r["node_local_run_dir"]["error"]
        )
    assert not list((out / "node_local_run").glob("step-*"))  # stopped before training


def test_each_checkpoint_file_is_hashed_once_when_written_and_once_when_resumed(distributed_results):
    out, ranks = distributed_results
    first = sorted(
        str(p.relative_to(out / "hash_once"))
        for p in (out / "hash_once" / "step-8").rglob("*")
        if p.is_file() and p.name != "manifest.json"
    )
    second = [f.replace("step-8", "step-16") for f in first]
    written = [r["hash_once"]["first"] for r in ranks]
    assert sorted(written[0] + written[1]) == first and all(written), written  # shared, each file once
    resumed = [r["hash_once"]["resumed"] for r in ranks]
    assert sorted(f for f in resumed[0] if "step-8" in f) == first  # rank 0 checks the checkpoint resumed from
    assert not [f for f in resumed[1] if "step-8" in f]  # rank 1 does not
    assert sorted(f for r in resumed for f in r if "step-16" in f) == second
