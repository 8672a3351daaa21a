"""Pre-flight estimate: memory per rank and FLOPs per step from the config and the model's config.json alone.

    python -u train.py <args> --estimate             # memory per rank, FLOPs per step
    python -u train.py <args> --estimate gpu=H100    # and time per step at an assumed MFU, and whether it fits

No weights are read and torch is not imported (a second, not a minute): only json, math and config.json.
The geometry is the worst case of the config: every sequence as long as max_length (padding-free packs the
same tokens, so its bound is the same, plus its rows' boolean mask). Memory is counted in phases, and the peak
is the largest phase:

  static     weights (+ an online reference) + optimizer state, sharded by FSDP over fsdp_size ranks
  backward   the saved activations of the whole micro-batch (all blocks; with checkpointing, each block's input
             plus one block recomputed) + the logits or LM-head tiles + the FSDP-gathered units; gradients
             appear as activations are freed, so the phase takes the larger end (start: activations, end: grads).
             Start: + the LM head's backward workspace (tiled: the weight's fp32 gradient accumulator) or, in the
             reference forward, the online reference's gathered root unit (embeddings, final norm, head); end: +
             FSDP2's root reduce-scatter (unsharded root gradients + reduce-dtype buffer). With several micro-batches
             the earlier ones' gradients are held: each rank's shard, or (no_sync_accumulation) the whole model's
             unsharded gradients. fsdp.reshard_after_forward=false keeps the whole policy gathered until backward.
  optimizer  gradients + one parameter-sized temporary of the foreach update (sqrt of the second moment)
  reference  precompute_ref_log_probs: policy and reference weights while the reference pass runs (then freed)

Activations per token per block (a Llama-style block in the compute dtype; counted from what autograd saves):
norms 2 x 2h, q/k/v after rotary a*d + 2 kv*d, attention output and its contiguous copy 2 a*d, MLP 4 i (gate,
up, act(gate), act*up); the attention itself runs in a fused kernel (no T x T scores). GPT-2 / GPT-NeoX blocks:
norms 2 x 2h, qkv 3h, attention out 2h, MLP 2 i (fc out, gelu out).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import config

GiB = 2 ** 30
CHUNK_ROWS = 1024  # losses.DEFAULT_CHUNK_SIZE: rows of one LM-head / entropy tile
HEAD_TILE_BYTES = 128 * 2**20  # losses.HEAD_TILE_BYTES: the tiled head's fp32 tiles shrink to this at large vocabularies

# name: (dense bf16 tensor peak TFLOP/s, fp32 peak TFLOP/s (no TF32), memory GiB); vendor datasheets
DEVICES = {
    "H200": (989.0, 67.0, 141),
    "H100": (989.0, 67.0, 80),
    "A100": (312.0, 19.5, 80),
    "A100-40GB": (312.0, 19.5, 40),
    "L40S": (362.0, 91.6, 48),
    "A10": (125.0, 31.2, 24),
}
ASSUMED_MFU = 0.4  # a well-tuned FSDP run of a 1-10B model; the logged throughput/mfu tells the truth afterwards
USABLE = 0.9       # of device memory: the CUDA context, the allocator's fragmentation and NCCL buffers take the rest
STATES = {"AdamW": 2, "RMSprop": 1, "SGD": 0}  # optimizer state tensors per parameter (SGD without momentum)
DTYPE_BYTES = {"float32": 4, "fp32": 4, "float": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
               "float64": 8, "fp64": 8}


class EstimateError(ValueError):
    """A config.json the estimator cannot read, or a device it does not know."""


@dataclass
class Geometry:
    """What the estimate needs of config.json."""
    family: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    block_params: int
    embed_params: int   # input embeddings (+ learned positions)
    head_params: int    # LM head (0 when tied) + final norm

    @property
    def params(self) -> int:
        return self.embed_params + self.layers * self.block_params + self.head_params


LLAMA_LIKE = {"llama", "mistral", "qwen2", "qwen3"}


def geometry(config: dict) -> Geometry:
    """Parameter counts per part, from config.json (Llama-style, GPT-2, GPT-NeoX); raises EstimateError otherwise."""
    family = config.get("model_type")
    get = lambda *names, default=None: next((config[n] for n in names if config.get(n) is not None), default)
    h = get("hidden_size", "n_embd", "d_model")
    layers, heads = get("num_hidden_layers", "n_layer"), get("num_attention_heads", "n_head")
    vocab = get("vocab_size")
    if family not in LLAMA_LIKE | {"gpt2", "gpt_neox"} or None in (h, layers, heads, vocab):
        raise EstimateError(f"config.json model_type={family!r}: the estimator knows {sorted(LLAMA_LIKE | {'gpt2', 'gpt_neox'})} "
                            "(hidden_size, num_hidden_layers, num_attention_heads, vocab_size); add the family to estimate.geometry")
    kv = get("num_key_value_heads", default=heads)
    d = get("head_dim", default=h // heads)
    if family in LLAMA_LIKE:
        i = config["intermediate_size"]
        qkv_bias = config.get("attention_bias", family == "qwen2")
        o_bias = config.get("attention_bias", False)
        mlp_bias = 2 * i + h if config.get("mlp_bias") else 0  # gate, up, down
        block = (h * heads * d + 2 * h * kv * d + heads * d * h + 3 * h * i + 2 * h + mlp_bias
                 + ((heads + 2 * kv) * d if qkv_bias else 0) + (h if o_bias else 0) + (2 * d if family == "qwen3" else 0))
        tied = config.get("tie_word_embeddings", False)
        embed, head = vocab * h, h + (0 if tied else vocab * h)
    else:
        i = get("n_inner", default=4 * h) if family == "gpt2" else config["intermediate_size"]
        block = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * i + i) + (i * h + h)  # 2 norms, qkv, out, MLP
        tied = config.get("tie_word_embeddings", family == "gpt2")
        positions = config.get("n_positions", 0) * h if family == "gpt2" else 0
        embed, head = vocab * h + positions, 2 * h + (0 if tied else vocab * h)
    return Geometry(family, h, layers, heads, kv, d, i, vocab, tied, block, embed, head)


def dtype_bytes(name, key: str) -> int:
    """Bytes per element of the dtype `name`, which the config key `key` gave."""
    if str(name).replace("torch.", "") not in DTYPE_BYTES:
        raise EstimateError(f"{key}={name!r}: expected a dtype, one of {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[str(name).replace("torch.", "")]


def activations_per_token(g: Geometry) -> int:
    """Elements autograd saves per token in one block (see the file docstring)."""
    if g.family in LLAMA_LIKE:
        return 4 * g.hidden + 3 * g.heads * g.head_dim + 2 * g.kv_heads * g.head_dim + 4 * g.intermediate
    return 4 * g.hidden + 3 * g.hidden + 2 * g.hidden + 2 * g.intermediate


def estimate(cfg, config: dict, world_size: int) -> dict:
    """{name: bytes or count} per rank for one optimizer step of `cfg` on the model of `config`."""
    g = geometry(config)
    fsdp = cfg.trainer == "FSDPTrainer"
    shard = (cfg.fsdp.fsdp_size if 1 <= cfg.fsdp.fsdp_size < world_size else world_size) if fsdp else 1
    mp = cfg.fsdp.mixed_precision or {}
    w = dtype_bytes(cfg.fsdp.model_dtype, "fsdp.model_dtype")                # master weights, grads, optimizer state
    c = dtype_bytes(mp.get("param_dtype", cfg.fsdp.dtype), "fsdp.mixed_precision.param_dtype") if mp else w  # compute
    r = dtype_bytes(mp.get("reduce_dtype", "fp32"), "fsdp.mixed_precision.reduce_dtype") if mp else w  # FSDP reductions
    ref_w = dtype_bytes(cfg.model.reference_dtype or cfg.fsdp.model_dtype, "model.reference_dtype")  # null: policy's
    ref_mp = cfg.model.reference_mixed_precision
    ref_c = c if (bool(mp) if ref_mp is None else ref_mp) else ref_w  # null: mixed precision whenever the policy's
    ref_online = _needs_reference(cfg) and not cfg.precompute_ref_log_probs
    pairs = 1 if _sft(cfg) else 2
    sp = cfg.fsdp.ulysses_sequence_parallel_size if fsdp else 1  # a group of sp ranks shares its pairs
    budget = cfg.max_tokens_per_microbatch
    micro = cfg.batch_size // (world_size // sp) // (1 if budget else cfg.gradient_accumulation_steps)
    tokens = min(micro * pairs * cfg.max_length, budget or 2**62)  # a token budget: the sequences that fit it
    rows = -(-tokens // cfg.max_length)  # whole rows of max_length tokens (padded or packed)
    tokens = -(-tokens // sp)  # Ulysses: each rank holds 1/sp of every row's positions
    several = cfg.gradient_accumulation_steps > 1 or bool(budget)  # micro-batches per step (a budget can split)
    P, root = g.params, g.embed_params + g.head_params  # FSDP's root unit: embeddings, final norm, LM head
    out = {"parameters": P, "parameters per rank": P / shard, "micro-batch tokens": tokens}
    out["weights"] = P * w / shard
    out["reference weights"] = P * ref_w / shard if ref_online else 0
    out["optimizer state"] = STATES[cfg.optimizer] * P * w / shard
    out["gradients"] = P * w / shard

    per_block = activations_per_token(g) * tokens * c
    if cfg.activation_checkpointing:  # each block keeps its input; backward recomputes one block at a time
        out["activations"] = g.layers * g.hidden * tokens * c + per_block
    else:
        out["activations"] = g.layers * per_block
    out["activations"] += 2 * g.hidden * tokens * c  # final norm
    if cfg.padding_free:  # the packed rows' boolean (R, 1, T, T) mask, whole rows on every rank (Ulysses too)
        out["activations"] += rows * cfg.max_length ** 2
    chunk_rows = min(tokens, CHUNK_ROWS)
    tiled = cfg.tiled_lm_head and not cfg.loss.entropy_coeff  # under FSDP too (forward_logps is the root's forward)
    head_backward = 0
    if tiled:  # the logged entropy and the log-probs: a few (chunk, V) fp32 tiles at a time, never (tokens, V)
        out["logits"] = 4 * min(chunk_rows, max(1, HEAD_TILE_BYTES // (4 * g.vocab))) * g.vocab * 4
        # backward: the weight's (V, H) fp32 gradient accumulator + a (V, H) tile product / final cast unless fp32
        head_backward = g.vocab * g.hidden * (4 + (c if c != 4 else 0))
    else:  # the logits kept for backward, beside them the fp32 softmax work of the logged entropy (forward) or
        entropy_rows = chunk_rows if cfg.fsdp.entropy_from_logits_with_chunking else tokens  # their gradient (backward)
        out["logits"] = tokens * g.vocab * c + max(3 * entropy_rows * g.vocab * 4, tokens * g.vocab * c)
    units = 2 if cfg.fsdp.forward_prefetch else 1  # FSDP units gathered at a time (the next one prefetched)
    gathered = ref_root = root_reduce = ref_gathered = 0
    if fsdp:  # one block gathered (two with prefetch), its unsharded gradient in backward, and the root unit
        gathered = (units + 1) * g.block_params * c + root * c * (1 - 1 / shard)
        if not cfg.fsdp.reshard_after_forward:  # every unit stays gathered from its forward to its backward
            gathered = P * c + g.block_params * c
        ref_root = root * ref_c if ref_online else 0  # the reference reshards after its forward, whatever the knob
        ref_gathered = (units * g.block_params + root) * ref_c
        root_reduce = root * (c + r) if cfg.fsdp.strategy == "fsdp2" else 0  # unsharded root grads + reduce buffer
    out.update({"FSDP gathered": gathered, "reference root": ref_root, "root reduce-scatter": root_reduce,
                "LM-head backward": head_backward})
    # held from a step's earlier micro-batches through the later ones: each rank's gradients (FSDP: its shard), or
    # with no_sync_accumulation the whole model's unsharded gradients (FSDP2: in reduce_dtype, FSDP1: param_dtype)
    unsynced = P * (r if cfg.fsdp.strategy == "fsdp2" else c) if fsdp and cfg.no_sync_accumulation and several else 0
    out["accumulated gradients"] = held = unsynced or (out["gradients"] if several else 0)

    static = out["weights"] + out["reference weights"] + out["optimizer state"]
    one_block = per_block  # a block's activations (the first block, or the one being recomputed)
    # gradients are None between steps (zero_grad(set_to_none=True)): backward allocates them as it frees
    # activations, so the phase peaks at its start (activations + head) or at its end (gradients + one block);
    # a later micro-batch starts with the gradients held
    start = held + out["activations"] + out["logits"] + max(head_backward, ref_root)
    backward = max(start, unsynced + out["gradients"] + one_block + root_reduce) + gathered
    optimizer = out["gradients"] + (P * w / shard if STATES[cfg.optimizer] else 0)  # foreach sqrt(second moment)
    reference = (P * ref_w / shard + one_block + ref_gathered
                 if _needs_reference(cfg) and cfg.precompute_ref_log_probs else 0)
    out["phases"] = {"backward": static + backward, "optimizer step": static + optimizer,
                     "reference pass": out["weights"] + reference}
    out["peak"] = max(out["phases"].values())

    # FLOPs: 6 N per trained token (forward 2N, backward 4N), 2 N more with checkpointing (a second forward),
    # 2 N per token through an online reference; N = parameters outside the input embedding (as trainers.flops_params).
    n = P - g.embed_params + (g.vocab * g.hidden if g.tied else 0)
    step_tokens = cfg.batch_size * pairs * cfg.max_length
    out["model FLOPs per step"] = (6 * n + (2 * n if ref_online else 0)) * step_tokens
    out["executed FLOPs per step"] = out["model FLOPs per step"] + (2 * n * step_tokens if cfg.activation_checkpointing else 0)
    out["compute bytes"] = c
    return out


def _sft(cfg) -> bool:
    return set(cfg.loss_names) == {"sft"}  # as losses.is_sft_only


def _needs_reference(cfg) -> bool:
    """As losses.needs_reference, from the registry config.py reads without importing torch (one declaration:
    each LossSpec's needs_reference); tests/test_estimate.py checks the two agree for every registered loss."""
    registry = config.loss_registry()
    return not cfg.loss.reference_free and any(registry[name]["needs_reference"] for name in cfg.loss_names)


def world_size_of(cfg) -> int:
    if cfg.trainer != "FSDPTrainer":
        return 1
    return int(os.environ.get("WORLD_SIZE", 0)) or cfg.n_workers or 2


def report(cfg, model_dir: str, gpu: str | None = None) -> str:
    """The table `train.py --estimate` prints."""
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).exists():  # a hub id: its config.json alone, from the local cache or the hub
        from huggingface_hub import hf_hub_download
        try:
            path = Path(hf_hub_download(model_dir, "config.json"))
        except Exception as e:  # noqa: BLE001 - offline, unknown repository, gated: all say the same to the user
            raise EstimateError(f"model.name_or_path={model_dir}: --estimate reads only its config.json, which is not in "
                                f"the local Hugging Face cache and could not be downloaded ({type(e).__name__}); fetch it"
                                f" alone with `hf download {model_dir} config.json` where the hub is reachable, or set "
                                "model.name_or_path to a local directory that holds it") from None
    if not path.is_file():
        raise EstimateError(f"--estimate reads the model's config.json: {path} does not exist")
    try:
        config = json.loads(path.read_text())
    except ValueError as e:
        raise EstimateError(f"{path}: not JSON ({e})") from None
    if gpu is not None and gpu not in DEVICES:
        raise EstimateError(f"--estimate gpu={gpu}: unknown device; expected one of {', '.join(DEVICES)}")
    world = world_size_of(cfg)
    e = estimate(cfg, config, world)
    hint = " (set n_workers=N for another world size)" if cfg.trainer == "FSDPTrainer" and not cfg.n_workers else ""
    unit, size = ("GiB", GiB) if e["peak"] >= 4 * GiB else ("MiB", 2 ** 20)
    gb = lambda b: f"{b / size:10.1f} {unit}"
    lines = [f"estimate for {cfg.trainer} x {world} rank(s), {config.get('model_type')} with {e['parameters'] / 1e6:.2f}M "
             f"parameters ({e['parameters per rank'] / 1e6:.2f}M per rank); micro-batch {e['micro-batch tokens']} tokens "
             f"(every sequence at max_length={cfg.max_length}); no weights read{hint}",
             "memory per rank:"]
    for name in ("weights", "reference weights", "gradients", "accumulated gradients", "optimizer state", "activations",
                 "logits", "FSDP gathered"):
        lines.append(f"  {name:<22} {gb(e[name])}")
    for name, b in e["phases"].items():
        lines.append(f"  phase {name:<16} {gb(b)}")
    lines.append(f"  peak                   {gb(e['peak'])}")
    lines.append(f"FLOPs per step: model {e['model FLOPs per step']:.3e}, executed {e['executed FLOPs per step']:.3e} "
                 f"(all ranks; {e['executed FLOPs per step'] / world:.3e} per rank)")
    if gpu is not None:
        bf16, fp32, mem = DEVICES[gpu]
        peak = (bf16 if e["compute bytes"] == 2 else fp32) * 1e12
        seconds = e["executed FLOPs per step"] / world / (peak * ASSUMED_MFU)
        fits = e["peak"] <= USABLE * mem * GiB
        lines.append(f"on {gpu} ({peak / 1e12:.0f} TFLOP/s {'bf16' if e['compute bytes'] == 2 else 'fp32'} peak, {mem} GiB): "
                     f"time per step {seconds:.3f} s at MFU {ASSUMED_MFU}; peak {e['peak'] / GiB:.2f} GiB of "
                     f"{USABLE * mem:.0f} GiB usable: {'fits' if fits else 'DOES NOT FIT'}")
    return "\n".join(lines)
