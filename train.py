"""Train a language model on preferences: SFT, DPO and its family.

    bash toy/main_job.sh                                                    # the offline toy task: SFT, then DPO
    python -u train.py model=pythia28 datasets=[hh] loss=dpo loss.beta=0.1  # one process (several GPUs: device_map)
    python -u train.py trainer=FSDPTrainer fsdp.strategy=fsdp2 ...          # sharded, one process per GPU
    torchrun --nnodes 2 --nproc_per_node 8 ... train.py trainer=FSDPTrainer ...  # several nodes

`--help` lists every key, the flags (--cfg, --estimate, --replay) and the exit codes; README.md shows the rest
(and the departures from the original DPO code).
SIGTERM or Ctrl-C stop after the step with a checkpoint and print the command that resumes.
"""

import dataclasses
import importlib.util
import os
import shlex
import shutil
import signal
import socket
import sys
import warnings
from pathlib import Path

from config import DTYPES, ConfigError, data_parallel_size, dtype_of, help_text, load_config, loss_registry
from config import known_world_size, to_yaml, validate

if __name__ == "__main__":  # before the imports below: they take seconds (torch), and they import losses.py
    if {"--help", "-h"} & set(sys.argv[1:]):
        print(help_text())
        sys.exit(0)
    try:
        loss_registry()  # the researcher's losses.py: whatever it cannot provide is named by file and line
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)

import torch  # noqa: E402

import logps  # noqa: E402
import losses  # noqa: E402
import preference_datasets as data  # noqa: E402
import run_manifest  # noqa: E402
import self_check  # noqa: E402
import sources  # noqa: E402
import trainers  # noqa: E402
import utils  # noqa: E402
# transformers and peft are imported where they are used, after work_offline_if_the_hub_is_unreachable: the hub
# libraries read HF_HUB_OFFLINE once, when they are first imported.

REPO = Path(__file__).resolve().parent


def resolve_local(path: str) -> str:
    """A relative path that exists under the repository (toy/tiny-llama) works from any working directory."""
    return str(REPO / path) if path and not Path(path).exists() and (REPO / path).exists() else path


def load_tokenizer(cfg):
    """The run's tokenizer (no weights), with a pad token and model.chat_template applied."""
    import transformers

    name = resolve_local(cfg.model.tokenizer_name_or_path or cfg.model.name_or_path)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(name, trust_remote_code=cfg.model.trust_remote_code)
    except (OSError, ValueError) as e:  # transformers raises OSError for a missing or unreachable repository
        raise ConfigError(
            [
                f"model.tokenizer_name_or_path / model.name_or_path={name!r}: cannot load a tokenizer"
                f" ({type(e).__name__}: {str(e).splitlines()[0]})"
            ]
        ) from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # padding is masked everywhere; any id will do
    if cfg.model.chat_template is not None:
        tokenizer.chat_template = sources.chat_template(cfg.model.chat_template)
    return tokenizer


def load_models(cfg, device_map=None, on_meta: bool = False):
    """(tokenizer, policy, reference or None). `on_meta`: the models' structure with no memory behind the weights
    (FSDP ranks other than 0: rank 0 loads the weights once, so a node holds one copy in host memory, not one per
    rank). Under LoRA the reference is the policy with its adapters off (trainers.Reference): None here."""
    import transformers

    transformers.utils.logging.disable_progress_bar()  # one bar per weight shard drowns the training bar
    path = resolve_local(cfg.model.name_or_path)
    remote = cfg.model.trust_remote_code

    def load(dtype: torch.dtype):
        if on_meta:
            with torch.device("meta"):
                config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=remote)
                model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=remote)
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, device_map=device_map, trust_remote_code=remote
            )
        utils.disable_dropout(model)
        return model

    compute = DTYPES.get((cfg.fsdp.mixed_precision_dtypes() or {}).get("param_dtype"))  # None: no mixed precision
    mixed = compute and cfg.reference_mixed  # the reference's; the policy's is compute alone
    utils.rank0_print(
        f"loading policy {path} in {cfg.fsdp.model_dtype}" + (f", computing in {compute}" if compute else "")
    )
    policy = load(dtype_of(cfg.fsdp.model_dtype))
    reference = None
    if losses.needs_reference(cfg.loss_names, cfg.loss.reference_free) and cfg.lora.r is None:
        dtype = cfg.model.reference_dtype or cfg.fsdp.model_dtype  # null: the policy's dtype
        utils.rank0_print(f"loading reference {path} in {dtype}, computing in {compute if mixed else dtype}")
        reference = load(dtype_of(dtype)).eval().requires_grad_(False)
    if cfg.model.archive and not on_meta:
        load_archive(cfg.model.archive, policy, reference)
    if cfg.lora.r is not None:
        policy = add_lora(cfg.lora, policy)
    return load_tokenizer(cfg), policy, reference


def add_lora(lora, policy):
    """The policy with peft's LoRA adapters (lora.r set); only they train."""
    import peft  # optional: check_inputs refused lora.r without it, before any model loaded

    with warnings.catch_warnings():  # peft asks transformers a deprecated question on every run: not the user's to fix
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        policy = peft.get_peft_model(
            policy,
            peft.LoraConfig(
                r=lora.r,
                lora_alpha=lora.alpha,
                lora_dropout=lora.dropout,
                bias="none",
                target_modules=lora.target_modules,
                task_type="CAUSAL_LM",
            ),
        )
    utils.rank0_print(
        f"LoRA r={lora.r} alpha={lora.alpha} on {lora.target_modules}: "
        f"{sum(p.numel() for p in policy.parameters() if p.requires_grad)} trainable parameters of "
        f"{sum(p.numel() for p in policy.parameters())}"
    )
    return policy


def load_archive(path: str, policy, reference=None) -> None:
    """The weights of an earlier run's policy.pt into `policy` (and `reference`), checked against it first."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)["state"]
    except Exception as e:  # noqa: BLE001 - any unreadable file: say which and why
        raise ConfigError([f"model.archive={path}: not a policy.pt checkpoint ({type(e).__name__}: {e})"]) from None
    expected = policy.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    shapes = [
        f"{k}: {tuple(state[k].shape)} vs {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state and state[k].shape != v.shape
    ]
    if missing or unexpected or shapes:
        raise ConfigError(
            [
                f"model.archive={path} does not fit model {type(policy).__name__}: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}, shape mismatches {shapes[:5]}"
            ]
        )
    for target in filter(None, (policy, reference)):
        target.load_state_dict(state)
    utils.rank0_print(f"loaded archive {path} into policy" + (" and reference" if reference is not None else ""))


def work_offline_if_the_hub_is_unreachable(cfg) -> None:
    """When the run needs the Hugging Face hub and a 3-second connection fails, set HF_HUB_OFFLINE and
    HF_DATASETS_OFFLINE (for its ranks too): a file missing from the cache then fails at once, not after retries."""
    names = {cfg.model.name_or_path, cfg.model.tokenizer_name_or_path or cfg.model.name_or_path}
    hub = [n for n in names if not Path(resolve_local(n)).exists()]
    hub += [d for d in cfg.datasets if sources.on_hub(d)]
    if not hub or utils.hub_offline():
        return
    try:
        socket.create_connection(("huggingface.co", 443), timeout=3).close()
    except OSError as e:
        os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
        print(
            f"the Hugging Face hub is unreachable ({e}): {', '.join(sorted(set(hub)))} must come from the local cache"
            " (HF_HUB_OFFLINE=1 set for this run)",
            file=sys.stderr,
        )


def check_inputs(cfg, world_size: int) -> dict:
    """The checks of the user's input beyond the config's that need no model (--cfg runs them too); returns the
    tokenized splits."""
    if cfg.lora.r is not None and importlib.util.find_spec("peft") is None:
        raise ConfigError([f"lora.r={cfg.lora.r}: LoRA needs the optional dependency peft: pip install peft"])
    sources.validate_sources(cfg.datasets)
    if cfg.model.archive and not Path(cfg.model.archive).is_file():
        raise ConfigError([f"model.archive={cfg.model.archive}: no such file (expected <run dir>/LATEST/policy.pt)"])
    if cfg.resume_from:  # under torchrun every rank runs this: sizes here, rank 0 alone hashes (distributed_worker)
        ckpt = trainers.validate_checkpoint(Path(cfg.resume_from) / "LATEST", hashes=not started_by_torchrun(cfg))
        trainers.check_compatible(torch.load(ckpt / "trainer_state.pt", weights_only=True), cfg, world_size)
    elif cfg.run_dir and (Path(cfg.run_dir) / "LATEST").exists():  # a fresh start may not reuse a run's directory
        raise FileExistsError(
            f"run_dir={cfg.run_dir} already holds a run; resume it with resume_from={cfg.run_dir} or pick a new run_dir"
        )
    if cfg.tiled_lm_head:
        check_tiled_head(cfg)
    if cfg.fsdp.ulysses_sequence_parallel_size > 1:
        check_sequence_parallel(cfg)
    if cfg.loss.router_aux_loss is not None:
        check_router_aux_loss(cfg)
    splits = check_data(cfg, world_size)
    if cfg.online.rounds:  # semi-online DPO: its scorer and prompts, before any model loads
        import online

        online.check(cfg, load_tokenizer(cfg))
    return splits


def check_tiled_head(cfg) -> None:
    """tiled_lm_head=true redoes the LM head's post-processing by model type: a head it does not know is refused here,
    from config.json alone (logps.tiled_head; the first tiled forward refuses it too)."""
    import transformers

    name = resolve_local(cfg.model.name_or_path)
    try:
        config = transformers.AutoConfig.from_pretrained(name, trust_remote_code=cfg.model.trust_remote_code)
    except (OSError, ValueError):  # unreadable here: loading the model reports it
        return
    try:
        logps.tiled_head(config)
    except ValueError as e:
        raise ConfigError([f"model.name_or_path={name!r}: {e}"]) from None


def check_router_aux_loss(cfg) -> None:
    """loss.router_aux_loss balances the routers of a mixture of experts: refused, from config.json alone, for a model
    without experts, and `model` for one whose config has no router_aux_loss_coef."""
    import transformers

    name = resolve_local(cfg.model.name_or_path)
    value = cfg.loss.router_aux_loss
    try:
        config = transformers.AutoConfig.from_pretrained(name, trust_remote_code=cfg.model.trust_remote_code)
    except (OSError, ValueError):  # unreadable here: loading the model reports it
        return
    if trainers.expert_share(config) == 1:
        raise ConfigError(
            [
                f"loss.router_aux_loss={value}: model type {config.model_type!r} (model.name_or_path="
                f"{name!r}) has no experts (num_experts_per_tok), so no router to balance; set "
                "loss.router_aux_loss=null"
            ]
        )
    if value == "model" and getattr(config, "router_aux_loss_coef", None) is None:
        raise ConfigError(
            [
                f"loss.router_aux_loss=model: the config of model type {config.model_type!r} has no "
                "router_aux_loss_coef; set a number"
            ]
        )


def check_sequence_parallel(cfg) -> None:
    """Ulysses gives each rank of a group heads / sp whole attention heads: sp must divide the model's attention heads
    (fewer key/value heads are repeated); RoPE types that scale by the longest position of a call are refused."""
    import transformers

    name = resolve_local(cfg.model.name_or_path)
    sp = cfg.fsdp.ulysses_sequence_parallel_size
    try:
        config = transformers.AutoConfig.from_pretrained(name, trust_remote_code=cfg.model.trust_remote_code)
        heads = config.num_attention_heads
    except (OSError, ValueError, AttributeError) as e:
        raise ConfigError(
            [
                f"fsdp.ulysses_sequence_parallel_size={sp}: cannot read the attention heads of model.name_or_path="
                f"{name!r} ({type(e).__name__}: {str(e).splitlines()[0]})"
            ]
        ) from None
    if heads % sp:
        raise ConfigError(
            [
                f"fsdp.ulysses_sequence_parallel_size={sp}: expected a divisor of the {heads} attention heads of"
                f" model.name_or_path={name!r} (each rank of a sequence-parallel group attends with heads / {sp})"
            ]
        )
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    # Gemma 3: one per layer type
    kinds = [r.get("rope_type", r.get("type")) for r in (rope, *rope.values()) if isinstance(r, dict)]
    if kind := next((k for k in kinds if k in ("dynamic", "longrope")), None):  # each rank sees only its slice
        raise ConfigError(
            [
                f"fsdp.ulysses_sequence_parallel_size={sp} with model.name_or_path={name!r} (model type "
                f"{config.model_type!r}): its RoPE type {kind!r} scales frequencies by the longest position"
                " of a call, and each rank of a group sees only its slice of the positions: not supported yet"
            ]
        )
    # logps._score refuses the same at the first forward; sdpa is the default of a model class that supports it
    cls = transformers.AutoModelForCausalLM._model_mapping.get(type(config), None)
    window = logps.sliding_window(config, float("inf"))
    no_flex = cls is not None and cls._supports_sdpa and not cls._supports_flex_attn
    if torch.cuda.is_available() and no_flex and (cfg.padding_free or window):
        option = "padding_free=true" if cfg.padding_free else f"a sliding window ({window})"
        raise ConfigError(
            [
                f"fsdp.ulysses_sequence_parallel_size={sp} with {option}: {cls.__name__} (model type "
                f"{config.model_type!r}) does not attend through FlexAttention, and sdpa on CUDA would "
                "keep a dense (T, T) mask in every layer; "
                + ("set padding_free=false" if cfg.padding_free else "not supported yet")
            ]
        )


def check_data(cfg, world_size: int) -> dict:
    """Tokenize both splits as the trainer will (returned: handed on); refuse fewer training pairs than one step, or
    fewer eval pairs than ranks, naming each source and its drops; warn of a long warmup and of one file for both."""
    for name in cfg.datasets:
        if sources.serves_both_splits(name):
            print(
                f"datasets: {name} has no {{split}} in its path: the same pairs serve training and evaluation (name"
                " two files <dir>/train.jsonl and <dir>/test.jsonl as <dir>/{split}.jsonl, or hold out :test=0.05)"
            )
    splits = data.load_splits(cfg, load_tokenizer(cfg))
    train = splits["train"]
    if len(train) < cfg.batch_size:
        raise too_few_pairs(cfg, "train", train, f"batch_size={cfg.batch_size}")
    steps = data.num_steps(len(train), batch_size=cfg.batch_size, n_epochs=cfg.n_epochs, n_examples=cfg.n_examples)
    if steps and cfg.warmup_steps >= steps:
        print(
            f"warning: warmup_steps={cfg.warmup_steps} >= the run's {steps} steps: the learning rate never reaches"
            f" lr={cfg.lr:g} (set warmup_steps=N, N < {steps})",
            file=sys.stderr,
        )
    dp, ranks = data_parallel_size(cfg, world_size)
    if len(splits["test"]) < dp:
        raise too_few_pairs(cfg, "test", splits["test"], f"{ranks} {dp} (one eval pair per data-parallel rank)")
    return splits


def too_few_pairs(cfg, split: str, examples, knob: str) -> sources.DataError:
    """The refusal of a split left with fewer pairs than `knob` asks for, naming each source and what it dropped."""
    per_source = "; ".join(
        f"{s.source}: {s.unit}_kept={s.kept} of prompts={s.prompts}, dropped: "
        + (", ".join(f"{k}={v}" for k, v in s.dropped.items()) or "none")
        for s in examples.stats
    )
    return sources.DataError(
        f"datasets={list(cfg.datasets)} split {split!r}: {len(examples)} pairs left after filtering,"
        f" fewer than {knob} ({per_source}); add data, or for dropped over-long pairs raise"
        f" max_length={cfg.max_length}"
    )


def resume_run_dir(resume_from: str) -> str:
    """The run directory a resume continues, from what users copy: the run directory, its LATEST, or the step-N
    checkpoint LATEST points at (an earlier one would have its later checkpoints overwritten: refused)."""
    path = Path(resume_from)
    latest = path.parent / "LATEST"
    if (path / "LATEST").exists():
        return str(path)
    if latest.exists() and (path.name == "LATEST" or path.resolve() == latest.resolve()):
        return str(path.parent)
    if latest.exists() and path.name.startswith("step-"):
        raise FileNotFoundError(
            f"resume_from={resume_from}: not the run's latest checkpoint ({latest} -> {latest.resolve().name});"
            f" a resume continues from LATEST and would overwrite the later checkpoints. To go back to"
            f" {path.name}: ln -sfn {path.name} {latest}"
        )
    if (path / "config.yaml").is_file():
        raise FileNotFoundError(
            f"resume_from={resume_from}: no LATEST checkpoint there: the run stopped before its first"
            " checkpoint; start it again with the same command, without resume_from"
        )
    raise FileNotFoundError(
        f"resume_from={resume_from}: no checkpoint there; expected a run directory holding LATEST "
        "(or its LATEST, or the step-N checkpoint LATEST points at)"
    )


def world_size_of(cfg) -> int:
    """Processes that will train: config.known_world_size, else what `launch` starts (one per GPU, 2 on CPU)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0  # NVML may count GPUs CUDA cannot use
    return known_world_size(cfg) or gpus or 2


def worker_main(rank: int, world_size: int, cfg, run_dir: str, splits: dict | None = None) -> None:
    utils.seed_everything(cfg.seed, cfg.fsdp.full_determinism)
    device_map = balanced_device_map() if cfg.trainer == "BasicTrainer" and torch.cuda.device_count() > 1 else None
    tokenizer, policy, reference = load_models(cfg, device_map, on_meta=cfg.trainer == "FSDPTrainer" and rank != 0)
    splits = splits or data.load_splits(cfg, tokenizer)  # a spawned rank: from the cache check_inputs filled
    if rank == 0 and not cfg.resume_from:  # a resume keeps the manifest of the run it continues
        run_manifest.write(run_dir, cfg, splits, world_size)
    if world_size > 1:  # rank 0 read the weights alone; the others wait without collective_timeout_secs
        utils.wait_for_rank0()
    if cfg.trainer == "BasicTrainer" and device_map is None and torch.cuda.is_available():
        policy, reference = policy.to("cuda"), reference.to("cuda") if reference is not None else None
    trainer = getattr(trainers, cfg.trainer)(
        policy, cfg, cfg.seed, run_dir, reference, rank, world_size, tokenizer, splits
    )
    del policy, reference  # the trainer owns the models: precompute_ref_log_probs can free the reference for real
    trainer.train()


def balanced_device_map() -> str:
    """BasicTrainer on several GPUs: naive model parallel, as the original, by transformers' device_map."""
    if importlib.util.find_spec("accelerate") is None:  # transformers' device_map needs it; we do not
        raise ConfigError(
            [
                "trainer=BasicTrainer on several GPUs spreads the model with transformers' device_map,"
                " which needs `pip install accelerate`; or use trainer=FSDPTrainer"
            ]
        )
    return "balanced"


def prepare_run_dir(cfg) -> tuple[Path, bool]:
    """(the run directory, whether this run created it), with the resolved config saved in it as config.yaml
    (config.resumed.yaml on a resume, written only once check_inputs accepted the checkpoint)."""
    run_dir = Path(cfg.resume_from or cfg.run_dir or utils.get_local_run_dir(cfg.exp_name, cfg.local_dirs))
    created = not run_dir.exists()
    if run_dir.is_dir() and not cfg.resume_from:  # run_dir given again: an earlier start's files move aside
        keep_earlier_start(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    utils.atomic_write_text(run_dir / ("config.resumed.yaml" if cfg.resume_from else "config.yaml"), to_yaml(cfg))
    return run_dir, created


def keep_earlier_start(run_dir: Path) -> None:
    """The files of an earlier start that stopped before its first checkpoint (check_inputs refuses one with a
    checkpoint) move into previous-<n>/: the new logs begin clean, nothing is lost."""
    written = {"config.yaml", "config.resumed.yaml", "metrics.jsonl", "samples.jsonl", "wandb", "rounds"}
    written |= {run_manifest.MANIFEST, run_manifest.DIFF, self_check.REPORT}
    earlier = [p for p in run_dir.iterdir() if p.name in written or p.name.startswith("step-")]
    if earlier:
        keep = run_dir / f"previous-{1 + sum(p.name.startswith('previous-') for p in run_dir.iterdir())}"
        keep.mkdir()
        for p in earlier:
            os.replace(p, keep / p.name)
        print(
            f"run_dir={run_dir} held an earlier start without a checkpoint: its files moved to {keep}", file=sys.stderr
        )


def remove_orphan(run_dir, created: bool) -> None:
    """After a failure before training: remove the run directory this run created if it holds only its start files."""
    start_files = {"config.yaml", run_manifest.MANIFEST, run_manifest.DIFF}
    if created and Path(run_dir).is_dir() and {p.name for p in Path(run_dir).iterdir()} <= start_files:
        shutil.rmtree(run_dir)


def spawned_worker(rank: int, world_size: int, cfg, run_dir: str, port: int) -> None:
    """Entry of each process `launch` starts on one node (mp.spawn passes the rank first)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    try:
        distributed_worker(cfg, run_dir)
    except trainers.Interrupted as e:  # the launcher tells the user how to resume
        sys.exit(128 + e.signum)
    except self_check.SelfCheckError:  # every rank agreed; the launcher reads the message from run_dir/self_check.json
        sys.exit(4)
    except KeyboardInterrupt:  # a second Ctrl-C: stopped at once; the launcher says so, once
        sys.exit(128 + signal.SIGINT)


def distributed_worker(cfg, run_dir: str | None, splits: dict | None = None) -> None:
    """Join the process group (env://), agree on the run directory, train, leave."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    utils.init_distributed(cfg.collective_timeout_secs, cuda=torch.cuda.is_available())
    created = False
    try:
        torchrun = run_dir is None
        if rank == 0 and torchrun:  # rank 0 makes the directory
            run_dir, created = prepare_run_dir(cfg)
        run_dir = str(utils.broadcast_object(run_dir))
        check_shared_run_dir(run_dir)
        if torchrun and cfg.resume_from:  # check_inputs compared sizes on every rank; the bytes are hashed once
            verdict = rank == 0 and checkpoint_problem(Path(cfg.resume_from) / "LATEST")
            if verdict := utils.broadcast_object(verdict, slow=True):
                raise trainers.CheckpointError(verdict)
        worker_main(rank, world_size, cfg, run_dir, splits)
    except BaseException as e:
        remove_orphan(run_dir, created)
        if isinstance(e, KeyboardInterrupt):  # a second Ctrl-C under torchrun: one line per rank, no traceback
            raise interrupted(signal.SIGINT, Path(run_dir), cfg.batch_size, at_once=True) from None
        raise
    finally:
        utils.destroy_distributed()


def check_shared_run_dir(run_dir: str) -> None:
    """Every rank writes its checkpoint shards into run_dir: ranks on other nodes must see the directory rank 0
    made (a node-local local_dirs does not work across nodes)."""
    views = utils.all_gather_object((socket.gethostname(), (Path(run_dir) / "config.yaml").is_file()))
    if blind := sorted({host for host, seen in views if not seen}):
        raise ConfigError(
            [
                f"run_dir={run_dir}: rank 0 made it, but the ranks on {', '.join(blind)} do not see it; the"
                " nodes of a run must share it (set local_dirs or run_dir to a shared filesystem)"
            ]
        )


def checkpoint_problem(ckpt: Path) -> str | None:
    """validate_checkpoint's message for a damaged checkpoint, None for a sound one (a verdict to broadcast)."""
    try:
        trainers.validate_checkpoint(ckpt)
    except trainers.CheckpointError as e:
        return str(e)
    return None


def started_by_torchrun(cfg) -> bool:
    return cfg.trainer != "BasicTrainer" and "RANK" in os.environ and "WORLD_SIZE" in os.environ


def interrupted(signum: int, run_dir: Path, batch_size: int, at_once: bool = False) -> trainers.Interrupted:
    """The Interrupted that the ranks' exit (or a second Ctrl-C) means, at the run's LATEST checkpoint if any."""
    latest = run_dir / "LATEST"
    examples = int(os.readlink(latest).split("-")[1]) if latest.is_symlink() else None
    return trainers.Interrupted(signum, examples and examples // batch_size, examples, run_dir, at_once)


def spawn_ranks(cfg, world_size: int, run_dir: Path) -> None:
    """One process per rank on this node, joined. A scheduler's SIGTERM reaches this process only: it is passed on to
    the ranks, which stop after their step with a checkpoint. Ctrl-C reaches every process of the terminal already,
    so this one ignores it and waits for the ranks to stop."""
    print(f"starting {world_size} processes", flush=True)
    context = torch.multiprocessing.start_processes(
        spawned_worker,
        args=(world_size, cfg, str(run_dir), cfg.fsdp_port or utils.get_open_port()),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    signal.signal(signal.SIGTERM, lambda signum, frame: [os.kill(pid, signum) for pid in context.pids()])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        while not context.join():
            pass
    except torch.multiprocessing.ProcessExitedException as e:
        if e.exit_code == 4:
            raise self_check.SelfCheckError(self_check.failure(run_dir)) from None
        if e.exit_code not in (128 + signal.SIGTERM, 128 + signal.SIGINT):
            raise
        raise interrupted(e.exit_code - 128, run_dir, cfg.batch_size) from None
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def launch(cfg, splits: dict | None = None) -> None:
    """One process (BasicTrainer), this process as one torchrun rank, or N local processes (FSDPTrainer)."""
    if started_by_torchrun(cfg):
        return distributed_worker(cfg, None, splits)
    run_dir, created = prepare_run_dir(cfg)
    print(f"run directory: {run_dir}", flush=True)
    try:
        if cfg.trainer == "BasicTrainer":
            worker_main(0, 1, cfg, str(run_dir), splits)
        else:
            spawn_ranks(cfg, world_size_of(cfg), run_dir)
    except BaseException as e:
        remove_orphan(run_dir, created)
        if isinstance(e, KeyboardInterrupt):  # a second Ctrl-C: stopped at once, without a checkpoint
            raise interrupted(signal.SIGINT, run_dir, cfg.batch_size, at_once=True) from None
        raise
    print(f"done; run directory: {run_dir}", flush=True)


def interrupt_message(e: trainers.Interrupted, argv: list[str]) -> str:
    """One line: where the run stopped and the command that continues it (as given, resume_from replaced)."""
    kept = [a for a in argv if not a.lstrip("-").startswith("resume_from=")]
    name = signal.Signals(e.signum).name
    if e.examples is None:
        return (
            f"interrupted ({name}) before the first checkpoint: start again with: python -u train.py {shlex.join(kept)}"
        )
    resume = f"resume with: python -u train.py {shlex.join([*kept, f'resume_from={e.run_dir}'])}"
    if e.at_once:
        latest = f"the latest is step {e.step} ({e.examples} pairs)"
        return f"interrupted ({name}) at once, without a checkpoint; {latest}: {resume}"
    return f"interrupted at step {e.step} ({e.examples} pairs, {name}); {resume}"


def valued_flags(argv: list[str]) -> tuple[list[str], str | None, str | None]:
    """(argv without them, gpu, replay_of) of the flags that take a value: `--estimate [gpu=NAME]`, `--replay DIR`
    (replay_of "" when DIR is missing)."""
    gpu = replay_of = None
    if "--estimate" in argv:
        i = argv.index("--estimate")
        gpu = argv[i + 1][len("gpu=") :] if i + 1 < len(argv) and argv[i + 1].startswith("gpu=") else None
        argv = argv[:i] + argv[i + 1 + (gpu is not None) :]
    if "--replay" in argv:
        i = argv.index("--replay")
        replay_of = (argv + [""])[i + 1]
        argv = argv[:i] + argv[i + 2 :]
    return argv, gpu, replay_of


def main(argv: list[str] | None = None) -> int:
    """The command line: flags, then config; returns the exit code (--help lists both)."""
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
    estimating = "--estimate" in argv
    gpu = replay_of = None
    if estimating or "--replay" in argv:
        argv, gpu, replay_of = valued_flags(argv)
        if replay_of == "":
            print("error: --replay needs the run directory to replay: --replay <run dir>", file=sys.stderr)
            return 2
    try:
        cfg, flags = run_manifest.replay_config(replay_of, argv) if replay_of is not None else load_config(argv)
        if cfg.trainer == "BasicTrainer" and int(os.environ.get("WORLD_SIZE") or 1) > 1:  # each rank: a whole run
            ranks = os.environ["WORLD_SIZE"]
            raise ConfigError(
                [
                    f"trainer=BasicTrainer trains in one process, but WORLD_SIZE={ranks} (torchrun started {ranks}): "
                    "add trainer=FSDPTrainer, or unset WORLD_SIZE and start one process"
                ]
            )
        work_offline_if_the_hub_is_unreachable(cfg)
        world_size = world_size_of(cfg)
        if known_world_size(cfg) is None and (problems := validate(cfg, world_size)):  # load_config could not count
            raise ConfigError(problems)
        if estimating:  # from config.json alone: no weights
            import estimate  # its tables: off a training run's path (a CUDA trainer reads the GPU peaks)

            print(estimate.report(cfg, resolve_local(cfg.model.name_or_path), world_size, gpu))
            return 0
        if cfg.resume_from:  # the run directory, whichever of its paths was given
            cfg = dataclasses.replace(cfg, resume_from=resume_run_dir(cfg.resume_from))
        splits = check_inputs(cfg, world_size)
        if recorded := cfg.resume_from or replay_of:  # the data must be the recorded run's
            run_manifest.check_against(recorded, cfg, splits, "resume" if cfg.resume_from else "replay")
        if "--cfg" in flags:
            print(to_yaml(cfg), end="")
            return 0
        launch(cfg, splits)
        if replay_of is not None:
            print(run_manifest.report(replay_of, cfg.run_dir), flush=True)
    except (
        ConfigError,
        sources.DataError,
        FileExistsError,
        FileNotFoundError,
        run_manifest.ManifestError,
        trainers.CheckpointError,
        trainers.NonFiniteError,
        self_check.SelfCheckError,
    ) as e:
        print(f"error: {e}", file=sys.stderr)  # 2 bad input (nothing loaded or written), 3 non-finite, 4 self-check
        return 3 if isinstance(e, trainers.NonFiniteError) else 4 if isinstance(e, self_check.SelfCheckError) else 2
    except trainers.Interrupted as e:
        utils.rank0_print(interrupt_message(e, argv), file=sys.stderr)
        return 128 + e.signum
    return 0


if __name__ == "__main__":
    sys.exit(main())
