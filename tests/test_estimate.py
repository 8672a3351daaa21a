"""`train.py --estimate`: from config.json alone (no weights, no torch), parameter counts exact for known families."""
import json
import shutil
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import config
import estimate
import losses
from test_train import REPO

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, vocab_size=300)


@pytest.mark.parametrize("model_type,extra", [
    ("llama", {}), ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 2}),
    ("llama", {"attention_bias": True, "mlp_bias": True}), ("mistral", {"num_key_value_heads": 1}),
    ("qwen2", {"num_key_value_heads": 2}), ("qwen3", {"head_dim": 32}),
    ("gpt2", {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128}),
    ("gpt_neox", {"max_position_embeddings": 128}),
])
def test_parameter_count_equals_the_real_model(model_type, extra):
    """The count from config.json equals sum(numel) of the model transformers builds from it (on meta: no memory)."""
    cfg = AutoConfig.for_model(model_type, **TINY, **extra)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    real = sum(p.numel() for p in model.parameters())  # tied weights are one parameter
    assert estimate.geometry(json.loads(cfg.to_json_string())).params == real


def test_reference_rule_agrees_with_the_loss_registry():
    for name in losses.LOSSES:
        for free in (False, True):
            cfg, _ = config.load_config([f"loss={name}" if (REPO / "config" / "loss" / f"{name}.yaml").exists()
                                         else f"loss.name={name}", f"loss.reference_free={str(free).lower()}"])
            assert estimate._needs_reference(cfg) == losses.needs_reference(cfg.loss_names, free), name


def test_memory_follows_the_geometry():
    """Sharding over 2 ranks halves the per-rank weights; checkpointing and precomputing the reference lower the peak."""
    model = json.loads((REPO / "toy" / "tiny-llama" / "config.json").read_text())
    est = lambda *args, world=1: estimate.estimate(config.load_config(["loss=dpo", *args])[0], model, world)
    base = est()
    assert est("trainer=FSDPTrainer", world=2)["weights"] == base["weights"] / 2
    assert est("activation_checkpointing=true")["activations"] < base["activations"]
    assert est("precompute_ref_log_probs=true")["reference weights"] == 0 < base["reference weights"]
    assert est("max_length=1024")["activations"] == pytest.approx(2 * base["activations"], rel=0.05)
    # Ulysses on 2 ranks, one pair per micro-batch: each rank holds half of it (SP=1: a whole pair per rank)
    fsdp = ["trainer=FSDPTrainer", "batch_size=2", "eval_batch_size=2"]
    whole = est(*fsdp, world=2)
    split = est(*fsdp, "gradient_accumulation_steps=2", "fsdp.ulysses_sequence_parallel_size=2", world=2)
    assert split["micro-batch tokens"] == whole["micro-batch tokens"] / 2
    assert split["activations"] == pytest.approx(whole["activations"] / 2)


def test_tile_constants_agree_with_losses():
    """estimate.py cannot import losses (torch): its copies of the tile sizes must be the same numbers."""
    assert (estimate.CHUNK_ROWS, estimate.HEAD_TILE_BYTES) == (losses.DEFAULT_CHUNK_SIZE, losses.HEAD_TILE_BYTES)
    model = json.loads((REPO / "toy" / "tiny-llama" / "config.json").read_text())
    big = dict(model, vocab_size=128256)
    est = estimate.estimate(config.load_config(["loss=dpo", "max_length=2048", "max_prompt_length=1024"])[0], big, 1)
    assert est["logits"] == 4 * losses.head_tile_rows(128256) * 128256 * 4  # 261-row tiles, not 1024


def test_estimate_reads_only_config_json_imports_no_torch_and_takes_under_3_seconds(tmp_path):
    """A model directory with config.json and the tokenizer but no weights: a run could not load, the estimate runs."""
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REPO / "toy" / "tiny-llama" / name, model / name)
    code = ("import sys, time; t = time.time(); sys.path.insert(0, sys.argv[1]); import train; "
            "rc = train.main(sys.argv[2:]); assert 'torch' not in sys.modules, 'torch imported'; "
            "print(f'seconds {time.time() - t:.3f}'); sys.exit(rc)")
    start = time.time()
    result = subprocess.run([sys.executable, "-c", code, str(REPO), "loss=dpo", "trainer=FSDPTrainer", "n_workers=2",
                             f"model.name_or_path={model}", "--estimate", "gpu=H100"], capture_output=True, text=True)
    elapsed = time.time() - start
    assert result.returncode == 0, result.stderr
    assert elapsed < 3.0, f"--estimate took {elapsed:.2f} s"
    out = result.stdout
    assert "FSDPTrainer x 2 rank(s)" in out and "no weights read" in out and "on H100" in out and "fits" in out
    for name in ("weights", "gradients", "optimizer state", "activations", "peak", "FLOPs per step"):
        assert name in out, name
    bad = subprocess.run([sys.executable, str(REPO / "train.py"), f"model.name_or_path={model}", "--estimate", "gpu=Z80"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "gpu=Z80: unknown device; expected one of H200, H100" in bad.stderr
