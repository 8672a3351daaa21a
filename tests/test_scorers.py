"""The scorers of sampled completions (scorers.py) with real tokenizers and a tiny real reward model, and what
--estimate counts of a reward model scorer."""

import contextlib
import io
from pathlib import Path

import pytest
import torch
import transformers

import estimate
import scorers
import train as train_py
from config_loader import load_config

from conftest import LOCAL_DIRS

REPO = Path(__file__).resolve().parent.parent
# a Llama-3-style template: its text begins with BOS, which the toy tokenizer also adds by default
TEMPLATE = "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
ONLINE = ["model=tiny", "datasets=[toy]", "loss=dpo", "online.rounds=1", "max_length=64", "max_prompt_length=32"]
ONLINE += ["online.max_new_tokens=8", LOCAL_DIRS]


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory) -> Path:
    """A tiny random Llama sequence classifier saved with the toy tokenizer and a chat template that carries BOS."""
    path = tmp_path_factory.mktemp("rm")
    tokenizer = transformers.AutoTokenizer.from_pretrained(REPO / "toy" / "tiny-llama")
    tokenizer.chat_template = TEMPLATE
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_labels=1
    )
    transformers.LlamaForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_a_chat_prompt_is_scored_with_one_bos(reward_model):
    """The template's text already starts with BOS; tokenizing it again with special tokens gave the reward model
    <s><s>... and another score (#52 G5). A string prompt still gets the tokenizer's BOS."""
    cfg = load_config([*ONLINE, f"online.scorer=reward_model={reward_model}"])[0]
    score = scorers.make("online.scorer", f"reward_model={reward_model}", cfg, torch.device("cpu"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(reward_model)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(reward_model).eval()
    model.config.pad_token_id = tokenizer.eos_token_id  # as the scorer pads (the toy tokenizer has no pad token)
    chat = [{"role": "user", "content": "Tell me about cats."}]
    text = tokenizer.apply_chat_template(chat + [scorers.assistant(" cats purr.")], tokenize=False)
    once = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert once[0] == tokenizer.bos_token_id != once[1]
    with torch.no_grad():
        alone = lambda ids: model(input_ids=torch.tensor([ids])).logits[0, 0].item()  # noqa: E731
        expected, doubled = alone(once), alone([tokenizer.bos_token_id] + once)
    assert expected != pytest.approx(doubled, abs=1e-6)  # a doubled BOS does shift the score
    assert score([chat], [" cats purr."]) == pytest.approx([expected], abs=1e-5)
    plain = tokenizer("Hi. cats purr.")["input_ids"]
    assert plain[0] == tokenizer.bos_token_id
    with torch.no_grad():
        assert score(["Hi."], [" cats purr."]) == pytest.approx([alone(plain)], abs=1e-5)


def test_the_reward_model_waits_off_the_device_between_rounds(reward_model, monkeypatch):
    """It is loaded on CPU and comes to the device only while it scores, then goes back (#52 G4): the moves a call
    makes, here with the CPU as the device."""
    cfg = load_config([*ONLINE, f"online.scorer=reward_model={reward_model}"])[0]
    moves = []
    to = torch.nn.Module.to
    monkeypatch.setattr(torch.nn.Module, "to", lambda module, device: moves.append(str(device)) or to(module, device))
    score = scorers.make("online.scorer", f"reward_model={reward_model}", cfg, torch.device("cpu"))
    assert moves == []  # where from_pretrained loads it: on CPU
    score(["Hi."], [" cats."])
    assert moves == ["cpu", "cpu"]  # to the device for the call, then back to CPU


def test_estimate_counts_a_reward_model_scorer(reward_model, tmp_path):
    """--estimate reads the reward model's safetensors headers (else its config.json): its weights, whole on every
    rank while it scores, in a phase of their own and a line saying so."""
    model = transformers.AutoModelForSequenceClassification.from_pretrained(reward_model)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert estimate.reward_model_bytes(str(reward_model)) == weights
    (tmp_path / "config.json").write_text((reward_model / "config.json").read_text())  # no safetensors
    assert estimate.reward_model_bytes(str(tmp_path)) == weights
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert train_py.main([*ONLINE, f"online.scorer=reward_model={reward_model}", "--estimate"]) == 0
    assert "phase scoring" in out.getvalue() and "  reward model " in out.getvalue()
    assert f"reward model: online.scorer=reward_model={reward_model} counted whole on every rank" in out.getvalue()
