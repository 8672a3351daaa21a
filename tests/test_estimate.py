"""`train.py --estimate`: from config.json alone (no weights), parameter counts exact for known families."""

import dataclasses
import json
import re
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import config
import config_loader
import estimate
import tiled_head
import utils
from test_train import REPO

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, vocab_size=300)


@pytest.mark.parametrize(
    "model_type,extra",
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 2}),
        ("llama", {"attention_bias": True, "mlp_bias": True}),
        ("mistral", {"num_key_value_heads": 1}),
        ("qwen2", {"num_key_value_heads": 2}),
        ("qwen3", {"head_dim": 32}),
        ("gpt2", {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128}),
        ("gpt_neox", {"max_position_embeddings": 128}),
    ],
)
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
    est = lambda *args, world=1: estimate.estimate(config_loader.load_config(["loss=dpo", *args])[0], model, world)
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
    est = estimate.estimate(
        config_loader.load_config(["loss=dpo", "tiled_lm_head=true", "max_length=2048", "max_prompt_length=1024"])[0],
        big,
        1,
    )
    assert est["logits"] == 4 * tiled_head.head_tile_rows(128256) * 128256 * 4  # 261-row tiles, not 1024


def test_estimate_reads_only_config_json(tmp_path):
    """A model directory with config.json and the tokenizer but no weights: a run could not load, the estimate runs
    (the loss registry it validates against imports torch; no weights, no tokenizer, no data are read)."""
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REPO / "toy" / "tiny-llama" / name, model / name)
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "train.py"),
            "loss=dpo",
            "trainer=FSDPTrainer",
            "n_workers=2",
            f"model.name_or_path={model}",
            "--estimate",
            "gpu=H100",
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "FSDPTrainer x 2 rank(s)" in out and "no weights read" in out and "on H100" in out and "fits" in out
    for name in ("weights", "gradients", "optimizer state", "activations", "peak", "FLOPs per step"):
        assert name in out, name
    bad = subprocess.run(
        [sys.executable, str(REPO / "train.py"), f"model.name_or_path={model}", "--estimate", "gpu=Z80"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "gpu=Z80: unknown device; expected one of H200, H100" in bad.stderr


TOY = json.loads((REPO / "toy" / "tiny-llama" / "config.json").read_text())
BIG_VOCAB = dict(TOY, vocab_size=128256)  # a Llama-3 vocabulary on the toy blocks: the root unit dominates


def est(*args, model=TOY, world=1, device="cuda"):
    return estimate.estimate(config_loader.load_config(["loss=dpo", *args])[0], model, world, device)


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
    assert (
        kept["phases"]["backward"] - default["phases"]["backward"] == kept["FSDP gathered"] - default["FSDP gathered"]
    )
    pre = ["precompute_ref_log_probs=true", *args]  # the reference reshards after its forward whatever the knob
    assert (
        est(*pre, "fsdp.reshard_after_forward=false", world=2)["phases"]["reference pass"]
        == est(*pre, world=2)["phases"]["reference pass"]
    )


def test_null_reference_dtype_is_the_policys(tmp_path):
    """config/model/blank_model.yaml sets reference_dtype: null (the policy's dtype), which --estimate must read."""
    shutil.copy(REPO / "toy" / "tiny-llama" / "config.json", tmp_path / "config.json")
    cfg, _ = config_loader.load_config(
        [
            "loss=dpo",
            "model=blank_model",
            f"model.name_or_path={tmp_path}",
            "model.block_name=LlamaDecoderLayer",
            "model.policy_dtype=bfloat16",
        ]
    )
    e = estimate.estimate(cfg, TOY, 1)
    assert e["reference weights"] == e["weights"] == e["parameters"] * 2
    assert "peak" in estimate.report(cfg, str(tmp_path), 1)


def test_lm_head_backward_workspace():
    """The tiled head's backward holds the (V, H) fp32 gradient accumulator of the head weight, and beside it a (V, H)
    temporary in the compute dtype when that is not fp32; the plain path holds the logits' gradient."""
    head = 128256 * TOY["hidden_size"]
    for mp, extra in (([], 0), (["fsdp.mixed_precision=bf16"], head * 2)):
        e = est("tiled_lm_head=true", *mp, model=BIG_VOCAB)
        assert e["phases"]["backward"] - static(e) - e["activations"] - e["logits"] == head * 4 + extra
    # the plain path keeps the fp32 log-softmax, and beside it at backward's start the fp32 gradients of it and its input
    plain = est("max_length=2048", "max_prompt_length=1024", model=BIG_VOCAB)
    assert plain["logits"] == 3 * plain["micro-batch tokens"] * 128256 * 4
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
        online["activations"] + online["logits"] + root * 4
    )
    assert online["reference root"] == root * 4 > online["LM-head backward"]
    assert est("trainer=FSDPTrainer", "precompute_ref_log_probs=true", model=BIG_VOCAB, world=2)["reference root"] == 0


def saved_per_layer(model_type: str, extra: dict, args: list, rows: int = 2, length: int = 64) -> float:
    """Bytes autograd keeps for one decoder layer of a (rows, length) forward, in the regime `args` sets (bf16
    weights, autocast, LoRA, packed rows' dense mask): a 2-layer model's saved tensors minus a 1-layer one's, each
    storage counted once, parameters left out (an autocast's weight copies are in)."""
    cfg = config_loader.load_config(["loss=dpo", *args])[0]
    autocast = cfg.fsdp.mixed_precision and cfg.trainer == "BasicTrainer"
    kept = []
    for layers in (2, 1):
        torch.manual_seed(0)
        spec = AutoConfig.for_model(model_type, **{**TINY, **extra, "num_hidden_layers": layers})
        model = AutoModelForCausalLM.from_config(spec, attn_implementation="sdpa")
        utils.disable_dropout(model)
        model = model.bfloat16() if config.DTYPES[cfg.fsdp.model_dtype] == "bfloat16" else model
        if cfg.lora.r:
            import peft

            model = peft.get_peft_model(
                model,
                peft.LoraConfig(
                    r=cfg.lora.r,
                    target_modules=cfg.lora.target_modules,
                    lora_dropout=cfg.lora.dropout,
                    task_type="CAUSAL_LM",
                ),
            )
        model = model.bfloat16() if cfg.fsdp.mixed_precision and not autocast else model  # FSDP casts every parameter
        backbone = model.get_base_model().base_model if cfg.lora.r else model.base_model
        mask = torch.ones(length, length, dtype=torch.bool).tril().expand(rows, 1, length, length).clone()
        storages, params = {}, {p.untyped_storage().data_ptr() for p in model.parameters()}

        def pack(t, storages=storages):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with (
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
            torch.autocast("cpu", torch.bfloat16, enabled=bool(autocast)),
        ):
            backbone(
                input_ids=torch.randint(0, 300, (rows, length)),
                attention_mask=mask if cfg.padding_free else None,
                use_cache=False,
            )
        kept.append(sum(n for ptr, n in storages.items() if ptr not in params))
    return kept[0] - kept[1]


GQA = {"num_key_value_heads": 2}
BF16, AUTOCAST, FSDP_BF16 = (
    ["model.policy_dtype=bfloat16"],
    ["fsdp.mixed_precision=bf16"],
    ["trainer=FSDPTrainer", "fsdp.strategy=fsdp2", "fsdp.mixed_precision=bf16", "batch_size=2"],
)  # a pair per rank
GPT2, NEOX = {"n_positions": 128, "bos_token_id": 0, "eos_token_id": 0}, {"max_position_embeddings": 128}


@pytest.mark.parametrize(
    "model_type,extra,args,over",
    [
        ("llama", GQA, [], 1.0),
        ("llama", GQA, BF16, 1.0),
        ("llama", GQA, AUTOCAST, 1.0),
        ("llama", GQA, FSDP_BF16, 1.0),
        ("llama", GQA, ["padding_free=true"], 1.0),
        ("llama", GQA, ["padding_free=true", *BF16], 1.0),
        ("qwen3", {**GQA, "head_dim": 32}, BF16, 1.0),
        ("qwen3", {**GQA, "head_dim": 32}, AUTOCAST, 1.0),
        ("gpt2", GPT2, [], 1.0),
        ("gpt2", GPT2, BF16, 1.0),
        ("gpt2", GPT2, AUTOCAST, 1.0),
        ("gpt_neox", NEOX, BF16, 1.0),
        ("gpt_neox", NEOX, [], 1.0),
        # LoRA: exact with all-linear; where lora_A keeps a copy of its input (cast to the fp32 adapters of a bf16 block,
        # or dropped out), the frozen linears' own inputs are no longer kept, which the estimate still counts
        ("llama", GQA, ["lora.r=4"], 1.0),
        ("llama", GQA, ["lora.r=4", *FSDP_BF16], 1.0),
        ("llama", GQA, ["lora.r=4", *BF16], 1.15),
        ("llama", GQA, ["lora.r=4", "lora.dropout=0.1"], 1.15),
    ],
)
def test_saved_activations_are_what_a_real_block_keeps(model_type, extra, args, over):
    """Per layer: the bytes of every tensor autograd saves in a real block, in fp32, bf16 (FSDP's mixed precision
    casts the weights), under autocast (fp32 weights: the norms stay fp32, each linear keeps its own bf16 input and
    weight), with LoRA, and with packed rows' dense mask on CPU (a float copy per layer, k and v on every head)."""
    cfg = config_loader.load_config(["loss=dpo", "batch_size=1", "max_length=64", "max_prompt_length=32", *args])[0]
    model = json.loads(AutoConfig.for_model(model_type, **{**TINY, **extra}).to_json_string())
    e = estimate.estimate(cfg, model, 2 if cfg.trainer == "FSDPTrainer" else 1, device="cpu")
    assert e["micro-batch tokens"] == 2 * 64
    g, autocast = estimate.geometry(model), bool(cfg.fsdp.mixed_precision) and cfg.trainer == "BasicTrainer"
    expected = (
        e["block activations"]
        + cfg.padding_free * 2 * 64**2 * e["compute bytes"]
        + (autocast and (g.block_params + e["adapters"] / g.layers) * 2)
    )
    measured = saved_per_layer(model_type, extra, args)
    assert measured * 0.995 <= expected <= measured * over * 1.01, (expected, measured)


def test_dense_masks_only_where_flex_attention_is_not_used():
    """Packed rows attend through FlexAttention block masks on GPUs for the families transformers marks
    _supports_flex_attn; elsewhere sdpa keeps a float copy of the dense (R, 1, T, T) mask in every layer (with
    checkpointing, the recomputed layer's), beside the bool mask itself."""
    for model_type in estimate.FAMILIES:
        assert (model_type in estimate.FLEX) == AutoModelForCausalLM._model_mapping[
            AutoConfig.for_model(model_type).__class__
        ]._supports_flex_attn, model_type
    args, rows = ["trainer=FSDPTrainer", "batch_size=4", "gradient_accumulation_steps=2"], 2  # a pair: 2 rows
    for ckpt, layers in ((False, 2), (True, 1)):  # the toy: 2 layers, fp32
        run = [*args, f"activation_checkpointing={ckpt}"]
        packed, padded = est(*run, "padding_free=true", world=2, device="cpu"), est(*run, world=2, device="cpu")
        assert packed["activations"] - padded["activations"] == rows * 512**2 * (1 + 4 * layers)
        assert est(*run, "padding_free=true", world=2)["activations"] == padded["activations"]  # CUDA: block masks
    gpt2 = json.loads(AutoConfig.for_model("gpt2", **{**TINY, **GPT2}).to_json_string())
    assert est("padding_free=true", model=gpt2)["dense mask"] and not est("padding_free=true")["dense mask"]


@pytest.mark.parametrize(
    "model_type,extra,targets",
    [
        ("llama", GQA, "all-linear"),
        ("llama", GQA, "[q_proj,self_attn.v_proj]"),
        ("qwen3", {"head_dim": 32}, "all-linear"),
        ("gpt2", GPT2, "all-linear"),
        ("gpt2", GPT2, "[c_proj]"),
        ("gpt_neox", NEOX, "[dense,query_key_value]"),
    ],
)
def test_lora_adapters_are_the_ones_peft_adds(model_type, extra, targets):
    """lora.target_modules selects what peft selects ('all-linear': every linear layer of the blocks, not the LM
    head; a name: every module whose path ends with it), each adding r * (in + out) trained parameters."""
    peft = pytest.importorskip("peft")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**TINY, **extra}))
    names = targets if targets == "all-linear" else targets.strip("[]").split(",")
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=names, task_type="CAUSAL_LM"))
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    e = est("lora.r=4", f"lora.target_modules={targets}", model=json.loads(model.config.to_json_string()))
    assert e["adapters"] == trained and e["parameters"] == sum(p.numel() for p in model.parameters()) - trained


LLAMA_7B = dict(
    TOY,
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    head_dim=128,
    vocab_size=32000,
)


def test_lora_trains_the_adapters_alone_and_the_reference_is_the_policy():
    """A 7B LoRA job: the frozen base in its dtype, no reference copy (the policy with its adapters off), gradients
    and AdamW's two moments for the fp32 adapters only, no LM-head gradient; it fits where full fine-tuning does not."""
    args = ["optimizer=AdamW", "model.policy_dtype=bfloat16", "activation_checkpointing=true"]
    full, lora = est(*args, model=LLAMA_7B), est(*args, "lora.r=16", model=LLAMA_7B)
    P, A = full["parameters"], lora["adapters"]
    assert A == 32 * 16 * (4 * (4096 + 4096) + 3 * (4096 + 11008))  # q, k, v, o, gate, up, down
    assert lora["weights"] == P * 2 + A * 4 and lora["reference weights"] == 0 < full["reference weights"]
    assert lora["gradients"] == A * 4 and lora["optimizer state"] == 2 * A * 4 and lora["LM-head backward"] == 0
    n = P - estimate.geometry(LLAMA_7B).embed_params  # the logged 8 N per token counts the adapters too
    assert lora["model FLOPs per step"] == full["model FLOPs per step"] / n * (n + A)
    assert lora["executed FLOPs per step"] < full["executed FLOPs per step"]  # frozen weights: no weight gradients
    assert lora["peak"] < estimate.USABLE * 80 * estimate.GiB < full["peak"]  # an H100


def test_lora_target_modules_the_estimate_cannot_read_are_refused():
    """A regular expression, or a module outside the blocks (peft would adapt the LM head or the embeddings): an
    EstimateError naming the key, never figures without those adapters."""
    for targets, message in (
        ("q_proj|v_proj", "not a regular expression"),
        ("[lm_head]", "['lm_head'] name no linear"),
    ):
        with pytest.raises(estimate.EstimateError, match=re.escape(message)):
            est("lora.r=4", f"lora.target_modules={targets}")


def test_report_names_the_peak_phase():
    """precompute_ref_log_probs: the reference pass holds policy and reference weights (no optimizer state yet), and
    training the policy alone; with SGD and short rows the pass is the peak, and the report says so. A large
    evaluation batch of full logits makes evaluation the peak."""
    pre = est("optimizer=SGD", "precompute_ref_log_probs=true", "max_length=32", "max_prompt_length=16")
    P = pre["parameters"]
    assert pre["reference weights"] == 0 and pre["phases"]["reference pass"] > pre["weights"] + P * 4
    assert pre["peak phase"] == "reference pass" and pre["peak"] == pre["phases"]["reference pass"]
    big_eval = est("eval_batch_size=64", "tiled_lm_head=false", model=BIG_VOCAB)
    assert big_eval["peak phase"] == "evaluation"
    # self_check compares the tiled head with the full fp32 logits of a few pairs, cut to HEAD_LOGITS_BYTES
    long = ["max_length=2048", "max_prompt_length=1024"]
    checked = [est(*long, *tiled, model=BIG_VOCAB)["phases"]["self check"] for tiled in (["tiled_lm_head=true"], [])]
    assert checked[0] - checked[1] == tiled_head.HEAD_LOGITS_BYTES
    assert "self check" not in est("self_check=false")["phases"]
    cfg = config_loader.load_config(
        ["loss=dpo", "optimizer=SGD", "precompute_ref_log_probs=true", "max_length=32", "max_prompt_length=16"]
    )[0]
    out = estimate.report(cfg, str(REPO / "toy" / "tiny-llama"), 1)
    assert re.search(r"peak \(reference pass\) +[\d.]+ MiB", out), out


def test_keys_the_estimate_does_not_model_are_printed():
    """Offloading, forward_only and size-based FSDP units are not modelled: the report says what it counts instead
    (a block class named in fsdp.wrap_policy, as the toy model's group does, is what it counts)."""
    cfg = config_loader.load_config(
        ["loss=dpo", "trainer=FSDPTrainer", "n_workers=2", "fsdp.strategy=fsdp2", "fsdp.offload_policy=true"]
    )[0]
    out = estimate.report(cfg, str(REPO / "toy" / "tiny-llama"), 2)
    assert "assumes: parameters, gradients and optimizer state counted on the device (fsdp.offload_policy=True" in out
    assert "assumes" not in estimate.report(
        config_loader.load_config(["loss=dpo"])[0], str(REPO / "toy" / "tiny-llama"), 1
    )


def test_a_report_that_does_not_fit_names_the_switches_that_would_with_their_figures(tmp_path):
    """--estimate of a Qwen3-8B shape on 8 H100s without activation checkpointing does not fit: the report names
    activation_checkpointing, the tiled head (its logits are the plain path's fp32 log-softmax) and half the
    micro-batch, each with the peak it gives and its verdict, computed by the estimate itself."""
    qwen3_8b = dict(
        model_type="qwen3",
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
    )
    (tmp_path / "config.json").write_text(json.dumps(qwen3_8b))
    args = ["trainer=FSDPTrainer", "n_workers=8", "loss=dpo", "batch_size=64", "fsdp.mixed_precision=bf16"]
    cfg = config_loader.load_config(args)[0]
    out = estimate.report(cfg, str(tmp_path), 8, "H100")
    assert "DOES NOT FIT" in out, out
    e = estimate.estimate(cfg, qwen3_8b, 8)
    for switch in ("activation_checkpointing", "tiled_lm_head"):
        peak = estimate.estimate(dataclasses.replace(cfg, **{switch: True}), qwen3_8b, 8)["peak"]
        assert peak < e["peak"]
        assert re.search(rf"{switch}=true +peak {peak / 2**30:.2f} GiB: (fits|does not fit)", out), out
    assert re.search(r"gradient_accumulation_steps=2 \(half the micro-batch\) +peak [\d.]+ GiB", out), out
    assert "all of these" in out
    fits = estimate.report(
        dataclasses.replace(cfg, activation_checkpointing=True, tiled_lm_head=True), str(tmp_path), 8, "H100"
    )
    assert "fits" in fits and "what lowers the peak" not in fits, fits  # nothing to name when it fits


def test_an_untiled_head_whose_logits_lead_the_peak_is_named_without_a_gpu(tmp_path):
    """At a 128k vocabulary and long rows the plain path's fp32 log-softmax holds most of the peak: the report says
    what tiled_lm_head=true gives, without gpu= too; with the tiled head on it says nothing of it."""
    cfg = config_loader.load_config(["loss=dpo", "max_length=2048", "max_prompt_length=1024"])[0]
    (tmp_path / "config.json").write_text(json.dumps(BIG_VOCAB))
    out = estimate.report(cfg, str(tmp_path), 1)
    tiled = estimate.estimate(dataclasses.replace(cfg, tiled_lm_head=True), BIG_VOCAB, 1)["peak"]
    assert f"tiled_lm_head=true gives a peak of {tiled / 2**30:.2f} GiB" in out, out
    assert "tiled_lm_head" not in estimate.report(dataclasses.replace(cfg, tiled_lm_head=True), str(tmp_path), 1)
