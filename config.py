"""Typed configuration and the YAML loader that replaces Hydra. Layers, later ones winning: the dataclass defaults;
config/<group>/<choice>.yaml (`model=pythia28 loss=dpo`; config/config.yaml picks the defaults); `key=value`
overrides in YAML (`--key=value` too, as W&B sweeps pass it). The frozen `Config` reads like a dict, as the original
DictConfig did; all problems are raised at once, as one ConfigError. losses.py (and torch) loads on first need, so
`--help` answers at once."""

import collections.abc
import contextlib
import copy
import dataclasses
import difflib
import functools
import os
import re
import sys
import traceback
import types
import typing
from pathlib import Path
from typing import Any, Optional, Union

import yaml

CONFIG_DIR = Path(__file__).resolve().parent / "config"
GROUPS = ("model", "loss")  # `model=X` picks config/model/X.yaml, `loss=X` picks config/loss/X.yaml
REQUIRED = "???"  # a YAML value that the user must override (as in Hydra/OmegaConf)
POSITIVE, NON_NEGATIVE = "(0, inf)", "[0, inf)"  # the commonest `allowed` intervals


def param(default: Any, doc: str, allowed: Any = None) -> Any:
    """A dataclass field with its one-line doc (shown by `--help`) and the non-null values it allows: a tuple of
    choices; an interval as text, "(0, inf)" or "[0, 0.5)" (round bracket = open end); or (test, what is expected)."""
    metadata = {"doc": doc, "allowed": allowed}
    if isinstance(default, (BaseConfig, list, dict)):  # a fresh copy for each instance
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class BaseConfig(collections.abc.Mapping):
    """A frozen dataclass that reads like a dict (verl's BaseConfig): `cfg.key`, `cfg["key"]`, `cfg.get(key)`,
    iteration. A changed copy is `dataclasses.replace(cfg, key=value)`."""

    def __getitem__(self, key: str) -> Any:
        if key not in list(self):
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self):
        return (f.name for f in dataclasses.fields(self))

    def __len__(self) -> int:
        return len(dataclasses.fields(self))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# spelling -> torch name: fp32 -> float32, float32 -> float32, bf16 -> bfloat16, ...
DTYPES = {
    s: name for short, name in (("fp32", "float32"), ("bf16", "bfloat16"), ("fp16", "float16")) for s in (short, name)
}
DTYPE = (lambda v: v in tuple(DTYPES), f"a dtype, one of {', '.join(DTYPES)}")


def dtype_of(name: str):
    """'bf16' / 'bfloat16' / 'fp32' / ... -> the torch dtype (torch imported on first use: --help needs none)."""
    import torch

    return getattr(torch, DTYPES[name])


RANKS = (lambda v: v == -1 or v > 0, "-1 (all ranks) or a positive number")  # fsdp.fsdp_size
SP_SIZE = (lambda v: v >= 1, "a positive integer (1 = off)")  # fsdp.ulysses_sequence_parallel_size
DATASETS = (lambda v: v and all(isinstance(d, str) for d in v), "at least one dataset name or path (strings)")


@dataclasses.dataclass(frozen=True)
class EngineConfig(BaseConfig):
    """Fields every training engine shares (verl's EngineConfig)."""

    param_offload: bool = param(False, "keep parameters on CPU, moved to the device only for forward/backward")
    optimizer_offload: bool = param(False, "keep optimizer state on CPU between optimizer steps")
    seed: Optional[int] = param(None, "verl's engine seed: fsdp.seed=N sets `seed`, the same knob (this stays null)")
    full_determinism: bool = param(False, "torch.use_deterministic_algorithms: slower, for debugging")
    dtype: str = param("bfloat16", "mixed precision's compute dtype if fsdp.mixed_precision sets no param_dtype", DTYPE)
    forward_only: bool = param(False, "run no optimizer: load, evaluate (and sample) once, then exit")


@dataclasses.dataclass(frozen=True)
class FSDPEngineConfig(EngineConfig):
    """The FSDP engine: verl's FSDPEngineConfig, every field live or refused; RENAMED maps the original's keys to it."""

    wrap_policy: dict = param({}, "{transformer_layer_cls_to_wrap: [names]} or {min_num_params: N}; {} = each block")
    offload_policy: bool = param(False, "FSDP2 CPUOffloadPolicy (params, grads and optimizer step on CPU)")
    reshard_after_forward: bool = param(True, "free gathered params after forward (FULL_SHARD); false: after backward")
    fsdp_size: int = param(-1, "ranks per shard group: -1 = all; 1 < it < world = hybrid (replicate x shard)", RANKS)
    forward_prefetch: bool = param(False, "issue the next block's all-gather before the current forward finishes")
    model_dtype: str = param("fp32", "dtype of the master weights (the original's model.policy_dtype)", DTYPE)
    use_orig_params: bool = param(False, "FSDP1: keep the original nn.Parameters (for per-parameter optimizer groups)")
    mixed_precision: Optional[dict] = param(
        None,
        "{param_dtype, reduce_dtype, buffer_dtype}, or one dtype for param_dtype; param_dtype defaults to fsdp.dtype, "
        "the others to fp32; null = compute in model_dtype (the original's model.fsdp_policy_mp)",
    )
    ulysses_sequence_parallel_size: int = param(
        1, "Ulysses: ranks that split each sequence (FSDPTrainer; divides world size and heads); 1 = off", SP_SIZE
    )
    entropy_from_logits_with_chunking: bool = param(False, "the entropy bonus in row chunks (the logged one always is)")
    use_torch_compile: Optional[bool] = param(None, "torch.compile the entropy bonus's kernel; null = only on CUDA")
    entropy_checkpointing: bool = param(False, "recompute the entropy bonus in backward instead of storing it")
    strategy: str = param("fsdp", "fsdp (FSDP1, FullyShardedDataParallel) or fsdp2 (fully_shard)", ("fsdp", "fsdp2"))

    def mixed_precision_dtypes(self) -> Optional[dict[str, str]]:
        """mixed_precision with its defaults, as verl's: param_dtype (compute) `dtype`, reduce_dtype and buffer_dtype
        fp32 (bf16 gradient sums lose bits, bf16 rotary tables shift every angle); None: no mixed precision."""
        mp = self.mixed_precision
        return None if mp is None else {"param_dtype": self.dtype, "reduce_dtype": "fp32", "buffer_dtype": "fp32", **mp}


@dataclasses.dataclass(frozen=True)
class WandbConfig(BaseConfig):
    enabled: bool = param(True, "log to Weights & Biases (online with an API key, else offline)")
    entity: Optional[str] = param(None, "W&B entity (team or user); null = your default")
    project: str = param("direct-preference-optimization", "W&B project")


@dataclasses.dataclass(frozen=True)
class ModelConfig(BaseConfig):
    name_or_path: str = param("toy/tiny-llama", "Hugging Face hub id or local directory of the policy")
    tokenizer_name_or_path: Optional[str] = param(None, "tokenizer hub id or directory; null = name_or_path")
    archive: Optional[str] = param(None, "policy.pt of an earlier run (e.g. SFT) loaded into policy and reference")
    reference_dtype: Optional[str] = param(None, "null = the policy's (but fp16 overflows bf16-native models)", DTYPE)
    reference_mixed_precision: Optional[bool] = param(
        None, "compute the reference under fsdp.mixed_precision; null = as the policy does; false = in reference_dtype"
    )
    chat_template: Optional[str] = param(
        None, "template of chat-form data: chatml, or a Jinja file; null = the tokenizer's (which it replaces)"
    )
    trust_remote_code: bool = param(False, "allow model repositories to run their own Python code (security risk)")


@dataclasses.dataclass(frozen=True)
class LossConfig(BaseConfig):
    """The loss and its hyperparameters: a loss function reads `loss.<key>` by naming it as a keyword-only parameter."""

    name: Union[str, list] = param(
        "sft",
        "loss name, or a list of names whose losses are summed with `weights`",
        (lambda v: isinstance(v, str) or v and all(isinstance(n, str) for n in v), "a loss name or a list of names"),
    )
    weights: Optional[list] = param(
        None, "one weight per loss name; null = all 1.0", (lambda v: all(type(w) in (int, float) for w in v), "numbers")
    )
    reference_free: bool = param(False, "a uniform reference (reference log-probs 0); no reference model is built")
    average_log_prob: Optional[bool] = param(None, "per-token mean, not sum, of sequence log-probs; null = the loss's")
    entropy_coeff: float = param(0.0, "entropy bonus: loss - entropy_coeff * mean policy entropy (0 = logged only)")
    # null: the released MoE configs (Mixtral, Qwen3-MoE, OLMoE, gpt-oss) set output_router_logits false, so
    # transformers and TRL add none either; DPO's few small steps need no pretraining-sized push toward uniform load
    router_aux_loss: Optional[Union[float, str]] = param(
        None,
        "MoE: weight of Switch's load-balancing loss, per sequence over its real tokens (logged as router_aux_loss); "
        "null = logged only, model = the model config's router_aux_loss_coef",
        (lambda v: v == "model" or not isinstance(v, str) and v >= 0, "model or a number >= 0"),
    )
    beta: float = param(0.1, "temperature of the implicit reward (DPO beta); 0.1-0.5 typical", POSITIVE)
    label_smoothing: float = param(
        0.0, "flipped-label fraction assumed: cDPO with dpo (as the original); robust DPO's, EXO's epsilon", "[0, 0.5)"
    )
    gamma: float = param(1.0, "SimPO target reward margin gamma")
    rpo_alpha: float = param(1.0, "RPO weight of the chosen NLL term")
    orpo_lambda: float = param(0.1, "ORPO weight of the odds-ratio term")
    f_divergence: str = param(
        "reverse_kl", "f-DPO divergence", ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
    )
    f_alpha: float = param(
        0.5, "f-DPO alpha_divergence's: 0 -> reverse KL, 1 forward; TRL 1.x's f_alpha_divergence_coef: 1 - it", "(0, 1]"
    )
    discopop_tau: float = param(0.05, "DiscoPOP temperature of the log-ratio modulation", POSITIVE)
    desirable_weight: float = param(1.0, "KTO lambda_D; keep lambda_D n_D / (lambda_U n_U) in [1, 4/3]", POSITIVE)
    undesirable_weight: float = param(1.0, "KTO lambda_U, weight of undesirable completions", POSITIVE)
    # Modifiers of every paired loss (losses.compute_loss)
    wpo: bool = param(
        False,
        "WPO (arXiv:2406.11827): weigh each pair by the policy's length-normalized probability of both responses, "
        "aligned to its own sampling, clamped at 1 and detached",
    )
    ld_alpha: float = param(
        1.0,
        "LD-DPO (arXiv:2409.06411): weight of the tokens past the pair's shorter response, policy and reference "
        "alike; 1 = off, 0.2-0.8 typical",
        "[0, 1]",
    )
    dynamic_beta: float = param(
        0.0,
        "beta-DPO (arXiv:2407.08639): alpha in beta (1 + alpha (batch margin - running mean)); 0 = off, 0.2-1 typical",
        NON_NEGATIVE,
    )
    dynamic_beta_filter: float = param(
        0.0,
        "beta-DPO's filter: the fraction of each batch's pairs left out, drawn by how far their margin lies from the "
        "running mean; 0 = none, 0.2 in the paper",
        "[0, 1)",
    )
    dpop_lambda: float = param(
        0.0,
        "DPOP (arXiv:2402.13228): penalty lambda * max(0, log ref(y_w) - log pi(y_w)) inside the chosen log-ratio; "
        "0 = off, 50 in the paper",
        NON_NEGATIVE,
    )


@dataclasses.dataclass(frozen=True)
class RefUpdateConfig(BaseConfig):
    """TR-DPO (arXiv:2404.09656): every `tau` optimizer steps, ref <- alpha * policy + (1 - alpha) * ref."""

    tau: Optional[int] = param(None, "optimizer steps between reference updates; null = frozen (plain DPO)", POSITIVE)
    alpha: float = param(0.6, "the policy's weight in the update: 0.6 = TR-DPO's soft update, 1 = hard", "(0, 1]")


@dataclasses.dataclass(frozen=True)
class LoraSettings(BaseConfig):
    """LoRA adapters (optional: pip install peft); the reference is the base model with them disabled, not a copy."""

    r: Optional[int] = param(
        None, "LoRA rank; null = full fine-tuning", (lambda v: v >= 1, "a positive rank, or null (no adapters)")
    )
    alpha: float = param(16.0, "LoRA scaling numerator: the update is (alpha / r) * B A", POSITIVE)
    dropout: float = param(0.0, "dropout on the adapters' input (0 keeps training deterministic)", "[0, 1)")
    target_modules: Union[str, list] = param(
        "all-linear", "names, or all-linear (peft: each linear but the LM head)", (bool, "module names or 'all-linear'")
    )


@dataclasses.dataclass(frozen=True)
class OnlineConfig(BaseConfig):
    """Semi-online DPO (online.py): rounds of sampling the policy, scoring, pairing best with worst, training a pass."""

    rounds: Optional[int] = param(None, "sample-score-pair-train rounds; null = offline DPO on the data", POSITIVE)
    prompts_per_round: int = param(64, "prompts per round, next in order (cycling); each one pair at most", POSITIVE)
    samples_per_prompt: int = param(
        4, "completions sampled per prompt; the best and the worst make its pair", (lambda v: v >= 2, "at least 2")
    )
    scorer: str = param(
        "rule",
        "rule (the toy's own), reward_model (a sequence classifier) or python (score(prompts, completions) -> floats)",
        (
            lambda v: bool(re.fullmatch(r"(?s)rule|reward_model=.+|python=[^:]+:[^:]+", v)),
            "rule, reward_model=<directory> or python=<module>:<function>",
        ),
    )
    prompts: Optional[str] = param(
        None, "a .jsonl of {prompt: ...} rows (text or chat messages); null = the datasets' .jsonl train prompts"
    )
    min_score_gap: float = param(0.0, "keep a pair whose best score beats its worst by more (ties never)", NON_NEGATIVE)
    unfinished_penalty: float = param(1.0, "subtracted from the score of a completion without EOS", NON_NEGATIVE)
    max_new_tokens: int = param(64, "tokens sampled per completion (+ max_prompt_length <= max_length)", POSITIVE)
    temperature: float = param(1.0, "sampling temperature of the rounds", POSITIVE)
    top_p: float = param(1.0, "nucleus sampling threshold of the rounds", "(0, 1]")
    prompts_per_generate: int = param(
        8,
        "prompts per generate call, each seeded apart (same samples at any world size); more: faster, more memory",
        POSITIVE,
    )


@dataclasses.dataclass(frozen=True)
class Config(BaseConfig):
    seed: int = param(0, "random seed: data order, initialization of anything random, sampling")
    exp_name: Optional[str] = param(None, "name of the run (directory and W&B); null = '<loss>_<model>'")
    batch_size: int = param(4, "pairs per optimizer step, over all ranks and accumulation steps", POSITIVE)
    eval_batch_size: int = param(16, "pairs per evaluation step, over all ranks", POSITIVE)
    debug: bool = param(False, "debug mode: no W&B and no checkpoints")
    fsdp_port: Optional[int] = param(None, "rendezvous port of the single-node FSDP launcher; null = a free port")
    datasets: list = param(["toy"], "names, files, folders, Hub ids; NAME:N, NAME:F take N or F (sources.py)", DATASETS)
    wandb: WandbConfig = param(WandbConfig(), "Weights & Biases")
    local_dirs: list = param(
        [".cache"], "dirs for caches and runs: the first that exists or can be made", (bool, "at least one directory")
    )
    sample_during_eval: bool = param(True, "generate samples from policy and reference at each evaluation")
    n_eval_model_samples: int = param(16, "prompts sampled at each evaluation", NON_NEGATIVE)
    do_first_eval: bool = param(True, "evaluate before the first training step")
    lr: float = param(5e-7, "peak learning rate (DPO paper: 1e-6 at batch 64; the original config: 5e-7)", POSITIVE)
    gradient_accumulation_steps: int = param(1, "micro-batches per optimizer step", POSITIVE)
    max_grad_norm: float = param(10.0, "clip the gradient norm to this (logged before: grad_norm)", POSITIVE)
    max_length: int = param(512, "max tokens of prompt + response", POSITIVE)
    max_prompt_length: int = param(256, "max tokens of the prompt (truncated first)", POSITIVE)
    truncation_mode: Optional[str] = param(None, "null = each source's own (hh: keep_end)", ("keep_start", "keep_end"))
    drop_identical_pairs: bool = param(True, "drop pairs with chosen = rejected (as text or truncated); always counted")
    n_epochs: Optional[int] = param(1, "epochs over the training pairs (exactly one of n_epochs, n_examples)", POSITIVE)
    n_examples: Optional[int] = param(None, "train on this many pairs (exactly one of n_epochs, n_examples)", POSITIVE)
    n_eval_examples: int = param(256, "held-out pairs evaluated (the fixed first ones of the test split)", POSITIVE)
    trainer: str = param(
        "BasicTrainer", "one process, or FSDPTrainer: sharded, one process per device", ("BasicTrainer", "FSDPTrainer")
    )
    optimizer: str = param("RMSprop", "RMSprop (the original's choice), AdamW or SGD", ("RMSprop", "AdamW", "SGD"))
    weight_decay: float = param(0.0, "weight decay of AdamW (decoupled) and SGD", NON_NEGATIVE)
    scheduler: str = param(
        "constant", "after warmup: constant (the original's), linear or cosine to 0", ("constant", "linear", "cosine")
    )
    warmup_steps: int = param(150, "linear warmup, in optimizer steps", NON_NEGATIVE)
    activation_checkpointing: bool = param(False, "recompute each transformer block in backward (NO_REENTRANT)")
    eval_every: int = param(20_000, "evaluate and checkpoint every this many pairs, a multiple of batch_size", POSITIVE)
    log_every_steps: int = param(1, "metrics.jsonl and W&B records every this many steps (never by time)", POSITIVE)
    minimum_log_interval_secs: float = param(
        30.0,
        "without a terminal, a progress line at most this often (the original timed W&B with it: now log_every_steps)",
        NON_NEGATIVE,
    )
    max_new_tokens: int = param(64, "tokens generated per sample during evaluation", POSITIVE)
    temperature: float = param(1.0, "sampling temperature during evaluation", POSITIVE)
    top_p: float = param(1.0, "nucleus sampling threshold during evaluation", "(0, 1]")
    resume_from: Optional[str] = param(None, "run directory to resume from (its LATEST checkpoint), continuing exactly")
    run_dir: Optional[str] = param(None, "where this run writes; null = <local_dir>/runs/<exp_name>_<timestamp>")
    padding_free: bool = param(False, "pack a micro-batch's chosen and rejected sequences into rows, no padding")
    prefix_sharing: bool = param(
        False, "each pair one sequence, prompt + chosen + rejected: the prompt computed once, the same log-probs"
    )
    pairs_to_unpaired: bool = param(False, "kto on pairs: chosen desirable, rejected undesirable; eval keeps pairs")
    tiled_lm_head: bool = param(True, "LM head on scored positions only, in tiles (FSDP: in the root's forward)")
    precompute_ref_log_probs: bool = param(False, "compute the reference's log-probs of all data first, then free it")
    self_check: bool = param(
        True,
        "before the first optimizer step, check on a few of the run's pairs that the tiled head, packed or shared rows "
        "and the reference give the plain path's log-probs (self_check.py); a failure stops the run with exit code 4",
    )
    max_tokens_per_microbatch: Optional[int] = param(
        None, "micro-batches of up to this many real tokens (replaces gradient_accumulation_steps)", POSITIVE
    )
    balance_batch: bool = param(
        True, "each step, equal pair counts of near-equal tokens per rank; false: consecutive shares (the original)"
    )
    no_sync_accumulation: bool = param(
        False, "FSDP: reduce-scatter gradients once per step, not per micro-batch (less traffic; unsharded grads held)"
    )
    fused_optimizer: bool = param(False, "AdamW's fused kernel (one kernel for all parameters; fastest on GPU)")
    peak_tflops: Optional[float] = param(
        None, "device's dense bf16 peak, TFLOP/s, for the logged mfu; null = from known GPUs, else no mfu", POSITIVE
    )
    max_nonfinite_steps: int = param(3, "skip non-finite steps; more than this many in a row stop a run", NON_NEGATIVE)
    collective_timeout_secs: int = param(600, "a collective waiting longer raises (a dead rank ends the job)", POSITIVE)
    n_workers: Optional[int] = param(None, "FSDPTrainer's processes (no torchrun); null: 1 per GPU, 2 on CPU", POSITIVE)
    model: ModelConfig = param(ModelConfig(), "the policy model")
    loss: LossConfig = param(LossConfig(), "the loss and its hyperparameters")
    ref_update: RefUpdateConfig = param(RefUpdateConfig(), "TR-DPO: move the reference toward the policy as it trains")
    lora: LoraSettings = param(LoraSettings(), "LoRA adapters (peft) instead of full fine-tuning")
    fsdp: FSDPEngineConfig = param(FSDPEngineConfig(), "the FSDP engine")
    online: OnlineConfig = param(OnlineConfig(), "semi-online DPO: pairs sampled from the policy and scored, in rounds")

    @property
    def reference_mixed(self) -> bool:
        """Whether the reference computes under fsdp.mixed_precision: model.reference_mixed_precision, and when null
        whenever the policy does (then both compute alike, and policy = reference gives exactly ln 2 at step 0)."""
        chosen = self.model.reference_mixed_precision
        return self.fsdp.mixed_precision is not None if chosen is None else chosen

    @property
    def loss_names(self) -> list:
        return [self.loss.name] if isinstance(self.loss.name, str) else list(self.loss.name)

    @property
    def unpaired_loss(self) -> bool:
        """True when a selected loss scores labelled completions (kto) instead of pairs."""
        return any(_flag(n, "unpaired") for n in self.loss_names)

    @property
    def trains_on_pairs(self) -> bool:
        """False when the selected losses score one completion per prompt: sft alone, or an unpaired loss (kto)."""
        return not self.unpaired_loss and set(self.loss_names) != {"sft"}


class ConfigError(ValueError):
    """All problems of one configuration, each a line naming the key, the bad value and what was expected."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        n = len(problems)
        super().__init__(
            f"{n} configuration problem{'s' if n > 1 else ''}:\n" + "\n".join(f"  - {p}" for p in self.problems)
        )


# --- The schema: dotted keys with their types, defaults, docs and allowed values, read off the dataclasses ---
def _leaves(cls=Config, prefix: str = ""):
    """(dotted key, dataclasses.Field, type hint) of every leaf field: ('loss.beta', <Field>, float), ..."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if isinstance(hints[f.name], type) and issubclass(hints[f.name], BaseConfig):
            yield from _leaves(hints[f.name], prefix + f.name + ".")
        else:
            yield prefix + f.name, f, hints[f.name]


def schema() -> dict[str, tuple]:
    """{dotted key: (type hint, default, doc)} for every leaf field, e.g. 'loss.beta'."""
    return {
        key: (t, f.default_factory() if callable(f.default_factory) else f.default, f.metadata["doc"])
        for key, f, t in _leaves()
    }


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
    if not cfg.loss.entropy_coeff:  # the logged entropy comes from the log-prob kernel's tiles (never compiled)
        for k in ("use_torch_compile", "entropy_checkpointing"):  # chunked, it is: entropy_from_logits_with_chunking
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


def flatten(tree: dict, prefix: str = "", keys: Optional[dict] = None) -> dict:
    """Nested dict -> {dotted: value}; dict-valued leaf fields (wrap_policy, mixed_precision) stay whole."""
    keys = schema() if keys is None else keys
    out = {}
    for k, v in tree.items():
        nested = isinstance(v, dict) and prefix + k not in keys
        out.update(flatten(v, prefix + k + ".", keys) if nested else {prefix + k: v})
    return out


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
            hint = f"; {n} is a preset of several losses: loss={n}" if preset else _suggest(n, known)
            problems.append(f"loss.name={n!r}: unknown loss; expected one of {', '.join(known)}" + hint)
    if any(_flag(n, "batch_statistics") for n in c.loss_names) or c.loss.dynamic_beta > 0:
        problems += _batch_statistics_rules(c, ws, ranks)
    if c.unpaired_loss or c.pairs_to_unpaired:
        problems += _unpaired_rules(c, ws, ranks)
    if c.loss.wpo or c.loss.ld_alpha != 1 or c.loss.dpop_lambda or c.loss.dynamic_beta or c.loss.dynamic_beta_filter:
        problems += _modifier_rules(c)
    if c.precompute_ref_log_probs:
        problems += _per_token_reference_rule(c)
    if c.prefix_sharing:
        problems += _prefix_sharing_rules(c)
    if c.fsdp.ulysses_sequence_parallel_size > 1:
        problems += _ulysses_rules(c, world)
    if c.lora.r is not None:
        problems += _lora_rules(c)
    if c.ref_update.tau is not None:
        problems += _ref_update_rules(c)
    if c.online.rounds is not None:
        problems += _online_rules(c)
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


def _per_token_reference_rule(c: Config) -> list[str]:
    """The precomputed reference table holds sums: refused for whatever reads each token's reference log-prob (LD-DPO,
    or a token-level loss: losses.logps_needed says which, so such a loss is written in losses.py alone)."""
    import losses  # loss_registry() has imported it

    if not losses.logps_needed(c.loss)["per_token"]:
        return []
    ld = c.loss.ld_alpha != 1
    what = f"loss.name={c.loss.name!r} reads the reference's log-prob of each token"
    what = "LD-DPO weighs the reference's tokens too" if ld else what
    return [
        f"{f'loss.ld_alpha={c.loss.ld_alpha} and ' * ld}precompute_ref_log_probs=true: {what}, and the "
        "precomputed table holds sums only; set one of them off"
    ]


def _modifier_rules(c: Config) -> list[str]:
    """The modifiers of paired losses: WPO, LD-DPO, DPOP, beta-DPO."""
    loss = c.loss
    compares = any(_flag(n, "needs_reference") for n in c.loss_names)  # a selected loss compares with a reference
    keeps = round(c.batch_size * (1 - loss.dynamic_beta_filter))
    problems = [
        f"loss.{key}={loss[key]}: a modifier of paired losses; loss.name={loss.name!r} scores one completion per prompt"
        for key, on in (
            ("wpo", loss.wpo),
            ("ld_alpha", loss.ld_alpha != 1),
            ("dpop_lambda", loss.dpop_lambda > 0),
            ("dynamic_beta", loss.dynamic_beta > 0),
        )
        if on and not c.trains_on_pairs
    ]
    if loss.dynamic_beta > 0 and not any("beta" in loss_registry().get(n, {}).get("reads", ()) for n in c.loss_names):
        problems.append(
            f"loss.dynamic_beta={loss.dynamic_beta}: beta-DPO scales loss.beta, which no selected loss reads "
            f"(loss.name={loss.name!r})"
        )
    if loss.dynamic_beta_filter > 0 and not loss.dynamic_beta:
        problems.append(
            f"loss.dynamic_beta_filter={loss.dynamic_beta_filter}: read only with loss.dynamic_beta > 0 (beta-DPO)"
        )
    if loss.dynamic_beta_filter > 0 and c.batch_size > 0 and keeps == c.batch_size:
        problems.append(
            f"loss.dynamic_beta_filter={loss.dynamic_beta_filter}: keeps round({c.batch_size} x (1 - "
            f"{loss.dynamic_beta_filter})) = all {c.batch_size} pairs of a step (batch_size={c.batch_size}); expected "
            "a fraction that leaves at least one out"
        )
    if loss.ld_alpha != 1 and not compares:
        problems.append(
            f"loss.ld_alpha={loss.ld_alpha}: LD-DPO weighs the log-probs of losses that compare "
            f"with a reference, and loss.name={loss.name!r} has none"
        )
    if loss.dpop_lambda > 0 and (loss.reference_free or not compares):
        problems.append(
            f"loss.dpop_lambda={loss.dpop_lambda}: DPOP penalizes "
            f"the chosen log-prob falling below the reference's, and loss.name={loss.name!r} runs no reference"
        )
    return problems


def _prefix_sharing_rules(c: Config) -> list[str]:
    sp = c.fsdp.ulysses_sequence_parallel_size
    problems = []
    if not c.trains_on_pairs:
        problems.append(
            f"prefix_sharing=true: loss.name={c.loss.name!r} scores one completion per "
            "prompt, not a pair sharing it; set prefix_sharing=false"
        )
    if sp > 1:
        problems.append(f"prefix_sharing=true with fsdp.ulysses_sequence_parallel_size={sp}: not supported yet")
    return problems


def _ulysses_rules(c: Config, world: int) -> list[str]:
    sp = c.fsdp.ulysses_sequence_parallel_size
    if c.trainer != "FSDPTrainer":
        return [
            f"fsdp.ulysses_sequence_parallel_size={sp}: sequence parallelism splits sequences over "
            f"ranks; it needs trainer=FSDPTrainer (trainer={c.trainer} runs one process)"
        ]
    if world % sp:
        return [f"fsdp.ulysses_sequence_parallel_size={sp}: expected a divisor of the world size {world}"]
    return []


def _lora_rules(c: Config) -> list[str]:
    problems = []
    if c.trainer == "FSDPTrainer" and c.fsdp.strategy == "fsdp" and not c.fsdp.use_orig_params:
        problems.append(
            "lora.r with fsdp.strategy=fsdp: FSDP1 flattens frozen base weights and trainable adapters into one "
            "parameter, so it needs fsdp.use_orig_params=true (or use fsdp.strategy=fsdp2)"
        )
    if c.ref_update.tau is not None:
        problems.append(
            f"lora.r={c.lora.r} and ref_update.tau={c.ref_update.tau}: the LoRA reference is the base model with the "
            "adapters off, which TR-DPO cannot move; use one of them"
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


def _online_rules(c: Config) -> list[str]:
    """Semi-online DPO (online.rounds)."""
    o = c.online
    problems = []
    if not c.trains_on_pairs:
        problems.append(
            f"online.rounds={o.rounds}: the rounds make pairs, and loss.name="
            f"{c.loss.name!r} does not train on pairs; use a paired loss (loss=dpo)"
        )
    if c.precompute_ref_log_probs:
        problems.append(
            f"online.rounds={o.rounds} and precompute_ref_log_probs=true: the rounds' "
            "pairs do not exist before training; set precompute_ref_log_probs=false"
        )
    if o.prompts_per_round < c.batch_size:
        problems.append(
            f"online.prompts_per_round={o.prompts_per_round}: fewer than "
            f"batch_size={c.batch_size}, so a round (at most one pair per prompt) cannot fill one step"
        )
    if o.max_new_tokens + c.max_prompt_length > c.max_length:
        problems.append(
            f"online.max_new_tokens={o.max_new_tokens} + "
            f"max_prompt_length={c.max_prompt_length} > max_length={c.max_length}: sampled pairs would be cut in "
            "training (and lose their EOS); lower one or raise max_length"
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
            "",
            "flags: --cfg                  run every check that needs no weights, print the resolved config as "
            "YAML, exit",
            "       --estimate [gpu=NAME]  memory per rank and FLOPs per step from config.json alone (gpu=: time, fit)",
            "       --replay <run dir>     run a recorded run again into a new directory, compare every logged metric",
            "",
            "exit codes: 0 done; 2 bad input (refused before anything is loaded or written); 3 more than "
            "max_nonfinite_steps",
            "  non-finite steps in a row (checkpoint written); 4 a self-check failed before the first optimizer",
            "  step (nothing trained; run_dir/self_check.json); 130 / 143 SIGINT / SIGTERM: stopped after a step,",
            "  checkpoint written, resume command printed",
        ]
    )
