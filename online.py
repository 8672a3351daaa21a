"""Semi-online DPO (`online.rounds`): rounds of generate, score, pair and train, with no inference server.

Round r samples online.samples_per_prompt completions of each of the next online.prompts_per_round prompts from the
policy, scores them, pairs each prompt's best with its worst where the gap exceeds online.min_score_gap and writes
run_dir/rounds/<r>/pairs.jsonl: an ordinary pairs file, trained one pass with the ordinary step. Optimizer and schedule
span the rounds; each group of prompts samples from its own seeded stream, whichever rank generates it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from pathlib import Path

import torch
from torch.nn.utils.rnn import pad_sequence

import preference_datasets as data
import scorers
import sources
import ulysses
from config import ConfigError
from sharding import unwrap
from checkpoints import CheckpointError
from utils import atomic_write_text, broadcast_object, file_sha256, rank0_print, sampling_seed

# round r, group g samples from sampling_seed(seed, STREAM + r, g): past any pairs count, so never evaluation's stream
STREAM = 1 << 40
STATS = (  # logged per round, at the pairs seen before it
    "online/round online/mean_score online/pairs_kept_per_prompt online/mean_score_gap online/length_ratio "
    "online/unfinished_share throughput/generated_tokens_per_second"
).split()


def rules(c, world: int) -> list[str]:
    """The config's problems with semi-online DPO (config_loader.validate calls this when online.rounds is set)."""
    o = c.online
    problems = []
    if not c.trains_on_pairs:
        problems.append(
            f"online.rounds={o.rounds}: the rounds make pairs, and loss.name="
            f"{c.loss.name!r} does not train on pairs; use a paired loss (loss=dpo)"
        )
    if c.precompute_ref_log_probs:
        problems.append(
            f"online.rounds={o.rounds} and precompute_ref_log_probs=true: the rounds' "
            "pairs do not exist before training; set precompute_ref_log_probs=false"
        )
    if o.prompts_per_round < c.batch_size:
        problems.append(
            f"online.prompts_per_round={o.prompts_per_round}: fewer than "
            f"batch_size={c.batch_size}, so a round (at most one pair per prompt) cannot fill one step"
        )
    if o.max_new_tokens + c.max_prompt_length > c.max_length:
        problems.append(
            f"online.max_new_tokens={o.max_new_tokens} + "
            f"max_prompt_length={c.max_prompt_length} > max_length={c.max_length}: sampled pairs would be cut in "
            "training (and lose their EOS); lower one or raise max_length"
        )
    return problems


def batches(t):
    """The rounds' batches, for BasicTrainer.train's loop (which evaluates and checkpoints every eval_every pairs and
    at the end): the prompts read, the scorer built and the schedule's length set before the optimizer is."""
    c, o = t.config, t.config.online
    prompts = read_prompts(c)
    score = scorers.make("online.scorer", o.scorer, c, t.device)
    t.total_steps = o.rounds * (o.prompts_per_round // c.batch_size)  # the schedule's length: every round full
    rank0_print(f"online: {o.rounds} rounds of {o.prompts_per_round} of {len(prompts)} prompts, {t.total_steps} steps")
    return rounds(t, prompts, score)


def rounds(t, prompts: list, score):
    """Round by round, this rank's share of one pass over the round's pairs. Runs from the loop's first batch: after
    the resume and self_check (on the datasets' training pairs: the head, layout and reference are the rounds' too)."""
    c, o = t.config, t.config.online
    resumed_at = t.state.example_counter  # the pairs a resumed checkpoint had seen (0 on a fresh start)
    done = 0  # the steps of the rounds before this one
    share = dict(batch_size=c.batch_size, n_epochs=1, rank=t.dp_rank, world_size=t.dp_size, balance=c.balance_batch)
    for r in range(o.rounds):
        folder = t.run_dir / "rounds" / str(r)
        # a resume reuses a complete round file (rank 0's verdict for all); a fresh start samples every round
        stats = broadcast_object(finished_round(folder) if t.rank == 0 and c.resume_from else None)
        if stats is None and t.state.batch_counter > done:
            raise CheckpointError(f"cannot resume: the checkpoint is inside round {r}, but {folder} is incomplete")
        fresh = stats is None
        stats = stats or make_round(t, r, prompts, score, folder)
        # the round file read as the training split is: its tokenization, truncation and drops
        as_data = dataclasses.replace(c, datasets=[str(folder / "pairs.jsonl")])
        pairs = data.load_splits(as_data, t.tokenizer)["train"] if stats["pairs"] else []
        steps = len(pairs) // c.batch_size
        start = done * c.batch_size  # the pairs seen before this round
        if fresh or start > resumed_at:  # else the resume kept its record
            t.log(start, {k: stats[k] for k in STATS})
        if fresh and not steps:
            rank0_print(f"round {r}: skipped: {stats['pairs']} pairs over online.min_score_gap, fewer than a batch")
        here = dict(seed=c.seed + r, start_example=t.state.example_counter - start, shared_prompt=c.prefix_sharing)
        seconds = t.train_seconds
        # none where a resume is past this round; the trainer takes each step (evaluating first when it is due)
        yield from data.get_batch_iterator(pairs, t.tokenizer.pad_token_id, **share, **here) if steps else []
        if train_seconds := t.train_seconds - seconds:  # sampling against the round's sampling, scoring and steps
            spent = stats["sample_seconds"] + stats["score_seconds"] + train_seconds
            t.log(t.state.example_counter, {"throughput/generation_share": stats["sample_seconds"] / spent})
        done += steps


def finished_round(folder: Path) -> dict | None:
    """round.json's statistics if pairs.jsonl is whole (the sha256 there); None: the round is to be sampled."""
    try:
        stats = json.loads((folder / "round.json").read_text())
        return stats if file_sha256(folder / "pairs.jsonl") == stats["sha256"] else None
    except (OSError, ValueError, KeyError):
        return None


def make_round(t, r: int, prompts: list, score, folder: Path) -> dict:
    """Round r's prompts sampled and scored (each rank its groups), paired and written; returns its statistics."""
    c, o = t.config, t.config.online
    n = o.samples_per_prompt
    tokenizer = t.tokenizer
    pad = tokenizer.pad_token_id
    picked = [(r * o.prompts_per_round + j) % len(prompts) for j in range(o.prompts_per_round)]
    groups = [picked[s : s + o.prompts_per_generate] for s in range(0, len(picked), o.prompts_per_generate)]
    mine = [g if g < len(groups) else -1 for g in range(t.dp_rank, -(-len(groups) // t.dp_size) * t.dp_size, t.dp_size)]
    eos = unwrap(t.policy).generation_config.eos_token_id  # where generate stops (a chat model's end of turn too)
    stops = {tokenizer.eos_token_id, *([eos] if isinstance(eos, int) else eos or [])}
    sampling = dict(max_new_tokens=o.max_new_tokens, temperature=o.temperature, top_p=o.top_p, pad_token_id=pad)
    rows = []
    tick = time.time()
    device = t.sharding.input_device(t.policy)
    t.policy.eval()
    with t.sharding.params_on_device(t.policy):
        for g in mine:  # as many generate calls on every rank (each a collective under FSDP); -1: a repeat
            ids = [torch.tensor(prompt_ids(tokenizer, prompts[i], c)) for i in groups[max(g, 0)]]
            batch = pad_sequence(ids, True, pad, padding_side="left").to(device)
            mask = pad_sequence([torch.ones_like(x) for x in ids], True, 0, padding_side="left").to(device)
            with torch.random.fork_rng(devices=range(torch.cuda.device_count()) if torch.cuda.is_available() else ()):
                torch.manual_seed(sampling_seed(c.seed, STREAM + r, max(g, 0)))  # every device's generator
                new = shared_prefix_generate(t.sharding, t.policy, batch, mask, n, **sampling).tolist()
            for k, i in enumerate(groups[g] if g >= 0 else []):
                ends = [next((p for p, x in enumerate(row) if x in stops), None) for row in new[k * n : k * n + n]]
                texts = [tokenizer.decode(row[:e], skip_special_tokens=True) for row, e in zip(new[k * n :], ends)]
                lengths = [o.max_new_tokens if e is None else e + 1 for e in ends]  # None: never stopped
                rows.append([g * o.prompts_per_generate + k, i, texts, [e is not None for e in ends], lengths])
    t.sharding.reshard(t.policy)
    sample_seconds = time.time() - tick
    tick = time.time()
    problem = None
    try:  # every rank reaches the gather below: a bad scorer stops all of them, with its message
        asked = [prompts[row[1]] for row in rows for _ in range(n)], [x for row in rows for x in row[2]]
        scores = scorers.checked(f"online.scorer={o.scorer}", score, *asked)
        for k, row in enumerate(rows):
            row.append([s - o.unfinished_penalty * (not end) for s, end in zip(scores[k * n : k * n + n], row[3])])
    except Exception as e:  # noqa: BLE001 - the user's scorer may raise anything: say which scorer, and what
        problem = str(e) if isinstance(e, ConfigError) else f"online.scorer={o.scorer}: raised {type(e).__name__}: {e}"
    gathered = t.sharding.gather_objects([(problem, rows)], t.sp_size)
    if problems := [p for p, _ in gathered if p]:
        raise ConfigError(problems[:1])
    rows = sorted((row for _, part in gathered for row in part), key=lambda row: row[0])
    return write_round(t, r, folder, prompts, rows, (sample_seconds, time.time() - tick))


def write_round(t, r: int, folder: Path, prompts: list, rows: list, seconds: tuple[float, float]) -> dict:
    """Each prompt's best sample over its worst where the gap exceeds min_score_gap: pairs.jsonl, then round.json."""
    o = t.config.online
    pairs = []
    lengths = []  # each pair's (chosen, rejected) generated tokens
    for _, i, texts, _, generated, scores in rows:
        best, worst = scores.index(max(scores)), scores.index(min(scores))
        if scores[best] - scores[worst] > o.min_score_gap:
            # a chat prompt stays messages: the loader renders it through the template, as it was sampled
            reply = [[scorers.assistant(x)] for x in texts] if isinstance(prompts[i], list) else texts
            pair = dict(prompt=prompts[i], chosen=reply[best], rejected=reply[worst], prompt_index=i)
            pairs.append(dict(pair, chosen_score=scores[best], rejected_score=scores[worst], scores=scores))
            lengths.append((generated[best], generated[worst]))
    samples = [s for row in rows for s in row[5]]
    tokens = sum(sum(row[4]) for row in rows)
    gaps = [p["chosen_score"] - p["rejected_score"] for p in pairs]
    gap = statistics.fmean(gaps) if gaps else math.nan
    unfinished = 1 - sum(sum(row[3]) for row in rows) / len(samples)
    ratio = sum(chosen for chosen, _ in lengths) / (sum(rejected for _, rejected in lengths) or math.nan)
    values = r, statistics.fmean(samples), len(pairs) / len(rows), gap, ratio, unfinished, tokens / seconds[0]
    stats = dict(zip(STATS, values), pairs=len(pairs), sample_seconds=seconds[0], score_seconds=seconds[1])
    if t.rank == 0:  # rank 0 writes; the others wait, then all read the file
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_text(folder / "pairs.jsonl", "".join(json.dumps(p) + "\n" for p in pairs))
        sha256 = file_sha256(folder / "pairs.jsonl")
        atomic_write_text(folder / "round.json", json.dumps(dict(stats, sha256=sha256), indent=1))  # last: complete
    t.sharding.barrier()
    rank0_print(f"round {r}: mean score {values[1]:.3f}, {len(pairs)} pairs of {len(rows)} prompts, mean gap {gap:.3f}")
    return stats


@torch.no_grad()
def shared_prefix_generate(sharding, model, ids: torch.Tensor, mask: torch.Tensor, n: int, **sampling) -> torch.Tensor:
    """(B n, new tokens): n samples of each left-padded prompt, its cache prefilled once and repeated n times."""
    if ids.size(1) > 1:
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate derives them from the mask
        prefix = dict(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=positions[:, :-1])
        with ulysses.paused():  # whole prompts on every rank, as in sharding.generate
            sampling["cache"] = model(**prefix, use_cache=True, logits_to_keep=1).cache
        sampling["cache"].batch_repeat_interleave(n)
    repeated = dict(input_ids=ids.repeat_interleave(n, 0), attention_mask=mask.repeat_interleave(n, 0))
    return sharding.generate(model, **repeated, do_sample=True, **sampling)[:, ids.size(1) :]


# --- Prompts ---------------------------------------------------------------------------------------------------
def read_prompts(c) -> list:
    """The distinct `prompt` fields (strings or {role, content} lists) of online.prompts, else of datasets' files."""
    files = [c.online.prompts] if c.online.prompts else [f for d in c.datasets for f in sources.local_files(d, "train")]
    prompts = []
    for path in map(Path, files):
        if path.suffix != ".jsonl" or not path.is_file():  # a hub dataset, a .json list
            raise ConfigError([f"online.prompts={c.online.prompts}: {path}: expected a .jsonl file of prompts"])
        for n, line in enumerate(path.read_text().splitlines(), 1):
            try:
                prompt = json.loads(line).get("prompt") if line.strip() else ""
            except (ValueError, AttributeError):
                prompt = None
            chat = isinstance(prompt, list) and all(isinstance(m, dict) and "content" in m for m in prompt)
            if line.strip() and not (prompt and (isinstance(prompt, str) or chat)):
                raise sources.DataError(
                    f'{path}, line {n}: expected {{"prompt": a string or messages}}, got {line[:60]}'
                )
            prompts += [prompt] if line.strip() else []
    return list({json.dumps(p): p for p in prompts}.values())


def prompt_ids(tokenizer, prompt, c) -> list[int]:
    """As training makes a prompt: [BOS] + text (chat: its template's markup special), cut to max_prompt_length."""
    chat = isinstance(prompt, list)
    text = sources.render_chat(tokenizer, prompt, {"role": "assistant", "content": ""})[0] if chat else prompt
    ids = tokenizer(text, add_special_tokens=False, split_special_tokens=not chat)["input_ids"]
    bos = tokenizer.bos_token_id
    ids = [bos] + ids if data.tokenizer_adds_bos(tokenizer) and ids[:1] != [bos] else ids
    mode = c.truncation_mode or ("keep_end" if chat or text.endswith(sources.HH_MARKER) else "keep_start")
    # against a response of max_length tokens, truncate cuts the prompt exactly when it exceeds max_prompt_length
    limits = dict(max_length=c.max_length, max_prompt_length=c.max_prompt_length, mode=mode, bos_id=bos)
    return data.truncate(ids, [range(c.max_length)], **limits)[0]


def check(c, tokenizer) -> None:
    """Before any model loads (train.py): the scorer builds, the prompts read and tokenize (a string, a chat one)."""
    scorers.make("online.scorer", c.online.scorer, c)
    for prompt in {isinstance(p, list): p for p in read_prompts(c)}.values():
        prompt_ids(tokenizer, prompt, c)


def record(c) -> dict:
    """run_manifest.json's `online`: settings, seeds and scorer (scorers.record)."""
    seeds = f"round r, group g: utils.sampling_seed({c.seed}, {STREAM} + r, g)"
    return {
        "settings": c.online.to_dict(),
        "seeds": seeds,
        "scorer": scorers.record("online.scorer", c.online.scorer, c),
    }
