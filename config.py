"""Every key of a run: typed dataclasses, each field with its default, its one-line doc (`--help` shows it) and the
values it allows. The frozen `Config` reads like a dict, as the original DictConfig did. config_loader.py composes
them from YAML files and the command line and checks them; this file holds the fields and nothing else."""

import collections.abc
import copy
import dataclasses
import re
import typing
from typing import Any, Optional, Union


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
        if key not in self.__dataclass_fields__:
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
SCORER = (  # online.scorer, eval_scorer: the scorers of scorers.py
    lambda v: bool(re.fullmatch(r"(?s)rule|reward_model=.+|python=[^:]+:[^:]+", v)),
    "rule, reward_model=<directory> or python=<module>:<function>",
)


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
    ulysses_sequence_parallel_size: int = param(1, "Ulysses: ranks splitting each sequence; 1 = off", SP_SIZE)
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
    reference_mixed_precision: Optional[bool] = param(None, "null: as the policy computes; false: in reference_dtype")
    chat_template: Optional[str] = param(None, "chat rows' template: chatml or a Jinja file; null = the tokenizer's")
    trust_remote_code: bool = param(False, "allow model repositories to run their own Python code (security risk)")
    quantization: Optional[str] = param(
        None,
        "QLoRA: the frozen base in 4 bits (nf4, fp4) or 8 (int8) through bitsandbytes, computing in the model's dtype; "
        "needs lora.r; the reference is the base with the adapters off",
        ("nf4", "fp4", "int8"),
    )


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
    label_smoothing: float = param(0.0, "assumed flipped-label share: cDPO (loss=cdpo), robust DPO, EXO", "[0, 0.5)")
    gamma: float = param(1.0, "SimPO target reward margin gamma")
    orpo_lambda: float = param(0.1, "ORPO weight of the odds-ratio term")
    f_divergence: str = param("reverse_kl", "f-DPO", ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"))
    f_alpha: float = param(0.5, "f-DPO alpha: 0 reverse KL, 1 forward (TRL: 1 - f_alpha_divergence_coef)", "(0, 1]")
    discopop_tau: float = param(0.05, "DiscoPOP temperature of the log-ratio modulation", POSITIVE)
    desirable_weight: float = param(1.0, "KTO lambda_D; keep lambda_D n_D / (lambda_U n_U) in [1, 4/3]", POSITIVE)
    undesirable_weight: float = param(1.0, "KTO lambda_U, weight of undesirable completions", POSITIVE)
    # Modifiers of every paired loss (losses.compute_loss)
    wpo: bool = param(False, "WPO (arXiv:2406.11827): pairs weighted by the policy's probability of them")
    ld_alpha: float = param(1.0, "LD-DPO (arXiv:2409.06411): weight of tokens past the shorter response", "[0, 1]")
    dynamic_beta: float = param(0.0, "beta-DPO (arXiv:2407.08639) alpha; 0 = off, 0.2-1 typical", NON_NEGATIVE)
    dynamic_beta_filter: float = param(0.0, "beta-DPO: share of pairs left out by margin; 0.2 in the paper", "[0, 1)")
    dpop_lambda: float = param(0.0, "DPOP (arXiv:2402.13228) penalty weight; 0 = off, 50 in the paper", NON_NEGATIVE)


@dataclasses.dataclass(frozen=True)
class RefUpdateConfig(BaseConfig):
    """TR-DPO (arXiv:2404.09656): every `tau` optimizer steps, ref <- alpha * policy + (1 - alpha) * ref."""

    tau: Optional[int] = param(None, "optimizer steps between reference updates; null = frozen (plain DPO)", POSITIVE)
    alpha: float = param(0.6, "the policy's weight in the update: 0.6 = TR-DPO's soft update, 1 = hard", "(0, 1]")


@dataclasses.dataclass(frozen=True)
class LoraSettings(BaseConfig):
    """LoRA adapters (optional: pip install peft); the reference is the base model with them disabled, not a copy."""

    r: Optional[int] = param(None, "LoRA rank; null = full fine-tuning", (lambda v: v >= 1, "a positive rank or null"))
    alpha: float = param(16.0, "LoRA scaling numerator: the update is (alpha / r) * B A", POSITIVE)
    dropout: float = param(0.0, "dropout on the adapters' input (0 keeps training deterministic)", "[0, 1)")
    target_modules: Union[str, list] = param("all-linear", "names, or all-linear (no LM head)", (bool, "names"))


@dataclasses.dataclass(frozen=True)
class OnlineConfig(BaseConfig):
    """Semi-online DPO (online.py): rounds of sampling the policy, scoring, pairing, training on the round's pairs."""

    rounds: Optional[int] = param(None, "sample-score-pair-train rounds; null = offline DPO on the data", POSITIVE)
    prompts_per_round: int = param(64, "prompts per round, next in order (cycling); each one pair at most", POSITIVE)
    samples_per_prompt: int = param(4, "completions sampled per prompt (best_worst: at least 2; spin: 1)", POSITIVE)
    pairing: str = param(
        "best_worst",
        "how a prompt's samples become its pair: best_worst (best over worst by more than min_score_gap), spin (the "
        "data's target over the policy's sample) or python (pair(prompts, targets, samples, scores) -> pairs)",
        (
            lambda v: bool(re.fullmatch(r"best_worst|spin|python=[^:]+:[^:]+", v)),
            "best_worst, spin or python=<module>:<function>",
        ),
    )
    scorer: str = param("rule", "rule (the toy's), reward_model=<dir> or python=<module>:<function>", SCORER)
    prompts: Optional[str] = param(None, "a .jsonl of {prompt: ...} rows; null = the datasets' train prompts")
    min_score_gap: float = param(0.0, "best_worst: a pair's best must beat its worst by more", NON_NEGATIVE)
    unfinished_penalty: float = param(1.0, "subtracted from the score of a completion without EOS", NON_NEGATIVE)
    max_new_tokens: int = param(64, "tokens sampled per completion (+ max_prompt_length <= max_length)", POSITIVE)
    temperature: float = param(1.0, "sampling temperature of the rounds", POSITIVE)
    top_p: float = param(1.0, "nucleus sampling threshold of the rounds", "(0, 1]")
    prompts_per_generate: int = param(8, "prompts per generate call, each seeded apart; more: faster", POSITIVE)


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
    local_dirs: list = param([".cache"], "dirs for caches and runs: the first usable", (bool, "a directory"))
    sample_during_eval: bool = param(True, "generate samples from policy and reference at each evaluation")
    n_eval_model_samples: int = param(16, "prompts sampled at each evaluation", NON_NEGATIVE)
    eval_scorer: Optional[str] = param(None, "score eval samples: win rate, KL (scored_eval.py); null = off", SCORER)
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
    trainer: str = param("BasicTrainer", "one process, or FSDPTrainer: one per device", ("BasicTrainer", "FSDPTrainer"))
    optimizer: str = param("RMSprop", "RMSprop (the original's choice), AdamW or SGD", ("RMSprop", "AdamW", "SGD"))
    weight_decay: float = param(0.0, "weight decay of AdamW (decoupled) and SGD", NON_NEGATIVE)
    scheduler: str = param("constant", "after warmup; linear, cosine: to 0", ("constant", "linear", "cosine"))
    warmup_steps: int = param(150, "linear warmup, in optimizer steps", NON_NEGATIVE)
    activation_checkpointing: bool = param(False, "recompute each transformer block in backward (NO_REENTRANT)")
    eval_every: int = param(20_000, "evaluate and checkpoint every this many pairs, a multiple of batch_size", POSITIVE)
    log_every_steps: int = param(1, "metrics.jsonl and W&B records every this many steps (never by time)", POSITIVE)
    minimum_log_interval_secs: float = param(30.0, "no terminal: seconds between progress lines", NON_NEGATIVE)
    max_new_tokens: int = param(64, "tokens generated per sample during evaluation", POSITIVE)
    temperature: float = param(1.0, "sampling temperature during evaluation", POSITIVE)
    top_p: float = param(1.0, "nucleus sampling threshold during evaluation", "(0, 1]")
    resume_from: Optional[str] = param(None, "run directory to resume from (its LATEST checkpoint), continuing exactly")
    run_dir: Optional[str] = param(None, "where this run writes; null = <local_dir>/runs/<exp_name>_<timestamp>")
    padding_free: bool = param(False, "pack a micro-batch's chosen and rejected sequences into rows, no padding")
    prefix_sharing: bool = param(False, "each pair one sequence, prompt + chosen + rejected: the prompt once")
    pairs_to_unpaired: bool = param(False, "kto on pairs: chosen desirable, rejected undesirable; eval keeps pairs")
    tiled_lm_head: bool = param(False, "the LM head on scored positions only, in tiles (tiled_head.py)")
    precompute_ref_log_probs: bool = param(False, "compute the reference's log-probs of all data first, then free it")
    self_check: bool = param(True, "check the run's own log-prob paths before the first step (exit 4)")
    max_tokens_per_microbatch: Optional[int] = param(None, "micro-batches of this many real tokens", POSITIVE)
    balance_batch: bool = param(True, "FSDP: equal pairs of near-equal tokens per rank; false: as the original")
    no_sync_accumulation: bool = param(False, "FSDP: reduce-scatter gradients once per step, not per micro-batch")
    fused_optimizer: bool = param(False, "AdamW's fused kernel (one kernel for all parameters; fastest on GPU)")
    peak_tflops: Optional[float] = param(None, "dense bf16 peak TFLOP/s for mfu; null = known GPUs", POSITIVE)
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
    def loss_specs(self) -> list:
        """The registry entries (losses.LossSpec) of the selected losses that exist."""
        import losses  # torch: loaded on first need, so that `--help` answers at once

        return [losses.LOSSES[n] for n in self.loss_names if n in losses.LOSSES]

    @property
    def unpaired_loss(self) -> bool:
        """True when a selected loss scores labelled completions (kto) instead of pairs."""
        return any(spec.unpaired for spec in self.loss_specs)

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


# --- Views of the fields: dotted keys with their types, defaults and docs ---
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


def flatten(tree: dict, prefix: str = "", keys: Optional[dict] = None) -> dict:
    """Nested dict -> {dotted: value}; dict-valued leaf fields (wrap_policy, mixed_precision) stay whole."""
    keys = schema() if keys is None else keys
    out = {}
    for k, v in tree.items():
        nested = isinstance(v, dict) and prefix + k not in keys
        out.update(flatten(v, prefix + k + ".", keys) if nested else {prefix + k: v})
    return out
