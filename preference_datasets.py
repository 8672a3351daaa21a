"""Preference data: raw sources -> normalized examples -> tokenized pairs (cached on disk) -> batches.

Sources: hh, shp, se (1% held out as 'test'), ultrafeedback and kto_mix (unpaired) from the Hugging Face Hub; toy
(toy/data/{split}.jsonl); or a .jsonl/.json path, '{split}' in it replaced by the split name (without it, one file
serves every split). A converter per source (SOURCES) gives {prompt: PromptResponses}; tokenize_normalized() makes
token ids of it, cached on disk under a key of content, tokenizer, LoadOptions and CODE_VERSION; get_batch_iterator()
shuffles the pairs, cuts global batches and collates this rank's share of each.

A local file's first row decides its shape (SHAPES; see examples/pairs.jsonl): {prompt, chosen, rejected[,
sft_target]} as strings (a response is appended to the prompt verbatim, so it carries its own leading space) or as
{role, content} message lists rendered with the tokenizer's chat template; {prompt, completion, label} rows of unpaired
(KTO) data; or a hub source's raw export (HH transcripts, SHP rows, UltraFeedback conversations). A bad row raises
DataError naming the file, line, field and what was expected: nothing is skipped silently.

Departures from the original DPO code:
  1. Tokenized once per run and cached on disk, not on every rank at every step.
  2. The shuffle is over pairs, a fresh permutation per epoch from (seed, epoch); resumable from start_example.
  3. Prompt and response are tokenized separately and concatenated: the prompt is a prefix by construction.
  4. BOS once, first in the prompt, when the tokenizer adds one; EOS after every response but a truncated one
     (it did not end: teaching the model to stop mid-thought is wrong).
  5. Special-token text in plain text is ordinary text, so the appended EOS is a response's only EOS (the original
     crashed); chat-template markup is parsed as special tokens.
  6. Pairs with an empty response or chosen == rejected (as text, or as tokens once truncated) are dropped, counted.
  7. Responses get the room left after the prompt (max_length - len(prompt)), not max_length - max_prompt_length.
  8. SHP and SE keep at most MAX_PAIRS_PER_PROMPT pairs per prompt; SE drops ties.
  9. hh: the prompt ends at the last "\\n\\nAssistant:" both transcripts share; rows whose histories differ are dropped.
 10. Prompts that end by cueing the reply (hh, chat, local "...\\n\\nAssistant:" rows) are cut keep_end by default.
 11. Each epoch drops its incomplete last global batch; n_examples runs ceil(n_examples / batch_size) steps.
"""
from __future__ import annotations

import difflib
import hashlib
import html
import json
import os
import pickle
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Optional

import numpy as np
import torch
from filelock import FileLock
from torch.nn.utils.rnn import pad_sequence

CODE_VERSION = 3  # bump when tokenization or conversion changes, so old cache files are not reused
MAX_PAIRS_PER_PROMPT = 5  # SHP and SE: comparisons grow as O(n^2) in a post's answers (the SHP authors' advice)
TRUNCATION_MODES = ("keep_start", "keep_end")
CHAT_ROLES = ("system", "user", "assistant", "tool")
ROLE_HINTS = {"human": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant", "ai": "assistant"}
HH_MARKER = "\n\nAssistant:"
ENCODE_CHUNK = 512  # prompts per tokenizer call: a call per text is slow, one call for all holds every list at once


class DataError(ValueError):
    """Bad data, or a source that cannot be read. The message names the file, line, field and what was expected."""


# --- The normalized form, and the converters from raw rows (pure functions: tests feed them rows by hand) ----

@dataclass
class PromptResponses:
    """One prompt: distinct response texts (appended to it verbatim); pairs (i, j) = responses[i] preferred over
    responses[j]; sft_targets (hub: one per prompt, as the original; local: one per row); rated (i, label) per
    unpaired row; chat: rendered by a chat template, so its special-token text is markup."""
    prompt: str
    responses: list[str] = field(default_factory=list)
    pairs: list[tuple[int, int]] = field(default_factory=list)
    sft_targets: list[str] = field(default_factory=list)
    rated: list[tuple[int, bool]] = field(default_factory=list)
    chat: bool = False

    def index(self, response: str) -> int:
        if response not in self.responses:
            self.responses.append(response)
        return self.responses.index(response)

    def add_pair(self, chosen: str, rejected: str) -> None:
        self.pairs.append((self.index(chosen), self.index(rejected)))


Converted = tuple[dict[str, PromptResponses], Counter]  # ({prompt: PromptResponses}, rows or pairs dropped by reason)


def convert_hh(rows: Iterable[dict], tokenizer: Any = None) -> Converted:
    """Anthropic/hh-rlhf rows {chosen, rejected}, whole transcripts (departure 9). SFT target: the last chosen."""
    data, dropped = {}, Counter()
    for row in rows:
        chosen, rejected = row["chosen"], row["rejected"]
        cut = chosen.rfind(HH_MARKER, 0, len(os.path.commonprefix([chosen, rejected])))
        prompt = chosen[: cut + len(HH_MARKER)]
        responses = chosen[len(prompt):], rejected[len(prompt):]
        if cut == -1 or any("\n\nHuman:" in r for r in responses):  # the histories differ
            dropped["hh_prompt_mismatch"] += 1
            continue
        entry = data.setdefault(prompt, PromptResponses(prompt))
        entry.add_pair(*responses)
        entry.sft_targets = [responses[0]]
    return data, dropped


def convert_shp(rows: Iterable[dict], tokenizer: Any = None) -> Converted:
    """stanfordnlp/SHP rows; a score ratio below 2 is a weak preference, dropped as the original. SFT target: the
    best-scored response kept."""
    data, dropped, best = {}, Counter(), {}
    for row in rows:
        a, b = row["score_A"], row["score_B"]
        if max(a, b) < 2 * min(a, b) or max(a, b) <= 0:  # ratio >= 2 without dividing by a score of 0
            dropped["shp_score_ratio_below_2"] += 1
            continue
        entry = data.setdefault(prompt := "\n\nHuman: " + row["history"] + HH_MARKER, PromptResponses(prompt))
        if len(entry.pairs) >= MAX_PAIRS_PER_PROMPT:
            dropped["over_pair_cap"] += 1
            continue
        ref_a, ref_b = " " + row["human_ref_A"], " " + row["human_ref_B"]
        entry.add_pair(*((ref_a, ref_b) if row["labels"] == 1 else (ref_b, ref_a)))
        for response, score in ((ref_a, a), (ref_b, b)):
            if score > best.get(prompt, -float("inf")):
                best[prompt], entry.sft_targets = score, [response]
    return data, dropped


def strip_html(text: str) -> str:
    """HTML -> plain text: block elements become paragraph breaks, other tags go, entities are decoded."""
    text = re.sub(r"<br\s*/?>", "\n", text, flags=re.I)
    text = re.sub(r"</?(?:p|div|pre|blockquote|ul|ol|li|table|tr|hr|h[1-6])\b[^>]*>", "\n\n", text, flags=re.I)
    text = html.unescape(re.sub(r"<[^>]*>", "", text))  # tags first: an escaped '&lt;' is text, not a tag
    return re.sub(r"\n\s*\n\s*\n+", "\n\n", text).strip()


def convert_se(rows: Iterable[dict], tokenizer: Any = None) -> Converted:
    """stack-exchange-preferences rows {question, answers: [{text, pm_score}]}: every pair of answers with different
    scores, better first. SFT target: the best answer."""
    data, dropped = {}, Counter()
    for row in rows:
        entry = data.setdefault(p := "\n\nHuman: " + strip_html(row["question"]) + HH_MARKER, PromptResponses(p))
        texts, scores = [" " + strip_html(a["text"]) for a in row["answers"]], [a["pm_score"] for a in row["answers"]]
        for i in range(len(texts)):
            for j in range(i + 1, len(texts)):
                if scores[i] == scores[j]:
                    dropped["se_tie"] += 1  # no preference
                elif len(entry.pairs) >= MAX_PAIRS_PER_PROMPT:
                    dropped["over_pair_cap"] += 1
                else:
                    entry.add_pair(*((texts[i], texts[j]) if scores[i] > scores[j] else (texts[j], texts[i])))
        if texts:
            entry.sft_targets = [texts[scores.index(max(scores))]]
    return data, dropped


def render_chat(tokenizer: Any, history: list[dict], reply: dict) -> tuple[str, str]:
    """(history, assistant reply) -> (prompt text ending in the generation prompt, response text) by the tokenizer's
    chat template. A trailing EOS text is removed: EOS is appended as an id later."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise DataError(f"chat-form rows need a tokenizer with a chat template; tokenizer {name!r} has none (set model."
                        "chat_template=chatml or a path to a Jinja template file, or write the rows as plain strings)")
    prompt = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(history + [reply], tokenize=False)
    if not full.startswith(prompt):
        raise DataError("the chat template does not render the prompt as a prefix of prompt+reply, so the reply cannot "
                        f"be separated (prompt ends {prompt[-80:]!r}, conversation {full[len(prompt) - 80:][:120]!r})")
    response, eos = full[len(prompt):], tokenizer.eos_token
    return prompt, response.rstrip()[: -len(eos)] if eos and response.rstrip().endswith(eos) else response


def reply_messages(prompt: list[dict], messages: list[dict]) -> list[dict]:
    """The reply part of a chosen/rejected/completion message list, which may repeat the prompt's messages first."""
    return messages[len(prompt):] if messages[: len(prompt)] == prompt else messages


def convert_rows(rows: Iterable[dict], tokenizer: Any = None) -> Converted:
    """Local rows: {prompt, chosen, rejected[, sft_target]}, each adding one SFT target (sft_target, else chosen), or
    unpaired {prompt, completion, label}. Strings are taken as they are, message lists rendered (render_chat)."""
    data = {}
    for row in rows:
        target = "sft_target" if "sft_target" in row else "chosen"
        fields = ("completion",) if "completion" in row else ("chosen", "rejected", target)
        if isinstance(row["prompt"], str):
            prompt, replies, chat = row["prompt"], [row[name] for name in fields], False
        else:
            rendered = [render_chat(tokenizer, row["prompt"], reply_messages(row["prompt"], row[n])[0]) for n in fields]
            prompt, replies, chat = rendered[0][0], [response for _, response in rendered], True
        entry = data.setdefault(prompt, PromptResponses(prompt, chat=chat))
        if "completion" in row:  # a completion rated twice counts twice
            entry.rated.append((entry.index(replies[0]), bool(row["label"])))
        else:
            entry.add_pair(replies[0], replies[1])
            entry.sft_targets.append(replies[2])
    return data, Counter()


def convert_ultrafeedback(rows: Iterable[dict], tokenizer: Any = None) -> Converted:
    """HuggingFaceH4/ultrafeedback_binarized rows {chosen, rejected}: whole conversations ending in the reply."""
    pairs, dropped = [], Counter()
    for row in rows:
        if row["rejected"][:-1] != row["chosen"][:-1] or row["chosen"][-1]["role"] != "assistant":
            dropped["ultrafeedback_prompt_mismatch"] += 1
        else:
            pairs.append({"prompt": row["chosen"][:-1], "chosen": row["chosen"][-1:], "rejected": row["rejected"][-1:]})
    return convert_rows(pairs, tokenizer)[0], dropped


def fetch_hub(hub_id: str, split: str, cache_dir: Optional[str], splits: Optional[dict] = None):
    """datasets.load_dataset(hub_id, split=...), with our advice when it cannot be had (e.g. offline)."""
    import datasets  # only hub sources need it, and it is slow to import
    hub_split = (splits or {}).get(split, split)
    try:
        return datasets.load_dataset(hub_id, split=hub_split, cache_dir=cache_dir)
    except Exception as e:  # the library raises ConnectionError, FileNotFoundError, ValueError, ... by case
        where = cache_dir or "the default Hugging Face cache"
        offline = any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on")
                      for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
        why = (f"is not available offline (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is set) and is not in {where}" if offline
               else f"could not be loaded from the Hugging Face Hub into {where}")
        raise DataError(
            f"dataset {hub_id!r} (split {hub_split!r}) {why}. To use a local copy, either\n  - export it to JSON "
            "lines with rows {prompt, chosen, rejected} (see examples/pairs.jsonl) and pass datasets=[path/to/file."
            f"jsonl], or\n  - pre-populate the cache: with network access run datasets.load_dataset({hub_id!r}, split="
            f"{hub_split!r}, cache_dir={cache_dir!r}) and copy that cache directory here.\n({type(e).__name__}: {e})"
        ) from e


def fetch_se(split: str, cache_dir: Optional[str]):
    """SE has only a train split: as the original, shuffle with seed 42 and hold out the first 1% as 'test'."""
    dataset = fetch_hub("HuggingFaceH4/stack-exchange-preferences", "train", cache_dir).shuffle(seed=42)
    n_test = int(len(dataset) * 0.01)
    return dataset.select(range(n_test) if split == "test" else range(n_test, len(dataset)))


# --- Local files: their shapes, the checks of every row, reading ---------------------------------------------

def _describe(value: Any, short: bool = False) -> str:
    """'null', 'boolean true', 'number 42', 'string "Hi"': the JSON type (only, when short) and a short view."""
    kind = "null" if value is None else "boolean" if isinstance(value, bool) else {
        str: "string", list: "list", dict: "object"}.get(type(value), "number")
    text = repr(value) if isinstance(value, float) else json.dumps(value, ensure_ascii=False)
    return kind if short or value is None else f"{kind} {text if len(text) <= 60 else text[:57] + '...'}"


def _check_messages(row: dict, where: str, name: str) -> None:
    for k, message in enumerate(row[name]):
        at = f"{where}: field '{name}' message {k}"
        if not isinstance(message, dict):
            raise DataError(f"{at}: expected an object with role and content, got {_describe(message)}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise DataError(f"{at}: '{key}': expected a string, got {_describe(message[key])}" if key in message
                                else f"{at}: missing '{key}' (expected {{\"role\": ..., \"content\": ...}}, "
                                f"found keys {sorted(message)})")
        if (role := message["role"]) not in CHAT_ROLES:
            guess = ROLE_HINTS.get(role.lower()) or next(iter(difflib.get_close_matches(role, CHAT_ROLES, 1)), None)
            raise DataError(f"{at}: unknown role '{role}' (expected one of {', '.join(CHAT_ROLES)})"
                            + (f"; did you mean '{guess}'?" if guess else ""))


def _check_texts(row: dict, where: str, fields: list[str]) -> None:
    """Prompt and replies all strings, or all message lists: a non-empty prompt, then one assistant reply each."""
    if len({type(row[name]) for name in fields}) > 1:
        shown = ", ".join(f"{name}={_describe(row[name], short=True)}" for name in fields)
        raise DataError(f"{where}: fields {'/'.join(fields)} mix strings and message lists ({shown}); "
                        "expected all strings or all lists of {role, content} messages")
    if isinstance(row["prompt"], str):
        return
    for name in fields:
        _check_messages(row, where, name)
    if not row["prompt"]:
        raise DataError(f"{where}: field 'prompt': empty list; expected at least one {{role, content}} message")
    for name in fields[1:]:
        if len(reply := reply_messages(row["prompt"], row[name])) != 1:
            raise DataError(f"{where}: field '{name}': expected one assistant message (alone, or after the prompt's "
                            f"messages), got {len(reply)} messages after the prompt")
        if (role := reply[0]["role"]) != "assistant":
            raise DataError(f"{where}: field '{name}': the reply must have role 'assistant', got role '{role}'")


class Shape(NamedTuple):
    """A local row shape: how a first row is recognised, what every row must hold, how the rows convert."""
    name: str  # in "missing field" messages
    description: str  # in "the first row has the ... shape" messages
    matches: Callable[[dict], bool]
    fields: dict[str, tuple]  # field -> accepted types
    convert: Callable[[Iterable[dict], Any], Converted]
    truncation_mode: Optional[str]  # default; None: keep_end when the first prompt cues a reply, else keep_start


TEXT, NUMBER = (str, list), (int, float)  # TEXT: a string, or a list of {role, content} messages
TYPE_NAMES = {str: "a string", list: "a list of {role, content} messages", bool: "a boolean", int: "a number"}
SHP_FIELDS = dict(history=(str,), human_ref_A=(str,), human_ref_B=(str,), labels=(int,), score_A=NUMBER, score_B=NUMBER)
SHAPES = {  # a first row takes the first shape that matches; "pairs", last, matches every row
    "unpaired": Shape("unpaired", "unpaired {prompt, completion, label}", lambda r: "completion" in r and "label" in r,
                      dict(prompt=TEXT, completion=TEXT, label=(bool,)), convert_rows, None),
    "shp": Shape("SHP", "SHP", lambda r: all(k in r for k in SHP_FIELDS), SHP_FIELDS, convert_shp, "keep_start"),
    "hh": Shape("Anthropic HH", "Anthropic HH {chosen, rejected} transcript",
                lambda r: "prompt" not in r and isinstance(r.get("chosen"), str) and HH_MARKER in r["chosen"],
                dict(chosen=(str,), rejected=(str,)), convert_hh, "keep_end"),
    "ultrafeedback": Shape("UltraFeedback", "UltraFeedback {chosen, rejected} conversation",
                           lambda r: not isinstance(r.get("prompt"), list) and isinstance(r.get("chosen"), list)
                           and len(r["chosen"]) >= 2, dict(chosen=(list,), rejected=(list,)), convert_ultrafeedback,
                           "keep_end"),
    "pairs": Shape("pair", "{prompt, chosen, rejected}", lambda r: True, dict(prompt=TEXT, chosen=TEXT, rejected=TEXT),
                   convert_rows, None),
}


def detect_shape(row: Any) -> str:
    return next(name for name, shape in SHAPES.items() if shape.matches(row)) if isinstance(row, dict) else "pairs"


def check_row(row: Any, where: str, shape: str = "pairs") -> None:
    """Raise DataError unless `row` has the shape's fields, with their types, and what the types do not say."""
    fields = SHAPES[shape].fields
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object with fields {', '.join(fields)}, got {_describe(row)}")
    fields = dict(fields, sft_target=TEXT) if shape == "pairs" and "sft_target" in row else fields  # optional
    for name, types in fields.items():
        if name not in row:
            typo = difflib.get_close_matches(name, [k for k in row if k not in fields], 1)
            raise DataError(f"{where}: missing field '{name}' (expected the {SHAPES[shape].name} fields "
                            f"{', '.join(fields)}; found {', '.join(map(repr, row)) or 'none'})"
                            + (f"; '{typo[0]}' looks like a misspelling of '{name}'" if typo else ""))
        if not isinstance(row[name], types) or isinstance(row[name], bool) and bool not in types:
            expected = " or ".join(dict.fromkeys(TYPE_NAMES[int if t is float else t] for t in types))
            raise DataError(f"{where}: field '{name}': expected {expected}, got {_describe(row[name])}")
    if shape in ("pairs", "unpaired"):
        _check_texts(row, where, [name for name in fields if name != "label"])
    if shape == "shp" and row["labels"] not in (0, 1):
        raise DataError(f"{where}: field 'labels': expected 0 or 1 (1 = human_ref_A preferred), got {row['labels']}")
    for name in fields if shape == "ultrafeedback" else ():
        _check_messages(row, where, name)
        if not row[name] or row[name][-1]["role"] != "assistant":
            raise DataError(f"{where}: field '{name}': the last message must be the assistant's reply, got "
                            + (f"role '{row[name][-1]['role']}'" if row[name] else "no messages"))


def _parse(path: Path, text: str, line: int, expected: str) -> Any:
    """json.loads, refusing duplicate fields; errors name the line."""
    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
        for key in (key for key, n in Counter(k for k, _ in pairs).items() if n > 1):
            raise DataError(f"{path}, line {line + 1}: duplicate field '{key}' in one object")
        return dict(pairs)
    try:
        return json.loads(text, object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as e:
        at = "" if e.msg.endswith(" at") else " at"  # "Unterminated string starting at" has its own
        raise DataError(f"{path}, line {line + e.lineno}: not valid JSON ({e.msg}{at} column {e.colno}); "
                        f"expected {expected}") from e


def read_rows(path: Path) -> list[dict]:
    """Every row of a local .jsonl (a JSON object per line) or .json (a JSON list) file, checked for its shape."""
    path, what = Path(path), "{prompt, chosen, rejected} rows"
    if path.suffix not in (".jsonl", ".json"):
        raise DataError(f"{path}: expected a .jsonl or .json file of {what}, got a '{path.suffix}' file")
    if not path.is_file():
        raise DataError(f"{path}: no such file (expected a .jsonl or .json file of {what})")
    try:
        text = (data := path.read_bytes()).decode("utf-8-sig")  # -sig: tolerate the byte-order mark editors write
    except UnicodeDecodeError as e:
        raise DataError(f"{path}, line {data[: e.start].count(10) + 1}: not valid UTF-8 (byte {data[e.start]:#04x} at "
                        f"offset {e.start}); expected a UTF-8 text file") from e
    if not text.strip():
        raise DataError(f"{path}: the file is empty (no rows); expected {what}")
    if path.suffix == ".jsonl":
        located = [(_parse(path, chunk, n - 1, "one JSON object per line"), f"{path}, line {n}")
                   for n, chunk in enumerate(text.split("\n"), 1) if chunk.strip()]
    elif not isinstance(rows := _parse(path, text, 0, f"a JSON list of {what[:-5]} objects"), list):
        raise DataError(f"{path}: expected a JSON list of {what[:-5]} objects, got {_describe(rows, short=True)}")
    else:
        located = [(row, f"{path}, item {n}") for n, row in enumerate(rows, 1)]
    if not located:
        raise DataError(f"{path}: no rows; expected {what}")
    shape = detect_shape(located[0][0])  # the first row decides; every row must then have that shape
    for row, where in located:
        if shape != "pairs" and detect_shape(row) != shape:
            got = "fields " + ", ".join(map(repr, row)) if isinstance(row, dict) else _describe(row)
            raise DataError(f"{where}: the file's first row has the {SHAPES[shape].description} shape; this row does "
                            f"not (got {got})")
        check_row(row, where, shape)
    return [row for row, _ in located]


# --- The registry: a new source is one entry in SOURCES -----------------------------------------------------

@dataclass(frozen=True)
class Source:
    convert: Callable[[Iterable[dict], Any], Converted]
    truncation_mode: str = "keep_start"  # keep_end for prompts that end by cueing the reply (departure 10)
    fetch: Optional[Callable[[str, Optional[str]], Any]] = None  # (split, cache_dir) -> the rows of a hub source
    path: Optional[str] = None  # a local source's file, relative to this module, '{split}' replaced; None: hub
    sample_rule: Optional[Callable[[str], bool]] = None  # response -> whether it shows the taught behaviour
    unpaired: bool = False  # its rows are labelled completions (KTO data), not pairs


def toy_follows_rule(response: str) -> bool:
    """The toy task's preferred behaviour (as toy/make_toy.py's follows_rule): letters, none upper case."""
    return bool(letters := re.sub(r"[^A-Za-z]", "", response)) and letters == letters.lower()


SOURCES: dict[str, Source] = {
    "hh": Source(convert_hh, "keep_end", fetch=partial(fetch_hub, "Anthropic/hh-rlhf")),
    "shp": Source(convert_shp, "keep_start", fetch=partial(fetch_hub, "stanfordnlp/SHP")),  # as the original
    "se": Source(convert_se, "keep_start", fetch=fetch_se),
    "ultrafeedback": Source(convert_ultrafeedback, "keep_end", fetch=partial(
        fetch_hub, "HuggingFaceH4/ultrafeedback_binarized", splits={"train": "train_prefs", "test": "test_prefs"})),
    "toy": Source(convert_rows, "keep_start", path="toy/data/{split}.jsonl", sample_rule=toy_follows_rule),
    "kto_mix": Source(convert_rows, "keep_end", fetch=partial(fetch_hub, "trl-lib/kto-mix-14k"), unpaired=True),
}
LOCAL_FILE = Source(convert_rows)  # any path in datasets=[...]: its first row picks the shape (SHAPES)


def resolve_source(name: str, split: str) -> tuple[Source, Optional[Path]]:
    """A dataset name -> (its Source, its local file for this split, or None for a hub source)."""
    if name in SOURCES:
        path = SOURCES[name].path
        return SOURCES[name], Path(__file__).resolve().parent / path.format(split=split) if path else None
    if "/" in name or os.sep in name or Path(name).suffix or Path(name).exists():
        return LOCAL_FILE, Path(name.replace("{split}", split))
    guess = difflib.get_close_matches(name, list(SOURCES), 1, cutoff=0.5)
    raise DataError(f"unknown dataset '{name}': expected one of {', '.join(SOURCES)} or a path to a .jsonl/.json "
                    "file" + (f"; did you mean '{guess[0]}'?" if guess else ""))


def sample_rule(names: list[str]) -> Optional[Callable[[str], bool]]:
    """The rule generated samples should follow, when every source in `names` shares one (the toy task); else None."""
    rules = {SOURCES[n].sample_rule if n in SOURCES else None for n in names}
    return rules.pop() if len(rules) == 1 else None


def validate_sources(names: list[str], splits: tuple[str, ...] = ("train", "test"), *, unpaired: bool = False,
                     pairs_to_unpaired: bool = False) -> None:
    """Check names, paths and local files without a tokenizer (at config time); every problem in one DataError.
    Hub sources are checked by name only. `unpaired` (loss=kto): every source must hold {prompt, completion, label}
    rows, or pairs with `pairs_to_unpaired`; a loss on pairs refuses unpaired rows."""
    problems = []
    for name in names:
        for split in splits:
            try:
                source, path = resolve_source(name, split)
                holds_unpaired = source.unpaired if path is None else detect_shape(read_rows(path)[0]) == "unpaired"
                where = f"dataset '{name}'" if path is None else str(path)
                if holds_unpaired and not unpaired:
                    raise DataError(f"{where}: holds unpaired {{prompt, completion, label}} rows; only an unpaired "
                                    "loss reads them (loss=kto), the selected loss needs {prompt, chosen, rejected} "
                                    "pairs")
                if unpaired and not holds_unpaired and not pairs_to_unpaired:
                    raise DataError(f"{where}: holds pairs, but loss kto needs {{prompt, completion, label}} rows; set "
                                    "pairs_to_unpaired=true to use each pair as a desirable (chosen) and an "
                                    "undesirable (rejected) completion")
            except DataError as e:
                problems += [] if str(e) in problems else [str(e)]
    if problems:
        raise DataError("\n".join(problems))


# --- Tokenization: the normalized form -> token ids, once per run (cached on disk below) --------------------

@dataclass(frozen=True)
class LoadOptions:
    """What the tokenized examples depend on besides the source and the tokenizer (all of it in the cache key)."""
    max_length: int = 512  # prompt + response tokens of one sequence
    max_prompt_length: int = 256  # a prompt is cut to this only when prompt + longest response exceed max_length
    sft_mode: bool = False  # one example per SFT target instead of per pair
    truncation_mode: Optional[str] = None  # keep_start | keep_end; None: each source's default (departure 10)
    unpaired: bool = False  # one example per labelled completion (KTO)
    pairs_to_unpaired: bool = False  # with unpaired: a pair gives a desirable (chosen) and an undesirable completion

    def __post_init__(self):
        if self.truncation_mode not in (None, *TRUNCATION_MODES):
            raise ValueError(f"truncation_mode={self.truncation_mode!r}: expected null or one of {TRUNCATION_MODES}")
        if not 0 < self.max_prompt_length < self.max_length:
            raise ValueError(f"max_prompt_length={self.max_prompt_length}, max_length={self.max_length}: expected "
                             "0 < max_prompt_length < max_length (responses need room after the prompt)")


class TokenizedExample(NamedTuple):
    """One pair (SFT: one target; unpaired: one completion in chosen_*, its label in `desirable`). prompt_ids: BOS
    first when the tokenizer adds one; response ids: the response's only, ending in EOS unless truncated. The texts
    are the untruncated originals, for logging and sampling."""
    source: str
    prompt: str
    chosen: str
    rejected: Optional[str]  # None in SFT and unpaired modes
    prompt_ids: np.ndarray
    chosen_ids: np.ndarray
    rejected_ids: Optional[np.ndarray]
    desirable: Optional[bool] = None


@dataclass
class SourceStats:
    """What loading one source did; dataset_summary() prints every number."""
    source: str
    split: str
    unit: str  # 'pairs', 'sft_targets' or 'completions'
    truncation_mode: str
    origin: str = ""  # the local file (and its shape), or "hub:<fingerprint>"
    prompts: int = 0
    kept: int = 0
    dropped: dict = field(default_factory=dict)
    prompts_truncated: int = 0
    reply_cues_cut: int = 0  # prompts ending in a cue to reply, truncated keep_start: the cue is gone
    responses_truncated: int = 0
    prompt_tokens_mean: float = 0.0
    prompt_tokens_max: int = 0
    response_tokens_mean: float = 0.0
    response_tokens_max: int = 0
    cache: str = "off"
    desirable: int = 0  # unpaired: completions kept per label
    undesirable: int = 0


def tokenizer_adds_bos(tokenizer: Any) -> bool:
    """True when the tokenizer puts BOS first by default (Llama-style post-processor); then we do too."""
    return tokenizer.bos_token_id is not None and tokenizer("a")["input_ids"][:1] == [tokenizer.bos_token_id]


def truncate(prompt_ids: list[int], responses: list[list[int]], *, max_length: int, max_prompt_length: int,
             mode: str, bos_id: Optional[int] = None) -> tuple[list[int], list[list[int]]]:
    """Fit prompt + the longest response into max_length, the prompt first, as the original: if they do not fit,
    the prompt is cut to max_prompt_length keeping its first (keep_start) or last (keep_end) tokens, a leading BOS
    kept either way. Then every response is cut to the room left (departures 4 and 7)."""
    if len(prompt_ids) + max(map(len, responses)) > max_length and len(prompt_ids) > max_prompt_length:
        head = prompt_ids[:1] if mode == "keep_end" and bos_id is not None and prompt_ids[:1] == [bos_id] else []
        prompt_ids = (prompt_ids[:max_prompt_length] if mode == "keep_start"
                      else head + prompt_ids[len(prompt_ids) - (max_prompt_length - len(head)):])
    return prompt_ids, [r[: max_length - len(prompt_ids)] for r in responses]


def _jobs(entries: list[PromptResponses], opts: LoadOptions, drops: Counter) -> Iterator[tuple]:
    """(entry, chosen or the completion, rejected or None, label or None) per example to tokenize."""
    for entry in entries:
        if opts.sft_mode:
            yield from ((entry, target, None, None) for target in entry.sft_targets)
            continue
        if opts.unpaired:
            yield from ((entry, entry.responses[i], None, label) for i, label in entry.rated)
            if not opts.pairs_to_unpaired:
                continue
        for chosen, rejected in ((entry.responses[i], entry.responses[j]) for i, j in entry.pairs):
            if chosen == rejected:
                drops["chosen_equals_rejected"] += 1
            elif opts.unpaired:  # pairs_to_unpaired: the pair's two completions, labelled by the preference
                yield from ((entry, chosen, None, True), (entry, rejected, None, False))
            else:
                yield entry, chosen, rejected, None


def tokenize_normalized(data: dict[str, PromptResponses], tokenizer: Any, *, source: str, split: str,
                        truncation_mode: str, dropped: Optional[Counter] = None, **options
                        ) -> tuple[list[TokenizedExample], SourceStats]:
    """The normalized form -> tokenized, truncated examples and their stats (`options`: LoadOptions' fields).

    Per example: prompt ids = [BOS] + ids(prompt), response ids = ids(response) + [EOS], then truncate(). Dropped by
    reason: chosen_equals_rejected (same text), empty_response (nothing but EOS to learn, and length-normalised losses
    would divide by zero), identical_after_truncation (the same tokens once cut: no preference left).
    """
    opts, drops = LoadOptions(**options, truncation_mode=truncation_mode), Counter(dropped)
    bos, eos, add_bos = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer_adds_bos(tokenizer)
    entries, examples = list(data.values()), []
    stats = SourceStats(source, split, "sft_targets" if opts.sft_mode else "completions" if opts.unpaired else "pairs",
                        truncation_mode)
    for start in range(0, len(entries), ENCODE_CHUNK):
        jobs, ids = list(_jobs(entries[start:start + ENCODE_CHUNK], opts, drops)), {}
        for chat in (False, True):  # special-token text is parsed as such only in chat-template output (departure 5)
            if texts := [*dict.fromkeys(t for e, *rest, _ in jobs if e.chat == chat for t in (e.prompt, *rest) if t)]:
                encoded = tokenizer(texts, add_special_tokens=False, split_special_tokens=not chat, verbose=False)
                ids.update(((t, chat), row) for t, row in zip(texts, encoded["input_ids"]))
        for entry, chosen, rejected, label in jobs:
            prompt_ids = ids.get((entry.prompt, entry.chat), [])
            prompt_ids = [bos] + prompt_ids if add_bos and prompt_ids[:1] != [bos] else prompt_ids  # once (departure 4)
            bodies = [ids.get((t, entry.chat)) for t in (chosen, rejected) if t is not None]
            if not all(bodies):
                drops["empty_response"] += 1
                continue
            # every response keeps >= 1 token: 0 < max_prompt_length < max_length leaves room after the prompt
            cut, responses = truncate(prompt_ids, [b + [eos] for b in bodies], max_length=opts.max_length,
                                      max_prompt_length=opts.max_prompt_length, mode=truncation_mode, bos_id=bos)
            if len(responses) == 2 and responses[0] == responses[1]:
                drops["identical_after_truncation"] += 1
                continue
            cue = truncation_mode == "keep_start" and (entry.chat or entry.prompt.endswith(HH_MARKER))
            stats.prompts_truncated += len(cut) < len(prompt_ids)
            stats.reply_cues_cut += len(cut) < len(prompt_ids) and cue
            stats.responses_truncated += sum(len(r) <= len(b) for r, b in zip(responses, bodies))  # lost its EOS
            stats.desirable, stats.undesirable = stats.desirable + (label is True), stats.undesirable + (label is False)
            arrays = [np.asarray(x, dtype=np.int32) for x in (cut, *responses)] + [None]  # int32: half int64's memory
            examples.append(TokenizedExample(source, entry.prompt, chosen, rejected, *arrays[:3], label))
    prompt_lengths = [len(e.prompt_ids) for e in examples]
    response_lengths = [len(r) for e in examples for r in (e.chosen_ids, e.rejected_ids) if r is not None]
    stats.prompts, stats.kept = len({e.prompt for e in examples}), len(examples)
    stats.dropped = dict(sorted(drops.items()))
    if examples:
        stats.prompt_tokens_mean, stats.prompt_tokens_max = float(np.mean(prompt_lengths)), max(prompt_lengths)
        stats.response_tokens_mean, stats.response_tokens_max = float(np.mean(response_lengths)), max(response_lengths)
    return examples, stats


# --- The cache: one file per (source, split, mode), keyed by everything the tokenized result depends on -----

def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Hash of the tokenizer's serialized state (vocab, merges, normalizer, post-processor, added tokens), special
    tokens and chat template: whatever could change token ids changes this."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    state = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    specials = {k: (str(getattr(tokenizer, k, None)), getattr(tokenizer, k + "_id", None))
                for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
    return _sha256([type(tokenizer).__name__, state, specials, str(getattr(tokenizer, "chat_template", None)),
                    tokenizer_adds_bos(tokenizer)])


def _sha256(value: Any) -> str:
    return hashlib.sha256(value if isinstance(value, bytes) else json.dumps(value, sort_keys=True).encode()).hexdigest()


def _plan(name: str, split: str, tokenizer: Any, tokenizer_fp: str, cache_dir: Optional[str], opts: LoadOptions
          ) -> tuple[str, Callable[[], tuple[list[TokenizedExample], SourceStats]]]:
    """(cache key, build): the key hashes the source's content, the tokenizer, the options and CODE_VERSION; build()
    converts and tokenizes. A local path's first row picks its converter and its default truncation."""
    source, path = resolve_source(name, split)
    convert, mode = source.convert, opts.truncation_mode or source.truncation_mode
    if path is not None:
        rows, origin, content = read_rows(path), str(path), "sha256:" + _sha256(path.read_bytes())
        if source is LOCAL_FILE:
            shape, prompt = detect_shape(rows[0]), rows[0].get("prompt")
            cues = isinstance(prompt, list) or str(prompt).endswith(HH_MARKER)
            convert, origin = SHAPES[shape].convert, f"{path} ({shape})"
            mode = opts.truncation_mode or SHAPES[shape].truncation_mode or ("keep_end" if cues else "keep_start")
    else:
        rows = source.fetch(split, cache_dir)
        content = origin = "hub:" + str(getattr(rows, "_fingerprint", None) or _sha256(list(rows)))
    key = _sha256(dict(asdict(opts), truncation_mode=mode, code_version=CODE_VERSION, source=name, split=split,
                       content=content, tokenizer=tokenizer_fp, max_pairs_per_prompt=MAX_PAIRS_PER_PROMPT))

    def build() -> tuple[list[TokenizedExample], SourceStats]:
        data, dropped = convert(rows, tokenizer)
        examples, stats = tokenize_normalized(data, tokenizer, source=name, split=split, dropped=dropped,
                                              **dict(asdict(opts), truncation_mode=mode))
        stats.origin = origin
        return examples, stats
    return key, build


def load_tokenized(names: list[str], tokenizer: Any, split: str, *, cache_dir: Optional[str] = None,
                   silent: bool = False, **options) -> tuple[list[TokenizedExample], list[SourceStats]]:
    """Every source in `names` tokenized (from the cache in cache_dir when there), concatenated in order, and one
    SourceStats per source; prints dataset_summary() unless silent. `options`: LoadOptions' fields."""
    opts, examples, all_stats = LoadOptions(**options), [], []
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token: responses end in EOS, so set tokenizer.eos_token")
    tokenizer_fp = tokenizer_fingerprint(tokenizer) if cache_dir is not None else ""
    for name in names:
        key, build = _plan(name, split, tokenizer, tokenizer_fp, cache_dir, opts)
        ex, stats = build() if cache_dir is None else _cached(Path(cache_dir), f"{name}-{split}", key, build, opts)
        examples += ex
        all_stats.append(stats)
    if not silent:
        print(dataset_summary(all_stats))
    return examples, all_stats


def _cached(cache_dir: Path, what: str, key: str, build: Callable, opts: LoadOptions) -> tuple[list, SourceStats]:
    """build()'s result from its cache file (the key in its name), built and written first when absent."""
    unit = "sft" if opts.sft_mode else "unpaired" if opts.unpaired else "pairs"
    file = cache_dir / "tokenized" / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', what)[-60:]}-{unit}-{key[:16]}.pkl"
    file.parent.mkdir(parents=True, exist_ok=True)
    # several ranks may start at once: the first builds the file while the others wait, then all read it
    with FileLock(str(file) + ".lock"):
        if file.exists():
            payload = pickle.loads(file.read_bytes())
            stats = SourceStats(**dict(payload["stats"], cache=f"hit {file}"))
            return [TokenizedExample(*row) for row in payload["examples"]], stats
        examples, stats = build()
        stats.cache, tmp = f"written {file}", file.with_suffix(f".tmp{os.getpid()}")
        # plain tuples and dicts: the file must not depend on where this module was imported from
        tmp.write_bytes(pickle.dumps({"examples": [tuple(e) for e in examples], "stats": asdict(stats)}))
        os.replace(tmp, file)  # atomic: a reader never sees half a file
    return examples, stats


def data_fingerprints(names: list[str], tokenizer: Any, split: str, *, cache_dir: Optional[str] = None,
                      **options) -> dict[str, str]:
    """{source: the cache key of its tokenized `split`}, without tokenizing: the run manifest records these, so a
    resume or replay on other data (tokenizer, lengths, truncation, CODE_VERSION) refuses."""
    fp, opts = tokenizer_fingerprint(tokenizer), LoadOptions(**options)
    return {name: _plan(name, split, tokenizer, fp, cache_dir, opts)[0] for name in names}


def count_examples(names: list[str], tokenizer: Any, *, split: str, silent: bool = True, **load_kwargs) -> int:
    """How many examples the iterator draws from (with cache_dir set, later loads hit the cache this fills)."""
    return len(load_tokenized(names, tokenizer, split, silent=silent, **load_kwargs)[0])


def dataset_summary(stats: list[SourceStats]) -> str:
    """One block per source, every number named."""
    lines = []
    for s in stats:
        dropped = ", ".join(f"{k}={v}" for k, v in s.dropped.items()) or "none"
        lines += [f"[data] {s.source}/{s.split} ({s.origin})",
                  f"       {s.unit}_kept={s.kept} prompts={s.prompts} dropped: {dropped}"]
        lines += [f"       desirable={s.desirable} undesirable={s.undesirable}"] if s.unit == "completions" else []
        lines += [f"       prompts_truncated={s.prompts_truncated} responses_truncated={s.responses_truncated} "
                  f"truncation_mode={s.truncation_mode}",
                  f"       prompt_tokens_mean={s.prompt_tokens_mean:.1f} prompt_tokens_max={s.prompt_tokens_max} "
                  f"response_tokens_mean={s.response_tokens_mean:.1f} response_tokens_max={s.response_tokens_max}",
                  f"       cache: {s.cache}"]
        lines += [f"       warning: reply_cues_cut={s.reply_cues_cut}: prompts truncated keep_start lost their final "
                  "cue to reply ('\\n\\nAssistant:' or the chat generation prompt); truncation_mode=keep_end keeps it"
                  ] if s.reply_cues_cut else []
    return "\n".join(lines)


# --- Batches: the order (a pure function of seed, epoch and step), each rank's share, the collate -----------

def num_steps(n_items: int, *, batch_size: int, n_epochs: Optional[int] = None, n_examples: Optional[int] = None
              ) -> int:
    """Global steps: min(n_epochs * (n_items // batch_size), ceil(n_examples / batch_size)) of the bounds set."""
    if n_epochs is None and n_examples is None:
        raise ValueError("set n_epochs or n_examples: the iterator needs to know when to stop")
    if n_items < batch_size:
        raise DataError(f"{n_items} examples, fewer than one global batch of {batch_size}: lower batch_size or add "
                        "data")
    bounds = [n_epochs * (n_items // batch_size)] if n_epochs is not None else []
    return min(bounds + ([-(-n_examples // batch_size)] if n_examples is not None else []))


def iter_batch_indices(n_items: int, *, batch_size: int, shuffle: bool = True, seed: int = 0,
                       n_epochs: Optional[int] = None, n_examples: Optional[int] = None, rank: int = 0,
                       world_size: int = 1, start_example: int = 0, sizes: Optional[list[int]] = None
                       ) -> Iterator[list[int]]:
    """Indices of this rank's items for each global batch, in order; bad arguments raise at the call.

    Step s covers perm_e[j*B:(j+1)*B], e = s // S, j = s % S, B = batch_size, S = n_items // B (each epoch drops its
    incomplete last batch), perm_e a permutation seeded by (seed, e) (the identity without shuffle). Rank r takes
    positions [r*k, (r+1)*k), k = B // world_size, or with `sizes` (tokens per item) its share of balance_shares. The
    run lasts n_epochs * S or ceil(n_examples / B) steps, the fewer, from step start_example // B: a resumed
    iterator yields exactly what an uninterrupted one would.
    """
    if batch_size <= 0 or batch_size % world_size:
        raise ValueError(f"batch_size={batch_size} (global pairs per step) must be a positive multiple of "
                         f"world_size={world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank}: expected 0 <= rank < world_size={world_size}")
    if start_example < 0 or start_example % batch_size:
        raise ValueError(f"start_example={start_example}: expected a multiple of batch_size={batch_size}")
    total = num_steps(n_items, batch_size=batch_size, n_epochs=n_epochs, n_examples=n_examples)
    per_epoch, k = n_items // batch_size, batch_size // world_size

    def batches():
        epoch = order = None
        for step in range(start_example // batch_size, total):
            if step // per_epoch != epoch:  # the order is a function of (seed, epoch): resuming needs no saved state
                epoch = step // per_epoch
                order = np.random.default_rng((seed, epoch)).permutation(n_items) if shuffle else np.arange(n_items)
            items = order[(step % per_epoch) * batch_size:][:batch_size].tolist()
            yield (balance_shares(items, [sizes[i] for i in items], world_size)[rank] if sizes is not None
                   else items[rank * k:(rank + 1) * k])
    return batches()


def example_tokens(e: TokenizedExample) -> int:
    """Tokens of the rows an example becomes: prompt + response, once per side."""
    return sum(len(e.prompt_ids) + len(r) for r in (e.chosen_ids, e.rejected_ids) if r is not None)


def balance_shares(items: list[int], sizes: list[int], n_shares: int) -> list[list[int]]:
    """Deal `items` (`sizes` tokens each) into n_shares shares of equal count and near-equal total size.

    Under FSDP every rank waits for the slowest at each collective, so a step costs what its heaviest share costs.
    Largest first, each item goes to the lightest share that still has room (ties: the lower share); each share then
    keeps the batch's order. Consecutive slices are kept where this deal is no lighter, so balancing never makes a
    step heavier. Equal counts keep every rank's micro-batches and per-pair weights as without balancing.
    """
    if len(items) % n_shares:
        raise ValueError(f"{len(items)} items cannot be dealt into {n_shares} shares of equal count")
    shares, loads, room = [[] for _ in range(n_shares)], [0] * n_shares, len(items) // n_shares
    for pos in sorted(range(len(items)), key=lambda p: -sizes[p]):  # sorted() is stable: ties keep batch order
        target = min((s for s in range(n_shares) if len(shares[s]) < room), key=loads.__getitem__)
        shares[target].append(pos)
        loads[target] += sizes[pos]
    consecutive, dealt = [list(range(s * room, (s + 1) * room)) for s in range(n_shares)], [sorted(s) for s in shares]
    best = min(consecutive, dealt, key=lambda deal: max(sum(sizes[p] for p in share) for share in deal))
    return [[items[p] for p in share] for share in best]


def _pad(rows: list[np.ndarray], value: int, side: str = "right") -> torch.Tensor:
    return pad_sequence([torch.as_tensor(r, dtype=torch.long) for r in rows], True, value, padding_side=side)


def _rows(prompts: list[np.ndarray], responses: list[np.ndarray], pad_token_id: int, prefix: str) -> dict:
    """{prefix}input_ids, attention_mask and labels (-100 on prompt and padding) of prompt + response rows."""
    sequences = [np.concatenate([p, r]) for p, r in zip(prompts, responses)]
    labels = [np.concatenate([np.full(len(p), -100), r]) for p, r in zip(prompts, responses)]
    return {prefix + "input_ids": _pad(sequences, pad_token_id), prefix + "labels": _pad(labels, -100),
            prefix + "attention_mask": _pad([np.ones_like(s) for s in sequences], 0)}


def collate(examples: list[TokenizedExample], pad_token_id: int, kl_rows: bool = False) -> dict[str, Any]:
    """Examples -> a batch dict with the original code's keys.

    Texts: prompt, chosen and rejected (prompt + response), {chosen,rejected}_response_only. Long tensors:
    prompt_input_ids and prompt_attention_mask (B, P), left-padded so generation continues from the last column;
    {chosen,rejected}_{input_ids,attention_mask,labels} (B, T), right-padded, labels = the ids on the response (EOS
    included) and -100 on prompt and padding. SFT examples give no rejected keys; unpaired ones add `desirable` (B,).
    kl_rows: also kl_{input_ids,attention_mask,labels}, the MISMATCHED rows KTO estimates its KL reference point on
    (as the paper, HALOs and TRL): the completions in the order the trainer scores them (chosen, then rejected),
    completion k-1 after the prompt of completion k, each cut to the batch's longest real sequence.
    """
    prompts = [e.prompt_ids for e in examples]
    batch = {"prompt": [e.prompt for e in examples], "prompt_input_ids": _pad(prompts, pad_token_id, "left"),
             "prompt_attention_mask": _pad([np.ones_like(p) for p in prompts], 0, "left")}
    sides = ("chosen",) if examples[0].rejected is None else ("chosen", "rejected")
    for side in sides:
        texts = [getattr(e, side) for e in examples]
        batch[side], batch[side + "_response_only"] = [e.prompt + t for e, t in zip(examples, texts)], texts
        batch.update(_rows(prompts, [getattr(e, side + "_ids") for e in examples], pad_token_id, side + "_"))
    if examples[0].desirable is not None:
        batch["desirable"] = torch.tensor([bool(e.desirable) for e in examples])
    if kl_rows:
        if len(examples) < 2:
            raise ValueError("kl_rows needs >= 2 examples per batch: each completion goes after another's prompt")
        completions = [(e.prompt_ids, getattr(e, side + "_ids")) for side in sides for e in examples]
        cap = max(len(p) + len(r) for p, r in completions)  # never longer than a real sequence of the batch
        shifted = [completions[k - 1][1][:cap - len(p)] for k, (p, _) in enumerate(completions)]
        batch.update(_rows([p for p, _ in completions], shifted, pad_token_id, "kl_"))
    return batch


def get_batch_iterator(names: list[str], tokenizer: Any, *, split: str, batch_size: int, shuffle: bool = True,
                       n_epochs: Optional[int] = None, n_examples: Optional[int] = None, seed: int = 0, rank: int = 0,
                       world_size: int = 1, start_example: int = 0, balance: bool = False, kl_rows: bool = False,
                       silent: bool = False, **load_kwargs) -> Iterator[dict[str, Any]]:
    """This rank's share of each global batch, collated, with `example_index` (positions in the tokenized split).

    batch_size is GLOBAL pairs per step; each rank gets exactly batch_size // world_size of them: consecutive slices,
    or with `balance` equal-count shares of near-equal tokens (balance_shares). The order: iter_batch_indices. For
    eval, shuffle=False, n_epochs=1, n_examples=n gives the first n examples. `load_kwargs`: load_tokenized's
    (cache_dir, LoadOptions' fields). Loading, and every error about the data or the arguments, happens at the
    call, not at the first next(). Padding uses pad_token_id, else EOS (padding is masked anyway).
    """
    if n_epochs is None and n_examples is None:  # before the (possibly long) loading
        raise ValueError("set n_epochs or n_examples: the iterator needs to know when to stop")
    examples, _ = load_tokenized(names, tokenizer, split, silent=silent, **load_kwargs)
    if len(examples) < batch_size:
        raise DataError(f"datasets={names} split {split!r}: {len(examples)} examples after filtering, fewer than "
                        f"one global batch of {batch_size}; lower batch_size or add data")
    indices = iter_batch_indices(len(examples), batch_size=batch_size, shuffle=shuffle, seed=seed, n_epochs=n_epochs,
                                 n_examples=n_examples, rank=rank, world_size=world_size, start_example=start_example,
                                 sizes=[example_tokens(e) for e in examples] if balance else None)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return (dict(collate([examples[i] for i in idx], pad, kl_rows), example_index=torch.as_tensor(idx))
            for idx in indices)


def get_eval_batches(names: list[str], tokenizer: Any, *, batch_size: int, n_examples: int, rank: int = 0,
                     world_size: int = 1, kl_rows: bool = False, silent: bool = False, **load_kwargs) -> list[dict]:
    """This rank's shares of the evaluation batches: the first n_examples pairs of the test split (all of them if
    there are fewer), exactly once each, in global batches of batch_size. The last batch is completed with
    repeats of its first pair marked `valid` False (B,), so that every rank runs the same forwards (a collective
    under FSDP) and the evaluation averages exactly the pairs it names, whatever their count."""
    examples, _ = load_tokenized(names, tokenizer, "test", silent=silent, **load_kwargs)
    n, per_rank = min(n_examples, len(examples)), batch_size // world_size
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    batches = []
    for start in range(0, n, batch_size):
        real = list(range(start, min(start + batch_size, n)))
        idx = (real + [real[0]] * batch_size)[:batch_size][rank * per_rank:(rank + 1) * per_rank]
        valid = [start + rank * per_rank + i < n for i in range(per_rank)]
        batches.append(dict(collate([examples[i] for i in idx], pad, kl_rows),
                            example_index=torch.as_tensor(idx, dtype=torch.long), valid=torch.tensor(valid)))
    return batches


SAMPLE_GROUP = 8  # prompts per generate call during evaluation (see get_sample_batches)


def get_sample_batches(names: list[str], tokenizer: Any, *, n_examples: int, rank: int = 0, world_size: int = 1,
                       silent: bool = False, **load_kwargs) -> list[tuple[int, dict]]:
    """(group, batch) of the prompts this rank samples at each evaluation: the first n_examples test prompts in
    groups of SAMPLE_GROUP, the groups dealt round-robin to the ranks. A group is generated in one call with a seed
    of its own, so its samples are the same whatever the world size. Every rank gets as many groups (a collective
    under FSDP); the repeats that complete the count have group -1."""
    examples, _ = load_tokenized(names, tokenizer, "test", silent=silent, **load_kwargs)
    n = min(n_examples, len(examples))
    groups = [list(range(start, min(start + SAMPLE_GROUP, n))) for start in range(0, n, SAMPLE_GROUP)]
    mine = list(range(len(groups)))[rank::world_size]
    mine += [-1] * (-(-len(groups) // world_size) - len(mine))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return [(g, collate([examples[i] for i in groups[g if g >= 0 else 0]], pad)) for g in mine if groups]

