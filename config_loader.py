"""The YAML loader that replaces Hydra, and the checks of a config. Layers, later ones winning: the dataclass
defaults (config.py); config/<group>/<choice>.yaml (`model=pythia28 loss=dpo`; config/config.yaml picks the defaults);
`key=value` overrides in YAML (`--key=value` too, as W&B sweeps pass it). All problems are raised at once, as one
ConfigError. losses.py (and torch) loads on first need, so `--help` answers at once."""

import contextlib
import dataclasses
import difflib
import functools
import importlib
import os
import sys
import traceback
import types
import typing
from pathlib import Path
from typing import Any, Optional, Union

import yaml

from config import DTYPE, DTYPES, BaseConfig, Config, ConfigError, LossConfig, _leaves, flatten, schema

CONFIG_DIR = Path(__file__).resolve().parent / "config"
GROUPS = ("model", "loss")  # `model=X` picks config/model/X.yaml, `loss=X` picks config/loss/X.yaml
REQUIRED = "???"  # a YAML value that the user must override (as in Hydra/OmegaConf)


# --- The schema: dotted keys with their types, defaults, docs and allowed values, read off the dataclasses ---
def _members(t) -> tuple:
    """The types a hint allows: Optional[int] -> (int, NoneType), str -> (str,)."""
    return typing.get_args(t) if typing.get_origin(t) in (Union, types.UnionType) else (t,)


def _type_name(t) -> str:
    return " or ".join("null" if a is type(None) else getattr(a, "__name__", str(a)) for a in _members(t))


def _coerce(value: Any, t) -> tuple[bool, Any]:
    """(fits the hint `t`, `value` converted): an int or numeric text (YAML 1.1's 1e-6) is a float, a bool no number."""
    for a in _members(t):
        if a is float and type(value) in (int, str):
            with contextlib.suppress(ValueError, OverflowError):
                return True, float(value)
        elif isinstance(value, typing.get_origin(a) or a) and (a is bool) == isinstance(value, bool):
            return True, value
    return False, value


def _expectation(key: str, allowed: Any, t) -> tuple:
    """(test of a non-null value, what is expected) for a field's `allowed` (see param)."""
    if isinstance(allowed, tuple) and callable(allowed[0]):
        return allowed
    null = " or null" * (type(None) in _members(t))
    if isinstance(allowed, tuple):
        return (lambda v: v in allowed), f"one of {', '.join(map(str, allowed))}{null}"
    low, high = (float(x) for x in allowed[1:-1].split(","))
    low_in = allowed[0] == "["  # a square bracket includes its end: "[0, 0.5)" is 0 <= v < 0.5
    high_in = allowed[-1] == "]"
    words = f"{low:g} {'<=' if low_in else '<'} {key.rpartition('.')[2]} {'<=' if high_in else '<'} {high:g}"
    if high == float("inf"):  # "(0, inf)" reads "> 0"
        words = f"{'>=' if low_in else '>'} {low:g}"
    return (lambda v: (v >= low if low_in else v > low) and (v <= high if high_in else v < high)), words + null


# {key: (test, what is expected)}
RULES = {key: _expectation(key, a, t) for key, f, t in _leaves() if (a := f.metadata["allowed"]) is not None}
CHOICES = {key: a for key, f, _ in _leaves() if isinstance(a := f.metadata["allowed"], tuple) and not callable(a[0])}
BLOCKS = "transformer_layer_cls_to_wrap"  # fsdp.wrap_policy's block class names
# The sub-keys of dict-valued fields with their rules; the command line may set them one by one (fsdp.wrap_policy.x=1).
SUBKEYS = {
    "fsdp.mixed_precision": dict.fromkeys(("param_dtype", "reduce_dtype", "buffer_dtype"), DTYPE),
    "fsdp.wrap_policy": {
        BLOCKS: (lambda v: v is None or isinstance(v, (str, list)), "block class names or null"),
        "min_num_params": (lambda v: v is None or type(v) is int and v >= 0, "a non-negative integer"),
    },
}
# The original DPO code's keys (README: its command lines parse) and verl's fsdp.seed, each the (sub-)key it sets; one
# given beside the key it sets, in one layer, must agree with it.
RENAMED = {
    "model.policy_dtype": "fsdp.model_dtype",
    "model.fsdp_policy_mp": "fsdp.mixed_precision.param_dtype",  # null: no mixed precision
    "model.block_name": f"fsdp.wrap_policy.{BLOCKS}",
    "fsdp.seed": "seed",
}
# Engine fields that only mean something when parameters are sharded; set under BasicTrainer they would be ignored.
FSDP_ONLY = (
    "wrap_policy offload_policy reshard_after_forward fsdp_size forward_prefetch use_orig_params strategy "
    "param_offload optimizer_offload"
).split()
# Sections read only when their switch is set: {section: (switch, what its null means)}
SWITCHED = {
    "lora": ("r", "full fine-tuning, no adapters"),
    "ref_update": ("tau", "the reference never changes"),
    "online": ("rounds", "offline DPO on the datasets' pairs"),
}
# FSDP2 always keeps the original parameters (as DTensors); CPUOffloadPolicy is FSDP2's (FSDP1: param_offload).
STRATEGY_ONLY = {"use_orig_params": "fsdp", "offload_policy": "fsdp2"}


def _suggest(word: str, candidates) -> str:
    """ " (did you mean X?)": another trainer's name for the key, else the closest candidate ignoring case."""
    # Names other trainers (TRL, Hugging Face's Trainer, the DPO paper) give keys of this config.
    other_names = {
        "learning_rate": "lr",
        "num_train_epochs": "n_epochs",
        "epochs": "n_epochs",
        "beta": "loss.beta",
        "warmup": "warmup_steps",
        "label_smoothing": "loss.label_smoothing",
        "loss_type": "loss.name",
        "loss.rpo_alpha": "loss.weights",  # loss=rpo is [dpo, sft]: the NLL term's weight is the second
        "rpo_alpha": "loss.weights",
        "max_prompt_len": "max_prompt_length",
        "seq_len": "max_length",
        "per_device_train_batch_size": "batch_size",
        "model_name_or_path": "model.name_or_path",
        "gradient_checkpointing": "activation_checkpointing",
    }
    lower = {c.lower(): c for c in candidates}
    if other_names.get(word) in lower.values():
        return f" (did you mean {other_names[word]}?)"
    close = difflib.get_close_matches(word.lower(), list(lower), n=1, cutoff=0.6)
    return f" (did you mean {lower[close[0]]}?)" if close else ""


# --- The loss registry, read from losses.py on first use ---
@functools.cache
def loss_registry() -> dict[str, dict]:
    """{loss name: {"reads": [loss.* keys its function takes], **LossSpec flags}}; a broken losses.py: ConfigError."""
    try:
        import losses
    except Exception as e:  # noqa: BLE001 - the researcher's own edit: say where, without a traceback
        frames = [
            f"{f.filename}:{f.lineno}"
            for f in traceback.extract_tb(e.__traceback__)
            if f.filename.endswith("losses.py")
        ]
        where = f"{e.filename}:{e.lineno}" if isinstance(e, SyntaxError) else (frames or ["losses.py"])[-1]
        raise ConfigError([f"{where}: importing losses.py failed ({type(e).__name__}: {e})"]) from None
    out = {}
    problems = []
    for name, spec in losses.LOSSES.items():
        if not isinstance(spec, losses.LossSpec) or not callable(spec.fn):
            problems.append(
                f"losses.py: LOSSES[{name!r}] = {spec!r}: expected LossSpec(<loss function>, needs_reference=..., ...)"
            )
            continue
        reads = losses.config_keys(spec.fn)
        code = getattr(spec.fn, "__code__", None)
        where = f"{code.co_filename}:{code.co_firstlineno}" if code else "losses.py"
        problems += [
            f"{where}: loss {name!r} ({getattr(spec.fn, '__name__', spec.fn)}) reads loss.{key}, which is not a "
            f"config key: add the field `{key}` to LossConfig in config.py (its default, doc and range)"
            for key in reads
            if key not in LossConfig()
        ]
        out[name] = {"reads": reads, **{k: v for k, v in vars(spec).items() if k != "fn"}}
    if problems:
        raise ConfigError(problems)
    return out


def _flag(name: Any, flag: str) -> bool:
    return isinstance(name, str) and bool(loss_registry().get(name, {}).get(flag))


def _ignored_problems(cfg: Config, explicit: set[str]) -> list[str]:
    """Keys a group file or the command line changed from their default that this run would ignore, each with why."""
    names = [n for n in cfg.loss_names if isinstance(n, str) and n in loss_registry()]
    selected = ", ".join(names) or "none"
    why = {}
    for key in LossConfig():
        readers = sorted(n for n, spec in loss_registry().items() if key in spec["reads"])
        if readers and not set(readers) & set(names):
            reason = f"no selected loss reads it (loss.name: {selected}); it is read by {', '.join(readers)}"
            why[f"loss.{key}"] = reason
    if cfg.loss.f_divergence != "alpha_divergence":
        reason = f"read only with loss.f_divergence=alpha_divergence (this run uses {cfg.loss.f_divergence})"
        why.setdefault("loss.f_alpha", reason)
    for section, (switch, off) in SWITCHED.items():
        if cfg[section][switch] is None:
            reason = f"read only with {section}.{switch} set (null: {off})"
            why |= {f"{section}.{k}": reason for k in cfg[section] if k != switch}
    if not cfg.loss.entropy_coeff:  # the logged entropy is a detached statistic of the log-prob path
        for k in ("use_torch_compile", "entropy_checkpointing", "entropy_from_logits_with_chunking"):
            if getattr(cfg.fsdp, k):
                why[f"fsdp.{k}"] = "applies to the entropy bonus, read only with loss.entropy_coeff > 0"
    if cfg.trainer == "BasicTrainer":
        why |= {f"fsdp.{k}": "only applies to trainer=FSDPTrainer (this run uses BasicTrainer)" for k in FSDP_ONLY}
    else:
        for k, s in STRATEGY_ONLY.items():
            if s != cfg.fsdp.strategy:
                why[f"fsdp.{k}"] = f"only applies to fsdp.strategy={s} (this run uses {cfg.fsdp.strategy})"
    flat, default = flatten(cfg.to_dict()), flatten(Config().to_dict())
    return [f"{k}={flat[k]!r}: {reason}" for k, reason in why.items() if k in explicit and flat[k] != default[k]]


# --- Loading: YAML files + command line -> {dotted key: value} -> Config ---
def _read_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError([f"{path}: not valid YAML: {e}"]) from None
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: expected a mapping of keys to values, got {type(data).__name__}"])
    return data


def _group_choices(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def parse_argv(argv: list[str]) -> tuple[dict[str, str], list[tuple[str, Any, str]], set[str], list[str]]:
    """(group choices, overrides [(key, YAML value, raw text)], flags, problems); a non-YAML [...] splits at commas."""
    choices = {}
    overrides = []
    flags = set()
    problems = []
    for arg in argv:
        key, eq, raw = arg.removeprefix("--").partition("=")
        if arg in ("--cfg", "--help", "-h"):
            flags.add("--help" if arg == "-h" else arg)
        elif not eq:
            problems.append(f"argument '{arg}': expected key=value (e.g. loss.beta=0.1), --cfg or --help")
        elif key in GROUPS:
            choices[key] = raw
        else:
            try:
                value = yaml.safe_load(raw)
            except yaml.YAMLError:
                items = [item.strip() for item in raw[1:-1].split(",") if item.strip()]
                value = items if raw[:1] + raw[-1:] == "[]" else raw
            overrides.append((key, value, raw))
    return choices, overrides, flags, problems


def typed(keys: dict, key: str, value, raw: str):
    """A command-line value: a text key keeps the text typed (exp_name=123 is the name "123"), null is None."""
    text = key in keys and set(_members(keys[key][0])) - {type(None)} == {str}  # str or Optional[str]
    return raw if text and raw not in ("null", "~") else value


def compose(argv: list[str]) -> tuple[dict, set[str], set[str]]:
    """Defaults, group files, overrides -> ({dotted key: value}, keys a group file or the command line set, flags)."""
    choices, overrides, flags, problems = parse_argv(argv)
    keys = schema()
    base = _read_yaml(CONFIG_DIR / "config.yaml")
    defaults = {k: v for entry in base.pop("defaults", []) if isinstance(entry, dict) for k, v in entry.items()}
    choices = defaults | choices
    layers = [("config/config.yaml", 0, flatten(base, "", keys))]  # (origin, layer, {dotted key: value})
    for group, name in ((g, choices[g]) for g in GROUPS if choices.get(g) is not None):
        if name in (known := _group_choices(group)):
            flat = flatten(_read_yaml(CONFIG_DIR / group / f"{name}.yaml"), f"{group}.", keys)
            layers.append((f"config/{group}/{name}.yaml", 1, flat))
        else:
            problems.append(
                f"{group}={name}: no such choice; expected one of {', '.join(known)}" + _suggest(str(name), known)
            )
    layers += [("command line", 2, {key: typed(keys, key, value, raw)}) for key, value, raw in overrides]
    values = {k: d for k, (_, d, _) in keys.items()}
    setting = {}  # {key: (the key as given, the value given, layer)} of its latest setting
    required = {}  # {key: the key as given} set to ??? by a layer and by no later one
    for origin, layer, flat in layers:
        for spelling, given in flat.items():
            if spelling == "fsdp.seed" and given is None:  # null: the top-level seed, as verl's default
                continue
            key, value = RENAMED.get(spelling, spelling), given
            head, _, sub = key.rpartition(".")
            if key not in keys and head in SUBKEYS:  # fsdp.mixed_precision.param_dtype=bf16
                held = values[head] or {}
                if not isinstance(held, dict):
                    problems.append(f"{origin}: {key}: {head} is {held!r}, not a dict of {', '.join(SUBKEYS[head])}")
                    continue
                key, value = head, {**held, sub: given}
            if key not in keys:
                problems.append(f"{origin}: unknown key '{key}'" + _suggest(key, keys))
                continue
            if given == REQUIRED:
                required[key] = spelling
                continue
            required.pop(key, None)
            if key == "fsdp.mixed_precision" and isinstance(value, str):  # one dtype: the compute dtype (param_dtype);
                if value not in DTYPES:  # reductions and buffers (rotary tables) stay fp32, as verl's
                    problems.append(
                        f"{key}={value!r}: expected one dtype ({', '.join(DTYPES)}), a dict "
                        f"{{{', '.join(SUBKEYS[key])}}} of dtypes, or null"
                    )
                value = {"param_dtype": value}
            if key == "fsdp.mixed_precision" and value == {"param_dtype": None}:  # model.fsdp_policy_mp=null
                value = None
            if key == "fsdp.wrap_policy" and isinstance(value, dict) and isinstance(value.get(BLOCKS), str):
                value = {**value, BLOCKS: [value[BLOCKS]]}
            last = setting.get(key)
            if last and last[2] == layer > 0 and last[0] != spelling:  # two spellings of one key, one layer
                problems += _disagree(last, (spelling, given, layer), values[key], value, values["fsdp.dtype"])
            values[key] = value
            setting[key] = (spelling, given, layer)
    problems += [f"{k}: a value is required (set it on the command line: {k}=...)" for k in required.values()]
    if problems:
        raise ConfigError(problems)
    explicit = {k for k, (spelling, _, layer) in setting.items() if layer and spelling not in RENAMED}
    return values, explicit, flags


def _disagree(first: tuple, second: tuple, before: Any, after: Any, dtype: str) -> list[str]:
    """Two settings (key as given, value, layer) of one key by one layer: a problem where one is a renamed key, the
    other sets its knob too and they differ (`before`, `after`: the key's value before and after the second setting; a
    mixed_precision without param_dtype computes in fsdp.dtype, `dtype`)."""
    old, new = (first, second) if first[0] in RENAMED else (second, first)
    if old[0] not in RENAMED:
        return []
    head, _, part = RENAMED[old[0]].rpartition(".")
    if head in SUBKEYS and new[0] not in (head, RENAMED[old[0]]):  # another sub-key: another knob
        return []
    default = dtype if head == "fsdp.mixed_precision" else None
    knobs = [v.get(part, default) if head in SUBKEYS and isinstance(v, dict) else v for v in (before, after)]
    if len({DTYPES.get(str(k), str(k)) for k in knobs}) == 1:  # bf16 and bfloat16 are one dtype
        return []
    return [f"{old[0]}={old[1]!r} and {new[0]}={new[1]!r} set the same knob to different values; set only {new[0]}"]


def build(cls, values: dict, prefix: str, problems: list[str]):
    """`cls` from {dotted key: value}, each leaf type-checked (the values are checked by validate())."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        key = prefix + f.name
        if isinstance(t, type) and issubclass(t, BaseConfig):
            kwargs[f.name] = build(t, values, key + ".", problems)
        else:
            ok, kwargs[f.name] = _coerce(values[key], t)
            if not ok:
                problems.append(f"{key}={values[key]!r}: expected {_type_name(t)}, got {type(values[key]).__name__}")
    return cls(**kwargs)


# Options whose config rules live in their own file beside their code, imported only when on: {module: switch}
OPTIONS = {
    "modifiers": lambda c: any(
        [c.loss.wpo, c.loss.ld_alpha != 1, c.loss.dpop_lambda, c.loss.dynamic_beta, c.loss.dynamic_beta_filter]
    ),
    "packing": lambda c: c.prefix_sharing,
    "ulysses": lambda c: c.fsdp.ulysses_sequence_parallel_size > 1,
    "lora": lambda c: c.lora.r is not None or c.model.quantization is not None,  # QLoRA: lora.py's rules
    "reference_cache": lambda c: c.precompute_ref_log_probs,
    "online": lambda c: c.online.rounds is not None,
    "scored_eval": lambda c: c.eval_scorer is not None,
}


# --- Validation: each key against RULES, then the rules across keys; each problem one line ---
def data_parallel_size(cfg: Config, world_size: Optional[int]) -> tuple[int, str]:
    """Ranks that see different pairs (Ulysses groups share theirs), and how a message names them."""
    ws = world_size or 1
    sp = cfg.fsdp.ulysses_sequence_parallel_size
    if sp > 1 and ws % sp == 0:
        return ws // sp, f"data-parallel size (world size {ws} / fsdp.ulysses_sequence_parallel_size {sp})"
    return ws, "world size"


def known_world_size(cfg: Config) -> Optional[int]:
    """Processes that will train, where the config and the environment say: 1 (BasicTrainer), torchrun's WORLD_SIZE,
    n_workers; None: train.launch counts the GPUs, so train.main checks the rules that need it once it has."""
    if cfg.trainer == "BasicTrainer":
        return 1
    workers = cfg.n_workers if (cfg.n_workers or 0) > 0 else None  # a bad n_workers is refused by its own rule
    return int(os.environ.get("WORLD_SIZE") or 0) or workers


def validate(c: Config, world_size: Optional[int] = None) -> list[str]:
    """Every problem of a built config; `world_size` = processes that will train (None = not known yet). The rules
    here are the ones every run needs; an optional feature's rules (below) run only when it is on."""
    ws, ranks = data_parallel_size(c, world_size)
    world = world_size or 0
    bs = c.batch_size
    accum = c.gradient_accumulation_steps
    flat = flatten(c.to_dict())
    problems = [  # each non-null value its rule refuses, with what was expected (null is the type's business)
        f"{k}={v!r}: expected {RULES[k][1]}" + (_suggest(str(v), map(str, CHOICES[k])) if k in CHOICES else "")
        for k, v in flat.items()
        if k in RULES and v is not None and not RULES[k][0](v)
    ]
    if c.max_prompt_length >= c.max_length:
        problems.append(
            f"max_prompt_length={c.max_prompt_length}: expected < max_length={c.max_length} (room for the response)"
        )
    if c.n_epochs is None and c.n_examples is None:
        problems.append("n_epochs=null, n_examples=null: expected one of them set: how long the run goes on")
    if c.n_epochs is not None and c.n_examples is not None:
        problems.append(
            f"n_epochs={c.n_epochs}, n_examples={c.n_examples}: expected exactly "
            f"one of them set; to train on n_examples={c.n_examples} pairs add n_epochs=null (n_epochs defaults to 1)"
        )
    if c.eval_every > 0 and bs > 0 and c.eval_every % bs:
        problems.append(
            f"eval_every={c.eval_every}: expected a multiple of batch_size={bs} (evaluation happens between steps)"
        )
    if bs > 0 and accum > 0 and bs % (accum * ws):
        problems.append(f"batch_size={bs}: expected divisible by gradient_accumulation_steps={accum} x {ranks}={ws}")
    if c.eval_batch_size > 0 and c.eval_batch_size % ws:
        problems.append(f"eval_batch_size={c.eval_batch_size}: expected divisible by {ranks}={ws}")
    if c.max_tokens_per_microbatch is not None and accum != 1:
        problems.append(
            f"max_tokens_per_microbatch={c.max_tokens_per_microbatch} and gradient_accumulation_steps={accum}: the "
            "token budget decides the micro-batches; leave accumulation at 1"
        )
    if c.no_sync_accumulation and c.trainer != "FSDPTrainer":
        problems.append(
            f"no_sync_accumulation=true: only FSDPTrainer reduces gradients across ranks (trainer={c.trainer})"
        )
    if c.fused_optimizer and c.optimizer != "AdamW":
        problems.append(f"fused_optimizer=true: only AdamW has a fused kernel here (optimizer={c.optimizer})")
    # under BasicTrainer fsdp_size is refused as ignored (FSDP_ONLY), not held against a world size of 1
    if c.trainer == "FSDPTrainer" and c.fsdp.fsdp_size > 0 and world % c.fsdp.fsdp_size:
        problems.append(f"fsdp.fsdp_size={c.fsdp.fsdp_size}: expected a divisor of the world size {world}")
    if c.loss.weights is not None and len(c.loss.weights) != len(c.loss_names):
        problems.append(f"loss.weights={c.loss.weights}: expected one weight per loss name ({len(c.loss_names)})")
    fp16_weights = DTYPES.get(c.fsdp.model_dtype) == "float16"
    if c.fsdp.mixed_precision is not None or c.model.reference_mixed_precision or fp16_weights:
        problems += _precision_rules(c)
    for key, subkeys in SUBKEYS.items():  # fsdp.mixed_precision, fsdp.wrap_policy
        for k, v in (flat[key] or {}).items():
            if k not in subkeys:
                problems.append(f"{key}.{k}: unknown key; expected one of {', '.join(subkeys)}" + _suggest(k, subkeys))
            elif not subkeys[k][0](v):
                problems.append(f"{key}.{k}={v!r}: expected {subkeys[k][1]}")
    policy = c.fsdp.wrap_policy or {}
    if policy.get(BLOCKS) and policy.get("min_num_params") is not None:  # fsdp.py would read the size alone
        problems.append(f"fsdp.wrap_policy={policy}: expected {BLOCKS} or min_num_params, not both (one policy)")
    known = sorted(loss_registry())
    for n in c.loss_names:
        if isinstance(n, str) and n not in known:
            preset = (CONFIG_DIR / "loss" / f"{n}.yaml").exists()
            hint = f"; {n} is a preset of losses and settings: loss={n}" if preset else _suggest(n, known)
            problems.append(f"loss.name={n!r}: unknown loss; expected one of {', '.join(known)}" + hint)
    if any(_flag(n, "batch_statistics") for n in c.loss_names) or c.loss.dynamic_beta > 0:
        problems += _batch_statistics_rules(c, ws, ranks)
    if c.unpaired_loss or c.pairs_to_unpaired:
        problems += _unpaired_rules(c, ws, ranks)
    if c.ref_update.tau is not None:
        problems += _ref_update_rules(c)
    for name, on in OPTIONS.items():  # each option's own rules, in its file, read only when it is on
        problems += importlib.import_module(name).rules(c, world) if on(c) else []
    return problems


def _precision_rules(c: Config) -> list[str]:
    """Mixed precision, the reference's share of it, fp16 weights."""
    problems = []
    if c.model.reference_mixed_precision and c.fsdp.mixed_precision is None:
        problems.append(
            "model.reference_mixed_precision=true: there is no mixed precision to "
            "give the reference (fsdp.mixed_precision / model.fsdp_policy_mp is null)"
        )
    compute = (c.fsdp.mixed_precision_dtypes() or {}).get("param_dtype")
    for key, dtype in (("fsdp.model_dtype", c.fsdp.model_dtype), ("fsdp.mixed_precision.param_dtype", compute)):
        if DTYPES.get(dtype) == "float16" and not c.fsdp.forward_only:
            problems.append(
                f"{key}={dtype}: fp16 training needs a gradient scaler, which is not "
                "supported yet; use bf16 (the same memory, fp32's range)"
            )
    return problems


def _batch_statistics_rules(c: Config, ws: int, ranks: str) -> list[str]:
    """A loss that reads statistics of the whole batch (or beta-DPO's batch-level beta): one micro-batch per step."""
    batch_level = [n for n in c.loss_names if _flag(n, "batch_statistics")]
    batch_level += ["loss.dynamic_beta"] * (c.loss.dynamic_beta > 0)
    accum = c.gradient_accumulation_steps
    budget = c.max_tokens_per_microbatch
    split = [f"gradient_accumulation_steps={accum}"] * (accum > 1)
    split += [f"max_tokens_per_microbatch={budget}"] * (budget is not None)
    split += [f"{ranks} {ws}"] * (ws > 1)
    if not split:
        return []
    return [
        f"loss.name={c.loss.name!r}: {', '.join(batch_level)} {'uses' if len(batch_level) == 1 else 'use'} "
        f"statistics of the whole batch (a sort or a mean over its pairs), so {' and '.join(split)} would change "
        "the loss by splitting the step; run them with one micro-batch per step on one process"
    ]


def _unpaired_rules(c: Config, ws: int, ranks: str) -> list[str]:
    """Unpaired losses (kto) and pairs_to_unpaired."""
    kto = next((n for n in c.loss_names if _flag(n, "unpaired")), None)
    if not kto:  # then pairs_to_unpaired=true brought us here
        return [f"pairs_to_unpaired=true: only unpaired losses (kto) read it; loss.name is {c.loss.name!r}"]
    problems = []
    if len(c.loss_names) > 1:
        problems.append(
            f"loss.name={c.loss.name!r}: {kto} scores labelled completions, not pairs; it cannot be summed with other "
            "losses"
        )
    for key in ("batch_size", "eval_batch_size"):
        if c[key] // ws < 2:
            problems.append(
                f"{key}={c[key]}: {kto} estimates its KL reference point from each completion paired with the next "
                f"one's prompt in a rank's batch, so it needs >= 2 per rank ({ranks} {ws})"
            )
    if c.precompute_ref_log_probs:
        problems.append(
            f"precompute_ref_log_probs=true: not supported with loss {kto} (its KL reference point needs "
            "the reference on mismatched prompt/completion pairs of each batch)"
        )
    return problems


def _ref_update_rules(c: Config) -> list[str]:
    """TR-DPO (ref_update.tau)."""
    tau = c.ref_update.tau
    problems = []
    if c.loss.reference_free or not any(_flag(n, "needs_reference") for n in c.loss_names):
        problems.append(
            f"ref_update.tau={tau}: the selected loss {c.loss.name!r} runs no reference model"
            + " (loss.reference_free=true)" * c.loss.reference_free
            + ", so there is nothing to update"
        )
    if c.precompute_ref_log_probs:
        problems.append(
            f"ref_update.tau={tau} and precompute_ref_log_probs=true: precomputed reference log-probs are of the "
            "initial reference, but TR-DPO changes the reference during training; set one of them off"
        )
    return problems


def load_config(argv: Optional[list[str]] = None, world_size: Optional[int] = None) -> tuple[Config, set[str]]:
    """Compose, type-check and validate (world_size None: known_world_size). Returns (config, flags)."""
    values, explicit, flags = compose(sys.argv[1:] if argv is None else argv)
    problems = []
    cfg = build(Config, values, "", problems)
    if problems:  # types must be right before the cross-field rules can read them
        raise ConfigError(problems)
    if "eval_every" not in explicit and (bs := cfg.batch_size) > 0:
        # the default adapts: the original's `example_counter % eval_every` never fired if batch_size did not divide it
        cfg = dataclasses.replace(cfg, eval_every=max(bs, cfg.eval_every // bs * bs))
    if problems := validate(cfg, world_size or known_world_size(cfg)) + _ignored_problems(cfg, explicit):
        raise ConfigError(problems)
    if cfg.exp_name is None:
        cfg = dataclasses.replace(cfg, exp_name=f"{'+'.join(cfg.loss_names)}_{Path(cfg.model.name_or_path).name}")
    return cfg, flags


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=None)


def help_text() -> str:
    """Every key with its type, default, doc and allowed values; then train.py's flags and exit codes."""
    return "\n".join(
        [
            "usage: python -u train.py [group=choice ...] [key=value ...] [--cfg | --estimate [gpu=NAME]]",
            "       python -u train.py --replay <run dir> [--cfg]",
            "",
            "groups:",
            *(f"  {g}=  one of: {', '.join(_group_choices(g))}" for g in GROUPS),
            "",
            "keys (key: type = default  # doc [allowed values]); values are YAML (datasets=[hh,shp] n_epochs=null);",
            "--key=value means key=value:",
            *(
                f"  {key}: {_type_name(t)} = {default!r}  # {doc}" + (f" [{RULES[key][1]}]" if key in RULES else "")
                for key, (t, default, doc) in schema().items()
            ),
            "the original DPO code's keys and verl's fsdp.seed, each setting another key:",
            *(f"  {old} -> {new}" for old, new in RENAMED.items()),
            "",
            "flags: --cfg                  run every check that needs no weights, print the resolved config as "
            "YAML, exit",
            "       --estimate [gpu=NAME]  memory per rank and FLOPs per step from config.json alone (gpu=: time, fit)",
            "       --replay <run dir>     run a recorded run again into a new directory, compare every logged metric",
            "",
            "exit codes: 0 done; 2 bad input (refused before anything is loaded or written); 3 more than "
            "max_nonfinite_steps",
            "  non-finite steps in a row (checkpoint written); 4 a self-check failed before the first optimizer",
            "  step (nothing trained; run_dir/self_check.json); 5 semi-online rounds made too few pairs for one step",
            "  (nothing trained; run_dir/rounds/ kept, the message names the knobs); 130 / 143 SIGINT / SIGTERM:",
            "  stopped after a step, checkpoint written, resume command printed",
        ]
    )
