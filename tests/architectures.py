"""Tiny random models of real architectures, built offline from transformers' config classes.

Each keeps what makes its family different (tied embeddings, learned positions, partial rotary, GQA, qkv
bias, logit softcapping, sliding window) at <= 1M parameters and the toy tokenizer's vocabulary (512), so
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

ARCHITECTURES = {
    # name: (config class, kwargs, tied input/output embeddings)
    "gpt2": (transformers.GPT2Config, dict(n_embd=64, n_layer=2, n_head=4, n_positions=320, resid_pdrop=0.0,
                                           embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True), True),
    "gpt_neox": (transformers.GPTNeoXConfig, dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                  intermediate_size=128, rotary_pct=0.25, use_parallel_residual=True,
                                                  max_position_embeddings=320, tie_word_embeddings=False), False),
    "llama": (transformers.LlamaConfig, dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             intermediate_size=128, max_position_embeddings=320, tie_word_embeddings=False), False),
    "qwen2": (transformers.Qwen2Config, dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             intermediate_size=128, max_position_embeddings=320, tie_word_embeddings=True), True),
    "gemma2": (transformers.Gemma2Config, dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               head_dim=16, intermediate_size=128, max_position_embeddings=320,
                                               sliding_window=16, final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
                                               tie_word_embeddings=True), True),
    "mistral": (transformers.MistralConfig, dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                 intermediate_size=128, max_position_embeddings=320, sliding_window=None,
                                                 tie_word_embeddings=False), False),
}


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
