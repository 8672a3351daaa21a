"""Real architectures on the real path: GPT-2, GPT-NeoX, Llama, Qwen2, Gemma2, Mistral, Qwen3, Gemma3, SmolLM3 and
the mixtures of experts Qwen3-MoE, OLMoE, Mixtral and gpt-oss (tests/architectures.py), each a tiny random model saved
with save_pretrained and loaded by train.py through `from_pretrained`.

- our log-probs (plain, tiled LM head, packed) equal the ones from the model's own `forward().logits`;
- one DPO step (SGD, lr 1: the parameter change is the gradient) under FSDP1 and FSDP2 on 2 gloo ranks equals
  BasicTrainer in one process on the full batch; activation checkpointing is on for one strategy and off for the
  other, alternating per architecture, so each architecture and each strategy runs with it on and off;
- tied embeddings stay ONE parameter on every rank after sharding, in policy.pt, through resume and in the HF export;
- with bf16 mixed precision the rotary tables stay fp32 and late-position log-probs stay close to fp32;
- sampling under FSDP1 and FSDP2 (before any other forward: FSDP1 must go through its root unit) gives the
  same tokens as one process for a fixed seed;
- a mixture of experts is sharded one decoder layer per unit, its fused experts split within it; the router's
  load-balancing loss (loss.router_aux_loss) is transformers' per sequence, and one step with it is the same under
  accumulation 1 and 4, packed and shared rows, one process and 2 ranks; LoRA's reference (adapters off) is the base.

ONE pair of workers runs every scenario (spawning costs ~15 s of imports); the one-process baselines run here.
"""

import contextlib
import io
import json
import os
import re
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

import architectures
import train as train_py
from conftest import LOCAL_DIRS  # runs and caches in a temporary directory
import fsdp
import logps
import lora
import moe
import packing
import trainers
from architectures import seams
from config_loader import load_config
from utils import get_open_port

FAST = [
    LOCAL_DIRS,
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
    "eval_every=8",
    "peak_tflops=1",  # no measured matmul peak: 1024^2 bf16 matmuls take seconds on a CPU
    "model.block_name=null",  # each model's own block class (_no_split_modules), not the toy Llama's
    # AutoTokenizer on a qwen2 directory builds Qwen2Tokenizer, which adds a pad token (id 512) past this
    # tiny vocabulary: every architecture reads the toy tokenizer itself.
    f"model.tokenizer_name_or_path={architectures.TOKENIZER}",
]
ONE_STEP, TWO_STEPS = ["n_examples=8"], ["n_examples=16"]
BF16 = ["fsdp.mixed_precision={param_dtype: bf16}"]
PACKED = ["padding_free=true"]  # padding-free rows through the full LM head (the plain one)
TILED = ["tiled_lm_head=true"]  # the LM head in tiles on the scored positions
BUDGET, BUDGET_TOKENS = [("gpt_neox", "fsdp"), ("llama", "fsdp2")], 120  # rank 0: 4 micro-batches, rank 1: 3
SP = ["fsdp.ulysses_sequence_parallel_size=2"]  # Ulysses: both ranks hold the same 8 pairs, each half of every row
# gemma3: local and global layers under Ulysses; gpt_oss: its sinks sliced to each rank's heads, eager attention
SP_ARCHS = ["llama", "qwen2", "gemma3", "gpt_oss"]
AUX = ["loss.router_aux_loss=0.5"]  # large enough that the router's term moves the parameters well past 1e-5
# the same 8 pairs under 2 ranks: packed shared rows, 2 micro-batches each (FSDP1); padded rows, tiled head (FSDP2)
AUX_RUNS = {
    "mixtral-fsdp-aux": ["fsdp.strategy=fsdp", "prefix_sharing=true", *PACKED],
    "mixtral-fsdp2-aux": ["fsdp.strategy=fsdp2", *TILED],
}
MODIFIERS = [
    "loss.ld_alpha=0.5",
    "loss.wpo=true",
    "loss.dpop_lambda=5",
]  # LD-DPO's per-token log-probs, WPO's statistic
ARCHS = list(architectures.ARCHITECTURES)
TIED = [a for a in ARCHS if architectures.ARCHITECTURES[a][2]]
ROTARY = [a for a in ARCHS if a != "gpt2"]  # GPT-2 has learned positions, no rotary table
MOE = architectures.MOE
# Prefix sharing's masks in one process: Qwen3, SmolLM3, Qwen3-MoE, OLMoE and Mixtral attend through Llama's masks,
# so of the newer families Gemma3 (local and global layers) and gpt-oss (sinks, eager) run it (the per-token columns,
# bookkeeping of the layouts, run on the first six); every family runs every layout in the FSDP matrix
MASKS = [a for a in ARCHS if a not in ("qwen3", "smollm3", "qwen3_moe", "olmoe", "mixtral")]
PROMPT = torch.randint(2, architectures.VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
LONG = torch.randint(2, architectures.VOCAB, (1, 260), generator=torch.Generator().manual_seed(1))
SAMPLE_SEED = 1234
# CI runs the bf16 step under one strategy per architecture (alternating, so both strategies are covered);
# ARCH_MATRIX_FULL=1 runs both, for the full architecture x trainer x precision table (test_matrix_table).
FULL = os.environ.get("ARCH_MATRIX_FULL") == "1"


def checkpointed(arch: str, strategy: str) -> bool:
    """Activation checkpointing on for FSDP1 on even architectures and for FSDP2 on odd ones."""
    return (ARCHS.index(arch) % 2 == 0) == (strategy == "fsdp")


def bf16_in_ci(arch: str, strategy: str) -> bool:
    return (ARCHS.index(arch) % 2 == 0) == (strategy == "fsdp2")


def scenarios() -> dict[str, list[str]]:
    out = {}
    for arch in ARCHS:
        for strategy in ("fsdp", "fsdp2"):
            ac = f"activation_checkpointing={str(checkpointed(arch, strategy)).lower()}"
            out[f"{arch}-{strategy}-fp32"] = [f"fsdp.strategy={strategy}", ac, *ONE_STEP, *TILED]
            out[f"{arch}-{strategy}-packed"] = [f"fsdp.strategy={strategy}", ac, *ONE_STEP, *PACKED]
            # prefix sharing: padded rows through the tiled head under one strategy, packed rows through the full head
            # under the other, alternating per architecture
            out[f"{arch}-{strategy}-shared"] = [
                f"fsdp.strategy={strategy}",
                ac,
                *ONE_STEP,
                "prefix_sharing=true",
                *(PACKED if checkpointed(arch, strategy) else TILED),
            ]
            if FULL or bf16_in_ci(arch, strategy):
                out[f"{arch}-{strategy}-bf16"] = [f"fsdp.strategy={strategy}", ac, *ONE_STEP, *BF16, *TILED]
    for arch in SP_ARCHS:
        for strategy in ("fsdp", "fsdp2"):
            ac = f"activation_checkpointing={str(checkpointed(arch, strategy)).lower()}"  # recomputed attention too
            out[f"{arch}-{strategy}-sp"] = [f"fsdp.strategy={strategy}", ac, *ONE_STEP, *SP, *TILED]  # padded rows
            out[f"{arch}-{strategy}-sp_packed"] = [f"fsdp.strategy={strategy}", ac, *ONE_STEP, *SP, *PACKED]
    # the loss modifiers: per-token log-probs and WPO's statistic under Ulysses (each rank's slice), and under FSDP1
    # through shared-prefix packed rows
    out["qwen2-fsdp2-sp_modifiers"] = ["fsdp.strategy=fsdp2", *ONE_STEP, *SP, *MODIFIERS, *TILED]
    out["llama-fsdp-modifiers"] = [
        "fsdp.strategy=fsdp",
        *ONE_STEP,
        *MODIFIERS,
        "prefix_sharing=true",
        "padding_free=true",
        *TILED,
    ]
    # the reference precomputed (its pass splits rows too) and token-budget micro-batches, under sequence parallelism
    out["qwen2-fsdp2-sp_budget"] = [
        "fsdp.strategy=fsdp2",
        *ONE_STEP,
        *SP,
        f"max_tokens_per_microbatch={BUDGET_TOKENS}",
        "precompute_ref_log_probs=true",
        *TILED,
    ]
    for arch, strategy in BUDGET:  # token-budget micro-batches: the ranks' counts differ, FSDP needs them equal
        # (consecutive halves: shares balanced by FLOPs happen to split into 4 micro-batches each on this batch)
        out[f"{arch}-{strategy}-budget"] = [
            f"fsdp.strategy={strategy}",
            *ONE_STEP,
            f"max_tokens_per_microbatch={BUDGET_TOKENS}",
            "balance_batch=false",
            *TILED,
        ]
    for name, args in AUX_RUNS.items():  # the router's loss, with recomputed blocks (its logits come from inside them)
        out[name] = [*args, *ONE_STEP, *AUX, "gradient_accumulation_steps=2", "activation_checkpointing=true"]
    for strategy in ("fsdp", "fsdp2"):  # a tied model stopped after step 1 and resumed
        out[f"gpt2-{strategy}-interrupted"] = [f"fsdp.strategy={strategy}", *TWO_STEPS, *TILED]
        out[f"gpt2-{strategy}-resumed"] = [f"fsdp.strategy={strategy}", *TWO_STEPS, *TILED]
    return out


class Preempted(Exception):
    pass


def tie_state(model) -> dict:
    """Is the LM head the input embedding, on this rank: one Parameter (FSDP2, one process) or, inside FSDP1's
    full parameters, one storage; and are the gathered values equal."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    is_fsdp1 = isinstance(model, FSDP)
    with FSDP.summon_full_params(model, writeback=False) if is_fsdp1 else contextlib.nullcontext():
        inner = model.module if is_fsdp1 else model
        out, inp = inner.get_output_embeddings().weight, inner.get_input_embeddings().weight
        same = out is inp or (is_fsdp1 and out.data_ptr() == inp.data_ptr())
        full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
        return {"same_parameter": same, "equal_values": torch.equal(full(out), full(inp))}


def block_of(unit) -> str:
    """An FSDP unit's block class: FSDP1 wraps it (.module), activation checkpointing too; FSDP2 names it FSDP<block>."""
    module = getattr(unit, "module", unit)
    return type(getattr(module, "_checkpoint_wrapped_module", module)).__name__.removeprefix("FSDP")


def units(model) -> list[str]:
    """The block class of each FSDP unit below the root."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel as FSDP

    found = (
        FSDP.fsdp_modules(model)[1:]
        if isinstance(model, FSDP)
        else [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
    )
    return sorted({block_of(unit) for unit in found})


def expert_shard(model) -> object:
    """Where the fused experts of the first MoE layer live on this rank: FSDP2, the rows of gate_up_proj (experts)
    this rank holds; FSDP1, the unit whose flat parameter holds them. None for a dense model."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if isinstance(model, FSDP):
        return next(
            (
                block_of(u)
                for u in FSDP.fsdp_modules(model)[1:]
                if any(".experts." in f or f.startswith("experts.") for f in u._handle.flat_param._fqns)
            ),
            None,
        )
    param = next((p for k, p in model.named_parameters() if "experts.gate_up_proj" in k), None)
    return None if param is None else param.to_local().shape[0]


def late_token_logps(model) -> torch.Tensor:
    """Per-token log-probs of LONG (1, 260) at positions 200..258, through the model's own forward."""
    with torch.no_grad():
        logits = model(input_ids=LONG, use_cache=False).logits.float()
    return torch.log_softmax(logits[0, 200:-1], -1).gather(-1, LONG[0, 201:, None])[:, 0]


def sample(trainer, model) -> torch.Tensor:
    torch.manual_seed(SAMPLE_SEED)
    with torch.no_grad():
        return trainer.sharding.generate(
            model,
            input_ids=PROMPT,
            attention_mask=torch.ones_like(PROMPT),
            max_new_tokens=8,
            do_sample=True,
            pad_token_id=1,
        )


def run_scenario(name: str, args: list[str], rank: int, world_size: int, out_dir: Path, models: dict) -> dict:
    arch = name.split("-")[0]
    run_dir = out_dir / name
    resume = [f"resume_from={out_dir / name.replace('resumed', 'interrupted')}"] if name.endswith("resumed") else []
    cfg, _ = load_config(
        [*FAST, "trainer=FSDPTrainer", f"model.name_or_path={models[arch]}", f"run_dir={run_dir}", *args, *resume],
        world_size=world_size,
    )
    if rank == 0 and not resume:
        run_dir.mkdir(parents=True)
    dist.barrier()
    tokenizer, policy, reference = train_py.load_models(cfg, on_meta=rank != 0)  # as train.py: rank 0 loads
    trainer = trainers.FSDPTrainer(
        policy,
        cfg,
        cfg.seed,
        resume[0].split("=", 1)[1] if resume else str(run_dir),
        reference,
        rank,
        world_size,
        tokenizer,
    )
    info = {
        "tie": tie_state(trainer.policy),
        "reference_tie": tie_state(trainer.reference.model),
        "units": units(trainer.policy),
        "experts": expert_shard(trainer.policy),
    }
    if name.endswith("fp32") or name.endswith("sp"):
        info["samples"] = sample(trainer, trainer.policy)  # the first forward of the run: no warm root unit
    if name.endswith("bf16"):
        info["late_logps"] = late_token_logps(trainer.policy)
        info["buffer_dtypes"] = sorted({str(b.dtype) for b in trainer.policy.buffers() if b.is_floating_point()})
        info["reference_buffer_dtypes"] = sorted(
            {str(b.dtype) for b in trainer.reference.model.buffers() if b.is_floating_point()}
        )
    # The tiled path reads the LM head's weight and never calls the head module: count its calls during training.
    head = (trainer.policy.module if hasattr(trainer.policy, "module") else trainer.policy).get_output_embeddings()
    info["head_calls"], info["positions_seen"] = 0, set()

    def count(*_):
        info["head_calls"] += 1

    hook = head.register_forward_hook(count)
    # the row lengths the policy's embedding sees while training (under Ulysses: this rank's slice of each row)
    embedding = (trainer.policy.module if hasattr(trainer.policy, "module") else trainer.policy).get_input_embeddings()

    def rows_and_positions(_module, args, _out):
        info["positions_seen"].add(args[0].shape[-1])
        info.setdefault("rows_seen", set()).add(args[0].shape[0])

    seen = embedding.register_forward_hook(rows_and_positions)
    split_by_tokens = trainers.split_by_tokens  # this rank's own token-budget micro-batches, before padding

    def counted(*args, **kwargs):
        out = split_by_tokens(*args, **kwargs)
        info.setdefault("micro_batches", []).append(len(out))
        return out

    trainers.split_by_tokens = counted
    # the whole rows, before any split: padded (the plain path's, and Ulysses' through packing), packed
    found = ((logps, "padded_inputs"), (packing, "padded_inputs"), (packing, "packed_inputs"))
    layouts = {(module, name): getattr(module, name) for module, name in found}

    def recorded(layout):
        def rows(*args, **kwargs):
            out = layouts[layout](*args, **kwargs)
            info.setdefault("row_widths", set()).add(out[0]["input_ids"].shape[-1])
            return out

        return rows

    for layout in layouts:
        setattr(*layout, recorded(layout))
    if name.endswith("interrupted"):
        save = trainer.checkpoints.save

        def save_then_die(*args, **kwargs):
            save(*args, **kwargs)
            raise Preempted

        trainer.checkpoints.save = save_then_die
    check = trainers.self_check.run  # its probe's forwards are not the step's: what the hooks saw is put back after it

    def checked(t):
        kept = {k: v.copy() if isinstance(v, (set, list)) else v for k, v in info.items()}
        check(t)
        info.clear(), info.update(kept)

    trainers.self_check.run = checked
    try:
        trainer.train()
    except Preempted:
        pass
    hook.remove(), seen.remove()
    trainers.split_by_tokens, trainers.self_check.run = split_by_tokens, check
    for layout, function in layouts.items():
        setattr(*layout, function)
    info["tie_after_training"] = tie_state(trainer.policy)
    return info


def worker(rank, world_size, port, out_dir, models):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # a rank that failed alone: no long hang
    results = {}
    try:
        for name, args in scenarios().items():
            if name in results:
                continue
            start = time.time()
            printed = io.StringIO()
            try:
                with contextlib.redirect_stdout(printed):
                    results[name] = run_scenario(name, args, rank, world_size, Path(out_dir), models)
                if "-sp" in name:
                    results[name]["printed"] = printed.getvalue()
            except Exception as e:  # recorded, so one broken architecture does not hide the others' results
                results[name] = {"error": f"{type(e).__name__}: {e}"}
                if "interrupted" in name:
                    results[name.replace("interrupted", "resumed")] = {"error": "its interrupted run failed"}
                dist.destroy_process_group()  # a failed collective leaves the group unusable: start a new one
                os.environ["MASTER_PORT"] = str(int(os.environ["MASTER_PORT"]) + 1)
                dist.init_process_group("gloo", timeout=timedelta(seconds=120))
            results[name]["seconds"] = time.time() - start
            torch.save(results, Path(out_dir) / f"results-{rank}.pt")
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, str]:
    return {name: str(path) for name, path in architectures.build_all(tmp_path_factory.mktemp("architectures")).items()}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, models):
    out_dir = tmp_path_factory.mktemp("arch_fsdp")
    mp.spawn(worker, args=(2, get_open_port(), str(out_dir), models), nprocs=2, join=True)
    return out_dir, [torch.load(out_dir / f"results-{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def single(tmp_path_factory, models):
    """BasicTrainer in this process on the full batch, fp32 and bf16 autocast: what every sharded run must match."""
    out = tmp_path_factory.mktemp("arch_single")
    # fp32: the plain path (full logits, padded rows), which every sharded path (tiled, packed) must match; bf16
    # through the tiled head
    runs = {
        f"{arch}-{precision}": [
            f"model.name_or_path={models[arch]}",
            *ONE_STEP,
            *([*BF16, *TILED] if precision == "bf16" else []),
        ]
        for arch in ARCHS
        for precision in ("fp32", "bf16")
    }
    runs["gpt2-two-steps"] = [
        f"model.name_or_path={models['gpt2']}",
        *TWO_STEPS,
        "activation_checkpointing=true",
        *TILED,
    ]
    runs.update(
        {
            f"{arch}-modifiers": [f"model.name_or_path={models[arch]}", *ONE_STEP, *MODIFIERS]
            for arch in ("llama", "qwen2")
        }
    )
    for accumulation in (1, 4):  # the router's loss on the plain path, in one and in four micro-batches
        runs[f"mixtral-aux{accumulation}"] = [
            f"model.name_or_path={models['mixtral']}",
            *ONE_STEP,
            *AUX,
            f"gradient_accumulation_steps={accumulation}",
        ]
    for name, args in runs.items():
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            assert train_py.main([*FAST, f"run_dir={out / name}", *args]) == 0, name
    return out


@pytest.fixture(scope="module")
def one_process(models) -> dict[str, dict]:
    """Per architecture, the fp32 model in this process: its samples for SAMPLE_SEED and its late-token log-probs."""
    out = {}
    for arch in ARCHS:
        model = AutoModelForCausalLM.from_pretrained(models[arch], dtype=torch.float32).eval()
        torch.manual_seed(SAMPLE_SEED)
        with torch.no_grad():
            samples = model.generate(
                input_ids=PROMPT,
                attention_mask=torch.ones_like(PROMPT),
                max_new_tokens=8,
                do_sample=True,
                pad_token_id=1,
            )
        out[arch] = {"samples": samples, "late_logps": late_token_logps(model)}
    return out


def final_state(run_dir: Path) -> dict:
    return torch.load(run_dir / "LATEST" / "policy.pt", weights_only=True)["state"]


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def ok(results: list[dict], name: str) -> list[dict]:
    for rank, r in enumerate(results):
        assert "error" not in r[name], f"{name} on rank {rank}: {r[name]['error']}"
    return [r[name] for r in results]


# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_log_probs_equal_the_models_own_logits(models, arch):
    """Three rows padded to different lengths (longer than Gemma2's sliding window of 16), 5 prompt tokens
    unscored: each path's mean log-prob per scored token equals the one gathered from forward().logits (1e-5)."""
    model = AutoModelForCausalLM.from_pretrained(models[arch], dtype=torch.float32).eval()
    ids = torch.randint(2, architectures.VOCAB, (3, 40), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, 30:] = mask[2, 20:] = 0
    labels = torch.where(mask.bool(), ids, -100)
    labels[:, :5] = -100
    inputs = {"input_ids": ids * mask, "attention_mask": mask, "labels": labels}
    with torch.no_grad():
        logits = model(input_ids=ids * mask, attention_mask=mask).logits
        scored = labels[:, 1:] != -100  # output t predicts token t+1
        token = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
        expected = (token * scored).sum(1) / scored.sum(1)
        for path, options in {
            "plain": {},
            "tiled": {"tiled": True},
            "packed": {"packed_capacity": 64},
            "packed+tiled": {"packed_capacity": 64, "tiled": True},
        }.items():
            sums, counts, _, *_ = logps.forward_logps(model, inputs, **seams(model, **options))
            assert counts.tolist() == scored.sum(1).tolist(), path
            assert (sums / counts - expected).abs().max().item() < 1e-5, path


def shared_prompt_pairs(seed: int = 3) -> dict:
    """Chosen rows over rejected rows of 4 pairs: prompts of 5-40 tokens (longer than Gemma2's window of 16),
    responses of 1-40, one pair whose prompts differ in their last token (its common prefix is shorter)."""
    g = torch.Generator().manual_seed(seed)
    prompt, chosen, rejected = [30, 5, 12, 40], [20, 40, 3, 30], [25, 10, 30, 1]
    ids = torch.randint(2, architectures.VOCAB, (8, 80), generator=g)
    mask, labels = torch.zeros_like(ids), torch.full_like(ids, -100)
    for i, p in enumerate(prompt):
        ids[4 + i, : p - (i == 2)] = ids[i, : p - (i == 2)]
        for row, length in ((i, p + chosen[i]), (4 + i, p + rejected[i])):
            mask[row, :length], labels[row, p:length] = 1, ids[row, p:length]
    return {"input_ids": ids * mask, "attention_mask": mask, "labels": labels}


@pytest.mark.parametrize("arch", MASKS)
def test_prefix_sharing_equals_separate_sequences(models, arch):
    """prefix_sharing (one sequence per pair: prompt + chosen + rejected) against the plain path (chosen and rejected
    as separate padded rows): sums, counts, entropies and one backward's gradients equal (1e-5 relative), padded
    and packed, tiled and full head; and the rejected cannot see the chosen: changing a chosen token leaves every
    rejected log-prob exactly as it was."""
    model = AutoModelForCausalLM.from_pretrained(models[arch], dtype=torch.float32)
    inputs = shared_prompt_pairs()

    def run(options, inputs=inputs):
        model.zero_grad()
        sums, counts, entropy, *_ = logps.forward_logps(model, inputs, **seams(model, **options))
        (sums / counts).sum().backward()
        return sums.detach(), counts, entropy, {k: p.grad.clone() for k, p in model.named_parameters()}

    base = run({})
    for options in ({}, {"tiled": True}, {"packed_capacity": 64}, {"packed_capacity": 64, "tiled": True}):
        sums, counts, entropy, grads = run({"prefix_sharing": True, **options})
        torch.testing.assert_close(sums, base[0], rtol=1e-5, atol=1e-5, msg=str(options))
        assert torch.equal(counts, base[1]), options
        torch.testing.assert_close(entropy, base[2], rtol=1e-5, atol=1e-5, msg=str(options))
        for k, g in grads.items():
            torch.testing.assert_close(g, base[3][k], rtol=1e-5, atol=1e-5, msg=f"{options} {k}")
        edited = dict(inputs, input_ids=inputs["input_ids"].clone())
        edited["input_ids"][0, 35] += 1  # a chosen token of pair 0 (its prompt is 30 tokens)
        changed = run({"prefix_sharing": True, **options}, edited)[0]
        assert changed[0] != sums[0] and torch.equal(changed[4:], sums[4:]), options


@pytest.mark.parametrize("arch", ARCHS[:6])
def test_per_token_logps_and_wpo_statistic_on_every_path(models, arch):
    """per_token: each labelled token's log-prob at its input column, as gathered from the model's own
    log_softmax(forward().logits) (1e-5), the same on every path (padded, tiled, packed, shared prefix), and its
    gradient the plain path's; sum_sq: the summed log sum_v p_v^2 over the labelled tokens, computed from those
    logits here, equal through the tiled head's tiles and the full logits (1e-5)."""
    model = AutoModelForCausalLM.from_pretrained(models[arch], dtype=torch.float32)
    inputs = shared_prompt_pairs()
    scored = inputs["labels"] != -100
    with torch.no_grad():
        logp = torch.log_softmax(
            model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits, -1
        )
    expected = torch.zeros(scored.shape)
    expected[:, 1:] = (
        logp[:, :-1].gather(-1, inputs["input_ids"][:, 1:, None])[..., 0] * scored[:, 1:]
    )  # output t predicts t+1
    sq = torch.logsumexp(2 * logp[:, :-1], -1)
    expected_sq = (sq * scored[:, 1:]).sum(1)
    weights = torch.randn(scored.shape, generator=torch.Generator().manual_seed(4))
    grads = {}
    for options in (
        {},
        {"tiled": True},
        {"packed_capacity": 64},
        {"prefix_sharing": True},
        {"prefix_sharing": True, "packed_capacity": 64, "tiled": True},
    ):
        model.zero_grad()
        out = logps.forward_logps(model, inputs, per_token=True, sum_sq=True, **seams(model, **options))
        torch.testing.assert_close(out.tokens.detach(), expected, rtol=1e-5, atol=1e-5, msg=str(options))
        torch.testing.assert_close(out.log_sum_sq, expected_sq, rtol=1e-5, atol=1e-5, msg=str(options))
        (out.tokens * weights).sum().backward()
        for k, p in model.named_parameters():
            torch.testing.assert_close(
                p.grad, grads.setdefault(k, p.grad.clone()), rtol=1e-5, atol=1e-5, msg=f"{options} {k}"
            )
    assert logps.forward_logps(model, inputs).tokens is None  # nothing kept unless asked


DENSE_MASK = ("gemma2", "gpt2", "olmoe", "gpt_oss")  # no FlexAttention for their packed rows, on GPUs too


# the newer dense families attend as Llama does here (sdpa, one mask per layer type); Gemma3 for its local layers
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "gemma2", "gpt2", "gemma3", *MOE])
def test_flex_attention_rows_equal_the_dense_mask(models, arch, monkeypatch):
    """The GPU path of packed and shared rows, FlexAttention block masks (packing.block_masks), run here on CPU,
    eagerly and forward only (CPU FlexAttention has no backward): the log-probs equal the plain path's (1e-5), Mistral given a
    sliding window of 16 (counted in positions), Qwen2 and Gemma3 one mask per layer type. Gemma2 attends eagerly (its
    logit softcapping), GPT-2's attention reads the mask as a tensor, OLMoE has no FlexAttention in transformers and
    gpt-oss attends eagerly (no sdpa: its sinks join each row's softmax after the mask is added): they keep the dense
    mask, FlexAttention is never called."""
    from torch.nn.attention.flex_attention import flex_attention as eager_flex_attention
    from transformers.integrations import flex_attention

    monkeypatch.setattr(packing, "FLEX_DEVICES", ("cpu",))
    calls, forward = [], flex_attention.flex_attention_forward
    monkeypatch.setattr(flex_attention, "flex_attention_forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    # transformers compiles FlexAttention; inductor's CPU kernel fails to build for these masks (torch 2.13), and the
    # GPU's is another kernel (Triton): the eager reference computes the same attention
    monkeypatch.setattr(
        flex_attention,
        "compile_friendly_flex_attention",
        lambda q, k, v, training=False, **kw: eager_flex_attention(q, k, v, **kw),
    )
    model = AutoModelForCausalLM.from_pretrained(
        models[arch], dtype=torch.float32, **({"sliding_window": 16} if arch == "mistral" else {})
    )
    inputs = shared_prompt_pairs()
    with torch.no_grad():
        base = logps.forward_logps(model.eval(), inputs)
        for options in ({"packed_capacity": 64}, {"prefix_sharing": True, "packed_capacity": 64, "tiled": True}):
            sums, counts, _, *_ = logps.forward_logps(model, inputs, **seams(model, **options))
            torch.testing.assert_close(sums, base[0], rtol=1e-5, atol=1e-5, msg=str(options))
            assert torch.equal(counts, base[1])
    assert bool(calls) == (arch not in DENSE_MASK), (arch, model.config._attn_implementation)


@pytest.mark.parametrize("order", ["embedding first", "head first"])
def test_fsdp1_param_init_fn_keeps_ties(models, order):
    """On GPU, FSDP1 materializes the meta model of ranks > 0 one module at a time (param_init_fn), which a CPU
    run cannot reach (it broadcasts a whole module instead): called in either order, the LM head and the
    embedding end up one real Parameter, and nothing stays on meta."""
    from transformers import AutoConfig

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(models["gpt2"]))
    init = fsdp.materialize(torch.device("cpu"), fsdp.tied_slots(model))
    modules = list(model.modules())
    for module in modules if order == "embedding first" else modules[::-1]:
        init(module)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
@pytest.mark.parametrize("arch", ARCHS)
def test_one_dpo_step_equals_one_process(sharded, single, models, arch, strategy):
    """SGD, lr 1: parameters after one step = before - gradient; 2 ranks vs one process on the full batch.
    The sharded runs take the tiled LM head (fp32: the head module is never called) and the padding-free path
    (packed: full logits); both equal the one-process plain path (full logits, padded rows) to 1e-5, and so does
    the evaluation loss after the step. Each unit is one decoder layer (the class of the model's layer list); a
    mixture of experts' fused experts are sharded within it (FSDP2: 2 of the 4 experts' rows on each rank)."""
    out, results = sharded
    model = AutoModelForCausalLM.from_pretrained(models[arch])
    layer = type(next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList))[0]).__name__
    before = model.state_dict()
    step = max_difference(
        final_state(single / f"{arch}-fp32"),
        {k: v for k, v in before.items() if k in final_state(single / f"{arch}-fp32")},
    )
    assert step > 1e-3  # a real step happened
    for info in ok(results, f"{arch}-{strategy}-fp32"):
        assert info["head_calls"] == 0  # tiled under FSDP: no full-logits forward of the policy
        assert info["units"] == [layer]
        assert info["experts"] == ((2 if strategy == "fsdp2" else layer) if arch in MOE else None)
    for info in ok(results, f"{arch}-{strategy}-packed"):
        assert info["head_calls"] > 0
    expected = records(single / f"{arch}-fp32", "loss/eval")[-1]["loss/eval"]
    for path in ("fp32", "packed"):
        assert (
            max_difference(final_state(out / f"{arch}-{strategy}-{path}"), final_state(single / f"{arch}-fp32")) <= 1e-5
        ), path
        assert abs(records(out / f"{arch}-{strategy}-{path}", "loss/eval")[-1]["loss/eval"] - expected) <= 1e-5, path


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_sharing_step_equals_one_process(sharded, single, arch, strategy):
    """prefix_sharing=true under FSDP on 2 ranks (packed rows and full logits where activation checkpointing is on,
    padded rows and the tiled head where it is off): one DPO step's log-probs, loss and parameters equal the
    one-process plain path (separate padded sequences, full logits) to 1e-5."""
    out, results = sharded
    expected = train_records(single / f"{arch}-fp32")[0]
    for info in ok(results, f"{arch}-{strategy}-shared"):  # 4 pairs a rank: 4 rows (packed: fewer), not 8 sequences
        assert max(info["rows_seen"]) <= 4, info["rows_seen"]
    record = train_records(out / f"{arch}-{strategy}-shared")[0]
    for key in ("logps_train/chosen", "logps_train/rejected", "loss/train"):
        assert abs(record[key] - expected[key]) <= 1e-5 * max(1.0, abs(expected[key])), key
    assert max_difference(final_state(out / f"{arch}-{strategy}-shared"), final_state(single / f"{arch}-fp32")) <= 1e-5


@pytest.mark.parametrize("name", ["qwen2-fsdp2-sp_modifiers", "llama-fsdp-modifiers"])
def test_loss_modifiers_under_fsdp_equal_one_process(sharded, single, name):
    """LD-DPO, WPO and DPOP at once: per-token log-probs and WPO's statistic from each Ulysses rank's slice of the
    rows (qwen2, FSDP2), and from shared-prefix packed rows under FSDP1 (llama); one step's loss, WPO weights and
    parameters equal one process on the plain path (1e-5)."""
    out, results = sharded
    ok(results, name)
    expected, record = train_records(single / f"{name.split('-')[0]}-modifiers")[0], train_records(out / name)[0]
    for key in ("loss/train", "wpo_train/weights", "logps_train/rejected"):
        assert abs(record[key] - expected[key]) <= 1e-5 * max(1.0, abs(expected[key])), key
    assert max_difference(final_state(out / name), final_state(single / f"{name.split('-')[0]}-modifiers")) <= 1e-5


def test_ulysses_with_precomputed_reference_and_token_budget_equals_one_process(sharded, single):
    """Sequence parallelism with the reference pass (before training, through the same split forward) and
    token-budget micro-batches (several per step, the same on both ranks of the group): one step equals one process."""
    out, results = sharded
    counts = [info["micro_batches"] for info in ok(results, "qwen2-fsdp2-sp_budget")]
    assert counts[0] == counts[1] and counts[0][0] > 1  # the group's ranks split the same pairs the same way
    assert max_difference(final_state(out / "qwen2-fsdp2-sp_budget"), final_state(single / "qwen2-fp32")) <= 1e-5


@pytest.mark.parametrize("arch,strategy", BUDGET)
def test_token_budget_under_fsdp_equals_one_process(sharded, single, arch, strategy):
    """max_tokens_per_microbatch under FSDP: the two ranks split their pairs into different numbers of micro-
    batches, agree on the larger (the other repeats its last with weight 0), and the step equals one process on
    the full batch (plain path) to 1e-5."""
    out, results = sharded
    counts = [info["micro_batches"] for info in ok(results, f"{arch}-{strategy}-budget")]
    assert counts[0] != counts[1]  # the case that needs agreeing
    assert max_difference(final_state(out / f"{arch}-{strategy}-budget"), final_state(single / f"{arch}-fp32")) <= 1e-5


def records(run_dir: Path, key: str) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if key in r]


def train_records(run_dir: Path) -> list[dict]:
    return records(run_dir, "loss/train")


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
@pytest.mark.parametrize("arch", SP_ARCHS)
def test_ulysses_step_equals_one_process(sharded, single, arch, strategy):
    """fsdp.ulysses_sequence_parallel_size=2 on 2 ranks (dp 1 x sp 2): each rank's embedding sees half of every
    row, attention sees whole rows through the all-to-all, and one DPO step's sequence log-probs, loss and
    parameters equal one process on the same 8 pairs (1e-5), padded (tiled head) and packed (full logits), with
    activation checkpointing (recomputed attention) on for one strategy and off for the other."""
    out, results = sharded
    expected = train_records(single / f"{arch}-fp32")[0]
    assert (
        "= data-parallel 1 (world size 2 = dp 1 x sequence-parallel 2) x accumulation 1 x micro-batch 8"
        in ok(results, f"{arch}-{strategy}-sp")[0]["printed"]
    )
    for path in ("sp", "sp_packed"):
        for info in ok(results, f"{arch}-{strategy}-{path}"):  # each rank: half of every row, never a whole one
            assert {w // 2 for w in info["row_widths"]} == info["positions_seen"], (
                path,
                info["row_widths"],
                info["positions_seen"],
            )
            assert all(w % 2 == 0 for w in info["row_widths"]), path  # rows padded to a multiple of the group's size
        record = train_records(out / f"{arch}-{strategy}-{path}")[0]
        for key in ("logps_train/chosen", "logps_train/rejected", "loss/train"):
            assert abs(record[key] - expected[key]) <= 1e-5 * max(1.0, abs(expected[key])), (path, key)
        assert (
            max_difference(final_state(out / f"{arch}-{strategy}-{path}"), final_state(single / f"{arch}-fp32")) <= 1e-5
        ), path


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
@pytest.mark.parametrize("arch", TIED)
def test_tied_embeddings_survive_sharding_checkpoints_resume_and_export(sharded, single, arch, strategy):
    out, results = sharded
    for name in (f"{arch}-{strategy}-fp32", f"{arch}-{strategy}-bf16"):
        if name not in results[0]:
            continue  # a bf16 run not in CI (bf16_in_ci)
        for info in ok(results, name):  # every rank, after sharding and after training
            assert (
                info["tie"]
                == info["tie_after_training"]
                == info["reference_tie"]
                == {"same_parameter": True, "equal_values": True}
            )
    run = out / f"{arch}-{strategy}-fp32"
    state = final_state(run)
    assert torch.equal(state["lm_head.weight"], state[next(k for k in state if "wte" in k or "embed_tokens" in k)])
    exported = AutoModelForCausalLM.from_pretrained(run / "LATEST" / "hf")
    assert exported.get_output_embeddings().weight is exported.get_input_embeddings().weight
    assert max_difference({k: v for k, v in exported.state_dict().items() if k in state}, state) == 0.0
    if arch == "gpt2":  # stopped after step 1, resumed: still tied, and equal to two uninterrupted steps
        for info in ok(results, f"gpt2-{strategy}-resumed"):
            assert info["tie_after_training"] == {"same_parameter": True, "equal_values": True}
        resumed = final_state(out / f"gpt2-{strategy}-interrupted")  # resume writes into the interrupted run dir
        assert max_difference(resumed, final_state(single / "gpt2-two-steps")) <= 1e-5


@pytest.mark.parametrize(
    "arch,strategy", [(a, s) for a in ROTARY for s in ("fsdp", "fsdp2") if FULL or bf16_in_ci(a, s)]
)
def test_bf16_keeps_rotary_tables_fp32_and_late_positions_close(sharded, one_process, arch, strategy):
    """Under bf16 mixed precision every floating buffer (the rotary inv_freq tables) of policy and reference stays
    fp32 on every rank, and per-token log-probs at positions 200-258 stay within 0.02 nats of the fp32 model.

    Why 0.02: bf16 keeps 8 bits of mantissa (~0.4% relative per matmul); measured on these models the bf16 forward
    is 0.002-0.005 nats off at those positions, so 0.02 is a 4x margin. An inv_freq rounded to bf16 turns the angle
    at position p by up to p * 0.4% of its frequency (~0.8 rad at p = 200 for the fastest one) — but a random tiny
    model's near-uniform attention hides that in its log-probs (measured: ~0.001-0.002 nats), so the dtype assertion
    is the check that catches it (it failed before the fix: FSDP1's buffer_dtype defaulted to bf16)."""
    _, results = sharded
    name = f"{arch}-{strategy}-bf16"
    fp32 = one_process[arch]["late_logps"]
    for info in ok(results, name):
        assert info["buffer_dtypes"] == info["reference_buffer_dtypes"] == ["torch.float32"]
        assert (info["late_logps"] - fp32).abs().max().item() < 0.02


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
@pytest.mark.parametrize("arch", ARCHS)
def test_sampling_equals_one_process(sharded, one_process, arch, strategy):
    """8 sampled tokens (temperature 1) for 2 prompts, seed SAMPLE_SEED, as the run's first forward under FSDP."""
    _, results = sharded
    expected = one_process[arch]["samples"]
    assert expected.shape == (2, PROMPT.size(1) + 8)
    for info in ok(results, f"{arch}-{strategy}-fp32") + (
        ok(results, f"{arch}-{strategy}-sp") if arch in SP_ARCHS else []
    ):
        assert torch.equal(info["samples"], expected)  # under Ulysses too: sampling attends over whole prompts


def test_router_load_balancing_is_transformers_per_sequence(models):
    """Per sequence, the router statistics of padded rows and of shared-prefix packed rows (through the tiled head)
    give moe.load_balancing_loss equal to transformers' load_balancing_loss_func on that sequence alone (real
    tokens only, so padding never counts: 1e-6), and the same gradient on the routers."""
    import importlib

    inputs = shared_prompt_pairs()
    for arch in MOE:  # padded rows, and shared-prefix packed rows (the prompt counted for both sequences of a pair)
        model = AutoModelForCausalLM.from_pretrained(models[arch], dtype=torch.float32)
        function, config = importlib.import_module(type(model).__module__).load_balancing_loss_func, model.config
        experts, (n, t) = getattr(config, "num_local_experts", None) or config.num_experts, inputs["input_ids"].shape
        with torch.no_grad():  # right-padded rows, causal: a row's real positions route as its sequence alone would
            layers = model(input_ids=inputs["input_ids"], output_router_logits=True).router_logits
            expected = torch.stack(
                [
                    function(tuple(x.view(n, t, -1)[i, :length] for x in layers), experts, config.num_experts_per_tok)
                    for i, length in enumerate(inputs["attention_mask"].sum(1).tolist())
                ]
            )
        grads = []
        for options in ({}, {"prefix_sharing": True, "packed_capacity": 64, "tiled": True}):
            model.zero_grad()
            routing = logps.forward_logps(model, inputs, **seams(model, routing_grad=True, **options)).routing
            aux = moe.load_balancing_loss(routing)
            torch.testing.assert_close(aux.detach(), expected, rtol=1e-6, atol=1e-6, msg=f"{arch} {options}")
            aux.sum().backward()
            grads.append(torch.cat([m.weight.grad.flatten() for m, _ in moe.routers(model)]))
            torch.testing.assert_close(grads[-1], grads[0], rtol=1e-5, atol=1e-6, msg=f"{arch} {options}")
        assert grads[0].abs().sum() > 0


def test_mfu_and_estimate_count_the_active_parameters_of_an_moe(models):
    """moe.active_parameters of trainers.flops_params, the N of MFU's 6N per token: of a mixture of experts, the
    parameters a token runs
    through. torch's FLOP counter on a forward of T tokens (experts looped: its counter skips grouped_mm) counts
    2 N T within 3% (attention's T x T products and the norms aside), where all parameters would be ~35% over.
    --estimate, from config.json alone, counts every parameter for memory and the same N for FLOPs, and says so."""
    import estimate
    from torch.utils.flop_counter import FlopCounterMode

    ids = torch.randint(2, architectures.VOCAB, (1, 64), generator=torch.Generator().manual_seed(6))
    for arch in ("qwen3_moe", "olmoe", "mixtral"):
        model = AutoModelForCausalLM.from_pretrained(models[arch], experts_implementation="eager")
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            model(input_ids=ids)
        active = moe.active_parameters(model, trainers.flops_params(model))
        every = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
        assert abs(counter.get_total_flops() / (2 * ids.numel()) / active - 1) < 0.03 and every > 1.3 * active, arch
        geometry = estimate.geometry(json.loads((Path(models[arch]) / "config.json").read_text()))
        assert geometry.params == sum(p.numel() for p in model.parameters()), arch
        assert geometry.active - geometry.embed_params == active, arch
    cfg, _ = load_config([*FAST, *ONE_STEP, f"model.name_or_path={models['mixtral']}"])
    assert "mixture of experts: FLOPs count N = 0.04M, the parameters a token runs through" in estimate.report(
        cfg, models["mixtral"], 1
    )  # the 0.04M active parameters train.py prints for MFU


def test_router_aux_loss_is_the_same_under_accumulation_packing_and_ranks(sharded, single):
    """loss.router_aux_loss=0.5 on Mixtral, the same 8 pairs: one process in 1 and in 4 micro-batches (padded rows,
    full logits), 2 ranks x 2 micro-batches under FSDP1 (packed shared rows) and FSDP2 (padded rows, tiled head),
    blocks recomputed: the logged router_aux_loss/train, the loss and the parameters after one step agree (1e-5).
    Without the key the same value is logged (the model before the step), as the same DPO loss (loss/train leaves the
    router's term out); with it the step moves the parameters elsewhere (the routers' gradient is in it)."""
    out, results = sharded
    expected, plain = train_records(single / "mixtral-aux1")[0], train_records(single / "mixtral-fp32")[0]
    aux = expected["router_aux_loss/train"]
    assert abs(plain["router_aux_loss/train"] - aux) <= 1e-6 and aux >= 2  # top-2 routing: 2 when perfectly balanced
    assert abs(expected["loss/train"] - plain["loss/train"]) <= 1e-6
    assert max_difference(final_state(single / "mixtral-aux1"), final_state(single / "mixtral-fp32")) > 1e-4
    for name in AUX_RUNS:
        ok(results, name)
    for run in (single / "mixtral-aux4", *(out / name for name in AUX_RUNS)):
        record = train_records(run)[0]
        for key in ("router_aux_loss/train", "loss/train"):
            assert abs(record[key] - expected[key]) <= 1e-5 * max(1.0, abs(expected[key])), (run.name, key)
        assert max_difference(final_state(run), final_state(single / "mixtral-aux1")) <= 1e-5, run.name


def test_lora_reference_on_moe_is_the_base_model(models):
    """LoRA on a mixture of experts: Mixtral as train.py builds it (lora.r=4, all-linear: peft 0.21 adapts its router
    and its fused 3-D experts, stored (experts, out, in)), padded rows; gpt-oss (whose experts all-linear leaves alone)
    with peft's target_parameters on its fused experts, stored (experts, in, out), packed rows. With random adapters the
    policy's log-probs move; the reference, the policy inside trainers.Reference.context (adapters off), gives exactly
    (torch.equal) the base model's log-probs and routing; the HF export's merged weights (lora.merged_lora_state)
    give the policy's log-probs (1e-5; before expert_lora_layers the experts' keys came out wrong)."""
    import types
    import peft

    cfg, _ = load_config([*FAST, *ONE_STEP, f"model.name_or_path={models['mixtral']}", "lora.r=4", "lora.alpha=8"])
    policy = train_py.load_models(cfg)[1]
    assert not any(p.requires_grad for k, p in policy.named_parameters() if ".lora_" not in k)
    assert any(".experts." in k for k, _ in policy.named_parameters() if ".lora_" in k)
    fused = peft.get_peft_model(
        AutoModelForCausalLM.from_pretrained(models["gpt_oss"], dtype=torch.float32),
        peft.LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules="all-linear",
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        ),
    )
    inputs, g = shared_prompt_pairs(), torch.Generator().manual_seed(5)
    for arch, model, options in (("mixtral", policy, {}), ("gpt_oss", fused, {"packed_capacity": 64})):
        base = AutoModelForCausalLM.from_pretrained(models[arch], dtype=torch.float32).eval()
        with torch.no_grad():
            for k, p in model.named_parameters():
                if "lora_B" in k:  # peft starts B at 0 (the policy is the base): move it
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        merged = AutoModelForCausalLM.from_pretrained(models[arch], dtype=torch.float32).eval()
        merged.load_state_dict(
            lora.merged_lora_state(
                model.state_dict(),
                2.0,
                lora.fan_in_fan_out_layers(model),
                experts=lora.expert_lora_layers(model),
            )
        )  # the export's
        with torch.no_grad():
            expected = logps.forward_logps(base, inputs, **seams(base, routing=True, **options))
            moved = logps.forward_logps(model.eval(), inputs, **seams(model, routing=True, **options))
            with trainers.Reference.context(types.SimpleNamespace(lora=True, model=model)):
                reference = logps.forward_logps(model, inputs, **seams(model, routing=True, **options))
            exported = logps.forward_logps(merged, inputs, **seams(merged, **options))
        assert (moved.sums - expected.sums).abs().max() > 1e-2, arch
        assert torch.equal(reference.sums, expected.sums) and torch.equal(reference.routing, expected.routing), arch
        torch.testing.assert_close(exported.sums, moved.sums, rtol=1e-5, atol=1e-4, msg=arch)


def gemma3_with_dynamic_rope(models, tmp_path) -> str:
    """Gemma3's config.json with its global layers' RoPE made dynamic (one dict per layer type)."""
    config = json.loads((Path(models["gemma3"]) / "config.json").read_text())
    config["rope_parameters"]["full_attention"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.mark.parametrize(
    "arch,args,message",
    ids=["olmoe-sp-packed", "llama-aux", "qwen3-aux-model", "gemma3-sp-dynamic"],
    argvalues=[
        (
            "olmoe",
            [*SP, "padding_free=true"],
            "fsdp.ulysses_sequence_parallel_size=2 with padding_free=true: "
            "OlmoeForCausalLM (model type 'olmoe') does not attend through FlexAttention",
        ),
        ("llama", AUX, "loss.router_aux_loss=0.5: model type 'llama'"),
        ("qwen3", ["loss.router_aux_loss=model"], "loss.router_aux_loss=model: model type 'qwen3'"),
        (
            "gemma3",
            SP,
            "(model type 'gemma3_text'): its RoPE type 'dynamic' scales frequencies by the longest position",
        ),
    ],
)
def test_options_an_architecture_cannot_take_are_refused_before_loading(
    models, arch, args, message, monkeypatch, tmp_path
):
    """Refused from config.json alone (train.check_inputs), naming the option and the architecture: OLMoE under
    Ulysses with packed rows on CUDA (sdpa, no FlexAttention: a dense (T, T) mask per layer; CPU keeps the dense
    mask); the router's loss for a dense model; a Gemma3 whose global layers' RoPE is dynamic, under Ulysses."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the check of the GPU path, on this CPU
    path = gemma3_with_dynamic_rope(models, tmp_path) if arch == "gemma3" else models[arch]
    cfg, _ = load_config([*FAST, *ONE_STEP, "trainer=FSDPTrainer", f"model.name_or_path={path}", *args], world_size=2)
    with pytest.raises(train_py.ConfigError, match=re.escape(message)):
        train_py.check_inputs(cfg, 2)


def test_matrix_table(sharded, single, capsys):
    """Prints architecture x layout x trainer -> max |parameter difference| from the fp32 one-process step (plain
    path): fp32 (tiled head), packed, shared (prefix sharing), bf16 (mixed precision), sp, sp_packed (Ulysses); '-':
    not run (bf16 under one strategy per architecture in CI, Ulysses for SP_ARCHS)."""
    out, results = sharded

    def cell(run: Path, name: str = "") -> str:
        if name and name not in results[0] or not name and not run.exists():
            return "   -   "
        return "error" if name and "error" in results[0][name] else f"{max_difference(final_state(run), base):.1e}"

    rows = []
    for arch in ARCHS:
        base = final_state(single / f"{arch}-fp32")
        for layout in ("fp32", "packed", "shared", "bf16", "sp", "sp_packed"):
            cells = [cell(single / f"{arch}-{layout}")] + [
                cell(out / f"{arch}-{s}-{layout}", f"{arch}-{s}-{layout}") for s in ("fsdp", "fsdp2")
            ]
            if any(c.strip() != "-" for c in cells):
                rows.append(f"{arch:9s} {layout:9s}  basic {cells[0]}  fsdp1 {cells[1]}  fsdp2 {cells[2]}")
    with capsys.disabled():
        print("\nmax |param - fp32 one-process param| after one SGD lr=1 DPO step:\n" + "\n".join(rows))


def test_every_matrix_run_checked_itself(sharded, single):
    """Every run above (BasicTrainer fp32 and bf16; FSDP1 and FSDP2 with the tiled head, packed and shared rows,
    bf16, Ulysses, loss modifiers, a precomputed reference, token budgets, a resume) ran self_check.py before its
    first step and passed: no false alarm on any architecture. The checks that apply ran: head with the tiled head,
    layout with packed, shared or Ulysses rows, cache with a precomputed reference, reference at step 0 (skipped on
    the resume, whose policy has trained)."""
    out, _ = sharded
    layouts = ("padding_free=true", "prefix_sharing=true", "fsdp.ulysses_sequence_parallel_size=2")
    for name, args in scenarios().items():
        if name.endswith("resumed"):
            continue  # it resumed into the interrupted run's directory: its report is that one's
        report = json.loads((out / name / "self_check.json").read_text())
        found = {c["check"]: c for c in report["checks"]}
        expected = {
            "reference",
            *(["head"] if "tiled_lm_head=true" in args else []),
            *(["layout"] if set(layouts) & set(args) else []),
            *(["cache"] if "precompute_ref_log_probs=true" in args else []),
        }
        assert report["passed"] and set(found) == expected, (name, report)
        assert ("skipped" in found["reference"]) == name.endswith("interrupted"), (name, report)
    for run in single.iterdir():
        report = json.loads((run / "self_check.json").read_text())
        found = {c["check"]: c for c in report["checks"]}
        assert report["passed"] and "skipped" not in found["reference"], (run.name, report)
