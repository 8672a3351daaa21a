"""Scorers of sampled completions: score(prompts, completions) -> one float per completion, named by a spec: `rule` (the
toy task's own), `reward_model=<directory>` (a sequence classifier's logit), `python=<module>:<function>` (the user's).
Semi-online DPO's rounds (online.scorer) and scored evaluation (eval_scorer) read them; imported only for those.
"""

import hashlib
import importlib
import inspect
import math
import numbers
from pathlib import Path

import torch

import sources
from config import ConfigError
from utils import file_sha256

assistant = lambda text: {"role": "assistant", "content": text}  # a chat reply


def make(key: str, spec: str, c, device=None):
    """The scorer `spec` (config key `key`) names, as score(prompts, completions) -> floats; without a device only
    checked (a reward model's config read, no weights)."""
    kind, _, arg = spec.partition("=")
    if kind == "rule":
        if (rule := sources.sample_rule(c.datasets)) is None:
            raise ConfigError([f"{key}=rule: datasets={list(c.datasets)} have no checkable rule (toy has one)"])
        return lambda prompts, completions: [float(rule(x)) for x in completions]
    if kind == "reward_model":
        return reward_model(f"{key}={spec}", arg, c, device)
    return user_function(f"{key}={spec}", arg)


def user_function(setting: str, arg: str):
    """The function `arg` = <module>:<name> names (the user's scorer, or online.pairing's rule)."""
    module, _, name = arg.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except Exception as e:  # noqa: BLE001 - the user's module: whatever stops its import
        raise ConfigError([f"{setting}: cannot import {name} from {module} ({e!r})"]) from None


def function_record(function) -> dict:
    """What the run manifest keeps of the user's function: module, name and its source's sha256."""
    source = hashlib.sha256(inspect.getsource(function).encode()).hexdigest()
    return {"module": function.__module__, "function": function.__qualname__, "source_sha256": source}


def reward_model(setting: str, path: str, c, device):
    """A sequence-classification model's logit for prompt + completion, in batches of eval_batch_size. The model
    waits on CPU and comes to the device only while it scores: between rounds the training steps have the memory."""
    import transformers

    remote = c.model.trust_remote_code  # the policy's setting: off unless asked
    try:
        labels = transformers.AutoConfig.from_pretrained(path, trust_remote_code=remote).num_labels
    except (OSError, ValueError) as e:
        raise ConfigError([f"{setting}: cannot load its config ({e!r})"]) from None
    if labels != 1:
        raise ConfigError([f"{setting}: num_labels={labels}; expected 1 (one reward)"])
    if device is None:
        return None
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, truncation_side="left", trust_remote_code=remote)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model = transformers.AutoModelForSequenceClassification.from_pretrained(path, trust_remote_code=remote).eval()
    model.config.pad_token_id = tokenizer.pad_token_id  # it scores the last token before the padding
    chat = lambda messages: tokenizer.apply_chat_template(messages, tokenize=False)  # a chat prompt: its template

    def encode(prompt, completion: str) -> list[int]:
        """prompt + completion as the reward model reads it: a chat template's text already holds its special tokens
        (a Llama-3 template begins with BOS: adding them again doubles it, and shifts the score)."""
        if isinstance(prompt, str):
            return tokenizer(prompt + completion, truncation=True, max_length=c.max_length)["input_ids"]
        text = chat(prompt + [assistant(completion)])
        return tokenizer(text, add_special_tokens=False, truncation=True, max_length=c.max_length)["input_ids"]

    @torch.no_grad()
    def score(prompts: list, completions: list[str]) -> list[float]:
        ids = [encode(p, x) for p, x in zip(prompts, completions)]
        step = c.eval_batch_size
        batches = [
            tokenizer.pad({"input_ids": ids[s : s + step]}, return_tensors="pt") for s in range(0, len(ids), step)
        ]
        model.to(device)
        try:
            return [v for b in batches for v in model(**b.to(device)).logits[:, 0].float().tolist()]
        finally:
            model.to("cpu")

    return score


def checked(name: str, score, prompts: list, completions: list[str]) -> list[float]:
    """The scorer's output as floats: one finite number per completion, else a ConfigError naming the scorer."""
    out = score(prompts, completions) if completions else []
    out = out.tolist() if hasattr(out, "tolist") else out  # a tensor or an array
    is_list = isinstance(out, (list, tuple))
    problem = f"returned {len(out)} scores" if is_list else f"returned {type(out).__name__}"
    if is_list and len(out) == len(completions):
        number = lambda v: isinstance(v, numbers.Real) and math.isfinite(v)
        problem = next((f"returned {v!r} for completion {i}" for i, v in enumerate(out) if not number(v)), None)
    if problem:
        raise ConfigError([f"{name}: {problem}; expected a list of {len(completions)} finite numbers"])
    return [float(v) for v in out]


def record(key: str, spec: str, c) -> dict:
    """What the run manifest keeps of a scorer, to check it on resume and replay: its spec and datasets; a function
    by module, name and source sha256; a reward model by its files' sha256."""
    kind, _, arg = spec.partition("=")
    scorer = {"spec": spec, "datasets": list(c.datasets)}
    if kind == "python":
        scorer.update(function_record(make(key, spec, c)))
    if kind == "reward_model":
        files = sorted(p for p in Path(arg).rglob("*") if p.is_file())
        scorer["sha256"] = {str(p.relative_to(arg)): file_sha256(p) for p in files}
    return scorer
