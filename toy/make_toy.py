"""Build the offline toy task: preference data, a byte-level BPE tokenizer and a tiny Llama-style model.

    python toy/make_toy.py          # rewrites toy/data/*.jsonl and toy/tiny-llama/ (deterministic)

The task. A user asks about a topic; the assistant answers with a few words about it. The SFT target of
each prompt is a coin flip between a calm answer ("cats purr and nap.") and the same answer SHOUTED
("CATS PURR AND NAP."), so an SFT model shouts about half of the time. The preference pairs always prefer
the calm answer. DPO should therefore move the policy from ~50% calm samples (the reference) to ~100%,
a rule anyone can check in generated text: `follows_rule` below (mirrored by preference_datasets.py).

The model loads through the same `from_pretrained` path as hub models: config.json, model.safetensors
(random init, seed 0) and the tokenizer files live in toy/tiny-llama/.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent

TOPICS = {
    "cats": ["cats", "purr", "nap", "chase", "mice", "whiskers", "soft", "curious"],
    "dogs": ["dogs", "bark", "fetch", "loyal", "tails", "walks", "friendly", "bones"],
    "rain": ["rain", "falls", "clouds", "wet", "puddles", "umbrella", "grey", "drops"],
    "bread": ["bread", "bake", "flour", "warm", "crust", "oven", "yeast", "slice"],
    "trees": ["trees", "grow", "leaves", "roots", "tall", "shade", "green", "bark"],
    "music": ["music", "songs", "play", "notes", "rhythm", "loud", "dance", "drums"],
    "ships": ["ships", "sail", "sea", "waves", "harbor", "crew", "deck", "wind"],
    "stars": ["stars", "shine", "night", "bright", "sky", "far", "light", "space"],
    "snow": ["snow", "cold", "white", "winter", "flakes", "melt", "ice", "quiet"],
    "bees": ["bees", "honey", "buzz", "flowers", "hive", "busy", "wings", "queen"],
    "trains": ["trains", "rails", "fast", "station", "tickets", "track", "engine", "travel"],
    "books": ["books", "read", "pages", "stories", "words", "library", "shelf", "learn"],
}
FILLER = ["and", "the", "they", "often", "very", "so", "with", "are"]
TEMPLATES = ["Tell me about {t}.", "What do you know about {t}?", "Say something about {t}.", "Describe {t}."]


def follows_rule(response: str) -> bool:
    """The preferred rule: the answer has letters and none of them is upper case (it does not shout)."""
    letters = re.sub(r"[^A-Za-z]", "", response)
    return bool(letters) and letters == letters.lower()


def make_example(rng: random.Random, index: int) -> dict:
    topic = rng.choice(sorted(TOPICS))
    words = [topic] + [rng.choice(TOPICS[topic] + FILLER) for _ in range(rng.randint(2, 5))]
    calm = " " + " ".join(words) + "."
    # The question number makes every prompt unique, so that pairs are not grouped under a few prompts.
    prompt = f"\n\nHuman: Question {index}. {rng.choice(TEMPLATES).format(t=topic)}\n\nAssistant:"
    return {
        "prompt": prompt,
        "chosen": calm,
        "rejected": calm.upper(),
        "sft_target": calm if rng.random() < 0.5 else calm.upper(),
    }


def make_data(n_train: int = 2000, n_test: int = 256, seed: int = 0) -> None:
    rng = random.Random(seed)
    out = HERE / "data"
    out.mkdir(exist_ok=True)
    index = 0
    for split, n in (("train", n_train), ("test", n_test)):
        with open(out / f"{split}.jsonl", "w") as f:
            for _ in range(n):
                index += 1
                f.write(json.dumps(make_example(rng, index)) + "\n")


def make_tokenizer(vocab_size: int = 512):
    """A byte-level BPE trained on the toy data; Llama-style: BOS added to every sequence, no pad token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    texts = []
    for line in open(HERE / "data" / "train.jsonl"):
        row = json.loads(line)
        texts += [row["prompt"] + row["chosen"], row["prompt"] + row["rejected"]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", model_max_length=512)


def make_model(tokenizer, seed: int = 0) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(HERE / "tiny-llama")
    tokenizer.save_pretrained(HERE / "tiny-llama")


if __name__ == "__main__":
    make_data()
    tokenizer = make_tokenizer()
    make_model(tokenizer)
    n = sum(
        p.numel()
        for p in __import__("safetensors.torch").torch.load_file(HERE / "tiny-llama" / "model.safetensors").values()
    )
    print(f"wrote {HERE / 'data'} and {HERE / 'tiny-llama'}: vocab {len(tokenizer)}, {n:,} parameters")
