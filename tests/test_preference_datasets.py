"""Tests for sources.py and preference_datasets.py: converters, row checks, tokenization invariants, batching, caching,
bad input.

Real components throughout: byte-level BPE tokenizers trained here with the `tokenizers` library and wrapped in
transformers.PreTrainedTokenizerFast (one GPT-2-like, one Llama-like that adds BOS), real files, a real
datasets.Dataset for the hub path.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import dataclasses  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import pickle  # noqa: E402  (to plant an old-format cache file, never to read one)
import math  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

import logps  # noqa: E402
import packing  # noqa: E402
import preference_datasets as pd  # noqa: E402
import sources  # noqa: E402

REPO = Path(pd.__file__).resolve().parent
BAD_DATA = Path(__file__).resolve().parent / "data" / "bad_data"

CORPUS = [
    "\n\nHuman: hello there, how are you today?\n\nAssistant: I am fine, thank you. hello hello!",
    "\n\nHuman: Tell me about cats.\n\nAssistant: cats purr and nap and chase mice.",
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France.",
    "def reverse(xs): return xs[::-1]  # Python lists reverse in place with .reverse()",
] * 20
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def train_bpe(specials: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(
            vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    return tok


@pytest.fixture(scope="module")
def gpt2_tok():
    """GPT-2-like: no BOS, EOS '<|endoftext|>', a separate pad token."""
    return PreTrainedTokenizerFast(
        tokenizer_object=train_bpe(["<|endoftext|>", "<pad>"]), eos_token="<|endoftext|>", pad_token="<pad>"
    )


def make_llama_tok(chat_template=None):
    """Llama-like: the post-processor puts BOS '<s>' first by default; EOS '</s>'; no pad token."""
    tok = train_bpe(["<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    out = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    if chat_template:
        out.chat_template = chat_template
    return out


@pytest.fixture(scope="module")
def llama_tok():
    return make_llama_tok()


@pytest.fixture(scope="module")
def chat_tok():
    return make_llama_tok(CHAT_TEMPLATE)


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def numbered_rows(n: int) -> list[dict]:
    return [
        {"prompt": f"\n\nHuman: question {i}?\n\nAssistant:", "chosen": f" good answer {i}.", "rejected": f" bad {i}"}
        for i in range(n)
    ]


def by_prompt(converted: tuple) -> tuple[dict, Counter]:
    """A converter's (entries, dropped) as ({prompt: entry}, dropped), the entries read first (drops count as read)."""
    entries, dropped = converted
    return {entry.prompt: entry for entry in entries}, dropped


def hh_row(history: str, chosen: str, rejected: str) -> dict:
    return {"chosen": history + chosen, "rejected": history + rejected}


def batch_iterator(path: str, tok, *, split: str = "train", **kw):
    """get_batch_iterator over a file tokenized as the trainer reads it (load options such as sft_mode go there)."""
    options = {f.name for f in dataclasses.fields(pd.LoadOptions)}
    examples = pd.load_tokenized([path], tok, split, **{k: v for k, v in kw.items() if k in options})
    return pd.get_batch_iterator(examples, tok.pad_token_id, **{k: v for k, v in kw.items() if k not in options})


# ---------------------------------------------------------------------------------------------------------
# Converters on hand-written raw rows
# ---------------------------------------------------------------------------------------------------------


def test_hh_multiturn_history_stays_in_prompt():
    history = "\n\nHuman: Hi\n\nAssistant: Hello! How can I help?\n\nHuman: What does 'Assistant:' mean?\n\nAssistant:"
    rows = [
        hh_row(history, " It names the speaker.", " No idea."),
        hh_row(history, " A label.", " It names the speaker."),
    ]
    data, dropped = by_prompt(sources.convert_hh(rows))
    assert list(data) == [history] and not dropped
    entry = data[history]
    assert entry.responses == [" It names the speaker.", " No idea.", " A label."]
    assert entry.pairs == [(0, 1), (2, 0)]
    assert entry.sft_targets == [" A label."]  # the last chosen, as the original


def test_hh_response_containing_the_marker_is_split_where_both_agree():
    history = "\n\nHuman: Write a dialogue.\n\nAssistant:"
    chosen = " Sure.\n\nAssistant: (continues)"  # the marker inside a response must not move the split
    data, dropped = by_prompt(sources.convert_hh([hh_row(history, chosen, " No.")]))
    assert list(data) == [history] and data[history].responses == [chosen, " No."] and not dropped


def test_hh_rows_with_different_histories_are_dropped_and_counted():
    a = "\n\nHuman: A\n\nAssistant: x\n\nHuman: B\n\nAssistant: y"
    b = "\n\nHuman: A\n\nAssistant: z\n\nHuman: C\n\nAssistant: w"
    data, dropped = by_prompt(
        sources.convert_hh([{"chosen": a, "rejected": b}, {"chosen": "no marker", "rejected": "none"}])
    )
    assert data == {} and dropped == {"no_shared_prompt": 2}


def shp_row(history, a, b, label, score_a, score_b):
    return {
        "history": history,
        "human_ref_A": a,
        "human_ref_B": b,
        "labels": label,
        "score_A": score_a,
        "score_B": score_b,
    }


def test_shp_ratio_filter_label_direction_sft_target_and_pair_cap():
    rows = [
        shp_row("post", "A1", "B1", 1, 10, 3),  # kept, A preferred
        shp_row("post", "A2", "B2", 0, 2, 30),  # kept, B preferred, best score -> SFT target
        shp_row("post", "A3", "B3", 1, 3, 2),  # ratio 1.5 < 2: dropped
        shp_row("post", "A4", "B4", 1, 0, 0),
    ]  # 0 vs 0: no preference, dropped
    rows += [shp_row("busy", f"a{i}", f"b{i}", 1, 4, 1) for i in range(sources.MAX_PAIRS_PER_PROMPT + 2)]
    data, dropped = by_prompt(sources.convert_shp(rows))
    post = data["\n\nHuman: post\n\nAssistant:"]
    assert [(post.responses[i], post.responses[j]) for i, j in post.pairs] == [(" A1", " B1"), (" B2", " A2")]
    assert post.sft_targets == [" B2"]
    assert len(data["\n\nHuman: busy\n\nAssistant:"].pairs) == sources.MAX_PAIRS_PER_PROMPT
    assert dropped == {"shp_score_ratio_below_2": 2, "over_pair_cap": 2}


def test_se_html_stripped_no_ties_best_answer_and_cap():
    row = {
        "question": "<p>How do I <b>reverse</b> a list?</p>\n<pre><code>xs = [1, 2]\n</code></pre>",
        "answers": [
            {"text": "<p>Use <code>xs[::-1]</code> &amp; done.</p>", "pm_score": 5},
            {"text": "<p>You can't.</p>", "pm_score": 1},
            {"text": "<p>Loop backwards.</p>", "pm_score": 1},
        ],
    }
    data, dropped = by_prompt(sources.convert_se([row]))
    ((prompt, entry),) = data.items()
    assert prompt == "\n\nHuman: How do I reverse a list?\n\nxs = [1, 2]\n\nAssistant:"
    assert entry.responses == [" Use xs[::-1] & done.", " You can't.", " Loop backwards."]
    assert entry.pairs == [(0, 1), (0, 2)] and dropped == {"se_tie": 1}
    assert entry.sft_targets == [" Use xs[::-1] & done."]
    many = {"question": "q", "answers": [{"text": f"a{i}", "pm_score": i} for i in range(5)]}  # 10 pairs
    data, dropped = by_prompt(sources.convert_se([many]))
    assert len(data["\n\nHuman: q\n\nAssistant:"].pairs) == sources.MAX_PAIRS_PER_PROMPT
    assert dropped == {"over_pair_cap": 10 - sources.MAX_PAIRS_PER_PROMPT}


def test_implicit_prompt_is_the_shared_opening_at_a_turn_boundary():
    """One rule for rows without a prompt: conversations share their opening messages (each keeps its last, the
    reply); HH-style transcripts share their text up to the last "\\n\\nAssistant:" within it. None where the
    replies are not one assistant message, no message is shared, or the histories differ."""
    user, system = {"role": "user", "content": "Hi"}, {"role": "system", "content": "Be brief."}
    reply = lambda text: {"role": "assistant", "content": text}  # noqa: E731
    assert sources.implicit_prompt([system, user, reply("a")], [system, user, reply("b")]) == (
        [system, user],
        [reply("a")],
        [reply("b")],
    )
    same = [user, reply("a")]
    assert sources.implicit_prompt(same, same) == ([user], [reply("a")], [reply("a")])  # no signal: dropped later
    longer = [user, reply("a"), {"role": "user", "content": "more"}, reply("c")]
    assert sources.implicit_prompt([user, reply("a")], longer) is None  # the replies: one message and three
    assert sources.implicit_prompt([reply("a")], [reply("b")]) is None  # nothing shared: no prompt
    history = "\n\nHuman: Hi\n\nAssistant: Hello.\n\nHuman: Name a prime.\n\nAssistant:"
    assert sources.implicit_prompt(history + " 7", history + " 8") == (history, " 7", " 8")
    assert sources.implicit_prompt("\n\nHuman: a\n\nAssistant: x", "\n\nHuman: b\n\nAssistant: x") is None


def test_ultrafeedback_rows_take_the_implicit_prompt_and_render_with_the_chat_template(chat_tok):
    """HuggingFaceH4/ultrafeedback_binarized's rows: a prompt string beside whole conversations; the conversations'
    shared opening is the prompt, rendered by the chat template (its EOS stripped from the replies); a row whose
    conversations open differently is dropped and counted."""
    user = {"role": "user", "content": "Name a prime."}
    row = {
        "prompt": "Name a prime.",
        "chosen": [user, {"role": "assistant", "content": "7"}],
        "rejected": [user, {"role": "assistant", "content": "8"}],
        "score_chosen": 9.0,
        "score_rejected": 2.0,
    }
    odd = {
        "chosen": [user, {"role": "assistant", "content": "7"}],
        "rejected": [{"role": "user", "content": "other"}, {"role": "assistant", "content": "8"}],
    }
    assert sources.SOURCES["ultrafeedback"].convert is sources.convert_implicit
    data, dropped = by_prompt(sources.convert_implicit([row, odd], chat_tok))
    ((prompt, entry),) = data.items()
    assert prompt == "<s><|user|>\nName a prime.</s>\n<|assistant|>\n"
    assert entry.responses == ["7", "8"] and entry.pairs == [(0, 1)] and entry.chat  # template's EOS stripped
    assert dropped == {"no_shared_prompt": 1}


# ---------------------------------------------------------------------------------------------------------
# Rows without a prompt (HH transcripts, whole conversations): one implicit-prompt rule
# ---------------------------------------------------------------------------------------------------------


def load_one(path, tok, **kw):
    examples = pd.load_tokenized([path], tok, "train", **kw)
    (stats,) = examples.stats
    return examples, stats


def test_local_raw_hh_file_is_split_like_the_hub_source(tmp_path, gpt2_tok, monkeypatch):
    """A user's export of Anthropic/hh-rlhf ({chosen, rejected} transcripts) loads by the implicit-prompt rule with
    the HH converter's split, drops and counts, and keep_end by default: what `datasets=[hh]` gives on the same rows."""
    import datasets

    history = "\n\nHuman: " + "hello there " * 40 + "\n\nAssistant:"
    rows = [
        hh_row(history, " fine.", " bad."),
        hh_row("\n\nHuman: hi\n\nAssistant:", " hello.", " no."),
        {
            "chosen": "\n\nHuman: A\n\nAssistant: x\n\nHuman: B\n\nAssistant: y",
            "rejected": "\n\nHuman: A\n\nAssistant: z\n\nHuman: C\n\nAssistant: w",
        },
    ]  # histories differ
    path = write_jsonl(tmp_path / "hh_export.jsonl", rows)
    sources.validate_sources([path])
    local, local_stats = load_one(path, gpt2_tok, max_length=40, max_prompt_length=20)
    dataset = datasets.Dataset.from_list(rows)
    monkeypatch.setitem(
        sources.SOURCES, "hh", dataclasses.replace(sources.SOURCES["hh"], fetch=lambda split, cd: dataset)
    )
    hub, hub_stats = load_one("hh", gpt2_tok, max_length=40, max_prompt_length=20)
    assert local_stats.dropped == hub_stats.dropped == {"no_shared_prompt": 1}
    assert local_stats.truncation_mode == "keep_end" and local_stats.kept == 2
    assert [(e.prompt, e.chosen, e.rejected, e.prompt_ids.tolist()) for e in local] == [
        (e.prompt, e.chosen, e.rejected, e.prompt_ids.tolist()) for e in hub
    ]
    long_prompt = next(e for e in local if e.prompt == history)
    assert long_prompt.prompt_ids.tolist() == gpt2_tok(history)["input_ids"][-20:]  # ends in "\n\nAssistant:"


def test_raw_shp_exports_are_refused_and_ultrafeedback_rows_take_the_implicit_prompt(tmp_path, chat_tok):
    """A raw SHP export (history, human_ref_A, ...) is no pair file: refused, naming the fields found (convert it, or
    use datasets=[shp]). UltraFeedback rows (prompt string, whole conversations in chosen/rejected, as
    ultrafeedback_binarized exports them) take the implicit prompt, drops counted."""
    shp = [{"history": "post", "human_ref_A": "A1", "human_ref_B": "B1", "labels": 1, "score_A": 10, "score_B": 3}]
    with pytest.raises(sources.DataError, match=r"line 1: missing field 'prompt' .*found 'history', 'human_ref_A'"):
        load_one(write_jsonl(tmp_path / "shp.jsonl", shp), chat_tok)
    user = {"role": "user", "content": "Name a prime."}
    uf = [
        {
            "prompt": "Name a prime.",
            "prompt_id": "x1",
            "chosen": [user, {"role": "assistant", "content": "7"}],
            "rejected": [user, {"role": "assistant", "content": "8"}],
            "score_chosen": 9.0,
            "score_rejected": 2.0,
        },
        {
            "prompt": "other",
            "chosen": [user, {"role": "assistant", "content": "7"}],
            "rejected": [{"role": "user", "content": "other"}, {"role": "assistant", "content": "8"}],
        },
    ]
    (example,), stats = load_one(write_jsonl(tmp_path / "uf.jsonl", uf), chat_tok)
    assert (example.prompt, example.chosen, example.rejected) == (
        "<s><|user|>\nName a prime.</s>\n<|assistant|>\n",
        "7",
        "8",
    )
    assert stats.dropped == {"no_shared_prompt": 1} and stats.truncation_mode == "keep_end"
    assert stats.origin.endswith("uf.jsonl (implicit prompt)")


def test_conversation_prompts_in_local_files_keep_their_end_by_default(tmp_path, llama_tok):
    """A {prompt, chosen, rejected} file whose prompts end in "\\n\\nAssistant:" is truncated keep_end (it kept
    the start before, cutting off the cue to reply); a plain prompt still keeps its start. A run that does cut a
    cue (truncation_mode=keep_start) says so in the summary."""
    prompt = "\n\nHuman: " + " ".join(f"word{i}" for i in range(60)) + "\n\nAssistant:"
    rows = [{"prompt": prompt, "chosen": " cats purr.", "rejected": " no."}]
    full = llama_tok(prompt)["input_ids"]
    (ex,), stats = load_one(write_jsonl(tmp_path / "conv.jsonl", rows), llama_tok, max_length=48, max_prompt_length=16)
    assert stats.truncation_mode == "keep_end" and ex.prompt_ids.tolist() == full[:1] + full[-15:]
    assert stats.reply_cues_cut == 0
    plain = [{"prompt": prompt[len("\n\nHuman: ") : -len("\n\nAssistant:")], "chosen": " a.", "rejected": " b."}]
    assert (
        load_one(write_jsonl(tmp_path / "plain.jsonl", plain), llama_tok, max_length=48, max_prompt_length=16)[
            1
        ].truncation_mode
        == "keep_start"
    )
    (_,), stats = load_one(
        str(tmp_path / "conv.jsonl"), llama_tok, max_length=48, max_prompt_length=16, truncation_mode="keep_start"
    )
    assert stats.reply_cues_cut == 1
    assert "warning: reply_cues_cut=1" in pd.dataset_summary([stats])


def test_strip_html_keeps_text_and_code():
    assert (
        sources.strip_html("<p>a &lt; b</p><ul><li>one</li><li>two</li></ul><pre>x\n  y</pre>")
        == "a < b\n\none\n\ntwo\n\nx\n  y"
    )


# ---------------------------------------------------------------------------------------------------------
# Tokenization invariants
# ---------------------------------------------------------------------------------------------------------


def test_prefix_property_holds_even_where_bpe_would_merge_across_the_boundary(tmp_path, gpt2_tok):
    rows = [
        {"prompt": "\n\nHuman: say hel", "chosen": "lo there", "rejected": " bye"},  # 'hel'+'lo' merges
        {"prompt": "\n\nHuman: Tell me about cats.\n\nAssistant:", "chosen": " cats purr.", "rejected": " cats nap."},
    ]
    examples = pd.load_tokenized([write_jsonl(tmp_path / "p.jsonl", rows)], gpt2_tok, "train")
    for ex in examples:
        prompt_alone = gpt2_tok(ex.prompt, add_special_tokens=True)["input_ids"]
        for response in (ex.chosen_ids, ex.rejected_ids):
            sequence = np.concatenate([ex.prompt_ids, response]).tolist()
            assert sequence[: len(prompt_alone)] == prompt_alone  # prefix, checked in token space
            assert response[-1] == gpt2_tok.eos_token_id
    joint = gpt2_tok(rows[0]["prompt"] + rows[0]["chosen"])["input_ids"]
    assert joint[: len(examples[0].prompt_ids)] != examples[0].prompt_ids.tolist()  # it would have merged


def test_bos_exactly_once_for_llama_style_tokenizer(tmp_path, llama_tok):
    bos, eos = llama_tok.bos_token_id, llama_tok.eos_token_id
    assert pd.tokenizer_adds_bos(llama_tok)
    examples = pd.load_tokenized([str(REPO / "examples" / "pairs.jsonl")], llama_tok, "train")
    batch = pd.collate(examples, pad_token_id=eos)
    for ex in examples:
        assert ex.prompt_ids[0] == bos and (ex.prompt_ids == bos).sum() == 1
        assert ex.prompt_ids.tolist() == llama_tok(ex.prompt)["input_ids"]  # same as the tokenizer's own BOS
        assert bos not in ex.chosen_ids and bos not in ex.rejected_ids
    assert ((batch["chosen_input_ids"] == bos).sum(1) == 1).all()


def test_chat_file_bos_once_and_eos_once(tmp_path, chat_tok):
    row = {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "chosen": [{"role": "assistant", "content": "Hello"}],
        "rejected": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Go away"},
        ],
    }  # may repeat the prompt's messages
    (ex,) = pd.load_tokenized([write_jsonl(tmp_path / "c.jsonl", [row])], chat_tok, "train")
    assert ex.prompt.startswith("<s><|system|>") and ex.prompt.endswith("<|assistant|>\n")
    assert ex.chosen == "Hello" and ex.rejected == "Go away"
    assert ex.prompt_ids[0] == chat_tok.bos_token_id and (ex.prompt_ids == chat_tok.bos_token_id).sum() == 1
    assert chat_tok.convert_tokens_to_ids("<|user|>") in ex.prompt_ids  # template markup parsed as specials
    for response in (ex.chosen_ids, ex.rejected_ids):
        assert response[-1] == chat_tok.eos_token_id and (response == chat_tok.eos_token_id).sum() == 1


def test_chat_rows_need_a_chat_template(tmp_path, llama_tok):
    row = {
        "prompt": [{"role": "user", "content": "Hi"}],
        "chosen": [{"role": "assistant", "content": "a"}],
        "rejected": [{"role": "assistant", "content": "b"}],
    }
    with pytest.raises(sources.DataError, match="chat template"):
        pd.load_tokenized([write_jsonl(tmp_path / "c.jsonl", [row])], llama_tok, "train")


def test_a_file_mixing_string_and_chat_rows_warns_naming_it_and_each_kinds_first_line(tmp_path, chat_tok):
    chat = {
        "prompt": [{"role": "user", "content": "Hi"}],
        "chosen": [{"role": "assistant", "content": "a"}],
        "rejected": [{"role": "assistant", "content": "b"}],
    }
    path = write_jsonl(tmp_path / "mixed.jsonl", [*numbered_rows(2), chat, *numbered_rows(1)])
    with pytest.warns(
        UserWarning,
        match=re.escape(path) + r": mixes plain-string rows \(first: line 1\) and "
        r"chat-message rows \(first: line 3\)",
    ):
        examples, _ = load_one(path, chat_tok)
    assert len(examples) == 4  # valid rows: trained as written


def test_example_files_are_one_kind_each_and_the_chat_one_renders(chat_tok):
    """examples/pairs.jsonl (strings) and examples/chat_pairs.jsonl (messages) load without the mixing warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sources.validate_sources([str(REPO / "examples" / "pairs.jsonl"), str(REPO / "examples" / "chat_pairs.jsonl")])
        examples, stats = load_one(str(REPO / "examples" / "chat_pairs.jsonl"), chat_tok)
    assert stats.kept == 4 and all(e.prompt.endswith("<|assistant|>\n") for e in examples)
    assert examples[1].prompt.startswith("<s><|system|>") and examples[2].prompt.count("<|user|>") == 2


def test_eos_text_inside_a_response_is_plain_text(tmp_path, gpt2_tok):
    rows = [{"prompt": "Q:", "chosen": " fine <|endoftext|> really", "rejected": " no"}]
    (ex,) = pd.load_tokenized([write_jsonl(tmp_path / "e.jsonl", rows)], gpt2_tok, "train")
    eos = gpt2_tok.eos_token_id
    assert (ex.chosen_ids == eos).sum() == 1 and ex.chosen_ids[-1] == eos  # the appended EOS is the only one


def test_truncate_keep_start_and_keep_end_keep_bos():
    B, E = 100, 101
    prompt, response = [B] + list(range(1, 11)), [20, 21, 22, E]
    kw = dict(max_length=8, max_prompt_length=4, bos_id=B)
    assert pd.truncate(prompt, [response], mode="keep_start", **kw) == ([B, 1, 2, 3], [response])
    assert pd.truncate(prompt, [response], mode="keep_end", **kw) == ([B, 8, 9, 10], [response])
    assert pd.truncate(prompt[1:], [response], mode="keep_end", **kw) == ([7, 8, 9, 10], [response])
    # a pair that fits keeps its whole prompt, even beyond max_prompt_length (as the original)
    assert pd.truncate([B, 1, 2, 3, 4, 5], [[20, E]], mode="keep_end", **kw) == ([B, 1, 2, 3, 4, 5], [[20, E]])
    # responses get the room left after the prompt; a cut response loses its EOS (it did not end)
    long = [20, 21, 22, 23, 24, E]
    assert pd.truncate(prompt, [long, [30, E]], mode="keep_end", **kw) == ([B, 8, 9, 10], [long[:4], [30, E]])


@pytest.mark.parametrize("mode", ["keep_start", "keep_end"])
def test_truncation_modes_end_to_end(tmp_path, llama_tok, mode):
    prompt = "\n\nHuman: " + " ".join(f"word{i}" for i in range(60)) + "\n\nAssistant:"
    rows = [{"prompt": prompt, "chosen": " cats purr and nap " * 10, "rejected": " no."}]
    examples = pd.load_tokenized(
        [write_jsonl(tmp_path / "t.jsonl", rows)],
        llama_tok,
        "train",
        max_length=48,
        max_prompt_length=16,
        truncation_mode=mode,
    )
    (ex,), (stats,) = examples, examples.stats
    full = llama_tok(prompt)["input_ids"]
    assert len(ex.prompt_ids) == 16 and ex.prompt_ids[0] == llama_tok.bos_token_id
    expected = full[:16] if mode == "keep_start" else full[:1] + full[-15:]
    assert ex.prompt_ids.tolist() == expected
    assert len(ex.chosen_ids) == 48 - 16 and llama_tok.eos_token_id not in ex.chosen_ids  # cut: no EOS
    assert ex.rejected_ids[-1] == llama_tok.eos_token_id  # fits: keeps its EOS
    assert (stats.truncation_mode, stats.prompts_truncated, stats.responses_truncated) == (mode, 1, 1)


def test_pairs_dropped_by_reason(tmp_path, gpt2_tok):
    same = " cats purr and nap and chase mice" * 4
    rows = [
        {"prompt": "Q:", "chosen": "", "rejected": " no"},  # empty_response
        {"prompt": "Q:", "chosen": " same", "rejected": " same"},  # chosen_equals_rejected
        {"prompt": "Q:", "chosen": same + " yes", "rejected": same + " no"},  # identical once cut
        {"prompt": "Q:", "chosen": " ok", "rejected": " not ok"},
    ]  # kept
    examples = pd.load_tokenized(
        [write_jsonl(tmp_path / "d.jsonl", rows)], gpt2_tok, "train", max_length=16, max_prompt_length=8
    )
    (stats,) = examples.stats
    assert [ex.chosen for ex in examples] == [" ok"]
    assert stats.dropped == {"chosen_equals_rejected": 1, "empty_response": 1, "identical_after_truncation": 1}
    assert (stats.kept, stats.prompts) == (1, 1)


def test_pairs_without_signal_and_cut_prompts_are_counted_exactly_and_dropped_or_kept_as_configured(tmp_path, gpt2_tok):
    """Rows 1 and 4: chosen == rejected; row 3: identical once cut to max_length 16; rows 2 and 4: prompts over
    max_length, cut to 8 tokens. Dropped by default, kept with drop_identical_pairs=False; counted and listed by
    row either way, with the chosen/rejected mean length ratio (length bias) of what is kept."""
    long, same = "\n\nHuman: " + "hello there " * 20 + "\n\nAssistant:", " cats purr and nap and chase mice" * 4
    rows = [
        {"prompt": "Q1:", "chosen": " same", "rejected": " same"},
        {"prompt": long, "chosen": " fine.", "rejected": " bad."},
        {"prompt": "Q3:", "chosen": same + " yes", "rejected": same + " no"},
        {"prompt": long + " two", "chosen": " same", "rejected": " same"},
        {"prompt": "Q5:", "chosen": " cats purr.", "rejected": " no"},
        {"prompt": "Q6:", "chosen": " ok", "rejected": " not ok"},
    ]
    path = write_jsonl(tmp_path / "signal.jsonl", rows)
    no_signal = {"chosen_equals_rejected": [2, [1, 4]], "identical_after_truncation": [1, [3]]}
    for drop, kept, dropped, cut in (
        (True, 3, {"chosen_equals_rejected": 2, "identical_after_truncation": 1}, 1),
        (False, 6, {}, 2),
    ):
        examples, stats = load_one(path, gpt2_tok, max_length=16, max_prompt_length=8, drop_identical_pairs=drop)
        assert (stats.kept, stats.dropped, stats.no_signal, stats.prompts_truncated) == (kept, dropped, no_signal, cut)
        assert [e.chosen for e in examples] == [rows[n]["chosen"] for n in ((1, 4, 5) if drop else range(6))]
        lengths = [(len(e.chosen_ids), len(e.rejected_ids)) for e in examples]
        ratio = sum(c for c, _ in lengths) / sum(r for _, r in lengths)
        assert stats.tokens["chosen_rejected_length_ratio"] == round(ratio, 3) == (0.588 if drop else 0.833)
        fate = "dropped" if drop else "kept (drop_identical_pairs=false)"
        assert (
            "       no signal (chosen == rejected): chosen_equals_rejected=2 (first rows [1, 4]), "
            f"identical_after_truncation=1 (first rows [3]): {fate}"
        ) in pd.dataset_summary([stats]).splitlines()


# ---------------------------------------------------------------------------------------------------------
# Collate: exact label masks
# ---------------------------------------------------------------------------------------------------------


def test_collate_exact_padding_and_labels():
    """Prompt [5, 6] + chosen [7, E] and prompt [5] + chosen [7, 8, 9, E]; pad 0, E = 2.
    Labels are the input ids on the response (EOS included) and -100 on prompt and padding."""
    a = np.array
    examples = [
        pd.TokenizedExample("P1", " c1", " r1", a([5, 6]), a([7, 2]), a([8, 9, 2])),
        pd.TokenizedExample("P2", " c2", " r2", a([5]), a([7, 8, 9, 2]), a([2])),
    ]
    b = pd.collate(examples, pad_token_id=0)
    t = torch.tensor
    assert torch.equal(b["prompt_input_ids"], t([[5, 6], [0, 5]]))  # left-padded, for generation
    assert torch.equal(b["prompt_attention_mask"], t([[1, 1], [0, 1]]))
    assert torch.equal(b["chosen_input_ids"], t([[5, 6, 7, 2, 0], [5, 7, 8, 9, 2]]))
    assert torch.equal(b["chosen_attention_mask"], t([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]))
    assert torch.equal(b["chosen_labels"], t([[-100, -100, 7, 2, -100], [-100, 7, 8, 9, 2]]))
    assert torch.equal(b["rejected_input_ids"], t([[5, 6, 8, 9, 2], [5, 2, 0, 0, 0]]))
    assert torch.equal(b["rejected_labels"], t([[-100, -100, 8, 9, 2], [-100, 2, -100, -100, -100]]))
    assert all(v.dtype == torch.long for v in b.values() if torch.is_tensor(v))
    assert b["prompt"] == ["P1", "P2"] and b["chosen"] == ["P1 c1", "P2 c2"] and b["rejected"] == ["P1 r1", "P2 r2"]
    assert b["chosen_response_only"] == [" c1", " c2"] and b["rejected_response_only"] == [" r1", " r2"]


PAIR_KEYS = {
    "prompt",
    "chosen",
    "rejected",
    "chosen_response_only",
    "rejected_response_only",
    "prompt_input_ids",
    "prompt_attention_mask",
    "chosen_input_ids",
    "chosen_attention_mask",
    "chosen_labels",
    "rejected_input_ids",
    "rejected_attention_mask",
    "rejected_labels",
    "example_index",
}  # position of each pair in the tokenized split (precomputed reference lookup)


def test_batch_from_tokenizer_labels_mask_prompt_and_padding(gpt2_tok):
    path = str(REPO / "examples" / "pairs.jsonl")
    batch = next(batch_iterator(path, gpt2_tok, split="train", batch_size=6, n_epochs=1))
    assert set(batch) == PAIR_KEYS
    for side in ("chosen", "rejected"):
        ids, labels, mask = batch[f"{side}_input_ids"], batch[f"{side}_labels"], batch[f"{side}_attention_mask"]
        for i in range(len(ids)):
            n_prompt = int(batch["prompt_attention_mask"][i].sum())
            n = int(mask[i].sum())
            assert (labels[i, :n_prompt] == -100).all() and (labels[i, n:] == -100).all()
            assert torch.equal(labels[i, n_prompt:n], ids[i, n_prompt:n])
            assert labels[i, n - 1] == gpt2_tok.eos_token_id  # EOS is a label
            assert (ids[i, n:] == gpt2_tok.pad_token_id).all()


def test_sft_mode_yields_sft_targets_only(tmp_path, gpt2_tok):
    rows = numbered_rows(4)
    rows[1]["sft_target"] = " the sft answer."
    it = batch_iterator(
        write_jsonl(tmp_path / "s.jsonl", rows),
        gpt2_tok,
        split="train",
        batch_size=4,
        shuffle=False,
        n_epochs=1,
        sft_mode=True,
    )
    (batch,) = list(it)
    assert set(batch) == {k for k in PAIR_KEYS if "rejected" not in k}
    assert batch["chosen_response_only"] == [
        " good answer 0.",
        " the sft answer.",
        " good answer 2.",
        " good answer 3.",
    ]


# ---------------------------------------------------------------------------------------------------------
# Order: seeds, epochs, ranks, resume, eval
# ---------------------------------------------------------------------------------------------------------


def test_same_seed_same_order_other_seed_other_order_fresh_each_epoch():
    run = lambda seed: list(pd.iter_batch_indices(40, batch_size=8, seed=seed, n_epochs=2))
    assert run(0) == run(0) and run(0) != run(1)
    epoch0, epoch1 = sum(run(0)[:5], []), sum(run(0)[5:], [])
    assert sorted(epoch0) == sorted(epoch1) == list(range(40)) and epoch0 != epoch1
    assert sum(pd.iter_batch_indices(40, batch_size=8, shuffle=False, n_epochs=1), []) == list(range(40))


def test_seed_changes_batches_end_to_end(tmp_path, gpt2_tok):
    path = write_jsonl(tmp_path / "n.jsonl", numbered_rows(32))
    texts = lambda seed: [
        b["chosen"] for b in batch_iterator(path, gpt2_tok, split="train", batch_size=8, n_epochs=1, seed=seed)
    ]
    assert texts(3) == texts(3) and texts(3) != texts(4)


def test_ranks_get_disjoint_shares_that_cover_the_global_batch(tmp_path, gpt2_tok):
    path = write_jsonl(tmp_path / "n.jsonl", numbered_rows(24))
    kw = dict(split="train", batch_size=8, n_epochs=1, seed=7)
    whole = [b["chosen"] for b in batch_iterator(path, gpt2_tok, **kw)]
    shares = [[b["chosen"] for b in batch_iterator(path, gpt2_tok, rank=r, world_size=2, **kw)] for r in (0, 1)]
    for step, global_batch in enumerate(whole):
        r0, r1 = shares[0][step], shares[1][step]
        assert len(r0) == len(r1) == 4 and not set(r0) & set(r1) and r0 + r1 == global_batch
    assert sorted(sum(whole, [])) == sorted(f"{r['prompt']}{r['chosen']}" for r in numbered_rows(24))


def test_balanced_shares_cover_the_batch_in_equal_counts_and_even_out_the_tokens(tmp_path, gpt2_tok):
    # one long pair per global batch of 8 among short ones, as in benchmarks/bench_dpo.py: consecutive shares put
    # the long pair and 3 other pairs on one rank; balanced shares give it the 3 shortest
    rows = [
        {
            "prompt": f"question {i}" + " more" * (60 if i % 8 == 3 else i % 5),
            "chosen": f" yes {i}" + " so" * (i % 7),
            "rejected": f" no {i}",
        }
        for i in range(32)
    ]
    path = write_jsonl(tmp_path / "skew.jsonl", rows)
    kw = dict(split="train", batch_size=8, n_epochs=2, seed=5)
    whole = list(batch_iterator(path, gpt2_tok, **kw))
    tokens = lambda b: int(b["chosen_attention_mask"].sum() + b["rejected_attention_mask"].sum())
    worst = {}  # balance -> per step: the heaviest share's tokens / an even share's
    for balance in (False, True):
        shares = [list(batch_iterator(path, gpt2_tok, rank=r, world_size=2, balance=balance, **kw)) for r in (0, 1)]
        worst[balance] = []
        for step, batch in enumerate(whole):
            r0, r1 = shares[0][step], shares[1][step]
            assert not set(r0["chosen"]) & set(r1["chosen"]) and sorted(r0["chosen"] + r1["chosen"]) == sorted(
                batch["chosen"]
            )
            assert len(r0["chosen"]) == len(r1["chosen"]) == 4  # every rank exactly batch_size // world_size pairs
            for r in (r0, r1):  # each share keeps the global batch's order
                positions = [batch["chosen"].index(c) for c in r["chosen"]]
                assert positions == sorted(positions)
            assert tokens(r0) + tokens(r1) == tokens(batch)
            worst[balance].append(max(tokens(r0), tokens(r1)) / (tokens(batch) / 2))
    assert max(worst[False]) > 1.4, worst  # the data is skewed enough for the checks below to mean something
    assert all(b <= a for a, b in zip(worst[False], worst[True])) and sum(worst[True]) < sum(worst[False]) - 0.3, worst
    # a resumed balanced iterator deals exactly what the uninterrupted one did
    full = list(batch_iterator(path, gpt2_tok, rank=1, world_size=2, balance=True, **kw))
    resumed = list(batch_iterator(path, gpt2_tok, rank=1, world_size=2, balance=True, start_example=3 * 8, **kw))
    assert [b["chosen"] for b in full[3:]] == [b["chosen"] for b in resumed]


def test_balanced_shares_with_prefix_sharing_count_each_prompt_once(tmp_path, gpt2_tok):
    # prefix_sharing makes a pair one row, prompt + chosen + rejected: the deal must weigh that row, not two
    rng = np.random.default_rng(0)
    rows = [
        {
            "prompt": f"question {i}" + " more" * int(rng.integers(0, 80)),
            "chosen": f" yes {i}" + " so" * int(rng.integers(0, 40)),
            "rejected": f" no {i}" + " not" * int(rng.integers(0, 40)),
        }
        for i in range(64)
    ]
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    kw = dict(split="train", batch_size=8, n_epochs=1, seed=3, balance=True)
    whole = list(batch_iterator(path, gpt2_tok, **kw))
    differ = 0
    for shared in (False, True):
        shares = [
            list(batch_iterator(path, gpt2_tok, rank=r, world_size=2, shared_prompt=shared, **kw)) for r in (0, 1)
        ]
        for step, batch in enumerate(whole):
            # the tokens of the rows logps lays each pair out in: two sequences, or one shared-prefix unit per row
            inputs = logps.concatenated_inputs(batch)
            owner = (
                packing.packed_inputs(inputs, None, shared_prefix=True)[2] if shared else logps.padded_inputs(inputs)[2]
            )
            sizes = torch.zeros(len(inputs["input_ids"]), dtype=torch.long).index_add_(
                0, owner[owner >= 0], torch.ones_like(owner[owner >= 0])
            )
            sizes = (sizes[:8] + sizes[8:]).tolist()  # each pair's chosen and rejected rows
            expected = pd.balance_shares(batch["example_index"].tolist(), sizes, 2)
            assert [shares[r][step]["example_index"].tolist() for r in (0, 1)] == expected
            if shared:
                unshared = (inputs["attention_mask"][:8].sum(1) + inputs["attention_mask"][8:].sum(1)).tolist()
                differ += expected != pd.balance_shares(batch["example_index"].tolist(), unshared, 2)
    assert differ >= 2  # the two weighings deal some steps differently, so the check above can fail


def test_balance_shares_deals_largest_first_to_the_lightest_share_with_room():
    assert pd.balance_shares([10, 11, 12, 13], [5, 4, 1, 1], 2) == [[10, 13], [11, 12]]  # 6 and 5, not 9 and 2
    assert pd.balance_shares([7, 8, 9, 4, 5, 6], [9, 8, 7, 3, 2, 1], 3) == [[7, 6], [8, 5], [9, 4]]
    assert pd.balance_shares([0, 1, 2, 3], [1, 1, 1, 1], 2) == [[0, 1], [2, 3]]  # nothing to even out: as unbalanced
    assert pd.balance_shares([0, 1, 2], [4, 4, 4], 1) == [[0, 1, 2]]  # one rank: the batch as it is


def test_balance_shares_is_near_optimal_and_never_heavier_than_consecutive_slices():
    """Random batches with a few long pairs among short ones: the heaviest share is never heavier than consecutive
    slices' and within 15% of the best equal-count split (found by trying every split of 2 shares)."""
    import itertools

    rng = np.random.default_rng(0)
    for _ in range(300):
        k = int(rng.integers(2, 5))
        sizes = [int(rng.integers(100, 400) if rng.random() < 0.3 else rng.integers(10, 40)) for _ in range(2 * k)]
        heaviest = lambda shares: max(sum(sizes[i] for i in share) for share in shares)
        shares = pd.balance_shares(list(range(2 * k)), sizes, 2)
        assert [len(s) for s in shares] == [k, k] and sorted(sum(shares, [])) == list(range(2 * k))
        assert heaviest(shares) <= heaviest([range(k), range(k, 2 * k)])
        best = min(
            heaviest([c, [i for i in range(2 * k) if i not in c]]) for c in itertools.combinations(range(2 * k), k)
        )
        assert heaviest(shares) <= 1.15 * best


def test_resume_from_the_middle_yields_the_remaining_batches(tmp_path, gpt2_tok):
    path = write_jsonl(tmp_path / "n.jsonl", numbered_rows(20))  # 20 // 6 = 3 steps per epoch, 2 pairs dropped
    kw = dict(split="train", batch_size=6, n_epochs=3, seed=1)
    full = list(batch_iterator(path, gpt2_tok, **kw))
    assert len(full) == 9
    resumed = list(batch_iterator(path, gpt2_tok, start_example=4 * 6, **kw))  # crosses an epoch
    assert len(resumed) == 5
    for a, b in zip(full[4:], resumed):
        assert a["chosen"] == b["chosen"] and torch.equal(a["rejected_input_ids"], b["rejected_input_ids"])


def test_n_examples_rounds_up_to_whole_batches_and_eval_takes_the_first_n(tmp_path, gpt2_tok):
    path = write_jsonl(tmp_path / "n.jsonl", numbered_rows(10))
    batches = list(batch_iterator(path, gpt2_tok, split="test", batch_size=2, shuffle=False, n_epochs=1, n_examples=5))
    assert [b["chosen_response_only"] for b in batches] == [
        [" good answer 0.", " good answer 1."],
        [" good answer 2.", " good answer 3."],
        [" good answer 4.", " good answer 5."],
    ]
    endless = batch_iterator(path, gpt2_tok, split="train", batch_size=4, n_examples=40)
    assert len(list(endless)) == 10  # n_examples alone runs as many epochs as it takes


def test_sample_batches_take_each_prompt_once(tmp_path, gpt2_tok):
    """Prompts 0, 0, 1, 2, 2, 3 (two with two pairs): the first 3 prompts are 0, 1, 2, each sampled once."""
    r = numbered_rows(4)
    rows = [r[0], dict(r[0], chosen=" other 0."), r[1], r[2], dict(r[2], rejected=" worse 2"), r[3]]
    path = write_jsonl(tmp_path / "repeats.jsonl", rows)
    examples = pd.load_tokenized([path], gpt2_tok, "test")
    ((group, batch),) = pd.get_sample_batches(examples, gpt2_tok.pad_token_id, n_examples=3)
    assert group == 0 and batch["prompt"] == [f"\n\nHuman: question {i}?\n\nAssistant:" for i in range(3)]


def test_num_steps_matches_the_iterator_and_the_examples(tmp_path, gpt2_tok):
    assert pd.num_steps(100, batch_size=64, n_epochs=3) == 3  # 36 pairs per epoch dropped, not carried over
    assert pd.num_steps(100, batch_size=8, n_examples=20) == 3  # rounded up to whole batches
    assert pd.num_steps(100, batch_size=8, n_epochs=1, n_examples=1000) == 12  # whichever comes first
    assert len(list(pd.iter_batch_indices(100, batch_size=64, n_epochs=3))) == 3
    path = write_jsonl(tmp_path / "n.jsonl", numbered_rows(9))
    assert len(pd.load_tokenized([path], gpt2_tok, "train", cache_dir=str(tmp_path))) == 9


def test_json_list_file_loads(tmp_path, gpt2_tok):
    path = tmp_path / "pairs.json"
    path.write_text(json.dumps(numbered_rows(3)))
    examples = pd.load_tokenized([str(path)], gpt2_tok, "train")
    (stats,) = examples.stats
    assert [e.chosen for e in examples] == [" good answer 0.", " good answer 1.", " good answer 2."]


def test_sample_rule_only_where_every_source_has_it():
    rule = sources.sample_rule(["toy"])
    assert rule(" cats purr and nap.") and not rule(" CATS PURR.") and not rule(" ...")
    assert sources.sample_rule(["toy", "hh"]) is None and sources.sample_rule(["examples/pairs.jsonl"]) is None


def test_bad_iterator_arguments(tmp_path, gpt2_tok):
    path = write_jsonl(tmp_path / "n.jsonl", numbered_rows(4))
    base = dict(split="train", batch_size=4, n_epochs=1)
    with pytest.raises(sources.DataError, match="fewer than one global batch"):
        batch_iterator(path, gpt2_tok, **{**base, "batch_size": 8})


# ---------------------------------------------------------------------------------------------------------
# Cache
# ---------------------------------------------------------------------------------------------------------


def test_cache_hit_on_second_load_and_invalidated_by_max_length_and_content(tmp_path, gpt2_tok):
    path = tmp_path / "n.jsonl"
    write_jsonl(path, numbered_rows(6))
    load = lambda **kw: pd.load_tokenized([str(path)], gpt2_tok, "train", cache_dir=str(tmp_path / "cache"), **kw)
    first = load()
    (s1,) = first.stats
    second = load()
    (s2,) = second.stats
    assert s1.cache.startswith("written") and s2.cache.startswith("hit")
    assert [e.chosen for e in first] == [e.chosen for e in second]
    assert all(np.array_equal(a.chosen_ids, b.chosen_ids) for a, b in zip(first, second))
    assert load(max_length=1024).stats[0].cache.startswith("written")  # another key
    write_jsonl(path, numbered_rows(7))
    assert load().stats[0].cache.startswith("written")  # the file's content is in the key
    other = make_llama_tok()
    assert pd.tokenizer_fingerprint(other) != pd.tokenizer_fingerprint(gpt2_tok)


# The previous implementation's tokenized rows (the pickled cache, before Arrow) of PINNED_ROWS with make_llama_tok(),
# max_length=24, max_prompt_length=10: (prompt_ids, chosen_ids, rejected_ids) each. Row 1: a cueing prompt cut keep_end
# (BOS kept); row 2: a chosen response cut to the room left (no EOS); row 3: 'hel' + 'lo' not merged across the cut.
PINNED_ROWS = [
    {
        "prompt": "\n\nHuman: " + " ".join(f"word{i}" for i in range(12)) + "\n\nAssistant:",
        "chosen": " cats purr and nap.",
        "rejected": " no.",
    },
    {"prompt": "Tell me about cats.", "chosen": " cats purr and nap and chase mice" * 3, "rejected": " hello there!"},
    {"prompt": "Q: say hel", "chosen": "lo there", "rejected": " bye"},
]
PINNED_IDS = [
    ([0, 83, 86, 72, 21, 21, 203, 203, 307, 30], [302, 385, 306, 359, 18, 1], [225, 82, 83, 18, 1]),
    (
        [0, 313, 267, 380, 399, 302, 18],
        [302, 385, 306, 359, 306, 366, 381, 302, 385, 306, 359, 306, 366, 381, 302, 385, 306],
        [282, 371, 5, 1],
    ),
    ([0, 53, 30, 225, 87, 319, 276, 80], [80, 83, 371, 1], [225, 70, 93, 73, 1]),
]


def test_tokenized_rows_equal_the_previous_implementations_through_the_arrow_cache(tmp_path, llama_tok):
    """Written and read back: the same ids, the same prompt/response boundary, hence the same labels."""
    path = write_jsonl(tmp_path / "rows.jsonl", PINNED_ROWS)
    for cache in ("written", "hit"):
        examples = pd.load_tokenized(
            [path], llama_tok, "train", cache_dir=str(tmp_path / "cache"), max_length=24, max_prompt_length=10
        )
        (stats,) = examples.stats
        assert stats.cache.startswith(cache) and (stats.prompts_truncated, stats.responses_truncated) == (1, 1)
        assert [(e.prompt_ids.tolist(), e.chosen_ids.tolist(), e.rejected_ids.tolist()) for e in examples] == PINNED_IDS
        batch = pd.collate(examples.rows([0, 1, 2]), llama_tok.eos_token_id)
        for i, (prompt, chosen, _) in enumerate(PINNED_IDS):  # labels: -100 on the prompt and the padding
            n, width = len(prompt) + len(chosen), batch["chosen_labels"].shape[1]
            assert batch["chosen_input_ids"][i, :n].tolist() == prompt + chosen
            assert batch["chosen_labels"][i].tolist() == [-100] * len(prompt) + chosen + [-100] * (width - n)


def test_a_cache_entry_changed_on_disk_is_rebuilt_and_no_cache_file_is_ever_executed(tmp_path, gpt2_tok):
    """The cache holds Arrow columns and JSON, no code (it was a pickle: whoever could write local_dirs ran code in
    every job that read it). An entry whose examples.arrow was edited (same size) or whose stats.json was damaged is
    written again, with the right data; a pickle an older version left is never opened."""
    path, cache = write_jsonl(tmp_path / "n.jsonl", numbered_rows(6)), tmp_path / "cache"
    load = lambda: pd.load_tokenized([path], gpt2_tok, "train", cache_dir=str(cache))
    first = load()
    (stats,) = first.stats
    expected, entry = [(e.chosen, e.chosen_ids.tolist()) for e in first], Path(stats.cache.split(" ", 1)[1])
    del first  # its memory map is of the file edited below
    marker = tmp_path / "the pickle ran"

    class Payload:
        def __reduce__(self):
            return os.mkdir, (str(marker),)

    (entry.parent / f"{entry.name}.pkl").write_bytes(pickle.dumps(Payload()))  # as the previous version named them
    time.sleep(0.05)  # an edit comes after the write: the filesystem's clock moves in steps of a few milliseconds
    with open(entry / "examples.arrow", "r+b") as f:
        data = f.read()
        f.seek(data.index(b"good answer 3"))
        f.write(b"GOOD")
    examples = load()
    (stats,) = examples.stats
    assert stats.cache.startswith("rewritten") and [(e.chosen, e.chosen_ids.tolist()) for e in examples] == expected
    (entry / "stats.json").write_text("{")
    assert load().stats[0].cache.startswith("rewritten") and load().stats[0].cache.startswith("hit")
    assert not marker.exists()
    modules = [p.read_text() for p in REPO.glob("*.py")]
    assert not [m for m in modules if re.search(r"^\s*(import pickle|from pickle)", m, re.M)]


RANK = """
import json, sys
sys.path.insert(0, {repo!r})
import preference_datasets as pd
from transformers import PreTrainedTokenizerFast
tok = PreTrainedTokenizerFast.from_pretrained({tok!r})
examples = pd.load_tokenized([{path!r}], tok, "train", cache_dir={cache!r})
(stats,) = examples.stats
batches = pd.get_batch_iterator(examples, tok.pad_token_id, batch_size=8, n_epochs=2, seed=3, rank={rank},
                                world_size=2, balance=True)
print(json.dumps([stats.cache.split()[0], [(b["example_index"].tolist(), b["chosen_input_ids"].tolist())
                                           for b in batches]]))
"""


def test_two_ranks_read_one_cache_and_build_the_batches_of_one_process(tmp_path, gpt2_tok):
    """Two processes start together on an empty cache: one writes the entry, the other waits and maps it; each
    builds its balanced share of every step, and the shares are those one process computes for each rank."""
    rows = [dict(r, prompt=r["prompt"] + " more" * (i % 7)) for i, r in enumerate(numbered_rows(40))]
    path, cache, tok = write_jsonl(tmp_path / "n.jsonl", rows), str(tmp_path / "cache"), str(tmp_path / "tok")
    gpt2_tok.save_pretrained(tok)
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK.format(repo=str(REPO), tok=tok, path=path, cache=cache, rank=rank)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [json.loads(p.communicate()[0].splitlines()[-1]) for p in ranks]
    assert sorted(cache for cache, _ in outputs) == ["hit", "written"]
    examples = pd.load_tokenized([path], gpt2_tok, "train", cache_dir=cache)
    kw = dict(batch_size=8, n_epochs=2, seed=3, world_size=2, balance=True)
    for rank, (_, batches) in enumerate(outputs):
        mine = pd.get_batch_iterator(examples, gpt2_tok.pad_token_id, rank=rank, **kw)
        assert batches == [[b["example_index"].tolist(), b["chosen_input_ids"].tolist()] for b in mine]
    whole = pd.iter_batch_indices(40, batch_size=8, n_epochs=2, seed=3)
    assert [sorted(a + b) for (a, _), (b, _) in zip(outputs[0][1], outputs[1][1])] == [sorted(w) for w in whole]


BUILDER = """
import contextlib, hashlib, json, os, sys, time
from pathlib import Path
sys.path.insert(0, {repo!r})
import preference_datasets as pd
from transformers import AutoTokenizer
pd.FileLock = lambda path: contextlib.nullcontext()  # a flock that does not span the nodes: neither sees the other's
if {same_pid}:
    os.getpid = lambda: 4242  # containers on two nodes often have equal PIDs
tokenize = pd.tokenize_normalized

def both_building(*args, **kwargs):  # neither finishes before both have started building: the race, every time
    Path({mine!r}).touch()
    deadline = time.time() + 20
    while not Path({theirs!r}).exists() and time.time() < deadline:
        time.sleep(0.05)
    time.sleep({delay})
    return tokenize(*args, **kwargs)

pd.tokenize_normalized = both_building
examples = pd.load_tokenized(["toy"], AutoTokenizer.from_pretrained({tok!r}), "train", cache_dir={cache!r})
table = examples.table.to_pydict()
print(json.dumps([examples.stats[0].cache.split()[0], hashlib.sha256(repr(table).encode()).hexdigest()]))
"""


@pytest.mark.parametrize("same_pid", [False, True], ids=["two_nodes", "two_nodes_same_pid"])
def test_two_nodes_building_one_cache_entry_at_once_both_finish_with_the_same_table(tmp_path, same_pid):
    """Where flock is node-local (NFS with local_lock or nolock, Lustre's localflock, many FUSE mounts) two nodes both
    miss the entry and build it at once: the one that renames second reads the winner's entry (before: os.replace
    failed with 'Directory not empty' and that rank died). With equal PIDs (containers) each builds in its own folder
    (before: both used entry.tmp<pid>, and the second failed to make it). Both finish with identical tables, which a
    later load then finds; no build folder is left behind."""
    cache, tok = str(tmp_path / "cache"), str(REPO / "toy" / "tiny-llama")
    flags = [str(tmp_path / f"building-{n}") for n in (0, 1)]
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                BUILDER.format(
                    repo=str(REPO),
                    tok=tok,
                    cache=cache,
                    same_pid=same_pid,
                    mine=flags[n],
                    theirs=flags[1 - n],
                    delay=0.5 * n,
                ),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in (0, 1)
    ]
    finished = [p.communicate() for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], [err[-2000:] for _, err in finished]
    (first, digest), (second, other) = (json.loads(out.splitlines()[-1]) for out, _ in finished)
    assert (first, second) == ("written", "hit") and digest == other
    from transformers import AutoTokenizer

    again = pd.load_tokenized(["toy"], AutoTokenizer.from_pretrained(tok), "train", cache_dir=cache)
    assert again.stats[0].cache.startswith("hit")
    assert hashlib.sha256(repr(again.table.to_pydict()).encode()).hexdigest() == digest
    assert [p.name for p in (tmp_path / "cache" / "tokenized").iterdir() if ".tmp" in p.name] == []


def test_a_run_loads_each_split_once_reads_each_file_once_and_fingerprints_the_tokenizer_once(tmp_path, monkeypatch):
    """train.py's checks load both splits and hand them to the trainer and the manifest (before: the data was loaded
    7 times per run, a file parsed 11 times, the tokenizer hashed 9 times). Cold, each file is hashed (streamed) and
    parsed once; warm, hashed once and parsed never. What loading counted is in run_manifest.json."""
    from test_train import train

    for split in ("train", "test"):
        lines = (REPO / "toy" / "data" / f"{split}.jsonl").read_text().splitlines()[:48]
        (tmp_path / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    calls, reads, hashed = Counter(), Counter(), Counter()
    read_jsonl, file_digest = sources.READERS[".jsonl"], hashlib.file_digest
    for name in ("load_tokenized", "tokenizer_fingerprint"):
        monkeypatch.setattr(pd, name, lambda *a, _f=getattr(pd, name), _n=name, **k: calls.update([_n]) or _f(*a, **k))
    monkeypatch.setitem(sources.READERS, ".jsonl", lambda path: reads.update([path.name]) or read_jsonl(path))
    monkeypatch.setattr(hashlib, "file_digest", lambda f, *a: hashed.update([Path(f.name).name]) or file_digest(f, *a))
    args = [
        "loss=dpo",
        f"datasets=[{tmp_path}/{{split}}.jsonl]",
        "n_examples=16",
        "sample_during_eval=false",
        f"local_dirs=[{tmp_path / 'cache'}]",
    ]
    for run, parsed in (("cold", 1), ("warm", 0)):
        calls.clear(), reads.clear(), hashed.clear()
        train(tmp_path / run, *args)
        assert calls == Counter(load_tokenized=2, tokenizer_fingerprint=1), calls
        assert [(n[f"{split}.jsonl"]) for n in (hashed, reads) for split in ("train", "test")] == [1, 1, parsed, parsed]
    manifest = json.loads((tmp_path / "warm" / "run_manifest.json").read_text())
    counts = manifest["data_counts"]
    assert [s["kept"] for s in counts["train"]] == [48] and counts["test"][0]["no_signal"] == {}


# ---------------------------------------------------------------------------------------------------------
# Sources: hub path (with a real datasets.Dataset), offline failure, toy, the example file, summary
# ---------------------------------------------------------------------------------------------------------


def test_hub_source_path_uses_fingerprint_and_hh_default_keep_end(tmp_path, gpt2_tok, monkeypatch):
    import datasets

    history = "\n\nHuman: " + "hello there " * 40 + "\n\nAssistant:"
    rows = [hh_row(history, " fine.", " bad."), hh_row("\n\nHuman: hi\n\nAssistant:", " hello.", " no.")]
    dataset = datasets.Dataset.from_list(rows)
    monkeypatch.setitem(
        sources.SOURCES, "hh", dataclasses.replace(sources.SOURCES["hh"], fetch=lambda split, cd: dataset)
    )
    load = lambda: pd.load_tokenized(
        ["hh"], gpt2_tok, "train", max_length=40, max_prompt_length=20, cache_dir=str(tmp_path)
    )
    examples = load()
    (stats,) = examples.stats
    assert stats.truncation_mode == "keep_end" and stats.origin == "hub:" + dataset._fingerprint
    long_prompt = next(e for e in examples if e.prompt == history)
    assert long_prompt.prompt_ids.tolist() == gpt2_tok(history)["input_ids"][-20:]  # kept the last turn
    assert load().stats[0].cache.startswith("hit")


def test_offline_hub_dataset_fails_at_once_with_advice(tmp_path, gpt2_tok):
    with pytest.raises(sources.DataError) as info:
        pd.load_tokenized(["hh"], gpt2_tok, "train", cache_dir=str(tmp_path))
    message = str(info.value)
    assert "Anthropic/hh-rlhf" in message and "not available offline" in message
    assert "datasets=[path/to/file.jsonl]" in message and "pre-populate the cache" in message
    assert info.value.__cause__ is not None  # the library's exception, chained


def test_toy_maps_to_files_next_to_the_module():
    source, (path,), fetch = sources.resolve_source(sources.parse_spec("toy"), "train")
    assert path == REPO / "toy" / "data" / "train.jsonl" and source.convert is sources.convert_rows and fetch is None
    assert sources.local_files("toy", "test") == [REPO / "toy" / "data" / "test.jsonl"]
    if path.is_file() and (REPO / "toy" / "data" / "test.jsonl").is_file():
        sources.validate_sources(["toy"])


def test_split_placeholder_in_a_path(tmp_path):
    write_jsonl(tmp_path / "test.jsonl", numbered_rows(1))
    assert sources.local_files(str(tmp_path / "{split}.jsonl"), "test") == [tmp_path / "test.jsonl"]


def test_example_file_validates_loads_and_prints_a_summary(gpt2_tok):
    path = str(REPO / "examples" / "pairs.jsonl")
    sources.validate_sources([path])
    examples = pd.load_tokenized([path], gpt2_tok, "train")
    (stats,) = examples.stats
    out = pd.dataset_summary([stats])  # what the trainer prints on rank 0
    assert len(examples) == stats.kept == 6 and stats.prompts == 5  # one prompt has two pairs
    for name in (
        "pairs_kept=6",
        "prompts=5",
        "dropped: none",
        "prompts_truncated=",
        "prompt_tokens_mean=",
        "prompt_tokens_max=",
        "response_tokens_mean=",
        "response_tokens_max=",
    ):
        assert name in out


# ---------------------------------------------------------------------------------------------------------
# Bad input: one file per case under tests/data/bad_data/, and the fragments its message must contain
# ---------------------------------------------------------------------------------------------------------

BAD_CASES = {
    "not_json.jsonl": ["line 2", "not valid JSON", "one JSON object per line"],
    "trailing_comma.jsonl": ["line 1", "not valid JSON"],
    "single_quotes.jsonl": ["line 1", "not valid JSON", "double quotes"],
    "two_objects_one_line.jsonl": ["line 1", "not valid JSON", "Extra data"],
    "missing_prompt.jsonl": ["line 1", "missing field 'prompt'"],
    "missing_chosen.jsonl": ["line 3", "missing field 'chosen'"],
    "missing_rejected.jsonl": ["line 1", "missing field 'rejected'"],
    "misspelled_field.jsonl": ["missing field 'chosen'", "'choosen' looks like a misspelling of 'chosen'"],
    "chosen_number.jsonl": [
        "line 1",
        "field 'chosen'",
        "expected a string or a list of {role, content}",
        "got number 42",
    ],
    "chosen_boolean.jsonl": ["field 'chosen'", "got boolean true"],
    "prompt_null.jsonl": ["field 'prompt'", "got null"],
    "prompt_nan.jsonl": ["field 'prompt'", "got number nan"],
    "rejected_object.jsonl": ["field 'rejected'", "got object"],
    "sft_target_number.jsonl": ["field 'sft_target'", "got number 7"],
    "row_is_list.jsonl": ["line 1", "expected a JSON object with fields prompt, chosen, rejected", "got list"],
    "row_is_string.jsonl": ["expected a JSON object", "got string"],
    "row_is_null.jsonl": ["line 2", "expected a JSON object", "got null"],
    "row_is_number.jsonl": ["expected a JSON object", "got number 42"],
    "empty.jsonl": ["the file is empty"],
    "blank_lines_only.jsonl": ["the file is empty"],
    "duplicate_field.jsonl": ["line 1", "duplicate field 'chosen'"],
    "invalid_utf8.jsonl": ["line 2", "not valid UTF-8", "0xe9"],
    "utf16.jsonl": ["line 1", "not valid UTF-8"],
    "mixed_forms.jsonl": ["mix strings and message lists", "prompt=string, chosen=list"],
    "unknown_role.jsonl": ["field 'prompt' message 0", "unknown role 'human'", "did you mean 'user'"],
    "role_not_string.jsonl": ["'role': expected a string", "got number 1"],
    "message_missing_role.jsonl": ["field 'prompt' message 0", "missing field 'role'"],
    "message_missing_content.jsonl": ["field 'chosen' message 0", "missing field 'content'"],
    "message_content_not_string.jsonl": ["'content': expected a string", "got list"],
    "message_not_object.jsonl": ["message 0", "expected a JSON object with fields role, content", "got string"],
    "chat_prompt_empty.jsonl": ["field 'prompt'", "empty list"],
    "chat_chosen_empty.jsonl": ["field 'chosen'", "expected one assistant message", "got 0 messages"],
    "chat_reply_not_assistant.jsonl": ["field 'chosen'", "role 'assistant'", "got role 'user'"],
    "chat_reply_two_messages.jsonl": ["field 'rejected'", "expected one assistant message", "got 2 messages"],
    "chat_sft_target_from_user.jsonl": ["field 'sft_target'", "role 'assistant'"],
    "not_a_list.json": ["expected a JSON list of {prompt, chosen, rejected} objects", "got object"],
    "top_level_string.json": ["expected a JSON list", "got string"],
    "list_of_strings.json": ["item 1", "expected a JSON object", "got string"],
    "invalid.json": ["line 3", "not valid JSON"],
    "empty_list.json": ["no rows"],
    "item_missing_field.json": ["item 2", "missing field 'rejected'"],
    "wrong_extension.csv": ["got a '.csv' file", "expected a .jsonl, .json, .parquet, .arrow file"],
    "hh_missing_rejected.jsonl": ["line 2", "missing field 'rejected'", "implicit prompt fields chosen, rejected"],
    "hh_then_pairs.jsonl": ["line 2", "first row has the implicit prompt {chosen, rejected} shape"],
    "shp_export.jsonl": ["line 1", "missing field 'prompt'", "found 'history', 'human_ref_A'"],
    "ultrafeedback_reply_not_assistant.jsonl": ["line 2", "field 'rejected'", "last message must be the assistant"],
}


def test_every_bad_file_has_an_expected_message():
    assert sorted(p.name for p in BAD_DATA.iterdir()) == sorted(BAD_CASES)
    assert len(BAD_CASES) >= 25


@pytest.mark.parametrize("name", sorted(BAD_CASES))
def test_bad_input_raises_data_error_naming_file_line_and_field(name, gpt2_tok):
    path = str(BAD_DATA / name)
    with pytest.raises(sources.DataError) as info:  # rows are checked as they load (train.py: before any model loads)
        pd.load_tokenized([path], gpt2_tok, "train")
    assert isinstance(info.value, ValueError) and path in str(info.value)
    for fragment in BAD_CASES[name]:
        assert fragment in str(info.value)


def test_missing_path_and_unknown_names(tmp_path):
    with pytest.raises(sources.DataError, match=r"no such file"):
        sources.validate_sources([str(tmp_path / "nope.jsonl")])
    with pytest.raises(sources.DataError, match=r"got a '\.csv' file \(expected a \.jsonl, \.json, \.parquet, \.arrow"):
        sources.validate_sources([str(BAD_DATA / "wrong_extension.csv")])  # config time: names and paths
    with pytest.raises(sources.DataError, match=r"unknown dataset 'hhh'.*did you mean 'hh'\?"):
        sources.validate_sources(["hhh"])
    with pytest.raises(sources.DataError, match=r"did you mean 'ultrafeedback'\?"):
        sources.validate_sources(["ultra_feedback"])
    with pytest.raises(sources.DataError) as info:  # every problem reported at once
        sources.validate_sources(["hhh", str(tmp_path / "nope.jsonl"), "shp"])
    assert "unknown dataset 'hhh'" in str(info.value) and "nope.jsonl: no such file" in str(info.value)


# ---------------------------------------------------------------------------------------------------------
# Unpaired (KTO) data: {prompt, completion, label} rows, the kto-mix hub shape, pairs turned unpaired
# ---------------------------------------------------------------------------------------------------------


def unpaired_rows(n: int) -> list[dict]:
    return [
        {"prompt": f"\n\nHuman: question {i}?\n\nAssistant:", "completion": f" answer {i}.", "label": i % 3 != 0}
        for i in range(n)
    ]


def test_unpaired_local_file_gives_labelled_completions_and_counts(tmp_path, gpt2_tok):
    path = write_jsonl(tmp_path / "kto.jsonl", unpaired_rows(6))
    examples, stats = load_one(path, gpt2_tok, unpaired=True)
    assert [(e.chosen, e.rejected, e.desirable) for e in examples] == [
        (f" answer {i}.", None, i % 3 != 0) for i in range(6)
    ]
    assert examples[0].chosen_ids.tolist() == gpt2_tok(" answer 0.")["input_ids"] + [gpt2_tok.eos_token_id]
    assert (stats.unit, stats.desirable, stats.undesirable) == ("completions", 4, 2)
    assert "desirable=4 undesirable=2" in pd.dataset_summary([stats])
    with pytest.raises(sources.DataError, match="only an unpaired loss reads them"):
        load_one(path, gpt2_tok)  # a pair loss refuses labelled completions (train.py: before any model loads)


def test_unpaired_chat_rows_are_rendered_and_bad_rows_name_the_line(tmp_path, chat_tok):
    user = {"role": "user", "content": "Name a prime."}
    rows = [
        {"prompt": [user], "completion": [{"role": "assistant", "content": "7"}], "label": True},
        {"prompt": [user], "completion": [user, {"role": "assistant", "content": "8"}], "label": False},
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    examples, stats = load_one(path, chat_tok, unpaired=True)
    assert [(e.prompt, e.chosen, e.desirable) for e in examples] == [
        ("<s><|user|>\nName a prime.</s>\n<|assistant|>\n", "7", True),
        ("<s><|user|>\nName a prime.</s>\n<|assistant|>\n", "8", False),
    ]
    assert stats.truncation_mode == "keep_end"  # a conversation prompt keeps its cue to reply
    bad = write_jsonl(tmp_path / "bad.jsonl", [rows[0], dict(rows[0], label="yes")])
    with pytest.raises(sources.DataError, match=r"bad.jsonl, line 2: field 'label': expected a boolean, got string"):
        list(sources.read_rows([Path(bad)]))


def test_pairs_to_unpaired_gives_a_desirable_and_an_undesirable_completion_per_pair(tmp_path, gpt2_tok):
    path = write_jsonl(tmp_path / "pairs.jsonl", numbered_rows(3))
    with pytest.raises(sources.DataError, match="set pairs_to_unpaired=true"):
        load_one(path, gpt2_tok, unpaired=True)
    examples, stats = load_one(path, gpt2_tok, unpaired=True, pairs_to_unpaired=True)
    assert [(e.chosen, e.desirable) for e in examples] == [
        (r, d) for i in range(3) for r, d in ((f" good answer {i}.", True), (f" bad {i}", False))
    ]
    assert (stats.kept, stats.desirable, stats.undesirable) == (6, 3, 3)


def test_kto_mix_hub_source_loads_a_local_copy_of_its_shape_through_load_dataset(tmp_path, chat_tok, monkeypatch):
    """trl-lib/kto-mix-14k rows {prompt: [messages], completion: [assistant message], label}: the hub source's
    fetch is datasets.load_dataset; here it reads a local directory holding that shape (no network)."""
    user = {"role": "user", "content": "Say hi."}
    rows = [
        {"prompt": [user], "completion": [{"role": "assistant", "content": c}], "label": label}
        for c, label in (("hi", True), ("HI", False), ("hello", True))
    ]
    copy = tmp_path / "kto-mix-14k"
    copy.mkdir()
    write_jsonl(copy / "train.jsonl", rows)
    write_jsonl(copy / "test.jsonl", rows[:2])
    monkeypatch.setitem(
        sources.SOURCES,
        "kto_mix",
        dataclasses.replace(
            sources.SOURCES["kto_mix"], fetch=lambda split, cache_dir: sources.fetch_hub(str(copy), split, cache_dir)
        ),
    )
    examples = pd.load_tokenized(["kto_mix"], chat_tok, "train", unpaired=True)
    (stats,) = examples.stats
    assert [(e.chosen, e.desirable) for e in examples] == [("hi", True), ("HI", False), ("hello", True)]
    assert stats.origin.startswith("hub:") and (stats.desirable, stats.undesirable) == (2, 1)
    with pytest.raises(sources.DataError, match="holds pairs"):
        pd.load_tokenized(["toy"], chat_tok, "train", unpaired=True)


def test_se_holds_out_the_first_percent_of_its_shuffled_train_split_as_test(tmp_path):
    """stack-exchange-preferences has only a train split: as the original, shuffled with seed 42, its first 1% is
    'test' and the rest 'train' (fetch_hub's held_out, the SE source's fetch); here on a local copy, no network."""
    import datasets

    rows = [{"question": f"q{i}", "answers": [{"text": "a", "pm_score": 1}]} for i in range(300)]
    copy = tmp_path / "se"
    copy.mkdir()
    write_jsonl(copy / "train.jsonl", rows)
    assert sources.SOURCES["se"].fetch.keywords == {"held_out": 0.01}
    test, train = (sources.fetch_hub(str(copy), split, None, held_out=0.01)["question"] for split in ("test", "train"))
    shuffled = datasets.Dataset.from_list(rows).shuffle(seed=42)["question"]
    assert (test, train) == (shuffled[:3], shuffled[3:])


def test_kl_rows_put_each_completion_after_the_previous_examples_prompt(gpt2_tok):
    """collate(kl_rows=True): row k = prompt of completion k + completion k-1 (chosen then rejected for pairs), so
    no KL row pairs a completion with its own prompt when the batch has >= 2 prompts."""
    data, _ = sources.convert_rows(numbered_rows(3))
    opts = pd.LoadOptions(max_length=64, max_prompt_length=32, truncation_mode="keep_start")
    examples = list(pd.tokenize_normalized(data, gpt2_tok, opts, pd.SourceStats("t", "train")))
    batch = pd.collate(examples, gpt2_tok.pad_token_id, kl_rows=True)
    completions = [(e.prompt_ids, e.chosen_ids) for e in examples] + [(e.prompt_ids, e.rejected_ids) for e in examples]
    assert batch["kl_input_ids"].shape[0] == 6
    for k, (prompt, _) in enumerate(completions):
        row = batch["kl_input_ids"][k][batch["kl_attention_mask"][k].bool()].tolist()
        assert row == prompt.tolist() + completions[k - 1][1].tolist()
        labels = batch["kl_labels"][k]
        assert (labels[: len(prompt)] == -100).all() and labels[len(prompt) : len(row)].tolist() == completions[k - 1][
            1
        ].tolist()


def test_an_unterminated_string_says_where_it_starts_once(tmp_path):
    path = tmp_path / "cut.jsonl"
    path.write_text('{"prompt": "Q", "chosen": "a\n')
    with pytest.raises(sources.DataError) as error:
        list(sources.read_rows([path]))
    assert "(Unterminated string starting at column 27)" in str(error.value), str(error.value)


# ---------------------------------------------------------------------------------------------------------
# Preference data as researchers have it: parquet, Arrow, save_to_disk and Hub-repo folders, Hub ids (from a
# datasets cache laid out as a download leaves it), held-out test fractions, mixtures
# ---------------------------------------------------------------------------------------------------------


def toy_pairs(split: str, n: int) -> list[dict]:
    lines = (REPO / "toy" / "data" / f"{split}.jsonl").read_text().splitlines()[:n]
    return [{k: json.loads(line)[k] for k in ("prompt", "chosen", "rejected")} for line in lines]


def as_chat(row: dict) -> dict:  # the same pair as messages: the question a user turn, the replies assistant turns
    question = row["prompt"].split("Human: ", 1)[1].removesuffix("\n\nAssistant:")
    reply = lambda text: [{"role": "assistant", "content": text.strip()}]  # noqa: E731
    return {
        "prompt": [{"role": "user", "content": question}],
        "chosen": reply(row["chosen"]),
        "rejected": reply(row["rejected"]),
    }


def as_implicit(row: dict) -> dict:  # whole conversations, no prompt field
    chat = as_chat(row)
    return {"chosen": chat["prompt"] + chat["chosen"], "rejected": chat["prompt"] + chat["rejected"]}


def write_parquet(path: Path, rows: list[dict]) -> None:
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa_table(rows), path)


def pa_table(rows: list[dict]):
    import pyarrow as pa

    return pa.Table.from_pylist(rows)


def hub_cache(cache_dir: Path, repo_id: str, splits: dict[str, list[dict]]) -> None:
    """datasets' cache as a download of repo_id leaves it, made offline: the parquet builder run on local files, its
    output moved to <org>___<name>/default/0.0.0/<hash>/ and named for the repo (load_dataset(repo_id) offline
    reads it from there, as it would a real download)."""
    import datasets

    files = {}
    for split, rows in splits.items():
        write_parquet(cache_dir / "src" / f"{split}.parquet", rows)
        files[split] = str(cache_dir / "src" / f"{split}.parquet")
    datasets.load_dataset("parquet", data_files=files, cache_dir=str(cache_dir / "build"))
    (built,) = [p for p in (cache_dir / "build" / "parquet").glob("*/*/*") if p.is_dir()]
    org, name = repo_id.split("/")
    target = cache_dir / f"{org}___{name}" / "default" / "0.0.0" / built.name
    shutil.copytree(built, target)
    for arrow in target.glob("parquet-*.arrow"):
        arrow.rename(arrow.with_name(arrow.name.replace("parquet-", f"{name}-", 1)))
    info = json.loads((target / "dataset_info.json").read_text())
    (target / "dataset_info.json").write_text(json.dumps(dict(info, dataset_name=name, config_name="default")))
    shutil.rmtree(cache_dir / "build")
    shutil.rmtree(cache_dir / "src")


def write_format(folder: Path, kind: str, splits: dict[str, list[dict]]) -> str:
    """The pairs of `splits` in one format a researcher holds them in; returns the datasets=[...] entry."""
    import datasets
    import pyarrow as pa

    if kind == "save_to_disk":
        datasets.DatasetDict(
            {s: datasets.Dataset.from_list(list(map(as_chat, r))) for s, r in splits.items()}
        ).save_to_disk(folder / "saved")
        return str(folder / "saved")
    if kind == "hub_repo_folder":
        for split, rows in splits.items():
            write_parquet(folder / "repo" / "data" / f"{split}-00000-of-00001.parquet", list(map(as_chat, rows)))
        return str(folder / "repo")
    convert = {"strings": lambda row: row, "chat": as_chat, "implicit": as_implicit}[kind.split(".")[0]]
    for split, rows in splits.items():
        path = folder / kind.replace(".", f"-{split}.")
        if path.suffix == ".arrow":  # Arrow's file format (datasets writes the stream format: save_to_disk above)
            table = pa_table(list(map(convert, rows)))
            with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
                writer.write_table(table, max_chunksize=5)
        else:
            write_parquet(path, list(map(convert, rows)))
    return str(folder / kind.replace(".", "-{split}."))


@pytest.fixture(scope="module")
def chatml_tok():
    """The toy model's tokenizer with model.chat_template=chatml, as train.py loads it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(REPO / "toy" / "tiny-llama"))
    tok.chat_template = sources.chat_template("chatml")
    return tok


def examples_of(split) -> list[tuple]:
    return [(e.prompt, e.chosen, e.rejected, e.prompt_ids.tolist(), e.chosen_ids.tolist()) for e in split]


FORMATS = ["chat.parquet", "implicit.parquet", "strings.parquet", "chat.arrow", "save_to_disk", "hub_repo_folder"]


@pytest.mark.parametrize("kind", FORMATS)
def test_every_format_loads_the_pairs_its_jsonl_gives(tmp_path, chatml_tok, kind):
    """Parquet (conversational, implicit prompt, strings), an Arrow file, a save_to_disk folder and a Hub-repo
    folder (data/train-*.parquet) give, split by split, exactly the tokenized pairs of the same rows in a .jsonl
    (before: only .jsonl/.json were read, a folder or parquet file refused)."""
    splits = {"train": toy_pairs("train", 40), "test": toy_pairs("test", 12)}
    entry = write_format(tmp_path, kind, splits)
    sources.validate_sources([entry])
    plain = kind.startswith("strings")
    for split, rows in splits.items():
        reference = write_jsonl(tmp_path / f"ref-{split}.jsonl", rows if plain else list(map(as_chat, rows)))
        expected = pd.load_tokenized([reference], chatml_tok, split)
        loaded = pd.load_tokenized([entry], chatml_tok, split, cache_dir=str(tmp_path / "cache"))
        assert examples_of(loaded) == examples_of(expected) and len(expected) == len(rows)
        assert loaded.stats[0].truncation_mode == expected.stats[0].truncation_mode == "keep_end"  # prompts cue


def test_a_bad_row_in_a_parquet_file_is_named_by_file_row_and_field(tmp_path, chatml_tok):
    rows = list(map(as_chat, toy_pairs("train", 5)))
    rows[3] = dict(rows[3], rejected=[{"role": "user", "content": "no reply"}])
    write_parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(sources.DataError, match=r"bad.parquet, row 4: field 'rejected': the last message must be"):
        pd.load_tokenized([str(tmp_path / "bad.parquet")], chatml_tok, "train")


@pytest.mark.parametrize(
    "kind", ["chat.parquet", "implicit.parquet", "strings.parquet", "save_to_disk", "hub_repo_folder"]
)
def test_each_format_trains_one_dpo_step_on_the_toy_model(tmp_path, kind):
    """The bar: the same pairs in each format train one DPO step (model.chat_template=chatml)."""
    from test_train import metrics, train

    entry = write_format(tmp_path, kind, {"train": toy_pairs("train", 16), "test": toy_pairs("test", 8)})
    args = ["loss=dpo", f"datasets=[{entry}]", "model.chat_template=chatml", "n_examples=8", "sample_during_eval=false"]
    result = train(tmp_path / "run", *args, "do_first_eval=false", f"local_dirs=[{tmp_path / 'local'}]")
    assert "pairs_kept=16" in result.stdout and "eval pairs 8" in result.stdout
    (step,) = [m for m in metrics(tmp_path / "run") if "loss/train" in m]
    assert math.isfinite(step["loss/train"])


def test_a_hub_id_loads_from_the_datasets_cache_offline_with_its_split_names(tmp_path, chatml_tok):
    """datasets=[org/name:train=train_prefs:test=test_prefs] reads a Hub dataset through datasets.load_dataset, here
    offline from a cache laid out as a download leaves it (before: any org/name was a missing local path); its rows
    are checked as a file's are, and give the pairs the same rows give in a file."""
    splits = {"train_prefs": toy_pairs("train", 24), "test_prefs": toy_pairs("test", 8)}
    hub_cache(
        tmp_path / "local" / "datasets", "toy-org/toy_prefs", {s: list(map(as_implicit, r)) for s, r in splits.items()}
    )
    entry = "toy-org/toy_prefs:train=train_prefs:test=test_prefs"
    sources.validate_sources([entry])
    assert sources.on_hub(entry) and not sources.on_hub("toy") and sources.on_hub("hh")
    for split, hub_split in (("train", "train_prefs"), ("test", "test_prefs")):
        reference = write_jsonl(tmp_path / f"{split}.jsonl", list(map(as_chat, splits[hub_split])))
        loaded = pd.load_tokenized([entry], chatml_tok, split, cache_dir=str(tmp_path / "local" / "datasets"))
        assert examples_of(loaded) == examples_of(pd.load_tokenized([reference], chatml_tok, split))
        assert loaded.stats[0].origin.startswith("hub:") and loaded.stats[0].origin.endswith("(implicit prompt)")
    held_out = "toy-org/toy_prefs:train=train_prefs:test=0.25"  # a quarter of train_prefs held out as test
    cache = str(tmp_path / "local" / "datasets")
    assert [len(pd.load_tokenized([held_out], chatml_tok, s, cache_dir=cache)) for s in ("train", "test")] == [18, 6]


def test_hub_ids_train_and_an_uncached_one_offline_exits_2_naming_it(tmp_path):
    from test_train import train

    splits = {"train_prefs": toy_pairs("train", 16), "test_prefs": toy_pairs("test", 8)}
    hub_cache(
        tmp_path / "local" / "datasets", "toy-org/toy_prefs", {s: list(map(as_implicit, r)) for s, r in splits.items()}
    )
    args = ["loss=dpo", "model.chat_template=chatml", "n_examples=8", "sample_during_eval=false", "do_first_eval=false"]
    args.append(f"local_dirs=[{tmp_path / 'local'}]")
    train(tmp_path / "run", *args, "datasets=[toy-org/toy_prefs:train=train_prefs:test=test_prefs]")
    refused = train(tmp_path / "x", *args, "datasets=[nobody/not_cached_prefs]", check=False)
    assert refused.returncode == 2, refused.stderr
    assert "dataset 'nobody/not_cached_prefs'" in refused.stderr and "not available offline" in refused.stderr
    assert "pre-populate the cache" in refused.stderr and not (tmp_path / "x").exists()


def test_a_held_out_fraction_of_a_file_is_the_one_the_hub_path_holds_out(tmp_path, gpt2_tok):
    """NAME:test=F: no test split, so the fraction F of train is held out (a file without {split} otherwise serves
    both); its rows are the ones Dataset.shuffle(seed=42) puts first, as for se and Hub ids; train keeps the rest."""
    import datasets

    rows = numbered_rows(40)
    entry = write_jsonl(tmp_path / "all.jsonl", rows) + ":test=0.25"
    assert sources.serves_both_splits(str(tmp_path / "all.jsonl")) and not sources.serves_both_splits(entry)
    train_split, test_split = (pd.load_tokenized([entry], gpt2_tok, s) for s in ("train", "test"))
    drawn = datasets.Dataset.from_list(rows).shuffle(seed=42).select(range(10))["prompt"]
    assert sorted(e.prompt for e in test_split) == sorted(drawn)
    assert len(train_split) == 30 and not {e.prompt for e in train_split} & set(drawn)
    assert [e.prompt for e in train_split] == [r["prompt"] for r in rows if r["prompt"] not in drawn]  # file order


@pytest.mark.parametrize(
    "entry, message",
    [
        ("hh:0", "cannot read '0': expected N >= 1 pairs or a fraction 0 < F <= 1"),
        ("hh:1.5", "cannot read '1.5'"),
        ("hh:half", "cannot read 'half'"),
        ("hh:0.5:100", "cannot read '100'"),
        ("org/name:split=train", "cannot read 'split=train'"),
        ("org/name:tset=test_prefs", "did you mean 'test='"),
        ("org/name:train=", "cannot read 'train='"),
        (":0.5", "cannot read ':0.5'"),
        ("org/name:test=1.5", "cannot read 'test=1.5': expected a split or a fraction 0 < F < 1"),
        ("hh:train=x", "hh has its splits; it takes a count or fraction only"),
        ("examples/pairs.jsonl:train=x", "a file holds one split"),
    ],
)
def test_malformed_entries_are_refused_naming_the_entry(entry, message):
    with pytest.raises(sources.DataError) as error:
        sources.validate_sources([entry])
    assert message in str(error.value) and "datasets: " in str(error.value)


def test_entries_read_as_their_spec():
    spec = sources.parse_spec("HuggingFaceH4/ultrafeedback_binarized:train=train_prefs:test=test_prefs:0.25")
    assert (spec.name, spec.take, spec.train, spec.test, spec.held_out) == (
        "HuggingFaceH4/ultrafeedback_binarized",
        0.25,
        "train_prefs",
        "test_prefs",
        0.0,
    )
    assert spec.source == "HuggingFaceH4/ultrafeedback_binarized:train=train_prefs:test=test_prefs"  # no take
    assert sources.parse_spec("hh:1000").take == 1000 and sources.parse_spec("hh:1.0").take == 1.0
    assert sources.parse_spec("a/b:test=0.05").held_out == 0.05 and sources.parse_spec("a/b:config=x").config == "x"


def test_a_mixture_draws_a_seeded_count_or_fraction_of_each_source(tmp_path, gpt2_tok):
    """datasets=[toy:100, file:0.5]: 100 of toy's training pairs and half the file's, drawn by (seed, entry), each
    in its source's order; the cache entry is the whole source's (shared with datasets=[toy]); evaluation reads
    whole test splits; the summary shows pairs kept and taken; the fingerprint names the pairs drawn."""
    write_jsonl(tmp_path / "train.jsonl", numbered_rows(30))
    write_jsonl(tmp_path / "test.jsonl", numbered_rows(8))
    entries = ["toy:100", str(tmp_path / "{split}.jsonl") + ":0.5"]
    cache = str(tmp_path / "cache")
    load = lambda split, seed, names=entries: pd.load_tokenized(names, gpt2_tok, split, cache_dir=cache, seed=seed)  # noqa: E731
    mixed = load("train", 0)
    toy_all, file_all = (pd.load_tokenized([e.rsplit(":", 1)[0]], gpt2_tok, "train", cache_dir=cache) for e in entries)
    assert len(mixed) == 115 and [s.taken for s in mixed.stats] == [100, 15]
    assert [s.cache.split()[0] for s in mixed.stats] == ["written", "written"] and toy_all.stats[0].cache.startswith(
        "hit"
    )
    toy_drawn = [e.prompt for e in mixed[:100]]
    toy_order = [e.prompt for e in toy_all]
    assert sorted(toy_drawn, key=toy_order.index) == toy_drawn and set(toy_drawn) <= set(toy_order)
    assert {e.prompt for e in mixed[100:]} <= {e.prompt for e in file_all}
    assert mixed.lengths.shape == (3, 115) and mixed.lengths[0].tolist() == [len(e.prompt_ids) for e in mixed]
    again, other = load("train", 0), load("train", 1)
    assert examples_of(again) == examples_of(mixed) and again.keys == mixed.keys
    assert examples_of(other) != examples_of(mixed) and other.keys != mixed.keys
    assert len(load("test", 0)) == 256 + 8  # evaluation: whole test splits
    summary = pd.dataset_summary(mixed.stats)
    assert "pairs_kept=2000 taken=100" in summary and "pairs_kept=30 taken=15" in summary
    batches = pd.get_batch_iterator(mixed, gpt2_tok.pad_token_id, batch_size=8, n_epochs=1, world_size=2, balance=True)
    assert sum(len(b["prompt"]) for b in batches) == 112 // 2
    with pytest.raises(sources.DataError, match=r"'toy:2001' asks for 2001 training pairs; the source has 2000"):
        load("train", 0, ["toy:2001"])


def test_a_resume_with_another_draw_is_refused_by_the_manifest(tmp_path):
    """The draw is part of the data's fingerprint in run_manifest.json: the same entry and seed resume, another
    count (or seed) is other data, refused before any model loads."""
    from test_train import FAST, train

    import config_loader
    import run_manifest
    import train as train_py

    args = ["loss=dpo", "n_examples=8", "sample_during_eval=false", "do_first_eval=false", f"local_dirs=[{tmp_path}]"]
    train(tmp_path / "run", *args, "datasets=[toy:64]")
    manifest = json.loads((tmp_path / "run" / "run_manifest.json").read_text())
    assert [s["taken"] for s in manifest["data_counts"]["train"]] == [64] and "toy:64" in manifest["data"]["train"]
    for datasets_entry, refused in (("toy:64", False), ("toy:32", True)):
        cfg, _ = config_loader.load_config([*FAST, *args, f"datasets=[{datasets_entry}]"])
        splits = pd.load_splits(cfg, train_py.load_tokenizer(cfg))
        if refused:
            with pytest.raises(run_manifest.ManifestError, match="differs"):
                run_manifest.check_against(tmp_path / "run", cfg, splits, "resume")
        else:
            run_manifest.check_against(tmp_path / "run", cfg, splits, "resume")


def test_the_cold_build_holds_a_chunk_not_the_source(tmp_path, gpt2_tok):
    """Rows are read, checked, converted and tokenized a chunk at a time into the cache's Arrow file: the Python
    memory a build peaks at does not grow with the source (before: every row, its normalized form and the file's
    text were held at once, about 1.3 KB a pair more here)."""
    import tracemalloc

    def peak(n: int) -> int:
        rows = [
            {"prompt": f"\n\nHuman: q {i} {'w' * (i % 50)}?\n\nAssistant:", "chosen": f" a {i}", "rejected": f" b {i}"}
            for i in range(n)
        ]
        path = write_jsonl(tmp_path / f"rows{n}.jsonl", rows)
        del rows
        tracemalloc.start()
        split = pd.load_tokenized([path], gpt2_tok, "train", cache_dir=str(tmp_path / "cache"))
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert len(split) == n
        return peak

    peak(1000)  # first-call costs (imports, caches) out of the way
    small, large = peak(4000), peak(20000)
    assert large - small < 8_000_000, (small, large)  # before: +21 MB
