"""Pre-flight estimate: memory per rank and FLOPs per step from the config and the model's config.json alone.

    python -u train.py <args> --estimate             # memory per rank, FLOPs per step
    python -u train.py <args> --estimate gpu=H100    # and time per step at an assumed MFU, and whether it fits

No weights, tokenizer or data are read, so it answers before a run would load anything, for the worst case
(every sequence max_length long). The peak is the largest phase, each on top of the weights (+ an online
reference) and optimizer state, sharded over fsdp_size ranks:
  backward   activations, logits or head tiles, FSDP-gathered units, and the larger of its start (earlier micro-
             batches' gradients; the head's workspace or an online reference's root) and its end (gradients, which
             appear as activations are freed, + one block + FSDP2's root reduce-scatter)
  optimizer  gradients + one parameter-sized temporary of the foreach update (sqrt of the second moment)
  reference  precompute_ref_log_probs: policy and reference weights while the reference pass runs (then freed)
"""
from __future__ import annotations

import json
from collections import namedtuple
from pathlib import Path

import config
import losses
from logps import DEFAULT_CHUNK_SIZE, head_tile_rows

GiB = 2 ** 30
# name: (dense bf16 tensor peak TFLOP/s, fp32 peak TFLOP/s (no TF32), memory GiB); vendor datasheets
DEVICES = {"H200": (989.0, 67.0, 141), "H100": (989.0, 67.0, 80), "A100": (312.0, 19.5, 80),
           "A100-40GB": (312.0, 19.5, 40), "L40S": (362.0, 91.6, 48), "A10": (125.0, 31.2, 24)}
ASSUMED_MFU = 0.4  # a well-tuned FSDP run of a 1-10B model; the logged throughput/mfu tells the truth afterwards
USABLE = 0.9       # of device memory: the CUDA context, the allocator's fragmentation and NCCL buffers take the rest
STATES = {"AdamW": 2, "RMSprop": 1, "SGD": 0}  # optimizer state tensors per parameter (SGD without momentum)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # by torch name, as config.DTYPES maps each spelling
LLAMA_LIKE = {"llama", "mistral", "qwen2", "qwen3"}
FAMILIES = sorted(LLAMA_LIKE | {"gpt2", "gpt_neox"})
Geometry = namedtuple("Geometry", "hidden layers vocab tied block_params embed_params head_params saved_per_token params")


class EstimateError(ValueError):
    """A config.json the estimator cannot read, or a device it does not know."""


def geometry(config: dict) -> Geometry:
    """Parameter counts per part and the elements autograd saves per token in one block, from config.json of a
    family in FAMILIES; raises EstimateError otherwise."""
    family = config.get("model_type")
    get = lambda *names, default=None: next((config[n] for n in names if config.get(n) is not None), default)
    h, vocab = get("hidden_size", "n_embd", "d_model"), get("vocab_size")
    layers, heads = get("num_hidden_layers", "n_layer"), get("num_attention_heads", "n_head")
    if family not in FAMILIES or None in (h, layers, heads, vocab):
        raise EstimateError(f"config.json model_type={family!r}: the estimator knows {FAMILIES} (hidden_size, "
                            "num_hidden_layers, num_attention_heads, vocab_size); add the family to estimate.geometry")
    kv, d = get("num_key_value_heads", default=heads), get("head_dim", default=h // heads)
    if family in LLAMA_LIKE:
        i = config["intermediate_size"]
        qkv_bias, o_bias = config.get("attention_bias", family == "qwen2"), config.get("attention_bias", False)
        mlp_bias = 2 * i + h if config.get("mlp_bias") else 0  # gate, up, down
        block = (h * heads * d + 2 * h * kv * d + heads * d * h + 3 * h * i + 2 * h + mlp_bias
                 + ((heads + 2 * kv) * d if qkv_bias else 0) + (h if o_bias else 0) + (2 * d if family == "qwen3" else 0))
        tied, positions, norm = config.get("tie_word_embeddings", False), 0, h
        # norms 2 x 2h, q/k/v after rotary a*d + 2 kv*d, attention output and its contiguous copy 2 a*d, MLP 4 i
        # (gate, up, act(gate), act*up); attention runs in a fused kernel (no T x T scores)
        saved = 4 * h + 3 * heads * d + 2 * kv * d + 4 * i
    else:
        i = get("n_inner", default=4 * h) if family == "gpt2" else config["intermediate_size"]
        block = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * i + i) + (i * h + h)  # 2 norms, qkv, out, MLP
        tied = config.get("tie_word_embeddings", family == "gpt2")
        positions, norm = config.get("n_positions", 0) * h if family == "gpt2" else 0, 2 * h
        saved = 9 * h + 2 * i  # norms 2 x 2h, qkv 3h, attention out 2h, MLP 2 i (fc out, gelu out)
    embed, head = vocab * h + positions, norm + (0 if tied else vocab * h)  # final norm (+ bias), untied head
    return Geometry(h, layers, vocab, tied, block, embed, head, saved, params=embed + layers * block + head)


def _element_bytes(cfg) -> tuple[int, int, int, int, int]:
    """Bytes per element of: weights (grads, optimizer state), compute, reductions, reference weights, its compute
    (every spelling validated by config.py)."""
    mp, size = cfg.fsdp.mixed_precision or {}, lambda name: DTYPE_BYTES[config.DTYPES[name]]  # noqa: E731
    w = size(cfg.fsdp.model_dtype)
    c = size(mp.get("param_dtype", cfg.fsdp.dtype)) if mp else w
    r = size(mp.get("reduce_dtype", "fp32")) if mp else w
    ref_w = size(cfg.model.reference_dtype or cfg.fsdp.model_dtype)  # null: the policy's
    ref_mp = cfg.model.reference_mixed_precision  # null: mixed precision whenever the policy's
    return w, c, r, ref_w, c if (bool(mp) if ref_mp is None else ref_mp) else ref_w


def _activations(cfg, g: Geometry, tokens: int, rows: int, c: int) -> dict:
    """Per rank: saved activations, logits (or the tiled head's tiles), the head's backward workspace, one block's."""
    block = g.saved_per_token * tokens * c  # the first block's, or the one being recomputed
    # with checkpointing each block keeps only its input and backward recomputes one block at a time
    act = g.layers * g.hidden * tokens * c + block if cfg.activation_checkpointing else g.layers * block
    act += 2 * g.hidden * tokens * c  # final norm
    # the bool (R, 1, T, T) mask: padding-free's whole rows, or prefix sharing's rows of a pair of <= 2 max_length tokens
    act += tokens * 2 * cfg.max_length if cfg.prefix_sharing else rows * cfg.max_length ** 2 if cfg.padding_free else 0
    chunk_rows, head_backward = min(tokens, DEFAULT_CHUNK_SIZE), 0
    if cfg.tiled_lm_head and not cfg.loss.entropy_coeff:  # under FSDP too (forward_logps is the root's forward)
        # a few (chunk, V) fp32 tiles at a time, never (tokens, V); backward: the head weight's (V, H) fp32
        # gradient accumulator + a (V, H) tile product / final cast unless fp32
        logits = 4 * min(chunk_rows, head_tile_rows(g.vocab)) * g.vocab * 4
        head_backward = g.vocab * g.hidden * (4 + (c if c != 4 else 0))
    else:  # the logits kept for backward, beside them the fp32 softmax work of the logged entropy (forward) or
        entropy_rows = chunk_rows if cfg.fsdp.entropy_from_logits_with_chunking else tokens  # their gradient (backward)
        logits = tokens * g.vocab * c + max(3 * entropy_rows * g.vocab * 4, tokens * g.vocab * c)
    return {"activations": act, "logits": logits, "LM-head backward": head_backward, "block activations": block}


def estimate(cfg, config: dict, world_size: int) -> dict:
    """{name: bytes or count} per rank for one optimizer step of `cfg` on the model of `config`."""
    g = geometry(config)
    fsdp = cfg.trainer == "FSDPTrainer"
    shard = (cfg.fsdp.fsdp_size if 1 <= cfg.fsdp.fsdp_size < world_size else world_size) if fsdp else 1
    w, c, r, ref_w, ref_c = _element_bytes(cfg)
    needs_reference = losses.needs_reference(cfg.loss_names, cfg.loss.reference_free)
    ref_online = needs_reference and not cfg.precompute_ref_log_probs
    pairs = 1 if set(cfg.loss_names) == {"sft"} else 2  # sft alone: no rejected responses
    sp = cfg.fsdp.ulysses_sequence_parallel_size if fsdp else 1  # a group of sp ranks shares its pairs
    budget = cfg.max_tokens_per_microbatch
    micro = cfg.batch_size // (world_size // sp) // (1 if budget else cfg.gradient_accumulation_steps)
    tokens = min(micro * pairs * cfg.max_length, budget or 2**62)  # a token budget: the sequences that fit it
    rows = -(-tokens // cfg.max_length)  # whole rows of max_length tokens (padded or packed)
    tokens = -(-tokens // sp)  # Ulysses: each rank holds 1/sp of every row's positions
    several = cfg.gradient_accumulation_steps > 1 or bool(budget)  # micro-batches per step (a budget can split)
    P, root = g.params, g.embed_params + g.head_params  # FSDP's root unit: embeddings, final norm, LM head
    out = {"parameters": P, "parameters per rank": P / shard, "micro-batch tokens": tokens, "compute bytes": c,
           "weights": P * w / shard, "reference weights": P * ref_w / shard if ref_online else 0,
           "optimizer state": STATES[cfg.optimizer] * P * w / shard, "gradients": P * w / shard,
           **_activations(cfg, g, tokens, rows, c)}
    gathered = ref_root = root_reduce = ref_gathered = 0
    if fsdp:  # one block gathered (two with forward_prefetch), its unsharded gradient in backward, and the root unit
        units = 1 + cfg.fsdp.forward_prefetch
        gathered = ((units + 1) * g.block_params * c + root * c * (1 - 1 / shard) if cfg.fsdp.reshard_after_forward
                    else P * c + g.block_params * c)  # reshard_after_forward=false: every unit kept until its backward
        ref_root = root * ref_c if ref_online else 0  # the reference reshards after its forward, whatever the knob
        ref_gathered = (units * g.block_params + root) * ref_c
        root_reduce = root * (c + r) if cfg.fsdp.strategy == "fsdp2" else 0  # unsharded root grads + reduce buffer
    out.update({"FSDP gathered": gathered, "reference root": ref_root, "root reduce-scatter": root_reduce})
    # held from a step's earlier micro-batches through the later ones: each rank's gradients (FSDP: its shard), or
    # with no_sync_accumulation the whole model's unsharded gradients (FSDP2: in reduce_dtype, FSDP1: param_dtype)
    unsynced = P * (r if cfg.fsdp.strategy == "fsdp2" else c) if fsdp and cfg.no_sync_accumulation and several else 0
    out["accumulated gradients"] = held = unsynced or (out["gradients"] if several else 0)
    static = out["weights"] + out["reference weights"] + out["optimizer state"]
    # gradients are None between steps (zero_grad(set_to_none=True)): backward peaks at its start or its end
    start = held + out["activations"] + out["logits"] + max(out["LM-head backward"], ref_root)
    backward = max(start, unsynced + out["gradients"] + out["block activations"] + root_reduce) + gathered
    optimizer = out["gradients"] + (P * w / shard if STATES[cfg.optimizer] else 0)  # foreach sqrt(second moment)
    reference = (P * ref_w / shard + out["block activations"] + ref_gathered
                 if needs_reference and cfg.precompute_ref_log_probs else 0)
    out["phases"] = {"backward": static + backward, "optimizer step": static + optimizer,
                     "reference pass": out["weights"] + reference}
    out["peak"] = max(out["phases"].values())
    # FLOPs: 6 N per trained token (forward 2N, backward 4N), 2 N more with checkpointing (a second forward),
    # 2 N per token through an online reference; N = parameters outside the input embedding (as trainers.flops_params).
    n_tokens = (P - g.embed_params + (g.vocab * g.hidden if g.tied else 0)) * cfg.batch_size * pairs * cfg.max_length
    out["model FLOPs per step"] = (6 + 2 * ref_online) * n_tokens
    out["executed FLOPs per step"] = (6 + 2 * ref_online + 2 * cfg.activation_checkpointing) * n_tokens
    return out


def report(cfg, model_dir: str, world: int, gpu: str | None = None) -> str:
    """The table `train.py --estimate` prints for `world` ranks; a hub id's config.json alone comes from the cache or
    the hub."""
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).exists():
        from huggingface_hub import hf_hub_download
        try:
            path = Path(hf_hub_download(model_dir, "config.json"))
        except Exception as e:  # noqa: BLE001 - offline, unknown repository, gated: all say the same to the user
            raise EstimateError(f"model.name_or_path={model_dir}: --estimate reads only its config.json, neither "
                                f"cached nor downloadable here ({type(e).__name__}); fetch it alone with `hf download "
                                f"{model_dir} config.json`, or set model.name_or_path to a local directory") from None
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise EstimateError(f"--estimate reads the model's config.json: {path} is missing or not JSON ({e})") from None
    if gpu is not None and gpu not in DEVICES:
        raise EstimateError(f"--estimate gpu={gpu}: unknown device; expected one of {', '.join(DEVICES)}")
    e = estimate(cfg, config, world)
    hint = " (set n_workers=N for another world size)" if cfg.trainer == "FSDPTrainer" and not cfg.n_workers else ""
    unit, size = ("GiB", GiB) if e["peak"] >= 4 * GiB else ("MiB", 2 ** 20)
    lines = [f"estimate for {cfg.trainer} x {world} rank(s), {config.get('model_type')} with {e['parameters'] / 1e6:.2f}M "
             f"parameters ({e['parameters per rank'] / 1e6:.2f}M per rank); micro-batch {e['micro-batch tokens']} tokens "
             f"(every sequence at max_length={cfg.max_length}); no weights read{hint}", "memory per rank:"]
    rows = {name: e[name] for name in ("weights", "reference weights", "gradients", "accumulated gradients",
                                        "optimizer state", "activations", "logits", "FSDP gathered")}
    rows.update({f"phase {name}": b for name, b in e["phases"].items()}, peak=e["peak"])
    lines += [f"  {name:<22} {b / size:10.1f} {unit}" for name, b in rows.items()]
    lines.append(f"FLOPs per step: model {e['model FLOPs per step']:.3e}, executed {e['executed FLOPs per step']:.3e} "
                 f"(all ranks; {e['executed FLOPs per step'] / world:.3e} per rank)")
    if gpu is not None:
        bf16, fp32, mem = DEVICES[gpu]
        dtype, peak = ("bf16", bf16) if e["compute bytes"] == 2 else ("fp32", fp32)
        seconds = e["executed FLOPs per step"] / world / (peak * 1e12 * ASSUMED_MFU)
        fits = "fits" if e["peak"] <= USABLE * mem * GiB else "DOES NOT FIT"
        lines.append(f"on {gpu} ({peak:.0f} TFLOP/s {dtype} peak, {mem} GiB): time per step {seconds:.3f} s at MFU "
                     f"{ASSUMED_MFU}; peak {e['peak'] / GiB:.2f} GiB of {USABLE * mem:.0f} GiB usable: {fits}")
    return "\n".join(lines)
