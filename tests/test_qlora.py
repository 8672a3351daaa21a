"""QLoRA (model.quantization, lora.py): DPO on a base quantized by the real bitsandbytes, with peft's adapters, in one
process and on 2 real gloo ranks (FSDP2 and FSDP1), on the toy model and tests/architectures.py's GPT-2. The reference
is the quantized base with the adapters off: step 0 gives exactly float32(ln 2)."""

import contextlib
import dataclasses
import io
import json
import math
import os
import re
import time
from datetime import timedelta
from pathlib import Path

import pytest

pytest.importorskip("bitsandbytes")  # the optional dependency: CI installs it (README's test command)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import config_loader  # noqa: E402
import estimate  # noqa: E402
import lora  # noqa: E402
import sharding  # noqa: E402
import train as train_py  # noqa: E402
import trainers  # noqa: E402
from architectures import build  # noqa: E402
from test_train import FAST, final_state, kill_after_first_checkpoint, metrics, sample_lines, train  # noqa: E402
from utils import get_open_port, seed_everything  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
LN2 = float(torch.tensor(math.log(2)))  # the DPO loss at zero margin, in the float32 the loss is computed in
QLORA = ["lora.r=4", "lora.alpha=8", "model.quantization=nf4"]
# three AdamW steps with an evaluation (and samples of policy and reference) before each and at the end
ADAMW_3 = ["loss=dpo", "lr=1e-3", "n_examples=24", "eval_every=8", "minimum_log_interval_secs=0", *QLORA]
IDS = torch.tensor([[0, 200, 200, 269, 27, 316, 340, 15], [0, 12, 99, 7, 250, 3, 1, 1]])


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes: packed 4-bit weights stored as floats hold NaN patterns, which torch.equal calls
    unequal to themselves."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def loss_trace(run_dir) -> list[float]:
    return [r["loss/train"] for r in metrics(run_dir) if "loss/train" in r]


def live_policy(run_dir, *args):
    """The run's policy as a resume builds it: the base quantized again from model.name_or_path, the adapters, then
    LATEST/policy.pt loaded (sharding.loadable drops bitsandbytes' constants)."""
    cfg, _ = config_loader.load_config([*FAST, f"run_dir={run_dir}", *args])
    seed_everything(cfg.seed)
    with contextlib.redirect_stdout(io.StringIO()):
        _, policy, _ = train_py.load_models(cfg)
    policy.load_state_dict(sharding.loadable(policy, final_state(run_dir)))
    return policy.eval()


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory):
    """Three steps of QLoRA DPO in one process, shared by the tests that read what it wrote."""
    run_dir = tmp_path_factory.mktemp("qlora") / "run"
    return run_dir, train(run_dir, *ADAMW_3)


def test_step_0_is_exactly_ln2_samples_agree_and_the_eval_loss_falls(qlora_run):
    """The reference is the quantized base with the adapters off, and peft's B starts at zero: at step 0 the policy
    IS the reference, so DPO's loss is float32(ln 2) exactly (self-check and first training loss) and both sample the
    same completions; then the eval loss falls at every evaluation."""
    run_dir, result = qlora_run
    check = json.loads((run_dir / "self_check.json").read_text())["checks"][0]
    assert check["check"] == "reference" and check["difference"] == 0.0 and check["step0_loss"] == LN2
    assert loss_trace(run_dir)[0] == LN2
    evals = [r["loss/eval"] for r in metrics(run_dir) if "loss/eval" in r]
    assert evals[0] == LN2 and all(b < a for a, b in zip(evals, evals[1:])), evals
    samples = sample_lines(result.stdout)
    as_policy = lambda step: [line.replace("reference", "policy", 1) for line in samples[step]["reference"]]
    assert as_policy(0) == samples[0]["policy"] and as_policy(24) != samples[24]["policy"]
    assert "model.quantization=nf4: 14 linear layers quantized by bitsandbytes" in result.stdout


def test_the_manifest_records_bitsandbytes_settings_and_versions(qlora_run):
    run_dir, _ = qlora_run
    manifest = json.loads((run_dir / "run_manifest.json").read_text())
    assert manifest["config"]["model"]["quantization"] == "nf4"
    settings = manifest["quantization"]["settings"]
    assert settings["bnb_4bit_quant_type"] == "nf4" and settings["bnb_4bit_use_double_quant"] is True
    assert settings["bnb_4bit_quant_storage"] == "float32" and settings["bnb_4bit_compute_dtype"] == "float32"
    assert set(manifest["quantization"]["versions"]) == {"bitsandbytes", "peft", "accelerate"}


def test_the_hf_export_is_dense_merged_weights_that_plain_from_pretrained_loads(qlora_run):
    """step-N/hf/: a config without quantization_config and plain linear weights, the base dequantized and the
    adapters merged: it computes what the live quantized base + adapters compute (to fp32 rounding), and not what the
    base alone does. step-N/adapter/: peft's adapter."""
    run_dir, _ = qlora_run
    hf = run_dir / "LATEST" / "hf"
    assert "quantization_config" not in json.loads((hf / "config.json").read_text())
    exported = AutoModelForCausalLM.from_pretrained(hf)
    assert type(exported.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    live = live_policy(run_dir, *ADAMW_3)
    with torch.no_grad():
        ours = exported(IDS).logits
        torch.testing.assert_close(ours, live(IDS).logits, atol=2e-5, rtol=0)
        with live.disable_adapter():
            assert (ours - live(IDS).logits).abs().max() > 1e-3
    assert (run_dir / "LATEST" / "adapter" / "adapter_config.json").is_file()


def test_a_run_killed_after_its_first_checkpoint_resumes_bit_identically(qlora_run, tmp_path):
    """policy.pt holds bitsandbytes' constants, which load_state_dict refuses: the resume drops them (the base is
    quantized again from the same weights, to the same bytes) and ends exactly where the uninterrupted run did."""
    run_dir, _ = qlora_run
    kill_after_first_checkpoint(tmp_path / "cut", *ADAMW_3)
    result = train(tmp_path / "cut2", *ADAMW_3, f"resume_from={tmp_path / 'cut'}")
    assert "at 8 examples" in result.stdout
    full, cut = final_state(run_dir), final_state(tmp_path / "cut")
    assert full.keys() == cut.keys() and any(k.endswith(".absmax") for k in full)
    assert all(same_bytes(full[k], cut[k]) for k in full)
    assert loss_trace(tmp_path / "cut") == loss_trace(run_dir)


@pytest.mark.parametrize("quantization, dtype", [("int8", "fp32"), ("fp4", "bf16")])
def test_int8_and_bf16_fp4_start_at_exactly_ln2_and_train(tmp_path, quantization, dtype):
    """The other settings: LLM.int8 weights under fp32, fp4 weights stored as bf16 (peft's adapters in fp32)."""
    args = ["loss=dpo", "lr=1e-3", "n_examples=16", "eval_every=16", "sample_during_eval=false"]
    args += [
        "minimum_log_interval_secs=0",
        "lora.r=4",
        f"model.quantization={quantization}",
        f"fsdp.model_dtype={dtype}",
    ]
    train(tmp_path / "run", *args)
    losses = loss_trace(tmp_path / "run")
    assert losses[0] == LN2 and losses[1] < LN2


def test_a_replay_repeats_a_qlora_run_exactly(tmp_path):
    """--replay reads the recorded config, model.quantization with it, and every logged metric matches."""
    args = ["loss=dpo", "lr=1e-3", "n_examples=16", "eval_every=16", "sample_during_eval=false", *QLORA]
    train(tmp_path / "run", *args)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert train_py.main(["--replay", str(tmp_path / "run"), f"run_dir={tmp_path / 'replay'}"]) == 0
    assert "replay identical" in out.getvalue()


def test_a_precomputed_reference_of_a_quantized_base_is_its_own(tmp_path):
    """The reference cache is keyed by model.quantization: a QLoRA run after a LoRA run on the same model and data
    computes its own table (reusing the full-precision one would fail the self-check's cache probe: exit 4), and
    its cache agrees with a live forward of the quantized base."""
    args = ["loss=dpo", "n_examples=8", "eval_every=8", "sample_during_eval=false", "precompute_ref_log_probs=true"]
    args += ["lora.r=4", f"local_dirs=[{tmp_path}]"]
    train(tmp_path / "lora", *args)
    result = train(tmp_path / "qlora", *args, "model.quantization=nf4")
    assert re.search(r"reference log-probs of train: 0 cached in .*, \d+ to compute", result.stdout), result.stdout
    checks = {c["check"]: c for c in json.loads((tmp_path / "qlora" / "self_check.json").read_text())["checks"]}
    assert checks["cache"]["passed"] and loss_trace(tmp_path / "qlora")[0] == LN2


def test_semi_online_rounds_sample_and_train_on_a_quantized_base(tmp_path):
    """online.rounds: the policy (adapters on) samples the round's completions through bitsandbytes' layers."""
    args = ["loss=dpo", "lr=1e-4", "n_epochs=1", "eval_every=8", "sample_during_eval=false", "online.rounds=1"]
    args += ["online.prompts_per_round=8", "online.max_new_tokens=8", "online.scorer=python=test_online:by_length"]
    train(tmp_path / "run", *args, *QLORA)
    rows = (tmp_path / "run" / "rounds" / "0" / "pairs.jsonl").read_text().splitlines()
    assert len(rows) == 8 and loss_trace(tmp_path / "run")[0] == LN2


def test_gpt2_conv1d_export_is_transposed_back_and_tied_embeddings_stay_tied(tmp_path):
    """transformers quantizes GPT-2's Conv1D (weights stored (in, out)) as a linear layer of the transposed weight;
    the export transposes the merged weight back, and the tied embedding stays one matrix."""
    path = build("gpt2", tmp_path)
    args = ["loss=dpo", "lr=1e-2", "n_examples=8", "eval_every=8", "sample_during_eval=false", *QLORA]
    args += [f"model.name_or_path={path}", "max_length=48"]
    train(tmp_path / "run", *args)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "LATEST" / "hf")
    assert exported.lm_head.weight is exported.transformer.wte.weight
    with torch.no_grad():
        torch.testing.assert_close(
            exported(IDS).logits, live_policy(tmp_path / "run", *args)(IDS).logits, atol=2e-5, rtol=0
        )


def test_mfu_counts_a_quantized_weight_by_its_shape_not_its_packed_bytes():
    """trainers.flops_params (MFU's N) of a 4-bit base with adapters = that of the full-precision base with the same
    adapters (before: a 4-bit weight stored in fp32 counted 1/8 of its elements)."""
    counts = []
    for extra in ([], ["model.quantization=nf4"]):
        cfg, _ = config_loader.load_config(["model=tiny", "loss=dpo", "lora.r=4", *extra])
        with contextlib.redirect_stdout(io.StringIO()):
            counts.append(trainers.flops_params(train_py.load_models(cfg)[1]))
    assert counts[0] == counts[1]


# --- refusals: each before any model is loaded, exit 2, naming the key and what works --------------------------
@pytest.mark.parametrize(
    "args, message",
    [
        (["model.quantization=nf4"], "model.quantization=nf4 needs lora.r"),
        (
            [*QLORA, "model.archive=/some/run/LATEST/policy.pt"],
            "point model.name_or_path at that run's step-N/hf/ export instead",
        ),
        ([*QLORA, "ref_update.tau=2"], "the LoRA reference is the base model with the adapters off"),
        (
            ["lora.r=4", "model.quantization=int8", "trainer=FSDPTrainer", "n_workers=2"],
            "use model.quantization=nf4 or fp4, or trainer=BasicTrainer",
        ),
        (
            [*QLORA, "trainer=FSDPTrainer", "n_workers=2", "fsdp.strategy=fsdp2", "fsdp.mixed_precision=bf16"],
            "FSDP would cast as numbers; load the model in the compute dtype instead",
        ),
        (
            [*QLORA, "trainer=FSDPTrainer", "n_workers=2", "fsdp.strategy=fsdp", "fsdp.use_orig_params=true"]
            + ["fsdp.model_dtype=bf16"],
            "FSDP1 flattens the base and peft's fp32 adapters into one parameter, which has one dtype; use "
            "fsdp.strategy=fsdp2",
        ),
    ],
)
def test_settings_qlora_cannot_train_are_refused_by_name(tmp_path, args, message, capsys):
    assert train_py.main([*FAST, "loss=dpo", f"run_dir={tmp_path / 'run'}", *args]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("missing", ["bitsandbytes", "accelerate"])
def test_a_missing_dependency_says_what_to_install_before_loading_a_model(tmp_path, monkeypatch, capsys, missing):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == missing else real(name, *a))
    assert train_py.main([*FAST, "loss=dpo", "n_examples=8", f"run_dir={tmp_path / 'run'}", *QLORA]) == 2
    assert f"pip install {missing}" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_model_bitsandbytes_cannot_quantize_is_refused(tmp_path, monkeypatch, capsys):
    """A base with no layer bitsandbytes replaces (here: every linear layer excluded from quantization) is refused
    by name rather than trained as a full-precision LoRA run under a quantization setting."""
    loading = lora.quantized_loading

    def nothing_to_quantize(c, device_map=None):
        kwargs = loading(c, device_map)
        names = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
        kwargs["quantization_config"].llm_int8_skip_modules = names
        return kwargs

    monkeypatch.setattr(lora, "quantized_loading", nothing_to_quantize)
    args = ["loss=dpo", "n_examples=8", "sample_during_eval=false", *QLORA]
    assert train_py.main([*FAST, f"run_dir={tmp_path / 'run'}", *args]) == 2
    assert "bitsandbytes quantized no layer of LlamaForCausalLM" in capsys.readouterr().err


# --- --estimate ------------------------------------------------------------------------------------------------
TOY = json.loads((REPO / "toy" / "tiny-llama" / "config.json").read_text())
# Llama-3-8B's shape (hidden 4096, 32 layers, 32 query and 8 key/value heads of 128, MLP 14336, vocabulary 128256)
LLAMA3_8B = dict(
    model_type="llama",
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    tie_word_embeddings=False,
)


@pytest.mark.parametrize("quantization", ["nf4", "fp4", "int8"])
def test_estimated_weights_are_the_bytes_bitsandbytes_holds(quantization):
    """The toy model loaded for QLoRA: its parameters (packed weights, the rest, the fp32 adapters) and the
    constants bitsandbytes keeps beside them (4-bit: absmax codes, code books, the nested absmax and offset; int8:
    row scales) add up to the estimate's weights, byte for byte."""
    cfg, _ = config_loader.load_config(["model=tiny", "loss=dpo", "lora.r=4", f"model.quantization={quantization}"])
    with contextlib.redirect_stdout(io.StringIO()):
        policy = train_py.load_models(cfg)[1]
    held = 0
    for p in {id(p): p for p in policy.parameters()}.values():
        held += p.nbytes
        state = getattr(p, "quant_state", None)
        if state is not None:
            held += state.absmax.nbytes + state.code.nbytes + 4 + state.state2.absmax.nbytes + state.state2.code.nbytes
        held += p.SCB.nbytes if getattr(p, "SCB", None) is not None else 0
    assert estimate.estimate(cfg, TOY, 1)["weights"] == held


def test_llama3_8b_nf4_weights_are_under_0_4_of_bf16_with_no_reference():
    """By hand: nf4 with double quantization keeps, per matrix of n weights, n/2 bytes of codes, n/64 of absmax codes,
    4 per 256 blocks of 64 and 1092 of code books and offset: q and o (4096^2) 8,655,940 bytes each, k and v
    (4096 x 1024) 2,164,804, gate, up and down (4096 x 14336) 30,293,060; 112,520,668 a block, 3,600,661,376 for
    the 32. Embeddings and head (2 x 128256 x 4096) and the 65 norms (4096 each) stay bf16: 2,101,878,784. LoRA
    r=16 on the 7 linears: 32 x 16 x 81,920 = 41,943,040 fp32 adapters, 167,772,160 bytes. In all 5,870,312,320
    bytes, 0.3655 of bf16's 16,060,522,496 (8,030,261,248 weights). No reference weights: the reference is the base
    with the adapters off."""
    args = ["loss=dpo", "fsdp.model_dtype=bf16", "lora.r=16"]
    bf16 = estimate.estimate(config_loader.load_config([*args[:2]])[0], LLAMA3_8B, 1)
    qlora = estimate.estimate(config_loader.load_config([*args, "model.quantization=nf4"])[0], LLAMA3_8B, 1)
    assert bf16["weights"] == 16_060_522_496
    assert qlora["weights"] == 5_870_312_320 and qlora["weights"] / bf16["weights"] <= 0.4
    assert qlora["reference weights"] == 0 < bf16["reference weights"]


def test_a_report_whose_weights_do_not_fit_names_model_quantization(tmp_path):
    """Llama-3-8B's shape, bf16 DPO on one 24 GB L4: the weights, reference and optimizer state alone exceed it, so
    the report says that only model.quantization lowers them and gives the peak QLoRA reaches."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    cfg = config_loader.load_config(["loss=dpo", "fsdp.model_dtype=bf16", "batch_size=8", "max_length=1024"])[0]
    out = estimate.report(cfg, str(tmp_path), 1, "L4")
    assert "DOES NOT FIT" in out and "only model.quantization (QLoRA: a 4-bit base, LoRA adapters) lowers them" in out
    qlora = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, quantization="nf4"))
    qlora = dataclasses.replace(qlora, lora=dataclasses.replace(cfg.lora, r=16))
    peak = estimate.estimate(qlora, LLAMA3_8B, 1)["peak"]
    assert re.search(rf"model.quantization=nf4 lora.r=16 +peak {peak / 2**30:.2f} GiB", out), out


# --- FSDP on 2 gloo ranks: the same run as one process -----------------------------------------------------------
FSDP2 = ["fsdp.strategy=fsdp2", "activation_checkpointing=true"]  # NO_REENTRANT through bitsandbytes' layers
SCENARIOS = {  # with sampling at every evaluation
    "fsdp2": FSDP2,
    "fsdp": ["fsdp.strategy=fsdp", "fsdp.use_orig_params=true"],
    # killed after the first checkpoint, then resumed from its torch.distributed.checkpoint shards
    "fsdp2_interrupted": FSDP2,
    "fsdp2_resumed": FSDP2,
    "fsdp_interrupted": ["fsdp.strategy=fsdp", "fsdp.use_orig_params=true"],
    "fsdp_resumed": ["fsdp.strategy=fsdp", "fsdp.use_orig_params=true"],
}


class Preempted(Exception):
    pass


def run_scenario(name: str, rank: int, world_size: int, out_dir: Path) -> dict:
    """One scenario on this rank, as train.py's worker runs it (load_models with on_meta on the ranks but 0)."""
    run_dir = out_dir / name
    resume = [f"resume_from={out_dir / name.replace('resumed', 'interrupted')}"] * name.endswith("resumed")
    args = [*FAST, *ADAMW_3, "trainer=FSDPTrainer", f"run_dir={run_dir}", *SCENARIOS[name], *resume]
    cfg, _ = config_loader.load_config(args, world_size=world_size)
    if rank == 0 and not resume:
        run_dir.mkdir(parents=True)
    dist.barrier()
    seed_everything(cfg.seed)
    tokenizer, policy, reference = train_py.load_models(cfg, on_meta=rank != 0)
    info = {"loaded_on_every_rank": not any(p.is_meta for p in policy.parameters())}
    trainer = trainers.FSDPTrainer(
        policy,
        cfg,
        cfg.seed,
        str(out_dir / name.replace("resumed", "interrupted")),
        reference,
        rank,
        world_size,
        tokenizer,
    )
    if name.endswith("interrupted"):
        save = trainer.checkpoints.save

        def save_then_die(*args, **kwargs):
            save(*args, **kwargs)
            raise Preempted  # every rank, after the checkpoint's last barrier: a clean "kill"

        trainer.checkpoints.save = save_then_die
    try:
        trainer.train()
    except Preempted:
        info["preempted_at"] = trainer.state.example_counter
    return info


def worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    results = {}
    try:
        for name in SCENARIOS:
            start = time.time()
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    results[name] = run_scenario(name, rank, world_size, Path(out_dir))
            except Exception as e:  # recorded, so that one broken scenario does not hide the others' results
                results[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
                dist.destroy_process_group()  # a failed collective leaves the group unusable: start a new one
                os.environ["MASTER_PORT"] = str(int(os.environ["MASTER_PORT"]) + 1)
                dist.init_process_group("gloo", timeout=timedelta(seconds=120))
            results[name]["seconds"] = time.time() - start
    finally:
        if rank == 0:
            torch.save(results, Path(out_dir) / "results.pt")
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("fsdp_qlora")
    mp.spawn(worker, args=(2, get_open_port(), str(out_dir)), nprocs=2, join=True)
    results = torch.load(out_dir / "results.pt", weights_only=False)
    for name, info in results.items():
        assert "error" not in info, f"scenario {name} failed: {info['error']}"
    return out_dir, results


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp"])
def test_fsdp_trains_as_one_process_and_exports_the_same_weights(fsdp_results, qlora_run, strategy):
    """Every rank loads and quantizes the base (bitsandbytes' constants are no parameter a broadcast carries), stored
    in the model's dtype, and builds its adapters from the seed: FSDP shards the packed weights like any others. Three
    AdamW steps (sampling at every evaluation; FSDP2 with activation checkpointing) give one process's losses and
    adapters to 1e-6, the very same packed base, and an HF export computing what one process's computes."""
    out, results = fsdp_results
    assert results[strategy]["loaded_on_every_rank"]
    single, _ = qlora_run
    assert len(loss_trace(out / strategy)) == len(loss_trace(single)) == 3
    for a, b in zip(loss_trace(out / strategy), loss_trace(single)):
        assert abs(a - b) <= 1e-6
    ours, theirs = final_state(out / strategy), final_state(single)
    adapters = [k for k in theirs if ".lora_" in k]
    base = [k for k in theirs if ".lora_" not in k and not k.endswith(lora.CONSTANTS) and "quant_state" not in k]
    assert adapters and base and set(adapters + base) <= set(ours)
    assert max((ours[k] - theirs[k]).abs().max().item() for k in adapters) <= 1e-6
    assert all(same_bytes(ours[k], theirs[k]) for k in base)
    samples = [r for r in metrics(out / strategy) if "samples/policy_rule_rate" in r]
    assert len(samples) == 4
    with torch.no_grad():
        exported = AutoModelForCausalLM.from_pretrained(out / strategy / "LATEST" / "hf")(IDS).logits
        one = AutoModelForCausalLM.from_pretrained(single / "LATEST" / "hf")(IDS).logits
    torch.testing.assert_close(exported, one, atol=1e-5, rtol=0)


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp"])
def test_fsdp_resumes_exactly_from_its_sharded_checkpoint(fsdp_results, strategy):
    """Stopped after the first checkpoint and resumed from its torch.distributed.checkpoint shards (bitsandbytes'
    constants dropped on loading): the same final weights, bit for bit, as the uninterrupted run."""
    out, results = fsdp_results
    assert results[f"{strategy}_interrupted"]["preempted_at"] == 8
    ours, theirs = final_state(out / f"{strategy}_interrupted"), final_state(out / strategy)
    assert ours.keys() == theirs.keys() and all(same_bytes(ours[k], theirs[k]) for k in ours)
