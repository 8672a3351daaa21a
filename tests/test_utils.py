"""utils.py: rank-aware printing, block-class lookup and the small file helpers."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

import utils

REPO = Path(__file__).resolve().parent.parent


def test_rank0_print_prints_only_on_rank_zero():
    code = "import utils; utils.rank0_print('hello from', utils.get_rank())"
    outputs = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank))
        outputs.append(
            subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env).stdout
        )
    assert outputs == ["hello from 0\n", ""]


def tiny_gpt2():
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=32))


def test_block_class_lookup_finds_the_transformer_block():
    model = tiny_gpt2()
    cls = utils.get_block_class_from_model(model, "GPT2Block")
    assert cls.__name__ == "GPT2Block"
    assert sum(isinstance(m, cls) for m in model.modules()) == 2
    llama = LlamaForCausalLM(
        LlamaConfig(
            num_hidden_layers=2,
            hidden_size=16,
            intermediate_size=32,
            num_attention_heads=2,
            num_key_value_heads=2,
            vocab_size=50,
        )
    )
    assert utils.get_block_class_from_model(llama, "LlamaDecoderLayer").__name__ == "LlamaDecoderLayer"
    assert utils.find_block_class_names(llama) == ["LlamaDecoderLayer"]


def test_block_class_lookup_error_lists_candidates():
    with pytest.raises(
        ValueError, match=r"no module of class 'GPTNeoXLayer' in GPT2LMHeadModel; its module classes are: .*GPT2Block"
    ):
        utils.get_block_class_from_model(tiny_gpt2(), "GPTNeoXLayer")


def test_disable_dropout_zeroes_every_dropout():
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=32, resid_pdrop=0.3))
    utils.disable_dropout(model)
    assert all(m.p == 0.0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
    model.train()
    x = torch.arange(10)[None]
    assert torch.equal(model(x).logits, model(x).logits)


def test_atomic_write_replaces_whole_file(tmp_path):
    path = tmp_path / "f.txt"
    utils.atomic_write_text(path, "old")
    utils.atomic_write_text(path, "new")
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["f.txt"]


def test_local_run_dir_is_unique_and_under_first_usable_dir(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")
    a = utils.get_local_run_dir("exp", [str(blocked / "sub"), str(tmp_path / "runs_root")])
    b = utils.get_local_run_dir("exp", [str(tmp_path / "runs_root")])
    assert a != b and a.parent == b.parent == tmp_path / "runs_root" / "runs" and a.name.startswith("exp_")


def test_cudnn_attention_is_turned_off_on_cuda_only():
    """cuDNN's SDPA builds a graph per shape (7-10 ms of CPU per call on an H200): trainers on CUDA turn it off."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        utils.use_shape_free_attention(torch.device("cpu"))
        assert torch.backends.cuda.cudnn_sdp_enabled()
        utils.use_shape_free_attention(torch.device("cuda", 0))
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def test_rng_state_round_trip():
    utils.seed_everything(3)
    state = utils.get_rng_state()
    a = torch.rand(3)
    utils.set_rng_state(state)
    assert torch.equal(a, torch.rand(3))


def test_disable_dropout_reaches_attention_modules():
    """Attention modules copy config.attention_dropout when built: disable_dropout zeroes their copy too, or a model
    whose config has attention dropout would train DPO with it (and FlexAttention refuses dropout)."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=64,
        attention_dropout=0.1,
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    utils.disable_dropout(model)
    assert model.config.attention_dropout == 0.0
    assert [m.attention_dropout for m in model.modules() if hasattr(m, "attention_dropout")] == [0.0]


def test_disable_dropout_stops_a_routers_input_noise():
    """Mixtral multiplies the router's input by uniform noise in training mode (router_jitter_noise): two forwards of
    the same weights differ until disable_dropout zeroes it."""
    config = MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        router_jitter_noise=0.5,
    )
    model, ids = MixtralForCausalLM(config).train(), torch.arange(16).view(1, 16)
    assert not torch.equal(model(ids).logits, model(ids).logits)
    utils.disable_dropout(model)
    assert torch.equal(model(ids).logits, model(ids).logits) and model.config.router_jitter_noise == 0.0
