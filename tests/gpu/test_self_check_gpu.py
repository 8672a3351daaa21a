"""self_check.py on CUDA (skipped without it): the checks pass with CUDA's kernels (the tiled head's bf16 matmuls,
FlexAttention's packed and shared rows, NCCL's collectives) in fp32 and bf16, under BasicTrainer and FSDP2 (a world
of 1 over NCCL), and a head the tiled path does not reproduce stops the run with exit code 4 before any step.

    python -m pytest tests/gpu/test_self_check_gpu.py -q      # benchmarks/gpu_check.sh runs it too
"""

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
import self_check  # noqa: E402
import train as train_py  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
FAST = [
    "model=tiny",
    "datasets=[toy]",
    "loss=dpo",
    "optimizer=AdamW",
    "lr=1e-4",
    "warmup_steps=0",
    "batch_size=8",
    "eval_batch_size=8",
    "n_eval_examples=8",
    "n_epochs=null",
    "n_examples=16",
    "eval_every=16",
    "max_length=64",
    "max_prompt_length=32",
    "do_first_eval=false",
    "sample_during_eval=false",
    "wandb.enabled=false",
    "tiled_lm_head=true",  # the head check runs with the tiled head (off by default)
]
BF16 = "fsdp.mixed_precision={param_dtype: bf16}"
SETTINGS = {  # name: (arguments, the checks that must run)
    "basic_fp32_shared_packed": (["padding_free=true", "prefix_sharing=true"], {"head", "layout", "reference"}),
    "basic_bf16_packed": ([BF16, "padding_free=true"], {"head", "layout", "reference"}),
    "fsdp2_bf16_precomputed_shared": (
        ["trainer=FSDPTrainer", "fsdp.strategy=fsdp2", BF16, "prefix_sharing=true", "precompute_ref_log_probs=true"],
        {"head", "layout", "cache", "reference"},
    ),
    "fsdp1_bf16_checkpointed": (
        ["trainer=FSDPTrainer", "fsdp.strategy=fsdp", BF16, "activation_checkpointing=true"],
        {"head", "reference"},
    ),
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_the_checks_pass_on_cuda(tmp_path, name):
    args, expected = SETTINGS[name]
    run_dir = tmp_path / name
    result = subprocess.run(
        [sys.executable, "-u", str(REPO / "train.py"), *FAST, f"local_dirs=[{tmp_path}]", f"run_dir={run_dir}", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
        env=dict(os.environ, CUDA_VISIBLE_DEVICES="0"),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((run_dir / self_check.REPORT).read_text())
    found = {c["check"]: c for c in report["checks"]}
    assert report["passed"] and set(found) == expected, report
    print("\n".join(line for line in result.stdout.splitlines() if line.startswith("self-check")))


def test_a_scaled_head_stops_the_run_on_cuda(tmp_path, monkeypatch):
    """A 1.25 logit multiplier in the model's own head: exit 4 naming tiled_lm_head=false, on the GPU's kernels."""
    load = train_py.load_models

    def load_models(*args, **kwargs):
        tokenizer, policy, reference = load(*args, **kwargs)
        for model in filter(None, (policy, reference)):
            model.get_output_embeddings().register_forward_hook(lambda module, inputs, out: out * 1.25)
        return tokenizer, policy, reference

    monkeypatch.setattr(train_py, "load_models", load_models)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = train_py.main([*FAST, f"local_dirs=[{tmp_path}]", f"run_dir={tmp_path / 'run'}", BF16])
    assert code == 4 and "self-check failed: head" in out.getvalue() and "set tiled_lm_head=false" in out.getvalue()
