"""Train a language model on preferences: SFT, DPO and its family.

One process (CPU, one GPU, or several GPUs as naive model parallel):

    python -u train.py loss=sft exp_name=my_sft                                   # the offline toy task
    python -u train.py loss=dpo loss.beta=0.1 model.archive=.cache/runs/<sft run>/LATEST/policy.pt
    python -u train.py model=pythia28 datasets=[hh] loss=dpo loss.beta=0.1 batch_size=64 gradient_accumulation_steps=2

Sharded (FSDP1 or FSDP2), one process per GPU (or `n_workers` CPU processes), started for you:

    python -u train.py trainer=FSDPTrainer model=pythia28 datasets=[hh] loss=dpo fsdp.strategy=fsdp2

Several nodes, with torchrun (env:// rendezvous; nccl on GPU, gloo on CPU):

    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $HOST:29500 train.py trainer=FSDPTrainer ...

`python -u train.py --help` lists every key; `--cfg` prints the resolved config and exits.
Resume a run exactly where it stopped: `python -u train.py <same arguments> resume_from=<run dir>`.

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
"""
from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parent


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
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()  # one bar per weight shard drowns the training bar

    import losses
    from utils import disable_dropout, dtype_of, rank0_print

    model_path = resolve_local(cfg.model.name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(resolve_local(cfg.model.tokenizer_name_or_path or model_path),
                                              trust_remote_code=cfg.model.trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # padding is masked everywhere; any id will do

    def load(dtype):
        if on_meta:
            from transformers import AutoConfig
            config = AutoConfig.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config, dtype=dtype_of(dtype), trust_remote_code=cfg.model.trust_remote_code)
        else:
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype_of(dtype), device_map=device_map,
                                                         trust_remote_code=cfg.model.trust_remote_code)
        disable_dropout(model)
        return model

    rank0_print(f"loading policy {model_path} in {cfg.fsdp.model_dtype}")
    policy = load(cfg.fsdp.model_dtype)
    reference = None
    if losses.needs_reference(cfg.loss_names, cfg.loss.reference_free) and cfg.lora.r is None:  # LoRA: see add_lora
        rank0_print(f"loading reference {model_path} in {cfg.model.reference_dtype}")
        reference = load(cfg.model.reference_dtype).eval().requires_grad_(False)
    if cfg.model.archive and not on_meta:
        state = load_archive(cfg.model.archive, policy)
        policy.load_state_dict(state)
        if reference is not None:
            reference.load_state_dict(state)
        rank0_print(f"loaded archive {cfg.model.archive} into policy" + (" and reference" if reference is not None else ""))
    if cfg.lora.r is not None:
        policy = add_lora(policy, cfg.lora)
    return tokenizer, policy, reference


def add_lora(model, lora):
    """The model with LoRA adapters (peft), only the adapters trainable. The trainer's reference is this same model
    with its adapters disabled (trainers.BasicTrainer), so the base weights exist once."""
    try:
        import peft
    except ImportError:
        from config import ConfigError
        raise ConfigError([f"lora.r={lora.r}: LoRA needs the optional dependency peft: pip install peft"]) from None
    from utils import rank0_print
    config = peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, bias="none",
                             target_modules=lora.target_modules, task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, config)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    rank0_print(f"LoRA r={lora.r} alpha={lora.alpha} on {lora.target_modules}: {trainable} trainable parameters of "
                f"{sum(p.numel() for p in model.parameters())}")
    return model


class ArchiveError(ValueError):
    """model.archive is missing, unreadable or does not fit the model."""


def load_archive(path: str, model) -> dict:
    """The weights of an earlier run's policy.pt, checked against `model` before anything is loaded."""
    import torch
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
    import trainers
    from config import ConfigError
    from utils import seed_everything

    seed_everything(cfg.seed, cfg.fsdp.full_determinism)
    import torch
    device_map = None
    if cfg.trainer == "BasicTrainer" and torch.cuda.device_count() > 1:
        import importlib.util
        if importlib.util.find_spec("accelerate") is None:  # transformers' device_map needs it; we do not
            raise ConfigError(["trainer=BasicTrainer on several GPUs spreads the model with transformers'"
                               " device_map, which needs `pip install accelerate`; or use trainer=FSDPTrainer"])
        device_map = "balanced"  # naive model parallel, as the original
    tokenizer, policy, reference = load_models(cfg, device_map, on_meta=cfg.trainer == "FSDPTrainer" and rank != 0)
    if cfg.trainer == "BasicTrainer" and device_map is None and torch.cuda.is_available():
        policy.to("cuda")
        if reference is not None:
            reference.to("cuda")
    trainer_class = getattr(trainers, cfg.trainer)
    trainer = trainer_class(policy, cfg, cfg.seed, run_dir, reference_model=reference, rank=rank,
                            world_size=world_size, tokenizer=tokenizer)
    trainer.train()


def prepare_run_dir(cfg) -> Path:
    """The run directory; the resolved config is saved in it as config.yaml."""
    from config import to_yaml
    from utils import atomic_write_text, get_local_run_dir

    if cfg.resume_from:
        run_dir = Path(cfg.resume_from)
        if not (run_dir / "LATEST").exists():
            raise FileNotFoundError(f"resume_from={cfg.resume_from}: no LATEST checkpoint there")
    elif cfg.run_dir:
        run_dir = Path(cfg.run_dir)
        if (run_dir / "LATEST").exists():
            raise FileExistsError(f"run_dir={cfg.run_dir} already holds a run; resume it with resume_from={cfg.run_dir} or pick a new run_dir")
        run_dir.mkdir(parents=True, exist_ok=True)
    else:
        run_dir = get_local_run_dir(cfg.exp_name, cfg.local_dirs)
    atomic_write_text(run_dir / ("config.resumed.yaml" if cfg.resume_from else "config.yaml"), to_yaml(cfg))
    return run_dir


def spawned_worker(rank: int, world_size: int, cfg, run_dir: str, port: int) -> None:
    """Entry of each process that `launch` starts on one node (mp.spawn passes the rank first)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    distributed_worker(cfg, run_dir)


def distributed_worker(cfg, run_dir: str | None) -> None:
    """Join the process group (env://), agree on the run directory, train, leave."""
    import torch
    import torch.distributed as dist

    from utils import broadcast_object

    rank, world_size, local_rank = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    # A hung collective (a dead peer) raises after this timeout instead of waiting forever.
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=timedelta(seconds=cfg.collective_timeout_secs))
    try:
        run_dir = broadcast_object(str(prepare_run_dir(cfg)) if rank == 0 and run_dir is None else run_dir)
        worker_main(rank, world_size, cfg, run_dir)
    finally:
        dist.destroy_process_group()


def launch(cfg) -> None:
    """One process (BasicTrainer), this process as one torchrun rank, or N local processes (FSDPTrainer)."""
    from utils import get_open_port, rank0_print

    if cfg.trainer == "BasicTrainer":
        run_dir = prepare_run_dir(cfg)
        print(f"run directory: {run_dir}", flush=True)
        worker_main(0, 1, cfg, str(run_dir))
        print(f"done; run directory: {run_dir}", flush=True)
        return
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        distributed_worker(cfg, None)
        return
    import torch
    import torch.multiprocessing as mp

    world_size = cfg.n_workers or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    from config import ConfigError, validate
    problems = validate(cfg, world_size)
    if problems:
        raise ConfigError(problems)
    run_dir = prepare_run_dir(cfg)
    rank0_print(f"run directory: {run_dir}\nstarting {world_size} processes")
    mp.spawn(spawned_worker, nprocs=world_size, args=(world_size, cfg, str(run_dir), cfg.fsdp_port or get_open_port()), join=True)
    rank0_print(f"done; run directory: {run_dir}")


def main(argv: list[str] | None = None) -> int:
    from config import ConfigError, help_text, load_config, to_yaml

    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
    try:
        cfg, flags = load_config(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if "--cfg" in flags:
        print(to_yaml(cfg), end="")
        return 0
    import importlib.util
    if cfg.lora.r is not None and importlib.util.find_spec("peft") is None:  # before any model loads
        print(f"error: lora.r={cfg.lora.r}: LoRA needs the optional dependency peft: pip install peft", file=sys.stderr)
        return 2
    import preference_datasets
    try:
        # bad data fails here, before any model is loaded
        preference_datasets.validate_sources(cfg.datasets, unpaired=cfg.unpaired_loss, pairs_to_unpaired=cfg.pairs_to_unpaired)
        launch(cfg)
    except (ConfigError, preference_datasets.DataError, FileExistsError, FileNotFoundError, ArchiveError) as e:
        print(f"error: {e}", file=sys.stderr)  # the user's input is wrong: say what, without a traceback
        return 2
    except Exception as e:
        import trainers  # imported by then; its errors are about the run, not a bug: no traceback either
        if isinstance(e, trainers.CheckpointError):
            print(f"error: {e}", file=sys.stderr)
            return 2
        if isinstance(e, trainers.NonFiniteError):
            print(f"error: {e}", file=sys.stderr)
            return 3
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
