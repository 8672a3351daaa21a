"""self_check.py: every run checks itself before its first optimizer step, and a fault stops it (exit code 4).

Each fault below is one the check exists for, injected on purpose: a head the tiled path does not reproduce, a broken
packed or shared-prefix mask, a corrupted reference cache, a fault on one FSDP rank only. A reference that does not
start as the policy (another archive, another dtype) is no fault. The architecture matrix (test_architectures.py,
test_every_matrix_run_checked_itself) runs the checks under BasicTrainer, FSDP1 and FSDP2 without a false alarm.
"""

import contextlib
import io
import json
import math
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from types import SimpleNamespace
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

import packing
import self_check
import sharding
import tiled_head
import train as train_py
import trainers
from config_loader import load_config
from utils import get_open_port

from conftest import LOCAL_DIRS  # runs and caches in a temporary directory

REPO = Path(__file__).resolve().parent.parent
TOY = REPO / "toy" / "tiny-llama"
FAST = [
    "model=tiny",
    "datasets=[toy]",
    "loss=dpo",
    "optimizer=SGD",
    "lr=0.1",
    "warmup_steps=0",
    "batch_size=8",
    "eval_batch_size=8",
    "n_eval_examples=8",
    "n_epochs=null",
    "n_examples=8",
    "eval_every=8",
    "max_length=64",
    "max_prompt_length=32",
    "do_first_eval=false",
    "sample_during_eval=false",
    "wandb.enabled=false",
    LOCAL_DIRS,
]


def run(run_dir: Path, *args) -> tuple[int, str, dict]:
    """train.py in this process: (exit code, what it printed, self_check.json or {})."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = train_py.main([*FAST, f"run_dir={run_dir}", *args])
    report = run_dir / self_check.REPORT
    return code, out.getvalue(), json.loads(report.read_text()) if report.exists() else {}


def checks(report: dict) -> dict:
    return {c["check"]: c for c in report["checks"]}


def scaled_head(monkeypatch, factor: float = 1.25):
    """Models whose forward() multiplies its logits (a head multiplier in the model's code, as HyperCLOVAX's or a
    muP model's, or a wrapper's): the model's own forward applies it, the tiled head reads the weight alone and does
    not."""
    load = train_py.load_models

    def load_models(*args, **kwargs):
        tokenizer, policy, reference = load(*args, **kwargs)
        for model in filter(None, (policy, reference)):

            def scaled(*inputs, forward=model.forward, **options):
                out = forward(*inputs, **options)
                out["logits"] = out.logits * factor
                return out

            model.forward = scaled
        return tokenizer, policy, reference

    monkeypatch.setattr(train_py, "load_models", load_models)


def leaky_masks(monkeypatch):
    """Packed and shared-prefix rows whose mask is plain causal over the whole row: each sequence attends to the ones
    packed before it, a rejected to its chosen."""
    build = packing.packed_attention_mask

    def packed_attention_mask(mask, config, positions=None):
        causal = torch.ones(mask.shape[-2:], dtype=torch.bool, device=mask.device).tril()
        return build(causal.expand_as(mask).clone(), config, positions)

    monkeypatch.setattr(packing, "packed_attention_mask", packed_attention_mask)


TILED = "tiled_lm_head=true"


@pytest.mark.parametrize("args,code", [((TILED,), 4), ((), 0), ((TILED, "self_check=false"), 0)])
def test_a_head_the_tiled_path_does_not_reproduce_stops_the_run(tmp_path, monkeypatch, args, code):
    """A 1.25 logit multiplier: the tiled head's log-probs differ from the model's own, the run stops before any step
    (exit 4) naming the check, its difference and tolerance and tiled_lm_head=false, and keeps what it wrote; without
    the tiled head (the default) the same model trains (the reference equals the policy: ln 2); self_check=false skips
    the checks."""
    scaled_head(monkeypatch)
    exit_code, printed, report = run(tmp_path / "run", *args)
    assert exit_code == code, printed[-3000:]
    if "self_check=false" in args:
        assert not report and "self-check" not in printed
        return
    head = checks(report).get("head")
    if code == 4:
        assert head["passed"] is False and head["difference"] > head["tolerance"] == 1e-3
        assert "error: self-check failed: head" in printed and "set tiled_lm_head=false" in printed
        assert f"tolerance {head['tolerance']:g} for float32" in printed and report["failure"] in printed
        kept = {p.name for p in (tmp_path / "run").iterdir()}
        assert {"config.yaml", "run_manifest.json", self_check.REPORT} <= kept
        assert not any(name.startswith("step-") for name in kept)
        assert not (tmp_path / "run" / "metrics.jsonl").exists()  # no step was taken
    else:
        assert head is None and report["passed"] and "self-check reference:" in printed
        assert checks(report)["reference"]["step0_loss"] == pytest.approx(math.log(2), abs=1e-6)


@pytest.fixture(scope="module")
def long_prompts(tmp_path_factory) -> list[str]:
    """A Llama of Llama-3's vocabulary (128256; hidden size 16) and 4 pairs whose prompts are 309 tokens, with their
    train.py arguments: the probe's 8 rows at that vocabulary once kept only their first 261 columns, all prompt."""
    root = tmp_path_factory.mktemp("long")
    sizes = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    config = LlamaConfig(vocab_size=128256, max_position_embeddings=512, initializer_range=0.2, **sizes)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "model")
    AutoTokenizer.from_pretrained(TOY).save_pretrained(root / "model")
    prompt = "\n\nHuman: " + " ".join(["Describe rain and snow."] * 60) + "\n\nAssistant:"
    pairs = [dict(prompt=f"{prompt} {i}", chosen=" rain falls.", rejected=" snow falls.") for i in range(4)]
    for split in ("train", "test"):
        (root / f"{split}.jsonl").write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    data = [f"datasets=[{root}/{{split}}.jsonl]", "max_length=340", "max_prompt_length=320"]
    return [f"model.name_or_path={root / 'model'}", *data, "batch_size=4", "n_examples=4", "n_eval_examples=4"]


def test_a_head_fault_past_long_prompts_stops_the_run(tmp_path, monkeypatch, long_prompts):
    """Llama-3's vocabulary, prompts over 300 tokens and a forward that scales its logits by 1.1: the head check
    compares the responses' tokens (the model's own logits at the scored positions alone), says how many, and stops
    the run; it once compared the prompts' first columns, none scored, and passed with a difference of 0."""
    scaled_head(monkeypatch, 1.1)
    code, printed, report = run(tmp_path / "run", *long_prompts, TILED)
    assert code == 4, printed[-3000:]
    head = checks(report)["head"]
    assert head["tokens"] == checks(report)["reference"]["tokens"] > 0 and not head["passed"]
    assert f"over {head['tokens']} scored tokens" in printed and "set tiled_lm_head=false" in printed


def test_a_check_that_compared_no_token_fails():
    """Rows without a scored token: the head check compared nothing, and fails instead of passing with 0."""
    model = AutoModelForCausalLM.from_pretrained(TOY).eval()
    ids = torch.randint(3, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=torch.full_like(ids, -100))
    t = SimpleNamespace(policy=model, sp=None, autocast=contextlib.nullcontext, device=torch.device("cpu"))
    t.sharding = sharding.OneProcess(model, SimpleNamespace(activation_checkpointing=False))
    with torch.no_grad():
        (head,) = tiled_head.Head().probe(t, {}, inputs, None, torch.float32)
    assert head["tokens"] == 0 and not head["passed"]
    assert "compared no scored token" in self_check.failure_line(head)


@pytest.fixture(scope="module")
def spread_logits(tmp_path_factory) -> Path:
    """The toy model, its LM head times 4: a logit temperature 10% off then moves its tokens by about 0.1 nats, as it
    moves a trained model's by 0.1 to 0.3 (the toy's own logits, near uniform, by 0.02)."""
    model = AutoModelForCausalLM.from_pretrained(TOY)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)
    path = tmp_path_factory.mktemp("spread") / "model"
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(TOY).save_pretrained(path)
    return path


@pytest.mark.parametrize("factor,code", [(1.1, 4), (1.0, 0)])
def test_a_logit_temperature_ten_percent_off_stops_a_bf16_run(tmp_path, monkeypatch, spread_logits, factor, code):
    """bf16: a forward that scales its logits by 1.1 moves each token by more than the head check's own tolerance
    (less than the layout's 0.2, which once let it pass); the same model without the fault trains."""
    scaled_head(monkeypatch, factor)
    args = [f"model.name_or_path={spread_logits}", "fsdp.mixed_precision={param_dtype: bf16}", TILED]
    exit_code, printed, report = run(tmp_path / "run", *args)
    assert exit_code == code, printed[-3000:]
    head = checks(report)["head"]
    assert head["tolerance"] == self_check.HEAD_TOLERANCE[torch.bfloat16] and head["dtype"] == "bfloat16"
    if code == 4:
        assert head["tolerance"] < head["difference"] < self_check.TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("option", ["padding_free=true", "prefix_sharing=true"])
def test_a_broken_packed_or_shared_prefix_mask_stops_the_run(tmp_path, monkeypatch, option):
    """Sequences that see each other in a packed row, or a rejected that sees its chosen: the layout check fails and
    names the key that turns the layout off; the tiled head's check (padded rows) still passes."""
    leaky_masks(monkeypatch)
    code, printed, report = run(tmp_path / "run", option, TILED)
    assert code == 4, printed[-3000:]
    assert checks(report)["head"]["passed"] and not checks(report)["layout"]["passed"]
    assert "self-check failed: layout" in printed and f"set {option.replace('true', 'false')}" in printed


def test_a_corrupted_reference_cache_entry_stops_the_run(tmp_path):
    """precompute_ref_log_probs: a first run fills the cache (its check passes), one cached value is then changed by
    one nat, as a stale or damaged file would; the next run reads it and stops before training."""
    args = [f"local_dirs=[{tmp_path}]", "precompute_ref_log_probs=true"]
    code, printed, report = run(tmp_path / "first", *args)
    assert code == 0, printed[-3000:]
    assert checks(report)["cache"]["passed"] and checks(report)["cache"]["difference"] < 1e-6
    path = next((tmp_path / "reference_logps").glob("train-*.pt"))
    table = torch.load(path, weights_only=True)
    table[report["example_index"][0], 1] += 1.0  # the rejected of the probe's first pair
    torch.save(table, path)
    code, printed, report = run(tmp_path / "second", *args)
    assert code == 4 and not checks(report)["cache"]["passed"], printed[-3000:]
    assert "self-check failed: cache" in printed and "precompute_ref_log_probs=false" in printed


@pytest.fixture(scope="module")
def archive(tmp_path_factory) -> Path:
    """A policy.pt of the toy model with its weights moved: another model than the one it was saved from."""
    model = AutoModelForCausalLM.from_pretrained(TOY)
    torch.manual_seed(0)
    state = {k: v + 0.02 * torch.randn_like(v) for k, v in model.state_dict().items()}
    path = tmp_path_factory.mktemp("archive") / "policy.pt"
    torch.save({"step_idx": 0, "state": state, "metrics": {}}, path)
    return path


@pytest.mark.parametrize("reference", ["another archive", "model.reference_dtype=bf16"])
def test_a_reference_that_is_not_the_policy_raises_no_false_alarm(tmp_path, monkeypatch, archive, reference):
    """The policy from an archive and the reference from the base weights (or the reference in bf16): step 0 is not
    at zero margin, and the check, deciding from the weights themselves, says so instead of failing."""
    args = [f"model.archive={archive}"]
    if reference == "another archive":
        load = train_py.load_models

        def load_models(*a, **k):
            tokenizer, policy, ref = load(*a, **k)
            ref.load_state_dict(AutoModelForCausalLM.from_pretrained(TOY).state_dict())
            return tokenizer, policy, ref

        monkeypatch.setattr(train_py, "load_models", load_models)
    else:
        args.append(reference)
    code, printed, report = run(tmp_path / "run", *args)
    assert code == 0, printed[-3000:]
    assert "the reference's weights are not the policy's" in checks(report)["reference"]["skipped"] and report["passed"]
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert abs(first["loss/train"] - math.log(2)) > 1e-6  # not ln 2: the case a pinned ln 2 would call a bug


def test_kto_on_unpaired_rows(tmp_path):
    """KTO with pairs_to_unpaired (one completion a row), packed rows and the tiled head: head, layout and reference
    pass on the same scored tokens, head and layout by their mean per token (the largest per sequence logged), and the
    step-0 loss is KTO's at zero margin (1 - sigma(0) = 0.5 per completion, the weights being 1)."""
    code, printed, report = run(tmp_path / "run", "loss=kto", "pairs_to_unpaired=true", "padding_free=true", TILED)
    assert code == 0, printed[-3000:]
    found = checks(report)
    assert set(found) == {"head", "layout", "reference"} and report["passed"]
    assert found["head"]["tokens"] == found["layout"]["tokens"] == found["reference"]["tokens"] > 0
    for name, measure in (("head", "mean"), ("layout", "mean"), ("reference", "largest")):
        assert found[name]["measure"] == measure and found[name]["difference"] == found[name][measure], found[name]
    assert found["reference"]["step0_loss"] == pytest.approx(found["reference"]["zero_margin_loss"])
    assert found["reference"]["zero_margin_loss"] == pytest.approx(0.5)


def test_the_launcher_of_several_processes_exits_4_with_the_ranks_message(tmp_path, monkeypatch):
    """Spawned ranks leave with exit code 4 on a failed check; the launcher raises it again with the message rank 0
    wrote, and main() returns 4 keeping the run directory."""
    run_dir = tmp_path / "run"

    class Ranks:  # what torch.multiprocessing.start_processes returns, for ranks that failed their check
        def __init__(self, *args, **kwargs):
            (run_dir / self_check.REPORT).write_text(json.dumps({"failure": "self-check failed: layout (...)"}))

        def join(self):
            raise mp.ProcessExitedException("exited", error_index=0, error_pid=1, exit_code=4)

        def pids(self):
            return []

    monkeypatch.setattr(mp, "start_processes", Ranks)
    code, printed, _ = run(run_dir, "trainer=FSDPTrainer", "n_workers=2")
    assert code == 4 and "error: self-check failed: layout (...)" in printed and run_dir.is_dir()


# --- under FSDP: every rank agrees, whichever rank saw the fault ---
def worker(rank: int, world_size: int, port: int, out: str):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    verdicts = {}
    try:
        for strategy in ("fsdp", "fsdp2"):
            run_dir = Path(out) / strategy
            cfg, _ = load_config(
                [*FAST, "trainer=FSDPTrainer", f"fsdp.strategy={strategy}", TILED, f"run_dir={run_dir}"],
                world_size=world_size,
            )
            run_dir.mkdir(exist_ok=True)
            tokenizer, policy, reference = train_py.load_models(cfg, on_meta=rank != 0)
            trainer = trainers.FSDPTrainer(policy, cfg, cfg.seed, str(run_dir), reference, rank, world_size, tokenizer)

            def shifted(inputs, per_token=False, forward=trainer.reference.forward):
                out = forward(inputs, per_token)
                return out._replace(sums=out.sums + 1.0)

            if rank == 1:  # the fault on one rank only: its reference scores one nat more per sequence
                trainer.reference.forward = shifted
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    trainer.train()
                verdicts[strategy] = "trained"
            except self_check.SelfCheckError as e:
                verdicts[strategy] = str(e)
    finally:
        torch.save(verdicts, Path(out) / f"verdicts-{rank}.pt")
        dist.destroy_process_group()


def test_under_fsdp_every_rank_stops_when_one_rank_sees_a_fault(tmp_path):
    """FSDP1 and FSDP2 on 2 gloo ranks, rank 1's reference off by one nat per sequence: rank 0's own pairs pass, yet
    both ranks stop (no rank left waiting in a collective) and rank 0's report holds rank 1's difference."""
    mp.spawn(worker, args=(2, get_open_port(), str(tmp_path)), nprocs=2, join=True)
    verdicts = [torch.load(tmp_path / f"verdicts-{rank}.pt") for rank in range(2)]
    for strategy in ("fsdp", "fsdp2"):
        assert all(v[strategy].startswith("self-check failed: reference") for v in verdicts), verdicts
        report = json.loads((tmp_path / strategy / self_check.REPORT).read_text())
        assert not checks(report)["reference"]["passed"] and checks(report)["head"]["passed"]
