"""Where preference rows come from and what they must hold: sources -> rows, checked -> the normalized form.

Sources (SOURCES): hh, shp, se, ultrafeedback, kto_mix (Hugging Face Hub), toy, or a .jsonl/.json path ('{split}' in
it replaced) whose first row picks its shape (SHAPES): {prompt, chosen, rejected[, sft_target]} as strings (appended
verbatim: a response has its own leading space) or {role, content} lists (chat template); unpaired {prompt, completion,
label}; raw HH, SHP, UltraFeedback. Bad rows raise DataError naming file, line, field and expectation, none skipped.
preference_datasets.py tokenizes what the converters return; nothing here knows about tokens beyond the chat template.

Departures from the original DPO code:
  1. SHP and SE keep at most MAX_PAIRS_PER_PROMPT pairs per prompt; SE drops ties and holds out 1% as 'test'.
  2. hh: the prompt ends at the last "\\n\\nAssistant:" both transcripts share; rows whose histories differ are dropped.
  3. Prompts that end by cueing the reply (hh, chat, local "...\\n\\nAssistant:" rows) are cut keep_end by default.
"""

import difflib
import html
import itertools
import json
import os
import re
import warnings
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable

from config import ConfigError
from utils import hub_offline

MAX_PAIRS_PER_PROMPT = 5  # SHP and SE: comparisons grow as O(n^2) in a post's answers (the SHP authors' advice)
CHAT_ROLES = ("system", "user", "assistant", "tool")
ROLE_HINTS = {"human": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant", "ai": "assistant"}
HH_MARKER = "\n\nAssistant:"

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
    rows: list[int] = field(default_factory=list)  # each pair's row in the source (1-based), to name it in messages

    def index(self, response: str) -> int:
        if response not in self.responses:
            self.responses.append(response)
        return self.responses.index(response)

    def add_pair(self, chosen: str, rejected: str, row: int = 0) -> None:
        self.pairs.append((self.index(chosen), self.index(rejected)))
        self.rows.append(row)


def convert_hh(rows: Iterable[dict], tokenizer: Any = None) -> Converted:
    """Anthropic/hh-rlhf rows {chosen, rejected}, whole transcripts (departure 2). SFT target: the last chosen."""
    data = {}
    dropped = Counter()
    for n, row in enumerate(rows, 1):
        cut = row["chosen"].rfind(HH_MARKER, 0, len(os.path.commonprefix([row["chosen"], row["rejected"]])))
        prompt = row["chosen"][: cut + len(HH_MARKER)]
        responses = row["chosen"][len(prompt) :], row["rejected"][len(prompt) :]
        if cut == -1 or any("\n\nHuman:" in r for r in responses):  # the histories differ
            dropped["hh_prompt_mismatch"] += 1
        else:
            (entry := data.setdefault(prompt, PromptResponses(prompt))).add_pair(*responses, n)
            entry.sft_targets = [responses[0]]
    return data, dropped


def convert_shp(rows: Iterable[dict], tokenizer: Any = None) -> Converted:
    """stanfordnlp/SHP rows; a score ratio below 2 (a weak preference) is dropped, as the original. SFT: the best."""
    data = {}
    dropped = Counter()
    best = {}
    for n, row in enumerate(rows, 1):
        a, b = row["score_A"], row["score_B"]
        prompt = "\n\nHuman: " + row["history"] + HH_MARKER
        if max(a, b) < 2 * min(a, b) or max(a, b) <= 0:  # ratio >= 2 without dividing by a score of 0
            dropped["shp_score_ratio_below_2"] += 1
        elif len((entry := data.setdefault(prompt, PromptResponses(prompt))).pairs) >= MAX_PAIRS_PER_PROMPT:
            dropped["over_pair_cap"] += 1
        else:
            ref_a, ref_b = " " + row["human_ref_A"], " " + row["human_ref_B"]
            entry.add_pair(*((ref_a, ref_b) if row["labels"] == 1 else (ref_b, ref_a)), n)
            if max(a, b) > best.get(prompt, -float("inf")):  # a != b: the ratio filter passed
                best[prompt] = max(a, b)
                entry.sft_targets = [ref_a if a > b else ref_b]
    return data, dropped


def strip_html(text: str) -> str:
    """HTML -> plain text: block elements become paragraph breaks, other tags go, entities are decoded."""
    text = re.sub(r"<br\s*/?>", "\n", text, flags=re.I)
    text = re.sub(r"</?(?:p|div|pre|blockquote|ul|ol|li|table|tr|hr|h[1-6])\b[^>]*>", "\n\n", text, flags=re.I)
    text = html.unescape(re.sub(r"<[^>]*>", "", text))  # tags first: an escaped '&lt;' is text, not a tag
    return re.sub(r"\n\s*\n\s*\n+", "\n\n", text).strip()


def convert_se(rows: Iterable[dict], tokenizer: Any = None) -> Converted:
    """stack-exchange-preferences rows: every pair of answers with different scores, better first. SFT: the best."""
    data = {}
    dropped = Counter()
    for n, row in enumerate(rows, 1):
        entry = data.setdefault(p := "\n\nHuman: " + strip_html(row["question"]) + HH_MARKER, PromptResponses(p))
        answers = [(" " + strip_html(a["text"]), a["pm_score"]) for a in row["answers"]]
        for (text_i, score_i), (text_j, score_j) in itertools.combinations(answers, 2):
            if score_i == score_j:
                dropped["se_tie"] += 1  # no preference
            elif len(entry.pairs) >= MAX_PAIRS_PER_PROMPT:
                dropped["over_pair_cap"] += 1
            else:
                entry.add_pair(*((text_i, text_j) if score_i > score_j else (text_j, text_i)), n)
        entry.sft_targets = [max(answers, key=lambda answer: answer[1])[0]] if answers else entry.sft_targets
    return data, dropped


def render_chat(tokenizer: Any, history: list[dict], reply: dict) -> tuple[str, str]:
    """(history, reply) -> (prompt ending in the generation prompt, response) by the chat template, less its EOS."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"chat-form rows need a chat template; tokenizer {getattr(tokenizer, 'name_or_path', None)!r} "
            "has none (set model.chat_template=chatml or a Jinja template file, or write plain strings)"
        )
    prompt = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(history + [reply], tokenize=False)
    if not full.startswith(prompt):
        raise DataError(
            "the chat template does not render the prompt as a prefix of prompt+reply, so the reply cannot "
            f"be separated (prompt ends {prompt[-80:]!r}, conversation {full[len(prompt) - 80 :][:120]!r})"
        )
    response = full[len(prompt) :]
    eos = tokenizer.eos_token
    return prompt, response.rstrip()[: -len(eos)] if eos and response.rstrip().endswith(eos) else response


def reply_messages(prompt: list[dict], messages: list[dict]) -> list[dict]:  # the reply, if the prompt comes first
    return messages[len(prompt) :] if messages[: len(prompt)] == prompt else messages


def convert_rows(rows: Iterable[dict], tokenizer: Any = None) -> Converted:
    """Local {prompt, chosen, rejected[, sft_target]} or {prompt, completion, label} rows; message lists rendered."""
    data = {}
    for n, row in enumerate(rows, 1):
        if row is None:  # a row convert_ultrafeedback dropped, counted in its numbers
            continue
        target = "sft_target" if "sft_target" in row else "chosen"
        names = ("completion",) if "completion" in row else ("chosen", "rejected", target)
        if chat := not isinstance(row["prompt"], str):
            rendered = [render_chat(tokenizer, row["prompt"], reply_messages(row["prompt"], row[k])[0]) for k in names]
        else:
            rendered = [(row["prompt"], row[k]) for k in names]
        prompt = rendered[0][0]
        replies = [response for _, response in rendered]
        entry = data.setdefault(prompt, PromptResponses(prompt, chat=chat))
        if "completion" in row:  # a completion rated twice counts twice
            entry.rated.append((entry.index(replies[0]), bool(row["label"])))
        else:
            entry.add_pair(*replies[:2], n)
            entry.sft_targets.append(replies[2])
    return data, Counter()


def convert_ultrafeedback(rows: Iterable[dict], tokenizer: Any = None) -> Converted:
    """HuggingFaceH4/ultrafeedback_binarized rows {chosen, rejected}: whole conversations ending in the reply."""
    pairs = []
    dropped = Counter()
    for row in rows:
        if row["rejected"][:-1] != row["chosen"][:-1] or row["chosen"][-1]["role"] != "assistant":
            dropped["ultrafeedback_prompt_mismatch"] += 1
            pairs.append(None)  # still a row: later rows keep their numbers
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
        why = "could not be loaded from the Hub into"
        if hub_offline():
            why = "is not available offline (HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set), not in"
        raise DataError(
            f"dataset {hub_id!r} (split {hub_split!r}) {why} {cache_dir or 'the default cache'}. Pass datasets=[path/"
            f"to/file.jsonl] (its rows, as examples/pairs.jsonl), or pre-populate the cache: run datasets.load_dataset("
            f"{hub_id!r}, split={hub_split!r}, cache_dir={cache_dir!r}) where there is network, and copy the cache."
            f"\n({type(e).__name__}: {e})"
        ) from e
    if held_out:  # only a train split (SE): as the original, shuffled with seed 42, its first `held_out` is 'test'
        dataset = dataset.shuffle(seed=42)
        n_test = int(len(dataset) * held_out)
        dataset = dataset.select(range(n_test) if split == "test" else range(n_test, len(dataset)))
    return dataset


# --- Sources: one entry in SOURCES each; a local file's row shape one in SHAPES, every row checked -----------
@dataclass(frozen=True)
class Source:
    """Where rows come from, what they must hold and how they convert: a named source, or a local file's shape."""

    convert: Callable[[Iterable[dict], Any], Converted]
    truncation_mode: str | None = None  # keep_end when prompts cue the reply (departure 3); None: as the first one
    fetch: Callable[[str, str | None], Any] | None = None  # (split, cache_dir) -> the rows of a hub source
    path: str | None = None  # a local source's file, relative to this module, '{split}' replaced
    sample_rule: Callable[[str], bool] | None = None  # response -> whether it shows the taught behaviour
    unpaired: bool = False  # its rows are labelled completions (KTO data), not pairs
    matches: Callable[[dict], bool] = lambda row: True  # a shape: whether a file's first row has it
    fields: dict[str, tuple] | None = None  # a shape: field -> accepted types, for every row


SOURCES: dict[str, Source] = {
    "hh": Source(convert_hh, "keep_end", fetch=partial(fetch_hub, "Anthropic/hh-rlhf")),
    "shp": Source(convert_shp, "keep_start", fetch=partial(fetch_hub, "stanfordnlp/SHP")),  # as the original
    "se": Source(
        convert_se, "keep_start", fetch=partial(fetch_hub, "HuggingFaceH4/stack-exchange-preferences", held_out=0.01)
    ),
    "ultrafeedback": Source(
        convert_ultrafeedback,
        "keep_end",
        fetch=partial(
            fetch_hub, "HuggingFaceH4/ultrafeedback_binarized", splits={"train": "train_prefs", "test": "test_prefs"}
        ),
    ),
    "toy": Source(
        convert_rows,
        "keep_start",
        path="toy/data/{split}.jsonl",  # the rule: toy/make_toy.py's follows_rule
        sample_rule=lambda text: bool(az := re.sub(r"[^A-Za-z]", "", text)) and az == az.lower(),
    ),
    "kto_mix": Source(convert_rows, "keep_end", fetch=partial(fetch_hub, "trl-lib/kto-mix-14k"), unpaired=True),
}
TEXT = (str, list)  # a string, or a list of {role, content} messages
NUMBER = (int, float)
TYPE_NAMES = {str: "a string", list: "a list of {role, content} messages", bool: "a boolean", int: "a number"}
MESSAGE_FIELDS = dict(role=(str,), content=(str,))
SHP_FIELDS = dict(history=(str,), human_ref_A=(str,), human_ref_B=(str,), labels=(int,), score_A=NUMBER, score_B=NUMBER)
SHAPES = {  # named in messages; a file's first row takes the first that matches ("pair", last, matches every row)
    "unpaired": Source(
        convert_rows,
        unpaired=True,
        matches=lambda r: "completion" in r and "label" in r,
        fields=dict(prompt=TEXT, completion=TEXT, label=(bool,)),
    ),
    "SHP": Source(convert_shp, "keep_start", matches=lambda r: all(k in r for k in SHP_FIELDS), fields=SHP_FIELDS),
    "Anthropic HH": Source(
        convert_hh,
        "keep_end",
        fields=dict(chosen=(str,), rejected=(str,)),
        matches=lambda r: "prompt" not in r and isinstance(r.get("chosen"), str) and HH_MARKER in r["chosen"],
    ),
    "UltraFeedback": Source(
        convert_ultrafeedback,
        "keep_end",
        fields=dict(chosen=(list,), rejected=(list,)),
        matches=lambda r: (
            not isinstance(r.get("prompt"), list) and isinstance(r.get("chosen"), list) and len(r["chosen"]) >= 2
        ),
    ),
    "pair": Source(convert_rows, fields=dict(prompt=TEXT, chosen=TEXT, rejected=TEXT)),
}


def resolve_source(name: str, split: str) -> tuple[Source | None, Path | None]:
    """A dataset name -> (its Source, None for a local file: its first row picks one; its file, None on the hub),
    DataError for an unknown name or a local file that is not there."""
    if source := SOURCES.get(name):
        return source, Path(__file__).resolve().parent / source.path.format(split=split) if source.path else None
    if "/" in name or os.sep in name or Path(name).suffix or Path(name).exists():
        if (path := Path(name.replace("{split}", split))).suffix in (".jsonl", ".json") and path.is_file():
            return None, path
        what = "expected a .jsonl or .json file of {prompt, chosen, rejected} rows"
        why = f"no such file ({what})" if path.suffix in (".jsonl", ".json") else f"{what}, got a '{path.suffix}' file"
        raise DataError(f"{path}: {why}")
    guess = difflib.get_close_matches(name, list(SOURCES), 1, cutoff=0.5)
    raise DataError(
        f"unknown dataset '{name}': expected one of {', '.join(SOURCES)} or a path to a .jsonl/.json "
        "file" + (f"; did you mean '{guess[0]}'?" if guess else "")
    )


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
            typos = difflib.get_close_matches(name, [k for k in obj if k not in fields], 1)
            raise DataError(
                f"{where}: missing field '{name}' (expected the {kind} fields {', '.join(fields)}; found "
                f"{', '.join(map(repr, obj)) or 'none'})"
                + "".join(f"; '{k}' looks like a misspelling of '{name}'" for k in typos)
            )
        if not isinstance(obj[name], types) or isinstance(obj[name], bool) and bool not in types:
            expected = " or ".join(dict.fromkeys(TYPE_NAMES[int if t is float else t] for t in types))
            raise DataError(f"{where}: field '{name}': expected {expected}, got {_describe(obj[name])}")


def detect_shape(row: Any) -> str:
    return next(name for name, shape in SHAPES.items() if shape.matches(row)) if isinstance(row, dict) else "pair"


def check_row(row: Any, where: str, shape: str = "pair") -> None:
    """DataError unless `row` has `shape`, its fields and types, and its message lists end in one assistant reply."""
    if shape != "pair" and detect_shape(row) != shape:
        got = "fields " + ", ".join(map(repr, row)) if isinstance(row, dict) else _describe(row)
        raise DataError(
            f"{where}: the file's first row has the {shape} {{{', '.join(SHAPES[shape].fields)}}} "
            f"shape; this row does not (got {got})"
        )
    fields = SHAPES[shape].fields
    if shape == "pair" and isinstance(row, dict) and "sft_target" in row:
        fields = dict(fields, sft_target=TEXT)  # optional
    _check_fields(row, where, fields, shape)
    if shape == "SHP" and row["labels"] not in (0, 1):
        raise DataError(f"{where}: field 'labels': expected 0 or 1 (1 = human_ref_A preferred), got {row['labels']}")
    texts = [name for name in fields if fields[name] is TEXT]
    if len({type(row[name]) for name in texts}) > 1:
        shown = ", ".join(f"{name}={_describe(row[name], short=True)}" for name in texts)
        raise DataError(
            f"{where}: fields {'/'.join(texts)} mix strings and message lists ({shown}); expected all strings or all "
            "lists of {role, content} messages"
        )
    lists = [name for name in fields if isinstance(row[name], list)]  # every text field, or UltraFeedback's two
    if lists:
        _check_messages(row, where, lists)


def _check_messages(row: dict, where: str, lists: list[str]) -> None:
    """A row's message lists: known roles, a non-empty prompt, and each other list ending in one assistant reply."""
    for name, (k, message) in ((name, m) for name in lists for m in enumerate(row[name])):
        _check_fields(message, at := f"{where}: field '{name}' message {k}", MESSAGE_FIELDS, "message")
        if (role := message["role"]) not in CHAT_ROLES:
            guess = ROLE_HINTS.get(role.lower()) or next(iter(difflib.get_close_matches(role, CHAT_ROLES, 1)), None)
            raise DataError(
                f"{at}: unknown role '{role}' (expected one of {', '.join(CHAT_ROLES)})"
                + (f"; did you mean '{guess}'?" if guess else "")
            )
    if (prompt := row["prompt"] if lists[:1] == ["prompt"] else None) == []:
        raise DataError(f"{where}: field 'prompt': empty list; expected at least one {{role, content}} message")
    for name in lists[1:] if prompt else lists:
        reply = reply_messages(prompt, row[name]) if prompt else row[name]
        if prompt and len(reply) != 1:
            raise DataError(
                f"{where}: field '{name}': expected one assistant message (after the prompt's, if "
                f"repeated), got {len(reply)} messages"
            )
        if not reply or reply[-1]["role"] != "assistant":
            raise DataError(
                f"{where}: field '{name}': the last message must be the assistant's reply (role "
                "'assistant'), got " + (f"role '{reply[-1]['role']}'" if reply else "no messages")
            )


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
            raise DataError(
                f"{path}, line {line + e.lineno}: not valid JSON ({e.msg}{at} column {e.colno}); expected {expected}"
            ) from e

    path = Path(path)
    what = "{prompt, chosen, rejected}"
    try:
        text = (data := path.read_bytes()).decode("utf-8-sig")  # -sig: tolerate the byte-order mark editors write
    except UnicodeDecodeError as e:
        raise DataError(
            f"{path}, line {data[: e.start].count(10) + 1}: not valid UTF-8 (byte {data[e.start]:#04x} at "
            f"offset {e.start}); expected a UTF-8 text file"
        ) from e
    if path.suffix == ".jsonl":
        located = [
            (parse(chunk, n - 1, "one JSON object per line"), f"{path}, line {n}")
            for n, chunk in enumerate(text.split("\n"), 1)
            if chunk.strip()
        ]
    elif not isinstance(rows := parse(text, 0, f"a JSON list of {what} objects") if text.strip() else [], list):
        raise DataError(f"{path}: expected a JSON list of {what} objects, got {_describe(rows, short=True)}")
    else:
        located = [(row, f"{path}, item {n}") for n, row in enumerate(rows, 1)]
    if not located:
        raise DataError(f"{path}: no rows (the file is empty, or an empty list); expected {what} rows")
    shape = detect_shape(located[0][0])  # the first row decides; every row must then have that shape
    first = {}  # {is a chat row: 'line N' of the first such row}
    for row, where in located:
        check_row(row, where, shape)
        first.setdefault(isinstance(row.get("prompt"), list), where.rpartition(", ")[2])
    # strings are used verbatim, messages through the chat template; a warning: every row is valid, a mix may be meant
    if len(first) == 2 and SHAPES[shape].fields.get("prompt") is TEXT:
        warnings.warn(
            f"{path}: mixes plain-string rows (first: {first[False]}) and chat-message rows (first: "
            f"{first[True]}), so training sees two prompt formats; convert one kind, or if both are "
            "meant put each in a file of its own (datasets=[a,b])"
        )
    return [row for row, _ in located]


def validate_sources(names: list[str], splits: tuple[str, ...] = ("train", "test")) -> None:
    """At config time: every name known and every local file there, every problem at once (rows are checked as they
    load: a file is read once)."""
    problems = {}  # a dict: a file serving both splits is reported once
    for name, split in itertools.product(names, splits):
        try:
            resolve_source(name, split)
        except DataError as e:
            problems[str(e)] = None
    if problems:
        raise DataError("\n".join(problems))


# Chat templates by name, for tokenizers without one (model.chat_template): ChatML, as Qwen and many others use it.
CHAT_TEMPLATES = {
    "chatml": "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
}


def chat_template(template: str) -> str:
    """model.chat_template's Jinja text: one of CHAT_TEMPLATES by name, or a file's contents."""
    if template not in CHAT_TEMPLATES and not Path(template).is_file():
        raise ConfigError(
            [
                f"model.chat_template={template!r}: expected {', '.join(CHAT_TEMPLATES)} or a path to a Jinja "
                "template file"
            ]
        )
    return CHAT_TEMPLATES.get(template) or Path(template).read_text()
