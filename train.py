"""Train a language model on preferences: SFT, DPO and its family.

One process (CPU, one GPU, or several GPUs as naive model parallel):

    bash toy/main_job.sh          # the offline toy task, SFT then DPO: these two commands (README: what it shows)
    python -u train.py loss=sft exp_name=toy_sft lr=1e-3 optimizer=AdamW warmup_steps=10 n_epochs=2 batch_size=16 max_length=64 max_prompt_length=32
    python -u train.py loss=dpo exp_name=toy_dpo lr=1e-4 optimizer=AdamW warmup_steps=10 batch_size=16 max_length=64 max_prompt_length=32 \
        loss.beta=0.1 model.archive=.cache/runs/<toy_sft run>/LATEST/policy.pt
    python -u train.py model=pythia28 datasets=[hh] loss=dpo loss.beta=0.1 batch_size=64 gradient_accumulation_steps=2

Sharded (FSDP1 or FSDP2), one process per GPU (or `n_workers` CPU processes), started for you:

    python -u train.py trainer=FSDPTrainer model=pythia28 datasets=[hh] loss=dpo fsdp.strategy=fsdp2

Several nodes, with torchrun (env:// rendezvous; nccl on GPU, gloo on CPU):

    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $HOST:29500 train.py trainer=FSDPTrainer ...

`python -u train.py --help` lists every key; `--cfg` runs every check the run makes before it loads a model
(config, data, archive, resume checkpoint), then prints the resolved config and exits.
Resume a run exactly where it stopped: `python -u train.py <same arguments> resume_from=<run dir>`.
Run a recorded run again and compare its metrics: `python -u train.py --replay <run dir>` (run_manifest.py).
Memory per rank and FLOPs per step before booking a GPU: `python -u train.py <args> --estimate [gpu=H100]` (estimate.py).

Departures from the original DPO code (eric-mitchell/direct-preference-optimization):
  1. No Hydra: our own loader (config.py) with typed, validated keys; the original command lines still parse.
  2. Data order honours `seed`, pairs (not prompts) are shuffled, tokenization happens once and is cached,
     BOS is added where the tokenizer expects it and EOS ends every complete response.
  3. FSDP: rank 0 loads the weights, the other ranks build empty (meta) models that FSDP fills from rank 0
     (one copy in host memory per node, not one per rank); nothing is pickled through mp.spawn; multi-node
     runs start with torchrun.
  4. Gradient sync is skipped on all but the last micro-batch; sampling under FSDP does not hang.
  5. Checkpoints are atomic, resumable (optimizer, scheduler, RNG, data position) and come with a
     Hugging Face export; `debug=true` writes none.
  6. The final evaluation runs at the end of training too, and evaluation metrics average the whole eval set.
  7. On GPUs the process group is cpu:gloo,cuda:nccl (CPU tensors take gloo); the non-finite guard decides once for
     all ranks; rank 0's lone work (loading weights, writing checkpoints) is waited for with a long timeout of its own.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import shlex
import shutil
import signal
import socket
import sys
from pathlib import Path

import estimate  # json and math only: --estimate must not wait for torch
import run_manifest
from config import ConfigError, OnFirstUse, data_parallel_size, help_text, load_config, to_yaml, validate
from estimate import EstimateError

REPO = Path(__file__).resolve().parent


# The one place train.py defers imports: these modules import torch (seconds), and `--help`, `--estimate` and
# config errors answer without it. Each is imported the first time the run reads one of its names.
torch = OnFirstUse("torch")
transformers = OnFirstUse("transformers")
losses = OnFirstUse("losses")
data = OnFirstUse("preference_datasets")
trainers = OnFirstUse("trainers")
utils = OnFirstUse("utils")
peft = OnFirstUse("peft")  # optional (LoRA): check_inputs refuses lora.r without it, before any model loads


def resolve_local(path: str) -> str:
    """A relative path that exists under the repository (toy/model) works from any working directory."""
    if path and not Path(path).exists() and (REPO / path).exists():
        return str(REPO / path)
    return path


def load_models(cfg, device_map=None, on_meta: bool = False):
    """tokenizer, policy, reference (None when the loss needs none), as the config says.

    `on_meta`: build the models' structure only, with no memory behind the weights (FSDP ranks other than 0:
    rank 0 loads the weights once and FSDP broadcasts them, so a node holds one copy in host memory, not one
    per rank)."""
    transformers.utils.logging.disable_progress_bar()  # one bar per weight shard drowns the training bar

    model_path = resolve_local(cfg.model.name_or_path)
    tokenizer = load_tokenizer(cfg)

    def load(dtype):
        if on_meta:
            config = transformers.AutoConfig.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)
            with torch.device("meta"):
                model = transformers.AutoModelForCausalLM.from_config(config, dtype=utils.dtype_of(dtype), trust_remote_code=cfg.model.trust_remote_code)
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=utils.dtype_of(dtype), device_map=device_map,
                                                         trust_remote_code=cfg.model.trust_remote_code)
        utils.disable_dropout(model)
        return model

    utils.rank0_print(f"loading policy {model_path} in {cfg.fsdp.model_dtype}")
    policy = load(cfg.fsdp.model_dtype)
    reference = None
    if losses.needs_reference(cfg.loss_names, cfg.loss.reference_free) and cfg.lora.r is None:  # LoRA: see add_lora
        reference_dtype = cfg.model.reference_dtype or cfg.fsdp.model_dtype  # null: the policy's dtype
        utils.rank0_print(f"loading reference {model_path} in {reference_dtype}")
        reference = load(reference_dtype).eval().requires_grad_(False)
    if cfg.model.archive and not on_meta:
        state = load_archive(cfg.model.archive, policy)
        policy.load_state_dict(state)
        if reference is not None:
            reference.load_state_dict(state)
        utils.rank0_print(f"loaded archive {cfg.model.archive} into policy" + (" and reference" if reference is not None else ""))
    if cfg.lora.r is not None:
        policy = add_lora(policy, cfg.lora)
    return tokenizer, policy, reference


def load_tokenizer(cfg):
    """The run's tokenizer (cheap: no weights), with a pad token."""
    name = resolve_local(cfg.model.tokenizer_name_or_path or cfg.model.name_or_path)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(name, trust_remote_code=cfg.model.trust_remote_code)
    except (OSError, ValueError) as e:  # transformers raises OSError for a missing/offline repo
        raise ConfigError([f"model.tokenizer_name_or_path / model.name_or_path={name!r}: cannot load a tokenizer"
                           f" ({type(e).__name__}: {str(e).splitlines()[0]})"]) from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # padding is masked everywhere; any id will do
    template = cfg.model.chat_template
    if template is not None:
        if template not in CHAT_TEMPLATES and not Path(template).is_file():
            raise ConfigError([f"model.chat_template={template!r}: expected {', '.join(CHAT_TEMPLATES)} or a path to a Jinja "
                               "template file"])
        tokenizer.chat_template = CHAT_TEMPLATES.get(template) or Path(template).read_text()
    return tokenizer


# Chat templates by name, for tokenizers without one (model.chat_template). ChatML, as Qwen and many others use it.
CHAT_TEMPLATES = {"chatml": "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                            "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"}


def world_size_of(cfg) -> int:
    """Processes that will train: 1 (BasicTrainer), torchrun's WORLD_SIZE, or what `launch` starts."""
    if cfg.trainer == "BasicTrainer":
        return 1
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return cfg.n_workers or (torch.cuda.device_count() if torch.cuda.is_available() else 2)


def work_offline_if_the_hub_is_unreachable(cfg) -> None:
    """When the run needs the Hugging Face hub (a model, tokenizer or dataset that is not local) and a 3-second
    connection to it fails, set HF_HUB_OFFLINE and HF_DATASETS_OFFLINE for this process (and the ranks it starts):
    every hub access then reads the local cache and fails at once when the cache lacks the file, instead of
    retrying for a minute. Decided once, here, before transformers or datasets are imported."""
    names = [cfg.model.name_or_path, cfg.model.tokenizer_name_or_path or cfg.model.name_or_path]
    hub = [n for n in names if not Path(resolve_local(n)).exists()] + [d for d in cfg.datasets if d in data.SOURCES and data.SOURCES[d].path is None]
    if not hub or any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        return
    try:
        socket.create_connection(("huggingface.co", 443), timeout=3).close()
    except OSError as e:
        os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
        print(f"the Hugging Face hub is unreachable ({e}): {', '.join(sorted(set(hub)))} must come from the local cache"
              " (HF_HUB_OFFLINE=1 set for this run)", file=sys.stderr)


def check_inputs(cfg, world_size: int) -> None:
    """Every check of the user's input that needs no model, run by `--cfg` and before any model loads:
    the config against the world size, dataset names and files, model.archive, the checkpoint a resume reads,
    and the data after tokenization (hub datasets fetched, pairs left after filtering)."""
    problems = validate(cfg, world_size)
    if problems:
        raise ConfigError(problems)
    if cfg.lora.r is not None and importlib.util.find_spec("peft") is None:
        raise ConfigError([f"lora.r={cfg.lora.r}: LoRA needs the optional dependency peft: pip install peft"])
    data.validate_sources(cfg.datasets, unpaired=cfg.unpaired_loss, pairs_to_unpaired=cfg.pairs_to_unpaired)
    if cfg.model.archive and not Path(cfg.model.archive).is_file():
        raise ArchiveError(f"model.archive={cfg.model.archive}: no such file (expected <run dir>/LATEST/policy.pt)")
    if cfg.resume_from:
        check_resumable(cfg, world_size)
    if cfg.fsdp.ulysses_sequence_parallel_size > 1:
        check_sequence_parallel(cfg)
    check_data(cfg, world_size)


def check_sequence_parallel(cfg) -> None:
    """Ulysses gives each rank of a group heads / sp whole attention heads: sp must divide the model's attention
    heads (read from its config.json; no weights). Fewer key/value heads are repeated, so they need not divide."""
    name = resolve_local(cfg.model.name_or_path)
    sp = cfg.fsdp.ulysses_sequence_parallel_size
    try:
        config = transformers.AutoConfig.from_pretrained(name, trust_remote_code=cfg.model.trust_remote_code)
        heads = config.num_attention_heads
    except (OSError, ValueError, AttributeError) as e:
        raise ConfigError([f"fsdp.ulysses_sequence_parallel_size={sp}: cannot read the attention heads of model.name_or_path="
                           f"{name!r} ({type(e).__name__}: {str(e).splitlines()[0]})"]) from None
    if heads % sp:
        raise ConfigError([f"fsdp.ulysses_sequence_parallel_size={sp}: expected a divisor of the {heads} attention heads of"
                           f" model.name_or_path={name!r} (each rank of a sequence-parallel group attends with heads / {sp})"])
    # These RoPE types pick their frequencies from the largest position the call sees: each rank sees only its slice.
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type")) in ("dynamic", "longrope"):
        raise ConfigError([f"fsdp.ulysses_sequence_parallel_size={sp} with model.name_or_path={name!r}: its RoPE type "
                           f"{rope.get('rope_type', rope.get('type'))!r} scales frequencies by the longest position of a call, "
                           "and each rank of a group sees only its slice of the positions: not supported yet"])


def check_data(cfg, world_size: int) -> None:
    """Tokenize both splits as the trainer will (the result is cached for it) and refuse data that leaves
    fewer training pairs than one step, or fewer eval pairs than ranks, naming each source and its drops."""
    for name in cfg.datasets:
        if name not in data.SOURCES and "{split}" not in name:
            print(f"datasets: {name} has no {{split}} in its path: the same pairs serve training and evaluation"
                  " (name two files <dir>/train.jsonl and <dir>/test.jsonl as <dir>/{split}.jsonl to separate them)")
    tokenizer = load_tokenizer(cfg)
    dp, ranks = data_parallel_size(cfg, world_size)
    kwargs = dict(max_length=cfg.max_length, max_prompt_length=cfg.max_prompt_length,
                  sft_mode=losses.is_sft_only(cfg.loss_names), truncation_mode=cfg.truncation_mode,
                  cache_dir=str(utils.first_usable_dir(cfg.local_dirs) / "datasets"))
    # KTO reads labelled completions (pairs_to_unpaired: training splits each pair in two; eval keeps the pairs)
    modes = {"train": dict(unpaired=cfg.unpaired_loss, pairs_to_unpaired=cfg.pairs_to_unpaired),
             "test": dict(unpaired=cfg.unpaired_loss and not cfg.pairs_to_unpaired)}
    for split, needed, knob in (("train", cfg.batch_size, f"batch_size={cfg.batch_size}"),
                                ("test", dp, f"{ranks} {dp} (one eval pair per data-parallel rank)")):
        examples, stats = data.load_tokenized(cfg.datasets, tokenizer, split, silent=True, **kwargs, **modes[split])
        if split == "train" and len(examples) >= needed:
            steps = data.num_steps(len(examples), batch_size=cfg.batch_size, n_epochs=cfg.n_epochs, n_examples=cfg.n_examples)
            if cfg.warmup_steps >= steps:
                print(f"warning: warmup_steps={cfg.warmup_steps} >= the run's {steps} steps: the learning rate never reaches"
                      f" lr={cfg.lr:g} (set warmup_steps=N, N < {steps})", file=sys.stderr)
        if len(examples) < needed:
            per_source = "; ".join(f"{s.source}: {s.unit}_kept={s.kept} of prompts={s.prompts}, dropped: "
                                   + (", ".join(f"{k}={v}" for k, v in s.dropped.items()) or "none")
                                   for s in stats)
            raise data.DataError(f"datasets={list(cfg.datasets)} split {split!r}: {len(examples)} pairs left after"
                                 f" filtering, fewer than {knob} ({per_source}); add data, or for dropped"
                                 f" over-long pairs raise max_length={cfg.max_length}")


def resume_run_dir(resume_from: str) -> str:
    """The run directory a resume continues, from what users copy: the run directory, its LATEST, or the step-N
    checkpoint LATEST points at (an earlier one would have its later checkpoints overwritten: refused)."""
    path = Path(resume_from)
    if (path / "LATEST").exists():
        return str(path)
    run_dir = path.parent
    latest = run_dir / "LATEST"
    if path.name == "LATEST" and latest.exists():
        return str(run_dir)
    if path.name.startswith("step-") and latest.exists():
        if path.resolve() == latest.resolve():
            return str(run_dir)
        raise FileNotFoundError(f"resume_from={resume_from}: not the run's latest checkpoint ({latest} -> "
                                f"{latest.resolve().name}); a resume continues from LATEST and would overwrite the later "
                                f"checkpoints. To go back to {path.name}: ln -sfn {path.name} {latest}")
    if (path / "config.yaml").is_file():
        raise FileNotFoundError(f"resume_from={resume_from}: no LATEST checkpoint there: the run stopped before its first"
                                " checkpoint; start it again with the same command, without resume_from")
    raise FileNotFoundError(f"resume_from={resume_from}: no checkpoint there; expected a run directory holding LATEST "
                            "(or its LATEST, or the step-N checkpoint LATEST points at)")


def check_resumable(cfg, world_size: int) -> None:
    """The checkpoint resume_from points at is complete and belongs to this run (nothing is loaded)."""
    ckpt = trainers.validate_checkpoint(Path(cfg.resume_from) / "LATEST")
    trainers.check_compatible(torch.load(ckpt / "trainer_state.pt", weights_only=True), cfg, world_size)


def add_lora(model, lora):
    """The model with LoRA adapters (peft), only the adapters trainable. The trainer's reference is this same model
    with its adapters disabled (trainers.BasicTrainer), so the base weights exist once."""
    config = peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, bias="none",
                             target_modules=lora.target_modules, task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, config)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    utils.rank0_print(f"LoRA r={lora.r} alpha={lora.alpha} on {lora.target_modules}: {trainable} trainable parameters of "
                f"{sum(p.numel() for p in model.parameters())}")
    return model


class ArchiveError(ValueError):
    """model.archive is missing, unreadable or does not fit the model."""


def load_archive(path: str, model) -> dict:
    """The weights of an earlier run's policy.pt, checked against `model` before anything is loaded."""
    if not Path(path).is_file():
        raise ArchiveError(f"model.archive={path}: no such file (expected <run dir>/LATEST/policy.pt)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)["state"]
    except Exception as e:
        raise ArchiveError(f"model.archive={path}: not a policy.pt checkpoint ({type(e).__name__}: {e})") from None
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = [f"{k}: {tuple(state[k].shape)} vs {tuple(v.shape)}" for k, v in expected.items() if k in state and state[k].shape != v.shape]
    if missing or unexpected or shapes:
        raise ArchiveError(f"model.archive={path} does not fit model {type(model).__name__}: "
                         f"missing {missing[:5]}, unexpected {unexpected[:5]}, shape mismatches {shapes[:5]}")
    return state


def worker_main(rank: int, world_size: int, cfg, run_dir: str) -> None:
    """Everything one process does: seed, load, build the trainer, train."""
    utils.seed_everything(cfg.seed, cfg.fsdp.full_determinism)
    device_map = None
    if cfg.trainer == "BasicTrainer" and torch.cuda.device_count() > 1:
        if importlib.util.find_spec("accelerate") is None:  # transformers' device_map needs it; we do not
            raise ConfigError(["trainer=BasicTrainer on several GPUs spreads the model with transformers'"
                               " device_map, which needs `pip install accelerate`; or use trainer=FSDPTrainer"])
        device_map = "balanced"  # naive model parallel, as the original
    tokenizer, policy, reference = load_models(cfg, device_map, on_meta=cfg.trainer == "FSDPTrainer" and rank != 0)
    if rank == 0 and not cfg.resume_from:  # a resume keeps the manifest of the run it continues
        run_manifest.write(run_dir, cfg, tokenizer, world_size)
    if world_size > 1:  # rank 0 read the weights (and wrote the manifest) alone; the others wait without collective_timeout_secs
        utils.wait_for_rank0()
    if cfg.trainer == "BasicTrainer" and device_map is None and torch.cuda.is_available():
        policy.to("cuda")
        if reference is not None:
            reference.to("cuda")
    trainer_class = getattr(trainers, cfg.trainer)
    trainer = trainer_class(policy, cfg, cfg.seed, run_dir, reference_model=reference, rank=rank,
                            world_size=world_size, tokenizer=tokenizer)
    trainer.train()


def prepare_run_dir(cfg) -> tuple[Path, bool]:
    """(the run directory, whether this run created it); the resolved config is saved in it as config.yaml
    (config.resumed.yaml on a resume, written only once check_inputs accepted the checkpoint)."""
    if cfg.resume_from:
        run_dir, created = Path(cfg.resume_from), False
    elif cfg.run_dir:
        run_dir = Path(cfg.run_dir)
        if (run_dir / "LATEST").exists():
            raise FileExistsError(f"run_dir={cfg.run_dir} already holds a run; resume it with resume_from={cfg.run_dir} or pick a new run_dir")
        created = not run_dir.exists()
        run_dir.mkdir(parents=True, exist_ok=True)
    else:
        run_dir, created = utils.get_local_run_dir(cfg.exp_name, cfg.local_dirs), True
    utils.atomic_write_text(run_dir / ("config.resumed.yaml" if cfg.resume_from else "config.yaml"), to_yaml(cfg))
    return run_dir, created


def remove_orphan(run_dir: Path, created: bool) -> None:
    """After a failure: remove the run directory this run created if it holds nothing but what a run writes at
    its start (config.yaml, the run manifest): it failed before training wrote anything. Never touches a
    directory that existed before."""
    if created and run_dir.is_dir() and {p.name for p in run_dir.iterdir()} <= {"config.yaml", run_manifest.MANIFEST, run_manifest.DIFF}:
        shutil.rmtree(run_dir)


def spawned_worker(rank: int, world_size: int, cfg, run_dir: str, port: int) -> None:
    """Entry of each process that `launch` starts on one node (mp.spawn passes the rank first)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    try:
        distributed_worker(cfg, run_dir)
    except trainers.Interrupted as e:  # the launcher tells the user how to resume
        sys.exit(128 + e.signum)


def distributed_worker(cfg, run_dir: str | None) -> None:
    """Join the process group (env://), agree on the run directory, train, leave."""
    rank, world_size, local_rank = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    # cpu:gloo,cuda:nccl on GPUs (CPU tensors take gloo); collectives time out after collective_timeout_secs.
    utils.init_distributed(cfg.collective_timeout_secs, cuda=torch.cuda.is_available())
    created = False
    try:
        if rank == 0 and run_dir is None:  # started by torchrun: rank 0 makes the directory
            made, created = prepare_run_dir(cfg)
            run_dir = str(made)
        run_dir = utils.broadcast_object(run_dir)
        worker_main(rank, world_size, cfg, run_dir)
    except BaseException:
        if created:
            remove_orphan(Path(run_dir), created)
        raise
    finally:
        utils.destroy_distributed()


def launch(cfg) -> None:
    """One process (BasicTrainer), this process as one torchrun rank, or N local processes (FSDPTrainer)."""
    if cfg.trainer != "BasicTrainer" and "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        distributed_worker(cfg, None)
        return
    run_dir, created = prepare_run_dir(cfg)
    try:
        if cfg.trainer == "BasicTrainer":
            print(f"run directory: {run_dir}", flush=True)
            worker_main(0, 1, cfg, str(run_dir))
        else:
            world_size = world_size_of(cfg)
            utils.rank0_print(f"run directory: {run_dir}\nstarting {world_size} processes")
            spawn_ranks(cfg, world_size, run_dir)
    except BaseException:
        remove_orphan(run_dir, created)
        raise
    utils.rank0_print(f"done; run directory: {run_dir}")


def spawn_ranks(cfg, world_size: int, run_dir: Path) -> None:
    """One process per rank on this node, joined. A scheduler's SIGTERM reaches this process only: it is passed on
    to the ranks, which stop after their step with a checkpoint. Ctrl-C reaches every process of the terminal
    already, so this one ignores it and waits for the ranks to stop."""
    context = torch.multiprocessing.start_processes(
        spawned_worker, args=(world_size, cfg, str(run_dir), cfg.fsdp_port or utils.get_open_port()), nprocs=world_size,
        join=False, start_method="spawn")
    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, lambda signum, frame: [os.kill(pid, signum) for pid in context.pids()]),
                signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN)}
    try:
        while not context.join():
            pass
    except torch.multiprocessing.ProcessExitedException as e:
        if e.exit_code not in (128 + signal.SIGTERM, 128 + signal.SIGINT):
            raise
        examples = int(os.readlink(run_dir / "LATEST").split("-")[1])
        raise trainers.Interrupted(e.exit_code - 128, examples // cfg.batch_size, examples, run_dir) from None
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def resume_command(argv: list[str], run_dir) -> str:
    """The command that continues an interrupted run: the same arguments, resume_from=<run dir>."""
    kept = [a for a in argv if not a.lstrip("-").startswith("resume_from=")]
    return "python -u train.py " + " ".join(shlex.quote(a) for a in [*kept, f"resume_from={run_dir}"])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
    # --replay <run dir> and --estimate [gpu=NAME] are read here; everything else is config.
    replay_of, gpu = None, None
    estimating = "--estimate" in argv
    if estimating:
        i = argv.index("--estimate")
        gpu = argv[i + 1][len("gpu="):] if i + 1 < len(argv) and argv[i + 1].startswith("gpu=") else None
        argv = argv[:i] + argv[i + 1 + (gpu is not None):]
    if "--replay" in argv:
        i = argv.index("--replay")
        if i + 1 >= len(argv):
            print("error: --replay needs the run directory to replay: --replay <run dir>", file=sys.stderr)
            return 2
        replay_of, argv = argv[i + 1], argv[:i] + argv[i + 2:]
    try:
        if replay_of is not None:
            cfg, flags = run_manifest.replay_config(replay_of, argv)
        else:
            cfg, flags = load_config(argv)
        work_offline_if_the_hub_is_unreachable(cfg)
        if estimating:  # from config.json alone: no weights
            print(estimate.report(cfg, resolve_local(cfg.model.name_or_path), gpu))
            return 0
    except (ConfigError, EstimateError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        if cfg.resume_from:  # the run directory, whichever of its paths was given
            cfg = dataclasses.replace(cfg, resume_from=resume_run_dir(cfg.resume_from))
        check_inputs(cfg, world_size_of(cfg))  # bad input fails here, before any model is loaded; --cfg too
        if cfg.resume_from or replay_of:  # the data must be the recorded run's: checked before any model loads
            run_manifest.check_against(cfg.resume_from or replay_of, cfg, load_tokenizer(cfg),
                                       "resume" if cfg.resume_from else "replay")
        if "--cfg" in flags:
            print(to_yaml(cfg), end="")
            return 0
        launch(cfg)
        if replay_of is not None:
            print(run_manifest.report(replay_of, cfg.run_dir), flush=True)
    except (ConfigError, data.DataError, FileExistsError, FileNotFoundError, ArchiveError,
            run_manifest.ManifestError) as e:
        print(f"error: {e}", file=sys.stderr)  # the user's input is wrong: say what, without a traceback
        return 2
    except Exception as e:
        if isinstance(e, trainers.CheckpointError):
            print(f"error: {e}", file=sys.stderr)
            return 2
        if isinstance(e, trainers.NonFiniteError):
            print(f"error: {e}", file=sys.stderr)
            return 3
        if isinstance(e, trainers.Interrupted):
            if int(os.environ.get("RANK", 0)) == 0:
                print(f"interrupted at step {e.step} ({e.examples} pairs, {signal.Signals(e.signum).name}); resume with: "
                      f"{resume_command(argv, e.run_dir)}", file=sys.stderr, flush=True)
            return 128 + e.signum
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
