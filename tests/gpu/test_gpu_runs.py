"""Checks that need CUDA (skipped without it): what CPU + gloo cannot show about NCCL, device_map, bf16 and
offloading. Each runs train.py as a user does; none is the only test of its feature (the CPU tests stand-in
devices and gloo ranks: tests/test_distributed.py, tests/test_trainers.py). benchmarks/gpu_check.sh runs the
throughput matrix on a GPU node.

    python -m pytest tests/gpu -q
"""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
import utils  # noqa: E402

N_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(N_GPUS == 0, reason="needs CUDA")]
needs_2 = pytest.mark.skipif(N_GPUS < 2, reason="needs 2 GPUs (nccl)")
FAST = ["datasets=[toy]", "model.tokenizer_name_or_path=toy/tiny-llama", "model.reference_dtype=float32", "loss=dpo",
        "optimizer=AdamW", "lr=1e-4", "warmup_steps=0", "n_epochs=null", "max_length=64", "max_prompt_length=32",
        "do_first_eval=true", "sample_during_eval=false", "minimum_log_interval_secs=0", "wandb.enabled=false"]


def train(tmp_path, name, *args, gpus=None):
    """train.py with 3 steps of 4 pairs per GPU used; returns the metrics records (asserting success)."""
    world = 1 if gpus == 1 else N_GPUS
    batch = 4 * world
    env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": "0"} if gpus == 1 else {}))
    run_dir = tmp_path / name
    result = subprocess.run([sys.executable, "-u", str(REPO / "train.py"), *FAST, f"batch_size={batch}",
                             f"eval_batch_size={batch}", f"n_eval_examples={batch}", f"n_examples={3 * batch}",
                             f"eval_every={3 * batch}", f"run_dir={run_dir}", *args],
                            capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss/train"] for r in records if "loss/train" in r]
    assert len(losses) == 3 and all(v is not None and math.isfinite(v) for v in losses), losses
    first_eval = next(r for r in records if "loss/eval" in r)
    assert abs(first_eval["loss/eval"] - math.log(2)) < 1e-2  # policy = reference at step 0 (bf16: 1e-2)
    return records


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny random GPT-2 (tied), Llama, Qwen2 (tied, qkv bias), as benchmarks/gpu_check.sh builds them."""
    out = tmp_path_factory.mktemp("models")
    lines = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_models.py"), "build", str(out), "--size", "tiny"],
                           capture_output=True, text=True, check=True, cwd=REPO).stdout.splitlines()
    return dict(line.split("\t") for line in lines)


def test_one_gpu_bf16_autocast(tmp_path):
    train(tmp_path, "bf16", "model=tiny", "fsdp.mixed_precision={param_dtype: bf16}", gpus=1)


@needs_2
def test_device_map_with_the_tiled_lm_head(tmp_path):
    """trainer=BasicTrainer on several GPUs: inputs on the first, the LM head on the last (issue 11, item 2)."""
    pytest.importorskip("accelerate")
    train(tmp_path, "device_map", "model=tiny", "trainer=BasicTrainer", "tiled_lm_head=true")


@needs_2
@pytest.mark.parametrize("offload", ["fsdp.strategy=fsdp;fsdp.param_offload=true", "fsdp.strategy=fsdp2;fsdp.offload_policy=true"])
def test_parameter_offload_with_optimizer_offload(tmp_path, offload):
    """Parameters on CPU, optimizer state offloaded: the second step used to meet state on the GPU (item 4)."""
    train(tmp_path, "offload", "model=tiny", "trainer=FSDPTrainer", *offload.split(";"), "fsdp.optimizer_offload=true")


@needs_2
def test_precomputed_reference_tables_go_through_nccl_runs(tmp_path):
    """The reference tables are gathered as CPU tensors (item 3: cpu:gloo,cuda:nccl)."""
    train(tmp_path, "precomputed", "model=tiny", "trainer=FSDPTrainer", "fsdp.strategy=fsdp2", "precompute_ref_log_probs=true",
          f"local_dirs=[{tmp_path / 'cache'}]")


@needs_2
@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen2"])
def test_architectures_train_under_fsdp_in_bf16(tmp_path, models, arch, strategy):
    train(tmp_path, f"{arch}-{strategy}", f"model.name_or_path={models[arch]}", "model.block_name=null", "trainer=FSDPTrainer",
          f"fsdp.strategy={strategy}", "fsdp.mixed_precision={param_dtype: bf16, reduce_dtype: fp32}")


@needs_2
@pytest.mark.skipif(N_GPUS % 2 == 1, reason="sequence-parallel groups of 2 need an even number of GPUs")
@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
def test_ulysses_all_to_all_over_nccl_in_bf16(tmp_path, models, strategy):
    """Sequence parallelism over all GPUs: the all-to-alls and the log-prob sums go through NCCL on CUDA tensors
    (long counts included), in bf16, padded and packed. Correctness against one process: tests/test_ulysses.py."""
    for packed in ("false", "true"):
        train(tmp_path, f"sp-{strategy}-{packed}", f"model.name_or_path={models['llama']}", "model.block_name=null",
              "trainer=FSDPTrainer", f"fsdp.strategy={strategy}", "fsdp.ulysses_sequence_parallel_size=2",
              "fsdp.mixed_precision={param_dtype: bf16, reduce_dtype: fp32}", f"padding_free={packed}")


def _collectives(rank, world_size, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    torch.cuda.set_device(rank)
    utils.init_distributed(60, cuda=True)
    try:
        cpu = utils.all_gather_if_needed(torch.tensor([float(rank)]), rank, world_size)
        gpu = utils.all_gather_if_needed(torch.tensor([float(rank)], device="cuda"), rank, world_size)
        flag = utils.all_ranks_true(rank == 0, torch.device("cuda"))
        torch.save({"cpu": (cpu.tolist(), str(cpu.device)), "gpu": (gpu.tolist(), gpu.device.type), "flag": flag},
                   Path(out) / f"rank{rank}.pt")
    finally:
        utils.destroy_distributed()


@needs_2
def test_cpu_and_cuda_tensors_both_go_through_the_default_group(tmp_path):
    mp.spawn(_collectives, args=(2, utils.get_open_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        seen = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert seen == {"cpu": ([0.0, 1.0], "cpu"), "gpu": ([0.0, 1.0], "cuda"), "flag": False}
