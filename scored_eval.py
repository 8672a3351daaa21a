"""Scored evaluation (`eval_scorer`): each evaluation's samples scored, and the policy's sequence KL to the reference on
its own samples: the two axes of the DPO paper's reward-KL frontier (its Figure 2), and the win rate against the
reference. Logged per evaluation, beside the evaluation's other metrics:

  samples/policy_score, samples/reference_score    the mean score of each model's completions (scorers.py)
  samples/win_rate          per prompt 1 if the policy's completion scores above the reference's, 1/2 on a tie, else 0
  samples/policy_length, samples/reference_length  the mean tokens a completion generated, its EOS included
  samples/kl                the mean over the policy's completions y of log pi(y|x) - log pi_ref(y|x), each summed
                            over y's tokens up to its EOS (one no-grad forward of each model over prompt + completion)

Without a reference model (a loss without one, reference_free, or precompute_ref_log_probs: it frees the reference
before the first evaluation) there is nothing to compare: only samples/policy_score and samples/policy_length.

Policy and reference sample from the same seeds (trainers.sample_and_log): with equal weights they draw the same
completions, so at step 0 the KL is exactly 0 and the win rate exactly 0.5, and later a difference is the models'.
The KL estimates KL(pi || pi_ref) when the completions are drawn from pi itself (temperature=1, top_p=1, the
defaults); otherwise it is the mean log-ratio over the completions drawn. Every rank forwards and scores the sample
groups it drew (as many forwards on every rank: collectives under FSDP), then the results are gathered.
"""

from __future__ import annotations

import statistics
from typing import NamedTuple, Optional

import torch

import scorers
from config import SCORER, ConfigError
from logps import IGNORE_INDEX, forward_logps
from sharding import unwrap


def rules(c, world: int) -> list[str]:
    """The config's problems with eval_scorer (config_loader.validate calls this when it is set); the scorer builds
    without loading weights (a rule for the datasets, the function imports, a reward model's config reads)."""
    problems = []
    if not c.sample_during_eval or not c.n_eval_model_samples:
        problems.append(
            f"eval_scorer={c.eval_scorer}: sample_during_eval={str(c.sample_during_eval).lower()}, "
            f"n_eval_model_samples={c.n_eval_model_samples}: no samples to score; sample (sample_during_eval=true, "
            "n_eval_model_samples > 0) or set eval_scorer=null"
        )
    try:
        if SCORER[0](c.eval_scorer):  # a spec of another shape is refused by the field's own rule
            scorers.make("eval_scorer", c.eval_scorer, c)
    except ConfigError as e:
        problems += e.problems
    return problems


class Scored(NamedTuple):
    """One prompt's evaluation: its policy completion's score and length, and where the reference sampled, its
    completion's score and length and the policy's log-ratio on its own completion."""

    group: int
    index: int
    policy_score: float
    policy_length: int
    reference_score: Optional[float]
    reference_length: Optional[int]
    kl: Optional[float]


class ScoredEvaluation:
    """The scorer eval_scorer names (on the trainer's device, as online.scorer's), and what each evaluation logs of its
    samples (`__call__`)."""

    def __init__(self, c, device, tokenizer, policy):
        self.name = f"eval_scorer={c.eval_scorer}"
        self.score = scorers.make("eval_scorer", c.eval_scorer, c, device)
        self.prefix_sharing = c.prefix_sharing
        eos = unwrap(policy).generation_config.eos_token_id  # where generate stops (a chat model's end of turn too)
        self.stops = {tokenizer.eos_token_id, *([eos] if isinstance(eos, int) else eos or [])}

    @torch.no_grad()
    def __call__(self, t, drawn: list[tuple]) -> dict[str, float]:
        """drawn: this rank's (group, batch, the policy's (ids, texts), the reference's or None) in sampling order,
        group -1 a repeat (forwarded, not counted). The KL forwards, this rank's completions scored, all gathered."""
        rows = []  # this rank's prompts: (group, index, prompt, policy text, policy length, reference's or None)
        for group, batch, (ids, texts), reference in drawn:
            inputs, lengths = completions(batch, ids, self.stops)
            against = [None] * len(texts)  # the reference's text, length and the policy's log-ratio
            if reference is not None:  # as many on every rank: each forward is a collective under FSDP
                reference_lengths = completions(batch, reference[0], self.stops)[1]
                against = list(zip(reference[1], reference_lengths, self.log_ratios(t, inputs)))
            if group >= 0:
                rows += [(group, i, batch["prompt"][i], texts[i], lengths[i], against[i]) for i in range(len(texts))]
        problem, scored = None, []
        try:  # every rank reaches the gather below: a bad scorer stops all of them, with its message
            scored = self.scored(rows)
        except Exception as e:  # noqa: BLE001 - the user's scorer may raise anything: say which scorer, and what
            problem = str(e) if isinstance(e, ConfigError) else f"{self.name}: raised {type(e).__name__}: {e}"
        gathered = t.sharding.gather_objects([(problem, scored)], t.sp_size)
        if problems := [p for p, _ in gathered if p]:
            raise ConfigError(problems[:1])
        # in (group, index) order: the same sums at any world size
        return summary(sorted((Scored(*row) for _, part in gathered for row in part), key=lambda r: r[:2]))

    def scored(self, rows: list[tuple]) -> list[Scored]:
        """This rank's rows scored: the policy's completions in one call of the scorer, the reference's in another (a
        reward model batches each by eval_batch_size)."""
        prompts = [row[2] for row in rows]
        policy = scorers.checked(self.name, self.score, prompts, [row[3] for row in rows])
        reference = [None] * len(rows)
        if rows and rows[0][5] is not None:
            reference = scorers.checked(self.name, self.score, prompts, [row[5][0] for row in rows])
        return [
            Scored(group, i, score, length, against_score, *(against[1:] if against else (None, None)))
            for (group, i, _, _, length, against), score, against_score in zip(rows, policy, reference)
        ]

    def log_ratios(self, t, inputs: dict) -> list[float]:
        """log pi(y|x) - log pi_ref(y|x) of each row's completion, by the trainer's path (sharding.forward,
        forward_logps, its row layout and head) in each model's precision; plain rows where the run's layout lays
        out pairs sharing a prompt (prefix_sharing): these are single sequences."""
        paths = dict(layout=None if self.prefix_sharing else t.layout, head=t.head)
        with t.autocast():
            policy = t.sharding.forward(
                t.policy, forward_logps, {k: v.to(t.device) for k, v in inputs.items()}, **paths
            )
        reference = t.reference.forward(inputs, **paths)
        return (policy.sums.double() - reference.sums.to(policy.sums.device).double()).tolist()


def completions(batch: dict, new: torch.Tensor, stops: set) -> tuple[dict, list[int]]:
    """Rows of prompt + completion for forward_logps, right-padded, labelled on the completion's tokens only (up to and
    including its first stop token; what generate wrote after it is padding), and each completion's length."""
    rows, lengths = [], []
    for prompt, mask, tokens in zip(batch["prompt_input_ids"], batch["prompt_attention_mask"], new.tolist()):
        end = next((i + 1 for i, x in enumerate(tokens) if x in stops), len(tokens))  # no stop: all were generated
        rows.append((prompt[mask.bool()].tolist(), tokens[:end]))  # the prompt without its left padding
        lengths.append(end)
    width = max(len(prompt) + len(y) for prompt, y in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full_like(ids, IGNORE_INDEX)
    attention = torch.zeros_like(ids)
    for r, (prompt, y) in enumerate(rows):
        ids[r, : len(prompt) + len(y)] = torch.tensor(prompt + y)
        labels[r, len(prompt) : len(prompt) + len(y)] = torch.tensor(y)
        attention[r, : len(prompt) + len(y)] = 1
    return {"input_ids": ids, "attention_mask": attention, "labels": labels}, lengths


def summary(rows: list[Scored]) -> dict[str, float]:
    """The logged means over every prompt; the reference's and the comparisons only where it sampled."""
    names = ["policy_score", "policy_length"]
    if rows[0].reference_score is not None:
        names += ["reference_score", "reference_length", "kl"]
    metrics = {f"samples/{name}": statistics.fmean(getattr(row, name) for row in rows) for name in names}
    if rows[0].reference_score is not None:  # a tie is half a win: equal models score 0.5
        wins = [
            1.0 if r.policy_score > r.reference_score else 0.5 * (r.policy_score == r.reference_score) for r in rows
        ]
        metrics["samples/win_rate"] = statistics.fmean(wins)
    return metrics
