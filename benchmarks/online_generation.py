"""Semi-online DPO's sampling (online.shared_prefix_generate: each prompt prefilled once, its KV cache repeated for its
n samples) against generate's num_return_sequences (n copies of each prompt prefilled), A/B in one run: HH-shaped
prompts (random token ids, 180-220 tokens, left-padded in groups), short answers, n samples per prompt, the two methods
alternating over the repeats on a random Llama-style model. Prints generated tokens/s of each (median and range over
the repeats) and whether both drew the same tokens from the same seed.

    python -u benchmarks/online_generation.py --threads 1                  # CPU: 8 prompts x 4 samples, 50M model
    python -u benchmarks/online_generation.py --model 1b --device cuda --prompts 64
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from online import shared_prefix_generate  # noqa: E402
from sharding import OneProcess  # noqa: E402

GEOMETRIES = {  # Llama-style, random weights
    "50m": dict(
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        intermediate_size=1408,
        vocab_size=32000,
    ),
    "1b": dict(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=8192,
        vocab_size=128256,
        tie_word_embeddings=True,
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=GEOMETRIES, default="50m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per generate call")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:  # on shared cores, one thread spares each small decode op the wait for a second core
        torch.set_num_threads(args.threads)
    from transformers import LlamaConfig, LlamaForCausalLM

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    torch.manual_seed(0)
    model = (
        LlamaForCausalLM(LlamaConfig(**GEOMETRIES[args.model], max_position_embeddings=1024)).to(device, dtype).eval()
    )
    model.generation_config.eos_token_id = None  # random weights: every sample is new_tokens long, for both methods
    lengths = torch.randint(180, 221, (args.prompts,)).tolist()
    ids = torch.zeros(args.prompts, max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):  # left-padded, as online.py batches a group
        ids[row, -length:] = torch.randint(2, model.config.vocab_size, (length,))
        mask[row, -length:] = 1
    ids, mask = ids.to(device), mask.to(device)
    sharding = OneProcess(model, types.SimpleNamespace(activation_checkpointing=False))
    sampling = dict(max_new_tokens=args.new_tokens, temperature=1.0, top_p=1.0, pad_token_id=0)

    def plain() -> torch.Tensor:
        return model.generate(
            input_ids=ids, attention_mask=mask, do_sample=True, num_return_sequences=args.n, **sampling
        )[:, ids.size(1) :]

    def shared() -> torch.Tensor:
        return shared_prefix_generate(sharding, model, ids, mask, args.n, **sampling)

    methods, seconds, outputs = {"num_return_sequences": plain, "shared prefix": shared}, {}, {}
    for name, method in methods.items():  # warm-up: allocator, kernels
        torch.manual_seed(1)
        method()
    for repeat in range(args.repeats):
        for name in list(methods)[:: 1 if repeat % 2 == 0 else -1]:  # alternate which goes first
            torch.manual_seed(repeat)
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.no_grad():
                out = methods[name]()
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds.setdefault(name, []).append(time.perf_counter() - start)
            outputs.setdefault(name, []).append(out.cpu())
    tokens = args.prompts * args.n * args.new_tokens
    print(
        f"model {args.model} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {dtype}) on "
        f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; {args.prompts} prompts of {min(lengths)}-{max(lengths)} tokens x "
        f"{args.n} samples x {args.new_tokens} new tokens per call, {args.repeats} repeats"
    )
    print("| method | generated tokens/s (median) | range | s per call (median) |\n|---|---|---|---|")
    for name, times in seconds.items():
        rates = [tokens / s for s in times]
        print(
            f"| {name} | {statistics.median(rates):.0f} | {min(rates):.0f}-{max(rates):.0f} | {statistics.median(times):.3f} |"
        )
    ratio = statistics.median(seconds["num_return_sequences"]) / statistics.median(seconds["shared prefix"])
    same = all(torch.equal(a, b) for a, b in zip(outputs["num_return_sequences"], outputs["shared prefix"]))
    print(
        f"shared prefix / num_return_sequences: {ratio:.2f}x generated tokens/s; same tokens from the same seed: {same}"
    )


if __name__ == "__main__":
    main()
