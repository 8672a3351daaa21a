"""Semi-online DPO (`online.rounds`): rounds of generate, score, pair and train, with no inference server.

Round r samples online.samples_per_prompt completions of each of the next online.prompts_per_round prompts from the
policy (inside sharding.sampling: under FSDP its parameters gathered once for the round where they fit), scores them
(online.scorer), makes at most one pair per prompt (online.pairing: PAIRINGS, or the user's function) and writes
run_dir/rounds/<r>/pairs.jsonl: an ordinary pairs file, trained with the ordinary step. Every pair a round makes is
trained: in whole steps of batch_size pairs, the rest waiting for the next round's steps, and the last round's rest in
one smaller last step (each pair weighs 1/batch_size in it, as in every step). The schedule's length is the steps the
run will take: known for the rounds made, at most prompts_per_round pairs for each round to come, exact once the last
round is made. Optimizer and schedule span the rounds; each group of prompts samples from its own seeded stream,
whichever rank generates it.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import statistics
import time
from pathlib import Path

import numpy as np
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
# and what became of its pairs: made (pairs.jsonl), dropped by the loader (an empty or identical reply), trained in
# the round's steps (with the ones waiting from earlier rounds), left waiting for the next round's (after the last
# round: too few for a step on every rank)
COUNTS = dict(made="pairs", dropped="pairs_dropped", trained="pairs_trained", waiting="pairs_left")


# --- Pairing: a round's samples -> at most one (chosen, rejected) per prompt ------------------------------------
def best_worst(min_score_gap: float):
    """Each prompt's best sample over its worst, where the scores differ by more than min_score_gap (ties never)."""

    def pair(prompts: list, targets: list, samples: list[list[str]], scores: list[list[float]]) -> list:
        pairs = []
        for s in scores:
            best, worst = s.index(max(s)), s.index(min(s))
            pairs.append((best, worst) if s[best] - s[worst] > min_score_gap else None)
        return pairs

    return pair


def spin(prompts: list, targets: list, samples: list[list[str]], scores) -> list:
    """SPIN (Chen et al. 2024, self-play fine-tuning): the data's target over the policy's sample, nothing scored."""
    return [(target, 0) for target in targets]


# online.pairing -> (the rule given the config, whether it reads scores); python=<module>:<function>: the user's,
# pair(prompts, targets, samples, scores) -> per prompt None or (chosen, rejected), each a sample's index or a text
PAIRINGS = {
    "best_worst": (lambda o: best_worst(o.min_score_gap), True),
    "spin": (lambda o: spin, False),
}
# the keys a pairing's rule never reads: set away from their default, they are refused
UNREAD = {"spin": ("scorer", "min_score_gap", "unfinished_penalty"), "python": ("min_score_gap",)}
# what a pairing's rule reads besides the samples: where a run starves, these are the knobs to name
STARVING = {
    "best_worst": "online.min_score_gap={o.min_score_gap} (a pair's best must beat its worst by more), "
    "online.samples_per_prompt={o.samples_per_prompt}, online.scorer={o.scorer}",
    "spin": "the targets (a sampled reply equal to its target is dropped as an identical pair)",
    "python": "online.pairing={o.pairing} (it returned None for the prompts without a pair), online.scorer={o.scorer}",
}


def pairing(c):
    """(pair, scored): the rule online.pairing names and whether it reads scores (else the scorer never runs)."""
    o = c.online
    if o.pairing in PAIRINGS:
        rule, scored = PAIRINGS[o.pairing]
        return rule(o), scored
    return scorers.user_function(f"online.pairing={o.pairing}", o.pairing.removeprefix("python=")), True


def checked_pairs(name: str, pairs, n_prompts: int, n_samples: int) -> list:
    """The rule's output: per prompt None or (chosen, rejected), each side a sample's index or a text (a string, or
    chat messages); else a ConfigError naming the rule."""
    side = lambda v: (
        (isinstance(v, int) and not isinstance(v, bool) and 0 <= v < n_samples) or isinstance(v, str | list)
    )
    problem = f"returned {type(pairs).__name__}"
    if isinstance(pairs, list | tuple):
        problem = f"returned {len(pairs)} entries" if len(pairs) != n_prompts else None
        for i, p in enumerate(pairs if problem is None else ()):
            if p is not None and not (isinstance(p, list | tuple) and len(p) == 2 and all(map(side, p))):
                problem = f"returned {p!r} for prompt {i}"
                break
    if problem:
        raise ConfigError(
            [
                f"{name}: {problem}; expected one entry per prompt ({n_prompts}): None, or (chosen, rejected) each a "
                f"sample's index (0 to {n_samples - 1}) or a text"
            ]
        )
    return list(pairs)


# --- The rounds as the training loop reads them -----------------------------------------------------------------
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
    if o.pairing == "best_worst" and o.samples_per_prompt < 2:
        problems.append(
            f"online.samples_per_prompt={o.samples_per_prompt}: online.pairing=best_worst pairs a prompt's best "
            "sample with its worst; sample at least 2"
        )
    if o.pairing == "spin" and o.samples_per_prompt != 1:
        problems.append(
            f"online.samples_per_prompt={o.samples_per_prompt}: online.pairing=spin pairs each prompt's target "
            "with the policy's one sample; set online.samples_per_prompt=1"
        )
    default = type(o)()
    for key in UNREAD.get(o.pairing.partition("=")[0], ()):
        if getattr(o, key) != getattr(default, key):
            problems.append(f"online.{key}={getattr(o, key)!r}: not read with online.pairing={o.pairing}; unset it")
    return problems


def batches(t):
    """The rounds' batches, for BasicTrainer.train's loop (which evaluates and checkpoints every eval_every pairs and
    at the end): the prompts read, the scorer built and the schedule's length set before the optimizer is."""
    c, o = t.config, t.config.online
    prompts, targets = read_prompts(c)
    pair, scored = pairing(c)
    score = scorers.make("online.scorer", o.scorer, c, t.device) if scored else None
    t.total_steps = run_steps(t, 0, o.rounds)  # every round full: the most the rounds can make
    rank0_print(
        f"online: {o.rounds} rounds of {o.prompts_per_round} of {len(prompts)} prompts x {o.samples_per_prompt} "
        f"samples, paired by {o.pairing} (one pair per prompt at most), {c.batch_size} pairs a step: at most "
        f"{t.total_steps} steps (the schedule's length follows the pairs the rounds make)"
    )
    return rounds(t, prompts, targets, score, pair)


def run_steps(t, pairs: int, rounds_left: int) -> int:
    """The steps that train `pairs` and the pairs of `rounds_left` full rounds: whole steps, then one with the rest
    that every data-parallel rank can share (an equal number per rank, of at least one per micro-batch)."""
    c = t.config
    pairs += rounds_left * c.online.prompts_per_round
    return pairs // c.batch_size + (pairs % c.batch_size >= last_step_unit(t))


def last_step_unit(t) -> int:
    """The smaller last step holds a multiple of this many pairs: ranks x micro-batches (a token budget: ranks)."""
    c = t.config
    return t.dp_size * (1 if c.max_tokens_per_microbatch else c.gradient_accumulation_steps)


class Pool:
    """Pairs from several rounds' files, read as the batch iterator reads a preference_datasets.Split: each pair a
    (split, index) of its round's file."""

    def __init__(self, pairs: list[tuple]):
        self.pairs = pairs

    def __len__(self) -> int:
        return len(self.pairs)

    def rows(self, indices) -> list:
        return [split.rows([i])[0] for split, i in (self.pairs[j] for j in indices)]

    @property
    def lengths(self) -> np.ndarray:  # (3, len): prompt, chosen, rejected tokens (balance_batch deals by them)
        return np.stack([split.lengths[:, i] for split, i in self.pairs], axis=1)


def rounds(t, prompts: list, targets: list, score, pair):
    """Round by round, this rank's share of the round's steps (plan_round). Runs from the loop's first batch: after the
    resume and self_check (on the datasets' training pairs: the head, layout and reference are the rounds' too)."""
    c, o = t.config, t.config.online
    logged = logged_rounds(t.run_dir) if t.rank == 0 else set()  # a resumed run's records kept from before (rank 0's)
    done = 0  # the steps of the rounds before this one (all whole)
    waiting = []  # (split, index) of the pairs made and not trained yet, oldest first
    totals = dict.fromkeys(("pairs", "pairs_dropped", "steps", "pairs_trained", "no pair", "no step"), 0)
    for r in range(o.rounds):
        folder = t.run_dir / "rounds" / str(r)
        # a resume reuses a complete round file (rank 0's verdict for all); a fresh start samples every round
        stats = broadcast_object(finished_round(folder) if t.rank == 0 and c.resume_from else None)
        if stats is None and t.state.batch_counter > done:
            raise CheckpointError(f"cannot resume: the checkpoint is inside round {r}, but {folder} is incomplete")
        fresh = stats is None
        stats = stats or make_round(t, r, prompts, targets, score, pair, folder)
        # the round file read as the training split is: its tokenization, truncation and drops
        as_data = dataclasses.replace(c, datasets=[str(folder / "pairs.jsonl")])
        split = data.load_splits(as_data, t.tokenizer)["train"] if stats["pairs"] else []
        steps, plan, waiting = plan_round(t, r, stats["pairs"], split, waiting)
        stats |= plan
        if fresh and t.rank == 0:  # round.json last: the round is complete
            sha256 = file_sha256(folder / "pairs.jsonl")
            atomic_write_text(folder / "round.json", json.dumps(dict(stats, sha256=sha256), indent=1))
        set_length(t, done + plan["steps"] + run_steps(t, plan["pairs_left"], o.rounds - 1 - r))
        if r not in logged:  # at the pairs seen before the round
            t.log(
                done * c.batch_size,
                {k: stats[k] for k in STATS} | {f"online/pairs_{name}": stats[key] for name, key in COUNTS.items()},
            )
        if fresh:
            gap = stats["online/mean_score_gap"]
            scored = f"mean score {stats['online/mean_score']:.3f}, mean gap {gap:.3f}, " if score else ""  # spin: none
            rank0_print(
                f"round {r}: {scored}{stats['pairs']} pairs of {o.prompts_per_round} prompts; trains "
                f"{plan['pairs_trained']} pairs in {plan['steps']} steps ({plan['pairs_waited']} of them from earlier "
                f"rounds), {plan['pairs_left']} left waiting"
                + (f", {plan['pairs_dropped']} dropped by the loader" if plan["pairs_dropped"] else "")
            )
        for key in ("pairs", "pairs_dropped", "steps", "pairs_trained"):
            totals[key] += stats[key]
        totals["no pair"] += not stats["pairs"]
        totals["no step"] += stats["pairs"] > 0 and not plan["steps"]
        seconds = t.train_seconds
        for k, step in enumerate(steps):  # none where a resume is past them; the trainer takes each
            yield from step if t.state.batch_counter == done + k else []  # (evaluating first when it is due)
        if train_seconds := t.train_seconds - seconds:  # sampling against the round's sampling, scoring and steps
            spent = stats["sample_seconds"] + stats["score_seconds"] + train_seconds
            t.log(t.state.example_counter, {"throughput/generation_share": stats["sample_seconds"] / spent})
        done += plan["steps"]
    left = totals["pairs"] - totals["pairs_dropped"] - totals["pairs_trained"]
    notes = {  # the ones that happened
        f"{totals['no pair']} rounds made no pair": totals["no pair"],
        f"{totals['no step']} rounds took no step (their pairs waited for a later round's)": totals["no step"],
        f"the loader dropped {totals['pairs_dropped']} pairs (an empty or identical reply)": totals["pairs_dropped"],
        f"{left} pairs left untrained, fewer than {last_step_unit(t)} (ranks x micro-batches)": left,
    }
    rank0_print(
        f"online: {o.rounds} rounds made {totals['pairs']} pairs and trained {totals['pairs_trained']} in "
        f"{totals['steps']} steps" + "".join(f"; {note}" for note, count in notes.items() if count)
    )


def logged_rounds(run_dir: Path) -> set[int]:
    """The rounds whose record metrics.jsonl holds: a resume keeps those of the steps up to its checkpoint (a round is
    logged once it is made, before its first step and any checkpoint there)."""
    path = run_dir / "metrics.jsonl"
    records = map(json.loads, path.read_text().splitlines()) if path.is_file() else []
    return {record["online/round"] for record in records if "online/round" in record}


def plan_round(t, r: int, made: int, split, waiting: list) -> tuple[list, dict, list]:
    """Round r's steps: the pairs waiting from earlier rounds and the round's `split` (its `made` pairs as loaded) in
    whole steps of batch_size, in an order seeded by the round; the rest wait for the next round, and after the last
    round make one smaller step (as many as every rank can share: last_step_unit). Returns each step as an iterator
    of this rank's share, the round's counts (round.json) and the pairs still waiting."""
    c = t.config
    pool = Pool(waiting + [(split, i) for i in range(len(split))])
    whole = len(pool) // c.batch_size
    order = data.iter_batch_indices(len(pool), batch_size=c.batch_size, seed=c.seed + r, n_epochs=1) if whole else []
    trained = {i for step in order for i in step}
    waiting = [pool.pairs[i] for i in range(len(pool)) if i not in trained]  # oldest first
    final = len(waiting) - len(waiting) % last_step_unit(t) if r == c.online.rounds - 1 else 0
    share = dict(n_epochs=1, rank=t.dp_rank, world_size=t.dp_size, balance=c.balance_batch, seed=c.seed + r)
    share |= dict(shared_prompt=c.prefix_sharing, pad_token_id=t.tokenizer.pad_token_id)
    # one iterator per step, of one batch: the trainer's loop draws them as it steps (a resume starts past some)
    steps = [
        itertools.islice(
            data.get_batch_iterator(pool, batch_size=c.batch_size, start_example=k * c.batch_size, **share), 1
        )
        for k in range(whole)
    ]
    steps += [data.get_batch_iterator(Pool(waiting[:final]), batch_size=final, **share)] if final else []
    plan = dict(
        pairs_dropped=made - len(split),  # by the loader, as for any pairs file (an empty or identical reply)
        pairs_waited=len(pool) - len(split),  # from earlier rounds
        steps=len(steps),
        pairs_trained=whole * c.batch_size + final,
        pairs_left=len(waiting) - final,
    )
    return steps, plan, waiting[final:]


def set_length(t, steps: int) -> None:
    """The schedule's length (build_optimizer's factor reads t.total_steps at every step), and the coming step's
    learning rate recomputed with it: the scheduler set it after the step before, with the length it knew then."""
    t.total_steps = steps
    scheduler = t.scheduler
    for group, base, factor in zip(t.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * factor(scheduler.last_epoch)


def starved(c, run_dir) -> str:
    """Why a semi-online run took no step (trainers.NothingTrained; exit code 5): its rounds' pairs and the knobs that
    made so few."""
    o = c.online
    made = [json.loads(p.read_text()) for p in Path(run_dir).glob("rounds/*/round.json")]
    pairs = sum(s["pairs"] for s in made)
    dropped = sum(s["pairs_dropped"] for s in made)
    knobs = STARVING[o.pairing.partition("=")[0]].format(o=o)
    return (
        f"online.rounds={o.rounds}: {len(made)} rounds of online.prompts_per_round={o.prompts_per_round} prompts made "
        f"{pairs} pairs ({dropped} dropped by the loader: an empty or identical reply), too few for one step: nothing "
        f"was trained (the rounds' files are in {Path(run_dir) / 'rounds'}). What decides a pair: {knobs}"
    )


def finished_round(folder: Path) -> dict | None:
    """round.json's statistics if pairs.jsonl is whole (the sha256 there); None: the round is to be sampled."""
    try:
        stats = json.loads((folder / "round.json").read_text())
        return stats if file_sha256(folder / "pairs.jsonl") == stats["sha256"] else None
    except (OSError, ValueError, KeyError):
        return None


# --- One round: sample, score, pair, write ----------------------------------------------------------------------
def make_round(t, r: int, prompts: list, targets: list, score, pair, folder: Path) -> dict:
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
    with t.sharding.params_on_device(t.policy), t.sharding.sampling(t.policy):
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
        scores = scorers.checked(f"online.scorer={o.scorer}", score, *asked) if score else None
        for k, row in enumerate(rows):  # scores less the penalty for no EOS; None: the pairing reads none
            own = None if scores is None else scores[k * n : k * n + n]
            row.append(own and [s - o.unfinished_penalty * (not end) for s, end in zip(own, row[3])])
    except Exception as e:  # noqa: BLE001 - the user's scorer may raise anything: say which scorer, and what
        problem = str(e) if isinstance(e, ConfigError) else f"online.scorer={o.scorer}: raised {type(e).__name__}: {e}"
    gathered = t.sharding.gather_objects([(problem, rows)], t.sp_size)
    if problems := [p for p, _ in gathered if p]:
        raise ConfigError(problems[:1])
    rows = sorted((row for _, part in gathered for row in part), key=lambda row: row[0])
    return write_round(t, r, folder, prompts, targets, pair, rows, (sample_seconds, time.time() - tick))


def write_round(t, r: int, folder: Path, prompts: list, targets: list, pair, rows: list, seconds: tuple) -> dict:
    """The pairing's pairs (at most one per prompt) written to pairs.jsonl; returns the round's statistics (round.json,
    once its steps are planned: rounds)."""
    o = t.config.online
    name = f"online.pairing={o.pairing}"
    try:  # the user's rule may raise anything: say which rule, and what (every rank calls it alike)
        made = pair(
            [prompts[row[1]] for row in rows],
            [targets[row[1]] for row in rows],
            [row[2] for row in rows],
            [row[5] for row in rows],
        )
    except Exception as e:  # noqa: BLE001
        raise ConfigError([f"{name}: raised {type(e).__name__}: {e}"]) from None
    pairs = []
    lengths = []  # each pair of two samples: (chosen, rejected) tokens generated, EOS included
    gaps = []
    made = checked_pairs(name, made, len(rows), o.samples_per_prompt)
    for (_, i, texts, _, generated, scores), sides in zip(rows, made):
        if sides is None:
            continue
        chat = isinstance(prompts[i], list)
        chosen, rejected = (reply(texts[s] if isinstance(s, int) else s, chat) for s in sides)
        pair_row = dict(prompt=prompts[i], chosen=chosen, rejected=rejected, prompt_index=i)
        if scores is not None:
            sided = [scores[s] if isinstance(s, int) else None for s in sides]
            pair_row |= dict(chosen_score=sided[0], rejected_score=sided[1], scores=scores)
            gaps += [sided[0] - sided[1]] if None not in sided else []
        pairs.append(pair_row)
        lengths += [[generated[s] for s in sides]] if all(isinstance(s, int) for s in sides) else []
    samples = [s for row in rows for s in row[5] or []]
    tokens = sum(sum(row[4]) for row in rows)
    gap = statistics.fmean(gaps) if gaps else math.nan
    unfinished = 1 - sum(sum(row[3]) for row in rows) / sum(len(row[3]) for row in rows)
    ratio = sum(chosen for chosen, _ in lengths) / (sum(rejected for _, rejected in lengths) or math.nan)
    mean = statistics.fmean(samples) if samples else math.nan
    values = r, mean, len(pairs) / len(rows), gap, ratio, unfinished, tokens / seconds[0]
    stats = dict(zip(STATS, values), pairs=len(pairs), sample_seconds=seconds[0], score_seconds=seconds[1])
    if t.rank == 0:  # rank 0 writes; the others wait, then all read the file
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_text(folder / "pairs.jsonl", "".join(json.dumps(p) + "\n" for p in pairs))
    t.sharding.barrier()
    return stats


def reply(side, chat: bool):
    """A pair's side as pairs.jsonl keeps it: a chat prompt's reply as messages (the loader renders them through the
    template, as the prompt was sampled), else the text."""
    return [scorers.assistant(side)] if chat and isinstance(side, str) else side


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
def read_prompts(c) -> tuple[list, list]:
    """The distinct `prompt` fields (strings or {role, content} lists) of online.prompts, else of datasets' files, and
    each one's target: the first row's `sft_target`, else its `chosen` (SFT's target, as the loader reads it), or
    None."""
    files = [c.online.prompts] if c.online.prompts else [f for d in c.datasets for f in sources.local_files(d, "train")]
    found = {}  # json of the prompt -> (prompt, target)
    for path in map(Path, files):
        if path.suffix != ".jsonl" or not path.is_file():  # a hub dataset, a .json list
            raise ConfigError([f"online.prompts={c.online.prompts}: {path}: expected a .jsonl file of prompts"])
        for n, line in enumerate(path.read_text().splitlines(), 1):
            try:
                row = json.loads(line) if line.strip() else {}
                prompt = row.get("prompt") if line.strip() else ""
            except (ValueError, AttributeError):
                row, prompt = {}, None
            chat = isinstance(prompt, list) and all(isinstance(m, dict) and "content" in m for m in prompt)
            if line.strip() and not (prompt and (isinstance(prompt, str) or chat)):
                raise sources.DataError(
                    f'{path}, line {n}: expected {{"prompt": a string or messages}}, got {line[:60]}'
                )
            if line.strip():
                target = row.get("sft_target", row.get("chosen"))
                if isinstance(target, list):  # chat messages: the reply, where the prompt comes first
                    target = sources.reply_messages(prompt, target) if chat else target
                found.setdefault(json.dumps(prompt), (prompt, target))
    return [p for p, _ in found.values()], [t for _, t in found.values()]


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
    """Before any model loads (train.py): the pairing and scorer build, the prompts read and tokenize (a string, a chat
    one); spin's prompts have their targets."""
    _, scored = pairing(c)
    if scored:
        scorers.make("online.scorer", c.online.scorer, c)
    prompts, targets = read_prompts(c)
    if c.online.pairing == "spin" and None in targets:
        where = c.online.prompts or f"datasets={list(c.datasets)}"
        raise ConfigError(
            [
                f"online.pairing=spin: {where}: the prompt {prompts[targets.index(None)]!r:.80} has no target; spin "
                'reads {"prompt", "chosen"} or {"prompt", "sft_target"} rows'
            ]
        )
    for prompt in {isinstance(p, list): p for p in prompts}.values():
        prompt_ids(tokenizer, prompt, c)


def record(c) -> dict:
    """run_manifest.json's `online`: settings, seeds, scorer (scorers.record) and the user's pairing function."""
    seeds = f"round r, group g: utils.sampling_seed({c.seed}, {STREAM} + r, g)"
    pair, scored = pairing(c)
    out = {"settings": c.online.to_dict(), "seeds": seeds}
    out["scorer"] = scorers.record("online.scorer", c.online.scorer, c) if scored else None  # spin: none

    if c.online.pairing.startswith("python="):
        out["pairing"] = scorers.function_record(pair)
    return out
