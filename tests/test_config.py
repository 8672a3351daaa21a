"""config.py: the dict-like frozen dataclasses, the YAML loader, overrides, aliases and every error."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import config
import config_loader
from config import Config, ConfigError, EngineConfig, FSDPEngineConfig
from config import schema
from config_loader import BLOCKS, help_text, load_config

REPO = Path(__file__).resolve().parent.parent
ORIGINAL_COMMAND = (
    "model=pythia28 datasets=[hh] loss=dpo loss.beta=0.1 exp_name=anthropic_dpo_pythia28 "
    "gradient_accumulation_steps=2 batch_size=64 eval_batch_size=32 trainer=FSDPTrainer "
    "sample_during_eval=false model.fsdp_policy_mp=bfloat16 model.archive=/path/to/LATEST/policy.pt"
).split()


def run_train(*args, timeout=30):
    return subprocess.run(
        [sys.executable, "-u", str(REPO / "train.py"), *args], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


# ---------------------------------------------------------------------------------------------------------
# BaseConfig
# ---------------------------------------------------------------------------------------------------------
def test_base_config_reads_like_a_dict():
    cfg = FSDPEngineConfig()
    assert cfg.strategy == cfg["strategy"] == cfg.get("strategy") == "fsdp"
    assert cfg.get("no_such_key", 7) == 7
    assert "fsdp_size" in cfg and "no_such_key" not in cfg
    assert list(cfg) == [f.name for f in dataclasses.fields(FSDPEngineConfig)]
    assert len(cfg) == len(dataclasses.fields(FSDPEngineConfig))
    with pytest.raises(KeyError):
        cfg["no_such_key"]
    d = Config().to_dict()
    assert d["loss"]["beta"] == 0.1 and d["fsdp"]["wrap_policy"] == {} and isinstance(d["wandb"], dict)


def test_a_config_is_frozen_and_replace_makes_a_changed_copy():
    cfg = Config()
    for section, key, value in (
        (cfg, "lr", 1.0),
        (cfg.fsdp, "ulysses_sequence_parallel_size", 2),
        (cfg.loss, "beta", 0.3),
    ):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(section, key, value)
    changed = dataclasses.replace(cfg, loss=dataclasses.replace(cfg.loss, beta=0.3))
    assert changed.loss.beta == 0.3 and cfg.loss.beta == 0.1


def test_fsdp_engine_config_has_exactly_the_seed_fields_and_defaults():
    expected = dict(
        wrap_policy={},
        offload_policy=False,
        reshard_after_forward=True,
        fsdp_size=-1,
        forward_prefetch=False,
        model_dtype="fp32",
        use_orig_params=False,
        mixed_precision=None,
        ulysses_sequence_parallel_size=1,
        entropy_from_logits_with_chunking=False,
        use_torch_compile=None,
        entropy_checkpointing=False,
        strategy="fsdp",
        param_offload=False,
        optimizer_offload=False,
        full_determinism=False,
        dtype="bfloat16",
        forward_only=False,
        seed=None,
    )
    assert FSDPEngineConfig().to_dict() == expected


def test_a_bad_strategy_is_a_config_error_naming_the_key_and_the_valid_values():
    """Not an `assert` (python -O strips those, and they name neither the key nor the choices)."""
    with pytest.raises(ConfigError) as info:
        load_config(["trainer=FSDPTrainer", "fsdp.strategy=fsdp3"])
    assert "fsdp.strategy='fsdp3': expected one of fsdp, fsdp2" in str(info.value)
    result = subprocess.run(
        [sys.executable, "-O", str(REPO / "train.py"), "trainer=FSDPTrainer", "fsdp.strategy=fsdp3", "--cfg"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2 and "fsdp.strategy='fsdp3'" in result.stderr, result.stderr


def test_no_assert_checks_user_input_in_the_code():
    """`assert` vanishes under python -O: user input gets errors. The code holds no assert statement at all."""
    import ast

    found = []
    for path in sorted(REPO.glob("*.py")):
        found += [
            f"{path.name}:{node.lineno}"
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Assert)
        ]
    assert not found, f"assert statements: {found}"


def test_mixed_precision_shorthand_is_the_compute_dtype_with_fp32_reductions_and_buffers():
    """fsdp.mixed_precision=bf16 means model.fsdp_policy_mp=bf16: compute in bf16; reduce_dtype and buffer_dtype
    are left out, so they stay fp32 (FSDPTrainer.mixed_precision_dtypes; rotary tables are not rounded)."""
    cfg, _ = load_config(["trainer=FSDPTrainer", "fsdp.mixed_precision=bf16"])
    long, _ = load_config(["trainer=FSDPTrainer", "model.fsdp_policy_mp=bf16"])
    assert cfg.fsdp.mixed_precision == long.fsdp.mixed_precision == {"param_dtype": "bf16"}


def test_each_default_is_written_once_in_the_dataclasses():
    """config/config.yaml picks the groups and repeats no default: a key's default lives in its dataclass field."""
    base = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    assert set(base) == {"defaults"}
    assert load_config([])[0].loss.beta == config.LossConfig().beta == 0.1


# ---------------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------------
def test_the_original_long_command_resolves_to_typed_values():
    # in-process: `--cfg` also runs the run's input checks, and this command's hub data, model and archive are
    # not here (tests/test_train.py checks that `--cfg` refuses what the run refuses)
    cfg = yaml.safe_load(config_loader.to_yaml(load_config(ORIGINAL_COMMAND)[0]))
    assert cfg["model"]["name_or_path"] == "EleutherAI/pythia-2.8b"
    assert cfg["fsdp"]["wrap_policy"] == {"transformer_layer_cls_to_wrap": ["GPTNeoXLayer"]}
    assert cfg["datasets"] == ["hh"]
    assert cfg["loss"]["name"] == "dpo" and cfg["loss"]["beta"] == 0.1
    assert cfg["exp_name"] == "anthropic_dpo_pythia28"
    assert (cfg["gradient_accumulation_steps"], cfg["batch_size"], cfg["eval_batch_size"]) == (2, 64, 32)
    assert cfg["trainer"] == "FSDPTrainer" and cfg["sample_during_eval"] is False
    # model.fsdp_policy_mp sets the compute dtype only: reductions and buffers stay fp32 (FSDPTrainer.mixed_precision_dtypes)
    assert cfg["fsdp"]["mixed_precision"] == {"param_dtype": "bfloat16"}
    assert cfg["model"]["archive"] == "/path/to/LATEST/policy.pt"


def test_group_selection_and_override_precedence():
    cfg, _ = load_config([])
    assert cfg.model.name_or_path == "toy/tiny-llama" and cfg.loss.name == "sft"  # the defaults list
    cfg, _ = load_config(["loss=dpo"])
    assert (
        cfg.loss.name == "dpo" and cfg.loss.beta == yaml.safe_load((REPO / "config/loss/dpo.yaml").read_text())["beta"]
    )
    cfg, _ = load_config(["loss=dpo", "loss.beta=0.3"])  # command line beats the group file
    assert cfg.loss.beta == 0.3
    cfg, _ = load_config(["loss.beta=0.3", "loss=dpo"])  # whatever the order on the line
    assert cfg.loss.beta == 0.3
    cfg, _ = load_config(["model=pythia28", "model.name_or_path=/local/pythia"])
    assert cfg.model.name_or_path == "/local/pythia" and cfg.fsdp.wrap_policy == {BLOCKS: ["GPTNeoXLayer"]}


def test_yaml_typed_values_and_double_dash_form():
    cfg, _ = load_config(["--datasets=[hh,shp]", "lr=1e-6", "n_epochs=null", "n_examples=64", "--debug=true"])
    assert cfg.datasets == ["hh", "shp"] and cfg.lr == 1e-6 and isinstance(cfg.lr, float)
    assert cfg.n_epochs is None and cfg.n_examples == 64 and cfg.debug is True
    cfg, _ = load_config(["exp_name=123", "max_grad_norm=1"])  # a string key keeps its text; an int is a float
    assert cfg.exp_name == "123" and cfg.max_grad_norm == 1.0


def test_the_original_keys_set_the_keys_that_hold_their_knobs_now():
    """model.policy_dtype, model.fsdp_policy_mp and model.block_name (the original code's) and verl's fsdp.seed set
    fsdp.model_dtype, fsdp.mixed_precision, fsdp.wrap_policy and seed; given with those in one layer, they must agree."""
    cfg, _ = load_config(["trainer=FSDPTrainer", "model.policy_dtype=bfloat16"])
    assert cfg.fsdp.model_dtype == "bfloat16" and "policy_dtype" not in cfg.model
    cfg, _ = load_config(["trainer=FSDPTrainer", "model.fsdp_policy_mp=bf16", "fsdp.mixed_precision.reduce_dtype=fp32"])
    assert cfg.fsdp.mixed_precision == {"param_dtype": "bf16", "reduce_dtype": "fp32"}  # one dtype, then a sub-key
    cfg, _ = load_config(["trainer=FSDPTrainer", "fsdp.mixed_precision=bf16", "fsdp.mixed_precision.reduce_dtype=fp32"])
    assert cfg.fsdp.mixed_precision == {"param_dtype": "bf16", "reduce_dtype": "fp32"}
    cfg, _ = load_config(["trainer=FSDPTrainer", "fsdp.wrap_policy={transformer_layer_cls_to_wrap: null}"])
    assert cfg.fsdp.wrap_policy == {BLOCKS: None}  # null: the model's _no_split_modules
    cfg, _ = load_config(["trainer=FSDPTrainer", "model=pythia28", "model.block_name=null"])
    assert cfg.fsdp.wrap_policy == {BLOCKS: None}  # the command line wins over the group file
    cfg, _ = load_config(["trainer=FSDPTrainer", "model=pythia28", "fsdp.wrap_policy={min_num_params: 1000}"])
    assert cfg.fsdp.wrap_policy == {"min_num_params": 1000}
    cfg, _ = load_config(["trainer=FSDPTrainer", "fsdp.wrap_policy.transformer_layer_cls_to_wrap=Block"])
    assert cfg.fsdp.wrap_policy == {BLOCKS: ["Block"]}
    cfg, _ = load_config(["fsdp.seed=5"])
    assert cfg.seed == 5
    cfg, _ = load_config(["trainer=FSDPTrainer", "model.policy_dtype=bf16", "fsdp.model_dtype=bfloat16"])
    assert cfg.fsdp.model_dtype == "bfloat16"  # same knob, same value
    for args in (  # a block class and a size policy: neither dropped silently, in either order
        ["model.block_name=Block", "fsdp.wrap_policy={min_num_params: 1000}"],
        ["fsdp.wrap_policy={min_num_params: 1000}", "model.block_name=Block"],
        ["fsdp.model_dtype=fp32", "model.policy_dtype=bf16"],
        ["seed=1", "fsdp.seed=2"],
    ):
        with pytest.raises(ConfigError, match="set the same knob to different values; set only") as info:
            load_config(["trainer=FSDPTrainer", *args])
        assert all(key.partition("=")[0] in str(info.value) for key in args)


def test_exp_name_is_derived_when_null():
    cfg, _ = load_config(["loss=dpo"])
    assert cfg.exp_name == "dpo_tiny-llama"


def test_world_size_enters_the_divisibility_check():
    with pytest.raises(ConfigError, match="world size=4"):
        load_config(["batch_size=8", "gradient_accumulation_steps=4"], world_size=4)
    load_config(["batch_size=8", "gradient_accumulation_steps=4"], world_size=2)


# ---------------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------------
def bad_configs():
    rows = []
    for line in (REPO / "tests" / "data" / "bad_configs.tsv").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            args, fragment = line.split("\t")
            rows.append(pytest.param(args.split(), fragment, id=args))
    return rows


@pytest.mark.parametrize("args,fragment", bad_configs())
def test_bad_config_is_reported_with_key_value_and_expectation(args, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(args)
    assert fragment in str(info.value)


def test_a_required_value_is_one_problem_naming_the_key():
    with pytest.raises(ConfigError) as info:
        load_config(["model=blank_model"])
    assert info.value.problems == [
        "model.name_or_path: a value is required (set it on the command line: model.name_or_path=...)"
    ]


def test_blank_model_needs_no_block_name_and_help_lists_the_original_keys(capsys):
    """model=blank_model model.name_or_path=X works as typed: its blocks are the model's own (_no_split_modules),
    found and printed when FSDP or activation checkpointing needs them; --help names model.block_name (#53)."""
    from transformers import AutoModelForCausalLM

    import sharding

    cfg, _ = load_config(["model=blank_model", f"model.name_or_path={REPO / 'toy' / 'tiny-llama'}"])
    assert not cfg.fsdp.wrap_policy.get("transformer_layer_cls_to_wrap")
    model = AutoModelForCausalLM.from_pretrained(cfg.model.name_or_path)
    assert {c.__name__ for c in sharding.block_classes(model, cfg.fsdp.wrap_policy)} == {"LlamaDecoderLayer"}
    assert "blocks of LlamaForCausalLM: LlamaDecoderLayer (its _no_split_modules)" in capsys.readouterr().out
    assert "model.block_name -> fsdp.wrap_policy.transformer_layer_cls_to_wrap" in help_text()


def test_there_are_at_least_twenty_bad_configs():
    assert len(bad_configs()) >= 20


def test_all_problems_are_reported_at_once():
    with pytest.raises(ConfigError) as info:
        load_config(["loss.betaa=1", "batchsize=3", "lr=x"])
    assert len(info.value.problems) == 2  # unknown keys stop before type checks; both reported
    with pytest.raises(ConfigError) as info:
        load_config(["lr=x", "batch_size=y", "debug=z"])
    assert len(info.value.problems) == 3


def test_bad_config_exits_2_without_traceback():
    result = run_train("loss.betaa=1", "--cfg")
    assert result.returncode == 2
    assert "loss.beta" in result.stderr and "Traceback" not in result.stderr


def test_help_lists_every_field_of_every_config_class_without_importing_torch():
    result = run_train("--help")
    assert result.returncode == 0, result.stderr
    imports = subprocess.run(
        [sys.executable, "-X", "importtime", "train.py", "--help"], capture_output=True, text=True, cwd=REPO
    )
    imported = {line.split("|")[-1].strip() for line in imports.stderr.splitlines() if line.startswith("import time:")}
    assert "config" in imported and "torch" not in imported, sorted(imported)[:20]
    for key in schema():
        assert f"  {key}:" in result.stdout, key
    for cls in (Config, config.ModelConfig, config.LossConfig, config.WandbConfig, FSDPEngineConfig, EngineConfig):
        for f in dataclasses.fields(cls):
            assert f.metadata.get("doc"), f"{cls.__name__}.{f.name} has no doc"
    assert help_text().count("\n") > len(schema())
    for flag in (
        "--cfg ",
        "--estimate [gpu=NAME]",
        "--replay <run dir>",
        "exit codes: 0 done; 2 bad input",
        "130 / 143",
    ):
        assert flag in result.stdout, flag


def test_loss_names_known_to_config_are_the_registered_losses():
    import losses

    with pytest.raises(ConfigError, match="loss.name='mpo': unknown loss") as info:
        load_config(["loss.name=mpo"])
    assert f"expected one of {', '.join(sorted(losses.LOSSES))};" in str(info.value)
    cfg, _ = load_config(["loss=mpo"])  # the preset is a mixture of registered losses
    assert cfg.loss_names == ["dpo", "bco_pair", "sft"]


def test_config_reads_the_loss_registry_from_the_imported_losses_py():
    import inspect

    import losses

    keys = set(config.LossConfig())
    assert sorted(config_loader.loss_registry()) == sorted(losses.LOSSES)
    for name, spec in losses.LOSSES.items():
        params = inspect.signature(spec.fn).parameters.values()
        reads = [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name != "chosen_nll"]
        assert set(reads) <= keys, (name, reads)  # every hyperparameter is a config key
        entry = config_loader.loss_registry()[name]
        assert entry["reads"] == reads, name
        assert entry["batch_statistics"] == spec.batch_statistics, name
        assert entry["needs_reference"] == spec.needs_reference and entry["average_log_prob"] == spec.average_log_prob


def test_loss_hyperparameters_are_declared_once_as_loss_config_fields():
    """A hyperparameter is one LossConfig field: its default, --help doc and range; each range is enforced, and
    f_divergence's choices are the implemented ones."""
    import losses

    read = {key for entry in config_loader.loss_registry().values() for key in entry["reads"]}
    for f in dataclasses.fields(config.LossConfig):
        if f.name in read:
            assert (
                f"  loss.{f.name}: {type(f.default).__name__} = {f.default!r}  # {f.metadata['doc']}" in help_text()
            ), f.name
    assert set(config_loader.CHOICES["loss.f_divergence"]) == set(losses.F_DIVERGENCES)
    with pytest.raises(ConfigError) as info:
        load_config(
            [
                "loss=dpo",
                "loss.beta=0",
                "loss.label_smoothing=0.5",
                "loss.f_divergence=alpha_divergence",
                "loss.f_alpha=1.5",
            ]
        )
    assert sorted(p.split("=")[0] for p in info.value.problems) == ["loss.beta", "loss.f_alpha", "loss.label_smoothing"]
    load_config(["loss=dpo", "loss.label_smoothing=0.49", "loss.f_divergence=alpha_divergence", "loss.f_alpha=1"])


def copy_of_the_project(tmp_path) -> Path:
    """The project's Python files, config and toy model in a fresh directory, to edit losses.py there."""
    import shutil

    out = tmp_path / "project"
    shutil.copytree(REPO, out, ignore=shutil.ignore_patterns(".git", ".cache", "tests", "benchmarks", "__pycache__"))
    return out


LOSS_IN_MY_FILE = """
import torch.nn.functional as F


def margin2_dpo_loss(policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps, *,
                     beta):
    chosen, rejected = beta * (policy_chosen_logps - reference_chosen_logps), beta * (policy_rejected_logps - reference_rejected_logps)
    return -F.logsigmoid(chosen - rejected - 2.0), chosen.detach(), rejected.detach()
"""


def test_losses_py_is_ordinary_python(tmp_path):
    """A researcher's losses.py with a keyword LossSpec(fn=...), a computed value and a loss imported from their own
    file works for every command; a losses.py that cannot provide the registry fails with the file and line,
    exit 2, no traceback (before: losses.py was read as a syntax tree, and each of these broke every command)."""
    project = copy_of_the_project(tmp_path)
    (project / "mylosses.py").write_text(LOSS_IN_MY_FILE)
    source = (project / "losses.py").read_text()
    edited = source.replace(
        '    "ipo": LossSpec(ipo_loss, needs_reference=True, average_log_prob=True),',
        '    "ipo": LossSpec(fn=ipo_loss, needs_reference=bool(1), average_log_prob=True),\n'
        '    "margin2_dpo": LossSpec(margin2_dpo_loss, needs_reference=True, average_log_prob=False),',
    )
    assert edited != source
    edited = edited.replace(
        "from __future__ import annotations\n",
        "from __future__ import annotations\nfrom mylosses import margin2_dpo_loss\n",
        1,
    )
    (project / "losses.py").write_text(edited)
    for args in (["--help"], ["loss=ipo", "--cfg"], ["loss.name=margin2_dpo", "loss.beta=0.2", "--cfg"]):
        result = subprocess.run([sys.executable, "train.py", *args], capture_output=True, text=True, cwd=project)
        assert result.returncode == 0, (args, result.stderr[-2000:])
    (project / "losses.py").write_text(edited.replace("def ipo_loss(", "def ipo_loss(((", 1))  # a syntax error
    result = subprocess.run(
        [sys.executable, "train.py", "loss=dpo", "--cfg"], capture_output=True, text=True, cwd=project
    )
    assert result.returncode == 2 and "losses.py:" in result.stderr and "Traceback" not in result.stderr, result.stderr[
        -2000:
    ]
    (project / "losses.py").write_text(
        edited.replace(
            'beta: float\n) -> LossReturn:\n    """Identity',
            'beta: float, ipo_tau: float\n) -> LossReturn:\n    """Identity',
        )
    )
    result = subprocess.run(
        [sys.executable, "train.py", "loss=ipo", "--cfg"], capture_output=True, text=True, cwd=project
    )
    assert result.returncode == 2 and "loss 'ipo' (ipo_loss) reads loss.ipo_tau" in result.stderr, result.stderr[-2000:]


def test_every_loss_preset_is_valid_and_only_changed_unread_keys_are_refused():
    """Presets restate defaults freely (dpo.yaml sets f_alpha: 0.5 for reverse_kl); only a value changed away
    from the default that no selected loss reads is refused, wherever it was set."""
    for name in config_loader._group_choices("loss"):
        load_config([f"loss={name}"])
    load_config(["loss=sft", "loss.beta=0.1"])  # the default, typed again: nothing is ignored
    load_config(["loss=dpo", "loss.label_smoothing=0.3"])  # cDPO, as the original code
    load_config(["loss=dpo", "loss.name=[dpo,simpo]", "loss.gamma=0.5"])  # read by one of the selected losses
    load_config(["loss=dpo", "loss.f_divergence=alpha_divergence", "loss.f_alpha=0.3"])
    with pytest.raises(ConfigError) as info:
        load_config(["loss=ipo", "loss.label_smoothing=0.1", "loss.gamma=2", "loss.orpo_lambda=0.1"])
    assert len(info.value.problems) == 2, info.value.problems  # orpo_lambda=0.1 is its default
    result = run_train("loss=dpo", "loss.gamma=0.5", "--cfg")
    assert result.returncode == 2 and "read by simpo" in result.stderr, result.stderr


def test_batch_statistic_losses_refuse_several_ranks():
    with pytest.raises(ConfigError, match="bco_pair uses statistics of the whole batch"):  # the launcher's 2 ranks
        load_config(["loss=bco_pair", "trainer=FSDPTrainer", "n_workers=2"])
    cfg, _ = load_config(["loss=bco_pair", "trainer=FSDPTrainer"], world_size=1)
    assert any(
        "bco_pair uses statistics of the whole batch" in p and "world size 2" in p
        for p in config_loader.validate(cfg, world_size=2)
    )
    assert not config_loader.validate(cfg, world_size=1)


def test_the_config_is_checked_at_the_world_size_it_names_never_at_the_hosts_gpus(monkeypatch):
    """load_config checks the world-size rules where the config or torchrun names the size (BasicTrainer: 1); an
    FSDPTrainer run sized by the GPUs it finds is checked once train.py has counted them, so a config's verdict
    never depends on the machine that loads it."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg, _ = load_config(["trainer=FSDPTrainer"])  # batch_size=4 would not divide over 8 GPUs
    assert config_loader.known_world_size(cfg) is None and config_loader.validate(cfg, 8)
    assert config_loader.known_world_size(load_config([])[0]) == 1
    with pytest.raises(ConfigError, match="x world size=8"):
        load_config(["trainer=FSDPTrainer", "n_workers=8"])
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(ConfigError, match="x world size=8"):
        load_config(["trainer=FSDPTrainer"])
    assert load_config(["batch_size=3"])[0].batch_size == 3  # one process (train.main refuses it under torchrun)
    with pytest.raises(ConfigError) as info:  # one line: the knob is ignored here, not "no divisor of 1"
        load_config(["fsdp.fsdp_size=2"])
    assert info.value.problems == ["fsdp.fsdp_size=2: only applies to trainer=FSDPTrainer (this run uses BasicTrainer)"]


def test_the_sweep_example_starts_from_the_sft_checkpoint_and_targets_a_metric_that_can_rank_it():
    """Each grid point of sweeps/dpo_beta_lr.yaml is a valid run from model.archive (the SFT checkpoint), ranked by
    the toy task's sampled rule rate (rewards_eval/accuracies is 1.0 at every point after a few steps)."""
    import itertools

    sweep = yaml.safe_load((REPO / "sweeps" / "dpo_beta_lr.yaml").read_text())
    assert sweep["metric"]["name"] == "samples/policy_rule_rate" and sweep["method"] == "grid"
    fixed = [a for a in sweep["command"] if not str(a).startswith("${") and a not in ("python", "-u")]
    grid = list(itertools.product(*([f"{k}={v}" for v in p["values"]] for k, p in sweep["parameters"].items())))
    assert len(grid) == 9
    for point in grid:
        cfg, _ = load_config([*fixed, *point])
        assert cfg.model.archive and cfg.loss_names == ["dpo"] and cfg.sample_during_eval
        assert cfg.n_eval_model_samples >= 256 and cfg.n_eval_examples >= cfg.n_eval_model_samples
    assert "python sweeps/run_grid.py sweeps/dpo_beta_lr.yaml" in (REPO / "README.md").read_text()


def test_compiling_the_entropy_is_refused_without_the_entropy_bonus():
    """The logged entropy comes from the log-prob kernel's own tiles: fsdp.use_torch_compile=true compiles nothing
    unless loss.entropy_coeff > 0 adds the bonus, so it is refused; false, and the bonus with true, are accepted."""
    with pytest.raises(ConfigError, match="fsdp.use_torch_compile=True: applies to the entropy bonus, read only with"):
        load_config(["loss=dpo", "fsdp.use_torch_compile=true"])
    load_config(["loss=dpo", "fsdp.use_torch_compile=false"])
    load_config(["loss=dpo", "fsdp.use_torch_compile=true", "loss.entropy_coeff=0.01"])
    with pytest.raises(ConfigError, match="fsdp.entropy_checkpointing=True: applies to the entropy bonus"):
        load_config(["loss=dpo", "fsdp.entropy_checkpointing=true"])


def test_original_and_new_spellings_that_agree_are_accepted_and_one_wrap_policy_is_asked():
    """A mixed_precision without param_dtype computes in fsdp.dtype: model.fsdp_policy_mp=bf16 beside it agrees;
    fsdp.seed=null is unset; block classes and a size policy together are refused (the size would win silently)."""
    cfg, _ = load_config(["loss=dpo", "fsdp.mixed_precision={reduce_dtype: fp32}", "model.fsdp_policy_mp=bf16"])
    assert cfg.fsdp.mixed_precision_dtypes()["param_dtype"] in ("bf16", "bfloat16")
    assert load_config(["loss=dpo", "fsdp.seed=null"])[0].seed == 0
    with pytest.raises(ConfigError, match="expected transformer_layer_cls_to_wrap or min_num_params, not both"):
        load_config(["trainer=FSDPTrainer", "model.block_name=Y", "fsdp.wrap_policy.min_num_params=5"])
