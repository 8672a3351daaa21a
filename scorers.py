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
    module, _, name = arg.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except Exception as e:  # noqa: BLE001 - the user's module: whatever stops its import
        raise ConfigError([f"{key}={spec}: cannot import {name} from {module} ({e!r})"]) from None


def reward_model(setting: str, path: str, c, device):
    """A sequence-classification model's logit for prompt + completion, in batches of eval_batch_size on the device."""
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
    model = transformers.AutoModelForSequenceClassification.from_pretrained(path, trust_remote_code=remote)
    model = model.to(device).eval()
    model.config.pad_token_id = tokenizer.pad_token_id  # it scores the last token before the padding
    options = dict(return_tensors="pt", padding=True, truncation=True, max_length=c.max_length)
    chat = lambda messages: tokenizer.apply_chat_template(messages, tokenize=False)  # a chat prompt: its template

    @torch.no_grad()
    def score(prompts: list, completions: list[str]) -> list[float]:
        texts = [p + x if isinstance(p, str) else chat(p + [assistant(x)]) for p, x in zip(prompts, completions)]
        step = c.eval_batch_size
        batches = [tokenizer(texts[s : s + step], **options) for s in range(0, len(texts), step)]
        return [v for b in batches for v in model(**b.to(device)).logits[:, 0].float().tolist()]

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
        function = make(key, spec, c)
        source = hashlib.sha256(inspect.getsource(function).encode()).hexdigest()
        scorer.update(module=function.__module__, function=function.__qualname__, source_sha256=source)
    if kind == "reward_model":
        files = sorted(p for p in Path(arg).rglob("*") if p.is_file())
        scorer["sha256"] = {str(p.relative_to(arg)): file_sha256(p) for p in files}
    return scorer
