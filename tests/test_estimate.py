"""`train.py --estimate`: from config.json alone (no weights), parameter counts exact for known families."""
import json
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import config
import estimate
import logps
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


def test_tiled_head_logits_follow_the_tile_size():
    """At Llama-3's vocabulary the tiled head's tiles shrink to HEAD_TILE_BYTES: the estimate counts those rows."""
    model = json.loads((REPO / "toy" / "tiny-llama" / "config.json").read_text())
    big = dict(model, vocab_size=128256)
    est = estimate.estimate(config.load_config(["loss=dpo", "max_length=2048", "max_prompt_length=1024"])[0], big, 1)
    assert est["logits"] == 4 * logps.head_tile_rows(128256) * 128256 * 4  # 261-row tiles, not 1024


def test_estimate_reads_only_config_json(tmp_path):
    """A model directory with config.json and the tokenizer but no weights: a run could not load, the estimate runs
    (the loss registry it validates against imports torch; no weights, no tokenizer, no data are read)."""
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REPO / "toy" / "tiny-llama" / name, model / name)
    result = subprocess.run([sys.executable, str(REPO / "train.py"), "loss=dpo", "trainer=FSDPTrainer", "n_workers=2",
                             f"model.name_or_path={model}", "--estimate", "gpu=H100"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "FSDPTrainer x 2 rank(s)" in out and "no weights read" in out and "on H100" in out and "fits" in out
    for name in ("weights", "gradients", "optimizer state", "activations", "peak", "FLOPs per step"):
        assert name in out, name
    bad = subprocess.run([sys.executable, str(REPO / "train.py"), f"model.name_or_path={model}", "--estimate", "gpu=Z80"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "gpu=Z80: unknown device; expected one of H200, H100" in bad.stderr


TOY = json.loads((REPO / "toy" / "tiny-llama" / "config.json").read_text())
BIG_VOCAB = dict(TOY, vocab_size=128256)  # a Llama-3 vocabulary on the toy blocks: the root unit dominates


def est(*args, model=TOY, world=1):
    return estimate.estimate(config.load_config(["loss=dpo", *args])[0], model, world)


def static(e):
    return e["weights"] + e["reference weights"] + e["optimizer state"]


@pytest.mark.parametrize("fsdp", [[], ["trainer=FSDPTrainer"]])
def test_accumulation_holds_the_gradients_through_the_later_micro_batches(fsdp):
    """4 micro-batches of 2 pairs = 1 micro-batch of 2 pairs, plus the gradients of the earlier micro-batches (each
    rank's shard under FSDP, which reduce-scatters after every micro-batch), held through the later ones."""
    world = 2 if fsdp else 1
    one = est(*fsdp, f"batch_size={2 * world}", world=world)
    four = est(*fsdp, f"batch_size={8 * world}", "gradient_accumulation_steps=4", world=world)
    assert four["micro-batch tokens"] == one["micro-batch tokens"]
    assert four["phases"]["backward"] == one["phases"]["backward"] + one["gradients"]
    assert four["accumulated gradients"] == one["gradients"]
    budget = est(*fsdp, f"batch_size={2 * world}", "max_tokens_per_microbatch=2048", world=world)
    assert budget["accumulated gradients"] == one["gradients"]  # a token budget can split a step too


@pytest.mark.parametrize("strategy,grad_bytes", [("fsdp2", 4), ("fsdp", 2)])
def test_no_sync_accumulation_holds_the_whole_unsharded_gradients(strategy, grad_bytes):
    """no_sync_accumulation: between micro-batches every rank holds the whole model's unsharded gradients, in the
    reduce dtype under FSDP2 (fp32 by default), in the compute dtype (param_dtype) under FSDP1."""
    args = ["trainer=FSDPTrainer", f"fsdp.strategy={strategy}", "fsdp.mixed_precision=bf16", "batch_size=16"]
    synced = est(*args, "gradient_accumulation_steps=4", world=4)
    unsynced = est(*args, "gradient_accumulation_steps=4", "no_sync_accumulation=true", world=4)
    P = synced["parameters"]
    assert unsynced["phases"]["backward"] - synced["phases"]["backward"] == P * grad_bytes - P * 4 / 4
    assert synced["accumulated gradients"] == P * 4 / 4 and unsynced["accumulated gradients"] == P * grad_bytes
    assert est(*args, "no_sync_accumulation=true", world=4)["accumulated gradients"] == 0  # one micro-batch


def test_reshard_after_forward_false_keeps_the_whole_policy_gathered_but_not_the_reference():
    args = ["trainer=FSDPTrainer", "fsdp.mixed_precision=bf16"]
    kept = est(*args, "fsdp.reshard_after_forward=false", world=2)
    g, default = estimate.geometry(TOY), est(*args, world=2)
    assert kept["FSDP gathered"] == g.params * 2 + g.block_params * 2  # every unit, and one block's gradient
    assert (kept["phases"]["backward"] - default["phases"]["backward"]
            == kept["FSDP gathered"] - default["FSDP gathered"])
    pre = ["precompute_ref_log_probs=true", *args]  # the reference reshards after its forward whatever the knob
    assert (est(*pre, "fsdp.reshard_after_forward=false", world=2)["phases"]["reference pass"]
            == est(*pre, world=2)["phases"]["reference pass"])


def test_null_reference_dtype_is_the_policys(tmp_path):
    """config/model/blank_model.yaml sets reference_dtype: null (the policy's dtype), which --estimate must read."""
    shutil.copy(REPO / "toy" / "tiny-llama" / "config.json", tmp_path / "config.json")
    cfg, _ = config.load_config(["loss=dpo", "model=blank_model", f"model.name_or_path={tmp_path}",
                                 "model.block_name=LlamaDecoderLayer", "model.policy_dtype=bfloat16"])
    e = estimate.estimate(cfg, TOY, 1)
    assert e["reference weights"] == e["weights"] == e["parameters"] * 2
    assert "peak" in estimate.report(cfg, str(tmp_path), 1)


def test_lm_head_backward_workspace():
    """The tiled head's backward holds the (V, H) fp32 gradient accumulator of the head weight, and beside it a (V, H)
    temporary in the compute dtype when that is not fp32; the plain path holds the logits' gradient."""
    head = 128256 * TOY["hidden_size"]
    for mp, extra in (([], 0), (["fsdp.mixed_precision=bf16"], head * 2)):
        e = est(*mp, model=BIG_VOCAB)
        assert e["phases"]["backward"] - static(e) - e["activations"] - e["logits"] == head * 4 + extra
    # the plain path keeps the logits, and beside them the logits' gradient (more than the chunked entropy's work)
    plain = est("tiled_lm_head=false", "fsdp.entropy_from_logits_with_chunking=true", "max_length=2048",
                "max_prompt_length=1024", model=BIG_VOCAB)
    assert plain["logits"] == 2 * plain["micro-batch tokens"] * 128256 * 4
    assert plain["phases"]["backward"] - static(plain) - plain["activations"] == plain["logits"]


def test_fsdp2_root_reduce_scatter_and_the_online_reference_root():
    """Under FSDP2 the end of backward holds the root unit's unsharded gradients and an fp32 reduce-scatter input
    buffer; an online reference's gathered root (embeddings, final norm, head) coexists with the policy's saved
    activations during the reference forward."""
    g = estimate.geometry(BIG_VOCAB)
    root = g.embed_params + g.head_params
    short = ["trainer=FSDPTrainer", "batch_size=2", "max_length=16", "max_prompt_length=8"]  # the end dominates
    fsdp1, fsdp2 = (est(*short, f"fsdp.strategy={s}", model=BIG_VOCAB, world=2) for s in ("fsdp", "fsdp2"))
    assert fsdp2["phases"]["backward"] > static(fsdp2) + fsdp2["FSDP gathered"] + fsdp2["gradients"] + root * 8
    assert fsdp1["root reduce-scatter"] == 0 and fsdp2["root reduce-scatter"] == root * (4 + 4)
    online = est("trainer=FSDPTrainer", model=BIG_VOCAB, world=2)  # the start dominates
    assert online["phases"]["backward"] - static(online) - online["FSDP gathered"] == (
        online["activations"] + online["logits"] + root * 4)
    assert online["reference root"] == root * 4 > online["LM-head backward"]
    assert est("trainer=FSDPTrainer", "precompute_ref_log_probs=true", model=BIG_VOCAB, world=2)["reference root"] == 0


def test_packed_rows_mask():
    """padding_free builds a boolean (R, 1, T, T) mask of whole rows on every rank, with or without Ulysses."""
    fsdp = ["trainer=FSDPTrainer", "batch_size=2", "gradient_accumulation_steps=2"]
    for sp in (1, 2):
        args = [*fsdp, f"fsdp.ulysses_sequence_parallel_size={sp}"]
        packed, padded = est(*args, "padding_free=true", world=2), est(*args, world=2)
        rows = 2 // (2 // sp) // 2 * 2  # pairs per micro-batch of the group, two sequences each
        assert packed["activations"] - padded["activations"] == rows * 512 ** 2
