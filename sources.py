"""Where preference rows come from and what they must hold: a dataset entry -> its rows, checked -> normalized form.

datasets=[ENTRY, ...], an ENTRY a NAME and its options, joined by ':' (a YAML list of strings, no spaces):
  NAME             hh, shp, se, ultrafeedback, kto_mix (Hub sources, SOURCES) or toy; a .jsonl, .json, .parquet or
                   .arrow file ('{split}' in its path becomes train or test); a folder from save_to_disk or laid out
                   as a Hub repo (data/train-*.parquet, data/test-*.parquet); a Hub id org/name (load_dataset; offline
                   from its cache, <local_dirs>/datasets).
  N or F           N pairs, or the fraction F (0 < F <= 1), of the source's training pairs, drawn with `seed`: in the
                   summary (pairs kept, then taken) and in the run manifest's data fingerprint.
  config=C         the Hub dataset's configuration (a Hub-repo folder: C/ instead of data/).
  train=S, test=S  the splits read as train and test (train_prefs, test_prefs); test=F: no test split, the fraction
                   F of train held out as se's 1% is (Dataset.shuffle(seed=42)'s first F).
e.g. datasets=[hh:0.5,toy:1000], datasets=[HuggingFaceH4/ultrafeedback_binarized:train=train_prefs:test=test_prefs]

Rows (SHAPES: the first row picks one, every row is checked; DataError names the file, row, field and expectation):
{prompt, chosen, rejected[, sft_target]}, strings (appended verbatim: a response has its own leading space) or
{role, content} lists (chat template); {chosen, rejected} alone, conversations or HH transcripts whose prompt is
implicit (implicit_prompt); unpaired {prompt, completion, label}. A row is an example, in the order read.

Departures from the original DPO code:
  1. SHP and SE keep at most MAX_PAIRS_PER_PROMPT pairs per prompt; SE drops ties and holds out 1% as 'test'.
  2. An implicit prompt ends at the last turn both share (hh: "\\n\\nAssistant:"); other histories are dropped.
  3. Prompts that end by cueing the reply (hh, chat, "...\\n\\nAssistant:" rows) are cut keep_end by default.
"""

import difflib
import hashlib
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
from typing import Any, Callable, Iterable, Iterator, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from config import ConfigError
from utils import file_sha256, hub_offline

MAX_PAIRS_PER_PROMPT = 5  # SHP and SE: comparisons grow as O(n^2) in a post's answers (the SHP authors' advice)
CHAT_ROLES = ("system", "user", "assistant", "tool")
ROLE_HINTS = {"human": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant", "ai": "assistant"}
HH_MARKER = "\n\nAssistant:"

ROW_CHUNK = 2048  # rows per batch read from a parquet or Arrow file or the Hub: whole files are never held
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # org/name, as the Hub spells dataset ids
# A converter's (entries, rows dropped by reason): a lazy converter counts the drops as its entries are read
Converted = tuple[Iterable["PromptResponses"], Counter]


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


def implicit_prompt(chosen: str | list, rejected: str | list) -> tuple | None:
    """(prompt, chosen reply, rejected reply) of a row without a prompt: the turns both open with, up to the reply.
    Messages: the messages they share, each keeping at least its last; None unless both replies are one assistant
    message after a prompt of one message or more. Text: up to the last "\\n\\nAssistant:" within the text they
    share; None without one, or when a reply holds a "\\n\\nHuman:" turn (the histories differ)."""
    if isinstance(chosen, list):
        n = 0
        while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
            n += 1
        replies = chosen[n:], rejected[n:]
        if n == 0 or any(len(reply) != 1 or reply[0]["role"] != "assistant" for reply in replies):
            return None
        return chosen[:n], *replies
    cut = chosen.rfind(HH_MARKER, 0, len(os.path.commonprefix([chosen, rejected])))
    prompt = chosen[: cut + len(HH_MARKER)]
    replies = chosen[len(prompt) :], rejected[len(prompt) :]
    if cut == -1 or any("\n\nHuman:" in reply for reply in replies):
        return None
    return prompt, *replies


def convert_hh(rows: Iterable[dict], tokenizer: Any = None) -> Converted:
    """Anthropic/hh-rlhf rows {chosen, rejected}, whole transcripts: the implicit prompt (departure 2), pairs grouped
    by prompt as the original. SFT target: the last chosen."""
    data = {}
    dropped = Counter()
    for n, row in enumerate(rows, 1):
        found = implicit_prompt(row["chosen"], row["rejected"])
        if found is None:
            dropped["no_shared_prompt"] += 1
            continue
        prompt, chosen, rejected = found
        entry = data.setdefault(prompt, PromptResponses(prompt))
        entry.add_pair(chosen, rejected, n)
        entry.sft_targets = [chosen]
    return data.values(), dropped


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
    return data.values(), dropped


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
    return data.values(), dropped


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


def convert_rows(rows: Iterable[dict | None], tokenizer: Any = None) -> Converted:
    """Checked {prompt, chosen, rejected[, sft_target]} or {prompt, completion, label} rows, an entry each, in order and
    as they are read; message lists rendered by the chat template. None: a row a converter before it dropped."""

    def entries() -> Iterator[PromptResponses]:
        for n, row in enumerate(rows, 1):  # n: the row in the source, to name it
            if row is None:
                continue
            if "completion" in row:
                replies = [row["completion"]]
            else:
                replies = [row["chosen"], row["rejected"], row.get("sft_target", row["chosen"])]
            prompt = row["prompt"]
            chat = isinstance(prompt, list)
            if chat:
                rendered = [render_chat(tokenizer, prompt, reply_messages(prompt, reply)[0]) for reply in replies]
                prompt = rendered[0][0]
                replies = [response for _, response in rendered]
            entry = PromptResponses(prompt, chat=chat)
            if "completion" in row:
                entry.rated.append((entry.index(replies[0]), bool(row["label"])))
            else:
                entry.add_pair(replies[0], replies[1], n)
                entry.sft_targets.append(replies[2])
            yield entry

    return entries(), Counter()


def convert_implicit(rows: Iterable[dict], tokenizer: Any = None) -> Converted:
    """{chosen, rejected} rows whose prompt is implicit (implicit_prompt), as convert_rows' rows; a row whose chosen and
    rejected share no prompt is dropped (no_shared_prompt). A string 'prompt' beside message lists is not read."""
    dropped = Counter()

    def explicit() -> Iterator[dict | None]:
        for row in rows:
            found = implicit_prompt(row["chosen"], row["rejected"])
            if found is None:
                dropped["no_shared_prompt"] += 1
            yield None if found is None else dict(zip(("prompt", "chosen", "rejected"), found))

    return convert_rows(explicit(), tokenizer)[0], dropped


def fetch_hub(hub_id: str, split: str, cache_dir: str | None, splits: dict | None = None, held_out: float = 0, **kw):
    """datasets.load_dataset(hub_id, split, **kw) (kw: its `name`, the configuration), `splits` naming the Hub's, with
    advice when it fails; held_out: the fraction of train that is 'test'."""
    import datasets  # only Hub sources need it, and it is slow to import

    splits = {"train": "train", "test": "test", **(splits or {})}
    hub_split = splits["train" if held_out else split]
    try:
        dataset = datasets.load_dataset(hub_id, split=hub_split, cache_dir=cache_dir, **kw)
    except Exception as e:  # the library raises ConnectionError, FileNotFoundError, ValueError, ... by case
        why = "could not be loaded from the Hub into"
        if hub_offline():
            why = "is not available offline (HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set), not in"
        raise DataError(
            f"dataset {hub_id!r} (split {hub_split!r}) {why} {cache_dir or 'the default cache'}. Pass datasets=[path/"
            f"to/file.jsonl] (its rows, as examples/pairs.jsonl), or pre-populate the cache: run datasets.load_dataset("
            f"{hub_id!r}, split={hub_split!r}, cache_dir={cache_dir!r}) where there is network, and copy the cache. "
            f"Other splits: {hub_id}:train=S:test=S, or hold out {hub_id}:test=0.05.\n({type(e).__name__}: {e})"
        ) from e
    if held_out:  # as the original's SE: shuffled with seed 42, the first `held_out` of train is 'test'
        dataset = dataset.shuffle(seed=42)
        n_test = int(len(dataset) * held_out)
        dataset = dataset.select(range(n_test) if split == "test" else range(n_test, len(dataset)))
    return dataset


# --- Sources: one entry in SOURCES each; a row shape one in SHAPES, every row of a file or Hub id checked --------
@dataclass(frozen=True)
class Source:
    """Where rows come from, what they must hold and how they convert: a named source, or a row shape."""

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
        convert_implicit,
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
TYPE_NAMES = {str: "a string", list: "a list of {role, content} messages", bool: "a boolean", int: "a number"}
MESSAGE_FIELDS = dict(role=(str,), content=(str,))


def _implicit_shape(row: dict) -> bool:  # whole conversations (a string prompt beside them unread), or transcripts
    if isinstance(row.get("chosen"), list):
        return len(row["chosen"]) >= 2 and not isinstance(row.get("prompt"), list)
    return "prompt" not in row and isinstance(row.get("chosen"), str) and HH_MARKER in row["chosen"]


SHAPES = {  # named in messages; a file's first row takes the first that matches ("pair", last, matches every row)
    "unpaired": Source(
        convert_rows,
        unpaired=True,
        matches=lambda r: "completion" in r and "label" in r,
        fields=dict(prompt=TEXT, completion=TEXT, label=(bool,)),
    ),
    "implicit prompt": Source(
        convert_implicit, "keep_end", matches=_implicit_shape, fields=dict(chosen=TEXT, rejected=TEXT)
    ),
    "pair": Source(convert_rows, fields=dict(prompt=TEXT, chosen=TEXT, rejected=TEXT)),
}


class Spec(NamedTuple):
    """One entry of datasets=[...], NAME[:N or F][:config=C][:train=S][:test=S or F] (the module docstring)."""

    name: str
    source: str  # the entry less its take: what its rows, and so their cache entry, depend on
    take: int | float | None = None
    config: str | None = None
    train: str = "train"
    test: str = "test"
    held_out: float = 0.0


def parse_spec(text: str) -> Spec:
    """datasets=[...]'s entry -> Spec; DataError naming the entry and its part that does not read."""
    if ":" in text and Path(text.replace("{split}", "train")).exists():  # a local path with a ':' in it
        return Spec(text, text)
    name, *parts = text.split(":")
    given = {}
    for part in parts:
        key, _, value = part.partition("=") if "=" in part else ("take", "=", part)
        if key not in ("take", "config", "train", "test") or not value or key in given or not name:
            raise _bad_entry(text, part if name else text, GRAMMAR)
        given[key] = value
    source = ":".join([name] + [f"{key}={value}" for key, value in given.items() if key != "take"])
    raw = given.pop("take", None)
    take = None
    if raw is not None:
        take = float(raw) if re.fullmatch(r"\d*\.\d+", raw) else int(raw) if raw.isdigit() else 0
        if not (take >= 1 if isinstance(take, int) else 0 < take <= 1):
            raise _bad_entry(text, raw, "N >= 1 pairs or a fraction 0 < F <= 1")
    held_out = 0.0
    if re.fullmatch(r"\d*\.\d+", given.get("test", "")):  # test=F, not a split's name
        held_out = float(given.pop("test"))
        if not 0 < held_out < 1:
            raise _bad_entry(text, f"test={held_out}", "a split or a fraction 0 < F < 1 of train")
    return Spec(name, source, take, held_out=held_out, **given)


GRAMMAR = "NAME[:N or :F][:config=C][:train=SPLIT][:test=SPLIT or :test=F], each option once"


def _bad_entry(text: str, part: str, expected: str) -> DataError:
    guess = difflib.get_close_matches(part.partition("=")[0], ["config", "train", "test"], 1) if "=" in part else []
    hint = "".join(f"; did you mean '{g}='?" for g in guess)
    return DataError(f"datasets: {text!r}: cannot read {part!r}: expected {expected}{hint}")


def resolve_source(spec: Spec, split: str) -> tuple[Source | None, list[Path], Callable[[str | None], Any] | None]:
    """(its Source, None: the first row picks one of SHAPES; the local files holding the split's rows; or the Hub
    fetch, cache_dir -> a datasets.Dataset). DataError: an unknown name, a missing file, an option that cannot apply."""
    named = spec.config is not None or spec.train != "train" or spec.test != "test"  # the splits named
    if source := SOURCES.get(spec.name):
        if named or spec.held_out:
            raise DataError(f"datasets: {spec.source!r}: {spec.name} has its splits; it takes a count or fraction only")
        if source.path:
            return source, [Path(__file__).resolve().parent / source.path.format(split=split)], None
        return source, [], partial(source.fetch, split)
    path = Path(spec.name.replace("{split}", split))
    if path.is_dir():
        return None, _folder_files(path, spec, split), None
    if path.suffix in READERS and path.is_file():
        if named:
            raise DataError(f"datasets: {spec.source!r}: a file holds one split ('{{split}}' in its path names two)")
        return None, [path], None
    if HUB_ID.fullmatch(spec.name) and path.suffix not in READERS:
        splits = {"train": spec.train, "test": spec.test}
        config = {"name": spec.config} if spec.config else {}
        return None, [], partial(fetch_hub, spec.name, split, splits=splits, held_out=spec.held_out, **config)
    raise _not_found(spec.name, path)


def _not_found(name: str, path: Path) -> DataError:
    what = f"a {', '.join(READERS)} file of {{prompt, chosen, rejected}} rows, a folder, or a Hub id org/name"
    if path.suffix in READERS or path.parent != Path("."):  # a path, not a name
        why = f"got a '{path.suffix}' file" if path.is_file() else "no such file or folder"
        return DataError(f"{path}: {why} (expected {what})")
    guess = "".join(f"; did you mean '{g}'?" for g in difflib.get_close_matches(name, list(SOURCES), 1, cutoff=0.5))
    return DataError(f"unknown dataset '{name}': expected one of {', '.join(SOURCES)}, or {what}{guess}")


def _folder_files(folder: Path, spec: Spec, split: str) -> list[Path]:
    """The files of a folder's split: save_to_disk's (dataset_dict.json: a folder per split; state.json: one
    dataset, both splits), else a Hub repo's data/<split>-*.parquet (config=C: C/<split>-*.parquet)."""
    name = spec.test if split == "test" and not spec.held_out else spec.train
    if (folder / "dataset_dict.json").is_file():
        names = json.loads((folder / "dataset_dict.json").read_text())["splits"]
        if name not in names:
            raise DataError(
                f"{folder}: no split {name!r} (it holds {', '.join(names)}): name one, :{split}=SPLIT"
                + (", or hold out a fraction of train, :test=0.05" if split == "test" else "")
            )
        folder = folder / name
    if (folder / "state.json").is_file():
        return [folder / f["filename"] for f in json.loads((folder / "state.json").read_text())["_data_files"]]
    files = sorted((folder / (spec.config or "data")).glob(f"{name}-*.parquet"))
    if not files:
        raise DataError(
            f"{folder}: no {spec.config or 'data'}/{name}-*.parquet (a Hub repo's files) and no save_to_disk "
            "dataset_dict.json or state.json" + (": name the split, or hold out :test=0.05" if split == "test" else "")
        )
    return files


class Rows(NamedTuple):
    """One split of a dataset entry, not read yet: its Source (None: the first row picks one of SHAPES), what the
    rows are (a cache key's part: the files' sha256, or the Hub dataset's fingerprint), where, and a reader."""

    source: Source | None
    content: str
    origin: str
    read: Callable[[], Iterator[dict]]  # the rows, checked as they are read (a named Hub source's: as they are)


def open_source(spec: Spec, split: str, cache_dir: str | None) -> Rows:
    """The split's Rows: local files hashed (streamed), a Hub dataset loaded (memory-mapped from its cache)."""
    source, files, fetch = resolve_source(spec, split)
    if fetch is None:
        content = "sha256:" + "".join(file_sha256(f) for f in files)
        origin = str(files[0] if len(files) == 1 else files[0].parent)
        return Rows(source, content, origin, partial(read_rows, files, split, spec.held_out))
    dataset = fetch(cache_dir)
    fingerprint = getattr(dataset, "_fingerprint", None)
    origin = "hub:" + (fingerprint or hashlib.sha256(json.dumps(list(dataset), sort_keys=True).encode()).hexdigest())
    if source:  # a named source's converter reads its rows as they come
        return Rows(source, origin, origin, lambda: iter(dataset))
    return Rows(None, origin, origin, partial(_hub_rows, dataset, f"dataset {spec.name!r} (split {split})"))


def _hub_rows(dataset: Any, where: str) -> Iterator[dict]:  # a Hub dataset's rows, checked, a batch at a time
    tables = dataset.with_format("arrow").iter(ROW_CHUNK)
    return _checked(_batch_rows((batch for table in tables for batch in table.to_batches()), where), where)


def local_files(name: str, split: str) -> list[Path]:
    """The local files a datasets=[...] entry reads for `split`; none for the Hub."""
    return resolve_source(parse_spec(name), split)[1]


def on_hub(name: str) -> bool:
    """Whether a datasets=[...] entry reads the Hugging Face Hub (a named Hub source or an id); False if it is bad."""
    try:
        return resolve_source(parse_spec(name), "train")[2] is not None
    except DataError:
        return False


def serves_both_splits(name: str) -> bool:
    """Whether training and evaluation would read the same rows: a local file or dataset without splits."""
    spec = parse_spec(name)
    files = resolve_source(spec, "train")[1]
    return bool(files) and files == resolve_source(spec, "test")[1] and not spec.held_out


def sample_rule(names: list[str]) -> Callable[[str], bool] | None:
    """The rule generated samples should follow, when every source in `names` shares one (the toy task); else None."""
    named = [parse_spec(name).name for name in names]
    rules = {SOURCES[name].sample_rule if name in SOURCES else None for name in named}
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
    texts = [name for name in fields if fields[name] is TEXT]
    if len({type(row[name]) for name in texts}) > 1:
        shown = ", ".join(f"{name}={_describe(row[name], short=True)}" for name in texts)
        raise DataError(
            f"{where}: fields {'/'.join(texts)} mix strings and message lists ({shown}); expected all strings or all "
            "lists of {role, content} messages"
        )
    lists = [name for name in fields if isinstance(row[name], list)]  # every text field, or an implicit prompt's two
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


def read_rows(files: list[Path], split: str = "train", held_out: float = 0.0) -> Iterator[dict]:
    """Every row of local files (READERS: .jsonl, .json, .parquet, .arrow), in order, checked as it is read, one
    batch at a time; held_out: the rows test=F holds out (split 'test') or the others, drawn as fetch_hub draws."""
    located = itertools.chain.from_iterable(READERS[file.suffix](file) for file in files)
    if not held_out:
        return _checked(located, files[0])
    n = sum(1 for _ in itertools.chain.from_iterable(READERS[file.suffix](file) for file in files))
    is_test = np.zeros(n, bool)
    is_test[np.random.default_rng(42).permutation(n)[: int(n * held_out)]] = True  # Dataset.shuffle(seed=42)'s draw
    return _checked((pair for pair, test in zip(located, is_test) if test == (split == "test")), files[0])


def _checked(located: Iterable[tuple[Any, str]], what: Any) -> Iterator[dict]:
    """The rows of (row, where) pairs, each checked against the shape of the first, a batch of ROW_CHUNK before its
    rows go on (a small file's rows all, so a bad row is named before any is converted); DataError if there is none."""
    shape = None
    first = {}  # {is a chat row: where the first such row is}
    located = iter(located)
    while batch := list(itertools.islice(located, ROW_CHUNK)):
        for row, where in batch:
            shape = shape or detect_shape(row)  # the first row decides; every row must then have that shape
            check_row(row, where, shape)
            first.setdefault(isinstance(row.get("prompt"), list), where.rpartition(", ")[2])
        yield from (row for row, _ in batch)
    if shape is None:
        raise DataError(
            f"{what}: no rows (the file is empty, or an empty list); expected {{prompt, chosen, rejected}} rows"
        )
    # strings are used verbatim, messages through the chat template; a warning: every row is valid, a mix may be meant
    if len(first) == 2 and SHAPES[shape].fields.get("prompt") is TEXT:
        warnings.warn(
            f"{what}: mixes plain-string rows (first: {first[False]}) and chat-message rows (first: "
            f"{first[True]}), so training sees two prompt formats; convert one kind, or if both are "
            "meant put each in a file of its own (datasets=[a,b])"
        )


def _jsonl(path: Path) -> Iterator[tuple[Any, str]]:  # a JSON object a line, read a line at a time
    with open(path, "rb") as f:
        offset = 0
        for n, line in enumerate(f, 1):
            text = _decode(path, line.removesuffix(b"\n"), n, offset)
            offset += len(line)
            if text.strip():
                yield _parse(path, text, n, "one JSON object per line"), f"{path}, line {n}"


def _json(path: Path) -> Iterator[tuple[Any, str]]:  # a JSON list, read whole
    what = "a JSON list of {prompt, chosen, rejected} objects"
    text = _decode(path, path.read_bytes())
    rows = _parse(path, text, 1, what) if text.strip() else []
    if not isinstance(rows, list):
        raise DataError(f"{path}: expected {what}, got {_describe(rows, short=True)}")
    return ((row, f"{path}, item {n}") for n, row in enumerate(rows, 1))


def _parquet(path: Path) -> Iterator[tuple[Any, str]]:
    return _batch_rows(pq.ParquetFile(path).iter_batches(ROW_CHUNK), path)


def _arrow(path: Path) -> Iterator[tuple[Any, str]]:  # Arrow's file format, or the stream format datasets writes
    try:
        reader = pa.ipc.open_file(pa.OSFile(str(path)))
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
    except pa.ArrowInvalid:
        batches = pa.ipc.open_stream(pa.OSFile(str(path)))
    return _batch_rows(batches, path)


READERS = {".jsonl": _jsonl, ".json": _json, ".parquet": _parquet, ".arrow": _arrow}  # a local file's suffix -> rows


def _batch_rows(batches: Iterable[pa.RecordBatch], where: Any) -> Iterator[tuple[dict, str]]:
    n = 0
    for batch in batches:
        for row in batch.to_pylist():
            n += 1
            yield row, f"{where}, row {n}"


def _decode(path: Path, data: bytes, line: int = 1, offset: int = 0) -> str:
    """UTF-8 text (a byte-order mark at the start tolerated: editors write one); DataError naming line and byte."""
    try:
        return data.decode("utf-8-sig" if offset == 0 else "utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{path}, line {line + data[: e.start].count(10)}: not valid UTF-8 (byte {data[e.start]:#04x} at "
            f"offset {offset + e.start}); expected a UTF-8 text file"
        ) from e


def _parse(path: Path, text: str, line: int, expected: str) -> Any:
    """json.loads refusing duplicate fields; errors name the line."""

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
        for key in (key for key, n in Counter(k for k, _ in pairs).items() if n > 1):
            raise DataError(f"{path}, line {line}: duplicate field '{key}' in one object")
        return dict(pairs)

    try:
        return json.loads(text, object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as e:
        at = "" if e.msg.endswith(" at") else " at"  # "Unterminated string starting at" has its own
        raise DataError(
            f"{path}, line {line + e.lineno - 1}: not valid JSON ({e.msg}{at} column {e.colno}); expected {expected}"
        ) from e


def validate_sources(names: list[str], splits: tuple[str, ...] = ("train", "test")) -> None:
    """At config time: every entry readable, every name known and every local file there, every problem at once
    (rows are checked as they load: a file is read once)."""
    problems = {}  # a dict: a file serving both splits is reported once
    for name, split in itertools.product(names, splits):
        try:
            resolve_source(parse_spec(name), split)
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
