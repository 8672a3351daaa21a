"""Preference data: raw sources -> normalized examples -> tokenized pairs -> batches.

The path one raw row takes, top to bottom of this file:

    raw row (a hub dataset row, or a line of a local .jsonl/.json file)
      -> a converter (one small pure function per source, registered in SOURCES)
      -> the normalized form: {prompt: PromptResponses(responses, pairs, sft_targets, rated)}
      -> tokenize_normalized(): prompt ids, response ids + EOS, truncation, drops counted by reason
      -> a cache file on disk (key: source + content + tokenizer + lengths + truncation + CODE_VERSION)
      -> get_batch_iterator(): seeded pair-level shuffle, global batches, this rank's share, collate().

Sources (`datasets=[...]` in the config):
    hh             Anthropic/hh-rlhf                      prompts truncated keep_end (keeps the latest turns)
    shp            stanfordnlp/SHP                        score ratio >= 2, SFT target = best-scored response
    se             HuggingFaceH4/stack-exchange-preferences  HTML stripped, no ties, 1% held out as 'test'
    ultrafeedback  HuggingFaceH4/ultrafeedback_binarized  chat messages rendered with the tokenizer's template, keep_end
    toy            toy/data/{split}.jsonl next to this file (a local file, below)
    path/to/file.jsonl | .json  a local file; '{split}' in the path is replaced by the split name, otherwise
                   the same file serves every split (then eval measures fit to the training data).

A local file holds one row per JSON line (.jsonl) or a JSON list of rows (.json). A row has the fields prompt,
chosen, rejected and optionally sft_target (what SFT trains on; default: chosen). It is either plain text
(see examples/pairs.jsonl)

    {"prompt": "\\n\\nHuman: Name a prime.\\n\\nAssistant:", "chosen": " 7", "rejected": " 8"}

where each response is appended to the prompt verbatim (so it carries its own leading space), or chat form,
rendered with the tokenizer's chat template:

    {"prompt":   [{"role": "user", "content": "Name a prime."}],
     "chosen":   [{"role": "assistant", "content": "7"}],
     "rejected": [{"role": "assistant", "content": "8"}]}

(chosen/rejected may also repeat the prompt's messages before the reply, as UltraFeedback does). Extra fields
are ignored; blank lines are skipped. A local export of a hub source in its raw shape also loads, with that
source's converter (same splitting, dropping and counting): Anthropic HH rows {chosen, rejected} of whole
"\\n\\nHuman: ...\\n\\nAssistant: ..." transcripts, SHP rows {history, human_ref_A, human_ref_B, labels, score_A,
score_B}, UltraFeedback rows whose chosen/rejected are whole conversations (LOCAL_SHAPES; the first row decides,
every row must match). Default truncation of a local file's prompts: keep_end when they end by cueing the reply
("\\n\\nAssistant:" or chat form), since keep_start would cut the cue off; keep_start otherwise, and for SHP (as
the hub source). Wherever keep_start does cut a cue, the summary says so (reply_cues_cut). Anything else raises DataError naming the file, line, field and what
was expected: malformed rows are never skipped. validate_sources() runs these checks without a tokenizer.

Departures from the original DPO code, numbered:
  1. Tokenized once per run and cached on disk (the original tokenized on every rank, every step).
  2. The shuffle is over pairs, a fresh permutation per epoch from (seed, epoch) (the original shuffled
     prompts and ignored `seed` for the data order); iteration is resumable from `start_example`.
  3. Prompt and response are tokenized separately and concatenated, so the prompt tokens are a prefix of the
     prompt+response tokens by construction. Where tokenizing the joined text would have merged tokens across
     the boundary, we count it (`boundary_merges`) and keep our split: it is deliberate, not an error.
  4. BOS exactly once at the start of the prompt when the tokenizer adds one (Llama-style), never in a
     response (the original never added BOS). EOS is appended to every response.
  5. A truncated response has no EOS: it did not end, and teaching the model to stop mid-thought is wrong.
     (The original also lost EOS on truncation, as a side effect rather than a decision.)
  6. Plain text is tokenized with special-token text NOT parsed as special tokens, so a response containing
     "<|endoftext|>" is ordinary text and the appended EOS is the only EOS id in it (the original asserted and
     crashed). Text rendered by a chat template is the exception: its markup ("<|im_start|>", BOS) must be
     parsed as special tokens, so it is.
  7. Pairs with an empty response or with chosen == rejected (as text, or as tokens after truncation) are
     dropped and counted by reason; the summary prints the counts.
  8. Responses are truncated to the room left after the prompt (max_length - len(prompt)), not to
     max_length - max_prompt_length, so a pair uses its whole budget.
  9. SHP and SE keep at most MAX_PAIRS_PER_PROMPT pairs per prompt (the SHP authors' advice: comparisons grow
     as O(n^2) in the answers to one post); SE drops ties (the original ordered a tie arbitrarily).
 10. hh: the prompt ends at the last "\\n\\nAssistant:" that both chosen and rejected share, so a response that
     itself contains "\\n\\nAssistant:" is split correctly; rows whose histories differ are dropped and counted.
 11. Each epoch drops its incomplete final global batch (every step sees exactly batch_size pairs); with
     n_examples the iterator runs ceil(n_examples / batch_size) steps, as the original.
"""
from __future__ import annotations

import contextlib
import difflib
import gc
import hashlib
import json
import os
import pickle
import re
from collections import Counter
import dataclasses
from dataclasses import asdict, dataclass, field
from functools import partial
from html.parser import HTMLParser
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Optional, Sequence

import numpy as np
import torch
from filelock import FileLock

CODE_VERSION = 2  # bump when tokenization or conversion changes, so old cache files are not reused
MAX_PAIRS_PER_PROMPT = 5  # SHP and SE: cap on preference pairs per prompt (departure 9)
TRUNCATION_MODES = ("keep_start", "keep_end")
CHAT_ROLES = ("system", "user", "assistant", "tool")
ROLE_HINTS = {"human": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant", "ai": "assistant"}
PAIR_FIELDS = ("prompt", "chosen", "rejected")
LOCAL_SUFFIXES = (".jsonl", ".json")
HERE = Path(__file__).resolve().parent  # the toy source's files are found relative to this file
ENCODE_CHUNK = 512  # prompts tokenized per call: bounds memory (token lists are big) while batching calls


class DataError(ValueError):
    """Bad data, or a source that cannot be read. The message names the file, line, field and what was expected."""


# ----------------------------------------------------------------------------------------------------------
# The normalized form: every source converts to {prompt: PromptResponses}.
# ----------------------------------------------------------------------------------------------------------

@dataclass
class PromptResponses:
    """Everything known about one prompt.

    responses: distinct response texts, each appended to the prompt verbatim (they carry their own leading space).
    pairs: (i, j) means responses[i] is preferred over responses[j].
    sft_targets: the responses SFT trains on for this prompt. Hub sources give one per prompt, as the original;
        local files give one per row (its `sft_target` field, else its chosen response).
    rated: (i, label): responses[i] was rated desirable (True) or undesirable (False), unpaired data for KTO;
        one entry per rated row, so a completion rated twice counts twice.
    chat: the texts were rendered with a chat template, so special-token text in them is markup (departure 6).
    """
    prompt: str
    responses: list[str] = field(default_factory=list)
    pairs: list[tuple[int, int]] = field(default_factory=list)
    sft_targets: list[str] = field(default_factory=list)
    rated: list[tuple[int, bool]] = field(default_factory=list)
    chat: bool = False

    def index(self, response: str) -> int:
        """Index of `response`, added if new (responses are kept distinct so pairs can share them)."""
        if response in self.responses:
            return self.responses.index(response)
        self.responses.append(response)
        return len(self.responses) - 1

    def add_pair(self, chosen: str, rejected: str) -> None:
        self.pairs.append((self.index(chosen), self.index(rejected)))

    def add_rated(self, completion: str, desirable: bool) -> None:
        self.rated.append((self.index(completion), desirable))


Normalized = dict[str, PromptResponses]
Converted = tuple[Normalized, Counter]  # (normalized data, rows/pairs dropped by reason)


def _entry(data: Normalized, prompt: str, chat: bool = False) -> PromptResponses:
    if prompt not in data:
        data[prompt] = PromptResponses(prompt, chat=chat)
    return data[prompt]


# ----------------------------------------------------------------------------------------------------------
# Converters: raw rows -> normalized form. Pure functions of the rows (and, for chat data, the tokenizer's
# chat template), so tests feed them rows written by hand.
# ----------------------------------------------------------------------------------------------------------

HH_MARKER = "\n\nAssistant:"


def split_hh(chosen: str, rejected: str) -> Optional[tuple[str, str, str]]:
    """Split an hh transcript pair into (prompt, chosen_response, rejected_response), or None if impossible.

    The prompt is the text up to and including the last "\\n\\nAssistant:" — so the multi-turn history stays in
    the prompt — taken from the part both transcripts share (departure 10).
    """
    prompt = chosen[: chosen.rfind(HH_MARKER) + len(HH_MARKER)] if HH_MARKER in chosen else None
    if prompt is None or not rejected.startswith(prompt):
        # the chosen response itself contains the marker, or the two histories differ: use the shared part
        shared = len(os.path.commonprefix([chosen, rejected]))
        cut = chosen.rfind(HH_MARKER, 0, shared)
        if cut == -1:
            return None
        prompt = chosen[: cut + len(HH_MARKER)]
    chosen_response, rejected_response = chosen[len(prompt):], rejected[len(prompt):]
    if "\n\nHuman:" in chosen_response or "\n\nHuman:" in rejected_response:
        return None  # the histories differ: a "response" would hold several turns
    return prompt, chosen_response, rejected_response


def convert_hh(rows: Iterable[dict], tokenizer: Any = None) -> Converted:
    """Anthropic/hh-rlhf rows {chosen, rejected} (full transcripts). SFT target: the chosen response (the last
    one seen for a prompt, as the original)."""
    data, dropped = {}, Counter()
    for row in rows:
        split = split_hh(row["chosen"], row["rejected"])
        if split is None:
            dropped["hh_prompt_mismatch"] += 1
            continue
        prompt, chosen, rejected = split
        entry = _entry(data, prompt)
        entry.add_pair(chosen, rejected)
        entry.sft_targets = [chosen]
    return data, dropped


def convert_shp(rows: Iterable[dict], tokenizer: Any = None) -> Converted:
    """stanfordnlp/SHP rows {history, human_ref_A, human_ref_B, labels, score_A, score_B}.

    labels == 1 means A is preferred. Pairs whose score ratio is below 2 are dropped (weak preferences, as the
    original); at most MAX_PAIRS_PER_PROMPT pairs per post. SFT target: the best-scored kept response.
    """
    data, dropped, best = {}, Counter(), {}
    for row in rows:
        score_a, score_b = row["score_A"], row["score_B"]
        # ratio >= 2 written without division: a score of 0 must not divide (0 vs 0 is no preference at all)
        if max(score_a, score_b) < 2 * min(score_a, score_b) or max(score_a, score_b) <= 0:
            dropped["shp_score_ratio_below_2"] += 1
            continue
        prompt = "\n\nHuman: " + row["history"] + "\n\nAssistant:"
        response_a, response_b = " " + row["human_ref_A"], " " + row["human_ref_B"]
        entry = _entry(data, prompt)
        if len(entry.pairs) >= MAX_PAIRS_PER_PROMPT:
            dropped["over_pair_cap"] += 1
            continue
        entry.add_pair(*((response_a, response_b) if row["labels"] == 1 else (response_b, response_a)))
        for response, score in ((response_a, score_a), (response_b, score_b)):
            if prompt not in best or score > best[prompt][0]:
                best[prompt] = (score, response)
                entry.sft_targets = [response]
    return data, dropped


class _HTMLText(HTMLParser):
    """Collects the text of an HTML fragment; block elements become paragraph breaks, <pre> stays verbatim."""
    BLOCKS = {"p", "div", "pre", "blockquote", "ul", "ol", "li", "table", "tr", "hr",
              "h1", "h2", "h3", "h4", "h5", "h6"}

    def __init__(self):
        super().__init__(convert_charrefs=True)  # &amp; -> &
        self.parts: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.parts.append("\n" if tag == "br" else "\n\n" if tag in self.BLOCKS else "")

    def handle_endtag(self, tag):
        self.parts.append("\n\n" if tag in self.BLOCKS else "")

    def handle_data(self, data):
        self.parts.append(data)


def strip_html(text: str) -> str:
    """HTML -> plain text: tags removed, entities decoded, paragraphs separated by one blank line."""
    parser = _HTMLText()
    parser.feed(text)
    parser.close()
    return re.sub(r"\n\s*\n\s*\n+", "\n\n", "".join(parser.parts)).strip()


def convert_se(rows: Iterable[dict], tokenizer: Any = None) -> Converted:
    """HuggingFaceH4/stack-exchange-preferences rows {question, answers: [{text, pm_score}]}.

    Every pair of answers with different scores, better first, in answer order, at most MAX_PAIRS_PER_PROMPT per
    question; ties are dropped (no preference). SFT target: the best-scored answer.
    """
    data, dropped = {}, Counter()
    for row in rows:
        prompt = "\n\nHuman: " + strip_html(row["question"]) + "\n\nAssistant:"
        texts = [" " + strip_html(a["text"]) for a in row["answers"]]
        scores = [a["pm_score"] for a in row["answers"]]
        entry = _entry(data, prompt)
        for i in range(len(texts)):
            for j in range(i + 1, len(texts)):
                if scores[i] == scores[j]:
                    dropped["se_tie"] += 1
                elif len(entry.pairs) >= MAX_PAIRS_PER_PROMPT:
                    dropped["over_pair_cap"] += 1
                else:
                    entry.add_pair(*((texts[i], texts[j]) if scores[i] > scores[j] else (texts[j], texts[i])))
        if texts:
            entry.sft_targets = [texts[max(range(len(texts)), key=scores.__getitem__)]]
    return data, dropped


def render_chat(tokenizer: Any, history: list[dict], reply: dict) -> tuple[str, str]:
    """Render (history, assistant reply) with the tokenizer's chat template -> (prompt text, response text).

    The prompt is the history with the generation prompt ("<|assistant|>\\n"...); the response is what the full
    conversation adds after it. A trailing EOS text is removed from the response because EOS is appended as an
    id later (departure 4), so it is not doubled.
    """
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise DataError(f"chat-form rows need a tokenizer with a chat template; tokenizer {name!r} has none "
                        "(set model.chat_template=chatml or a path to a Jinja template file, or write the rows as plain strings)")
    prompt = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(history + [reply], tokenize=False)
    if not full.startswith(prompt):
        raise DataError("the chat template does not render the prompt as a prefix of prompt+reply, so the "
                        f"reply cannot be separated (prompt renders as {prompt[-80:]!r}, "
                        f"conversation as {full[len(prompt) - 80:len(prompt) + 40]!r})")
    response, eos = full[len(prompt):], tokenizer.eos_token
    if eos and response.rstrip().endswith(eos):
        response = response.rstrip()[: -len(eos)]
    return prompt, response


def reply_messages(prompt: list[dict], messages: list[dict]) -> list[dict]:
    """The reply part of a chosen/rejected message list, which may repeat the prompt's messages first."""
    return messages[len(prompt):] if messages[: len(prompt)] == prompt else messages


def convert_pairs(rows: Iterable[dict], tokenizer: Any = None) -> Converted:
    """Local-file rows {prompt, chosen, rejected[, sft_target]}: all strings, or all lists of {role, content}
    messages (chat form, rendered with the tokenizer's template). Rows are checked by check_row() when the file is
    read. Each row adds one SFT target: its sft_target if given, else its chosen response."""
    data = {}
    for row in rows:
        replies = [row["chosen"], row["rejected"], row.get("sft_target", row["chosen"])]
        if isinstance(row["prompt"], str):
            prompt, chat = row["prompt"], False
        else:
            history, chat = row["prompt"], True
            rendered = [render_chat(tokenizer, history, reply_messages(history, r)[0]) for r in replies]
            prompt, replies = rendered[0][0], [response for _, response in rendered]
        entry = _entry(data, prompt, chat)
        entry.add_pair(replies[0], replies[1])
        entry.sft_targets.append(replies[2])
    return data, Counter()


def convert_unpaired(rows: Iterable[dict], tokenizer: Any = None) -> Converted:
    """Unpaired rows {prompt, completion, label} (KTO data; trl-lib/kto-mix-14k's shape): label true = the completion
    is desirable. Plain strings, or chat form: prompt a list of messages, completion one assistant message (alone or
    after the prompt's messages), rendered with the tokenizer's chat template."""
    data = {}
    for row in rows:
        if isinstance(row["prompt"], str):
            prompt, completion, chat = row["prompt"], row["completion"], False
        else:
            history, chat = row["prompt"], True
            prompt, completion = render_chat(tokenizer, history, reply_messages(history, row["completion"])[0])
        _entry(data, prompt, chat).add_rated(completion, bool(row["label"]))
    return data, Counter()


def convert_ultrafeedback(rows: Iterable[dict], tokenizer: Any = None) -> Converted:
    """HuggingFaceH4/ultrafeedback_binarized rows {chosen, rejected}: full conversations, the last message the
    assistant's reply. Rendered with the tokenizer's chat template."""
    pairs, dropped = [], Counter()
    for row in rows:
        history = row["chosen"][:-1]
        if row["rejected"][:-1] != history or row["chosen"][-1]["role"] != "assistant":
            dropped["ultrafeedback_prompt_mismatch"] += 1
            continue
        pairs.append({"prompt": history, "chosen": row["chosen"][-1:], "rejected": row["rejected"][-1:]})
    data, _ = convert_pairs(pairs, tokenizer)
    return data, dropped


# ----------------------------------------------------------------------------------------------------------
# Fetching: hub datasets through datasets.load_dataset; local files through read_rows(). Kept apart from the
# converters so those can be tested without either.
# ----------------------------------------------------------------------------------------------------------

def _offline() -> bool:
    return any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on")
               for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def fetch_hub(hub_id: str, split: str, cache_dir: Optional[str], splits: Optional[dict] = None):
    """datasets.load_dataset(hub_id, split=...) with our error message when it cannot be had (e.g. offline)."""
    import datasets  # imported here: only hub sources need it, and it takes a second or two to import
    hub_split = (splits or {}).get(split, split)
    try:
        return datasets.load_dataset(hub_id, split=hub_split, cache_dir=cache_dir)
    except Exception as e:  # the library raises ConnectionError, FileNotFoundError, ValueError, ... by case
        where = cache_dir or "the default Hugging Face cache"
        why = (f"is not available offline (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is set) and is not in {where}"
               if _offline() else f"could not be loaded from the Hugging Face Hub into {where}")
        raise DataError(
            f"dataset {hub_id!r} (split {hub_split!r}) {why}. To use a local copy, either\n"
            f"  - export it to JSON lines with rows {{prompt, chosen, rejected}} (see examples/pairs.jsonl) and "
            f"pass datasets=[path/to/file.jsonl], or\n"
            f"  - pre-populate the cache: with network access run "
            f"datasets.load_dataset({hub_id!r}, split={hub_split!r}, cache_dir={cache_dir!r}) and copy that "
            f"cache directory here.\n"
            f"({type(e).__name__}: {e})") from e


def fetch_se(split: str, cache_dir: Optional[str]):
    """SE has only a train split: as the original, shuffle with seed 42 and hold out the first 1% as 'test'."""
    if split not in ("train", "test"):
        raise DataError(f"dataset 'se' has splits 'train' and 'test' (1% held out), not {split!r}")
    dataset = fetch_hub("HuggingFaceH4/stack-exchange-preferences", "train", cache_dir).shuffle(seed=42)
    n_test = int(len(dataset) * 0.01)
    return dataset.select(range(n_test) if split == "test" else range(n_test, len(dataset)))


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return {str: "string", list: "list", dict: "object"}.get(type(value), "number")


def _describe(value: Any) -> str:
    """'null', 'boolean true', 'number 42', 'string "Hi"': the JSON type and a short view of the value."""
    if value is None:
        return "null"
    text = repr(value) if isinstance(value, float) else json.dumps(value, ensure_ascii=False)
    return f"{_json_type(value)} {text if len(text) <= 60 else text[:57] + '...'}"


class _DuplicateField(Exception):
    pass


def _object_without_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateField(key)
        seen[key] = value
    return seen


def _check_message(message: Any, where: str) -> None:
    if not isinstance(message, dict):
        raise DataError(f"{where}: expected an object with role and content, got {_describe(message)}")
    for key in ("role", "content"):
        if key not in message:
            raise DataError(f"{where}: missing '{key}' (expected {{\"role\": ..., \"content\": ...}}, "
                            f"found keys {sorted(message)})")
        if not isinstance(message[key], str):
            raise DataError(f"{where}: '{key}': expected a string, got {_describe(message[key])}"
                        f"")
    role = message["role"]
    if role not in CHAT_ROLES:
        guess = ROLE_HINTS.get(role.lower()) or next(iter(difflib.get_close_matches(role, CHAT_ROLES, 1)), None)
        hint = f"; did you mean '{guess}'?" if guess else ""
        raise DataError(f"{where}: unknown role '{role}' (expected one of {', '.join(CHAT_ROLES)}){hint}")


def check_row(row: Any, where: str) -> None:
    """Raise DataError unless `row` is a valid local-file row (module docstring); `where` is 'file, line n'."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object with fields prompt, chosen, rejected, "
                        f"got {_describe(row)}")
    for name in PAIR_FIELDS:
        if name not in row:
            extra = [k for k in row if k not in PAIR_FIELDS]
            typo = difflib.get_close_matches(name, extra, 1)
            hint = f"; '{typo[0]}' looks like a misspelling of '{name}'" if typo else ""
            raise DataError(f"{where}: missing field '{name}' (expected fields prompt, chosen, rejected; "
                            f"found {', '.join(map(repr, row)) or 'none'}){hint}")
    fields = PAIR_FIELDS + (("sft_target",) if "sft_target" in row else ())  # sft_target is optional
    for name in fields:
        if not isinstance(row[name], (str, list)):
            raise DataError(f"{where}: field '{name}': expected a string or a list of {{role, content}} messages, "
                            f"got {_describe(row[name])}")
    kinds = {name: type(row[name]) for name in fields}
    if len(set(kinds.values())) > 1:
        shown = ", ".join(f"{n}={_json_type(row[n])}" for n in fields)
        raise DataError(f"{where}: fields {'/'.join(fields)} mix strings and message lists ({shown}); "
                        "expected all strings or all lists of {role, content} messages")
    if kinds["prompt"] is str:
        return
    for name in fields:
        for k, message in enumerate(row[name]):
            _check_message(message, f"{where}: field '{name}' message {k}")
    if not row["prompt"]:
        raise DataError(f"{where}: field 'prompt': empty list; expected at least one {{role, content}} message")
    for name in fields[1:]:
        reply = reply_messages(row["prompt"], row[name])
        if len(reply) != 1:
            raise DataError(f"{where}: field '{name}': expected one assistant message (alone, or after the "
                            f"prompt's messages), got {len(reply)} messages after the prompt")
        if reply[0]["role"] != "assistant":
            raise DataError(f"{where}: field '{name}': the reply must have role 'assistant', "
                            f"got role '{reply[0]['role']}'")


def check_unpaired_row(row: dict, where: str) -> None:
    """Unpaired (KTO) rows {prompt, completion, label}: strings, or a message list and one assistant reply; label a
    boolean (true = desirable)."""
    _need(row, where, "unpaired", {"prompt": (str, list), "completion": (str, list), "label": (bool,)})
    if isinstance(row["prompt"], str) != isinstance(row["completion"], str):
        raise DataError(f"{where}: fields prompt/completion mix a string and a message list; expected both strings or "
                        "both lists of {role, content} messages")
    if isinstance(row["prompt"], str):
        return
    for name in ("prompt", "completion"):
        for k, message in enumerate(row[name]):
            _check_message(message, f"{where}: field '{name}' message {k}")
    if not row["prompt"]:
        raise DataError(f"{where}: field 'prompt': empty list; expected at least one {{role, content}} message")
    reply = reply_messages(row["prompt"], row["completion"])
    if len(reply) != 1 or reply[0]["role"] != "assistant":
        raise DataError(f"{where}: field 'completion': expected one assistant message (alone, or after the prompt's "
                        f"messages), got {[m['role'] for m in reply]}")


def read_rows(path: Path, data: Optional[bytes] = None) -> list[dict]:
    """Read and check every row of a local .jsonl/.json file. Raises DataError at the first bad row."""
    path = Path(path)
    if path.suffix not in LOCAL_SUFFIXES:
        raise DataError(f"{path}: expected a .jsonl or .json file of {{prompt, chosen, rejected}} rows, "
                        f"got a '{path.suffix}' file")
    if data is None:
        if not path.is_file():
            raise DataError(f"{path}: no such file (expected a .jsonl or .json file of "
                            "{prompt, chosen, rejected} rows)")
        data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")  # -sig: tolerate the byte-order mark some editors write
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise DataError(f"{path}, line {line}: not valid UTF-8 (byte {data[e.start]:#04x} at offset {e.start}); "
                        "expected a UTF-8 text file") from e
    if not text.strip():
        raise DataError(f"{path}: the file is empty (no rows); expected {{prompt, chosen, rejected}} rows")
    loads = partial(json.loads, object_pairs_hook=_object_without_duplicates)

    def parse(chunk: str, where: str, line_offset: int = 0) -> Any:
        try:
            return loads(chunk)
        except json.JSONDecodeError as e:
            at = "" if e.msg.endswith(" at") else " at"  # json's "Unterminated string starting at" has its own
            raise DataError(f"{path}, line {line_offset + e.lineno}: not valid JSON ({e.msg}{at} column {e.colno}); "
                            f"expected {where}") from e
        except _DuplicateField as e:
            raise DataError(f"{path}, line {line_offset + 1}: duplicate field '{e}' in one object") from None

    if path.suffix == ".jsonl":
        located = [(parse(line, "one JSON object per line", n - 1), f"{path}, line {n}")
                   for n, line in enumerate(text.split("\n"), 1) if line.strip()]
    else:
        rows = parse(text, "a JSON list of {prompt, chosen, rejected} objects")
        if not isinstance(rows, list):
            raise DataError(f"{path}: expected a JSON list of {{prompt, chosen, rejected}} objects, "
                            f"got {_json_type(rows)}")
        located = [(row, f"{path}, item {n}") for n, row in enumerate(rows, 1)]
    if not located:
        raise DataError(f"{path}: no rows; expected {{prompt, chosen, rejected}} rows")
    shape = detect_shape(located[0][0])  # the first row decides; every row must then have that shape
    for row, where in located:
        if shape != "pairs" and (not isinstance(row, dict) or detect_shape(row) != shape):
            raise DataError(f"{where}: the file's first row has the {LOCAL_SHAPES[shape].description} shape; "
                            f"this row does not (got {_describe(row) if not isinstance(row, dict) else 'fields ' + ', '.join(map(repr, row))})")
        LOCAL_SHAPES[shape].check(row, where)
    return [row for row, _ in located]


# ----------------------------------------------------------------------------------------------------------
# Local file shapes: besides our {prompt, chosen, rejected} rows, a local export of a hub source in its raw
# shape is recognised by its first row and converted with that source's converter (same dropping, counting).
# ----------------------------------------------------------------------------------------------------------

SHP_FIELDS = ("history", "human_ref_A", "human_ref_B", "labels", "score_A", "score_B")


def _need(row: dict, where: str, shape: str, fields: dict[str, tuple]) -> None:
    """Raise unless each field is present with one of the JSON types given (shape: named in the message)."""
    for name, types_ in fields.items():
        if name not in row:
            raise DataError(f"{where}: missing field '{name}' (expected the {shape} fields {', '.join(fields)}; "
                            f"found {', '.join(map(repr, row))})")
        if not isinstance(row[name], types_) or isinstance(row[name], bool) and bool not in types_:
            expected = " or ".join("number" if t in (int, float) else _json_type(t()) for t in types_)
            raise DataError(f"{where}: field '{name}': expected a {expected}, got {_describe(row[name])}")


def check_hh_row(row: dict, where: str) -> None:
    """Raw Anthropic HH: {chosen, rejected}, each a whole transcript "\\n\\nHuman: ...\\n\\nAssistant: ..."."""
    _need(row, where, "Anthropic HH", {"chosen": (str,), "rejected": (str,)})


def check_shp_row(row: dict, where: str) -> None:
    """Raw stanfordnlp/SHP: {history, human_ref_A, human_ref_B, labels (1 = A preferred), score_A, score_B}."""
    _need(row, where, "SHP", {"history": (str,), "human_ref_A": (str,), "human_ref_B": (str,),
                              "labels": (int,), "score_A": (int, float), "score_B": (int, float)})
    if row["labels"] not in (0, 1):
        raise DataError(f"{where}: field 'labels': expected 0 or 1 (1 = human_ref_A preferred), got {row['labels']}")


def check_ultrafeedback_row(row: dict, where: str) -> None:
    """Raw HuggingFaceH4/ultrafeedback_binarized: {chosen, rejected}, each the whole conversation as {role, content}
    messages ending in the assistant's reply (the string field 'prompt' and the scores are ignored)."""
    _need(row, where, "UltraFeedback", {"chosen": (list,), "rejected": (list,)})
    for name in ("chosen", "rejected"):
        for k, message in enumerate(row[name]):
            _check_message(message, f"{where}: field '{name}' message {k}")
        if row[name][-1]["role"] != "assistant":
            raise DataError(f"{where}: field '{name}': the last message must be the assistant's reply, "
                            f"got role '{row[name][-1]['role']}'")


def detect_shape(row: Any) -> str:
    """Which shape a local row has: 'pairs' (ours, the default: its checker names what is missing), 'hh' (no
    prompt; chosen is a transcript containing "\\n\\nAssistant:"), 'shp' (the SHP fields), 'ultrafeedback' (no
    list prompt; chosen/rejected are conversations of >= 2 messages)."""
    if not isinstance(row, dict):
        return "pairs"
    if "completion" in row and "label" in row:
        return "unpaired"
    chosen = row.get("chosen")
    if all(name in row for name in SHP_FIELDS):
        return "shp"
    if "prompt" not in row and isinstance(chosen, str) and HH_MARKER in chosen:
        return "hh"
    if not isinstance(row.get("prompt"), list) and isinstance(chosen, list) and len(chosen) >= 2:
        return "ultrafeedback"
    return "pairs"


def is_conversation(prompt: Any) -> bool:
    """A prompt that ends by cueing the reply: a message list (the chat template adds the generation prompt) or
    text ending in "\\n\\nAssistant:". Truncating such a prompt keep_start cuts the cue off."""
    return isinstance(prompt, list) or (isinstance(prompt, str) and prompt.endswith(HH_MARKER))


class LocalShape(NamedTuple):
    description: str
    check: Callable[[Any, str], None]
    convert: Callable[[Iterable[dict], Any], Converted]
    truncation_mode: Callable[[dict], str]  # the first row -> the default truncation of the file's prompts


LOCAL_SHAPES: dict[str, LocalShape] = {
    # conversation prompts keep their end (the cue to reply); other plain prompts their start, as before
    "pairs": LocalShape("{prompt, chosen, rejected}", check_row, convert_pairs,
                        lambda row: "keep_end" if is_conversation(row.get("prompt")) else "keep_start"),
    "hh": LocalShape("Anthropic HH {chosen, rejected} transcript", check_hh_row,
                     convert_hh, lambda row: "keep_end"),
    # as the hub source `shp` (the original's keep_start); the summary counts prompts whose cue is cut
    "shp": LocalShape("SHP", check_shp_row, convert_shp, lambda row: "keep_start"),
    "ultrafeedback": LocalShape("UltraFeedback {chosen, rejected} conversation", check_ultrafeedback_row,
                                convert_ultrafeedback, lambda row: "keep_end"),
    "unpaired": LocalShape("unpaired {prompt, completion, label}", check_unpaired_row, convert_unpaired,
                           lambda row: "keep_end" if is_conversation(row.get("prompt")) else "keep_start"),
}


# ----------------------------------------------------------------------------------------------------------
# The registry: a new source is one entry here (a converter, plus how to fetch its rows).
# ----------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Source:
    """How to get one named source's rows and convert them.

    convert: rows -> (normalized, dropped counts). truncation_mode: the default for prompts.
    fetch: (split, cache_dir) -> hub rows, for hub sources; path: a local file template relative to this file
    ('{split}' replaced), for local sources. sample_rule: response text -> whether it follows the behaviour the
    preferences teach, for sources that have a checkable one (the trainer logs the rate in samples).
    """
    convert: Callable[[Iterable[dict], Any], Converted]
    truncation_mode: str = "keep_start"
    fetch: Optional[Callable[[str, Optional[str]], Any]] = None
    path: Optional[str] = None
    sample_rule: Optional[Callable[[str], bool]] = None
    unpaired: bool = False  # its rows are labelled completions (KTO data), not pairs


def toy_follows_rule(response: str) -> bool:
    """The toy task's preferred behaviour (mirrors toy/make_toy.py's follows_rule): the answer has letters and none
    of them is upper case (it does not shout)."""
    letters = re.sub(r"[^A-Za-z]", "", response)
    return bool(letters) and letters == letters.lower()


SOURCES: dict[str, Source] = {
    # hh prompts are long multi-turn histories: keep their end, the turns the response answers
    "hh": Source(convert_hh, "keep_end", fetch=partial(fetch_hub, "Anthropic/hh-rlhf")),
    "shp": Source(convert_shp, "keep_start", fetch=partial(fetch_hub, "stanfordnlp/SHP")),
    "se": Source(convert_se, "keep_start", fetch=fetch_se),
    # chat prompts end in the template's generation prompt (the cue to reply): keep their end
    "ultrafeedback": Source(convert_ultrafeedback, "keep_end", fetch=partial(
        fetch_hub, "HuggingFaceH4/ultrafeedback_binarized", splits={"train": "train_prefs", "test": "test_prefs"})),
    "toy": Source(convert_pairs, "keep_start", path="toy/data/{split}.jsonl", sample_rule=toy_follows_rule),
    # KTO's unpaired data: chat prompts and completions with a desirable/undesirable label
    "kto_mix": Source(convert_unpaired, "keep_end", fetch=partial(fetch_hub, "trl-lib/kto-mix-14k"), unpaired=True),
}
LOCAL_FILE = Source(convert_pairs, "keep_start")  # any path given in datasets=[...]


def _looks_like_path(name: str) -> bool:
    return os.sep in name or "/" in name or bool(Path(name).suffix) or Path(name).exists()


def resolve_source(name: str, split: str) -> tuple[Source, Optional[Path]]:
    """A dataset name -> (its Source, its local file for this split or None for hub sources)."""
    if name in SOURCES:
        source = SOURCES[name]
        return source, (HERE / source.path.format(split=split)) if source.path else None
    if _looks_like_path(name):
        return LOCAL_FILE, Path(name.replace("{split}", split))
    guess = difflib.get_close_matches(name, list(SOURCES), 1, cutoff=0.5)
    hint = f"; did you mean '{guess[0]}'?" if guess else ""
    raise DataError(f"unknown dataset '{name}': expected one of {', '.join(SOURCES)} "
                    f"or a path to a .jsonl/.json file{hint}")


def sample_rule(names: list[str]) -> Optional[Callable[[str], bool]]:
    """The rule generated samples should follow, when every source in `names` shares one (the toy task); else None."""
    rules = {SOURCES[n].sample_rule if n in SOURCES else None for n in names}
    return rules.pop() if len(rules) == 1 else None


def validate_sources(names: list[str], splits: tuple[str, ...] = ("train", "test"), *, unpaired: bool = False,
                     pairs_to_unpaired: bool = False) -> None:
    """Check dataset names, paths and local file contents, cheaply and without a tokenizer.

    Call at config time, before any model is loaded. Hub sources are only checked by name (whether they can be
    fetched is known only by fetching). `unpaired`: the loss scores labelled completions (kto), so every source
    must hold {prompt, completion, label} rows, or pairs with `pairs_to_unpaired`; a loss on pairs refuses unpaired
    rows. Every problem is collected and raised together as one DataError.
    """
    problems, shapes = [], {}  # path -> whether its rows are unpaired
    for name in names:
        for split in splits:
            try:
                source, path = resolve_source(name, split)
                if path is not None and path not in shapes:
                    shapes[path] = detect_shape(read_rows(path)[0]) == "unpaired"
                is_unpaired = shapes[path] if path is not None else source.unpaired
                _check_mode(name, path, is_unpaired, unpaired, pairs_to_unpaired)
            except DataError as e:
                if str(e) not in problems:
                    problems.append(str(e))
    if problems:
        raise DataError("\n".join(problems))


def _check_mode(name: str, path: Optional[Path], is_unpaired: bool, unpaired: bool, pairs_to_unpaired: bool) -> None:
    where = f"{path}" if path is not None else f"dataset '{name}'"
    if is_unpaired and not unpaired:
        raise DataError(f"{where}: holds unpaired {{prompt, completion, label}} rows; only an unpaired loss reads them "
                        "(loss=kto), the selected loss needs {prompt, chosen, rejected} pairs")
    if unpaired and not is_unpaired and not pairs_to_unpaired:
        raise DataError(f"{where}: holds pairs, but loss kto needs {{prompt, completion, label}} rows; set "
                        "pairs_to_unpaired=true to use each pair as a desirable (chosen) and an undesirable (rejected) "
                        "completion")


# ----------------------------------------------------------------------------------------------------------
# Tokenization: the normalized form -> token ids, once per run (cached on disk below).
# ----------------------------------------------------------------------------------------------------------

class TokenizedExample(NamedTuple):
    """One pair (or, in SFT mode, one target) ready to collate.

    prompt_ids: the prompt's ids, BOS first when the tokenizer adds one. chosen_ids / rejected_ids: the response
    ids only, ending in EOS unless truncated. Texts are the untruncated originals, for logging and sampling.
    """
    source: str
    prompt: str
    chosen: str
    rejected: Optional[str]  # None in SFT mode
    prompt_ids: np.ndarray
    chosen_ids: np.ndarray
    rejected_ids: Optional[np.ndarray]
    desirable: Optional[bool] = None  # unpaired mode: chosen_* is the completion, this its label


@dataclass
class SourceStats:
    """What loading one source did; every number printed by dataset_summary()."""
    source: str
    split: str
    unit: str  # 'pairs', 'sft_targets' or 'completions' (unpaired)
    truncation_mode: str
    origin: str = ""  # the local file, or "hub:<fingerprint>" of the hub dataset
    prompts: int = 0
    kept: int = 0
    dropped: dict = field(default_factory=dict)
    boundary_merges: int = 0
    prompts_truncated: int = 0
    reply_cues_cut: int = 0  # conversation prompts truncated keep_start, so they lost their final cue to reply
    responses_truncated: int = 0
    prompt_tokens_mean: float = 0.0
    prompt_tokens_max: int = 0
    response_tokens_mean: float = 0.0
    response_tokens_max: int = 0
    cache: str = "off"
    desirable: int = 0  # unpaired mode: completions kept per label
    undesirable: int = 0


def tokenizer_adds_bos(tokenizer: Any) -> bool:
    """True when the tokenizer puts BOS first by default (Llama-style post-processor); then we do too."""
    bos = tokenizer.bos_token_id
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bos is not None and len(ids) > 0 and ids[0] == bos


def encode(tokenizer: Any, texts: list[str], chat: list[bool]) -> list[list[int]]:
    """Token ids of each text, without special tokens added. Special-token text is parsed as special tokens only
    in chat-template output; elsewhere it is ordinary text (departure 6)."""
    out: list[list[int]] = [[] for _ in texts]
    for parse_special in (False, True):
        idx = [i for i, c in enumerate(chat) if c == parse_special]
        if idx:
            ids = tokenizer([texts[i] for i in idx], add_special_tokens=False,
                            split_special_tokens=not parse_special, verbose=False)["input_ids"]
            for i, row in zip(idx, ids):
                out[i] = row
    return out


def truncate(prompt_ids: list[int], responses: list[list[int]], *, max_length: int, max_prompt_length: int,
             mode: str, bos_id: Optional[int] = None) -> tuple[list[int], list[list[int]]]:
    """Fit prompt + the longest response into max_length, the prompt first, as the original.

    If prompt + longest response is too long, the prompt is cut to max_prompt_length: keep_start keeps its first
    tokens, keep_end its last (a leading BOS is kept either way). If still too long, every response is cut to the
    room left, max_length - len(prompt), keeping its start (a cut response loses its EOS: departure 5).
    """
    longest = max(len(r) for r in responses)
    if len(prompt_ids) + longest > max_length and len(prompt_ids) > max_prompt_length:
        if mode == "keep_start":
            prompt_ids = prompt_ids[:max_prompt_length]
        elif mode == "keep_end":
            head = prompt_ids[:1] if bos_id is not None and prompt_ids[:1] == [bos_id] else []
            body, room = prompt_ids[len(head):], max_prompt_length - len(head)
            prompt_ids = head + body[len(body) - room:]
        else:
            raise ValueError(f"truncation_mode={mode!r}: expected one of {TRUNCATION_MODES}")
    room = max_length - len(prompt_ids)
    return prompt_ids, [r[:room] for r in responses]


@contextlib.contextmanager
def _gc_paused():
    """Pause the cyclic garbage collector: tokenizing builds millions of small lists, none of them cyclic, and
    the collector's repeated scans of them cost ~30% of the build time."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _jobs(entries: list[PromptResponses], sft_mode: bool, unpaired: bool, pairs_to_unpaired: bool,
          drops: Counter) -> list[tuple]:
    """What to tokenize: (entry, chosen text or the completion, rejected text or None, label or None) per example;
    pairs of identical responses are counted in `drops` instead."""
    jobs = []
    for entry in entries:
        if sft_mode:
            jobs.extend((entry, target, None, None) for target in entry.sft_targets)
            continue
        if unpaired:
            jobs.extend((entry, entry.responses[i], None, label) for i, label in entry.rated)
            if not pairs_to_unpaired:
                continue
        for i, j in entry.pairs:
            if entry.responses[i] == entry.responses[j]:
                drops["chosen_equals_rejected"] += 1
            elif unpaired:  # pairs_to_unpaired: the pair's two completions, labelled by the preference
                jobs += [(entry, entry.responses[i], None, True), (entry, entry.responses[j], None, False)]
            else:
                jobs.append((entry, entry.responses[i], entry.responses[j], None))
    return jobs


def _encode_jobs(tokenizer: Any, jobs: list[tuple], stats: SourceStats) -> tuple[dict, dict]:
    """{prompt: ids} and {(prompt, response): ids} of the jobs' texts, with one tokenizer call per kind of text for
    the whole chunk (a call per text is ~10x slower); counts boundary_merges in `stats`."""
    prompts = list({id(e): e for e, _, _, _ in jobs}.values())
    replies = list(dict.fromkeys((e.prompt, r, e.chat) for e, c, rj, _ in jobs for r in (c, rj) if r is not None))
    prompt_ids = dict(zip((e.prompt for e in prompts),
                          encode(tokenizer, [e.prompt for e in prompts], [e.chat for e in prompts])))
    reply_ids = encode(tokenizer, [r for _, r, _ in replies], [c for _, _, c in replies])
    joint_ids = encode(tokenizer, [p + r for p, r, _ in replies], [c for _, _, c in replies])
    response_ids = {}
    for (p, r, _), ids, joint in zip(replies, reply_ids, joint_ids):
        # the prefix property holds by construction; count where the joint tokenization would differ
        stats.boundary_merges += joint != prompt_ids[p] + ids
        response_ids[(p, r)] = ids
    return prompt_ids, response_ids


def tokenize_normalized(data: Normalized, tokenizer: Any, *, source: str, split: str, max_length: int,
                        max_prompt_length: int, truncation_mode: str, sft_mode: bool,
                        dropped: Optional[Counter] = None, unpaired: bool = False,
                        pairs_to_unpaired: bool = False) -> tuple[list[TokenizedExample], SourceStats]:
    """The normalized form -> tokenized, truncated examples (pairs, SFT targets, or labelled completions) + stats.

    `unpaired`: one example per rated completion (chosen_ids = the completion, `desirable` its label); with
    `pairs_to_unpaired` each pair adds its chosen response as desirable and its rejected one as undesirable.

    Per example: prompt_ids = [BOS] + ids(prompt); response ids = ids(response) + [EOS]; then truncate().
    Dropped, by reason: chosen_equals_rejected (same text), empty_response (no tokens before EOS: it would teach
    nothing but EOS, and length-normalised losses divide by its length), identical_after_truncation (same tokens
    once cut: the pair carries no preference). No response is empty after truncation: 0 < max_prompt_length <
    max_length leaves room for at least one token.
    """
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    add_bos = tokenizer_adds_bos(tokenizer)
    drops = Counter(dropped or {})
    stats = SourceStats(source, split, "sft_targets" if sft_mode else "completions" if unpaired else "pairs",
                        truncation_mode)
    examples, kept_prompts, prompt_lengths, response_lengths = [], set(), [], []
    entries = list(data.values())
    for start in range(0, len(entries), ENCODE_CHUNK):
        jobs = _jobs(entries[start:start + ENCODE_CHUNK], sft_mode, unpaired, pairs_to_unpaired, drops)
        prompt_ids, response_ids = _encode_jobs(tokenizer, jobs, stats)
        for entry, chosen, rejected, label in jobs:
            p_ids = prompt_ids[entry.prompt]
            if add_bos and p_ids[:1] != [bos]:
                p_ids = [bos] + p_ids
            texts = [chosen] if rejected is None else [chosen, rejected]
            bodies = [response_ids[(entry.prompt, t)] for t in texts]
            if any(not b for b in bodies):
                drops["empty_response"] += 1
                continue
            # every response keeps >= 1 token: truncate() leaves max_length - max_prompt_length > 0 of room
            p_cut, r_cut = truncate(p_ids, [b + [eos] for b in bodies], max_length=max_length,
                                    max_prompt_length=max_prompt_length, mode=truncation_mode, bos_id=bos)
            if rejected is not None and r_cut[0] == r_cut[1]:
                drops["identical_after_truncation"] += 1
                continue
            stats.prompts_truncated += len(p_cut) < len(p_ids)
            stats.reply_cues_cut += (len(p_cut) < len(p_ids) and truncation_mode == "keep_start"
                                     and (entry.chat or is_conversation(entry.prompt)))
            stats.responses_truncated += sum(len(r) < len(b) + 1 for r, b in zip(r_cut, bodies))  # +1: EOS
            kept_prompts.add(entry.prompt)
            prompt_lengths.append(len(p_cut))
            response_lengths.extend(len(r) for r in r_cut)
            arrays = [np.asarray(x, dtype=np.int32) for x in (p_cut, *r_cut)]  # int32: half the memory
            examples.append(TokenizedExample(source, entry.prompt, chosen, rejected, arrays[0], arrays[1],
                                             arrays[2] if rejected is not None else None, label))
            if label is not None:
                stats.desirable += label
                stats.undesirable += not label
    stats.prompts, stats.kept, stats.dropped = len(kept_prompts), len(examples), dict(sorted(drops.items()))
    if examples:
        stats.prompt_tokens_mean, stats.prompt_tokens_max = float(np.mean(prompt_lengths)), max(prompt_lengths)
        stats.response_tokens_mean = float(np.mean(response_lengths))
        stats.response_tokens_max = max(response_lengths)
    return examples, stats


# ----------------------------------------------------------------------------------------------------------
# The cache: one file per (source, split, mode), keyed by everything the tokenized result depends on.
# ----------------------------------------------------------------------------------------------------------

def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Hash of the tokenizer's serialized state (vocab, merges, normalizer, post-processor, added tokens), its
    special tokens and chat template: any change that could change token ids changes this."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    state = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    specials = {k: (str(getattr(tokenizer, k, None)), getattr(tokenizer, k + "_id", None))
                for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
    parts = [type(tokenizer).__name__, state, json.dumps(specials, sort_keys=True),
             str(getattr(tokenizer, "chat_template", None)), str(tokenizer_adds_bos(tokenizer))]
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()


def cache_key(**parts: Any) -> str:
    """sha256 of the key parts (source, split, content, tokenizer, lengths, truncation, mode, code version)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _read_cache(path: Path, key: str) -> Optional[tuple[list[TokenizedExample], SourceStats]]:
    try:
        with open(path, "rb") as f:
            payload = pickle.load(f)
        if payload.get("key") != key:
            return None
        return [TokenizedExample(*row) for row in payload["examples"]], SourceStats(**payload["stats"])
    except FileNotFoundError:
        return None
    except Exception as e:  # a truncated or foreign file: rebuild rather than fail the run
        print(f"[data] ignoring unreadable cache file {path} ({type(e).__name__}: {e}); rebuilding it")
        return None


def _write_cache(path: Path, key: str, examples: list[TokenizedExample], stats: SourceStats) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:  # plain tuples: the file must not depend on where this module was imported from
        pickle.dump({"key": key, "examples": [tuple(e) for e in examples], "stats": asdict(stats)}, f,
                    protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(tmp, path)  # atomic: a reader never sees half a file


def _load_source(name: str, tokenizer: Any, split: str, *, max_length: int, max_prompt_length: int,
                 sft_mode: bool, truncation_mode: Optional[str], cache_dir: Optional[str],
                 tokenizer_fp: str, unpaired: bool = False, pairs_to_unpaired: bool = False, key_only: bool = False
                 ) -> tuple[list[TokenizedExample], SourceStats]:
    source, path = resolve_source(name, split)
    mode = truncation_mode or source.truncation_mode
    if path is not None:
        if path.suffix not in LOCAL_SUFFIXES or not path.is_file():
            read_rows(path)  # raises the wrong-suffix or no-such-file error
        raw = path.read_bytes()
        content, origin = "sha256:" + hashlib.sha256(raw).hexdigest(), str(path)
        get_rows = partial(read_rows, path, raw)
        if source is LOCAL_FILE:  # a path: its first row decides the converter and the default truncation
            rows = read_rows(path, raw)
            shape = detect_shape(rows[0])
            source = dataclasses.replace(source, convert=LOCAL_SHAPES[shape].convert)
            mode = truncation_mode or LOCAL_SHAPES[shape].truncation_mode(rows[0])
            origin, get_rows = f"{path} ({shape})", lambda: rows
    else:
        dataset = source.fetch(split, cache_dir)
        content = "hub:" + str(getattr(dataset, "_fingerprint", None) or cache_key(rows=list(dataset)))
        origin, get_rows = content, lambda: dataset

    def build() -> tuple[list[TokenizedExample], SourceStats]:
        data, dropped = source.convert(get_rows(), tokenizer)
        with _gc_paused():
            examples, stats = tokenize_normalized(data, tokenizer, source=name, split=split, max_length=max_length,
                                                  max_prompt_length=max_prompt_length, truncation_mode=mode,
                                                  sft_mode=sft_mode, dropped=dropped, unpaired=unpaired,
                                                  pairs_to_unpaired=pairs_to_unpaired)
        stats.origin = origin
        return examples, stats

    key = cache_key(code_version=CODE_VERSION, source=name, split=split, content=content, tokenizer=tokenizer_fp,
                    max_length=max_length, max_prompt_length=max_prompt_length, truncation_mode=mode,
                    sft_mode=sft_mode, max_pairs_per_prompt=MAX_PAIRS_PER_PROMPT, unpaired=unpaired,
                    pairs_to_unpaired=pairs_to_unpaired)
    if key_only:  # data_fingerprints: everything the tokenized result depends on, without tokenizing
        return key
    if cache_dir is None:
        return build()
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(name).stem if path is not None else name)[:40]
    file = Path(cache_dir) / "tokenized" / f"{slug}-{split}-{'sft' if sft_mode else 'unpaired' if unpaired else 'pairs'}-{key[:16]}.pkl"
    file.parent.mkdir(parents=True, exist_ok=True)
    # several ranks may start at once: the first builds the file while the others wait, then all read it
    with FileLock(str(file) + ".lock"):
        cached = _read_cache(file, key)
        if cached is not None:
            cached[1].cache = f"hit {file}"
            return cached
        examples, stats = build()
        stats.cache = f"written {file}"
        _write_cache(file, key, examples, stats)
    return examples, stats


def load_tokenized(names: list[str], tokenizer: Any, split: str, *, max_length: int = 512,
                   max_prompt_length: int = 256, sft_mode: bool = False, truncation_mode: Optional[str] = None,
                   cache_dir: Optional[str] = None, silent: bool = False, unpaired: bool = False,
                   pairs_to_unpaired: bool = False) -> tuple[list[TokenizedExample], list[SourceStats]]:
    """Every source in `names`, tokenized (from the cache when it is there), concatenated in order.

    Returns (examples, one SourceStats per source). Prints dataset_summary() unless silent.
    truncation_mode None means each source's default (hh, ultrafeedback and conversation-shaped local files
    keep_end, the others keep_start).
    """
    if truncation_mode not in (None, *TRUNCATION_MODES):
        raise ValueError(f"truncation_mode={truncation_mode!r}: expected null or one of {TRUNCATION_MODES}")
    if not 0 < max_prompt_length < max_length:
        raise ValueError(f"max_prompt_length={max_prompt_length}, max_length={max_length}: expected "
                         "0 < max_prompt_length < max_length (responses need room after the prompt)")
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token: responses end in EOS, so set tokenizer.eos_token")
    tokenizer_fp = tokenizer_fingerprint(tokenizer) if cache_dir is not None else ""
    examples, all_stats = [], []
    for name in names:
        ex, stats = _load_source(name, tokenizer, split, max_length=max_length, max_prompt_length=max_prompt_length,
                                 sft_mode=sft_mode, truncation_mode=truncation_mode, cache_dir=cache_dir,
                                 tokenizer_fp=tokenizer_fp, unpaired=unpaired, pairs_to_unpaired=pairs_to_unpaired)
        examples.extend(ex)
        all_stats.append(stats)
    if not silent:
        print(dataset_summary(all_stats))
    return examples, all_stats


def data_fingerprints(names: list[str], tokenizer: Any, split: str, *, max_length: int = 512,
                      max_prompt_length: int = 256, sft_mode: bool = False, truncation_mode: Optional[str] = None,
                      cache_dir: Optional[str] = None, unpaired: bool = False,
                      pairs_to_unpaired: bool = False) -> dict[str, str]:
    """{source name: sha256} of the tokenized data of `split`, without tokenizing: the cache key, which hashes the
    raw content, the tokenizer, the lengths, truncation, mode and CODE_VERSION (the run manifest records these;
    a resume or replay refuses when one differs)."""
    fp = tokenizer_fingerprint(tokenizer)
    return {name: _load_source(name, tokenizer, split, max_length=max_length, max_prompt_length=max_prompt_length,
                               sft_mode=sft_mode, truncation_mode=truncation_mode, cache_dir=cache_dir,
                               tokenizer_fp=fp, unpaired=unpaired, pairs_to_unpaired=pairs_to_unpaired, key_only=True)
            for name in names}


def count_examples(names: list[str], tokenizer: Any, *, split: str, max_length: int = 512,
                   max_prompt_length: int = 256, sft_mode: bool = False, truncation_mode: Optional[str] = None,
                   cache_dir: Optional[str] = None, silent: bool = True, **mode: bool) -> int:
    """How many examples (pairs, or SFT targets) the iterator draws from; with cache_dir set, the loading here is
    what later iterators find in the cache."""
    examples, _ = load_tokenized(names, tokenizer, split, max_length=max_length, max_prompt_length=max_prompt_length,
                                 sft_mode=sft_mode, truncation_mode=truncation_mode, cache_dir=cache_dir,
                                 silent=silent, **mode)
    return len(examples)


def dataset_summary(stats: list[SourceStats]) -> str:
    """One block per source, every number named."""
    lines = []
    for s in stats:
        dropped = ", ".join(f"{k}={v}" for k, v in s.dropped.items()) or "none"
        lines.append(
            f"[data] {s.source}/{s.split} ({s.origin})\n"
            f"       {s.unit}_kept={s.kept} prompts={s.prompts} dropped: {dropped}\n"
            + (f"       desirable={s.desirable} undesirable={s.undesirable}\n" if s.unit == "completions" else "") +
            f"       boundary_merges={s.boundary_merges} prompts_truncated={s.prompts_truncated} "
            f"responses_truncated={s.responses_truncated} truncation_mode={s.truncation_mode}\n"
            f"       prompt_tokens_mean={s.prompt_tokens_mean:.1f} prompt_tokens_max={s.prompt_tokens_max} "
            f"response_tokens_mean={s.response_tokens_mean:.1f} response_tokens_max={s.response_tokens_max}\n"
            f"       cache: {s.cache}")
        if s.reply_cues_cut:
            lines.append(f"       warning: reply_cues_cut={s.reply_cues_cut}: conversation prompts truncated keep_start lost "
                         "their final cue to reply ('\\n\\nAssistant:' or the chat generation prompt); "
                         "truncation_mode=keep_end keeps it")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# Batches: the order (a pure function of seed, epoch, step) and the collate.
# ----------------------------------------------------------------------------------------------------------

def _check_batch_args(*, batch_size, n_epochs, n_examples, rank, world_size, start_example, seed) -> None:
    """Raise ValueError for arguments no data could make sense of (cheap: called before loading)."""
    if n_epochs is None and n_examples is None:
        raise ValueError("set n_epochs or n_examples: the iterator needs to know when to stop")
    if batch_size <= 0 or batch_size % world_size:
        raise ValueError(f"batch_size={batch_size} (global pairs per step) must be a positive multiple of "
                         f"world_size={world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank}: expected 0 <= rank < world_size={world_size}")
    if start_example < 0 or start_example % batch_size:
        raise ValueError(f"start_example={start_example}: expected a multiple of batch_size={batch_size} "
                         "(the examples consumed by whole steps)")
    if seed < 0:
        raise ValueError(f"seed={seed}: expected a non-negative integer")


def num_steps(n_items: int, *, batch_size: int, n_epochs: Optional[int] = None,
              n_examples: Optional[int] = None) -> int:
    """Global steps the iterator runs: min(n_epochs * (n_items // batch_size), ceil(n_examples / batch_size)),
    the bounds that are set. Each epoch drops its incomplete last batch; n_examples rounds up to whole batches."""
    if n_epochs is None and n_examples is None:
        raise ValueError("set n_epochs or n_examples: the iterator needs to know when to stop")
    if n_items // batch_size == 0:
        raise DataError(f"{n_items} examples, fewer than one global batch of {batch_size}: "
                        "lower batch_size or add data")
    bounds = [n_epochs * (n_items // batch_size)] if n_epochs is not None else []
    bounds += [-(-n_examples // batch_size)] if n_examples is not None else []
    return min(bounds)


def iter_batch_indices(n_items: int, *, batch_size: int, shuffle: bool = True, seed: int = 0,
                       n_epochs: Optional[int] = None, n_examples: Optional[int] = None, rank: int = 0,
                       world_size: int = 1, start_example: int = 0, sizes: Optional[Sequence[int]] = None,
                       min_share: int = 1, share_cost: Optional[Callable[[list[int]], float]] = None
                       ) -> Iterator[list[int]]:
    """Indices of this rank's items for each global batch, in order.

    Global step s covers items perm_e[j*B:(j+1)*B] with e = s // S, j = s % S, B = batch_size,
    S = n_items // B steps per epoch (the incomplete last batch of each epoch is dropped) and
    perm_e = a permutation seeded by (seed, e) (the identity when shuffle is False). Rank r takes positions
    [r*k, (r+1)*k) of each global batch, k = B // world_size; or, when `sizes` (tokens per item) is given, the
    share balance_shares deals it (at least min_share items; refined by `share_cost` of a share's items when
    given). The run lasts n_epochs * S steps or
    ceil(n_examples / B) steps, whichever is fewer (at least one must be set), and starts at step
    start_example // B, so a resumed iterator yields exactly what an uninterrupted one would.
    """
    _check_batch_args(batch_size=batch_size, n_epochs=n_epochs, n_examples=n_examples, rank=rank,
                      world_size=world_size, start_example=start_example, seed=seed)
    if sizes is not None and not 1 <= min_share <= batch_size // world_size:
        raise ValueError(f"min_share={min_share}: expected 1 <= min_share <= batch_size // world_size")
    total = num_steps(n_items, batch_size=batch_size, n_epochs=n_epochs, n_examples=n_examples)
    # the checks above run at the call; the batches come from a generator, one step at a time
    return _batch_indices(n_items, batch_size, rank, world_size, shuffle, seed, start_example // batch_size, total,
                          sizes, min_share, share_cost)


def _batch_indices(n_items, batch_size, rank, world_size, shuffle, seed, step, total, sizes, min_share, share_cost):
    steps_per_epoch, per_rank = n_items // batch_size, batch_size // world_size
    epoch, order = None, None
    while step < total:
        if step // steps_per_epoch != epoch:
            epoch = step // steps_per_epoch
            # a fresh permutation per epoch, a pure function of (seed, epoch): resuming needs no saved state
            order = np.random.default_rng((seed, epoch)).permutation(n_items) if shuffle else np.arange(n_items)
        items = order[(step % steps_per_epoch) * batch_size:][:batch_size].tolist()
        yield (balance_shares(items, [sizes[i] for i in items], world_size, min_share, share_cost)[rank]
               if sizes is not None
               else items[rank * per_rank:(rank + 1) * per_rank])
        step += 1


def example_tokens(e: TokenizedExample) -> int:
    """Tokens of the rows an example becomes: prompt + response, once per side."""
    return sum(len(e.prompt_ids) + len(r) for r in (e.chosen_ids, e.rejected_ids) if r is not None)


def balance_shares(items: list[int], sizes: list[int], n_shares: int, min_share: int = 1,
                   share_cost: Optional[Callable[[list[int]], float]] = None) -> list[list[int]]:
    """Deal `items` (`sizes` tokens each) into n_shares shares of near-equal cost, each >= min_share items.

    Under FSDP every rank waits for the slowest in each collective, so a step costs what its costliest share
    costs: with one long pair among short ones, equal-count shares differ by 1.2-2x in tokens. Largest first,
    each item goes to the lightest share in tokens (ties: the lower share), except that the last items go to the
    shares still short of min_share. Tokens are not what a share costs, though: packed rows are as wide as
    their longest sequence, the LM head may score only responses, attention grows with the square of the
    width. So with `share_cost` (items -> cost, e.g. the trainer's executed FLOPs) the costliest share then
    gives an item to, or swaps one with, the cheapest share while that lowers the larger of their two costs
    (the best such change each time; at most REFINE_EVALUATIONS costs per batch, so a large batch stays cheap).
    Each share keeps the batch's order. Shares may differ in count; the trainer weights every pair by
    1 / (pairs per step), so the step's gradient is the same however the batch is dealt.
    """
    shares, loads = [[] for _ in range(n_shares)], [0] * n_shares
    by_size = sorted(range(len(items)), key=lambda p: -sizes[p])  # sorted() is stable: ties keep batch order
    for placed, pos in enumerate(by_size):
        short = [s for s in range(n_shares) if len(shares[s]) < min_share]
        must_fill = sum(min_share - len(shares[s]) for s in short) >= len(items) - placed
        target = min(short if must_fill else range(n_shares), key=lambda s: loads[s])
        shares[target].append(pos)
        loads[target] += sizes[pos]
    shares = [sorted(share) for share in shares]
    if share_cost is not None and n_shares > 1:
        shares = _refined(shares, lambda share: share_cost([items[p] for p in share]), min_share)
    return [[items[p] for p in share] for share in shares]


REFINE_EVALUATIONS = 512  # share costs one batch's refinement may evaluate (each packs a share's rows)


def _refined(shares: list[list[int]], cost: Callable[[list[int]], float], min_share: int) -> list[list[int]]:
    """balance_shares's local search: moves and swaps between the costliest and the cheapest share."""
    memo: dict[tuple[int, ...], float] = {}

    def cost_of(share: list[int]) -> float:
        key = tuple(share)
        if key not in memo:
            memo[key] = cost(share)
        return memo[key]

    while len(memo) < REFINE_EVALUATIONS:
        costs = [cost_of(share) for share in shares]
        top, low = max(range(len(shares)), key=costs.__getitem__), min(range(len(shares)), key=costs.__getitem__)
        if costs[top] == costs[low]:
            break
        best = None
        gives = [(i, None) for i in shares[top]] if len(shares[top]) > min_share else []
        for i, j in gives + [(i, j) for i in shares[top] for j in shares[low]]:
            a = sorted([x for x in shares[top] if x != i] + ([] if j is None else [j]))
            b = sorted([x for x in shares[low] if x != j] + [i])
            worse = max(cost_of(a), cost_of(b))
            if worse < costs[top] and (best is None or worse < best[0]):
                best = (worse, a, b)
            if len(memo) >= REFINE_EVALUATIONS:
                break
        if best is None:
            break
        shares[top], shares[low] = best[1], best[2]
    return shares


def _pad(rows: list[np.ndarray], value: int, left: bool = False) -> torch.Tensor:
    """Rows of different lengths -> one (len(rows), longest) long tensor, padded with `value` on the right
    (or on the left)."""
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), value, dtype=torch.long)
    for i, r in enumerate(rows):
        if len(r):
            if left:
                out[i, width - len(r):] = torch.as_tensor(r)
            else:
                out[i, :len(r)] = torch.as_tensor(r)
    return out


def collate(examples: list[TokenizedExample], pad_token_id: int, kl_rows: bool = False) -> dict[str, Any]:
    """Examples -> a batch dict with the original code's keys.

    Texts (lists of str): prompt, chosen and rejected (prompt + response), chosen_response_only,
    rejected_response_only. Tensors (long): prompt_input_ids, prompt_attention_mask (B, P), left-padded so
    generation continues from the last column; {chosen,rejected}_{input_ids,attention_mask,labels} (B, T),
    right-padded, labels = input ids on the response (EOS included) and -100 on prompt and padding.
    SFT examples (rejected None) give no rejected keys. Unpaired examples (desirable set) add `desirable` (B,) bool.

    kl_rows: also kl_{input_ids,attention_mask,labels}, the MISMATCHED sequences KTO's KL reference point is
    estimated on (as the paper, HALOs and TRL): the batch's completions in the order the trainer scores them
    (chosen then rejected), completion k-1 after the prompt of completion k (shifted by one), each cut to the
    batch's longest real sequence. Needs >= 2 examples (else a completion would meet its own prompt).
    """
    batch: dict[str, Any] = {"prompt": [e.prompt for e in examples]}
    prompts = [e.prompt_ids for e in examples]
    batch["prompt_input_ids"] = _pad(prompts, pad_token_id, left=True)
    batch["prompt_attention_mask"] = _pad([np.ones_like(p) for p in prompts], 0, left=True)
    sides = ("chosen",) if examples[0].rejected is None else ("chosen", "rejected")
    for side in sides:
        texts, responses = [getattr(e, side) for e in examples], [getattr(e, side + "_ids") for e in examples]
        batch[side] = [e.prompt + t for e, t in zip(examples, texts)]
        batch[side + "_response_only"] = texts
        sequences = [np.concatenate([p, r]) for p, r in zip(prompts, responses)]
        batch[side + "_input_ids"] = _pad(sequences, pad_token_id)
        batch[side + "_attention_mask"] = _pad([np.ones_like(s) for s in sequences], 0)
        batch[side + "_labels"] = _pad([np.concatenate([np.full(len(p), -100), r])
                                        for p, r in zip(prompts, responses)], -100)
    if examples[0].desirable is not None:
        batch["desirable"] = torch.tensor([bool(e.desirable) for e in examples])
    if kl_rows:
        if len(examples) < 2:
            raise ValueError("kl_rows needs >= 2 examples per batch: each completion goes after another's prompt")
        completions = [(e.prompt_ids, getattr(e, side + "_ids")) for side in sides for e in examples]
        cap = max(len(p) + len(r) for p, r in completions)  # never longer than a real sequence of the batch
        shifted = [(p, completions[k - 1][1][:cap - len(p)]) for k, (p, _) in enumerate(completions)]
        batch["kl_input_ids"] = _pad([np.concatenate([p, r]) for p, r in shifted], pad_token_id)
        batch["kl_attention_mask"] = _pad([np.ones(len(p) + len(r), dtype=np.int64) for p, r in shifted], 0)
        batch["kl_labels"] = _pad([np.concatenate([np.full(len(p), -100), r]) for p, r in shifted], -100)
    return batch


def get_batch_iterator(names: list[str], tokenizer: Any, *, split: str, batch_size: int, shuffle: bool = True,
                       max_length: int = 512, max_prompt_length: int = 256, sft_mode: bool = False,
                       n_epochs: Optional[int] = None, n_examples: Optional[int] = None, seed: int = 0,
                       rank: int = 0, world_size: int = 1, start_example: int = 0, cache_dir: Optional[str] = None,
                       truncation_mode: Optional[str] = None, silent: bool = False, unpaired: bool = False,
                       pairs_to_unpaired: bool = False, kl_rows: bool = False, min_share: Optional[int] = None,
                       share_cost: Optional[Callable[[list[TokenizedExample]], float]] = None
                       ) -> Iterator[dict[str, Any]]:
    """Batches of this rank's share of each global batch (see iter_batch_indices for the order, collate for keys).

    batch_size is GLOBAL pairs per step. Each rank collates only its share: batch_size // world_size consecutive
    pairs, or with min_share set, a share of near-equal tokens of at least min_share pairs (balance_shares), then
    of near-equal `share_cost` (its examples -> a cost, e.g. the trainer's FLOPs) when that is given too.
    sft_mode iterates over prompts' SFT targets and yields chosen_* keys only. Loading (and every error about the
    data or the arguments) happens when this is called, not at the first next(). Padding uses
    tokenizer.pad_token_id, or EOS when there is none (padded positions are masked, so the value is never seen).
    For eval the trainer passes shuffle=False, n_epochs=1, n_examples=n_eval_examples: the first n examples.
    unpaired/pairs_to_unpaired: labelled completions (tokenize_normalized); kl_rows: see collate.
    """
    # argument errors before the (possibly long) loading
    _check_batch_args(batch_size=batch_size, n_epochs=n_epochs, n_examples=n_examples, rank=rank,
                      world_size=world_size, start_example=start_example, seed=seed)
    examples, _ = load_tokenized(names, tokenizer, split, max_length=max_length,
                                 max_prompt_length=max_prompt_length, sft_mode=sft_mode,
                                 truncation_mode=truncation_mode, cache_dir=cache_dir, silent=silent,
                                 unpaired=unpaired, pairs_to_unpaired=pairs_to_unpaired)
    indices = iter_batch_indices(len(examples), batch_size=batch_size, shuffle=shuffle, seed=seed,
                                 n_epochs=n_epochs, n_examples=n_examples, rank=rank, world_size=world_size,
                                 start_example=start_example, min_share=min_share or 1,
                                 sizes=None if min_share is None else [example_tokens(e) for e in examples],
                                 share_cost=None if share_cost is None else lambda idx: share_cost([examples[i] for i in idx]))
    if len(examples) < batch_size:
        raise DataError(f"datasets={names} split {split!r}: {len(examples)} examples after filtering, fewer than "
                        f"one global batch of {batch_size}; lower batch_size or add data")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return (dict(collate([examples[i] for i in idx], pad, kl_rows), example_index=torch.as_tensor(idx, dtype=torch.long))
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

