"""Preference data: normalized examples (sources.py) -> tokenized pairs (Arrow, cached on disk) -> batches.

Departures from the original DPO code:
  1. Tokenized once, into Arrow files the ranks memory-map (one copy per node); the original tokenized on every rank.
  2. The shuffle is over pairs, a fresh permutation per epoch from (seed, epoch); resumable from start_example.
  3. Prompt and response are tokenized separately and concatenated: the prompt is a prefix by construction.
  4. BOS once, first in the prompt, when the tokenizer adds one; EOS after every response but a truncated one.
  5. Special-token text in plain text is ordinary text (the original crashed); chat-template markup is special.
  6. Empty responses and, unless drop_identical_pairs=false, chosen == rejected (text, or tokens once cut) are dropped.
  7. Responses get the room left after the prompt (max_length - len(prompt)), not max_length - max_prompt_length.
  8. Each epoch drops its incomplete last global batch; n_examples runs ceil(n_examples / batch_size) steps.
"""

import errno
import hashlib
import itertools
import json
import os
import re
import secrets
import shutil
import socket
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, NamedTuple

import numpy as np
import pyarrow as pa  # not `datasets`: the same Arrow files without its second of import time on every run
import torch
from filelock import FileLock
from torch.nn.utils.rnn import pad_sequence

from sources import HH_MARKER, MAX_PAIRS_PER_PROMPT, SHAPES, DataError, PromptResponses, Spec, detect_shape
from sources import open_source, parse_spec
from utils import first_usable_dir

CODE_VERSION = 6  # bump when tokenization, conversion or SourceStats change, so old cache entries are not reused
ENCODE_CHUNK = 2048  # prompts per tokenizer call: a call per text is slow, one call for all holds every list at once
SAMPLE_GROUP = 8  # prompts per generate call during evaluation (see get_sample_batches)


# --- Tokenization: the normalized form -> token ids in Arrow columns, cached on disk under a key of its inputs --
@dataclass(frozen=True)
class LoadOptions:
    """What the tokenized examples depend on besides the source and the tokenizer (all of it in the cache key)."""

    max_length: int = 512  # prompt + response tokens of one sequence
    max_prompt_length: int = 256  # a prompt is cut to this only when prompt + longest response exceed max_length
    sft_mode: bool = False  # one example per SFT target instead of per pair
    truncation_mode: str | None = None  # keep_start | keep_end; None: each source's default (sources.py, departure 3)
    unpaired: bool = False  # one example per labelled completion (KTO)
    pairs_to_unpaired: bool = False  # with unpaired: a pair gives a desirable (chosen) and an undesirable completion
    drop_identical_pairs: bool = True  # chosen == rejected, as text or once truncated: no signal, so not trained on


class TokenizedExample(NamedTuple):
    """One pair (SFT: a target; unpaired: a completion in chosen_*, labelled `desirable`); texts untruncated."""

    prompt: str
    chosen: str
    rejected: str | None  # None in SFT and unpaired modes
    prompt_ids: np.ndarray
    chosen_ids: np.ndarray
    rejected_ids: np.ndarray | None
    desirable: bool | None = None


# The Arrow columns of a tokenized split, one per TokenizedExample field (int32 ids: half int64's bytes)
SCHEMA = pa.schema(
    (name, pa.list_(pa.int32()) if name.endswith("_ids") else pa.bool_() if name == "desirable" else pa.string())
    for name in TokenizedExample._fields
)


@dataclass
class SourceStats:
    """What loading one source did; dataset_summary() prints every number."""

    source: str
    split: str
    unit: str = "pairs"  # 'pairs', 'sft_targets' or 'completions'
    truncation_mode: str | None = None
    origin: str = ""  # the local file (and its shape), or "hub:<fingerprint>"
    prompts: int = 0
    kept: int = 0
    taken: int | None = None  # drawn from the kept examples by the entry's N or F (training split)
    dropped: dict = field(default_factory=dict)
    prompts_truncated: int = 0
    responses_truncated: int = 0  # cut before their EOS
    reply_cues_cut: int = 0  # prompts ending in a cue to reply, truncated keep_start: the cue is gone
    desirable: int = 0  # unpaired: completions kept per label
    undesirable: int = 0
    tokens: dict = field(default_factory=dict)  # {prompt,response}_tokens_{mean,max}, chosen_rejected_length_ratio
    no_signal: dict = field(default_factory=dict)  # reason -> [pairs, their first rows]: chosen == rejected
    cache: str = "off"


@dataclass
class Split:
    """One split's tokenized examples as Arrow columns (memory-mapped from the cache: the ranks of a node share one
    copy), with a SourceStats and a cache key per source. Loaded once per rank and handed on; a batch reads its rows."""

    table: pa.Table
    stats: list[SourceStats]
    keys: dict[str, str]  # {source: cache key}: the run manifest's fingerprints
    lengths: np.ndarray  # (3, len): prompt, chosen, rejected tokens per example (0: none), kept out of the mapped file
    index: np.ndarray | None = None  # the table's row of each example, where entries drew from their sources

    def __len__(self) -> int:
        return self.table.num_rows if self.index is None else len(self.index)

    def __getitem__(self, i: int | slice) -> TokenizedExample | list[TokenizedExample]:  # iter() stops at IndexError
        return self.rows(range(len(self))[i]) if isinstance(i, slice) else self.rows([i])[0]

    def rows(self, indices: Iterable[int]) -> list[TokenizedExample]:
        """The examples at `indices`, each a one-row slice (take() on a chunked table copies whole columns)."""
        if self.index is not None:
            indices = self.index[list(indices)]
        rows = (self.table.slice(int(i), 1).to_pylist()[0].values() for i in indices)
        return [TokenizedExample(*(np.asarray(v, np.int32) if isinstance(v, list) else v for v in r)) for r in rows]


def tokenizer_adds_bos(tokenizer: Any) -> bool:
    """True when the tokenizer puts BOS first by default (Llama-style post-processor); then we do too."""
    return tokenizer.bos_token_id is not None and tokenizer("a")["input_ids"][:1] == [tokenizer.bos_token_id]


def truncate(
    prompt_ids: list[int],
    responses: list[list[int]],
    *,
    max_length: int,
    max_prompt_length: int,
    mode: str,
    bos_id: int | None = None,
) -> tuple[list[int], list[list[int]]]:
    """As the original: if prompt + the longest response exceed max_length, cut the prompt to max_prompt_length,
    keep_start or keep_end (a leading BOS kept); then cut every response to the room left (departure 7)."""
    if len(prompt_ids) + max(map(len, responses)) > max_length and len(prompt_ids) > max_prompt_length:
        head = prompt_ids[:1] if mode == "keep_end" and prompt_ids[:1] == [bos_id] else []  # ids are never None
        tail = prompt_ids[len(prompt_ids) - (max_prompt_length - len(head)) :]
        prompt_ids = prompt_ids[:max_prompt_length] if mode == "keep_start" else head + tail
    return prompt_ids, [r[: max_length - len(prompt_ids)] for r in responses]


def _jobs(entries: list[PromptResponses], opts: LoadOptions, no_signal: dict) -> Iterator[tuple]:
    """(entry, chosen or the completion, rejected or None, label or None, source row) per example to tokenize; a
    pair whose chosen is its rejected is listed in no_signal, and yielded only with drop_identical_pairs=False."""
    for entry in entries:
        if opts.sft_mode:
            yield from ((entry, target, None, None, 0) for target in entry.sft_targets)
            continue
        if opts.unpaired:
            yield from ((entry, entry.responses[i], None, label, 0) for i, label in entry.rated)
        for (i, j), row in zip(entry.pairs, entry.rows) if opts.pairs_to_unpaired or not opts.unpaired else ():
            if i == j:  # responses are distinct: the same index is the same text
                no_signal.setdefault("chosen_equals_rejected", []).append(row)
                if opts.drop_identical_pairs:
                    continue
            if opts.unpaired:  # pairs_to_unpaired: the pair's two completions, labelled by the preference
                yield from ((entry, entry.responses[i], None, True, row), (entry, entry.responses[j], None, False, row))
            else:
                yield entry, entry.responses[i], entry.responses[j], None, row


def _encode(jobs: list[tuple], tokenizer: Any) -> dict[tuple[str, bool], list[int]]:
    """{(text, chat): token ids} of every distinct prompt and response of `jobs`, one tokenizer call per kind of text
    (a call per text is slow). Special-token text is parsed as such only in chat-template output (departure 5)."""
    ids = {}
    ids_only = dict(add_special_tokens=False, verbose=False, return_attention_mask=False, return_token_type_ids=False)
    for chat in (False, True):
        texts = []
        for entry, chosen, rejected, _, _ in jobs:
            if entry.chat == chat:
                texts += [entry.prompt, chosen, rejected]
        texts = [text for text in dict.fromkeys(texts) if text]  # distinct, in order; no rejected (None) or empty
        if texts:
            encoded = tokenizer(texts, split_special_tokens=not chat, **ids_only)["input_ids"]
            ids.update(((text, chat), row) for text, row in zip(texts, encoded))
    return ids


def tokenize_normalized(
    entries: Iterable[PromptResponses], tokenizer: Any, opts: LoadOptions, stats: SourceStats, file: Path | None = None
) -> Split:
    """[BOS] + ids(prompt), ids(response) + [EOS], truncated, into Arrow columns written to `file` chunk by chunk (or
    kept in memory), the entries read a chunk at a time; `stats` (source, split, origin, the converter's drops, a
    Counter it may fill as its entries are read) completed. Dropped, counted: empty_response;
    unless drop_identical_pairs=False, the pairs without signal (listed in no_signal with their first rows either way):
    chosen_equals_rejected, identical_after_truncation (no preference left once cut)."""
    drops = Counter()  # here; the converter's join at the end, once its entries are read
    counts = Counter()
    no_signal = {}
    lengths = []
    prompts = set()  # their hashes: a million prompts' text is not held
    bos = tokenizer.bos_token_id
    eos = tokenizer.eos_token_id
    add_bos = tokenizer_adds_bos(tokenizer)
    entries = iter(entries)
    limits = dict(max_length=opts.max_length, max_prompt_length=opts.max_prompt_length)
    sink = str(file) if file else pa.BufferOutputStream()  # no file: in memory
    writer = pa.ipc.new_file(sink, SCHEMA)
    while chunk := list(itertools.islice(entries, ENCODE_CHUNK)):
        jobs = list(_jobs(chunk, opts, no_signal))
        ids = _encode(jobs, tokenizer)
        columns = {name: [] for name in SCHEMA.names}
        for entry, chosen, rejected, label, row in jobs:
            prompt_ids = ids.get((entry.prompt, entry.chat), [])
            if add_bos and prompt_ids[:1] != [bos]:
                prompt_ids = [bos] + prompt_ids  # once (departure 4)
            texts = [chosen] if rejected is None else [chosen, rejected]
            bodies = [ids.get((text, entry.chat), []) for text in texts]
            with_eos = [body + [eos] for body in bodies]
            cut, responses = truncate(prompt_ids, with_eos, mode=opts.truncation_mode, bos_id=bos, **limits)
            if not all(bodies) or not all(responses):  # nothing to learn (config.py leaves room for >= 1 token)
                drops["empty_response"] += 1
                continue
            if chosen != rejected and len(responses) == 2 and responses[0] == responses[1]:
                no_signal.setdefault("identical_after_truncation", []).append(row)
                if opts.drop_identical_pairs:
                    continue
            shortened = len(cut) < len(prompt_ids)
            cue = opts.truncation_mode == "keep_start" and (entry.chat or entry.prompt.endswith(HH_MARKER))
            counts["prompts_truncated"] += shortened
            counts["reply_cues_cut"] += shortened and cue
            counts["responses_truncated"] += sum(len(r) <= len(b) for r, b in zip(responses, bodies))  # lost EOS
            if label is not None:  # unpaired: completions per label
                counts["desirable" if label else "undesirable"] += 1
            prompts.add(hash(entry.prompt))
            rejected_ids = responses[1] if rejected is not None else None
            example = TokenizedExample(entry.prompt, chosen, rejected, cut, responses[0], rejected_ids, label)
            for name, value in zip(SCHEMA.names, example):  # SCHEMA's columns are TokenizedExample's fields
                columns[name].append(value)
        writer.write_batch(pa.record_batch(columns, schema=SCHEMA))
        sides = ("prompt_ids", "chosen_ids", "rejected_ids")
        lengths.append(np.array([[len(v or ()) for v in columns[side]] for side in sides], np.int32).reshape(3, -1))
    writer.close()
    # memory-mapped: a page is read when used, and the processes that map the file share it
    table = pa.ipc.open_file(pa.memory_map(sink) if file else sink.getvalue()).read_all()
    drops.update(stats.dropped)
    if opts.drop_identical_pairs:
        drops.update({reason: len(rows) for reason, rows in no_signal.items()})
    lengths = np.concatenate(lengths or [np.zeros((3, 0), np.int32)], axis=1)
    prompt, chosen, rejected = lengths
    paired = bool(rejected.any())  # a kept rejected response has >= 1 token
    tokens = {}
    for kind, x in (("prompt", prompt), ("response", np.r_[chosen, rejected] if paired else chosen)):
        tokens[f"{kind}_tokens_mean"] = round(float(x.mean()) if len(x) else 0.0, 1)
        tokens[f"{kind}_tokens_max"] = int(x.max(initial=0))
    if paired:  # length bias: chosen responses longer than rejected ones teach length along with the preference
        tokens["chosen_rejected_length_ratio"] = round(float(chosen.mean() / rejected.mean()), 3)
    unit = "sft_targets" if opts.sft_mode else "completions" if opts.unpaired else "pairs"
    stats = replace(stats, **counts, kept=len(table), prompts=len(prompts), unit=unit)
    stats.tokens = tokens
    stats.dropped = dict(sorted(drops.items()))
    stats.truncation_mode = opts.truncation_mode
    stats.no_signal = {reason: [len(rows), rows[:5]] for reason, rows in no_signal.items()}  # count, first rows
    if file:  # read whole by every rank that maps the table: a few bytes an example, beside it
        np.save(file.with_name("lengths.npy"), lengths)
    return Split(table, [stats], {}, lengths)


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Hash of what could change token ids: the serialized tokenizer, special tokens, chat template, BOS rule."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    state = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return _sha256(
        [type(tokenizer).__name__, state, str(getattr(tokenizer, "chat_template", None)), tokenizer_adds_bos(tokenizer)]
        + [str(getattr(tokenizer, k, None)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")]
    )


def _sha256(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def _plan(spec: Spec, split: str, tokenizer: Any, tokenizer_fp: str, cache_dir: str | None, opts: LoadOptions):
    """(cache key of content, tokenizer, options and CODE_VERSION; build(file) that converts and tokenizes the
    source). Local files are hashed as a stream, never held whole; rows are read, checked and tokenized a batch at a
    time, only if build() runs."""
    rows = open_source(spec, split, cache_dir)
    key = _sha256([asdict(opts), CODE_VERSION, spec.source, split, rows.content, tokenizer_fp, MAX_PAIRS_PER_PROMPT])

    def build(file: Path | None) -> Split:
        records = rows.read()
        first = list(itertools.islice(records, 1))  # checked rows: none raises; a named Hub source's may be empty
        shape = None if rows.source else detect_shape(first[0])  # a file's or Hub id's shape, by its first row
        src = rows.source or SHAPES[shape]
        named = f"dataset {spec.name!r}" if rows.origin.startswith("hub:") else rows.origin  # in messages
        if src.unpaired and not opts.unpaired:
            raise DataError(
                f"{named}: holds unpaired {{prompt, completion, label}} rows; only an unpaired loss reads them "
                "(loss=kto), this one needs pairs"
            )
        if opts.unpaired and not src.unpaired and not opts.pairs_to_unpaired:
            raise DataError(
                f"{named}: holds pairs, but loss kto needs {{prompt, completion, label}} rows; set "
                "pairs_to_unpaired=true to use each pair as a desirable and an undesirable completion"
            )
        mode = opts.truncation_mode or src.truncation_mode
        if not mode:  # does the first prompt cue the reply? (sources.py, departure 3)
            prompt = first[0]["prompt"]
            mode = "keep_end" if isinstance(prompt, list) or prompt.endswith(HH_MARKER) else "keep_start"
        entries, dropped = src.convert(itertools.chain(first, records), tokenizer)
        where = SourceStats(spec.name, split, origin=rows.origin + f" ({shape})" * bool(shape), dropped=dropped)
        return tokenize_normalized(entries, tokenizer, replace(opts, truncation_mode=mode), where, file)

    return key, build


def load_tokenized(
    names: list[str], tokenizer: Any, split: str, *, cache_dir: str | None = None, tokenizer_fp="", seed=0, **options
) -> Split:
    """Every source tokenized (cached in cache_dir; the draw of an entry NAME:N or NAME:F from its training pairs
    seeded by `seed`), concatenated, with one SourceStats per source (printed by dataset_summary)."""
    opts = LoadOptions(**options)
    parts = []
    keys = {}
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token: responses end in EOS, so set tokenizer.eos_token")
    tokenizer_fp = tokenizer_fp or tokenizer_fingerprint(tokenizer)
    for name in names:
        spec = parse_spec(name)
        keys[name], build = _plan(spec, split, tokenizer, tokenizer_fp, cache_dir, opts)
        part = _cached(Path(cache_dir), f"{spec.source}-{split}", keys[name], build) if cache_dir else build(None)
        part.stats[0].source = name
        if spec.take is not None and split == "train":
            part = _draw(part, spec, seed, name)
            keys[name] = _sha256([keys[name], hashlib.sha256(part.index.tobytes()).hexdigest()])  # which pairs
        parts.append(part)
    stats = [s for part in parts for s in part.stats]
    index = None
    if any(p.index is not None for p in parts):  # entries drew: each example's row of the concatenated table
        starts = np.cumsum([0] + [p.table.num_rows for p in parts])
        index = np.concatenate(
            [start + (np.arange(len(p)) if p.index is None else p.index) for p, start in zip(parts, starts)]
        )
    lengths = parts[0].lengths if len(parts) == 1 else np.concatenate([p.lengths for p in parts], 1)  # no copy of one
    return Split(pa.concat_tables([p.table for p in parts]), stats, keys, lengths, index)


def _draw(part: Split, spec: Spec, seed: int, name: str) -> Split:
    """spec.take examples (a count, or a fraction of them) of one source's split, drawn by (seed, entry), in order."""
    count = spec.take if isinstance(spec.take, int) else round(spec.take * len(part))
    if count > len(part):
        raise DataError(
            f"datasets: {name!r} asks for {count} training pairs; the source has {len(part)} after filtering "
            f"(ask for at most that, or for a fraction, {spec.source}:0.5)"
        )
    rng = np.random.default_rng([seed, int(hashlib.sha256(name.encode()).hexdigest()[:8], 16)])
    index = np.sort(rng.choice(len(part), count, replace=False))
    return Split(part.table, [replace(part.stats[0], taken=count)], {}, part.lengths[:, index], index)


def _cached(cache_dir: Path, what: str, key: str, build: Callable[[Path], Split]) -> Split:
    """The source's entry cache_dir/tokenized/<what>-<key>/: examples.arrow (memory-mapped), lengths.npy and
    stats.json, or built there. No file holds code. Files whose size or times differ from the record made when they
    were written (edited, truncated, replaced) are rebuilt; an older version's cache file is never read."""
    entry = cache_dir / "tokenized" / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', what)[-60:]}-{key[:16]}"
    entry.parent.mkdir(parents=True, exist_ok=True)
    # several ranks may start at once: the first builds the entry while the others wait, then all map it. Where flock
    # does not span the nodes (NFS with local_lock or nolock, Lustre's localflock, many FUSE mounts) a builder per
    # node: each in a folder of its own (PIDs repeat across containers), and the first to rename wins
    with FileLock(str(entry) + ".lock"):
        if hit := _read_entry(entry, key):
            return hit
        changed = entry.exists()  # but not as its record says: edited, truncated or replaced since it was written
        shutil.rmtree(entry, ignore_errors=True)
        tmp = entry.with_name(f"{entry.name}.tmp-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}")
        tmp.mkdir()
        try:
            split = build(tmp / "examples.arrow")
            split.stats[0].cache = f"{'rewritten (it had changed)' if changed else 'written'} {entry}"
            stats = dict(asdict(split.stats[0]), key=key, files=_record(tmp))
            (tmp / "stats.json").write_text(json.dumps(stats))
            try:  # atomic: a reader sees the whole entry or none (renaming keeps the files' times)
                os.replace(tmp, entry)
            except OSError as e:  # another node renamed its entry first: the same data, read from there
                winner = _read_entry(entry, key) if e.errno in (errno.ENOTEMPTY, errno.EEXIST) else None
                if winner is None:
                    raise
                split = winner
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return split


def _record(folder: Path) -> list[list[int]]:  # ctime: set by the kernel on any change, a user cannot set it back
    found = [(folder / name).stat() for name in ("examples.arrow", "lengths.npy")]
    return [[st.st_size, st.st_mtime_ns, st.st_ctime_ns] for st in found]


def _read_entry(entry: Path, key: str) -> Split | None:
    """The cache entry's split, memory-mapped, if it was written for `key` and its files are as written; else None."""
    try:
        stats = json.loads((entry / "stats.json").read_text())
        if stats.pop("key") == key and stats.pop("files") == _record(entry):
            table = pa.ipc.open_file(pa.memory_map(str(entry / "examples.arrow"))).read_all()
            stats = SourceStats(**dict(stats, cache=f"hit {entry}"))
            return Split(table, [stats], {}, np.load(entry / "lengths.npy"))
    except (ValueError, TypeError, KeyError, OSError):  # not built yet, or unreadable
        pass
    return None


def load_splits(cfg, tokenizer: Any) -> dict[str, Split]:
    """{'train': ..., 'test': ...} as the run reads them, the tokenizer fingerprinted once: loaded once per rank and
    handed on to the checks, the trainer and the manifest. KTO reads labelled completions; with pairs_to_unpaired,
    training splits each pair into two and evaluation keeps the pairs (so that rewards_eval/accuracies ranks them)."""
    fp = tokenizer_fingerprint(tokenizer)
    cache_dir = str(first_usable_dir(cfg.local_dirs) / "datasets")
    splits = {}
    # the LoadOptions named as config keys, and SFT's
    same = {k: getattr(cfg, k) for k in ("max_length", "max_prompt_length", "truncation_mode", "drop_identical_pairs")}
    same["sft_mode"] = set(cfg.loss_names) == {"sft"}
    for split in ("train", "test"):
        unpaired = cfg.unpaired_loss and (split == "train" or not cfg.pairs_to_unpaired)
        options = dict(same, unpaired=unpaired, pairs_to_unpaired=unpaired and cfg.pairs_to_unpaired)
        splits[split] = load_tokenized(
            cfg.datasets, tokenizer, split, cache_dir=cache_dir, tokenizer_fp=fp, seed=cfg.seed, **options
        )
    return splits


def dataset_summary(stats: list[SourceStats]) -> str:
    """One block per source, every number named."""
    lines = []
    for s in stats:
        labels = f" desirable={s.desirable} undesirable={s.undesirable}" if s.unit == "completions" else ""
        taken = "" if s.taken is None else f" taken={s.taken} (drawn for training)"
        lines += [
            f"[data] {s.source}/{s.split} ({s.origin})",
            f"       {s.unit}_kept={s.kept}{taken} prompts={s.prompts}{labels} dropped: "
            + (", ".join(f"{k}={v}" for k, v in s.dropped.items()) or "none"),
            f"       prompts_truncated={s.prompts_truncated} responses_truncated={s.responses_truncated} "
            f"truncation_mode={s.truncation_mode}",
            "       " + " ".join(f"{k}={v}" for k, v in s.tokens.items()),
            f"       cache: {s.cache}",
        ]
        found = ", ".join(f"{k}={n} (first rows {rows})" for k, (n, rows) in s.no_signal.items())  # 1-based rows
        fate = "dropped" if set(s.no_signal) & set(s.dropped) else "kept (drop_identical_pairs=false)"
        if s.unit == "pairs" or found:
            lines.append(f"       no signal (chosen == rejected): {f'{found}: {fate}' if found else 'none'}")
        if s.reply_cues_cut:
            lines.append(
                f"       warning: reply_cues_cut={s.reply_cues_cut}: keep_start cut prompts' cue to reply ('\\n\\n"
                "Assistant:' or the generation prompt): set truncation_mode=keep_end"
            )
    return "\n".join(lines)


# --- Batches: the order (a pure function of seed, epoch and step), each rank's share, the collate -----------
def num_steps(n_items: int, *, batch_size: int, n_epochs: int | None = None, n_examples: int | None = None) -> int:
    """Global steps: min(n_epochs * (n_items // batch_size), ceil(n_examples / batch_size)) of the bounds set."""
    if n_items < batch_size:
        raise DataError(f"{n_items} examples, fewer than one global batch of {batch_size}: lower batch_size, add data")
    bounds = [n_epochs * (n_items // batch_size)] if n_epochs is not None else []
    return min(bounds + ([-(-n_examples // batch_size)] if n_examples is not None else []))


def iter_batch_indices(
    n_items: int,
    *,
    batch_size: int,
    shuffle: bool = True,
    seed: int = 0,
    n_epochs: int | None = None,
    n_examples: int | None = None,
    rank: int = 0,
    world_size: int = 1,
    start_example: int = 0,
    sizes: list[int] | None = None,
) -> Iterator[list[int]]:
    """This rank's item indices per global step: step s is batch s % S of epoch s // S (S = n_items // batch_size)
    in a permutation seeded by (seed, epoch); rank r takes its slice, or with `sizes` its balance_shares share."""
    total = num_steps(n_items, batch_size=batch_size, n_epochs=n_epochs, n_examples=n_examples)
    per_epoch = n_items // batch_size
    k = batch_size // world_size
    start = start_example // batch_size

    def batches():  # a generator inside: num_steps' check raises at the call, not at the first next()
        for step in range(start, total):
            epoch, j = divmod(step, per_epoch)
            if j == 0 or step == start:  # the order is a function of (seed, epoch): no state to resume
                order = np.random.default_rng((seed, epoch)).permutation(n_items) if shuffle else np.arange(n_items)
            items = order[j * batch_size : (j + 1) * batch_size].tolist()
            if sizes is None:
                yield items[rank * k : (rank + 1) * k]
            else:
                yield balance_shares(items, [sizes[i] for i in items], world_size)[rank]

    return batches()


def balance_shares(items: list[int], sizes: list[int], n_shares: int) -> list[list[int]]:
    """`items` (`sizes` tokens each) in n_shares equal-count shares of near-equal size (FSDP waits for the heaviest):
    largest first to the lightest share with room, each share in batch order; consecutive slices where no heavier."""
    shares = [[] for _ in range(n_shares)]
    room = len(items) // n_shares
    for pos in sorted(range(len(items)), key=lambda p: -sizes[p]):  # sorted() is stable: ties keep batch order
        min((s for s in shares if len(s) < room), key=lambda s: sum(sizes[p] for p in s)).append(pos)
    consecutive, dealt = [list(range(s * room, (s + 1) * room)) for s in range(n_shares)], [sorted(s) for s in shares]
    best = min(consecutive, dealt, key=lambda deal: max(sum(sizes[p] for p in share) for share in deal))
    return [[items[p] for p in share] for share in best]


def row_tokens(sequences: list, prompt, shared_prompt: bool = False):
    """Real tokens of the rows each example becomes: its sequences (prompt + response, one length array per side,
    numpy or torch), less the prompt's second copy when chosen and rejected share it (prefix_sharing: one row)."""
    return sum(sequences) - (prompt if shared_prompt else 0)


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
        return {
            prefix + "input_ids": pad(sequences, pad_token_id),
            prefix + "labels": pad(labels, -100),
            prefix + "attention_mask": pad([np.ones_like(s) for s in sequences], 0),
        }

    prompts = [e.prompt_ids for e in examples]
    batch = {
        "prompt": [e.prompt for e in examples],
        "prompt_input_ids": pad(prompts, pad_token_id, "left"),
        "prompt_attention_mask": pad([np.ones_like(p) for p in prompts], 0, "left"),
    }
    sides = ("chosen",) if examples[0].rejected is None else ("chosen", "rejected")
    for side in sides:
        texts = [getattr(e, side) for e in examples]
        batch[side] = [e.prompt + t for e, t in zip(examples, texts)]
        batch[side + "_response_only"] = texts
        batch.update(rows(prompts, [getattr(e, side + "_ids") for e in examples], side + "_"))
    if examples[0].desirable is not None:
        batch["desirable"] = torch.tensor([bool(e.desirable) for e in examples])
    if kl_rows:
        completions = [(e.prompt_ids, getattr(e, side + "_ids")) for side in sides for e in examples]
        cap = max(len(p) + len(r) for p, r in completions)  # never longer than a real sequence of the batch
        shifted = [completions[k - 1][1][: cap - len(p)] for k, (p, _) in enumerate(completions)]
        batch.update(rows([p for p, _ in completions], shifted, "kl_"))
    return batch


def get_batch_iterator(
    split: Split,
    pad_token_id: int | None,
    *,
    balance: bool = False,
    kl_rows: bool = False,
    shared_prompt: bool = False,
    **order,
) -> Iterator[dict[str, Any]]:
    """This rank's share of each global batch (iter_batch_indices: `order` its arguments batch_size, seed, n_epochs,
    n_examples, rank, world_size, start_example, shuffle), collated, with `example_index`; raises at once. `balance`
    deals by the tokens of the rows an example becomes: one row, its prompt once, with `shared_prompt`."""
    sizes = None
    if balance and order.get("world_size", 1) > 1:  # one rank's share is the whole batch: nothing to balance
        prompt, chosen, rejected = split.lengths
        sizes = row_tokens([prompt + chosen] + [prompt + rejected] * bool(rejected.any()), prompt, shared_prompt)
    return (
        dict(collate(split.rows(idx), pad_token_id, kl_rows), example_index=torch.as_tensor(idx))
        for idx in iter_batch_indices(len(split), sizes=sizes, **order)
    )  # called now: errors raise here


def get_eval_batches(
    split: Split,
    pad_token_id: int | None,
    *,
    batch_size: int,
    n_examples: int,
    rank: int = 0,
    world_size: int = 1,
    kl_rows: bool = False,
) -> list[dict]:
    """This rank's shares of the first n_examples test pairs in global batches, the last filled with repeats marked
    `valid` False (B,): every rank runs the same forwards (FSDP), and the mean counts each pair once."""
    n = min(n_examples, len(split))
    per_rank = batch_size // world_size
    batches = []
    for start in range(0, n, batch_size):
        positions = range(start + rank * per_rank, start + (rank + 1) * per_rank)  # past n: the batch's first pair
        idx, valid = [p if p < n else start for p in positions], torch.tensor([p < n for p in positions])
        batch = collate(split.rows(idx), pad_token_id, kl_rows)
        batches.append(dict(batch, example_index=torch.tensor(idx), valid=valid))
    return batches


def get_sample_batches(
    split: Split, pad_token_id: int | None, *, n_examples: int, rank: int = 0, world_size: int = 1
) -> list[tuple[int, dict]]:
    """(group, batch): groups of SAMPLE_GROUP of the first n_examples distinct test prompts, round-robin over the
    ranks, each generated with its own seed (world-size independent); repeats that even out the ranks' counts have
    group -1."""
    firsts = {}
    for example in itertools.takewhile(lambda _: len(firsts) < n_examples, split):
        firsts.setdefault(example.prompt, example)  # a prompt with several pairs is sampled (and counted) once
    examples = list(firsts.values())
    groups = [examples[start : start + SAMPLE_GROUP] for start in range(0, len(examples), SAMPLE_GROUP)]
    mine = (list(range(len(groups)))[rank::world_size] + [-1] * world_size)[: -(-len(groups) // world_size)]
    return [(g, collate(groups[max(g, 0)], pad_token_id)) for g in mine]
