"""Pre-flight estimate: memory per rank and FLOPs per step from the config and the model's config.json alone.

    python -u train.py <args> --estimate             # memory per rank, FLOPs per step
    python -u train.py <args> --estimate gpu=H100    # and time per step at an assumed MFU, and whether it fits

No weights, tokenizer or data are read, so it answers before a run would load anything, for the worst case
(every sequence max_length long). The peak is the largest phase (the report names it), each but the reference pass
on top of the weights (+ an online reference) and optimizer state, sharded over fsdp_size ranks:
  backward    activations (the tensors autograd saves, by dtype), logits or head tiles, FSDP-gathered units, and the
              larger of its start (earlier micro-batches' gradients; the head's workspace or an online reference's
              root) and its end (gradients, which appear as activations are freed, + one block + FSDP2's root
              reduce-scatter)
  optimizer   gradients + one parameter-sized temporary of the foreach update (sqrt of the second moment)
  evaluation  a forward without gradients of eval_batch_size pairs, or sampling's KV cache
  reference   precompute_ref_log_probs: policy and reference weights while the reference pass runs, before
              training (the reference is freed after it: training holds the policy alone)
  self check  before the first step, the reference still loaded: a few pairs' forwards and, with the tiled head,
              the model's own fp32 logits at the scored positions (at most tiled_head.HEAD_LOGITS_BYTES)
  scoring     semi-online rounds scored by online.scorer=reward_model=<dir>: its weights, whole on every rank, as
              transformers loads them (the checkpoint's dtype: its safetensors headers), beside the training state;
              it leaves the device between rounds
LoRA (lora.r): the frozen base in its dtype; fp32 adapters, their gradients and optimizer state; no reference copy.
QLoRA (model.quantization): the blocks' linear weights as bitsandbytes holds them (quantized_bytes: the 4- or 8-bit
codes and their constants; a mixture's fused experts are not quantized), everything else in the model's dtype, and
one layer's weight dequantized at a time in the compute dtype.
Packed or shared rows attend through FlexAttention block masks on GPUs; elsewhere (CPU, GPT-2) sdpa keeps a float
copy of their dense mask in every layer. Keys it does not model (NOT_MODELLED) are printed with what it counts instead.
"""

from __future__ import annotations

import dataclasses
import json
from collections import namedtuple
from pathlib import Path

import torch

import config
import losses
from utils import DEVICES
from config import dtype_of
from packing import FLEX_DEVICES
from logps import MAX_TILE_ROWS, head_tile_rows
from tiled_head import HEAD_LOGITS_BYTES
from preference_datasets import SAMPLE_GROUP
from self_check import PROBE_PAIRS

GiB = 2**30
ASSUMED_MFU = 0.4  # a well-tuned FSDP run of a 1-10B model; the logged throughput/mfu tells the truth afterwards
USABLE = 0.9  # of device memory: the CUDA context, the allocator's fragmentation and NCCL buffers take the rest
STATES = {"AdamW": 2, "RMSprop": 1, "SGD": 0}  # optimizer state tensors per parameter (SGD without momentum)
# Mixtures of experts with Llama's attention: a router (E x h) and E experts (gate, up, down of moe_intermediate_size,
# else intermediate_size) in place of the MLP
MOE = {"mixtral", "qwen3_moe", "olmoe"}
LLAMA_LIKE = {"llama", "mistral", "qwen2", "qwen3", *MOE}
FAMILIES = sorted(LLAMA_LIKE | {"gpt2", "gpt_neox"})
FLEX = LLAMA_LIKE - {"olmoe"} | {"gpt_neox"}  # transformers' _supports_flex_attn (GPT-2's attention reads a dense mask)
# Config keys the estimate does not model, with what it counts instead: printed when set away from their default
NOT_MODELLED = {
    "fsdp.param_offload": "parameters counted on the device",
    "fsdp.optimizer_offload": "optimizer state counted on the device",
    "fsdp.offload_policy": "parameters, gradients and optimizer state counted on the device",
    "fsdp.forward_only": "counted as training (gradients, optimizer state, backward)",
    "fsdp.wrap_policy": "one FSDP unit per transformer block, not by size",
    "fsdp.entropy_checkpointing": "the entropy bonus's work counted as kept for backward, not recomputed",
    "online.rounds": "the rounds' sampling not counted (FSDP gathers the whole policy for it where it fits)",
}
Geometry = namedtuple(
    "Geometry",
    "hidden layers vocab tied block_params embed_params head_params saved widest linears kv_width params active",
)  # active: a token's (MoE), else None
# Elements autograd keeps per token in one block (tests/test_estimate.py measures them), by the dtype they are kept in:
# compute (the compute dtype), fp32 (always), stream and norm_grad (the weights' dtype under autocast, else compute;
# norm_grad only for the norms' weight gradients, none under LoRA), copies (under autocast: each linear's own cast of
# its input) and repeat_kv (k and v copied to every head, as transformers' sdpa does with a dense mask)
Saved = namedtuple("Saved", "compute fp32 stream norm_grad copies repeat_kv")


class EstimateError(config.ConfigError):
    """A config.json or a config the estimator cannot read, or a device it does not know: bad input, exit code 2."""

    def __init__(self, message: str):  # printed as it is, not as a list of configuration problems
        ValueError.__init__(self, message)
        self.problems = [message]


def geometry(config: dict) -> Geometry:
    """Parameter counts per part, the elements autograd saves per token in one block (Saved) and the block's linear
    layers (module path, in, out), from config.json of a family in FAMILIES; raises EstimateError otherwise."""
    family = config.get("model_type")
    get = lambda *names, default=None: next((config[n] for n in names if config.get(n) is not None), default)
    h = get("hidden_size", "n_embd", "d_model")
    vocab = get("vocab_size")
    layers = get("num_hidden_layers", "n_layer")
    heads = get("num_attention_heads", "n_head")
    if family not in FAMILIES or None in (h, layers, heads, vocab):
        raise EstimateError(
            f"config.json model_type={family!r}: the estimator knows {FAMILIES} (hidden_size, "
            "num_hidden_layers, num_attention_heads, vocab_size); add the family to estimate.geometry"
        )
    kv = get("num_key_value_heads", default=heads)
    d = get("head_dim", default=h // heads)
    act = get("activation_function", "hidden_act", default="gelu_new" if family == "gpt2" else None)
    experts, k = (get("num_local_experts", "num_experts"), get("num_experts_per_tok")) if family in MOE else (1, 1)
    if family in LLAMA_LIKE:
        i = get("moe_intermediate_size", "intermediate_size") if family in MOE else config["intermediate_size"]
        qkv_bias, o_bias = config.get("attention_bias", family == "qwen2"), config.get("attention_bias", False)
        mlp_bias = 2 * i + h if config.get("mlp_bias") else 0  # gate, up, down
        qk_norms = {"qwen3": 2 * d, "qwen3_moe": 2 * d, "olmoe": (heads + kv) * d}.get(family, 0)  # OLMoE: full width
        qkv = (heads + 2 * kv) * d  # the q, k and v projections' outputs
        attention = qkv * h + heads * d * h + (qkv if qkv_bias else 0) + (h if o_bias else 0) + qk_norms
        router = experts * h if family in MOE else 0
        block = attention + experts * 3 * h * i + mlp_bias + router + 2 * h  # + the 2 norms
        tied = config.get("tie_word_embeddings", False)
        positions = 0
        norm = h
        # compute: the norms' outputs 2h (the linears' input), q and the attention output a*d, k and v kv*d, MLP 4i
        # (gate, up, act(gate), act*up); fp32: each RMSNorm's upcast input and rsqrt, the kernel's logsumexp per head;
        # norm_grad: each norm's normalized input, for its weight; copies: q, k, v, gate, up cast the norms' output.
        # Qwen3 normalizes q and k per head (kept: the upcast input, rsqrt, the normalized).
        # a mixture of experts: each token's k experts keep the MLP's 4i each, its router E probabilities (fp32)
        qk = (heads + kv) * d if family in ("qwen3", "qwen3_moe") else 0
        compute = 2 * h + 2 * heads * d + 2 * kv * d + 4 * k * i + qk
        fp32 = 2 * (h + 1) + heads + qk + qk // d + (experts if family in MOE else 0)
        saved = Saved(compute, fp32, 0, 2 * h, 3 * h, 2 * (heads - kv) * d)
        widest = 3 * k * i + 2 * h  # without gradients: the MLP's act(gate), up, their product; the residual, norm's
        attention = (("q", h, heads * d), ("k", h, kv * d), ("v", h, kv * d), ("o", heads * d, h))  # (name, in, out)
        linears = tuple((f"self_attn.{p}_proj", a, b) for p, a, b in attention)
        if family not in MOE:  # a mixture's fused experts and router: peft's all-linear adapts them, not counted
            linears += tuple((f"mlp.{p}_proj", a, b) for p, a, b in (("gate", h, i), ("up", h, i), ("down", i, h)))
    else:
        i = get("n_inner", default=4 * h) if family == "gpt2" else config["intermediate_size"]
        block = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * i + i) + (i * h + h)  # 2 norms, qkv, out, MLP
        tied = config.get("tie_word_embeddings", family == "gpt2")
        positions = config.get("n_positions", 0) * h if family == "gpt2" else 0
        norm = 2 * h
        # compute: the norms' outputs 2h, qkv 3h, attention output h, MLP; GPT-NeoX: rotary q, k 2h and the output's
        # contiguous copy h; fp32: logsumexp per head, each LayerNorm's mean and rstd; stream: the LayerNorms'
        # inputs (one shared input with GPT-NeoX's parallel residual)
        mlp_saved = 5 if act == "gelu_new" else 2  # gelu_new is Python (tanh formula): 4 tensors + its output
        neox = family == "gpt_neox"
        parallel = neox and config.get("use_parallel_residual", True)
        saved = Saved(6 * h + 3 * h * neox + mlp_saved * i, heads + 4, h if parallel else 2 * h, 0, 0, 0)
        widest = (4 if mlp_saved == 5 else 2) * i + 2 * h  # the MLP's input, its activation's temporaries
        names = {
            "gpt2": ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"),
            "gpt_neox": ("attention.query_key_value", "attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h"),
        }[family]
        linears = tuple(zip(names, (h, h, h, i), (3 * h, h, i, h)))  # (name, in, out): qkv, out, MLP up, MLP down
    embed, head = vocab * h + positions, norm + (0 if tied else vocab * h)  # final norm (+ bias), untied head
    params = embed + layers * block + head
    active = params - layers * (experts - k) * 3 * h * i if family in MOE else None
    return Geometry(h, layers, vocab, tied, block, embed, head, saved, widest, linears, kv * d, params, active)


def lora_linears(cfg, g: Geometry) -> list:
    """(in, out) of each block linear lora.target_modules selects, as peft matches names: the module's path or a
    dotted suffix of it; 'all-linear' is every linear of the blocks (peft leaves out the LM head)."""
    targets = cfg.lora.target_modules
    if isinstance(targets, str) and targets.lower() != "all-linear":
        raise EstimateError(
            f"lora.target_modules={targets!r}: --estimate reads 'all-linear' or a list of module "
            "names, not a regular expression"
        )
    names = None if isinstance(targets, str) else targets
    hit = lambda path, name: path == name or path.endswith("." + name)
    if unknown := [n for n in names or () if not any(hit(path, n) for path, _, _ in g.linears)]:
        raise EstimateError(
            f"lora.target_modules: {unknown} name no linear layer of a block; --estimate counts "
            f"adapters on {', '.join(sorted({p for p, _, _ in g.linears}))} (or 'all-linear')"
        )
    return [(i, o) for path, i, o in g.linears if names is None or any(hit(path, n) for n in names)]


def quantized_bytes(n: int, rows: int, quantization: str) -> int:
    """Bytes bitsandbytes holds for one weight matrix of n elements and `rows` output rows: int8, a byte each and an
    fp32 scale per row; nf4 and fp4, two a byte, and an absmax per block of 64 quantized again to a byte (double
    quantization), with an fp32 absmax per 256 blocks, the two fp32 code books (16 and 256 entries) and an fp32
    offset."""
    if quantization == "int8":
        return n + 4 * rows
    blocks = -(-n // 64)
    return -(-n // 2) + blocks + 4 * -(-blocks // 256) + 4 * (16 + 256) + 4


def _activations(cfg, g: Geometry, tokens: int, rows: int, c: int, w: int, dense: bool) -> dict:
    """Per rank: saved activations, logits (or the tiled head's tiles), the head's backward workspace, one block's."""
    s = g.saved
    lora = cfg.lora.r is not None
    mp = bool(cfg.fsdp.mixed_precision)
    ckpt = cfg.activation_checkpointing
    # autocast (mixed precision in one process): the residual stream and norms stay in the weights' dtype, each linear
    # keeps its own cast of its input, and of its weight until its backward
    autocast = mp and cfg.trainer != "FSDPTrainer" and w != c
    stream = w if autocast else c
    per_token = s.compute * c + s.fp32 * 4 + (s.stream + s.norm_grad * (not lora)) * stream
    per_token += s.copies * c * autocast + s.repeat_kv * c * dense
    adapters = lora_linears(cfg, g) if lora else []
    cast = not mp and c != 4  # peft keeps the adapters in fp32: inputs cast to them
    drop = cfg.lora.dropout > 0
    a = 4 if cast else c
    # lora_A keeps its input (a cast copy; dropout's output and mask, bool on CUDA), lora_B the r-wide product. An
    # upper bound: frozen linears keep no input, so where lora_A keeps a copy the original may go
    per_token += sum(cfg.lora.r * a + i * a * ((cast or drop) + drop) for i, _ in adapters)
    block = per_token * tokens  # the first block's, or the one being recomputed
    # with checkpointing each block keeps only its input and backward recomputes one block at a time
    act = g.layers * g.hidden * tokens * stream + block if ckpt else g.layers * block
    act += 2 * g.hidden * tokens * c  # final norm
    if dense:  # the bool (R, 1, T, T) mask (prefix sharing: rows of a pair, <= 2 max_length), and sdpa's float bias of
        # it kept by every layer (checkpointing: the recomputed one's): padding-free's whole rows
        mask = tokens * 2 * cfg.max_length if cfg.prefix_sharing else rows * cfg.max_length**2
        act += mask * (1 + c * (1 if ckpt else g.layers))
    if autocast:  # the weights' cast copies: every block's (checkpointing: the recomputed one's) and the LM head's
        weights = g.block_params + cfg.lora.r * sum(i + o for i, o in adapters) if lora else g.block_params
        act += (weights * (1 if ckpt else g.layers) + g.vocab * g.hidden) * c
    return {"activations": act, "block activations": block, **_logits(cfg, g, tokens, c)}


def _logits(cfg, g: Geometry, tokens: int, c: int) -> dict:
    """Per rank: logits (or the tiled head's tiles) of `tokens` tokens in `c` bytes, the head's backward workspace."""
    if cfg.tiled_lm_head and not cfg.loss.entropy_coeff:  # under FSDP too (forward_logps is the root's forward)
        # a few (chunk, V) fp32 tiles at a time, never (tokens, V); backward: the head weight's (V, H) fp32
        # gradient accumulator + a (V, H) tile product / final cast unless fp32 (LoRA: the head is frozen)
        logits = 4 * min(tokens, MAX_TILE_ROWS, head_tile_rows(g.vocab)) * g.vocab * 4
        head_backward = 0 if cfg.lora.r is not None else g.vocab * g.hidden * (4 + (c if c != 4 else 0))
        return {"logits": logits, "LM-head backward": head_backward}
    # the plain path (logps.label_logps): the fp32 log-softmax kept for backward, and at its start the fp32 gradients
    # of the log-softmax and of its input beside it (then the logits' own, in the compute dtype); an entropy bonus
    # keeps its softmax work too, row chunks of it with fsdp.entropy_from_logits_with_chunking
    bonus = 0
    if cfg.loss.entropy_coeff:
        bonus = 3 * (min(tokens, MAX_TILE_ROWS) if cfg.fsdp.entropy_from_logits_with_chunking else tokens) * g.vocab * 4
    return {"logits": 3 * tokens * g.vocab * 4 + bonus, "LM-head backward": 0}


def _forward_logits(cfg, g: Geometry, tokens: int, c: int) -> int:
    """Per rank, a forward without gradients (evaluation, the reference pass): the plain path holds the model's
    (tokens, V) logits, the scored rows of them, and their fp32 log-softmax and entropy work; the tiled head its
    tiles."""
    if cfg.tiled_lm_head:
        return 4 * min(tokens, MAX_TILE_ROWS, head_tile_rows(g.vocab)) * g.vocab * 4
    return tokens * g.vocab * (2 * c + 3 * 4)


def estimate(cfg, config: dict, world_size: int, device: str = "cuda", scorer_bytes: int = 0) -> dict:
    """{name: bytes or count} per rank for one optimizer step of `cfg` on the model of `config`, run on `device`;
    `scorer_bytes`: a reward model's weights (reward_model_bytes), on the device while it scores a round."""
    g = geometry(config)
    fsdp = cfg.trainer == "FSDPTrainer"
    fsdp2 = fsdp and cfg.fsdp.strategy == "fsdp2"
    shard = (cfg.fsdp.fsdp_size if 1 <= cfg.fsdp.fsdp_size < world_size else world_size) if fsdp else 1
    # bytes per element of: weights (gradients, optimizer state), compute, reductions, reference weights, its compute
    mp = cfg.fsdp.mixed_precision_dtypes()
    size = lambda name: dtype_of(name).itemsize
    w = size(cfg.fsdp.model_dtype)
    c = size(mp["param_dtype"]) if mp else w
    r = size(mp["reduce_dtype"]) if mp else w
    ref_w = size(cfg.model.reference_dtype or cfg.fsdp.model_dtype)  # null: the policy's
    ref_c = c if mp and cfg.reference_mixed else ref_w
    lora = cfg.lora.r is not None  # the reference is the policy with its adapters off: no copy
    adapters = g.layers * cfg.lora.r * sum(i + o for i, o in lora_linears(cfg, g)) if lora else 0
    # what gets gradients and optimizer state: the adapters (fp32: peft casts bf16 ones up), or every parameter
    trained, tw, block_trained = (adapters, 4, adapters / g.layers) if lora else (g.params, w, g.block_params)
    # the size of a block's and of the model's weights, in elements of the model's dtype; model.quantization: the
    # blocks' linear weights as bitsandbytes holds them, and the largest one dequantized (one at a time, in the compute
    # dtype, in forward and again in backward)
    block_size, dequantized = g.block_params, 0
    if cfg.model.quantization is not None:
        block_size -= sum(i * o - quantized_bytes(i * o, o, cfg.model.quantization) / w for _, i, o in g.linears)
        dequantized = max(i * o for _, i, o in g.linears) * c
    model_size = g.params - g.layers * (g.block_params - block_size)
    gradients = trained * tw / shard
    needs_reference = losses.needs_reference(cfg.loss_names, cfg.loss.reference_free)
    ref_online = needs_reference and not cfg.precompute_ref_log_probs
    reference = g.params * ref_w / shard if needs_reference and not lora else 0  # held online, else before training
    pairs = 2 if cfg.trains_on_pairs else 1  # sequences per example
    sp = cfg.fsdp.ulysses_sequence_parallel_size if fsdp else 1  # a group of sp ranks shares its pairs
    budget = cfg.max_tokens_per_microbatch
    micro = cfg.batch_size // (world_size // sp) // (1 if budget else cfg.gradient_accumulation_steps)
    tokens = min(micro * pairs * cfg.max_length, budget or 2**62)  # a token budget: the sequences that fit it
    rows = -(-tokens // cfg.max_length)  # whole rows of max_length tokens (padded or packed)
    tokens = -(-tokens // sp)  # Ulysses: each rank holds 1/sp of every row's positions
    # packed or shared rows attend through FlexAttention block masks on GPUs (transformers' _supports_flex_attn);
    # elsewhere through sdpa with a dense (R, 1, T, T) mask (padded rows: no mask, the model's causal one)
    dense = (cfg.padding_free or cfg.prefix_sharing) and not (device in FLEX_DEVICES and config["model_type"] in FLEX)
    several = cfg.gradient_accumulation_steps > 1 or bool(budget)  # micro-batches per step (a budget can split)
    root = g.embed_params + g.head_params  # FSDP's root unit: embeddings, final norm, LM head
    out = {
        "parameters": g.params,
        "adapters": adapters,
        "parameters per rank": (g.params + adapters) / shard,
        "micro-batch tokens": tokens,
        "compute bytes": c,
        "dense mask": dense,
        "weights": (model_size * w + adapters * 4) / shard,
        "reference weights": reference if ref_online else 0,
        "optimizer state": STATES[cfg.optimizer] * gradients,
        "gradients": gradients,
        **_activations(cfg, g, tokens, rows, c, w, dense),
    }
    gathered = ref_root = root_reduce = forward_units = 0
    if fsdp:  # one block gathered (two with forward_prefetch), its unsharded gradient in backward, and the root unit
        units = 1 + cfg.fsdp.forward_prefetch
        gathered = (units * block_size + block_trained) * c + root * c * (1 - 1 / shard)
        if not cfg.fsdp.reshard_after_forward:  # every unit kept until its backward
            gathered = model_size * c + block_trained * c
        ref_root = root * ref_c if ref_online else 0  # the reference reshards after its forward, whatever the knob
        forward_units = units * block_size + root  # gathered by a forward alone (reference, evaluation)
        root_reduce = root * (c + r) if fsdp2 and not lora else 0  # unsharded grads + buffer
    out.update({"FSDP gathered": gathered, "reference root": ref_root, "root reduce-scatter": root_reduce})
    # held from a step's earlier micro-batches through the later ones: each rank's gradients (FSDP: its shard), or
    # with no_sync_accumulation the whole model's unsharded gradients (FSDP2: in reduce_dtype, FSDP1: param_dtype)
    unsynced = trained * (r if fsdp2 else c) if fsdp and cfg.no_sync_accumulation and several else 0
    out["accumulated gradients"] = held = unsynced or (gradients if several else 0)
    static = out["weights"] + out["reference weights"] + out["optimizer state"]
    # gradients are None between steps (zero_grad(set_to_none=True)): backward peaks at its start or its end
    start = held + out["activations"] + out["logits"] + max(out["LM-head backward"], ref_root)
    backward = max(start, unsynced + gradients + out["block activations"] + root_reduce) + gathered + dequantized
    fused = cfg.fused_optimizer and cfg.optimizer == "AdamW"  # one kernel: no temporary
    optimizer = gradients + (gradients if STATES[cfg.optimizer] and not fused else 0)  # the temporary: sqrt(v)
    # a forward without gradients, computing in b bytes per element: a block's widest moment, the output hidden
    # states and the rows gathered from them, the units FSDP gathers for it (the logits apart)
    no_grad = lambda tokens, b: ((g.widest + 2 * g.hidden) * tokens + forward_units) * b + dequantized
    # evaluation: eval_batch_size pairs per data-parallel group and their logits; sampling: SAMPLE_GROUP's KV cache
    eval_pairs = max(1, cfg.eval_batch_size // (world_size // sp))
    eval_tokens = -(-eval_pairs * pairs * cfg.max_length // sp)
    forward = lambda b: no_grad(eval_tokens, b) + _forward_logits(cfg, g, eval_tokens, b)
    kv_cache = 2 * g.layers * g.kv_width * c * SAMPLE_GROUP * (cfg.max_prompt_length + cfg.max_new_tokens)
    out["phases"] = {
        "backward": static + backward,
        "optimizer step": static + optimizer,
        "evaluation": static + max(forward(c), kv_cache * cfg.sample_during_eval),
    }
    if scorer_bytes:  # semi-online scoring: the training state stays, the policy's gathered units are freed
        out["phases"]["scoring"] = static + scorer_bytes
    out["reward model"] = scorer_bytes
    if needs_reference and cfg.precompute_ref_log_probs:  # before training: policy and reference, no optimizer state
        out["phases"]["reference pass"] = out["weights"] + reference + forward(ref_c)
    if cfg.self_check:  # before the first step, the reference still loaded (a resume: the optimizer state too): a few
        # pairs' forwards, and with the tiled head the full fp32 logits of the plain path it is compared with
        probe = min(PROBE_PAIRS, max(1, micro)) * pairs * cfg.max_length
        full = min(probe * g.vocab * 4, HEAD_LOGITS_BYTES) if cfg.tiled_lm_head else 0
        precomputed = 0 if ref_online else reference  # static holds an online one
        out["phases"]["self check"] = static + precomputed + full + no_grad(probe, c)
    out["peak phase"] = max(out["phases"], key=out["phases"].get)
    out["peak"] = out["phases"][out["peak phase"]]
    # FLOPs: 6 N per trained token (forward 2N, backward 4N), 2 N more with checkpointing (a second forward),
    # 2 N per token through an online reference; N = parameters outside the input embedding (as trainers.flops_params).
    # LoRA: N counts the adapters, and the frozen weights' backward computes only the inputs' gradients (2 N)
    # A mixture of experts: N counts the parameters a token runs through (top-k experts), memory all of them
    n = (g.active or g.params) - g.embed_params + (g.vocab * g.hidden if g.tied else 0)
    out["FLOPs parameters"] = n
    n_tokens = cfg.batch_size * pairs * cfg.max_length
    out["model FLOPs per step"] = (6 + 2 * ref_online) * (n + adapters) * n_tokens
    forward_flops = (2 + 2 * cfg.activation_checkpointing) * (n + adapters)
    backward_flops = 2 * n + 4 * adapters if lora else 4 * n
    out["executed FLOPs per step"] = (forward_flops + backward_flops + 2 * ref_online * n) * n_tokens
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
            raise EstimateError(
                f"model.name_or_path={model_dir}: --estimate reads only its config.json, neither "
                f"cached nor downloadable here ({type(e).__name__}); fetch it alone with `hf download "
                f"{model_dir} config.json`, or set model.name_or_path to a local directory"
            ) from None
    try:
        model = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise EstimateError(f"--estimate reads the model's config.json: {path} is missing or not JSON ({e})") from None
    if gpu is not None and gpu not in DEVICES:
        raise EstimateError(f"--estimate gpu={gpu}: unknown device; expected one of {', '.join(DEVICES)}")
    device = "cuda" if gpu is not None or torch.cuda.is_available() else "cpu"
    scorer = cfg.online.scorer.partition("=")
    scored = cfg.online.rounds and scorer[0] == "reward_model"  # online.pairing=spin refuses a scorer
    e = estimate(cfg, model, world, device, reward_model_bytes(scorer[2]) if scored else 0)
    family = model.get("model_type")
    lora = f" + {e['adapters'] / 1e6:.2f}M LoRA r={cfg.lora.r} (trained)" if e["adapters"] else ""
    if cfg.model.quantization is not None:
        lora = f", the blocks' linear layers in {cfg.model.quantization}{lora}"
    hint = " (set n_workers=N for another world size)" if cfg.trainer == "FSDPTrainer" and not cfg.n_workers else ""
    unit, size = ("GiB", GiB) if e["peak"] >= 4 * GiB else ("MiB", 2**20)
    lines = [
        f"estimate for {cfg.trainer} x {world} rank(s), {family} with {e['parameters'] / 1e6:.2f}M "
        f"parameters{lora} ({e['parameters per rank'] / 1e6:.2f}M per rank); "
        f"micro-batch {e['micro-batch tokens']} tokens "
        f"(every sequence at max_length={cfg.max_length}); no weights read{hint}",
        "memory per rank:",
    ]
    state = ("weights", "reference weights", "gradients", "accumulated gradients", "optimizer state")
    rows = {name: e[name] for name in (*state, "activations", "logits", "FSDP gathered")}  # then a micro-batch's
    rows |= {"reward model": e["reward model"]} if e["reward model"] else {}
    rows.update({f"phase {name}": b for name, b in e["phases"].items()}, **{f"peak ({e['peak phase']})": e["peak"]})
    lines += [f"  {name:<22} {b / size:10.1f} {unit}" for name, b in rows.items()]
    if e["reward model"]:
        lines.append(
            f"reward model: online.scorer={cfg.online.scorer} counted whole on every rank while it scores a round "
            "(phase scoring), off the device between rounds"
        )
    if cfg.padding_free or cfg.prefix_sharing:
        dense = f"dense (R, 1, T, T), a float copy kept by every layer (no FlexAttention for {family} on {device})"
        lines.append(f"attention masks: {dense if e['dense mask'] else 'FlexAttention block masks'}")
    values = config.flatten(cfg.to_dict())
    schema = config.schema()
    # a block class named in fsdp.wrap_policy is what the estimate counts; min_num_params units are not
    values["fsdp.wrap_policy"] = {k: v for k, v in values["fsdp.wrap_policy"].items() if k == "min_num_params"}
    for key, note in NOT_MODELLED.items():
        if values[key] != schema[key][1]:  # set away from its default
            lines.append(f"assumes: {note} ({key}={values[key]} is not modelled)")
    lines.append(
        f"FLOPs per step: model {e['model FLOPs per step']:.3e}, executed {e['executed FLOPs per step']:.3e} "
        f"(all ranks; {e['executed FLOPs per step'] / world:.3e} per rank)"
    )
    if family in MOE:  # its FLOPs count the active parameters
        lines.append(
            f"mixture of experts: FLOPs count N = {e['FLOPs parameters'] / 1e6:.2f}M, the parameters a token "
            f"runs through (its top-k experts; as throughput/mfu), memory all {e['parameters'] / 1e6:.2f}M"
        )
    usable = None
    if gpu is not None:
        bf16, fp32, mem = DEVICES[gpu]
        usable = USABLE * mem * GiB
        dtype, peak = ("bf16", bf16) if e["compute bytes"] == 2 else ("fp32", fp32)
        seconds = e["executed FLOPs per step"] / world / (peak * 1e12 * ASSUMED_MFU)
        lines.append(
            f"on {gpu} ({peak:.0f} TFLOP/s {dtype} peak, {mem} GiB): time per step {seconds:.3f} s at MFU "
            f"{ASSUMED_MFU}; peak {e['peak'] / GiB:.2f} GiB of {USABLE * mem:.0f} GiB usable: "
            + ("fits" if e["peak"] <= usable else "DOES NOT FIT")
        )
    if usable is not None and e["peak"] > usable:
        lines += _switches(cfg, model, world, device, e, usable)
    elif not cfg.tiled_lm_head:  # the plain path's (tokens, vocab) tensors: named where the tiled head halves the peak
        tiled = estimate(dataclasses.replace(cfg, tiled_lm_head=True), model, world, device)["peak"]
        if 2 * tiled < e["peak"]:
            lines.append(
                f"the logits hold most of the peak ({e['peak phase']}, {e['peak'] / GiB:.2f} GiB): tiled_lm_head=true "
                f"gives a peak of {tiled / GiB:.2f} GiB"
            )
    return "\n".join(lines)


def reward_model_bytes(path: str) -> int:
    """Bytes of a reward model's weights as transformers loads them (in the checkpoint's dtype): its safetensors files'
    tensors, from their headers; without them, config.json's parameters (a causal LM's, the LM head a score head) in
    its dtype."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise EstimateError(
            f"online.scorer=reward_model={path}: --estimate reads its config.json (and safetensors headers) from a "
            "local directory, and there is none"
        )
    if files := sorted(folder.glob("*.safetensors")):
        return sum(map(safetensors_bytes, files))
    config = json.loads((folder / "config.json").read_text())
    g = geometry(config)
    params = g.params - (0 if g.tied else g.vocab * g.hidden) + config.get("num_labels", 1) * g.hidden
    return params * dtype_of(config.get("dtype") or config.get("torch_dtype") or "float32").itemsize


def safetensors_bytes(path: Path) -> int:
    """The tensors' bytes of a .safetensors file, from its header: 8 bytes of length, then JSON with each tensor's
    data offsets."""
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    tensors = [v for name, v in header.items() if name != "__metadata__"]
    return sum(end - start for start, end in (v["data_offsets"] for v in tensors))


def _switches(cfg, model: dict, world: int, device: str, e: dict, usable: float) -> list[str]:
    """The switches that lower a peak over `usable`, each with the peak it gives and whether it fits: the tiled LM
    head, activation checkpointing, half the micro-batch, and all of them."""
    micro = {"gradient_accumulation_steps": 2 * cfg.gradient_accumulation_steps}
    if cfg.max_tokens_per_microbatch:
        micro = {"max_tokens_per_microbatch": max(1, cfg.max_tokens_per_microbatch // 2)}
    fits = cfg.batch_size % (2 * cfg.gradient_accumulation_steps * world) == 0 or cfg.max_tokens_per_microbatch
    options = {
        "tiled_lm_head=true": {"tiled_lm_head": True} if not cfg.tiled_lm_head else None,
        "activation_checkpointing=true": {"activation_checkpointing": True}
        if not cfg.activation_checkpointing
        else None,
        f"{', '.join(f'{k}={v}' for k, v in micro.items())} (half the micro-batch)": micro if fits else None,
    }
    if cfg.model.quantization is None:  # the weights themselves: a 4-bit base that only LoRA adapters train (QLoRA)
        qlora = {"model": dataclasses.replace(cfg.model, quantization="nf4")}
        if cfg.lora.r is None:
            qlora["lora"] = dataclasses.replace(cfg.lora, r=16)
        options["model.quantization=nf4" + (" lora.r=16" if cfg.lora.r is None else "")] = qlora
    options = {name: changes for name, changes in options.items() if changes}
    if len(options) > 1:
        options["all of these"] = {k: v for changes in options.values() for k, v in changes.items()}
    lines = [
        f"what lowers the peak of {e['peak'] / GiB:.2f} GiB ({e['peak phase']}; "
        f"the logits: {e['logits'] / GiB:.2f} GiB):"
    ]
    held = e["weights"] + e["reference weights"] + e["optimizer state"]
    if held > usable and cfg.model.quantization is None:  # no activation switch helps: the weights do not fit
        lines.insert(
            0,
            f"the weights, reference and optimizer state alone take {held / GiB:.2f} GiB of {usable / GiB:.0f} GiB "
            "usable: of these switches only model.quantization (QLoRA: a 4-bit base, LoRA adapters) lowers them",
        )
    for name, changes in options.items():
        peak = estimate(dataclasses.replace(cfg, **changes), model, world, device)["peak"]
        lines.append(f"  {name:<56} peak {peak / GiB:.2f} GiB: " + ("fits" if peak <= usable else "does not fit"))
    return lines
