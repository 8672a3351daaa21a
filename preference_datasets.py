"""Preference data: raw sources -> normalized examples -> tokenized pairs (cached on disk) -> batches.

Sources (SOURCES): hh, shp, se, ultrafeedback, kto_mix (Hugging Face Hub), toy, or a .jsonl/.json path ('{split}' in
it replaced) whose first row picks its shape (SHAPES): {prompt, chosen, rejected[, sft_target]} as strings (appended
verbatim: a response has its own leading space) or {role, content} lists (chat template); unpaired {prompt, completion,
label}; raw HH, SHP, UltraFeedback. Bad rows raise DataError naming file, line, field and expectation, none skipped.

Departures from the original DPO code:
  1. Tokenized once per run and cached on disk, not on every rank at every step.
  2. The shuffle is over pairs, a fresh permutation per epoch from (seed, epoch); resumable from start_example.
  3. Prompt and response are tokenized separately and concatenated: the prompt is a prefix by construction.
  4. BOS once, first in the prompt, when the tokenizer adds one; EOS after every response but a truncated one.
  5. Special-token text in plain text is ordinary text (the original crashed); chat-template markup is special.
  6. Pairs with an empty response or chosen == rejected (as text, or as tokens once truncated) are dropped, counted.
  7. Responses get the room left after the prompt (max_length - len(prompt)), not max_length - max_prompt_length.
  8. SHP and SE keep at most MAX_PAIRS_PER_PROMPT pairs per prompt; SE drops ties and holds out 1% as 'test'.
  9. hh: the prompt ends at the last "\\n\\nAssistant:" both transcripts share; rows whose histories differ are dropped.
 10. Prompts that end by cueing the reply (hh, chat, local "...\\n\\nAssistant:" rows) are cut keep_end by default.
 11. Each epoch drops its incomplete last global batch; n_examples runs ceil(n_examples / batch_size) steps.
"""
from __future__ import annotations

import difflib
import hashlib
import html
import itertools
import json
import os
import pickle
import re
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, NamedTuple

import numpy as np
import torch
from filelock import FileLock
from torch.nn.utils.rnn import pad_sequence

CODE_VERSION = 4  # bump when tokenization, conversion or SourceStats change, so old cache files are not reused
MAX_PAIRS_PER_PROMPT = 5  # SHP and SE: comparisons grow as O(n^2) in a post's answers (the SHP authors' advice)
CHAT_ROLES = ("system", "user", "assistant", "tool")
ROLE_HINTS = {"human": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant", "ai": "assistant"}
HH_MARKER = "\n\nAssistant:"
ENCODE_CHUNK = 512  # prompts per tokenizer call: a call per text is slow, one call for all holds every list at once
SAMPLE_GROUP = 8  # prompts per generate call during evaluation (see get_sample_batches)
Converted = tuple[dict[str, "PromptResponses"], Counter]  # a converter's ({prompt: ...}, rows dropped by reason)


class DataError(ValueError):
    """Bad data, or a source that cannot be read. The message names the file, line, field and what was expected."""


# --- The normalized form, and the converters from raw rows (pure functions: tests feed them rows by hand) ----
@dataclass
class PromptResponses:
    """One prompt, its distinct responses and their preferences: pairs (i, j), responses[i] over responses[j]."""
    prompt: str
    responses: list[str] = field(default_factory=list)
    pairs: list[tuple[int, int]] = field(default_factory=list)
    sft_targets: list[str] = field(default_factory=list)
    rated: list[tuple[int, bool]] = field(default_factory=list)  # (i, label) per unpaired row
    chat: bool = False  # rendered by a chat template: its special-token text is markup

    def index(self, response: str) -> int:
        if response not in self.responses:
            self.responses.append(response)
        return self.responses.index(response)

    def add_pair(self, chosen: str, rejected: str) -> None:
        self.pairs.append((self.index(chosen), self.index(rejected)))


def convert_hh(rows: Iterable[dict], tokenizer: Any = None) -> Converted:
    """Anthropic/hh-rlhf rows {chosen, rejected}, whole transcripts (departure 9). SFT target: the last chosen."""
    data, dropped = {}, Counter()
    for row in rows:
        cut = row["chosen"].rfind(HH_MARKER, 0, len(os.path.commonprefix([row["chosen"], row["rejected"]])))
        prompt = row["chosen"][: cut + len(HH_MARKER)]
        responses = row["chosen"][len(prompt):], row["rejected"][len(prompt):]
        if cut == -1 or any("\n\nHuman:" in r for r in responses):  # the histories differ
            dropped["hh_prompt_mismatch"] += 1
        else:
            (entry := data.setdefault(prompt, PromptResponses(prompt))).add_pair(*responses)
            entry.sft_targets = [responses[0]]
    return data, dropped


def convert_shp(rows: Iterable[dict], tokenizer: Any = None) -> Converted:
    """stanfordnlp/SHP rows; a score ratio below 2 (a weak preference) is dropped, as the original. SFT: the best."""
    data, dropped, best = {}, Counter(), {}
    for row in rows:
        (a, b), prompt = (row["score_A"], row["score_B"]), "\n\nHuman: " + row["history"] + HH_MARKER
        if max(a, b) < 2 * min(a, b) or max(a, b) <= 0:  # ratio >= 2 without dividing by a score of 0
            dropped["shp_score_ratio_below_2"] += 1
        elif len((entry := data.setdefault(prompt, PromptResponses(prompt))).pairs) >= MAX_PAIRS_PER_PROMPT:
            dropped["over_pair_cap"] += 1
        else:
            ref_a, ref_b = " " + row["human_ref_A"], " " + row["human_ref_B"]
            entry.add_pair(*((ref_a, ref_b) if row["labels"] == 1 else (ref_b, ref_a)))
            if max(a, b) > best.get(prompt, -float("inf")):  # a != b: the ratio filter passed
                best[prompt], entry.sft_targets = max(a, b), [ref_a if a > b else ref_b]
    return data, dropped


def strip_html(text: str) -> str:
    """HTML -> plain text: block elements become paragraph breaks, other tags go, entities are decoded."""
    text = re.sub(r"<br\s*/?>", "\n", text, flags=re.I)
    text = re.sub(r"</?(?:p|div|pre|blockquote|ul|ol|li|table|tr|hr|h[1-6])\b[^>]*>", "\n\n", text, flags=re.I)
    text = html.unescape(re.sub(r"<[^>]*>", "", text))  # tags first: an escaped '&lt;' is text, not a tag
    return re.sub(r"\n\s*\n\s*\n+", "\n\n", text).strip()


def convert_se(rows: Iterable[dict], tokenizer: Any = None) -> Converted:
    """stack-exchange-preferences rows: every pair of answers with different scores, better first. SFT: the best."""
    data, dropped = {}, Counter()
    for row in rows:
        entry = data.setdefault(p := "\n\nHuman: " + strip_html(row["question"]) + HH_MARKER, PromptResponses(p))
        answers = [(" " + strip_html(a["text"]), a["pm_score"]) for a in row["answers"]]
        for (text_i, score_i), (text_j, score_j) in itertools.combinations(answers, 2):
            if score_i == score_j:
                dropped["se_tie"] += 1  # no preference
            elif len(entry.pairs) >= MAX_PAIRS_PER_PROMPT:
                dropped["over_pair_cap"] += 1
            else:
                entry.add_pair(*((text_i, text_j) if score_i > score_j else (text_j, text_i)))
        entry.sft_targets = [max(answers, key=lambda answer: answer[1])[0]] if answers else entry.sft_targets
    return data, dropped


def render_chat(tokenizer: Any, history: list[dict], reply: dict) -> tuple[str, str]:
    """(history, reply) -> (prompt ending in the generation prompt, response) by the chat template, less its EOS."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"chat-form rows need a chat template; tokenizer {getattr(tokenizer, 'name_or_path', None)!r} "
                        "has none (set model.chat_template=chatml or a Jinja template file, or write plain strings)")
    prompt = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(history + [reply], tokenize=False)
    if not full.startswith(prompt):
        raise DataError("the chat template does not render the prompt as a prefix of prompt+reply, so the reply cannot "
                        f"be separated (prompt ends {prompt[-80:]!r}, conversation {full[len(prompt) - 80:][:120]!r})")
    response, eos = full[len(prompt):], tokenizer.eos_token
    return prompt, response.rstrip()[: -len(eos)] if eos and response.rstrip().endswith(eos) else response


def reply_messages(prompt: list[dict], messages: list[dict]) -> list[dict]:  # the reply, if the prompt comes first
    return messages[len(prompt):] if messages[: len(prompt)] == prompt else messages


def convert_rows(rows: Iterable[dict], tokenizer: Any = None) -> Converted:
    """Local {prompt, chosen, rejected[, sft_target]} or {prompt, completion, label} rows; message lists rendered."""
    data = {}
    for row in rows:
        target, chat = "sft_target" if "sft_target" in row else "chosen", not isinstance(row["prompt"], str)
        names = ("completion",) if "completion" in row else ("chosen", "rejected", target)
        rendered = [render_chat(tokenizer, row["prompt"], reply_messages(row["prompt"], row[n])[0]) if chat
                    else (row["prompt"], row[n]) for n in names]
        prompt, replies = rendered[0][0], [response for _, response in rendered]
        entry = data.setdefault(prompt, PromptResponses(prompt, chat=chat))
        if "completion" in row:  # a completion rated twice counts twice
            entry.rated.append((entry.index(replies[0]), bool(row["label"])))
        else:
            entry.add_pair(*replies[:2])
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


def fetch_hub(hub_id: str, split: str, cache_dir: str | None, splits: dict | None = None, held_out: float = 0):
    """datasets.load_dataset(hub_id, split), `splits` naming the hub's, with advice when it fails; held_out: 'test'."""
    import datasets  # only hub sources need it, and it is slow to import
    hub_split = "train" if held_out else (splits or {}).get(split, split)
    try:
        dataset = datasets.load_dataset(hub_id, split=hub_split, cache_dir=cache_dir)
    except Exception as e:  # the library raises ConnectionError, FileNotFoundError, ValueError, ... by case
        offline = any(os.getenv(v, "").lower() in ("1", "true", "yes", "on")
                      for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
        raise DataError(f"dataset {hub_id!r} (split {hub_split!r}) " + ("is not available offline (HF_HUB_OFFLINE or "
                        "HF_DATASETS_OFFLINE is set), not in" if offline else "could not be loaded from the Hub into")
                        + f" {cache_dir or 'the default cache'}. Pass datasets=[path/to/file.jsonl] (its rows, as"
                        f" examples/pairs.jsonl), or pre-populate the cache: run datasets.load_dataset({hub_id!r},"
                        f" split={hub_split!r}, cache_dir={cache_dir!r}) where there is network, and copy the cache."
                        f"\n({type(e).__name__}: {e})") from e
    if held_out:  # only a train split (SE): as the original, shuffled with seed 42, its first `held_out` is 'test'
        dataset, n_test = dataset.shuffle(seed=42), int(len(dataset) * held_out)
        dataset = dataset.select(range(n_test) if split == "test" else range(n_test, len(dataset)))
    return dataset


# --- Sources: one entry in SOURCES each; a local file's row shape one in SHAPES, every row checked -----------
@dataclass(frozen=True)
class Source:
    """Where rows come from, what they must hold and how they convert: a named source, or a local file's shape."""
    convert: Callable[[Iterable[dict], Any], Converted]
    truncation_mode: str | None = None  # keep_end when prompts cue the reply (departure 10); None: as the first one
    fetch: Callable[[str, str | None], Any] | None = None  # (split, cache_dir) -> the rows of a hub source
    path: str | None = None  # a local source's file, relative to this module, '{split}' replaced
    sample_rule: Callable[[str], bool] | None = None  # response -> whether it shows the taught behaviour
    unpaired: bool = False  # its rows are labelled completions (KTO data), not pairs
    matches: Callable[[dict], bool] = lambda row: True  # a shape: whether a file's first row has it
    fields: dict[str, tuple] | None = None  # a shape: field -> accepted types, for every row


SOURCES: dict[str, Source] = {
    "hh": Source(convert_hh, "keep_end", fetch=partial(fetch_hub, "Anthropic/hh-rlhf")),
    "shp": Source(convert_shp, "keep_start", fetch=partial(fetch_hub, "stanfordnlp/SHP")),  # as the original
    "se": Source(convert_se, "keep_start", fetch=partial(fetch_hub, "HuggingFaceH4/stack-exchange-preferences",
                                                         held_out=0.01)),
    "ultrafeedback": Source(convert_ultrafeedback, "keep_end", fetch=partial(
        fetch_hub, "HuggingFaceH4/ultrafeedback_binarized", splits={"train": "train_prefs", "test": "test_prefs"})),
    "toy": Source(convert_rows, "keep_start", path="toy/data/{split}.jsonl",  # the rule: toy/make_toy.py's follows_rule
                  sample_rule=lambda text: bool(az := re.sub(r"[^A-Za-z]", "", text)) and az == az.lower()),
    "kto_mix": Source(convert_rows, "keep_end", fetch=partial(fetch_hub, "trl-lib/kto-mix-14k"), unpaired=True),
}
TEXT, NUMBER = (str, list), (int, float)  # TEXT: a string, or a list of {role, content} messages
TYPE_NAMES = {str: "a string", list: "a list of {role, content} messages", bool: "a boolean", int: "a number"}
MESSAGE_FIELDS = dict(role=(str,), content=(str,))
SHP_FIELDS = dict(history=(str,), human_ref_A=(str,), human_ref_B=(str,), labels=(int,), score_A=NUMBER, score_B=NUMBER)
SHAPES = {  # named in messages; a file's first row takes the first that matches ("pair", last, matches every row)
    "unpaired": Source(convert_rows, unpaired=True, matches=lambda r: "completion" in r and "label" in r,
                       fields=dict(prompt=TEXT, completion=TEXT, label=(bool,))),
    "SHP": Source(convert_shp, "keep_start", matches=lambda r: all(k in r for k in SHP_FIELDS), fields=SHP_FIELDS),
    "Anthropic HH": Source(convert_hh, "keep_end", fields=dict(chosen=(str,), rejected=(str,)), matches=lambda r:
                           "prompt" not in r and isinstance(r.get("chosen"), str) and HH_MARKER in r["chosen"]),
    "UltraFeedback": Source(convert_ultrafeedback, "keep_end", fields=dict(chosen=(list,), rejected=(list,)),
                            matches=lambda r: not isinstance(r.get("prompt"), list)
                            and isinstance(r.get("chosen"), list) and len(r["chosen"]) >= 2),
    "pair": Source(convert_rows, fields=dict(prompt=TEXT, chosen=TEXT, rejected=TEXT)),
}


def resolve_source(name: str, split: str) -> tuple[Source | None, Path | None]:
    """A dataset name -> (its Source, None for a local file: its first row picks one; its file, None on the hub)."""
    if source := SOURCES.get(name):
        return source, Path(__file__).resolve().parent / source.path.format(split=split) if source.path else None
    if "/" in name or os.sep in name or Path(name).suffix or Path(name).exists():
        return None, Path(name.replace("{split}", split))
    guess = difflib.get_close_matches(name, list(SOURCES), 1, cutoff=0.5)
    raise DataError(f"unknown dataset '{name}': expected one of {', '.join(SOURCES)} or a path to a .jsonl/.json "
                    "file" + (f"; did you mean '{guess[0]}'?" if guess else ""))


def sample_rule(names: list[str]) -> Callable[[str], bool] | None:
    """The rule generated samples should follow, when every source in `names` shares one (the toy task); else None."""
    rules = {SOURCES[n].sample_rule if n in SOURCES else None for n in names}
    return rules.pop() if len(rules) == 1 else None


def _describe(value: Any, short: bool = False) -> str:  # 'null', 'number 42', 'string "Hi"'; short: the type only
    kind = {bool: "boolean", str: "string", list: "list", dict: "object", type(None): "null"}.get(type(value), "number")
    text = repr(value) if isinstance(value, float) else json.dumps(value, ensure_ascii=False)
    return kind if short or value is None else f"{kind} {text if len(text) <= 60 else text[:57] + '...'}"


def _check_fields(obj: Any, where: str, fields: dict[str, tuple], kind: str) -> None:  # fields: name -> types
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object with fields {', '.join(fields)}, got {_describe(obj)}")
    for name, types in fields.items():
        if name not in obj:
            typo = "".join(f"; '{k}' looks like a misspelling of '{name}'"
                           for k in difflib.get_close_matches(name, [k for k in obj if k not in fields], 1))
            raise DataError(f"{where}: missing field '{name}' (expected the {kind} fields {', '.join(fields)}; found "
                            f"{', '.join(map(repr, obj)) or 'none'}){typo}")
        if not isinstance(obj[name], types) or isinstance(obj[name], bool) and bool not in types:
            expected = " or ".join(dict.fromkeys(TYPE_NAMES[int if t is float else t] for t in types))
            raise DataError(f"{where}: field '{name}': expected {expected}, got {_describe(obj[name])}")


def detect_shape(row: Any) -> str:
    return next(name for name, shape in SHAPES.items() if shape.matches(row)) if isinstance(row, dict) else "pair"


def check_row(row: Any, where: str, shape: str = "pair") -> None:
    """DataError unless `row` has its shape's fields and types, and its message lists end in one assistant reply."""
    fields = SHAPES[shape].fields
    if shape == "pair" and isinstance(row, dict) and "sft_target" in row:
        fields = dict(fields, sft_target=TEXT)  # optional
    _check_fields(row, where, fields, shape)
    if shape == "SHP" and row["labels"] not in (0, 1):
        raise DataError(f"{where}: field 'labels': expected 0 or 1 (1 = human_ref_A preferred), got {row['labels']}")
    if len({type(row[name]) for name in fields if fields[name] is TEXT}) > 1:
        shown = ", ".join(f"{name}={_describe(row[name], short=True)}" for name in fields if fields[name] is TEXT)
        raise DataError(f"{where}: fields {'/'.join(n for n in fields if fields[n] is TEXT)} mix strings and message "
                        f"lists ({shown}); expected all strings or all lists of {{role, content}} messages")
    lists = [name for name in fields if isinstance(row[name], list)]  # every text field, or UltraFeedback's two
    for name, (k, message) in ((name, m) for name in lists for m in enumerate(row[name])):
        _check_fields(message, at := f"{where}: field '{name}' message {k}", MESSAGE_FIELDS, "message")
        if (role := message["role"]) not in CHAT_ROLES:
            guess = ROLE_HINTS.get(role.lower()) or next(iter(difflib.get_close_matches(role, CHAT_ROLES, 1)), None)
            raise DataError(f"{at}: unknown role '{role}' (expected one of {', '.join(CHAT_ROLES)})"
                            + (f"; did you mean '{guess}'?" if guess else ""))
    if (prompt := row["prompt"] if lists[:1] == ["prompt"] else None) == []:
        raise DataError(f"{where}: field 'prompt': empty list; expected at least one {{role, content}} message")
    for name in lists[1:] if prompt else lists:
        reply = reply_messages(prompt, row[name]) if prompt else row[name]
        if prompt and len(reply) != 1:
            raise DataError(f"{where}: field '{name}': expected one assistant message (after the prompt's, if "
                            f"repeated), got {len(reply)} messages")
        if not reply or reply[-1]["role"] != "assistant":
            raise DataError(f"{where}: field '{name}': the last message must be the assistant's reply (role "
                            "'assistant'), got " + (f"role '{reply[-1]['role']}'" if reply else "no messages"))


def read_rows(path: Path) -> list[dict]:
    """Every row of a local .jsonl (a JSON object per line) or .json (a JSON list) file, checked for its shape."""
    def parse(text: str, line: int, expected: str) -> Any:  # json.loads refusing duplicate fields; errors name the line
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
    path, what = Path(path), "{prompt, chosen, rejected} rows"
    if path.suffix not in (".jsonl", ".json") or not path.is_file():
        raise DataError(f"{path}: " + (f"no such file (expected a .jsonl or .json file of {what})" if path.suffix in (
            ".jsonl", ".json") else f"expected a .jsonl or .json file of {what}, got a '{path.suffix}' file"))
    try:
        text = (data := path.read_bytes()).decode("utf-8-sig")  # -sig: tolerate the byte-order mark editors write
    except UnicodeDecodeError as e:
        raise DataError(f"{path}, line {data[: e.start].count(10) + 1}: not valid UTF-8 (byte {data[e.start]:#04x} at "
                        f"offset {e.start}); expected a UTF-8 text file") from e
    if path.suffix == ".jsonl":
        located = [(parse(chunk, n - 1, "one JSON object per line"), f"{path}, line {n}")
                   for n, chunk in enumerate(text.split("\n"), 1) if chunk.strip()]
    elif not isinstance(rows := parse(text, 0, f"a JSON list of {what[:-5]} objects") if text.strip() else [], list):
        raise DataError(f"{path}: expected a JSON list of {what[:-5]} objects, got {_describe(rows, short=True)}")
    else:
        located = [(row, f"{path}, item {n}") for n, row in enumerate(rows, 1)]
    if not located:
        raise DataError(f"{path}: no rows (the file is empty, or an empty list); expected {what}")
    shape = detect_shape(located[0][0])  # the first row decides; every row must then have that shape
    for row, where in located:
        if shape != "pair" and detect_shape(row) != shape:
            got = "fields " + ", ".join(map(repr, row)) if isinstance(row, dict) else _describe(row)
            raise DataError(f"{where}: the file's first row has the {shape} {{{', '.join(SHAPES[shape].fields)}}} "
                            f"shape; this row does not (got {got})")
        check_row(row, where, shape)
    if SHAPES[shape].fields.get("prompt") is TEXT:  # strings are used verbatim, messages through the chat template
        # {is a chat row: 'line N' of the first such row} (reversed: the first row of a kind is written last)
        first = {isinstance(row["prompt"], list): where.rpartition(", ")[2] for row, where in reversed(located)}
        if len(first) == 2:  # a warning, not an error: every row is valid, and a mixed file may be meant
            warnings.warn(f"{path}: mixes plain-string rows (first: {first[False]}) and chat-message rows (first: "
                          f"{first[True]}), so training sees two prompt formats; convert one kind, or if both are "
                          "meant put each in a file of its own (datasets=[a,b])")
    return [row for row, _ in located]


def validate_sources(names: list[str], splits: tuple[str, ...] = ("train", "test"), *, unpaired: bool = False,
                     pairs_to_unpaired: bool = False) -> None:
    """At config time, no tokenizer: names, paths and local files (hub sources by name); every problem at once."""
    problems = {}  # a dict: a file serving both splits is reported once
    for name, split in itertools.product(names, splits):
        try:
            source, path = resolve_source(name, split)
            holds_unpaired = (source if path is None else SHAPES[detect_shape(read_rows(path)[0])]).unpaired
            if holds_unpaired != unpaired and not (unpaired and pairs_to_unpaired):
                raise DataError((f"dataset '{name}'" if path is None else str(path)) + (": holds unpaired {prompt, "
                    "completion, label} rows; only an unpaired loss reads them (loss=kto), this one needs pairs" if
                    holds_unpaired else ": holds pairs, but loss kto needs {prompt, completion, label} rows; set "
                    "pairs_to_unpaired=true to use each pair as a desirable and an undesirable completion"))
        except DataError as e:
            problems[str(e)] = None
    if problems:
        raise DataError("\n".join(problems))


# --- Tokenization: the normalized form -> token ids, once per run, cached on disk under a key of its inputs ----
@dataclass(frozen=True)
class LoadOptions:
    """What the tokenized examples depend on besides the source and the tokenizer (all of it in the cache key)."""
    max_length: int = 512  # prompt + response tokens of one sequence
    max_prompt_length: int = 256  # a prompt is cut to this only when prompt + longest response exceed max_length
    sft_mode: bool = False  # one example per SFT target instead of per pair
    truncation_mode: str | None = None  # keep_start | keep_end; None: each source's default (departure 10)
    unpaired: bool = False  # one example per labelled completion (KTO)
    pairs_to_unpaired: bool = False  # with unpaired: a pair gives a desirable (chosen) and an undesirable completion


class TokenizedExample(NamedTuple):
    """One pair (SFT: a target; unpaired: a completion in chosen_*, labelled `desirable`); texts untruncated."""
    source: str
    prompt: str
    chosen: str
    rejected: str | None  # None in SFT and unpaired modes
    prompt_ids: np.ndarray
    chosen_ids: np.ndarray
    rejected_ids: np.ndarray | None
    desirable: bool | None = None


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
    responses_truncated: int = 0  # cut before their EOS
    reply_cues_cut: int = 0  # prompts ending in a cue to reply, truncated keep_start: the cue is gone
    desirable: int = 0  # unpaired: completions kept per label
    undesirable: int = 0
    tokens: dict = field(default_factory=dict)  # {prompt,response}_tokens_{mean,max}
    cache: str = "off"


def tokenizer_adds_bos(tokenizer: Any) -> bool:
    """True when the tokenizer puts BOS first by default (Llama-style post-processor); then we do too."""
    return tokenizer.bos_token_id is not None and tokenizer("a")["input_ids"][:1] == [tokenizer.bos_token_id]


def truncate(prompt_ids: list[int], responses: list[list[int]], *, max_length: int, max_prompt_length: int,
             mode: str, bos_id: int | None = None) -> tuple[list[int], list[list[int]]]:
    """As the original: if prompt + the longest response exceed max_length, cut the prompt to max_prompt_length,
    keep_start or keep_end (a leading BOS kept); then cut every response to the room left (departure 7)."""
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
        for i, j in entry.pairs if opts.pairs_to_unpaired or not opts.unpaired else ():
            if i == j:  # responses are distinct: the same index is the same text
                drops["chosen_equals_rejected"] += 1
            elif opts.unpaired:  # pairs_to_unpaired: the pair's two completions, labelled by the preference
                yield from ((entry, entry.responses[i], None, True), (entry, entry.responses[j], None, False))
            else:
                yield entry, entry.responses[i], entry.responses[j], None


def tokenize_normalized(data: dict[str, PromptResponses], tokenizer: Any, *, source: str, split: str,
                        truncation_mode: str, dropped: Counter | None = None, origin: str = "", **options
                        ) -> tuple[list[TokenizedExample], SourceStats]:
    """[BOS] + ids(prompt), ids(response) + [EOS], truncated; drops counted: chosen_equals_rejected, empty_response
    (nothing to learn; length-normalised losses would divide by 0), identical_after_truncation (no preference left)."""
    opts, drops, counts = LoadOptions(**options, truncation_mode=truncation_mode), Counter(dropped), Counter()
    bos, eos, add_bos = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer_adds_bos(tokenizer)
    entries, examples = list(data.values()), []
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
            # every response keeps >= 1 token: 0 < max_prompt_length < max_length (config.py checks) leaves room
            cut, responses = truncate(prompt_ids, [b + [eos] for b in bodies], max_length=opts.max_length,
                                      max_prompt_length=opts.max_prompt_length, mode=truncation_mode, bos_id=bos)
            if len(responses) == 2 and responses[0] == responses[1]:
                drops["identical_after_truncation"] += 1
                continue
            cue = truncation_mode == "keep_start" and (entry.chat or entry.prompt.endswith(HH_MARKER))
            shortened = int(len(cut) < len(prompt_ids))  # int: a Counter's first update keeps a bool as it is
            counts.update(prompts_truncated=shortened, reply_cues_cut=shortened * cue,
                          responses_truncated=sum(len(r) <= len(b) for r, b in zip(responses, bodies)))  # lost EOS
            arrays = [np.asarray(x, dtype=np.int32) for x in (cut, *responses)] + [None]  # int32: half int64's memory
            examples.append(TokenizedExample(source, entry.prompt, chosen, rejected, *arrays[:3], label))
    lengths = {"prompt": [len(e.prompt_ids) for e in examples],
               "response": [len(r) for e in examples for r in (e.chosen_ids, e.rejected_ids) if r is not None]}
    tokens = {f"{kind}_tokens_{stat}": value for kind, x in lengths.items()
              for stat, value in (("mean", round(float(np.mean(x or [0])), 1)), ("max", max(x, default=0)))}
    return examples, SourceStats(
        source, split, "sft_targets" if opts.sft_mode else "completions" if opts.unpaired else "pairs", truncation_mode,
        origin, prompts=len({e.prompt for e in examples}), kept=len(examples), dropped=dict(sorted(drops.items())),
        desirable=sum(e.desirable is True for e in examples), undesirable=sum(e.desirable is False for e in examples),
        tokens=tokens, **counts)


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Hash of what could change token ids: the serialized tokenizer, special tokens, chat template, BOS rule."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    state = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return _sha256([type(tokenizer).__name__, state, str(getattr(tokenizer, "chat_template", None)), tokenizer_adds_bos(
        tokenizer)] + [str(getattr(tokenizer, k, None)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")])


def _sha256(value: Any) -> str:
    return hashlib.sha256(value if isinstance(value, bytes) else json.dumps(value, sort_keys=True).encode()).hexdigest()


def _plan(name: str, split: str, tokenizer: Any, tokenizer_fp: str, cache_dir: str | None, opts: LoadOptions):
    """(cache key of content, tokenizer, options and CODE_VERSION; build() that converts and tokenizes the source)."""
    source, path = resolve_source(name, split)
    if path is None:
        rows = source.fetch(split, cache_dir)
        content = origin = "hub:" + str(getattr(rows, "_fingerprint", None) or _sha256(list(rows)))
    else:
        rows, origin, content = read_rows(path), str(path), "sha256:" + _sha256(path.read_bytes())
        if source is None:
            source, origin = SHAPES[shape := detect_shape(rows[0])], f"{path} ({shape})"
    prompt = rows[0].get("prompt") if source.truncation_mode is None else None  # a local file's first prompt: does it
    cues = isinstance(prompt, list) or str(prompt).endswith(HH_MARKER)  # cue the reply? then keep_end (departure 10)
    mode = opts.truncation_mode or source.truncation_mode or ("keep_end" if cues else "keep_start")
    key = _sha256(dict(asdict(opts), truncation_mode=mode, code_version=CODE_VERSION, source=name, split=split,
                       content=content, tokenizer=tokenizer_fp, max_pairs_per_prompt=MAX_PAIRS_PER_PROMPT))

    def build() -> tuple[list[TokenizedExample], SourceStats]:
        data, dropped = source.convert(rows, tokenizer)
        return tokenize_normalized(data, tokenizer, source=name, split=split, dropped=dropped, origin=origin,
                                   **dict(asdict(opts), truncation_mode=mode))
    return key, build


def load_tokenized(names: list[str], tokenizer: Any, split: str, *, cache_dir: str | None = None,
                   silent: bool = False, **options) -> tuple[list[TokenizedExample], list[SourceStats]]:
    """Every source tokenized (cached in cache_dir), concatenated; one SourceStats each, summarised unless silent."""
    opts, loaded = LoadOptions(**options), []
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token: responses end in EOS, so set tokenizer.eos_token")
    tokenizer_fp = tokenizer_fingerprint(tokenizer) if cache_dir is not None else ""
    for name in names:
        key, build = _plan(name, split, tokenizer, tokenizer_fp, cache_dir, opts)
        loaded.append(build() if cache_dir is None else _cached(Path(cache_dir), f"{name}-{split}", key, build))
    examples, all_stats = [e for ex, _ in loaded for e in ex], [stats for _, stats in loaded]
    if not silent:
        print(dataset_summary(all_stats))
    return examples, all_stats


def _cached(cache_dir: Path, what: str, key: str, build: Callable) -> tuple[list, SourceStats]:
    file = cache_dir / "tokenized" / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', what)[-60:]}-{key[:16]}.pkl"
    file.parent.mkdir(parents=True, exist_ok=True)
    # several ranks may start at once: the first builds the file while the others wait, then all read it
    with FileLock(str(file) + ".lock"):
        if file.exists():
            payload = pickle.loads(file.read_bytes())
            return ([TokenizedExample(*row) for row in payload["examples"]],
                    SourceStats(**dict(payload["stats"], cache=f"hit {file}")))
        examples, stats = build()
        stats.cache, tmp = f"written {file}", file.with_suffix(f".tmp{os.getpid()}")
        # plain tuples and dicts: the file must not depend on where this module was imported from
        tmp.write_bytes(pickle.dumps({"examples": [tuple(e) for e in examples], "stats": asdict(stats)}))
        os.replace(tmp, file)  # atomic: a reader never sees half a file
    return examples, stats


def data_fingerprints(names: list[str], tokenizer: Any, split: str, *, cache_dir: str | None = None,
                      **options) -> dict[str, str]:
    """{source: its cache key}, untokenized: the run manifest's, so a resume or replay on other data refuses."""
    fp, opts = tokenizer_fingerprint(tokenizer), LoadOptions(**options)
    return {name: _plan(name, split, tokenizer, fp, cache_dir, opts)[0] for name in names}


def count_examples(names: list[str], tokenizer: Any, *, split: str, silent: bool = True, **load_kwargs) -> int:
    """How many examples the iterator draws from (with cache_dir set, later loads hit the cache this fills)."""
    return len(load_tokenized(names, tokenizer, split, silent=silent, **load_kwargs)[0])


def dataset_summary(stats: list[SourceStats]) -> str:
    """One block per source, every number named."""
    lines = []
    for s in stats:
        labels = f" desirable={s.desirable} undesirable={s.undesirable}" if s.unit == "completions" else ""
        lines += [f"[data] {s.source}/{s.split} ({s.origin})",
                  f"       {s.unit}_kept={s.kept} prompts={s.prompts}{labels} dropped: "
                  + (", ".join(f"{k}={v}" for k, v in s.dropped.items()) or "none"),
                  f"       prompts_truncated={s.prompts_truncated} responses_truncated={s.responses_truncated} "
                  f"truncation_mode={s.truncation_mode}",
                  "       " + " ".join(f"{k}={v}" for k, v in s.tokens.items()), f"       cache: {s.cache}"]
        lines += [f"       warning: reply_cues_cut={s.reply_cues_cut}: keep_start cut prompts' cue to reply ('\\n\\n"
                  "Assistant:' or the generation prompt): set truncation_mode=keep_end"] * bool(s.reply_cues_cut)
    return "\n".join(lines)


# --- Batches: the order (a pure function of seed, epoch and step), each rank's share, the collate -----------
def num_steps(n_items: int, *, batch_size: int, n_epochs: int | None = None, n_examples: int | None = None) -> int:
    """Global steps: min(n_epochs * (n_items // batch_size), ceil(n_examples / batch_size)) of the bounds set."""
    if n_items < batch_size:
        raise DataError(f"{n_items} examples, fewer than one global batch of {batch_size}: lower batch_size, add data")
    bounds = [n_epochs * (n_items // batch_size)] if n_epochs is not None else []
    return min(bounds + ([-(-n_examples // batch_size)] if n_examples is not None else []))


def iter_batch_indices(n_items: int, *, batch_size: int, shuffle: bool = True, seed: int = 0,
                       n_epochs: int | None = None, n_examples: int | None = None, rank: int = 0, world_size: int = 1,
                       start_example: int = 0, sizes: list[int] | None = None) -> Iterator[list[int]]:
    """This rank's item indices per global step: step s is batch s % S of epoch s // S (S = n_items // batch_size)
    in a permutation seeded by (seed, epoch); rank r takes its slice, or with `sizes` its balance_shares share."""
    total, first = num_steps(n_items, batch_size=batch_size, n_epochs=n_epochs, n_examples=n_examples), start_example
    per_epoch, k = n_items // batch_size, batch_size // world_size

    def batches():  # a generator inside: num_steps' check raises at the call, not at the first next()
        for step in range(first // batch_size, total):
            epoch, j = divmod(step, per_epoch)
            if j == 0 or step == first // batch_size:  # the order is a function of (seed, epoch): no state to resume
                order = np.random.default_rng((seed, epoch)).permutation(n_items) if shuffle else np.arange(n_items)
            items = order[j * batch_size:(j + 1) * batch_size].tolist()
            yield (balance_shares(items, [sizes[i] for i in items], world_size)[rank] if sizes is not None
                   else items[rank * k:(rank + 1) * k])
    return batches()


def balance_shares(items: list[int], sizes: list[int], n_shares: int) -> list[list[int]]:
    """`items` (`sizes` tokens each) in n_shares equal-count shares of near-equal size (FSDP waits for the heaviest):
    largest first to the lightest share with room, each share in batch order; consecutive slices where no heavier."""
    shares, room = [[] for _ in range(n_shares)], len(items) // n_shares
    for pos in sorted(range(len(items)), key=lambda p: -sizes[p]):  # sorted() is stable: ties keep batch order
        min((s for s in shares if len(s) < room), key=lambda s: sum(sizes[p] for p in s)).append(pos)
    consecutive, dealt = [list(range(s * room, (s + 1) * room)) for s in range(n_shares)], [sorted(s) for s in shares]
    best = min(consecutive, dealt, key=lambda deal: max(sum(sizes[p] for p in share) for share in deal))
    return [[items[p] for p in share] for share in best]


def collate(examples: list[TokenizedExample], pad_token_id: int | None, kl_rows: bool = False) -> dict[str, Any]:
    """The original code's batch: texts; prompt_* (B, P) left-padded for generation; {chosen,rejected}_* (B, T), labels
    -100 off the response; `desirable` (B,) if unpaired; kl_rows: kl_*, KTO's MISMATCHED rows (as the paper, HALOs and
    TRL): completion k-1 (chosen, then rejected) after prompt k, cut to the longest real row."""
    pad_token_id = 0 if pad_token_id is None else pad_token_id  # a tokenizer without one: padding is masked anyway
    def pad(rows: list[np.ndarray], value: int, side: str = "right") -> torch.Tensor:
        return pad_sequence([torch.as_tensor(r, dtype=torch.long) for r in rows], True, value, padding_side=side)

    def rows(prompts: list[np.ndarray], responses: list[np.ndarray], prefix: str) -> dict:  # labels -100 on prompts
        sequences = [np.concatenate([p, r]) for p, r in zip(prompts, responses)]
        labels = [np.concatenate([np.full(len(p), -100), r]) for p, r in zip(prompts, responses)]
        return {prefix + "input_ids": pad(sequences, pad_token_id), prefix + "labels": pad(labels, -100),
                prefix + "attention_mask": pad([np.ones_like(s) for s in sequences], 0)}
    prompts = [e.prompt_ids for e in examples]
    batch = {"prompt": [e.prompt for e in examples], "prompt_input_ids": pad(prompts, pad_token_id, "left"),
             "prompt_attention_mask": pad([np.ones_like(p) for p in prompts], 0, "left")}
    sides = ("chosen",) if examples[0].rejected is None else ("chosen", "rejected")
    for side in sides:
        texts = [getattr(e, side) for e in examples]
        batch[side], batch[side + "_response_only"] = [e.prompt + t for e, t in zip(examples, texts)], texts
        batch.update(rows(prompts, [getattr(e, side + "_ids") for e in examples], side + "_"))
    if examples[0].desirable is not None:
        batch["desirable"] = torch.tensor([bool(e.desirable) for e in examples])
    if kl_rows:
        completions = [(e.prompt_ids, getattr(e, side + "_ids")) for side in sides for e in examples]
        cap = max(len(p) + len(r) for p, r in completions)  # never longer than a real sequence of the batch
        shifted = [completions[k - 1][1][:cap - len(p)] for k, (p, _) in enumerate(completions)]
        batch.update(rows([p for p, _ in completions], shifted, "kl_"))
    return batch


def get_batch_iterator(names: list[str], tokenizer: Any, *, split: str, batch_size: int, shuffle: bool = True,
                       n_epochs: int | None = None, n_examples: int | None = None, seed: int = 0, rank: int = 0,
                       world_size: int = 1, start_example: int = 0, balance: bool = False, kl_rows: bool = False,
                       shared_prompt: bool = False, silent: bool = False, **load_kwargs) -> Iterator[dict[str, Any]]:
    """This rank's share of each global batch (iter_batch_indices), collated, with `example_index`; raises at once.
    `balance` deals by the tokens of the rows an example becomes: one row, its prompt once, with `shared_prompt`."""
    examples, _ = load_tokenized(names, tokenizer, split, silent=silent, **load_kwargs)

    def tokens(e: TokenizedExample) -> int:
        responses = [len(r) for r in (e.chosen_ids, e.rejected_ids) if r is not None]
        return len(e.prompt_ids) * (1 if shared_prompt else len(responses)) + sum(responses)
    sizes = [tokens(e) for e in examples] if balance else None
    return (dict(collate([examples[i] for i in idx], tokenizer.pad_token_id, kl_rows),
                 example_index=torch.as_tensor(idx))
            for idx in iter_batch_indices(len(examples), batch_size=batch_size, shuffle=shuffle, seed=seed,
                                          n_epochs=n_epochs, n_examples=n_examples, rank=rank, world_size=world_size,
                                          start_example=start_example, sizes=sizes))  # called now: errors raise here


def get_eval_batches(names: list[str], tokenizer: Any, *, batch_size: int, n_examples: int, rank: int = 0,
                     world_size: int = 1, kl_rows: bool = False, silent: bool = False, **load_kwargs) -> list[dict]:
    """This rank's shares of the first n_examples test pairs in global batches, the last filled with repeats marked
    `valid` False (B,): every rank runs the same forwards (FSDP), and the mean counts each pair once."""
    examples, _ = load_tokenized(names, tokenizer, "test", silent=silent, **load_kwargs)
    n, per_rank, batches = min(n_examples, len(examples)), batch_size // world_size, []
    for start in range(0, n, batch_size):
        positions = range(start + rank * per_rank, start + (rank + 1) * per_rank)  # past n: the batch's first pair
        idx, valid = [p if p < n else start for p in positions], [p < n for p in positions]
        batches.append(dict(collate([examples[i] for i in idx], tokenizer.pad_token_id, kl_rows),
                            example_index=torch.as_tensor(idx, dtype=torch.long), valid=torch.tensor(valid)))
    return batches


def get_sample_batches(names: list[str], tokenizer: Any, *, n_examples: int, rank: int = 0, world_size: int = 1,
                       silent: bool = False, **load_kwargs) -> list[tuple[int, dict]]:
    """(group, batch): groups of SAMPLE_GROUP of the first n_examples distinct test prompts, round-robin over the
    ranks, each generated with its own seed (world-size independent); repeats that even out the ranks' counts have
    group -1."""
    firsts = {}
    for example in load_tokenized(names, tokenizer, "test", silent=silent, **load_kwargs)[0]:
        firsts.setdefault(example.prompt, example)  # a prompt with several pairs is sampled (and counted) once
    examples = list(firsts.values())[:n_examples]
    groups = [examples[start:start + SAMPLE_GROUP] for start in range(0, len(examples), SAMPLE_GROUP)]
    mine = (list(range(len(groups)))[rank::world_size] + [-1] * world_size)[:-(-len(groups) // world_size)]
    return [(g, collate(groups[max(g, 0)], tokenizer.pad_token_id)) for g in mine]
