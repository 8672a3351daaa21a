"""Checks that need CUDA (skipped without it): what CPU + gloo cannot show about NCCL, device_map, bf16 and
offloading, CUDA's attention kernels. Most run train.py as a user does (FSDP on one GPU too: a world of 1 over
NCCL); none is the only test of its feature (the CPU tests stand-in devices and gloo ranks:
tests/test_distributed.py, tests/test_trainers.py, tests/test_architectures.py). benchmarks/gpu_check.sh runs the
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
sys.path.insert(0, str(REPO / "tests"))
import architectures  # noqa: E402
import logps  # noqa: E402
import trainers  # noqa: E402
import utils  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

N_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(N_GPUS == 0, reason="needs CUDA")]
needs_2 = pytest.mark.skipif(N_GPUS < 2, reason="needs 2 GPUs (nccl)")
FAST = [
    "datasets=[toy]",
    "model.tokenizer_name_or_path=toy/tiny-llama",
    "model.reference_dtype=float32",
    "loss=dpo",
    "optimizer=AdamW",
    "lr=1e-4",
    "warmup_steps=0",
    "n_epochs=null",
    "max_length=64",
    "max_prompt_length=32",
    "do_first_eval=true",
    "sample_during_eval=false",
    "minimum_log_interval_secs=0",
    "wandb.enabled=false",
]


def train(tmp_path, name, *args, gpus=None):
    """train.py with 3 steps of 4 pairs per GPU used; returns the metrics records (asserting success)."""
    world = 1 if gpus == 1 else N_GPUS
    batch = 4 * world
    env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": "0"} if gpus == 1 else {}))
    run_dir = tmp_path / name
    result = subprocess.run(
        [
            sys.executable,
            "-u",
            str(REPO / "train.py"),
            *FAST,
            f"batch_size={batch}",
            f"eval_batch_size={batch}",
            f"n_eval_examples={batch}",
            f"n_examples={3 * batch}",
            f"eval_every={3 * batch}",
            f"run_dir={run_dir}",
            *args,
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=600,
    )
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
    lines = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_models.py"), "build", str(out), "--size", "tiny"],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    ).stdout.splitlines()
    return dict(line.split("\t") for line in lines)


def test_one_gpu_bf16_autocast(tmp_path):
    train(tmp_path, "bf16", "model=tiny", "fsdp.mixed_precision={param_dtype: bf16}", gpus=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", list(architectures.ARCHITECTURES))
def test_log_prob_paths_and_their_gradients_on_cuda(tmp_path, arch, dtype):
    """tests/test_architectures.py's check on CUDA, gradients included: the tiled head, packed rows and both give
    the log-probs gathered from the model's own forward().logits, and the same gradient of their mean. CUDA's
    attention kernels (SDPA with a block-diagonal mask for packed rows, Gemma2's sliding window and softcapping)
    and bf16 matmuls are what the CPU run cannot show. fp32 without TF32: 1e-5 on log-probs, 1e-4 relative on
    gradients; bf16: 2e-2 on mean log-probs per token (~6.2 nats here) and 5e-2 relative on gradients."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    model = AutoModelForCausalLM.from_pretrained(architectures.build(arch, tmp_path), dtype=dtype).cuda().eval()
    ids = torch.randint(2, architectures.VOCAB, (3, 40), generator=torch.Generator().manual_seed(2)).cuda()
    mask = torch.ones_like(ids)
    mask[1, 30:] = mask[2, 20:] = 0
    labels = torch.where(mask.bool(), ids, -100)
    labels[:, :5] = -100
    inputs = {"input_ids": ids * mask, "attention_mask": mask, "labels": labels}

    def mean_logps_and_grads(compute):
        model.zero_grad(set_to_none=True)
        means = compute()
        means.sum().backward()
        return means.detach().float(), [p.grad.float().clone() for p in model.parameters()]

    def own_logits():
        logits = model(input_ids=ids * mask, attention_mask=mask).logits.float()
        scored = labels[:, 1:] != -100  # output t predicts token t+1
        token = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
        return (token * scored).sum(1) / scored.sum(1)

    expected, expected_grads = mean_logps_and_grads(own_logits)
    value_tol, grad_tol = (1e-5, 1e-4) if dtype == torch.float32 else (2e-2, 5e-2)
    for path, options in {
        "plain": {},
        "tiled": {"tiled": True},
        "packed": {"packed_capacity": 64},
        "packed+tiled": {"packed_capacity": 64, "tiled": True},
    }.items():

        def ours():
            sums, counts, _, *_ = logps.forward_logps(model, inputs, **architectures.seams(model, **options))
            assert counts.tolist() == (labels[:, 1:] != -100).sum(1).tolist(), path
            return sums.float() / counts

        means, grads = mean_logps_and_grads(ours)
        assert (means - expected).abs().max().item() < value_tol, (path, means, expected)
        for g, e in zip(grads, expected_grads):
            assert (g - e).norm().item() <= grad_tol * e.norm().item() + 1e-6, path


@pytest.mark.parametrize("arch", list(architectures.ARCHITECTURES))
def test_prefix_sharing_and_packing_through_flex_attention_on_cuda(tmp_path, arch):
    """On CUDA, packed and shared rows of sdpa models attend through FlexAttention (compiled, block-sparse; Gemma2
    attends eagerly and keeps the dense mask): log-probs and gradients equal the plain path (fp32 without TF32:
    1e-5 on sums, 1e-4 relative on gradients), and FlexAttention ran where it should."""
    from test_architectures import shared_prompt_pairs
    from transformers.integrations import flex_attention

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    model = AutoModelForCausalLM.from_pretrained(architectures.build(arch, tmp_path), dtype=torch.float32).cuda()
    inputs = {k: v.cuda() for k, v in shared_prompt_pairs().items()}
    calls, forward = [], flex_attention.flex_attention_forward
    flex_attention.flex_attention_forward = lambda *a, **k: calls.append(1) or forward(*a, **k)

    def run(options):
        model.zero_grad(set_to_none=True)
        sums, counts, _, *_ = logps.forward_logps(model, inputs, **architectures.seams(model, **options))
        (sums / counts).sum().backward()
        return sums.detach(), [p.grad.clone() for p in model.parameters()]

    try:
        expected, expected_grads = run({})
        for options in (
            {"packed_capacity": 64},
            {"prefix_sharing": True, "tiled": True},
            {"prefix_sharing": True, "packed_capacity": 64},
        ):
            sums, grads = run(options)
            assert (sums - expected).abs().max().item() < 1e-5, options
            for g, e in zip(grads, expected_grads):
                assert (g - e).norm().item() <= 1e-4 * e.norm().item() + 1e-6, options
    finally:
        flex_attention.flex_attention_forward = forward
    flex = model.config._attn_implementation == "sdpa" and model._supports_flex_attn
    assert bool(calls) == flex, (arch, model.config._attn_implementation)


@needs_2
def test_device_map_with_the_tiled_lm_head(tmp_path):
    """trainer=BasicTrainer on several GPUs: inputs on the first, the LM head on the last (issue 11, item 2)."""
    pytest.importorskip("accelerate")
    train(tmp_path, "device_map", "model=tiny", "trainer=BasicTrainer", "tiled_lm_head=true")


@pytest.mark.parametrize(
    "offload", ["fsdp.strategy=fsdp;fsdp.param_offload=true", "fsdp.strategy=fsdp2;fsdp.offload_policy=true"]
)
def test_parameter_offload_with_optimizer_offload(tmp_path, offload):
    """Parameters on CPU, optimizer state offloaded: the second step used to meet state on the GPU (item 4)."""
    train(tmp_path, "offload", "model=tiny", "trainer=FSDPTrainer", *offload.split(";"), "fsdp.optimizer_offload=true")


def test_precomputed_reference_tables_go_through_nccl_runs(tmp_path):
    """The reference tables are gathered as CPU tensors (item 3: cpu:gloo,cuda:nccl)."""
    train(
        tmp_path,
        "precomputed",
        "model=tiny",
        "trainer=FSDPTrainer",
        "fsdp.strategy=fsdp2",
        "precompute_ref_log_probs=true",
        f"local_dirs=[{tmp_path / 'cache'}]",
    )


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen2"])
def test_architectures_train_under_fsdp_in_bf16(tmp_path, models, arch, strategy):
    train(
        tmp_path,
        f"{arch}-{strategy}",
        f"model.name_or_path={models[arch]}",
        "model.block_name=null",
        "trainer=FSDPTrainer",
        f"fsdp.strategy={strategy}",
        "fsdp.mixed_precision={param_dtype: bf16, reduce_dtype: fp32}",
    )


@needs_2
@pytest.mark.skipif(N_GPUS % 2 == 1, reason="sequence-parallel groups of 2 need an even number of GPUs")
@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
def test_ulysses_all_to_all_over_nccl_in_bf16(tmp_path, models, strategy):
    """Sequence parallelism over all GPUs: the all-to-alls and the log-prob sums go through NCCL on CUDA tensors
    (long counts included), in bf16, padded and packed. Correctness against one process: tests/test_ulysses.py."""
    for packed in ("false", "true"):
        train(
            tmp_path,
            f"sp-{strategy}-{packed}",
            f"model.name_or_path={models['llama']}",
            "model.block_name=null",
            "trainer=FSDPTrainer",
            f"fsdp.strategy={strategy}",
            "fsdp.ulysses_sequence_parallel_size=2",
            "fsdp.mixed_precision={param_dtype: bf16, reduce_dtype: fp32}",
            f"padding_free={packed}",
        )


def _collectives(rank, world_size, port, out):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    torch.cuda.set_device(rank)
    utils.init_distributed(60, cuda=True)
    try:
        cpu = utils.all_gather_if_needed(torch.tensor([float(rank)]), rank, world_size)
        gpu = utils.all_gather_if_needed(torch.tensor([float(rank)], device="cuda"), rank, world_size)
        flag = utils.all_ranks_true(rank == 0, torch.device("cuda"))
        torch.save(
            {"cpu": (cpu.tolist(), str(cpu.device)), "gpu": (gpu.tolist(), gpu.device.type), "flag": flag},
            Path(out) / f"rank{rank}.pt",
        )
    finally:
        utils.destroy_distributed()


@needs_2
def test_cpu_and_cuda_tensors_both_go_through_the_default_group(tmp_path):
    mp.spawn(_collectives, args=(2, utils.get_open_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        seen = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert seen == {"cpu": ([0.0, 1.0], "cpu"), "gpu": ([0.0, 1.0], "cuda"), "flag": False}


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
def test_bf16_reference_computes_as_the_policy_and_step_0_is_ln2(tmp_path, strategy):
    """fsdp.mixed_precision=bf16: the reference computes in bf16 as the policy does (its weights loaded in fp32), so
    the first evaluation (policy = reference) is ln 2 to fp32 rounding, not to bf16's 1e-2 (issue 26, item 9)."""
    records = train(
        tmp_path,
        f"bf16-{strategy}",
        "model=tiny",
        "trainer=FSDPTrainer",
        f"fsdp.strategy={strategy}",
        "fsdp.mixed_precision=bf16",
        gpus=1,
    )
    assert abs(next(r for r in records if "loss/eval" in r)["loss/eval"] - math.log(2)) < 1e-6


@pytest.mark.parametrize("strategy", ["fsdp;fsdp.use_orig_params=true", "fsdp2"])
def test_lora_under_fsdp_samples_at_evaluation_over_nccl(tmp_path, strategy):
    """LoRA under FSDP with the default sampling at evaluation: peft's generate goes through the root unit on one
    GPU over NCCL (issue 26, item 1; the CPU test: tests/test_fsdp.py on 2 gloo ranks)."""
    pytest.importorskip("peft")
    records = train(
        tmp_path,
        "lora",
        "model=tiny",
        "trainer=FSDPTrainer",
        *f"fsdp.strategy={strategy}".split(";"),
        "lora.r=4",
        "sample_during_eval=true",
        "n_eval_model_samples=4",
        gpus=1,
    )
    assert all("samples/policy_rule_rate" in r for r in records if "loss/eval" in r)


def _fsdp1_settings(rank, port, out):
    """A world of 1 over NCCL: FSDPTrainer's FSDP1 wrappers, as train.py builds them."""
    import config_loader
    import train as train_py

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    torch.cuda.set_device(0)
    utils.init_distributed(60, cuda=True)
    try:
        cfg, _ = config_loader.load_config(
            [
                *FAST,
                "model=tiny",
                "trainer=FSDPTrainer",
                "fsdp.strategy=fsdp",
                "batch_size=4",
                "eval_batch_size=4",
                "n_examples=4",
                f"run_dir={out}/run",
            ]
        )
        tokenizer, policy, reference = train_py.load_models(cfg)
        trainer = trainers.FSDPTrainer(policy, cfg, cfg.seed, f"{out}/run", reference, 0, 1, tokenizer)
        torch.save(
            {"policy": trainer.policy.limit_all_gathers, "reference": trainer.reference_model.limit_all_gathers},
            Path(out) / "settings.pt",
        )
    finally:
        utils.destroy_distributed()


def test_fsdp1_limits_all_gathers_on_gpus(tmp_path):
    """On CUDA the rate limiter is on (issue 26, item 11): without it the CPU issues all-gathers far ahead of the
    GPU and gathered memory grows; torch advises it off only for CPU-bound runs (gloo on CPU keeps it off)."""
    mp.spawn(_fsdp1_settings, args=(utils.get_open_port(), str(tmp_path)), nprocs=1, join=True)
    assert torch.load(tmp_path / "settings.pt") == {"policy": True, "reference": True}
