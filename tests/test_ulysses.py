"""Ulysses sequence parallelism (ulysses.py) below the trainer: on 2 gloo ranks, the log-probs, entropies and
gradients of forward_logps with the sequence split over the ranks equal the same rows scored whole; and the
configurations it cannot run are refused before any model loads (exit 2).

The trainer-level checks (one DPO step under FSDP1 and FSDP2 equals one process, Llama and Qwen2, padded and
packed) run in tests/test_architectures.py's spawn, which this file does not repeat.
"""

import os
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers

import logps
import packing
import ulysses
from config import ConfigError
from architectures import seams
from utils import get_open_port

REPO = Path(__file__).resolve().parent.parent
WEIGHTS = torch.tensor([1.0, -2.0, 3.0])  # a loss that weighs the three rows differently


def tiny_llama(kv_heads: int, attention: str):
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        intermediate_size=128,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attention)


def tiny_mistral():
    config = transformers.MistralConfig(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=128,
        sliding_window=8,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")


def rows() -> dict[str, torch.Tensor]:
    """Three rows of 37 tokens (odd: the split pads), two right-padded, 5 prompt tokens unscored."""
    ids = torch.randint(2, 256, (3, 37), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 30:] = mask[2, 20:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :5] = -100
    return {"input_ids": ids * mask, "attention_mask": mask, "labels": labels}


def compare(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=120))
    torch.set_num_threads(1)
    sp = ulysses.make_group(torch.device("cpu"), 2, 2)
    worst = {}
    # kv_heads 2: split over the 2 ranks with the query heads; kv_heads 1: repeated to one per query head first
    for kv_heads, attention in ((2, "sdpa"), (1, "sdpa"), (2, "eager"), (1, "eager")):
        model = tiny_llama(kv_heads, attention)
        ulysses.install(model, sp)
        for packed in (None, 64):
            for tiled in (False, True):
                options = dict(packed_capacity=packed, tiled=tiled)
                model.zero_grad()
                with ulysses.paused():  # the reference: whole rows on this rank, plain attention
                    sums, counts, entropy, *_ = logps.forward_logps(model, rows(), **seams(model, **options))
                (sums * WEIGHTS).sum().backward()
                whole = {n: p.grad.clone() for n, p in model.named_parameters()}
                model.zero_grad()
                split_sums, split_counts, split_entropy, *_ = logps.forward_logps(
                    model, rows(), **seams(model, sequence_parallel=sp, **options)
                )
                # each rank holds the same loss; summing the ranks' gradients (as FSDP's reduction does, then
                # divides by the 2 ranks) must give the whole-row gradient
                (split_sums * WEIGHTS).sum().div(2).backward()
                grads = {n: p.grad.clone() for n, p in model.named_parameters()}
                for g in grads.values():
                    dist.all_reduce(g)
                key = f"kv{kv_heads}-{attention}-{'packed' if packed else 'padded'}-{'tiled' if tiled else 'plain'}"
                worst[key] = {
                    "counts_equal": torch.equal(counts, split_counts),
                    "logps": ((split_sums - sums).abs() / sums.abs()).max().item(),
                    "entropy": (split_entropy - entropy).abs().max().item(),
                    "grads": max(
                        ((grads[n] - whole[n]).abs().max() / whole[n].abs().max().clamp(min=1e-12)).item()
                        for n in whole
                    ),
                }
    # FSDP2 swaps a sharded module's class for a dynamic FSDP<cls> subclass defined in torch's own module: eager
    # attention must still find its architecture's function (before: AttributeError on torch's module)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = tiny_llama(2, "eager")
    ulysses.install(model, sp)
    with ulysses.paused():
        sums, _, _, *_ = logps.forward_logps(model, rows())
    for layer in model.model.layers:
        fully_shard(layer.self_attn, mesh=init_device_mesh("cpu", (2,)))
    assert type(model.model.layers[0].self_attn).__module__.startswith("torch.")
    split_sums, _, _, *_ = logps.forward_logps(model, rows(), **seams(model, sequence_parallel=sp))
    worst["fsdp2-eager"] = {
        "counts_equal": True,
        "logps": ((split_sums - sums).abs() / sums.abs()).max().item(),
        "entropy": 0.0,
        "grads": 0.0,
    }
    # the GPU path (FLEX_DEVICES, here CPU): packed rows and a sliding window's band (Mistral, window 8) are block
    # masks over whole sequences, FlexAttention after the all-to-all; forward only (CPU FlexAttention has no backward),
    # transformers' compiled FlexAttention swapped for the eager one (inductor's CPU kernel fails to build for these)
    from torch.nn.attention.flex_attention import flex_attention as eager_flex_attention
    from transformers.integrations import flex_attention

    packing.FLEX_DEVICES = ("cpu",)
    flex_attention.compile_friendly_flex_attention = lambda q, k, v, training=False, **kw: eager_flex_attention(
        q, k, v, **kw
    )
    calls, forward = [], flex_attention.flex_attention_forward
    flex_attention.flex_attention_forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
    for name, model, packed in (("flex-packed", tiny_llama(2, "sdpa"), 64), ("flex-window", tiny_mistral(), None)):
        ulysses.install(model, sp)
        with torch.no_grad():
            with ulysses.paused():  # the reference: padded whole rows, the model's own masks
                sums, counts, *_ = logps.forward_logps(model, rows())
            calls.clear()
            split_sums, split_counts, *_ = logps.forward_logps(
                model, rows(), **seams(model, packed_capacity=packed, sequence_parallel=sp)
            )
        worst[name] = {
            "counts_equal": torch.equal(counts, split_counts) and len(calls) == 2,  # both layers: flex
            "logps": ((split_sums - sums).abs() / sums.abs()).max().item(),
            "entropy": 0.0,
            "grads": 0.0,
        }
    torch.save(worst, Path(out) / f"compare-{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    out = tmp_path_factory.mktemp("ulysses")
    mp.spawn(compare, args=(get_open_port(), str(out)), nprocs=2, join=True)
    return [torch.load(out / f"compare-{r}.pt") for r in range(2)]


def test_split_sequences_equal_whole_rows(compared):
    """Per sequence: summed log-probs (relative 1e-5), token counts (exact), mean entropies (1e-5) and the weighted
    loss's gradients (relative to each tensor's largest entry, 1e-5): sdpa and eager, KV heads split or repeated,
    padded and packed rows, full logits and the tiled LM head (its entropies too), on both ranks; and the log-probs of eager attention
    modules sharded by FSDP2 (whose class then lives in torch); and, forward only, the GPU path's FlexAttention block
    masks for packed rows and a sliding window's band (each layer's attention went through FlexAttention)."""
    assert len(compared[0]) == 19
    for rank, worst in enumerate(compared):
        for key, w in worst.items():
            assert w["counts_equal"], (rank, key)
            assert w["logps"] <= 1e-5 and w["entropy"] <= 1e-5 and w["grads"] <= 1e-5, (rank, key, w)


class _StopBeforeTheModel(Exception):
    pass


@pytest.mark.parametrize("case", ["padding_free", "sliding window", "window over the rows"])
def test_on_gpus_sequence_parallel_rows_get_block_masks_not_dense_ones(monkeypatch, case):
    """The GPU path of Ulysses (FLEX_DEVICES; here on CPU), one rank of two, rows of 4096 tokens: packed rows and a
    sliding window's band are FlexAttention block masks over whole sequences (the builder stubbed: on GPUs it is
    compiled, on CPU it would materialize the mask it compresses), a window holding the rows keeps the causal
    stand-in, and nothing while the inputs are built allocates (T, T) (before: a dense (R, 1, T, T) mask and a
    (1, 1, T, T) band). An sdpa model without FlexAttention is refused before loading (the next test). What sdpa or
    FlexAttention allocate inside is a CUDA kernel's: a CPU run cannot reach it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    t, built, handed = 4096, [], {}
    monkeypatch.setattr(packing, "FLEX_DEVICES", ("cpu",))
    monkeypatch.setattr(
        packing,
        "_block_mask_builder",
        lambda device_type: (
            lambda mask_mod, b, h, q, kv, device: built.append((mask_mod, q, kv)) or f"block mask {len(built)}"
        ),
    )

    def stop(model, call, rows, sum_sq=False):  # forward_logps' head: handed the rows the model would see
        handed.update(rows.kwargs)
        raise _StopBeforeTheModel

    class Largest(TorchDispatchMode):
        bytes = 0  # storage: a stand-in expanded to (T, T) holds one element

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for x in out if isinstance(out, (tuple, list)) else [out]:
                Largest.bytes = max(Largest.bytes, x.untyped_storage().nbytes() if isinstance(x, torch.Tensor) else 0)
            return out

    config_class, options = {
        "padding_free": (transformers.LlamaConfig, dict(packed_capacity=2 * t)),
        "sliding window": (transformers.MistralConfig, dict(sliding_window=16)),
        "window over the rows": (transformers.MistralConfig, dict(sliding_window=t)),
    }[case]
    model = transformers.AutoModelForCausalLM.from_config(
        config_class(
            vocab_size=256,
            hidden_size=64,
            n_embd=64,
            num_hidden_layers=1,
            n_layer=1,
            num_attention_heads=4,
            n_head=4,
            num_key_value_heads=2,
            intermediate_size=128,
            **{k: v for k, v in options.items() if k == "sliding_window"},
        )
    )
    ids = torch.randint(2, 256, (2, t), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 3000:] = 0
    inputs = {"input_ids": ids * mask, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    sp = ulysses.SequenceParallel(group=None, rank=1, size=2)
    layout = seams(model, sequence_parallel=sp, packed_capacity=options.get("packed_capacity"))
    with Largest(), pytest.raises(_StopBeforeTheModel):
        logps.forward_logps(model, inputs, head=stop, **layout)
    assert Largest.bytes <= 64 * t, f"{Largest.bytes} bytes: a (T, T) boolean mask has {t * t}"
    if case == "window over the rows":
        assert not built and handed["attention_mask"].causal_only
        return
    # the last mask built, over whole rows: twice this rank's slice of positions
    whole_row = 2 * handed["input_ids"].shape[1]
    assert handed["attention_mask"] == f"block mask {len(built)}" and built[-1][1:] == (whole_row, whole_row)
    if case == "sliding window":  # row 0's band, at a few queries: keys within 16 positions before the query
        q, k = torch.tensor([0, 15, 16, 4095])[:, None], torch.arange(t)[None, :]
        assert torch.equal(built[-1][0](torch.tensor(0), 0, q, k), (k <= q) & (q - k < 16))


@pytest.mark.parametrize("padding_free", [True, False])
def test_on_gpus_packed_rows_or_a_window_without_flex_attention_are_refused_before_loading(monkeypatch, padding_free):
    """On CUDA, Ulysses' packed rows or a sliding window through an sdpa model without FlexAttention would keep a dense
    (T, T) mask in every layer: ulysses.check refuses them from config.json alone (train.check_inputs), naming the
    key and the model class: GPT-2 with padding_free; Mistral (which has FlexAttention) with its window is accepted;
    without padding_free or a window GPT-2 is accepted too. CPU keeps the dense mask: no refusal there."""
    cfg = SimpleNamespace(
        model=SimpleNamespace(name_or_path="tiny/gpt2"),
        fsdp=SimpleNamespace(ulysses_sequence_parallel_size=2),
        padding_free=padding_free,
    )
    gpt2, mistral = transformers.GPT2Config(n_head=4), transformers.MistralConfig(sliding_window=16)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ulysses.check(cfg, gpt2)  # CPU: the dense mask is what it runs
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    ulysses.check(cfg, mistral)
    if not padding_free:
        ulysses.check(cfg, gpt2)
        return
    expected = "padding_free=true: GPT2LMHeadModel (model type 'gpt2') does not attend through FlexAttention"
    with pytest.raises(ConfigError, match=re.escape(expected) + ".*set padding_free=false"):
        ulysses.check(cfg, gpt2)


def run_cfg(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="disabled")
    return subprocess.run(
        [sys.executable, str(REPO / "train.py"), *args, "--cfg"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO,
    )


@pytest.mark.parametrize(
    "args,reason",
    [
        (
            ["n_workers=3", "batch_size=6", "eval_batch_size=6", "fsdp.ulysses_sequence_parallel_size=3"],
            "fsdp.ulysses_sequence_parallel_size=3: expected a divisor of the 4 attention heads",
        ),
        (
            ["n_workers=2", "fsdp.ulysses_sequence_parallel_size=4"],
            "fsdp.ulysses_sequence_parallel_size=4: expected a divisor of the world size 2",
        ),
    ],
)
def test_sequence_parallel_that_cannot_split_exits_2_before_loading(args, reason):
    """The toy model has 4 attention heads: SP=3 (dividing the 3 ranks) cannot give each rank whole heads; SP=4 on 2
    ranks has no group to form. Both exit 2 with the reason, from the config check (--cfg loads no model)."""
    result = run_cfg("trainer=FSDPTrainer", *args)
    assert result.returncode == 2, result.stderr[-2000:]
    assert reason in result.stderr and "Traceback" not in result.stderr


def test_sequence_parallel_config_that_fits_is_accepted():
    """The same check passes SP=2 on 2 ranks (4 heads): what the two refusals above refuse is the geometry."""
    result = run_cfg("trainer=FSDPTrainer", "n_workers=2", "fsdp.ulysses_sequence_parallel_size=2")
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_rope_types_that_scale_by_the_longest_position_are_refused_under_sequence_parallelism(tmp_path, rope_type):
    """Dynamic and longrope RoPE choose frequencies from the largest position in the call: each rank of a group
    would pick its own from its slice. Refused before loading (before: silently different rotations per rank)."""
    import json
    import shutil

    model = tmp_path / "model"
    shutil.copytree(REPO / "toy" / "tiny-llama", model)
    config = json.loads((model / "config.json").read_text())
    config["rope_scaling"] = {
        "rope_type": rope_type,
        "factor": 2.0,
        **(
            {"short_factor": [1.0] * 4, "long_factor": [1.0] * 4, "original_max_position_embeddings": 64}
            if rope_type == "longrope"
            else {}
        ),
    }
    (model / "config.json").write_text(json.dumps(config))
    result = run_cfg(
        "trainer=FSDPTrainer", "n_workers=2", "fsdp.ulysses_sequence_parallel_size=2", f"model.name_or_path={model}"
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"its RoPE type '{rope_type}'" in result.stderr and "Traceback" not in result.stderr
