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
import shutil
import signal
import socket
import sys
from pathlib import Path

from config import DTYPES, ConfigError, dtype_of
from config_loader import data_parallel_size, help_text, load_config, loss_registry
from config_loader import known_world_size, to_yaml, validate

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

import losses  # noqa: E402
import preference_datasets as data  # noqa: E402
import checkpoints  # noqa: E402
import run_manifest  # noqa: E402
import self_check  # noqa: E402
import sources  # noqa: E402
import trainers  # noqa: E402
import utils  # noqa: E402
# transformers and peft are imported where they are used, after work_offline_if_the_hub_is_unreachable: the hub
# libraries read HF_HUB_OFFLINE once, when they are first imported.

REPO = Path(__file__).resolve().parent
# failures other than bad input (2), by their exit code (--help lists them)
EXIT_CODES = {trainers.NonFiniteError: 3, self_check.SelfCheckError: 4, trainers.NothingTrained: 5}
# Options that check the model's config.json before any model loads, each in its own file: {module: switch}
MODEL_CHECKS = {
    "tiled_head": lambda c: c.tiled_lm_head,
    "moe": lambda c: c.loss.router_aux_loss is not None,
    "ulysses": lambda c: c.fsdp.ulysses_sequence_parallel_size > 1,
}


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
    rank). Under LoRA the reference is the policy with its adapters off (trainers.Reference): None here.
    model.quantization: every rank loads and quantizes the base itself (bitsandbytes' constants are attributes, which
    no broadcast from rank 0 carries)."""
    import transformers

    transformers.utils.logging.disable_progress_bar()  # one bar per weight shard drowns the training bar
    path = resolve_local(cfg.model.name_or_path)
    remote = cfg.model.trust_remote_code
    quantized = {}
    if cfg.model.quantization is not None:
        import lora  # QLoRA: the BitsAndBytesConfig (check_inputs refused it without bitsandbytes and accelerate)

        quantized = lora.quantized_loading(cfg, device_map)
        on_meta = False

    def load(dtype: torch.dtype):
        if on_meta:
            with torch.device("meta"):
                config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=remote)
                model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=remote)
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, trust_remote_code=remote, **{"device_map": device_map, **quantized}
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
        import lora  # optional: check_inputs refused lora.r without peft, before any model loaded

        if quantized:  # every rank builds its own adapters: drawn from the seed alone, equal on all
            policy = lora.add(cfg.lora, lora.prepare(policy, cfg), seed=cfg.seed)
        else:
            policy = lora.add(cfg.lora, policy)
    return load_tokenizer(cfg), policy, reference


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
    missing = [n for n in ("bitsandbytes", "accelerate") if cfg.model.quantization and not importlib.util.find_spec(n)]
    if missing:  # transformers quantizes a model through both
        raise ConfigError(
            [
                f"model.quantization={cfg.model.quantization}: QLoRA needs the optional dependencies bitsandbytes and "
                f"accelerate (transformers quantizes through both): pip install {' '.join(missing)}"
            ]
        )
    sources.validate_sources(cfg.datasets)
    if cfg.model.archive and not Path(cfg.model.archive).is_file():
        raise ConfigError([f"model.archive={cfg.model.archive}: no such file (expected <run dir>/LATEST/policy.pt)"])
    if cfg.resume_from:  # under torchrun every rank runs this: sizes here, rank 0 alone hashes (distributed_worker)
        ckpt = checkpoints.validate_checkpoint(Path(cfg.resume_from) / "LATEST", hashes=not started_by_torchrun(cfg))
        checkpoints.check_compatible(torch.load(ckpt / "trainer_state.pt", weights_only=True), cfg, world_size)
    elif cfg.run_dir and (Path(cfg.run_dir) / "LATEST").exists():  # a fresh start may not reuse a run's directory
        raise FileExistsError(
            f"run_dir={cfg.run_dir} already holds a run; resume it with resume_from={cfg.run_dir} or pick a new run_dir"
        )
    for name, on in MODEL_CHECKS.items():  # each option's check of the model's config.json, in its own file
        if on(cfg):
            importlib.import_module(name).check(cfg, model_config(cfg))
    splits = check_data(cfg, world_size)
    if cfg.online.rounds:  # semi-online DPO: its scorer and prompts, before any model loads
        import online

        online.check(cfg, load_tokenizer(cfg))
    return splits


def model_config(cfg):
    """model.name_or_path's config.json alone (no weights), for the options' checks before any model loads."""
    import transformers

    name = resolve_local(cfg.model.name_or_path)
    try:
        return transformers.AutoConfig.from_pretrained(name, trust_remote_code=cfg.model.trust_remote_code)
    except (OSError, ValueError) as e:
        raise ConfigError(
            [f"model.name_or_path={name!r}: cannot read its config.json ({type(e).__name__}: {str(e).splitlines()[0]})"]
        ) from None


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


def world_size_of(cfg) -> int:
    """Processes that will train: config_loader.known_world_size, else what `launch` starts (one per GPU, 2 on CPU)."""
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
    except checkpoints.Interrupted as e:  # the launcher tells the user how to resume
        sys.exit(128 + e.signum)
    except self_check.SelfCheckError:  # every rank agreed; the launcher reads the message from run_dir/self_check.json
        sys.exit(4)
    except trainers.NothingTrained:  # every rank agreed; the launcher reads the rounds' files for the message
        sys.exit(5)
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
            verdict = rank == 0 and checkpoints.checkpoint_problem(Path(cfg.resume_from) / "LATEST")
            if verdict := utils.broadcast_object(verdict, slow=True):
                raise checkpoints.CheckpointError(verdict)
        worker_main(rank, world_size, cfg, run_dir, splits)
    except BaseException as e:
        remove_orphan(run_dir, created)
        if isinstance(e, KeyboardInterrupt):  # a second Ctrl-C under torchrun: one line per rank, no traceback
            raise checkpoints.interrupted(signal.SIGINT, Path(run_dir), cfg.batch_size, at_once=True) from None
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


def started_by_torchrun(cfg) -> bool:
    return cfg.trainer != "BasicTrainer" and "RANK" in os.environ and "WORLD_SIZE" in os.environ


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
        if e.exit_code == 5:
            import online  # only a semi-online run exits so

            raise trainers.NothingTrained(online.starved(cfg, run_dir)) from None
        if e.exit_code not in (128 + signal.SIGTERM, 128 + signal.SIGINT):
            raise
        raise checkpoints.interrupted(e.exit_code - 128, run_dir, cfg.batch_size) from None
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
            raise checkpoints.interrupted(signal.SIGINT, run_dir, cfg.batch_size, at_once=True) from None
        raise
    print(f"done; run directory: {run_dir}", flush=True)


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
            cfg = dataclasses.replace(cfg, resume_from=checkpoints.resume_run_dir(cfg.resume_from))
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
        checkpoints.CheckpointError,
        trainers.NonFiniteError,
        self_check.SelfCheckError,
        trainers.NothingTrained,
    ) as e:
        print(f"error: {e}", file=sys.stderr)  # the exit codes --help lists
        return next((code for kind, code in EXIT_CODES.items() if isinstance(e, kind)), 2)  # 2: bad input
    except checkpoints.Interrupted as e:
        utils.rank0_print(checkpoints.interrupt_message(e, argv), file=sys.stderr)
        return 128 + e.signum
    return 0


if __name__ == "__main__":
    sys.exit(main())
