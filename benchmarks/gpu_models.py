"""The helper benchmarks/gpu_check.sh calls: build small random models, summarize a run.

    python benchmarks/gpu_models.py build OUT_DIR [--size tiny|small]   # prints "name<TAB>path" per model
    python benchmarks/gpu_models.py summarize RUN_DIR                   # prints "pairs/s<TAB>MFU" (median of steps;
                                                                        # MFU "-" where the run logged none)

Models are built offline from transformers config classes, with random weights and the toy tokenizer's vocabulary
(512), one per architecture family whose quirks break distributed code: GPT-2 (tied embeddings, learned positions,
Conv1D), Llama (RoPE, GQA, untied), Qwen2 (tied, qkv bias), Qwen3-MoE (per-head q/k norms, fused experts, a router)
and gpt-oss (attention sinks, alternating 128-token sliding windows, YaRN, biased fused experts; `small` keeps
gpt-oss-20b's attention geometry: 64 query heads of 64 over 8 key/value heads, 32 experts, 4 a token). `tiny` (~0.3M
parameters) checks correctness fast; `small` (~20-40M, the MoEs ~100M of which a quarter is active) gives throughput
numbers worth reading.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

VOCAB = 512  # the toy tokenizer's (toy/tiny-llama), which every model here is trained with
SIZES = {
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, mlp=128, experts=(4, 2), gpt_oss_heads=(4, 2, 16)),
    "small": dict(hidden=512, layers=8, heads=8, kv_heads=4, mlp=2048, experts=(32, 4), gpt_oss_heads=(64, 8, 64)),
}
MOE = ("qwen3_moe", "gpt_oss")  # the ones that take loss.router_aux_loss


def configs(size: str) -> dict:
    from transformers import GptOssConfig, GPT2Config, LlamaConfig, Qwen2Config, Qwen3MoeConfig

    s = SIZES[size]
    common = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return {
        "gpt2": GPT2Config(
            n_embd=s["hidden"],
            n_layer=s["layers"],
            n_head=s["heads"],
            n_inner=s["mlp"],
            n_positions=512,
            tie_word_embeddings=True,
            **common,
        ),
        "llama": LlamaConfig(
            hidden_size=s["hidden"],
            num_hidden_layers=s["layers"],
            num_attention_heads=s["heads"],
            num_key_value_heads=s["kv_heads"],
            intermediate_size=s["mlp"],
            max_position_embeddings=512,
            tie_word_embeddings=False,
            **common,
        ),
        "qwen2": Qwen2Config(
            hidden_size=s["hidden"],
            num_hidden_layers=s["layers"],
            num_attention_heads=s["heads"],
            num_key_value_heads=s["kv_heads"],
            intermediate_size=s["mlp"],
            max_position_embeddings=512,
            tie_word_embeddings=True,
            **common,
        ),
        # top-k of the experts a token (experts: (count, k)), each a quarter of the dense MLP's width
        "qwen3_moe": Qwen3MoeConfig(
            hidden_size=s["hidden"],
            num_hidden_layers=s["layers"],
            num_attention_heads=s["heads"],
            num_key_value_heads=s["kv_heads"],
            head_dim=s["hidden"] // s["heads"],
            intermediate_size=s["mlp"],
            moe_intermediate_size=s["mlp"] // 4,
            num_experts=s["experts"][0],
            num_experts_per_tok=s["experts"][1],
            max_position_embeddings=512,
            tie_word_embeddings=False,
            **common,
        ),
        # layers alternate sliding (128) and full attention, as gpt-oss-20b's; its YaRN (x32 over 4096 positions)
        "gpt_oss": GptOssConfig(
            hidden_size=s["hidden"],
            num_hidden_layers=max(2, s["layers"] // 2),
            num_attention_heads=s["gpt_oss_heads"][0],
            num_key_value_heads=s["gpt_oss_heads"][1],
            head_dim=s["gpt_oss_heads"][2],
            intermediate_size=s["hidden"],
            num_local_experts=s["experts"][0],
            num_experts_per_tok=s["experts"][1],
            sliding_window=128,
            max_position_embeddings=131072,
            tie_word_embeddings=False,
            **common,
        ),
    }


def build(out: Path, size: str) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()  # stdout is the list of models the script reads
    for name, config in configs(size).items():
        path = out / f"{name}-{size}"
        if not (path / "config.json").exists():  # reused between runs of the script
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(config).save_pretrained(path)
        print(f"{name}\t{path}")


def summarize(run_dir: Path) -> int:
    """Median pairs/s and MFU over the training steps after the first (warm-up, compilation, allocator). train.py
    logs throughput/mfu only with peak_tflops or on a GPU in estimate.DEVICES: otherwise MFU is "-"."""
    path = run_dir / "metrics.jsonl"
    steps = (
        [r for r in map(json.loads, path.read_text().splitlines()) if "throughput/pairs_per_second" in r]
        if path.exists()
        else []
    )
    steps = steps[1:] or steps
    if not steps or any(r.get("loss/train") is None for r in steps):  # no step, or a non-finite loss (logged as null)
        print(f"no finite training step in {path}", file=sys.stderr)
        return 1
    pairs = statistics.median(r["throughput/pairs_per_second"] for r in steps)
    mfu = [r["throughput/mfu"] for r in steps if r.get("throughput/mfu") is not None]
    print(f"{pairs:.2f}\t" + (f"{100 * statistics.median(mfu):.2f}%" if mfu else "-"))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build")
    b.add_argument("out", type=Path)
    b.add_argument("--size", choices=sorted(SIZES), default="small")
    s = sub.add_parser("summarize")
    s.add_argument("run_dir", type=Path)
    args = parser.parse_args()
    if args.command == "build":
        build(args.out, args.size)
        return 0
    return summarize(args.run_dir)


if __name__ == "__main__":
    sys.exit(main())
