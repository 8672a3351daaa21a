"""FSDPTrainer on CPU with gloo and 2 real processes, against BasicTrainer in one process.

Spawning processes costs ~15 s of imports each time, so ONE pair of workers runs every scenario in turn
(module fixture `fsdp_results`) and the tests read what each scenario recorded: the wrapped modules' real
settings (not the config's), the optimizer state's device, and the final parameters. The one-process
baselines run in this process. Checks that need a GPU (nccl, CUDA device_id, pinned memory) are marked.
"""

import contextlib
import io
import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoConfig, AutoModelForCausalLM

import fsdp
import sharding
import train as train_py
import trainers
from config_loader import load_config
from utils import get_open_port, seed_everything

from conftest import LOCAL_DIRS, TEST_LOCAL_DIR  # runs and caches in a temporary directory

REPO = Path(__file__).resolve().parent.parent
FAST = [
    "model=tiny",
    "datasets=[toy]",
    "warmup_steps=0",
    "batch_size=8",
    "eval_batch_size=8",
    "n_eval_examples=16",
    "max_length=64",
    "max_prompt_length=32",
    "max_new_tokens=8",
    "fsdp.use_torch_compile=false",
    "wandb.enabled=false",
    "n_epochs=null",
    "loss=dpo",
    "do_first_eval=false",
    "sample_during_eval=false",
    "minimum_log_interval_secs=0",
    LOCAL_DIRS,
]
SGD_ONE_STEP = ["optimizer=SGD", "lr=1.0", "n_examples=8", "eval_every=8"]  # parameter change = the gradient
ADAMW_3 = ["optimizer=AdamW", "lr=1e-4", "n_examples=24", "eval_every=8"]
KTO = ["loss=kto", "pairs_to_unpaired=true"]
TR_DPO = ["ref_update.tau=1", "ref_update.alpha=0.6"]  # a soft update after every step
SGD_TWO = ["optimizer=SGD", "lr=1.0", "n_examples=16", "eval_every=8"]  # step 2's gradient reads the updated reference
LORA = ["lora.r=4", "lora.alpha=8"]
SAMPLING = ["do_first_eval=true", "sample_during_eval=true", "n_eval_model_samples=4"]
SAMPLES_12 = ["sample_during_eval=true", "n_eval_model_samples=12"]  # two groups of prompts: one per rank


def write_skewed_pairs(path: Path) -> str:
    """16 pairs, every 4th one long (78 tokens against 32): balanced shares put one long pair on each rank."""
    long = lambda i: {
        "prompt": f"\n\nHuman: Question {i}. Describe rain and snow.\n\nAssistant:",
        "chosen": " rain falls and the snow is white and very cold.",
        "rejected": " RAIN FALLS AND THE SNOW IS WHITE AND VERY COLD.",
    }
    short = lambda i: {"prompt": f"\n\nHuman: Cats {i}?\n\nAssistant:", "chosen": " cats.", "rejected": " CATS."}
    path.write_text("".join(json.dumps(long(i) if i % 4 == 1 else short(i)) + "\n" for i in range(16)))
    return str(path)


# written at import, so each spawned worker (which imports this module anew) has the same file
SKEWED = [f"datasets=[{write_skewed_pairs(Path(TEST_LOCAL_DIR) / 'skewed_pairs.jsonl')}]", *SGD_ONE_STEP]


def write_tied_llama(path: Path) -> list[str]:
    """The toy Llama with its LM head tied to its input embedding (as Llama-3.2-1B, Qwen2.5-0.5B, Gemma), saved; the
    arguments that load it."""
    config = AutoConfig.from_pretrained(REPO / "toy" / "tiny-llama", tie_word_embeddings=True)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return [f"model.name_or_path={path}", f"model.tokenizer_name_or_path={REPO / 'toy' / 'tiny-llama'}"]


TIED = [*write_tied_llama(Path(TEST_LOCAL_DIR) / "tied-llama"), *SGD_ONE_STEP]
# on it each MLP (147456 parameters), the two attentions together (model.layers) and the LlamaModel holding the tied
# embedding pass the threshold
COARSE = "fsdp.wrap_policy={min_num_params: 100000}"

SCENARIOS = {
    # name: (arguments, strategy-independent baseline name)
    "fsdp_sgd": (["fsdp.strategy=fsdp", *SGD_ONE_STEP], "sgd"),
    "fsdp2_sgd": (["fsdp.strategy=fsdp2", *SGD_ONE_STEP], "sgd"),
    "fsdp_adamw": (["fsdp.strategy=fsdp", *ADAMW_3], "adamw"),
    "fsdp2_adamw": (["fsdp.strategy=fsdp2", *ADAMW_3, *SAMPLES_12], "adamw"),
    "fsdp_bf16": (["fsdp.strategy=fsdp", *ADAMW_3, "model.fsdp_policy_mp=bfloat16"], None),
    "fsdp2_bf16": (
        ["fsdp.strategy=fsdp2", *ADAMW_3, "fsdp.mixed_precision={param_dtype: bf16, reduce_dtype: fp32}"],
        None,
    ),
    "fsdp_knobs": (
        [
            "fsdp.strategy=fsdp",
            *ADAMW_3,
            "fsdp.reshard_after_forward=false",
            "fsdp.forward_prefetch=true",
            "fsdp.use_orig_params=true",
            "activation_checkpointing=true",
            "fsdp.param_offload=true",
            "fsdp.optimizer_offload=true",
        ],
        "adamw",
    ),
    "fsdp2_knobs": (
        [
            "fsdp.strategy=fsdp2",
            *ADAMW_3,
            "fsdp.reshard_after_forward=false",
            "fsdp.forward_prefetch=true",
            "activation_checkpointing=true",
            "fsdp.offload_policy=true",
            "fsdp.optimizer_offload=true",
        ],
        "adamw",
    ),
    "fsdp_replicate": (["fsdp.strategy=fsdp", *ADAMW_3, "fsdp.fsdp_size=1"], "adamw"),
    "fsdp2_replicate": (["fsdp.strategy=fsdp2", *ADAMW_3, "fsdp.fsdp_size=1", "fsdp.param_offload=true"], "adamw"),
    "fsdp2_precomputed_packed": (
        ["fsdp.strategy=fsdp2", *ADAMW_3, "precompute_ref_log_probs=true", "padding_free=true"],
        "adamw",
    ),
    # the step's pairs dealt in shares of unequal counts (near-equal FLOPs): one step, with and without micro-batches,
    # equals one process
    "fsdp_skewed": (["fsdp.strategy=fsdp", *SKEWED], "skewed_sgd"),
    "fsdp2_skewed_accumulation": (["fsdp.strategy=fsdp2", *SKEWED, "gradient_accumulation_steps=2"], "skewed_sgd"),
    "fsdp2_skewed_budget": (["fsdp.strategy=fsdp2", *SKEWED, "max_tokens_per_microbatch=100"], "skewed_sgd"),
    "fsdp2_skewed_consecutive": (["fsdp.strategy=fsdp2", *SKEWED, "balance_batch=false"], "skewed_sgd"),
    # opting in to unsynced accumulation (the reduce-scatter after the last micro-batch only) gives the same step
    "fsdp_skewed_no_sync": (
        ["fsdp.strategy=fsdp", *SKEWED, "gradient_accumulation_steps=2", "no_sync_accumulation=true"],
        "skewed_sgd",
    ),
    "fsdp2_size_policy": (["fsdp.strategy=fsdp2", *SGD_ONE_STEP, "fsdp.wrap_policy={min_num_params: 20000}"], "sgd"),
    "fsdp_tied_size_policy": (["fsdp.strategy=fsdp", *TIED, COARSE], "tied_sgd"),
    "fsdp2_tied_size_policy": (["fsdp.strategy=fsdp2", *TIED, COARSE], "tied_sgd"),
    "fsdp_kto": (["fsdp.strategy=fsdp", *SGD_ONE_STEP, *KTO], "kto_sgd"),
    "fsdp2_kto": (["fsdp.strategy=fsdp2", *SGD_ONE_STEP, *KTO], "kto_sgd"),
    # TR-DPO with the knobs that broke its update: checkpoint wrappers on the policy's names, a reference that
    # stayed gathered (full shapes against the policy's shards) under reshard_after_forward=false
    "fsdp_trdpo_knobs": (
        [
            "fsdp.strategy=fsdp",
            *SGD_TWO,
            *TR_DPO,
            "activation_checkpointing=true",
            "fsdp.use_orig_params=true",
            "fsdp.reshard_after_forward=false",
        ],
        "trdpo_sgd",
    ),
    "fsdp2_trdpo_knobs": (
        ["fsdp.strategy=fsdp2", *SGD_TWO, *TR_DPO, "activation_checkpointing=true", "fsdp.reshard_after_forward=false"],
        "trdpo_sgd",
    ),
    "fsdp_trdpo_hard": (["fsdp.strategy=fsdp", *SGD_TWO, "ref_update.tau=1", "ref_update.alpha=1.0"], None),
    "fsdp_trdpo": (["fsdp.strategy=fsdp", *SGD_TWO, *TR_DPO], "trdpo_sgd"),
    "fsdp2_trdpo": (["fsdp.strategy=fsdp2", *SGD_TWO, *TR_DPO], "trdpo_sgd"),
    "fsdp2_trdpo_interrupted": (["fsdp.strategy=fsdp2", *SGD_TWO, *TR_DPO], None),
    "fsdp2_trdpo_resumed": (["fsdp.strategy=fsdp2", *SGD_TWO, *TR_DPO], None),
    # with sampling at evaluation (the defaults): the adapters' model generates through the root unit
    "fsdp2_lora": (["fsdp.strategy=fsdp2", *ADAMW_3, *LORA, *SAMPLING], "lora_adamw"),
    "fsdp_lora": (["fsdp.strategy=fsdp", *ADAMW_3, *LORA, *SAMPLING, "fsdp.use_orig_params=true"], "lora_adamw"),
    # killed after its first checkpoint (step 8), then resumed by the next scenario
    "fsdp2_interrupted": (["fsdp.strategy=fsdp2", *ADAMW_3], None),
    "fsdp2_resumed": (["fsdp.strategy=fsdp2", *ADAMW_3], None),
    "fsdp_interrupted": (["fsdp.strategy=fsdp", *ADAMW_3], None),
    "fsdp_resumed": (["fsdp.strategy=fsdp", *ADAMW_3], None),
}


class Preempted(Exception):
    pass


def inspect_wrapping(trainer) -> dict:
    """What the wrapped policy really is, read from FSDP's own objects."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    policy = trainer.policy
    info = {"checkpointed_blocks": sum(isinstance(m, CheckpointWrapper) for m in policy.modules())}
    if isinstance(policy, FSDP):
        units = FSDP.fsdp_modules(policy)
        info.update(
            strategy=policy.sharding_strategy.name,
            forward_prefetch=policy.forward_prefetch,
            use_orig_params=policy._use_orig_params,
            offload_params=policy.cpu_offload.offload_params,
            units=len(units),
            mixed_param_dtype=str(policy.mixed_precision.param_dtype),
        )
    else:
        states = [m._get_fsdp_state() for m in policy.modules() if hasattr(m, "_get_fsdp_state")]
        groups = [s._fsdp_param_group for s in states if s._fsdp_param_group is not None]
        param = next(policy.parameters())
        info.update(
            strategy="fully_shard",
            units=len(groups),
            reshard_after_forward=[g._reshard_after_forward for g in groups],
            forward_prefetch=sum(len(s._states_to_forward_prefetch) for s in states),
            offload_policy=[type(g.offload_policy).__name__ for g in groups],
            mesh_shape=tuple(param.device_mesh.shape),
            local_numel=param.to_local().numel(),
            full_numel=param.numel(),
            param_device=str(param.to_local().device),
            mixed_param_dtype=str(groups[0].mp_policy.param_dtype),
        )
    return info


def run_scenario(name, args, rank, world_size, out_dir):
    run_dir = out_dir / name
    resume = [f"resume_from={out_dir / name.replace('resumed', 'interrupted')}"] if name.endswith("resumed") else []
    cfg, _ = load_config([*FAST, "trainer=FSDPTrainer", f"run_dir={run_dir}", *args, *resume], world_size=world_size)
    if rank == 0 and not resume:
        run_dir.mkdir(parents=True)
    dist.barrier()
    # As train.py: only rank 0 loads weights, the other ranks build empty (meta) models that FSDP fills.
    seed_everything(cfg.seed)  # as train.worker_main: LoRA's adapters are initialised from the RNG
    tokenizer, policy, reference = train_py.load_models(cfg, on_meta=rank != 0)
    assert all(p.is_meta for p in policy.parameters()) == (rank != 0)
    trainer = trainers.FSDPTrainer(
        policy,
        cfg,
        cfg.seed,
        str(resume[0].split("=", 1)[1]) if resume else str(run_dir),
        reference,
        rank,
        world_size,
        tokenizer,
    )
    info = inspect_wrapping(trainer)
    if name.endswith("interrupted"):
        save = trainer.checkpoints.save

        def save_then_die(*args, **kwargs):
            save(*args, **kwargs)
            raise Preempted  # every rank, after the checkpoint's last barrier: a clean "kill"

        trainer.checkpoints.save = save_then_die
    # Where fsdp.optimizer_offload sends the optimizer state, call by call (on CPU every device is the CPU, so the
    # devices themselves prove nothing; tests/test_trainers.py checks the placement with a stand-in device).
    moves, move = [], fsdp.move_optimizer_state

    def recording_move(optimizer, device):
        moves.append("parameter's device" if device is None else str(device))
        move(optimizer, device)

    fsdp.move_optimizer_state = recording_move
    # Gradient syncs skipped, and gradients held unsharded after a micro-batch that is not the step's last
    info["skipped_syncs"], info["unsharded_grads_between_micro_batches"], micro_batches = 0, [], [0]
    gradient_sync = trainer.sharding.gradient_sync

    @contextlib.contextmanager
    def inspected(model, sync):
        info["skipped_syncs"] += not sync
        with gradient_sync(model, sync):
            yield
        micro_batches[0] += 1
        if (
            micro_batches[0] == 1
            and trainer.config.gradient_accumulation_steps > 1
            or trainer.config.max_tokens_per_microbatch
        ):
            info["unsharded_grads_between_micro_batches"].append(unsharded_gradient_elements(trainer.policy))

    trainer.sharding.gradient_sync = inspected
    # After every reference forward: are the reference's parameters sharded again (FSDP2: every unit; FSDP1: every
    # flat parameter back on its local shard)?
    info["reference_gathered_after_forward"] = []
    reference_forward = trainer.reference.forward

    def checked_reference(inputs, *args):
        out = reference_forward(inputs, *args)
        info["reference_gathered_after_forward"].append(gathered_units(trainer.reference.model))
        return out

    trainer.reference.forward = checked_reference
    shares, train_step = [], trainer.train_step  # the pairs this rank trained on at each step

    def recording_step(batch):
        shares.append(batch["chosen"])
        return train_step(batch)

    trainer.train_step = recording_step
    try:
        trainer.train()
    except Preempted:
        info["preempted_at"] = trainer.state.example_counter
    finally:
        fsdp.move_optimizer_state = move
    info["optimizer_state_moves"] = moves
    if "tied" in name:  # the live policy's head and input embedding: one Parameter (FSDP1's, gathered)
        model, wrapped = sharding.unwrap(trainer.policy), isinstance(trainer.policy, fsdp.FSDP)
        with fsdp.FSDP.summon_full_params(trainer.policy) if wrapped else contextlib.nullcontext():
            info["tied"] = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    if name.endswith("_adamw"):  # the reference after its forwards, and one never run (every log-prob cached)
        fresh = trainer.sharding.shard(train_py.load_models(cfg, on_meta=rank != 0)[2], False)
        info["release"] = [release_check(trainer, model) for model in (trainer.reference.model, fresh)]
    info["shares"] = [None] * world_size  # [rank][step]: the chosen texts of the pairs it trained on
    dist.all_gather_object(info["shares"], shares)
    if name.endswith("kto"):  # the KL estimate over both ranks' halves of one global batch's mismatched rows
        rows = {k: v[rank * 4 : (rank + 1) * 4] for k, v in kto_global_batch(tokenizer).items() if k.startswith("kl_")}
        info["kl"] = trainer.reference.kl_point(rows).item()
    return info


def release_check(trainer, model) -> dict:
    """Frees a sharded model with sharding's release: the bytes it reports, the bytes this rank's shards hold by their
    sizes (FSDP1: each unit's flat parameter padded to 2 equal halves; FSDP2: each parameter's first dimension),
    buffers included, and the bytes its tensors still hold afterwards."""
    world, shards = trainer.world_size, 0
    if isinstance(model, fsdp.FSDP):
        for unit in fsdp.FSDP.fsdp_modules(model):
            flat = unit._handle.flat_param
            shards += -(-flat._unpadded_unsharded_size.numel() // world) * flat.element_size()
    else:
        shards = sum(-(-p.shape[0] // world) * p[0].numel() * p.element_size() for p in model.parameters())
    shards += sum(b.untyped_storage().nbytes() for b in model.buffers())
    tensors = trainer.sharding.tensors(model)  # FSDP1: with each flat parameter and its copies
    freed = trainer.sharding.release(model)
    left = sum((t.to_local() if hasattr(t, "to_local") else t).untyped_storage().nbytes() for t in tensors)
    return {"freed": freed, "shards": shards, "left": left}


def unsharded_gradient_elements(policy) -> int:
    """Elements of whole (unsharded) gradients FSDP2 keeps on this rank between micro-batches (0 under FSDP1:
    counted through its flat parameters' gradient sizes)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if isinstance(policy, FSDP):
        handles = [u._handle for u in FSDP.fsdp_modules(policy) if u._handle is not None]
        return sum(
            h.flat_param.grad.numel()
            for h in handles
            if h.flat_param.grad is not None and h.flat_param.grad.numel() > h.flat_param._local_shard.numel()
        )
    total = 0
    for module in policy.modules():
        group = module._get_fsdp_state()._fsdp_param_group if hasattr(module, "_get_fsdp_state") else None
        for fsdp_param in group.fsdp_params if group is not None else []:
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            for grad in (fsdp_param.unsharded_accumulated_grad, None if unsharded is None else unsharded.grad):
                total += 0 if grad is None else grad.numel()
    return total


def gathered_units(model) -> int:
    """Units of `model` whose parameters are gathered (unsharded) right now."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if isinstance(model, FSDP):
        handles = [
            u._handle for u in FSDP.fsdp_modules(model) if u._handle is not None and u._handle.uses_sharded_strategy
        ]
        return sum(h.flat_param.data_ptr() != h.flat_param._local_shard.data_ptr() for h in handles)
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    groups = [m._get_fsdp_state()._fsdp_param_group for m in model.modules() if hasattr(m, "_get_fsdp_state")]
    return sum(any(p.sharded_state != ShardedState.SHARDED for p in g.fsdp_params) for g in groups if g is not None)


def kto_global_batch(tokenizer) -> dict:
    """The first 8 toy pairs turned unpaired, collated with their mismatched (KL) rows."""
    import preference_datasets as data

    examples = data.load_tokenized(
        ["toy"], tokenizer, "train", max_length=64, max_prompt_length=32, unpaired=True, pairs_to_unpaired=True
    )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id  # masked anyway
    return data.collate(examples[:8], pad, kl_rows=True)


def worker(rank, world_size, port, out_dir):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # a rank that failed alone: no long hang
    results = {}
    try:
        for name, (args, _) in SCENARIOS.items():
            start = time.time()
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    results[name] = run_scenario(name, args, rank, world_size, Path(out_dir))
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


class Results(dict):
    """Scenario name -> what rank 0 recorded; a scenario that raised fails the tests that read it, with its error."""

    def __getitem__(self, name):
        info = super().__getitem__(name)
        assert "error" not in info, f"scenario {name} failed: {info['error']}"
        return info


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("fsdp")
    mp.spawn(worker, args=(2, get_open_port(), str(out_dir)), nprocs=2, join=True)
    return out_dir, Results(torch.load(out_dir / "results.pt", weights_only=False))


@pytest.fixture(scope="module")
def baselines(tmp_path_factory):
    """BasicTrainer in this process on the full batch: the reference every sharded run must match."""
    out = tmp_path_factory.mktemp("single")
    for name, args in (
        ("sgd", SGD_ONE_STEP),
        ("adamw", [*ADAMW_3, *SAMPLES_12]),
        ("kto_sgd", [*SGD_ONE_STEP, *KTO]),
        ("skewed_sgd", SKEWED),
        ("trdpo_sgd", [*SGD_TWO, *TR_DPO]),
        ("lora_adamw", [*ADAMW_3, *LORA]),
        ("tied_sgd", TIED),
    ):
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            assert train_py.main([*FAST, f"run_dir={out / name}", *args]) == 0
    return out


def final_state(run_dir: Path) -> dict:
    return torch.load(run_dir / "LATEST" / "policy.pt", weights_only=True)["state"]


def assert_close_states(a, b, atol):
    assert a.keys() == b.keys()
    worst = max((x.float() - y.float()).abs().max().item() for x, y in ((a[k], b[k]) for k in a))
    assert worst <= atol, f"max |difference| {worst:.3g} > {atol}"


def loss_trace(run_dir: Path) -> list[float]:
    return [
        r["loss/train"]
        for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if "loss/train" in r
    ]


# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
def test_gradients_equal_one_process_on_the_full_batch(fsdp_results, baselines, strategy):
    """SGD with lr 1 for one step: the parameter change IS the gradient, so this compares gradients."""
    out, _ = fsdp_results
    before = AutoModelForCausalLM.from_pretrained(REPO / "toy" / "tiny-llama").state_dict()
    sharded, single = final_state(out / f"{strategy}_sgd"), final_state(baselines / "sgd")
    grads_sharded = {k: before[k] - v for k, v in sharded.items()}
    grads_single = {k: before[k] - v for k, v in single.items()}
    assert max(g.abs().max().item() for g in grads_single.values()) > 1e-3  # a real step happened
    assert_close_states(grads_sharded, grads_single, atol=1e-6)


@pytest.mark.parametrize(
    "scenario", ["fsdp_skewed", "fsdp2_skewed_accumulation", "fsdp2_skewed_budget", "fsdp2_skewed_consecutive"]
)
def test_balanced_shares_give_the_gradient_of_the_whole_batch(fsdp_results, baselines, scenario):
    """Length-skewed pairs are dealt in equal counts of near-equal tokens (the long pairs spread over the ranks;
    consecutive halves with balance_batch=false, as the original code): one SGD step (lr 1) equals
    one process on the whole batch, alone, in 2 micro-batches per rank or under a token budget; loss/train too."""
    out, results = fsdp_results
    (rank0,), (rank1,) = results[scenario]["shares"]  # one step
    assert len(rank0) == len(rank1) == 4 and not set(rank0) & set(rank1)
    longs = [sum("snow" in text for text in share) for share in (rank0, rank1)]
    assert scenario.endswith("consecutive") or abs(longs[0] - longs[1]) <= 1  # balanced: the long pairs spread out
    before = AutoModelForCausalLM.from_pretrained(REPO / "toy" / "tiny-llama").state_dict()
    sharded, single = final_state(out / scenario), final_state(baselines / "skewed_sgd")
    assert max((before[k] - single[k]).abs().max().item() for k in single) > 1e-3  # a real step happened
    assert_close_states(
        {k: before[k] - v for k, v in sharded.items()}, {k: before[k] - v for k, v in single.items()}, atol=1e-6
    )
    assert loss_trace(out / scenario) == pytest.approx(loss_trace(baselines / "skewed_sgd"), abs=1e-6)


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
def test_parameters_after_three_adamw_steps_match(fsdp_results, baselines, strategy):
    out, _ = fsdp_results
    assert_close_states(final_state(out / f"{strategy}_adamw"), final_state(baselines / "adamw"), atol=1e-5)
    assert loss_trace(out / f"{strategy}_adamw") == pytest.approx(loss_trace(baselines / "adamw"), abs=1e-5)


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
def test_bf16_mixed_precision_stays_within_1e_2_of_fp32(fsdp_results, strategy):
    out, results = fsdp_results
    assert results[f"{strategy}_bf16"]["mixed_param_dtype"] == "torch.bfloat16"
    fp32, bf16 = loss_trace(out / f"{strategy}_adamw"), loss_trace(out / f"{strategy}_bf16")
    assert len(bf16) == 3 and max(abs(a - b) for a, b in zip(fp32, bf16)) < 1e-2
    assert fp32 != bf16  # bf16 really ran


def test_default_wrapping_is_the_seed(fsdp_results):
    """FULL_SHARD over every LlamaDecoderLayer (2) plus the root, no checkpointing, no offload."""
    _, results = fsdp_results
    info = results["fsdp_adamw"]
    assert info["strategy"] == "FULL_SHARD" and info["units"] == 3 and info["checkpointed_blocks"] == 0
    assert not info["forward_prefetch"] and not info["use_orig_params"] and not info["offload_params"]
    info2 = results["fsdp2_adamw"]
    assert info2["units"] == 3 and info2["reshard_after_forward"] == [True] * 3 and info2["mesh_shape"] == (2,)
    assert info2["local_numel"] * 2 == info2["full_numel"]  # each rank holds half of every parameter


def test_fsdp1_knobs_take_effect_and_training_still_matches(fsdp_results, baselines):
    out, results = fsdp_results
    info = results["fsdp_knobs"]
    assert info["strategy"] == "SHARD_GRAD_OP"  # reshard_after_forward=false
    assert info["forward_prefetch"] is True and info["use_orig_params"] is True
    assert info["offload_params"] is torch.cuda.is_available()  # FSDP1 offload pins memory: GPU only
    assert info["checkpointed_blocks"] == 2  # NO_REENTRANT wrapper on each block
    # optimizer_offload: at each of the 3 steps the state comes to its parameters, then goes back to CPU
    assert info["optimizer_state_moves"] == ["parameter's device", "cpu"] * 3
    assert results["fsdp_adamw"]["optimizer_state_moves"] == []  # and without the knob it stays put
    assert_close_states(final_state(out / "fsdp_knobs"), final_state(baselines / "adamw"), atol=1e-5)


def test_fsdp2_knobs_take_effect_and_training_still_matches(fsdp_results, baselines):
    out, results = fsdp_results
    info = results["fsdp2_knobs"]
    assert info["reshard_after_forward"] == [False] * 3
    assert info["forward_prefetch"] == 1  # block 0 prefetches block 1
    assert info["checkpointed_blocks"] == 2
    assert info["offload_policy"] == ["CPUOffloadPolicy"] * 3 and info["param_device"] == "cpu"
    assert info["optimizer_state_moves"] == ["parameter's device", "cpu"] * 3
    assert_close_states(final_state(out / "fsdp2_knobs"), final_state(baselines / "adamw"), atol=1e-5)


def test_fsdp_size_1_replicates_and_training_still_matches(fsdp_results, baselines):
    out, results = fsdp_results
    assert results["fsdp_replicate"]["strategy"] == "NO_SHARD"
    info = results["fsdp2_replicate"]
    assert info["mesh_shape"] == (2, 1) and info["local_numel"] == info["full_numel"]  # a full copy per rank
    for name in ("fsdp_replicate", "fsdp2_replicate"):
        assert_close_states(final_state(out / name), final_state(baselines / "adamw"), atol=1e-5)


def test_precomputed_reference_and_packing_work_under_fsdp(fsdp_results, baselines):
    out, results = fsdp_results
    assert_close_states(final_state(out / "fsdp2_precomputed_packed"), final_state(baselines / "adamw"), atol=1e-5)


def test_size_based_wrap_policy(fsdp_results, baselines):
    out, results = fsdp_results
    assert results["fsdp2_size_policy"]["units"] > 3  # finer units than the 2 blocks + root
    before = AutoModelForCausalLM.from_pretrained(REPO / "toy" / "tiny-llama").state_dict()
    sharded, single = final_state(out / "fsdp2_size_policy"), final_state(baselines / "sgd")
    assert_close_states(
        {k: before[k] - v for k, v in sharded.items()}, {k: before[k] - v for k, v in single.items()}, 1e-6
    )


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
def test_size_policy_keeps_a_tied_embedding_in_the_root_and_matches_one_process(fsdp_results, baselines, strategy):
    """A tied Llama under fsdp.wrap_policy={min_num_params: 100000}: units are the two MLPs and the root, which keeps
    the tied weight (never the LlamaModel holding it) and model.layers (a ModuleList). Before: FSDP1 flattened the
    tied weight into the LlamaModel's unit and again into the root's, so embedding and head trained as two matrices;
    FSDP2 picked model.layers, which fully_shard refuses. One SGD step (lr 1) equals one process; still tied."""
    out, results = fsdp_results
    info = results[f"{strategy}_tied_size_policy"]
    assert info["tied"] and info["units"] == 3
    sharded = final_state(out / f"{strategy}_tied_size_policy")
    assert torch.equal(sharded["lm_head.weight"], sharded["model.embed_tokens.weight"])
    assert_close_states(sharded, final_state(baselines / "tied_sgd"), atol=1e-6)


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
def test_release_frees_every_shard_of_the_reference(fsdp_results, strategy):
    """sharding's release (precompute_ref_log_probs frees the reference with it): this rank's shards, to the byte,
    and nothing left in the reference's tensors (FSDP1's flat parameters and the copies it keeps beside them)."""
    _, results = fsdp_results
    for info in results[f"{strategy}_adamw"]["release"]:  # after forwards, and never run
        assert info["freed"] == info["shards"] > 0 and info["left"] == 0


def test_release_in_one_process_frees_the_model_and_a_forward_then_raises():
    """Tied weights counted once; the model keeps its shapes over no memory, and a forward raises (FSDP's all-gather
    from a freed shard would crash the process)."""
    model = AutoModelForCausalLM.from_pretrained(TIED[0].split("=", 1)[1])
    tensors = [*model.parameters(), *model.buffers()]  # the tied weight once
    size, cfg = sum(t.numel() * t.element_size() for t in tensors), load_config([*FAST, *TIED])[0]
    assert sharding.OneProcess(model, cfg).release(model) == size
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
    with pytest.raises(RuntimeError, match="released"):
        model(torch.tensor([[1, 2, 3]]))


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
def test_stopped_and_resumed_under_two_ranks_equals_uninterrupted(fsdp_results, strategy):
    out, results = fsdp_results
    assert results[f"{strategy}_interrupted"]["preempted_at"] == 8
    assert (out / f"{strategy}_interrupted" / "step-8" / "sharded").is_dir()
    resumed, uninterrupted = final_state(out / f"{strategy}_interrupted"), final_state(out / f"{strategy}_adamw")
    assert_close_states(resumed, uninterrupted, atol=0.0)


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
def test_hf_export_of_an_fsdp_run_equals_the_one_process_run(fsdp_results, baselines, strategy):
    """The HF export of a sharded run (with checkpoint wrappers around its blocks), loaded by plain
    from_pretrained, against weights it was NOT written from: the one-process run's. A shard missing from the
    gathered state, or a wrapper prefix in a key (from_pretrained would then keep random weights), fails."""
    out, _ = fsdp_results
    exported = AutoModelForCausalLM.from_pretrained(out / f"{strategy}_knobs" / "LATEST" / "hf")
    single = AutoModelForCausalLM.from_pretrained(REPO / "toy" / "tiny-llama")
    single.load_state_dict(final_state(baselines / "adamw"))
    assert_close_states(exported.state_dict(), single.state_dict(), atol=1e-5)
    ids = torch.tensor([[0, 200, 200, 269, 27, 316, 340, 15]])
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, single(ids).logits, atol=1e-4, rtol=0)


def test_sampling_under_fsdp_does_not_hang_and_is_logged(fsdp_results, baselines):
    """Every evaluation samples 12 prompts, logs their rule rates and writes them to samples.jsonl: the same samples
    as one process for the same seed (prompts in groups with seeds of their own, whatever rank generates them;
    before: each rank drew from its own eval batches and stream, so a sweep's samples changed with the world size)."""
    out, results = fsdp_results
    evals = [
        r for r in map(json.loads, (out / "fsdp2_adamw" / "metrics.jsonl").read_text().splitlines()) if "loss/eval" in r
    ]
    assert evals and all("samples/policy_rule_rate" in r for r in evals)
    sharded = (out / "fsdp2_adamw" / "samples.jsonl").read_text().splitlines()
    assert (
        len(sharded) == 12 * len(evals) and sharded == (baselines / "adamw" / "samples.jsonl").read_text().splitlines()
    )
    assert results["fsdp2_adamw"]["seconds"] < 120


def test_a_failing_rank_ends_the_whole_torchrun_job_fast(tmp_path):
    """Rank 1 raises at its second step while rank 0 waits in a collective: torchrun must end both, non-zero."""
    script = REPO / "tests" / "data" / "failing_rank.py"
    start = time.time()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(get_open_port()),
            str(script),
            *FAST,
            *ADAMW_3,
            "trainer=FSDPTrainer",
            f"run_dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    elapsed = time.time() - start
    assert result.returncode != 0
    assert "injected failure on rank 1" in result.stderr + result.stdout
    assert elapsed < 60 + 30, f"{elapsed:.0f}s"  # 30 s of imports and loading on this 2-core machine


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs (nccl)")
def test_nccl_fsdp2_with_pinned_cpu_offload_on_gpus(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-u",
            str(REPO / "train.py"),
            *FAST,
            *ADAMW_3,
            "trainer=FSDPTrainer",
            "fsdp.strategy=fsdp2",
            "fsdp.offload_policy=true",
            f"run_dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
def test_kto_under_two_ranks_equals_one_process_and_its_kl_spans_both_ranks(fsdp_results, baselines, strategy):
    """One SGD step (lr 1) of KTO on 2 ranks equals one process on the full batch (step 0: policy = reference, so
    the KL point is 0 both ways). After it, each rank scores half of one batch's mismatched rows and the KL point
    both report is the mean over ALL 8 rows, computed here in one process with plain HF forwards."""
    from transformers import AutoTokenizer

    out, results = fsdp_results
    assert_close_states(final_state(out / f"{strategy}_kto"), final_state(baselines / "kto_sgd"), atol=1e-6)
    policy = AutoModelForCausalLM.from_pretrained(out / f"{strategy}_kto" / "LATEST" / "hf")
    reference = AutoModelForCausalLM.from_pretrained(REPO / "toy" / "tiny-llama")
    batch = kto_global_batch(AutoTokenizer.from_pretrained(REPO / "toy" / "tiny-llama"))

    def sums(model):
        with torch.no_grad():
            logits = model(input_ids=batch["kl_input_ids"], attention_mask=batch["kl_attention_mask"]).logits
        labels = batch["kl_labels"][:, 1:]
        logps = logits[:, :-1].log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
        return (logps * (labels != -100)).sum(-1)

    log_ratios = sums(policy) - sums(reference)
    assert results[f"{strategy}_kto"]["kl"] == pytest.approx(log_ratios.mean().item(), abs=1e-4)
    assert abs(log_ratios[:4].mean() - log_ratios[4:].mean()) > 1e-3  # a rank-local mean would differ


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
def test_tr_dpo_soft_updates_of_the_sharded_reference_match_one_process(fsdp_results, baselines, strategy):
    """Two SGD steps (lr 1) with a soft reference update after each: each rank updates its own reference shards
    from its policy shards (no gather), and the second step's gradient, which reads the updated reference, equals
    one process's. FSDP1 with the hard update (alpha 1): each step starts with reference = policy, so both losses
    are ln 2, which holds only if every flat reference shard took its own policy shard's values."""
    out, _ = fsdp_results
    assert_close_states(final_state(out / f"{strategy}_trdpo"), final_state(baselines / "trdpo_sgd"), atol=1e-5)
    assert loss_trace(out / f"{strategy}_trdpo") == pytest.approx(loss_trace(baselines / "trdpo_sgd"), abs=1e-6)
    if strategy == "fsdp":
        assert loss_trace(out / "fsdp_trdpo_hard") == pytest.approx([0.6931472] * 2, abs=1e-6)


def test_tr_dpo_under_fsdp2_resumes_exactly_with_its_sharded_reference(fsdp_results):
    out, results = fsdp_results
    assert results["fsdp2_trdpo_interrupted"]["preempted_at"] == 8
    assert (out / "fsdp2_trdpo_interrupted" / "step-8" / "reference_sharded").is_dir()
    assert_close_states(final_state(out / "fsdp2_trdpo_interrupted"), final_state(out / "fsdp2_trdpo"), atol=0.0)
    assert loss_trace(out / "fsdp2_trdpo_interrupted") == loss_trace(out / "fsdp2_trdpo")


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
def test_lora_under_fsdp_samples_matches_one_process_and_exports_merged_weights(fsdp_results, baselines, strategy):
    """LoRA (adapters only trainable, reference = base with adapters off) on 2 ranks: the same three AdamW steps as
    one process, sampling policy and reference at every evaluation (before: the first evaluation crashed, peft's
    generate skipping the root unit); the HF export is plain merged weights, the adapter directory peft's own."""
    out, results = fsdp_results
    name = f"{strategy}_lora"
    results[name]  # noqa: B018 - fails with the scenario's error if it raised
    evals = [r for r in map(json.loads, (out / name / "metrics.jsonl").read_text().splitlines()) if "loss/eval" in r]
    assert len(evals) == 4 and all(
        "samples/policy_rule_rate" in r and "samples/reference_rule_rate" in r for r in evals
    )
    assert_close_states(final_state(out / name), final_state(baselines / "lora_adamw"), atol=1e-5)
    losses_ = loss_trace(out / name)
    assert losses_[0] == pytest.approx(0.6931472, abs=1e-6)  # reference = policy with adapters off, B = 0 at start
    exported = AutoModelForCausalLM.from_pretrained(out / name / "LATEST" / "hf")
    assert (out / name / "LATEST" / "adapter" / "adapter_config.json").is_file()
    base = AutoModelForCausalLM.from_pretrained(REPO / "toy" / "tiny-llama").state_dict()
    changed = [k for k, v in exported.state_dict().items() if not torch.equal(v, base[k])]
    assert changed and all("proj" in k for k in changed)  # the adapters' linears moved; embeddings, norms did not


def test_gradients_are_reduce_scattered_after_every_micro_batch_unless_asked(fsdp_results, baselines):
    """By default a micro-batch's backward ends with its reduce-scatter, so no rank holds the whole model's
    gradients between micro-batches (before: no_sync / set_requires_gradient_sync(False), P x 4 bytes per rank);
    no_sync_accumulation=true opts in to skipping it, and gives the same step."""
    out, results = fsdp_results
    for name in ("fsdp2_skewed_accumulation", "fsdp2_skewed_budget"):
        info = results[name]
        assert info["skipped_syncs"] == 0 and info["unsharded_grads_between_micro_batches"], name
        assert set(info["unsharded_grads_between_micro_batches"]) == {0}, name
    assert results["fsdp_skewed_no_sync"]["skipped_syncs"] == 1  # 2 micro-batches: the first one skipped
    before = AutoModelForCausalLM.from_pretrained(REPO / "toy" / "tiny-llama").state_dict()
    sharded, single = final_state(out / "fsdp_skewed_no_sync"), final_state(baselines / "skewed_sgd")
    assert_close_states(
        {k: before[k] - v for k, v in sharded.items()}, {k: before[k] - v for k, v in single.items()}, 1e-6
    )


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
def test_the_reference_is_resharded_after_every_forward_and_tr_dpo_updates_it_with_every_knob(
    fsdp_results, baselines, strategy
):
    """The forward-only reference never stays gathered: not FSDP1's root unit after any forward, not any unit under
    reshard_after_forward=false (before: the whole reference resident on every rank, and TR-DPO under FSDP2 met
    full shapes against the policy's shards). TR-DPO with activation checkpointing (wrapper names on the policy
    only) and that knob still matches one process."""
    out, results = fsdp_results
    for name in (f"{strategy}_adamw", f"{strategy}_knobs", f"{strategy}_trdpo_knobs"):
        gathered = results[name]["reference_gathered_after_forward"]
        assert gathered and set(gathered) == {0}, (name, gathered)
    assert_close_states(final_state(out / f"{strategy}_trdpo_knobs"), final_state(baselines / "trdpo_sgd"), atol=1e-5)
    assert loss_trace(out / f"{strategy}_trdpo_knobs") == pytest.approx(loss_trace(baselines / "trdpo_sgd"), abs=1e-6)


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
def test_under_bf16_the_reference_computes_as_the_policy_so_step_0_is_ln2(fsdp_results, strategy):
    """fsdp.mixed_precision=bf16: the reference computes in bf16 as the policy does (before: in fp32, several times
    slower on GPUs without TF32, and unequal to the policy at step 0)."""
    out, _ = fsdp_results
    assert loss_trace(out / f"{strategy}_bf16")[0] == pytest.approx(0.6931472, abs=1e-6)
