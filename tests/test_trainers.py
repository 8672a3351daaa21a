"""trainers.py pieces: packed (padding-free) and tiled-LM-head log-probs equal the plain padded ones, and
every speed option leaves a training step unchanged."""

import contextlib
import shutil
import io
import json
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
)

import architectures
import logps
import packing
import preference_datasets as data
import fsdp
import sharding
import train as train_py
import checkpoints
import lora
import trainers
from config_loader import load_config
from utils import disable_dropout

from conftest import LOCAL_DIRS  # runs and caches in a temporary directory

REPO = Path(__file__).resolve().parent.parent


def tiny_models():
    torch.manual_seed(0)
    models = {
        "gpt2": GPT2LMHeadModel(
            GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=512, n_positions=128, bos_token_id=0, eos_token_id=1)
        ),
        "llama": LlamaForCausalLM(
            LlamaConfig(
                num_hidden_layers=2,
                hidden_size=32,
                intermediate_size=64,
                num_attention_heads=4,
                num_key_value_heads=2,
                vocab_size=512,
                max_position_embeddings=128,
            )
        ),
        "neox": GPTNeoXForCausalLM(
            GPTNeoXConfig(
                num_hidden_layers=2,
                hidden_size=32,
                num_attention_heads=2,
                intermediate_size=64,
                vocab_size=512,
                max_position_embeddings=128,
                bos_token_id=0,
                eos_token_id=1,
            )
        ),
    }
    for model in models.values():
        disable_dropout(model)  # as train.py does: log-probs must be a function of the weights
    return models


@pytest.fixture(scope="module")
def skewed_inputs():
    """Chosen over rejected of 8 toy pairs, two of them made long: padded rows are mostly padding."""
    tok = AutoTokenizer.from_pretrained(REPO / "toy" / "tiny-llama")
    tok.pad_token = tok.eos_token
    examples = data.load_tokenized(["toy"], tok, "test", max_length=64, max_prompt_length=32)
    batch = next(data.get_batch_iterator(examples, tok.pad_token_id, batch_size=8, shuffle=False, n_epochs=1))
    inputs = logps.concatenated_inputs(batch)
    long = torch.randint(3, 500, (2, 90))
    width = 90
    padded = {
        k: logps.pad_to_length(v, width, {"input_ids": 0, "attention_mask": 0, "labels": -100}[k])
        for k, v in inputs.items()
    }
    padded["input_ids"][:2], padded["attention_mask"][:2] = long, 1
    padded["labels"][:2] = torch.where(torch.arange(width) < 20, -100, long)
    return padded


@pytest.mark.parametrize("name", ["gpt2", "llama", "neox"])
def test_packed_and_tiled_logps_equal_padded(skewed_inputs, name):
    model = tiny_models()[name].eval()
    base_sums, base_counts, base_entropy, *_ = logps.forward_logps(model, skewed_inputs)
    kwargs, _, owner, _ = packing.packed_inputs(skewed_inputs, 96)
    assert kwargs["input_ids"].numel() < skewed_inputs["input_ids"].numel() * 0.6  # the padding really went away
    for options in ({"packed_capacity": 96}, {"tiled": True}, {"packed_capacity": 96, "tiled": True}):
        seams = architectures.seams(model, **options)
        sums, counts, entropy, *_ = logps.forward_logps(model, skewed_inputs, **seams)
        # sums of ~450 nats over hundreds of tokens: fp32's summation order differs in the last bits
        torch.testing.assert_close(sums, base_sums, atol=1e-5, rtol=1e-6)
        assert torch.equal(counts, base_counts)
        torch.testing.assert_close(entropy, base_entropy, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["gpt2", "llama", "neox"])
def test_packed_and_tiled_gradients_equal_padded(skewed_inputs, name):
    grads = []
    for options in ({}, {"packed_capacity": 96, "tiled": True}):
        model = tiny_models()[name]
        sums, counts, _, *_ = logps.forward_logps(model, skewed_inputs, **architectures.seams(model, **options))
        (sums / counts).sum().backward()
        grads.append({k: p.grad for k, p in model.named_parameters()})
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], atol=1e-5, rtol=1e-4, msg=k)


@pytest.mark.parametrize(
    "options", [{"packed_capacity": 96}, {"prefix_sharing": True}, {"prefix_sharing": True, "packed_capacity": 96}]
)
def test_a_labelled_first_token_is_never_scored_from_the_row_before(options):
    """Pairs without a prompt (labels from column 0; chosen and rejected differ at once): no output predicts a
    sequence's first token, so it is not scored, and packed or shared rows must not score it from the sequence
    before it in the row: counts and sums equal the padded path's."""
    model = tiny_models()["llama"].eval()
    ids = torch.randint(3, 500, (4, 12), generator=torch.Generator().manual_seed(5))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    base = logps.forward_logps(model, inputs)
    out = logps.forward_logps(model, inputs, **architectures.seams(model, **options))
    assert torch.equal(out.counts, base.counts) and base.counts.tolist() == [11] * 4
    torch.testing.assert_close(out.sums, base.sums, atol=1e-5, rtol=0)


def test_packing_is_first_fit_decreasing_and_restarts_positions(skewed_inputs):
    kwargs, labels, owner, _ = packing.packed_inputs(skewed_inputs, 64)
    lengths = skewed_inputs["attention_mask"].sum(1)
    for i in range(len(lengths)):  # every sequence appears once, whole, with positions 0..len-1
        rows, cols = (owner == i).nonzero(as_tuple=True)
        assert len(set(rows.tolist())) == 1 and len(cols) == lengths[i]
        assert kwargs["position_ids"][rows, cols].tolist() == list(range(lengths[i]))
    mask = kwargs["attention_mask"][:, 0]
    assert not mask[
        owner[:, :, None].expand_as(mask) != owner[:, None, :].expand_as(mask)
    ].any()  # no cross-sequence attention


FAST = [
    "model=tiny",
    "datasets=[toy]",
    "warmup_steps=0",
    "batch_size=8",
    "eval_batch_size=8",
    "n_eval_examples=8",
    "max_length=64",
    "max_prompt_length=32",
    "fsdp.use_torch_compile=false",
    "wandb.enabled=false",
    "n_epochs=null",
    "loss=dpo",
    "optimizer=SGD",
    "lr=1.0",
    "n_examples=16",
    "eval_every=16",
    "do_first_eval=false",
    "sample_during_eval=false",
    LOCAL_DIRS,
]


def run(run_dir, *args) -> dict:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert train_py.main([*FAST, f"run_dir={run_dir}", *args]) == 0
    return torch.load(Path(run_dir) / "LATEST" / "policy.pt", weights_only=True)["state"]


def test_every_speed_option_leaves_two_training_steps_unchanged(tmp_path):
    """Two SGD steps with lr 1 (the parameter change is the gradient) under each option, against the plain path
    (padded rows, the model's full logits): the tiled head alone and with each other option, and shared packed rows
    through the full logits."""
    plain = run(tmp_path / "plain")
    tiled = "tiled_lm_head=true"
    for name, options in {
        "tiled": [tiled],
        "packed": ["padding_free=true", tiled],
        "token_budget": ["max_tokens_per_microbatch=80", tiled],
        "precomputed": ["precompute_ref_log_probs=true", "padding_free=true", tiled],
        "shared": ["prefix_sharing=true", tiled],
        "shared_packed": ["prefix_sharing=true", "padding_free=true"],
        "shared_budget": [
            "prefix_sharing=true",
            "max_tokens_per_microbatch=80",
            "precompute_ref_log_probs=true",
            tiled,
        ],
    }.items():
        state = run(tmp_path / name, *options)
        worst = max((state[k] - plain[k]).abs().max().item() for k in plain)
        assert worst <= 1e-5, (name, worst)


def test_beta_dpo_resumes_exactly_with_its_running_margins(tmp_path):
    """beta-DPO keeps a running mean and spread of the margins: trained state. Three steps straight equal one step,
    a checkpoint and a resume for two more, bit for bit (the filter's draws are seeded by seed and step); resumed
    without that state (as if it were not checkpointed), the last steps differ."""
    options = ["loss.dynamic_beta=0.5", "loss.dynamic_beta_filter=0.25", "eval_every=8", "minimum_log_interval_secs=0"]
    whole = run(tmp_path / "whole", *options, "n_examples=24")
    run(tmp_path / "split", *options, "n_examples=8")
    shutil.copytree(tmp_path / "split", tmp_path / "forgot", symlinks=True)
    resumed = run(tmp_path / "split", *options, "n_examples=24", f"resume_from={tmp_path / 'split'}")
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    state = tmp_path / "forgot" / "LATEST" / "trainer_state.pt"
    saved = torch.load(state, weights_only=True)
    assert saved["beta_dpo_running"] is not None
    torch.save(dict(saved, beta_dpo_running=None), state)
    checkpoints.write_manifest((tmp_path / "forgot" / "LATEST").resolve(), 0, 1)
    forgot = run(tmp_path / "forgot", *options, "n_examples=24", f"resume_from={tmp_path / 'forgot'}")
    assert not all(torch.equal(whole[k], forgot[k]) for k in whole)


def test_precomputed_reference_equals_online_and_is_read_from_the_cache(tmp_path):
    """Precomputed equals online: the same weights after two steps and the same rewards. Then the cache is what a
    later run reads: shifting its chosen column by +1 nat shifts that run's chosen rewards by -beta = -0.1
    (rewards are beta * (policy - reference)) and leaves the rejected rewards alone."""
    cache, log_all = "local_dirs=[" + str(tmp_path / "cache") + "]", "minimum_log_interval_secs=0"
    online = run(tmp_path / "online", log_all)
    first = run(tmp_path / "first", "precompute_ref_log_probs=true", cache, log_all)
    assert max((first[k] - online[k]).abs().max().item() for k in online) <= 1e-5

    def first_step(name):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return next(r for r in map(json.loads, lines) if "loss/train" in r)

    assert first_step("first")["rewards_train/chosen"] == pytest.approx(
        first_step("online")["rewards_train/chosen"], abs=1e-6
    )
    tables = sorted((tmp_path / "cache" / "reference_logps").glob("*.pt"))
    assert [p.name.split("-")[0] for p in tables] == ["test", "train"]
    for path in tables:
        table = torch.load(path, weights_only=True)
        table[:, 0] += 1.0
        torch.save(table, path)
    # self_check=false: the self-check would stop a run reading a damaged cache (tests/test_self_check.py)
    run(tmp_path / "second", "precompute_ref_log_probs=true", cache, log_all, "self_check=false")
    before, after = first_step("first"), first_step("second")
    assert after["rewards_train/chosen"] == pytest.approx(before["rewards_train/chosen"] - 0.1, abs=1e-5)
    assert after["rewards_train/rejected"] == pytest.approx(before["rewards_train/rejected"], abs=1e-6)


def test_fused_adamw_and_bf16_autocast_in_one_process(tmp_path):
    """fused_optimizer gives AdamW's result; fsdp.mixed_precision autocasts the forward to bf16 (loss within 1e-2)."""
    adamw = ["optimizer=AdamW", "lr=1e-4", "minimum_log_interval_secs=0"]
    plain = run(tmp_path / "plain", *adamw)
    fused = run(tmp_path / "fused", *adamw, "fused_optimizer=true")
    assert max((fused[k] - plain[k]).abs().max().item() for k in plain) <= 1e-6
    run(tmp_path / "bf16", *adamw, "fsdp.mixed_precision={param_dtype: bf16}")
    traces = {}
    for name in ("plain", "bf16"):
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        traces[name] = [r["loss/train"] for r in records if "loss/train" in r]
        assert all(r["throughput/tokens_per_second"] > 0 for r in records if "loss/train" in r)
    assert len(traces["bf16"]) == 2 and traces["bf16"] != traces["plain"]  # bf16 really ran
    assert traces["bf16"][0] == pytest.approx(0.6931472, abs=1e-6)  # the reference computes in bf16 too: step 0 is ln 2
    assert max(abs(a - b) for a, b in zip(traces["plain"], traces["bf16"])) < 1e-2


def test_token_budget_groups_pairs_and_trims_padding(skewed_inputs):
    n = skewed_inputs["input_ids"].size(0) // 2
    batch = {
        f"{side}_{k}": v[sl]
        for side, sl in (("chosen", slice(0, n)), ("rejected", slice(n, None)))
        for k, v in skewed_inputs.items()
    }
    batch["prompt"] = [str(i) for i in range(n)]
    micro = trainers.split_by_tokens(batch, 100)
    assert sum(len(m["prompt"]) for m in micro) == n and len(micro) > 1
    sizes = [int(m["chosen_attention_mask"].sum() + m["rejected_attention_mask"].sum()) for m in micro]
    assert all(s <= 100 or len(m["prompt"]) == 1 for s, m in zip(sizes, micro))  # within budget, or one big pair
    assert all(m["chosen_input_ids"].size(1) == int(m["chosen_attention_mask"].sum(1).max()) for m in micro)


@pytest.mark.parametrize("tiled", [False, True])
def test_logps_follow_the_lm_head_to_another_device(skewed_inputs, tiled, monkeypatch):
    """device_map on several GPUs: inputs on the first device, the LM head (and so hidden states and logits) on
    the last. CPU has one device, so the head goes to `meta` with a pre-hook moving its input there, as
    accelerate's device_map hooks do; every tensor forward_logps indexes must follow it to `meta` (a mask or
    label left on the input device raises). Meta cannot run data-dependent masking, so nonzero is told to
    assume every element is selected: shapes, not values, are what this checks."""
    import torch.fx.experimental._config as fx_config

    monkeypatch.setattr(torch, "autocast", lambda *a, **k: contextlib.nullcontext())  # no autocast on meta
    model = tiny_models()["llama"].eval()
    head = model.get_output_embeddings().to("meta")
    head.register_forward_pre_hook(lambda module, args: tuple(a.to("meta") for a in args))
    # torch's config modules serve their attributes through a module __getattr__: patch them with their own
    # `patch`, which restores the value, not with monkeypatch, whose undo deletes the attribute (pytest >= 9.2)
    with torch.no_grad(), fx_config.patch(meta_nonzero_assume_all_nonzero=True):
        sums, counts, _, *_ = logps.forward_logps(model, skewed_inputs, **architectures.seams(model, tiled=tiled))
    n = skewed_inputs["input_ids"].size(0)
    assert sums.device.type == counts.device.type == "meta" and sums.shape == counts.shape == (n,)


def test_offloaded_optimizer_state_steps_on_the_parameters_device():
    """fsdp.optimizer_offload with parameters kept on CPU (FSDP1 CPUOffload, FSDP2 CPUOffloadPolicy) while the
    trainer's device is the GPU: the Adam state must come to the parameters' device for the step, and go back to
    CPU after it. `meta` stands in for the GPU (a step on CPU parameters with state there raises)."""
    from types import SimpleNamespace

    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1)
    shards = object.__new__(fsdp.FSDP2)  # only the step under test: no process group needed
    shards.fsdp, shards.device = SimpleNamespace(optimizer_offload=True), torch.device("meta")
    expected = torch.nn.Linear(4, 3)
    expected.load_state_dict(layer.state_dict())
    expected_optimizer = torch.optim.AdamW(expected.parameters(), lr=0.1)
    for _ in range(2):  # the second step is the one that reads offloaded state
        for model in (layer, expected):
            model.zero_grad()
            model(torch.ones(2, 4)).pow(2).sum().backward()
        shards.step(optimizer)
        expected_optimizer.step()
    assert {v.device.type for s in optimizer.state.values() for v in s.values()} == {"cpu"}
    for a, b in zip(layer.parameters(), expected.parameters()):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_torch_compile_is_on_by_default_only_on_cuda(tiny_trainer_cpu):
    """With an entropy bonus (loss.entropy_coeff > 0) the policy's head is the bonus's: null (the default) compiles its
    kernel only on CUDA; true set explicitly is honoured on CPU. The reference's head stays the plain one."""
    default, explicit = tiny_trainer_cpu
    assert default.policy_head.options["use_compile"] is False
    assert explicit.policy_head.options["use_compile"] is True
    assert default.head is explicit.head is None


@pytest.fixture(scope="module")
def tiny_trainer_cpu(tmp_path_factory):
    out = []
    for extra in (["loss.entropy_coeff=0.01"], ["fsdp.use_torch_compile=true", "loss.entropy_coeff=0.01"]):
        cfg, _ = load_config(
            [
                "model=tiny",
                "loss=sft",
                "batch_size=8",
                "eval_batch_size=8",
                "n_eval_examples=8",
                "max_length=64",
                "max_prompt_length=32",
                "wandb.enabled=false",
                f"local_dirs=[{tmp_path_factory.mktemp('cache')}]",
                *extra,
            ]
        )
        tokenizer, policy, _ = train_py.load_models(cfg)
        out.append(
            trainers.BasicTrainer(policy, cfg, cfg.seed, str(tmp_path_factory.mktemp("run")), tokenizer=tokenizer)
        )
    return out


KTO = ["loss=kto", "pairs_to_unpaired=true"]


def test_kto_runs_with_accumulation_logs_its_metrics_and_starts_at_half(tmp_path):
    """A KTO run on the toy pairs turned unpaired: the step-0 loss is 0.5 (policy = reference, KL 0), the metrics
    keep the original names plus kl, eval keeps the pairs (rewards_eval/accuracies), and 2 x 4 with accumulation
    ends where 8 in one micro-batch does (on this data the KL estimate stays <= 0: kl/train shows it, kl_clamped/train
    is the 0 the loss uses; the split invariance with a positive KL is the next test's)."""
    whole = run(tmp_path / "whole", *KTO, "minimum_log_interval_secs=0")
    split = run(tmp_path / "split", *KTO, "gradient_accumulation_steps=2")
    assert max((whole[k] - split[k]).abs().max().item() for k in whole) <= 1e-5
    records = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss/train" in r]
    assert train[0]["loss/train"] == pytest.approx(0.5, abs=1e-6) and train[0]["kl/train"] == 0.0
    assert {"rewards_train/chosen", "rewards_train/rejected", "kl/train"} <= set(train[0])
    assert "rewards_eval/accuracies" in records[-1]


def test_kto_kl_reference_point_is_the_mean_log_ratio_of_mismatched_rows_over_the_whole_step(tmp_path):
    """trainer.kl_reference_point against plain HF forwards: for each kl row, sum of log_softmax at the labels
    (shifted by one) under the policy minus under the reference, averaged over the rows. Then, with that KL > 0,
    the loss of the step is the same whole or as two micro-batches (each micro-batch reuses the step's KL), while
    the halves' own KL estimates differ: a per-micro-batch estimate would change the loss with the split."""
    cfg, _ = load_config([*FAST, *KTO, f"run_dir={tmp_path}", f"local_dirs=[{tmp_path / 'cache'}]"])
    tokenizer, policy, reference = train_py.load_models(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in reference.parameters():  # a noisier reference: the policy's log-ratios are mostly > 0
            p.add_(0.05 * torch.randn_like(p))
    with contextlib.redirect_stdout(io.StringIO()):
        trainer = trainers.BasicTrainer(policy, cfg, cfg.seed, str(tmp_path), reference, tokenizer=tokenizer)
    batch = next(iter(trainer.train_batches()))
    got = trainer.reference.kl_point(batch).item()

    def sums(model, rows=slice(None)):
        with torch.no_grad():
            logits = model(
                input_ids=batch["kl_input_ids"][rows], attention_mask=batch["kl_attention_mask"][rows]
            ).logits
        logps = logits[:, :-1].log_softmax(-1)
        labels = batch["kl_labels"][rows, 1:]
        mask = labels != -100
        return (logps.gather(-1, labels.clamp(min=0)[..., None])[..., 0] * mask).sum(-1)

    expected = (sums(policy) - sums(reference)).mean().item()
    assert expected > 0 and got == pytest.approx(expected, abs=1e-4)

    step = trainer.step_statistics(batch)
    whole, _ = trainer.batch_metrics(step, "train")
    halves = [trainer.batch_metrics(micro, "train")[0] for micro in trainers.split_batch(step, 2)]
    assert torch.stack(halves).mean().item() == pytest.approx(whole.item(), abs=1e-6)
    own = [(sums(policy, rows) - sums(reference, rows)).mean().item() for rows in (slice(0, 4), slice(4, 8))]
    assert abs(own[0] - own[1]) > 0.05 and min(own) > 0  # so the split would matter for a per-micro-batch KL


def test_each_fsdp_strategy_is_one_sharding_object_picked_in_one_place():
    """fsdp.strategy picks a sharding implementation once (fsdp.SHARDINGS); the loop never compares the strategy
    name, so a new strategy is a new class and an entry, not branches through the file."""
    import ast

    import config_loader

    assert set(fsdp.SHARDINGS) == set(config_loader.CHOICES["fsdp.strategy"])
    for cls in fsdp.SHARDINGS.values():  # each implements what differs between the strategies
        assert issubclass(cls, sharding.OneProcess) and all(
            name in vars(cls) for name in ("shard", "gradient_sync", "clip", "reshard")
        ), cls
    for path in ("trainers.py", "sharding.py", "fsdp.py"):
        tree = ast.parse((REPO / path).read_text())
        compared = [
            node.lineno
            for node in ast.walk(tree)
            if isinstance(node, ast.Compare)
            and any(
                isinstance(side, ast.Attribute) and side.attr == "strategy" for side in (node.left, *node.comparators)
            )
        ]
        assert compared == [], f"{path} compares fsdp.strategy at lines {compared}"


def test_a_one_process_run_imports_no_fsdp_code():
    """fsdp.py (FSDP1, FSDP2) is imported where FSDPTrainer picks one: train.py and trainers.py leave it unread."""
    import subprocess
    import sys

    code = "import sys, train, trainers; print('fsdp' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neox", "llama", "qwen2", "gemma2", "mistral"])
def test_merged_lora_export_equals_peft_merge_and_unload(tmp_path, arch):
    """The HF export of a LoRA run merges W + (alpha / r) B A as peft's own merge_and_unload does, for every
    architecture of the matrix; GPT-2's Conv1D stores W as (in, out), so its delta is (B A).T (fan_in_fan_out)."""
    import architectures
    import peft
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(architectures.build(arch, tmp_path), dtype=torch.float32)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    adapted = peft.get_peft_model(
        model, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    )
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)  # B = 0 at initialization would merge nothing
    state = {k: v.detach().clone() for k, v in adapted.state_dict().items()}
    merged = lora.merged_lora_state(state, 8 / 4, lora.fan_in_fan_out_layers(adapted))
    expected = adapted.merge_and_unload().state_dict()
    assert merged.keys() == expected.keys()
    for k, v in expected.items():
        torch.testing.assert_close(merged[k], v, atol=1e-6, rtol=1e-5, msg=k)
    assert sum(not torch.equal(merged[k], base[k]) for k in merged) >= 4  # the adapters were merged into the weights


def test_evaluation_averages_exactly_n_eval_examples_and_precomputed_equals_online(tmp_path):
    """12 eval pairs in batches of 8: the second batch holds 4 pairs and 4 repeats that are left out, so every
    pair counts once; the precomputed reference (its table covers exactly the 12) reports what the online one does.
    Before, evaluation rounded up to 16 pairs and the 4 beyond the table counted as wrong (NaN > NaN is False)."""

    def evals(name, *args):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            assert (
                train_py.main(
                    [
                        *FAST,
                        f"run_dir={tmp_path / name}",
                        "n_eval_examples=12",
                        "eval_batch_size=8",
                        "sample_during_eval=false",
                        *args,
                    ]
                )
                == 0
            )
        assert "eval pairs 12 in batches of 8" in out.getvalue()
        return [
            r for r in map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines()) if "loss/eval" in r
        ]

    online, precomputed = evals("online"), evals("precomputed", "precompute_ref_log_probs=true")
    assert len(online) == 1 and online[-1]["rewards_eval/accuracies"] > 0.5  # trained: not all ties
    for a, b in zip(online, precomputed):
        for key in ("loss/eval", "rewards_eval/accuracies", "rewards_eval/margins", "logps_eval/chosen"):
            assert b[key] == pytest.approx(a[key], abs=1e-5), key
    # by hand: 12 pairs' accuracies are multiples of 1/12 (16 pairs would give multiples of 1/16)
    assert round(online[-1]["rewards_eval/accuracies"] * 12, 4) == round(online[-1]["rewards_eval/accuracies"] * 12)


def test_kto_kl_pass_keeps_to_the_token_budget(tmp_path, monkeypatch):
    """max_tokens_per_microbatch bounds every forward of a KTO step, the KL pass over the mismatched rows too
    (before: all of a rank's KL rows in one forward), and the step is the same as without the budget."""
    sizes, forward_logps = [], logps.forward_logps

    def recorded(model, inputs, *args, **kwargs):
        if model.training:  # the policy's forwards of a training step (evaluation is not split)
            sizes.append((int(inputs["attention_mask"].sum()), len(inputs["input_ids"])))
        return forward_logps(model, inputs, *args, **kwargs)

    monkeypatch.setattr(trainers, "forward_logps", recorded)
    budgeted = run(tmp_path / "budget", *KTO, "max_tokens_per_microbatch=100")
    assert sizes and all(tokens <= 100 or rows == 1 for tokens, rows in sizes), sizes
    monkeypatch.setattr(trainers, "forward_logps", forward_logps)
    whole = run(tmp_path / "whole", *KTO)
    assert max((whole[k] - budgeted[k]).abs().max().item() for k in whole) <= 1e-5


def test_long_rows_build_no_quadratic_masks_beyond_what_attention_needs():
    """Ulysses' padded rows at T tokens get a one-element causal stand-in, not a (T, T) mask (the wrapper runs sdpa's
    causal kernel); a sliding window is a boolean band, not an int64 (T, T) of position differences (8 bytes per
    pair: 8 GiB at 32k); eager attention's additive masks are bf16, not fp32."""
    import transformers
    import ulysses

    t = 1024
    rows = {"input_ids": torch.zeros(2, t, dtype=torch.long)}
    stand_in = ulysses.SequenceParallel.whole_row_inputs(rows)["attention_mask"]
    assert stand_in.shape == (1, 1, t, t) and stand_in.untyped_storage().nbytes() == 1 and stand_in.causal_only
    config = transformers.MistralConfig(sliding_window=16)
    owner = torch.zeros(1, t, dtype=torch.long)
    mask = (owner[:, :, None] == owner[:, None, :]).tril_()[:, None]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        window = packing.packed_attention_mask(mask, config)
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert largest <= t * t, f"largest allocation {largest} bytes for a {t} x {t} bool mask"
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    assert torch.equal(window[0, 0], (j <= i) & (i - j < 16))  # the window by its definition
    config._attn_implementation = "eager"
    additive = packing.packed_attention_mask(mask, config)
    assert additive.dtype == torch.bfloat16 and torch.equal(additive[0, 0] == 0, (j <= i) & (i - j < 16))


def test_kto_with_a_one_pair_eval_set_evaluates_it(tmp_path):
    """KTO's KL rows need >= 2 completions per rank: a one-pair eval set is completed with a repeat that evaluation
    leaves out (before: the eval batch size was lowered to 1 and collate refused it at startup)."""
    run(tmp_path / "kto", *KTO, "n_eval_examples=1")
    evals = [
        r for r in map(json.loads, (tmp_path / "kto" / "metrics.jsonl").read_text().splitlines()) if "loss/eval" in r
    ]
    assert evals and evals[-1]["rewards_eval/accuracies"] in (0.0, 1.0)  # one pair: right or wrong, nothing between
