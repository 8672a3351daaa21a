"""Tiny random models of real architectures, built offline from transformers' config classes.

Each keeps what makes its family different (tied embeddings, learned positions, partial rotary, GQA, qkv
bias, logit softcapping, sliding window; per-head q/k norms, local and global layers, layers without RoPE; experts,
attention sinks) at <= 1M parameters and the toy tokenizer's vocabulary (512), so
that train.py loads it through its real `from_pretrained` path with `model.name_or_path=<dir>`.
"""

from pathlib import Path

import torch
import transformers

REPO = Path(__file__).resolve().parent.parent
TOKENIZER = REPO / "toy" / "tiny-llama"
VOCAB = 512
# max_position_embeddings > 256: the bf16 check scores tokens past position 200.
COMMON = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=1, pad_token_id=1)
# the newer families at hidden 32: 2 layers, 4 query heads over 2 key/value heads (Ulysses over 2 ranks)
SMALL = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=320
)
EXPERTS = dict(num_experts_per_tok=2)

ARCHITECTURES = {
    # name: (config class, kwargs, tied input/output embeddings)
    "gpt2": (
        transformers.GPT2Config,
        dict(
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=320,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            tie_word_embeddings=True,
        ),
        True,
    ),
    "gpt_neox": (
        transformers.GPTNeoXConfig,
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            rotary_pct=0.25,
            use_parallel_residual=True,
            max_position_embeddings=320,
            tie_word_embeddings=False,
        ),
        False,
    ),
    "llama": (
        transformers.LlamaConfig,
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            max_position_embeddings=320,
            tie_word_embeddings=False,
        ),
        False,
    ),
    "qwen2": (
        transformers.Qwen2Config,
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            max_position_embeddings=320,
            tie_word_embeddings=True,
        ),
        True,
    ),
    "gemma2": (
        transformers.Gemma2Config,
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=128,
            max_position_embeddings=320,
            sliding_window=16,
            final_logit_softcapping=30.0,
            attn_logit_softcapping=50.0,
            tie_word_embeddings=True,
        ),
        True,
    ),
    "mistral": (
        transformers.MistralConfig,
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            max_position_embeddings=320,
            sliding_window=None,
            tie_word_embeddings=False,
        ),
        False,
    ),
    # per-head q and k norms
    "qwen3": (
        transformers.Qwen3Config,
        dict(**SMALL, head_dim=8, intermediate_size=64, tie_word_embeddings=True),
        True,
    ),
    # a local (sliding, RoPE base 1e4) and a global (RoPE base 1e6) layer, scaled embeddings
    "gemma3": (
        transformers.Gemma3TextConfig,
        dict(
            **SMALL,
            head_dim=8,
            intermediate_size=64,
            query_pre_attn_scalar=8,
            sliding_window=16,
            tie_word_embeddings=True,
            layer_types=["sliding_attention", "full_attention"],
        ),
        True,
    ),
    # layer 1 without RoPE (no_rope_layers: 1 = rotary)
    "smollm3": (
        transformers.SmolLM3Config,
        dict(**SMALL, intermediate_size=64, no_rope_layers=[1, 0], tie_word_embeddings=True),
        True,
    ),
    # mixtures of experts: 4 experts, 2 a token, fused 3-D expert parameters, a router per layer
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        dict(
            **SMALL,
            **EXPERTS,
            head_dim=8,
            intermediate_size=64,
            num_experts=4,
            moe_intermediate_size=32,
            tie_word_embeddings=False,
        ),
        False,
    ),
    "olmoe": (
        transformers.OlmoeConfig,
        dict(**SMALL, **EXPERTS, intermediate_size=32, num_experts=4, tie_word_embeddings=False),
        False,
    ),
    "mixtral": (
        transformers.MixtralConfig,
        dict(**SMALL, **EXPERTS, intermediate_size=32, num_local_experts=4, tie_word_embeddings=False),
        False,
    ),
    # attention sinks, a sliding and a full layer, YaRN past position 80, biased experts and router
    "gpt_oss": (
        transformers.GptOssConfig,
        dict(
            **SMALL,
            **EXPERTS,
            head_dim=8,
            intermediate_size=32,
            num_local_experts=4,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=150000.0,
                factor=4.0,
                original_max_position_embeddings=80,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
            ),
            tie_word_embeddings=False,
        ),
        False,
    ),
}
MOE = ["qwen3_moe", "olmoe", "mixtral", "gpt_oss"]


def build(name: str, out_dir: Path, seed: int = 0) -> Path:
    """A random `name` model saved with the toy tokenizer into out_dir/name; returns that directory."""
    cls, kwargs, tied = ARCHITECTURES[name]
    config = cls(**COMMON, **kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) <= 1_000_000, name
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied, name
    path = Path(out_dir) / name
    model.save_pretrained(path)
    transformers.AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(path)
    return path


def build_all(out_dir: Path) -> dict[str, Path]:
    return {name: build(name, out_dir) for name in ARCHITECTURES}


# ---------- forward_logps' seams and inputs, shared by the log-prob tests ----------
def seams(
    model,
    tiled: bool = False,
    packed_capacity: int | None = None,
    prefix_sharing: bool = False,
    sequence_parallel=None,
    routing: bool = False,
    routing_grad: bool = False,
) -> dict:
    """forward_logps' keyword arguments for the options a test names, as a run with them builds its seams
    (trainers.BasicTrainer.log_prob_paths): a packing.Layout for packed rows (at most `packed_capacity` tokens),
    shared prefixes or Ulysses' slices (`sequence_parallel`, a ulysses.SequenceParallel); the tiled head; a moe.Router
    recording the routing, differentiable with `routing_grad` (a loss.router_aux_loss > 0)."""
    out = {}
    if packed_capacity or prefix_sharing or sequence_parallel:
        import packing

        out["layout"] = packing.Layout(packed_capacity, prefix_sharing, sequence_parallel)
    if tiled:
        import tiled_head

        out["head"] = tiled_head.Head()
    if routing or routing_grad:
        import moe
        from sharding import unwrap

        out["router"] = moe.Router(unwrap(model).config, 0.01 if routing_grad else None, prefix_sharing)
    return out


def tiny(config_class: str, **kwargs):
    """A random 2-layer model of transformers' `config_class` (vocab 256, hidden 64), fp32, in eval mode."""
    sizes = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**sizes, **kwargs})
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def padded_batch(vocab: int = 256) -> dict[str, torch.Tensor]:
    """Three rows of 24 tokens, the last two right-padded (to 18 and 11), 4 prompt tokens unscored."""
    ids = torch.randint(3, vocab, (3, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 18:] = mask[2, 11:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :4] = -100
    return {"input_ids": ids * mask, "attention_mask": mask, "labels": labels}


def own_token_logps(model, inputs: dict) -> torch.Tensor:
    """Each labelled token's log-prob from log_softmax(model(...).logits), 0 elsewhere, (N, T): each row alone."""
    out = torch.zeros(inputs["labels"].shape)
    for i, n in enumerate(inputs["attention_mask"].sum(1).tolist()):
        ids = inputs["input_ids"][i : i + 1, :n]
        logp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)[0]
        out[i, 1:n] = logp[:-1].gather(-1, ids[0, 1:, None])[:, 0] * (inputs["labels"][i, 1:n] != -100)
    return out


def own_statistics(model, inputs: dict) -> dict[str, torch.Tensor]:
    """From the model's own logits over the padded rows (log_softmax at every position, then the scored ones), per
    sequence: the summed log-probs, the count, the mean entropy and the summed log sum_v p_v^2 of its labelled tokens;
    differentiable (the entropy bonus's gradient is checked against this one)."""
    logp = torch.log_softmax(model(input_ids=inputs["input_ids"]).logits.float(), -1)[:, :-1]
    targets = inputs["labels"][:, 1:]  # output t predicts token t+1
    scored = (targets != -100).float()
    token = logp.gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    entropy = -(logp.exp() * logp).sum(-1)
    counts = scored.sum(1)
    return dict(
        sums=(token * scored).sum(1),
        counts=counts,
        entropy=(entropy * scored).sum(1) / counts,
        log_sum_sq=(torch.logsumexp(2 * logp, -1) * scored).sum(1),
    )
