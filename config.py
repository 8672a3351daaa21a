"""Typed configuration, and the small YAML loader that replaces Hydra.

A run's configuration is built in layers, later ones winning: the defaults in the dataclass fields below (each with
its one-line doc and allowed values); the group files config/model/<choice>.yaml and config/loss/<choice>.yaml
(`model=pythia28 loss=dpo`; config/config.yaml picks the default choices); dotted `key=value` overrides whose values
are YAML (`loss.beta=0.1 datasets=[hh,shp]`; `--key=value` is the same, as W&B sweep agents pass it). The result is a
frozen `Config` that reads like a dict, as the original DictConfig did. Every problem is collected and raised once as
a `ConfigError` naming the key, the bad value and what was expected. Only the loss registry imports losses.py (and
torch), on first use: `--help` answers at once.
"""
from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import functools
import inspect
import os
import sys
import traceback
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional, Union

import yaml

CONFIG_DIR = Path(__file__).resolve().parent / "config"
GROUPS = ("model", "loss")  # `model=X` picks config/model/X.yaml, `loss=X` picks config/loss/X.yaml
REQUIRED = "???"  # a YAML value that the user must override (as in Hydra/OmegaConf)
POSITIVE, NON_NEGATIVE = "(0, inf)", "[0, inf)"  # the commonest `allowed` intervals


def param(default: Any, doc: str, allowed: Any = None) -> Any:
    """A dataclass field with its one-line doc (shown by `--help`) and the values it allows: a tuple of choices, or an
    interval as text, "(0, inf)" or "[0, 0.5)" (round bracket = open end; null passes where the type allows it)."""
    metadata = {"doc": doc, "allowed": allowed}
    if isinstance(default, (BaseConfig, list, dict)):  # a fresh copy for each instance
        return field(default_factory=lambda d=default: type(d)() if isinstance(d, BaseConfig) else type(d)(d), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class BaseConfig(collections.abc.Mapping):
    """A dataclass that reads like a dict (verl's BaseConfig): `cfg.key`, `cfg["key"]`, `cfg.get(key)`, iteration. It is
    frozen after construction but for the fields in `_mutable_fields` (a subclass adds `Parent._mutable_fields | {...}`)."""

    _mutable_fields: ClassVar[frozenset] = frozenset()

    def __post_init__(self):
        object.__setattr__(self, "_frozen", True)

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_frozen", False) and name not in self._mutable_fields:
            raise dataclasses.FrozenInstanceError(f"cannot assign to field '{name}' of frozen {type(self).__name__}")
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot delete field '{name}' of {type(self).__name__}")

    def __getitem__(self, key: str) -> Any:
        if key not in list(self):
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self):
        return (f.name for f in dataclasses.fields(self))

    def __len__(self) -> int:
        return len(dataclasses.fields(self))

    def to_dict(self) -> dict:
        """A plain nested dict (sub-configs converted too); safe to dump as YAML."""
        plain = lambda v: ({k: plain(x) for k, x in v.items()} if isinstance(v, (dict, BaseConfig))  # noqa: E731
                           else [plain(x) for x in v] if isinstance(v, (list, tuple)) else v)
        return plain(self)


DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
          "fp16": "float16", "float16": "float16"}  # accepted spellings -> torch attribute name
MIXED_PRECISION_KEYS = ("param_dtype", "reduce_dtype", "buffer_dtype")
WRAP_POLICY_KEYS = ("transformer_layer_cls_to_wrap", "min_num_params")
DICT_FIELDS = ("fsdp.wrap_policy", "fsdp.mixed_precision")  # dict-valued fields whose sub-keys can be overridden


@dataclass
class EngineConfig(BaseConfig):
    """Fields every training engine shares (verl's EngineConfig)."""
    param_offload: bool = param(False, "keep parameters on CPU between compute phases (moved to the device only for forward/backward)")
    optimizer_offload: bool = param(False, "keep optimizer state on CPU between optimizer steps")
    seed: Optional[int] = param(None, "engine seed; null = the top-level `seed` (one source of truth, both set and different is an error)")
    full_determinism: bool = param(False, "deterministic algorithms everywhere (torch.use_deterministic_algorithms); slower, for debugging")
    dtype: str = param("bfloat16", "dtype of mixed-precision compute; the param_dtype when fsdp.mixed_precision leaves it out")
    forward_only: bool = param(False, "run no optimizer: load, evaluate (and sample) once, then exit")


@dataclass
class FSDPEngineConfig(EngineConfig):
    """The FSDP engine: verl's FSDPEngineConfig, every field live or refused. model.block_name, model.policy_dtype and
    model.fsdp_policy_mp (the original code's names) are aliases of wrap_policy, model_dtype and mixed_precision."""
    # ulysses_sequence_parallel_size is mutable for backward compatibility (as in verl)
    _mutable_fields: ClassVar[frozenset] = EngineConfig._mutable_fields | {"ulysses_sequence_parallel_size"}
    wrap_policy: dict = param({}, "FSDP auto-wrap: {transformer_layer_cls_to_wrap: [names]} or {min_num_params: N}; {} = each transformer block")
    offload_policy: bool = param(False, "FSDP2 CPUOffloadPolicy (params, grads and optimizer step on CPU); pinned memory only with a GPU")
    reshard_after_forward: bool = param(True, "free gathered params after forward (FULL_SHARD); false keeps them until backward (SHARD_GRAD_OP)")
    fsdp_size: int = param(-1, "ranks per shard group; -1 = all ranks; 1 < fsdp_size < world = hybrid (replicate x shard)")
    forward_prefetch: bool = param(False, "issue the next block's all-gather before the current forward finishes")
    model_dtype: str = param("fp32", "dtype of the master weights the model is loaded in (alias: model.policy_dtype)")
    use_orig_params: bool = param(False, "FSDP1: keep the original nn.Parameters visible (needed for per-parameter optimizer groups)")
    mixed_precision: Optional[dict] = param(None, "{param_dtype, reduce_dtype, buffer_dtype}, or one dtype (bf16) for param_dtype; param_dtype defaults to fsdp.dtype, the other two to fp32; null = compute in model_dtype (alias: model.fsdp_policy_mp)")
    ulysses_sequence_parallel_size: int = param(1, "Ulysses sequence parallelism: ranks per group that split every sequence (FSDPTrainer; divides the world size and the attention heads); 1 = off")
    entropy_from_logits_with_chunking: bool = param(False, "compute the logged policy entropy in row chunks (less memory)")
    use_torch_compile: Optional[bool] = param(None, "torch.compile the entropy kernel; null = only on CUDA, where compiling pays")
    entropy_checkpointing: bool = param(False, "recompute the entropy in backward instead of storing it")
    strategy: str = param("fsdp", "fsdp (FSDP1, FullyShardedDataParallel) or fsdp2 (fully_shard)", ("fsdp", "fsdp2"))


@dataclass
class WandbConfig(BaseConfig):
    enabled: bool = param(True, "log to Weights & Biases (online with an API key, else offline)")
    entity: Optional[str] = param(None, "W&B entity (team or user); null = your default")
    project: str = param("direct-preference-optimization", "W&B project")


@dataclass
class ModelConfig(BaseConfig):
    name_or_path: str = param("toy/tiny-llama", "Hugging Face hub id or local directory of the policy")
    tokenizer_name_or_path: Optional[str] = param(None, "tokenizer hub id or directory; null = name_or_path")
    archive: Optional[str] = param(None, "policy.pt of an earlier run (e.g. SFT) loaded into policy and reference")
    block_name: Optional[str] = param(None, "transformer block class name for FSDP wrapping (alias of fsdp.wrap_policy); null = from _no_split_modules")
    policy_dtype: str = param("float32", "dtype the policy is loaded in (alias of fsdp.model_dtype)")
    fsdp_policy_mp: Optional[str] = param(None, "mixed-precision dtype under FSDP (alias of fsdp.mixed_precision); null = none")
    reference_dtype: Optional[str] = param(None, "dtype of the frozen reference model; null = the policy's (fsdp.model_dtype): fp16 overflows bf16-native models")
    reference_mixed_precision: Optional[bool] = param(None, "compute the reference under fsdp.mixed_precision (FSDP MixedPrecision / autocast); null = as the policy does; false = in reference_dtype")
    chat_template: Optional[str] = param(None, "chat template for chat-form data when the tokenizer has none (or to replace its own): chatml, or a path to a Jinja template file; null = the tokenizer's")
    trust_remote_code: bool = param(False, "allow model repositories to run their own Python code (security risk)")


@dataclass
class LossConfig(BaseConfig):
    """The loss, and every hyperparameter a loss function reads: a function reads `loss.<key>` by naming it as a
    keyword-only parameter (losses.py). A new hyperparameter is one new field here."""
    name: Union[str, list] = param("sft", "loss name, or a list of names whose losses are summed with `weights`")
    weights: Optional[list] = param(None, "one weight per loss name; null = all 1.0")
    reference_free: bool = param(False, "use a uniform reference (all reference log-probs 0); no reference model is built")
    average_log_prob: Optional[bool] = param(None, "per-token mean instead of sum of sequence log-probs; null = the loss's own default")
    entropy_coeff: float = param(0.0, "entropy bonus: loss - entropy_coeff * mean policy entropy over responses (0 = entropy only logged)")
    beta: float = param(0.1, "temperature of the implicit reward (DPO beta); 0.1-0.5 typical", POSITIVE)
    label_smoothing: float = param(0.0, "assumed fraction of flipped labels, in [0, 0.5): dpo with it is cDPO (as the original code); robust DPO's and EXO's epsilon", "[0, 0.5)")
    gamma: float = param(1.0, "SimPO target reward margin gamma")
    rpo_alpha: float = param(1.0, "RPO weight of the chosen NLL term")
    orpo_lambda: float = param(0.1, "ORPO weight of the odds-ratio term")
    f_divergence: str = param("reverse_kl", "f-DPO divergence: reverse_kl | forward_kl | js_divergence | alpha_divergence",
                              ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"))
    f_alpha: float = param(0.5, "alpha of f-DPO's alpha_divergence, in (0, 1]: 0 -> reverse KL, 1 = forward KL; TRL 1.x's f_alpha_divergence_coef is 1 - f_alpha", "(0, 1]")
    discopop_tau: float = param(0.05, "DiscoPOP temperature of the log-ratio modulation", POSITIVE)
    desirable_weight: float = param(1.0, "KTO lambda_D, weight of desirable completions; keep lambda_D n_D / (lambda_U n_U) in [1, 4/3]", POSITIVE)
    undesirable_weight: float = param(1.0, "KTO lambda_U, weight of undesirable completions", POSITIVE)


@dataclass
class RefUpdateConfig(BaseConfig):
    """TR-DPO (Gorbatovski et al., arXiv:2404.09656): every `tau` optimizer steps the reference moves toward the
    policy, ref <- alpha * policy + (1 - alpha) * ref; alpha = 1 is the hard update (ref <- policy)."""
    tau: Optional[int] = param(None, "update the reference every tau optimizer steps; null = frozen reference (plain DPO)", POSITIVE)
    alpha: float = param(0.6, "weight of the policy in the update, in (0, 1]: 0.6 = TR-DPO's soft update, 1.0 = the hard update", "(0, 1]")


@dataclass
class LoraSettings(BaseConfig):
    """LoRA adapters through `peft` (optional: pip install peft). The reference is the base model with the adapters
    disabled, so no second copy of the weights is held."""
    r: Optional[int] = param(None, "LoRA rank; null = full fine-tuning (no adapters)")
    alpha: float = param(16.0, "LoRA scaling numerator: the update is (alpha / r) * B A", POSITIVE)
    dropout: float = param(0.0, "dropout on the adapters' input (0 keeps training deterministic)", "[0, 1)")
    target_modules: Union[str, list] = param("all-linear", "modules that get adapters: a list of names (q_proj, v_proj, ...) or peft's 'all-linear' (every linear layer but the LM head)")


@dataclass
class Config(BaseConfig):
    seed: int = param(0, "random seed: data order, initialization of anything random, sampling")
    exp_name: Optional[str] = param(None, "name of the run (directory and W&B); null = '<loss>_<model>'")
    batch_size: int = param(4, "pairs per optimizer step, over all ranks and accumulation steps", POSITIVE)
    eval_batch_size: int = param(16, "pairs per evaluation step, over all ranks", POSITIVE)
    debug: bool = param(False, "debug mode: no W&B and no checkpoints")
    fsdp_port: Optional[int] = param(None, "port of the rendezvous for the single-node FSDP launcher; null = a free port")
    datasets: list = param(["toy"], "dataset names (hh, shp, se, ultrafeedback, toy) or paths to .jsonl/.json files")
    wandb: WandbConfig = param(WandbConfig(), "Weights & Biases")
    local_dirs: list = param([".cache"], "directories for caches and runs; the first one that exists or can be made is used")
    sample_during_eval: bool = param(True, "generate samples from policy and reference at each evaluation")
    n_eval_model_samples: int = param(16, "prompts sampled at each evaluation", NON_NEGATIVE)
    do_first_eval: bool = param(True, "evaluate before the first training step")
    lr: float = param(5e-7, "peak learning rate (the DPO paper's 1e-6 at batch 64; the original config's 5e-7)", POSITIVE)
    gradient_accumulation_steps: int = param(1, "micro-batches per optimizer step", POSITIVE)
    max_grad_norm: float = param(10.0, "clip the gradient norm to this (the pre-clip norm is logged as grad_norm)", POSITIVE)
    max_length: int = param(512, "max tokens of prompt + response", POSITIVE)
    max_prompt_length: int = param(256, "max tokens of the prompt (truncated first)", POSITIVE)
    truncation_mode: Optional[str] = param(None, "keep_start | keep_end for prompts; null = each source's default (hh: keep_end)", (None, "keep_start", "keep_end"))
    n_epochs: Optional[int] = param(1, "epochs over the training pairs (exactly one of n_epochs, n_examples)", POSITIVE)
    n_examples: Optional[int] = param(None, "train on this many pairs, then stop (exactly one of n_epochs, n_examples)", POSITIVE)
    n_eval_examples: int = param(256, "held-out pairs evaluated (the fixed first ones of the test split)", POSITIVE)
    trainer: str = param("BasicTrainer", "BasicTrainer (one process) or FSDPTrainer (sharded, one process per device)", ("BasicTrainer", "FSDPTrainer"))
    optimizer: str = param("RMSprop", "RMSprop (the original's choice), AdamW or SGD", ("RMSprop", "AdamW", "SGD"))
    weight_decay: float = param(0.0, "weight decay of AdamW (decoupled) and SGD", NON_NEGATIVE)
    scheduler: str = param("constant", "after warmup: constant (the original), linear or cosine decay to 0", ("constant", "linear", "cosine"))
    warmup_steps: int = param(150, "linear warmup, in optimizer steps", NON_NEGATIVE)
    activation_checkpointing: bool = param(False, "recompute each transformer block in backward (NO_REENTRANT)")
    eval_every: int = param(20_000, "evaluate (and checkpoint) every this many training pairs; a multiple of batch_size", POSITIVE)
    minimum_log_interval_secs: float = param(1.0, "log training metrics at most this often", NON_NEGATIVE)
    max_new_tokens: int = param(64, "tokens generated per sample during evaluation", POSITIVE)
    temperature: float = param(1.0, "sampling temperature during evaluation", POSITIVE)
    top_p: float = param(1.0, "nucleus sampling threshold during evaluation", "(0, 1]")
    resume_from: Optional[str] = param(None, "run directory to resume from (its LATEST checkpoint), continuing exactly")
    run_dir: Optional[str] = param(None, "where this run writes; null = <local_dir>/runs/<exp_name>_<timestamp>")
    padding_free: bool = param(False, "pack the chosen and rejected sequences of a micro-batch into rows without padding")
    pairs_to_unpaired: bool = param(False, "unpaired losses (kto) on pair data: each training pair gives a desirable (chosen) and an undesirable (rejected) completion; eval keeps the pairs")
    tiled_lm_head: bool = param(True, "project only scored positions through the LM head, in tiles (every trainer; under FSDP inside the root unit's forward)")
    precompute_ref_log_probs: bool = param(False, "run the reference once over the data before training, cache its log-probs, free it")
    max_tokens_per_microbatch: Optional[int] = param(None, "token-budget micro-batching: pairs grouped up to this many real tokens (replaces gradient_accumulation_steps)", POSITIVE)
    balance_batch: bool = param(True, "deal each training step's pairs to the data-parallel ranks in equal counts of near-equal tokens; false = consecutive equal shares, as the original code")
    no_sync_accumulation: bool = param(False, "FSDP: reduce-scatter gradients only after a step's last micro-batch (less communication; every rank then holds the whole model's unsharded gradients, fp32 under FSDP2, between micro-batches); false = after every micro-batch, as the original")
    fused_optimizer: bool = param(False, "AdamW's fused kernel (one kernel for all parameters; fastest on GPU)")
    peak_tflops: Optional[float] = param(None, "the device's dense bf16/fp16 matmul peak in TFLOP/s for the logged throughput/mfu (6N FLOPs per token); null = from a table of known GPUs, else MFU is not logged", POSITIVE)
    max_nonfinite_steps: int = param(3, "a non-finite loss or gradient skips the step; more than this many in a row stops the run", NON_NEGATIVE)
    collective_timeout_secs: int = param(600, "a distributed collective waiting longer than this raises (a dead rank ends the job)", POSITIVE)
    n_workers: Optional[int] = param(None, "FSDPTrainer without torchrun: processes to start; null = one per GPU, 2 on CPU", POSITIVE)
    model: ModelConfig = param(ModelConfig(), "the policy model")
    loss: LossConfig = param(LossConfig(), "the loss and its hyperparameters")
    ref_update: RefUpdateConfig = param(RefUpdateConfig(), "TR-DPO: move the reference toward the policy during training")
    lora: LoraSettings = param(LoraSettings(), "LoRA adapters (peft) instead of full fine-tuning")
    fsdp: FSDPEngineConfig = param(FSDPEngineConfig(), "the FSDP engine")

    @property
    def loss_names(self) -> list:
        return [self.loss.name] if isinstance(self.loss.name, str) else list(self.loss.name)

    @property
    def unpaired_loss(self) -> bool:
        """True when a selected loss scores labelled completions (kto) instead of pairs."""
        return any(_flag(n, "unpaired") for n in self.loss_names)


class ConfigError(ValueError):
    """All problems of one configuration, each a line naming the key, the bad value and what was expected."""

    def __init__(self, problems: list[str]):
        self.problems, n = list(problems), len(problems)
        super().__init__(f"{n} configuration problem{'s' if n > 1 else ''}:\n" + "\n".join(f"  - {p}" for p in self.problems))


# --- The schema: dotted keys with their types, defaults, docs and allowed values, read off the dataclasses ---
def _leaves(cls=Config, prefix: str = ""):
    """(dotted key, dataclasses.Field, type hint) of every leaf field: ('loss.beta', <Field>, float), ..."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        if isinstance(t, type) and issubclass(t, BaseConfig):
            yield from _leaves(t, prefix + f.name + ".")
        else:
            yield prefix + f.name, f, t


def schema(cls=Config, prefix: str = "") -> dict[str, tuple]:
    """{dotted key: (type hint, default, doc)} for every leaf field, e.g. 'loss.beta'."""
    return {key: (t, f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default, f.metadata.get("doc", ""))
            for key, f, t in _leaves(cls, prefix)}


def loss_hyperparameters() -> dict[str, tuple[Any, str, Any]]:
    """{key: (default, one-line doc, allowed)} of LossConfig's fields that loss functions may read."""
    selection = {"name", "weights", "reference_free", "average_log_prob", "entropy_coeff"}
    return {f.name: (f.default, f.metadata["doc"], f.metadata["allowed"]) for f in dataclasses.fields(LossConfig)
            if f.name not in selection}


ALLOWED = {key: (f.metadata["allowed"], t) for key, f, t in _leaves() if f.metadata.get("allowed") is not None}
CHOICES = {key: allowed for key, (allowed, _) in ALLOWED.items() if isinstance(allowed, tuple)}  # the enumerated keys
# Engine fields that only mean something when parameters are sharded; set under BasicTrainer they would be ignored.
FSDP_ONLY = ("wrap_policy", "offload_policy", "reshard_after_forward", "fsdp_size", "forward_prefetch",
             "use_orig_params", "strategy", "param_offload", "optimizer_offload")
# FSDP2 always keeps the original parameters (as DTensors); CPUOffloadPolicy is FSDP2's (FSDP1: param_offload).
STRATEGY_ONLY = {"use_orig_params": "fsdp", "offload_policy": "fsdp2"}
# Names other trainers (TRL, Hugging Face's Trainer, the DPO paper) give keys of this config.
OTHER_NAMES = {"learning_rate": "lr", "num_train_epochs": "n_epochs", "epochs": "n_epochs", "beta": "loss.beta",
               "label_smoothing": "loss.label_smoothing", "loss_type": "loss.name", "max_prompt_len": "max_prompt_length",
               "per_device_train_batch_size": "batch_size", "model_name_or_path": "model.name_or_path",
               "gradient_checkpointing": "activation_checkpointing", "seq_len": "max_length", "warmup": "warmup_steps"}


def _type_name(t) -> str:
    args = typing.get_args(t)
    if typing.get_origin(t) in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args if a is not type(None)) + (" or null" if type(None) in args else "")
    return getattr(t, "__name__", str(t))


def _is_text(t) -> bool:
    """True for `str` and `Optional[str]`: a value typed on the command line is then taken as text."""
    return {a for a in (typing.get_args(t) or (t,)) if a is not type(None)} == {str}


def _coerce(value: Any, t) -> tuple[bool, Any]:
    """(whether `value` fits the type hint `t`, the value converted where lossless): an int is a float, a bool is no
    number, and numeric text is a float (YAML 1.1 reads `1e-6` as text)."""
    if typing.get_origin(t) in (Union, types.UnionType):
        if value is None:
            return type(None) in typing.get_args(t), None
        return next((r for r in (_coerce(value, a) for a in typing.get_args(t) if a is not type(None)) if r[0]), (False, value))
    if t is float and (type(value) is int or isinstance(value, str)):
        try:
            return True, float(value)
        except (ValueError, OverflowError):
            return False, value
    return t is Any or (isinstance(value, typing.get_origin(t) or t) and (t is bool) == isinstance(value, bool)), value


def _suggest(word: str, candidates) -> str:
    """" (did you mean X?)": another trainer's name for the key, else the closest candidate ignoring case."""
    lower = {c.lower(): c for c in candidates}
    if OTHER_NAMES.get(word) in lower.values():
        return f" (did you mean {OTHER_NAMES[word]}?)"
    close = difflib.get_close_matches(word.lower(), list(lower), n=1, cutoff=0.6)
    return f" (did you mean {lower[close[0]]}?)" if close else ""


# --- The loss registry, read from losses.py on first use ---
@functools.cache
def loss_registry() -> dict[str, dict]:
    """{loss name: {"reads": [the loss.* keys its function takes], **its LossSpec flags}} for each loss in losses.LOSSES.
    losses.py is ordinary Python: what it cannot provide (it does not import, an entry is not a LossSpec, a function
    reads a key LossConfig lacks) is a ConfigError naming the loss and the line, not a traceback."""
    try:
        import losses
    except Exception as e:  # noqa: BLE001 - the researcher's own edit: say where, without a traceback
        frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename.endswith("losses.py")]
        where = f"{e.filename}:{e.lineno}" if isinstance(e, SyntaxError) else (
            f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "losses.py")
        raise ConfigError([f"{where}: importing losses.py failed ({type(e).__name__}: {e})"]) from None
    out, problems = {}, []
    for name, spec in losses.LOSSES.items():
        if not isinstance(spec, losses.LossSpec) or not callable(spec.fn):
            problems.append(f"losses.py: LOSSES[{name!r}] = {spec!r}: expected LossSpec(<loss function>, needs_reference=..., ...)")
            continue
        reads = [p.name for p in inspect.signature(spec.fn).parameters.values()
                 if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in losses.SUPPLIED]
        code = getattr(spec.fn, "__code__", None)
        problems += [f"{f'{code.co_filename}:{code.co_firstlineno}' if code else 'losses.py'}: loss {name!r} "
                     f"({getattr(spec.fn, '__name__', spec.fn)}) reads loss.{key}, which is not a config key: add the field "
                     f"`{key}` to LossConfig in config.py (its default, doc and range)" for key in reads if key not in LossConfig()]
        out[name] = {"reads": reads, "needs_reference": spec.needs_reference, "average_log_prob": spec.average_log_prob,
                     "batch_statistics": spec.batch_statistics, "unpaired": spec.unpaired}
    if problems:
        raise ConfigError(problems)
    return out


def _single_losses() -> list[str]:
    """Names of the registered losses (a mixture like mpo is a config/loss preset, not a loss)."""
    return sorted(loss_registry())


def _flag(name: Any, flag: str) -> bool:
    return isinstance(name, str) and bool(loss_registry().get(name, {}).get(flag))


def unread_loss_keys(cfg: Config, explicit: dict[str, int]) -> list[str]:
    """A loss hyperparameter changed from its default (in a group file or on the command line) that no selected loss
    reads would be silently ignored: one problem per such key, naming the losses that do read it."""
    names, problems = [n for n in cfg.loss_names if isinstance(n, str) and n in loss_registry()], []
    for key in sorted({k for spec in loss_registry().values() for k in spec["reads"]}):
        value = cfg.loss[key]
        if not explicit.get(f"loss.{key}") or value == LossConfig()[key]:
            continue  # only what the user changed counts: presets may restate defaults
        readers = sorted(n for n, spec in loss_registry().items() if key in spec["reads"])
        if not set(readers) & set(names):
            problems.append(f"loss.{key}={value!r}: no selected loss reads it (loss.name: {', '.join(names) or 'none'}); "
                            f"it is read by {', '.join(readers)}")
        elif key == "f_alpha" and cfg.loss.f_divergence != "alpha_divergence":
            problems.append(f"loss.f_alpha={value!r}: read only with loss.f_divergence=alpha_divergence (this run uses {cfg.loss.f_divergence})")
    return problems


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
    """The command line as (group choices, overrides as (key, value, raw text), flags, problems). Values are YAML
    (`[hh,shp]`, `null`, `0.1`); text YAML cannot read stays text, and such a bracketed list (`[data/{split}.jsonl]`) is
    split at its commas."""
    choices, overrides, flags, problems = {}, [], set(), []
    for arg in argv:
        key, eq, raw = (arg[2:] if arg.startswith("--") else arg).partition("=")
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
                value = raw
            if isinstance(value, str) and raw.startswith("[") and raw.endswith("]"):
                value = [item.strip() for item in raw[1:-1].split(",") if item.strip()]
            overrides.append((key, value, raw))
    return choices, overrides, flags, problems


def _flatten(tree: dict, prefix: str = "", keys: Optional[dict] = None) -> dict:
    """Nested dict -> {dotted: value}; dict-valued leaf fields (wrap_policy, mixed_precision) stay whole."""
    keys = schema() if keys is None else keys
    out = {}
    for k, v in tree.items():
        out.update(_flatten(v, prefix + k + ".", keys) if isinstance(v, dict) and prefix + k not in keys else {prefix + k: v})
    return out


def compose(argv: list[str]) -> tuple[dict, dict[str, int], set[str]]:
    """The dataclass defaults, config.yaml's group choices, the chosen group files and the overrides, as
    (values {dotted key: value}, {key: layer that set it: 1 = a group file, 2 = the command line}, flags)."""
    choices, overrides, flags, problems = parse_argv(argv)
    keys, base = schema(), _read_yaml(CONFIG_DIR / "config.yaml")
    choices = {**{k: v for entry in base.pop("defaults", []) if isinstance(entry, dict) for k, v in entry.items()}, **choices}
    values, explicit = {k: d for k, (_, d, _) in keys.items()}, {}

    def apply(origin: str, flat: dict, layer: int) -> None:
        for key, value in flat.items():
            head, _, sub = key.rpartition(".")
            if key not in keys and head in DICT_FIELDS and layer == 2:  # fsdp.mixed_precision.param_dtype=bf16
                key, value = head, dict(values[head] or {}, **{sub: value})
            if key not in keys:
                problems.append(f"{origin}: unknown key '{key}'" + _suggest(key, keys))
            else:
                values[key], explicit[key] = value, layer

    apply("config/config.yaml", _flatten(base, "", keys), 0)
    for group, name in ((g, choices[g]) for g in GROUPS if choices.get(g) is not None):
        if (CONFIG_DIR / group / f"{name}.yaml").exists():
            apply(f"config/{group}/{name}.yaml", _flatten(_read_yaml(CONFIG_DIR / group / f"{name}.yaml"), f"{group}.", keys), 1)
        else:
            problems.append(f"{group}={name}: no such choice; expected one of {', '.join(_group_choices(group))}"
                            + _suggest(name, _group_choices(group)))
    for key, value, raw in overrides:  # a text key keeps the text typed: exp_name=123 is the name "123", not a number
        apply("command line", {key: raw if key in keys and _is_text(keys[key][0]) and raw not in ("null", "~") else value}, 2)
    if problems:
        raise ConfigError(problems)
    return values, {k: layer for k, layer in explicit.items() if layer}, flags


def _build(cls, values: dict, prefix: str, problems: list[str]):
    """`cls` from {dotted key: value}, each leaf type-checked (the values are checked by validate())."""
    hints, kwargs = typing.get_type_hints(cls), {}
    for f in dataclasses.fields(cls):
        t, key = hints[f.name], prefix + f.name
        if isinstance(t, type) and issubclass(t, BaseConfig):
            kwargs[f.name] = _build(t, values, key + ".", problems)
            continue
        value = values[key]
        if value == REQUIRED:
            problems.append(f"{key}: a value is required (set it on the command line: {key}=...)")
        ok, kwargs[f.name] = _coerce(None if value == REQUIRED else value, t)
        if not ok:
            problems.append(f"{key}={value!r}: expected {_type_name(t)}, got {type(value).__name__}")
    return cls(**kwargs)


# --- Aliases: the original DPO keys follow the FSDPEngineConfig fields that name the same knob ---
def mixed_precision_of(dtype: str) -> dict:
    """The fsdp.mixed_precision that one dtype stands for (the shorthand, model.fsdp_policy_mp): compute in `dtype`;
    reductions and buffers (rotary tables) stay fp32, as verl's (FSDPTrainer.mixed_precision_dtypes)."""
    return {"param_dtype": dtype}


def _dtype_problems(values: dict) -> list[str]:
    """Dtype spellings, and the sub-keys of fsdp.mixed_precision and fsdp.wrap_policy."""
    mp, names = values["fsdp.mixed_precision"], ", ".join(DTYPES)
    p = [f"fsdp.mixed_precision={mp!r}: expected one dtype ({names}), a dict {{{', '.join(MIXED_PRECISION_KEYS)}}} of dtypes,"
         " or null"] if isinstance(mp, str) else []
    p += [f"{key}={values[key]!r}: expected a dtype, one of {names}" for key in ("model.policy_dtype", "fsdp.model_dtype",
          "model.fsdp_policy_mp", "model.reference_dtype", "fsdp.dtype") if values[key] not in (None, *DTYPES)]
    for name, allowed in (("mixed_precision", MIXED_PRECISION_KEYS), ("wrap_policy", WRAP_POLICY_KEYS)):
        for k, v in (values[f"fsdp.{name}"].items() if isinstance(values[f"fsdp.{name}"], dict) else ()):
            if k not in allowed:
                p.append(f"fsdp.{name}.{k}: unknown key; expected one of {', '.join(allowed)}" + _suggest(k, allowed))
            elif name == "mixed_precision" and v not in tuple(DTYPES):
                p.append(f"fsdp.mixed_precision.{k}={v!r}: expected a dtype, one of {names}")
    return p


def _resolve_aliases(values: dict, explicit: dict[str, int], problems: list[str]) -> None:
    """Make model.policy_dtype, model.fsdp_policy_mp, model.block_name and the top-level seed agree with the fields that
    name the same knob, fsdp.model_dtype, fsdp.mixed_precision, fsdp.wrap_policy and fsdp.seed (the truth): the one set
    by the later layer (command line > group file > defaults) sets both; both set by one layer, differently, is an error."""
    if values["fsdp.mixed_precision"] in tuple(DTYPES):  # the shorthand fsdp.mixed_precision=bf16 = model.fsdp_policy_mp=bf16
        values["fsdp.mixed_precision"] = mixed_precision_of(values["fsdp.mixed_precision"])
    found = _dtype_problems(values)
    problems += found
    mp, wp, blocks = values["fsdp.mixed_precision"], values["fsdp.wrap_policy"], "transformer_layer_cls_to_wrap"
    if found or not isinstance(wp, dict) or not (mp is None or isinstance(mp, dict)):
        return  # types are reported by _build; aliases need valid values
    if isinstance(wp.get(blocks), str):
        values["fsdp.wrap_policy"] = wp = dict(wp, **{blocks: [wp[blocks]]})
    if values["fsdp.seed"] is None:  # null = the top-level seed
        values["fsdp.seed"], explicit["fsdp.seed"] = values["seed"], explicit.get("seed", 0)
    dtype = lambda v: DTYPES.get(v) if v is not None else None  # noqa: E731
    mp_dtype = lambda s: None if s is None else dtype(s.get("param_dtype", values["fsdp.dtype"]))  # noqa: E731
    for alias, source, to_source, from_source, same in (  # same(alias value, source value): no conflict
            ("model.policy_dtype", "fsdp.model_dtype", lambda a: a, dtype, lambda a, s: dtype(a) == dtype(s)),
            ("model.fsdp_policy_mp", "fsdp.mixed_precision", lambda a: a if a is None else mixed_precision_of(a), mp_dtype,
             lambda a, s: dtype(a) == mp_dtype(s)),
            ("model.block_name", "fsdp.wrap_policy", lambda a: dict(wp, **{blocks: [a]}) if a else wp,
             lambda s: s[blocks][0] if len(s.get(blocks) or []) == 1 else None, lambda a, s: a is None or s.get(blocks) in (None, [a])),
            ("seed", "fsdp.seed", lambda a: a, lambda s: s, lambda a, s: a == s)):
        a, s, layer_a, layer_s = values[alias], values[source], explicit.get(alias, 0), explicit.get(source, 0)
        if layer_a == layer_s > 0 and not same(a, s):
            problems.append(f"{alias}={a!r} and {source}={s!r} set the same knob to different values; set only {source}")
            continue
        if layer_a > layer_s:
            values[source] = to_source(a)
        values[alias] = from_source(values[source])


# --- Validation: each value in its field's `allowed`, then every cross-field rule; each problem one line ---
def data_parallel_size(cfg: Config, world_size: Optional[int]) -> tuple[int, str]:
    """Ranks that each see different pairs, and how a message names them: the world size, or under Ulysses sequence
    parallelism (whose groups share their pairs) world size / fsdp.ulysses_sequence_parallel_size."""
    ws, sp = world_size or 1, cfg.fsdp.ulysses_sequence_parallel_size
    if isinstance(sp, int) and sp > 1 and ws % sp == 0:
        return ws // sp, f"data-parallel size (world size {ws} / fsdp.ulysses_sequence_parallel_size {sp})"
    return ws, "world size"


def validate(cfg: Config, world_size: Optional[int] = None) -> list[str]:
    """Every problem of a built config. `world_size` = processes that will train (None = not known yet)."""
    p = []
    for key, (allowed, t) in ALLOWED.items():
        head, _, name = key.rpartition(".")
        v = cfg[head][name] if head else cfg[key]
        if isinstance(allowed, tuple) and v not in allowed:
            p.append(f"{key}={v!r}: expected one of {', '.join(map(str, allowed))}" + _suggest(str(v), map(str, allowed)))
        elif isinstance(allowed, str) and v is not None:  # an interval: "(0, inf)", "[0, 0.5)"
            (low, high), low_in, high_in = (float(x) for x in allowed[1:-1].split(",")), allowed[0] == "[", allowed[-1] == "]"
            if not ((v >= low if low_in else v > low) and (v <= high if high_in else v < high)):
                words = (f"{'>=' if low_in else '>'} {low:g}" if high == float("inf")
                         else f"{low:g} {'<=' if low_in else '<'} {name} {'<=' if high_in else '<'} {high:g}")
                p.append(f"{key}={v}: expected {words}" + " or null" * (type(None) in typing.get_args(t)))
    return p + _run_problems(cfg, world_size) + _loss_problems(cfg, world_size)


def _run_problems(cfg: Config, world_size: Optional[int]) -> list[str]:
    """Batch geometry, run length, precision, data and directories; the FSDP engine's groups."""
    p, (ws, ranks), fs, sp = [], data_parallel_size(cfg, world_size), cfg.fsdp.fsdp_size, cfg.fsdp.ulysses_sequence_parallel_size
    if cfg.max_prompt_length >= cfg.max_length:
        p.append(f"max_prompt_length={cfg.max_prompt_length}: expected < max_length={cfg.max_length} (room for the response)")
    if cfg.n_epochs is None and cfg.n_examples is None:
        p.append("n_epochs=null, n_examples=null: expected one of them set: how long the run goes on")
    elif cfg.n_epochs is not None and cfg.n_examples is not None:
        p.append(f"n_epochs={cfg.n_epochs}, n_examples={cfg.n_examples}: expected exactly one of them set; to train on "
                 f"n_examples={cfg.n_examples} pairs add n_epochs=null (n_epochs defaults to 1)")
    if cfg.eval_every > 0 and cfg.batch_size > 0 and cfg.eval_every % cfg.batch_size:
        p.append(f"eval_every={cfg.eval_every}: expected a multiple of batch_size={cfg.batch_size} (evaluation happens between steps)")
    if cfg.batch_size > 0 and cfg.gradient_accumulation_steps > 0 and cfg.batch_size % (cfg.gradient_accumulation_steps * ws):
        p.append(f"batch_size={cfg.batch_size}: expected divisible by gradient_accumulation_steps={cfg.gradient_accumulation_steps}"
                 f" x {ranks}={ws}")
    if cfg.eval_batch_size > 0 and cfg.eval_batch_size % ws:
        p.append(f"eval_batch_size={cfg.eval_batch_size}: expected divisible by {ranks}={ws}")
    if cfg.max_tokens_per_microbatch is not None and cfg.gradient_accumulation_steps != 1:
        p.append(f"max_tokens_per_microbatch={cfg.max_tokens_per_microbatch} and gradient_accumulation_steps="
                 f"{cfg.gradient_accumulation_steps}: the token budget decides the micro-batches; leave accumulation at 1")
    if cfg.model.reference_mixed_precision and cfg.fsdp.mixed_precision is None:
        p.append("model.reference_mixed_precision=true: there is no mixed precision to give the reference"
                 " (fsdp.mixed_precision / model.fsdp_policy_mp is null)")
    mp = cfg.fsdp.mixed_precision
    for key, value in (("fsdp.model_dtype", cfg.fsdp.model_dtype), ("fsdp.mixed_precision.param_dtype", mp and mp.get("param_dtype", cfg.fsdp.dtype))):
        if value and DTYPES.get(value) == "float16" and not cfg.fsdp.forward_only:
            p.append(f"{key}={value}: fp16 training needs a gradient scaler, which is not supported yet; use bf16 (the same memory, fp32's range)")
    if cfg.no_sync_accumulation and cfg.trainer != "FSDPTrainer":
        p.append(f"no_sync_accumulation=true: only FSDPTrainer reduces gradients across ranks (trainer={cfg.trainer})")
    if cfg.fused_optimizer and cfg.optimizer != "AdamW":
        p.append(f"fused_optimizer=true: only AdamW has a fused kernel here (optimizer={cfg.optimizer})")
    if not cfg.datasets or not all(isinstance(d, str) for d in cfg.datasets):
        p.append(f"datasets={cfg.datasets!r}: expected at least one dataset name or path (strings)")
    if not cfg.local_dirs:
        p.append("local_dirs=[]: expected at least one directory")
    if fs == 0 or fs < -1:
        p.append(f"fsdp.fsdp_size={fs}: expected -1 (all ranks) or a positive number")
    elif world_size and fs > 0 and world_size % fs:
        p.append(f"fsdp.fsdp_size={fs}: expected a divisor of the world size {world_size}")
    if not isinstance(sp, int) or isinstance(sp, bool) or sp < 1:
        p.append(f"fsdp.ulysses_sequence_parallel_size={sp!r}: expected a positive integer (1 = off)")
    elif sp > 1 and cfg.trainer != "FSDPTrainer":
        p.append(f"fsdp.ulysses_sequence_parallel_size={sp}: sequence parallelism splits sequences over ranks; it needs"
                 f" trainer=FSDPTrainer (trainer={cfg.trainer} runs one process)")
    elif sp > 1 and world_size and world_size % sp:
        p.append(f"fsdp.ulysses_sequence_parallel_size={sp}: expected a divisor of the world size {world_size}")
    mnp = cfg.fsdp.wrap_policy.get("min_num_params")
    if mnp is not None and (not isinstance(mnp, int) or isinstance(mnp, bool) or mnp < 0):
        p.append(f"fsdp.wrap_policy.min_num_params={mnp!r}: expected a non-negative integer")
    return p


def _loss_problems(cfg: Config, world_size: Optional[int]) -> list[str]:
    """Loss names and weights; what the selected losses need of the batch, the reference and the data; LoRA adapters
    and TR-DPO reference updates."""
    p, loss, names, lo, tau = [], cfg.loss, cfg.loss_names, cfg.lora, cfg.ref_update.tau
    ws, ranks = data_parallel_size(cfg, world_size)
    if not names or not all(isinstance(n, str) for n in names):
        p.append(f"loss.name={loss.name!r}: expected a loss name or a list of names")
    for n in (n for n in names if isinstance(n, str) and n not in _single_losses()):
        hint = f"; {n} is a preset of several losses: loss={n}" if (CONFIG_DIR / "loss" / f"{n}.yaml").exists() else _suggest(n, _single_losses())
        p.append(f"loss.name={n!r}: unknown loss; expected one of {', '.join(_single_losses())}" + hint)
    if loss.weights is not None and len(loss.weights) != len(names):
        p.append(f"loss.weights={loss.weights}: expected one weight per loss name ({len(names)})")
    elif loss.weights is not None and not all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in loss.weights):
        p.append(f"loss.weights={loss.weights}: expected numbers")
    batch_level, unpaired = [n for n in names if _flag(n, "batch_statistics")], [n for n in names if _flag(n, "unpaired")]
    split = [f"gradient_accumulation_steps={cfg.gradient_accumulation_steps}"] * (cfg.gradient_accumulation_steps > 1)
    split += [f"max_tokens_per_microbatch={cfg.max_tokens_per_microbatch}"] * (cfg.max_tokens_per_microbatch is not None)
    split += [f"{ranks} {ws}"] * (ws > 1)
    if batch_level and split:
        p.append(f"loss.name={loss.name!r}: {', '.join(batch_level)} {'uses' if len(batch_level) == 1 else 'use'} statistics of the whole"
                 f" batch (a sort or a mean over its pairs), so {' and '.join(split)} would change the loss by splitting the step;"
                 " run them with one micro-batch per step on one process")
    if unpaired and len(names) > 1:
        p.append(f"loss.name={loss.name!r}: {unpaired[0]} scores labelled completions, not pairs; it cannot be summed with other losses")
    if not unpaired and cfg.pairs_to_unpaired:
        p.append(f"pairs_to_unpaired=true: only unpaired losses (kto) read it; loss.name is {loss.name!r}")
    p += [f"{key}={cfg[key]}: {unpaired[0]} estimates its KL reference point from each completion paired with the next one's "
          f"prompt in a rank's batch, so it needs >= 2 per rank ({ranks} {ws})" for key in ("batch_size", "eval_batch_size")
          if unpaired and cfg[key] // ws < 2]
    if unpaired and cfg.precompute_ref_log_probs:
        p.append(f"precompute_ref_log_probs=true: not supported with loss {unpaired[0]} (its KL reference point needs the"
                 " reference on mismatched prompt/completion pairs of each batch)")
    if lo.r is not None and lo.r < 1:
        p.append(f"lora.r={lo.r}: expected a positive rank, or null (no adapters)")
    if lo.r is not None and not lo.target_modules:
        p.append(f"lora.target_modules={lo.target_modules!r}: expected module names or 'all-linear'")
    if lo.r is not None and cfg.trainer == "FSDPTrainer" and cfg.fsdp.strategy == "fsdp" and not cfg.fsdp.use_orig_params:
        p.append("lora.r with fsdp.strategy=fsdp: FSDP1 flattens frozen base weights and trainable adapters into one "
                 "parameter, so it needs fsdp.use_orig_params=true (or use fsdp.strategy=fsdp2)")
    if lo.r is not None and tau is not None:
        p.append(f"lora.r={lo.r} and ref_update.tau={tau}: the LoRA reference is the base model with the adapters off,"
                 " which TR-DPO cannot move; use one of them")
    if tau is not None and (loss.reference_free or not any(_flag(n, "needs_reference") for n in names)):
        p.append(f"ref_update.tau={tau}: the selected loss {loss.name!r} runs no reference model"
                 + " (loss.reference_free=true)" * loss.reference_free + ", so there is nothing to update")
    if tau is not None and cfg.precompute_ref_log_probs:
        p.append(f"ref_update.tau={tau} and precompute_ref_log_probs=true: precomputed reference log-probs are of the "
                 "initial reference, but TR-DPO changes the reference during training; set one of them off")
    return p


def load_config(argv: Optional[list[str]] = None, world_size: Optional[int] = None) -> tuple[Config, set[str]]:
    """Compose, type-check, resolve aliases and validate. Returns (config, flags). Raises ConfigError."""
    values, explicit, flags = compose(sys.argv[1:] if argv is None else argv)
    problems: list[str] = []
    _resolve_aliases(values, explicit, problems)
    bs, every = values["batch_size"], values["eval_every"]
    if "eval_every" not in explicit and isinstance(bs, int) and isinstance(every, int) and bs > 0:
        # The default (the original's 20000) adapts to the batch size: evaluation happens between steps, and the
        # original's `example_counter % eval_every` never fired when batch_size did not divide it.
        values["eval_every"] = max(bs, every // bs * bs)
    cfg = _build(Config, values, "", problems)
    if problems:  # types must be right before the cross-field rules can read them
        raise ConfigError(problems)
    if world_size is None and os.environ.get("WORLD_SIZE"):
        world_size = int(os.environ["WORLD_SIZE"])
    problems = validate(cfg, world_size) + unread_loss_keys(cfg, explicit)
    # Knobs set that this run would silently ignore: LoRA's without lora.r, ref_update.alpha without a tau, an fsdp.*
    # key typed on the command line that this trainer or strategy does not have.
    problems += [f"lora.{k}={cfg.lora[k]!r}: read only with lora.r set (null: full fine-tuning, no adapters)"
                 for k in ("alpha", "dropout", "target_modules") if explicit.get(f"lora.{k}") and cfg.lora.r is None
                 and cfg.lora[k] != LoraSettings()[k]]
    if explicit.get("ref_update.alpha") and cfg.ref_update.tau is None:
        problems.append(f"ref_update.alpha={cfg.ref_update.alpha}: read only with ref_update.tau set (null: the reference never changes)")
    typed = [k for k in FSDPEngineConfig() if explicit.get(f"fsdp.{k}") == 2 and cfg.fsdp[k] != FSDPEngineConfig()[k]]
    if cfg.trainer == "BasicTrainer":
        problems += [f"fsdp.{k}={cfg.fsdp[k]!r}: only applies to trainer=FSDPTrainer (this run uses BasicTrainer)"
                     for k in typed if k in FSDP_ONLY]
    else:
        problems += [f"fsdp.{k}={cfg.fsdp[k]!r}: only applies to fsdp.strategy={s} (this run uses {cfg.fsdp.strategy})"
                     for k, s in STRATEGY_ONLY.items() if k in typed and s != cfg.fsdp.strategy]
    if problems:
        raise ConfigError(problems)
    if cfg.exp_name is None:
        cfg = dataclasses.replace(cfg, exp_name=f"{'+'.join(cfg.loss_names)}_{Path(cfg.model.name_or_path).name}")
    return cfg, flags


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=None)


def help_text() -> str:
    """Every key with its type, default and one-line doc, grouped by config class; then the flags and exit codes."""
    lines = ["usage: python -u train.py [group=choice ...] [key=value ...] [--cfg | --estimate [gpu=NAME]]",
             "       python -u train.py --replay <run dir> [--cfg]", "", "groups:",
             *(f"  {g}=  one of: {', '.join(_group_choices(g))}" for g in GROUPS), "", "keys (key: type = default  # doc):"]
    sections: dict[str, list[str]] = {}
    for key, (t, default, doc) in schema().items():
        sections.setdefault(key.rpartition(".")[0] or "Config", []).append(f"  {key}: {_type_name(t)} = {default!r}  # {doc}")
    for head, rows in sections.items():
        lines += [f"  [{head}]", *rows]
    return "\n".join(lines + [
        "", "values are YAML: datasets=[hh,shp] lr=1e-6 n_epochs=null; --key=value means key=value", "", "flags:",
        "  --cfg                  every check the run makes before it loads a model (config, data, model.archive, the",
        "                         checkpoint of resume_from), then print the resolved config as YAML and exit",
        "  --estimate [gpu=NAME]  memory per rank and FLOPs per step from the model's config.json alone (no weights);",
        "                         gpu=H200|H100|A100|A100-40GB|L40S|A10 adds the time per step and whether it fits",
        "  --replay <run dir>     run a recorded run again into a new directory, then compare every logged metric",
        "  --help, -h             this text", "",
        "exit codes: 0 done; 2 bad input (config, data, archive, checkpoint: refused before anything is loaded or",
        "  written); 3 more than max_nonfinite_steps non-finite steps in a row (a checkpoint was written); 130 / 143",
        "  stopped by SIGINT / SIGTERM after a step, with a checkpoint and the command that resumes"])
