"""LoRA through peft (`lora.r`): the adapters, and what a checkpoint makes of them. The reference is the policy with its
adapters off (trainers.Reference), so the weights are held once. Imported only when lora.r is set.
"""

import warnings
from pathlib import Path

import torch
import torch.nn as nn

import utils
from utils import clean_name


def rules(c, world: int) -> list[str]:
    """The config's problems with LoRA (config_loader.validate calls this when lora.r is set)."""
    problems = []
    if c.trainer == "FSDPTrainer" and c.fsdp.strategy == "fsdp" and not c.fsdp.use_orig_params:
        problems.append(
            "lora.r with fsdp.strategy=fsdp: FSDP1 flattens frozen base weights and trainable adapters into one "
            "parameter, so it needs fsdp.use_orig_params=true (or use fsdp.strategy=fsdp2)"
        )
    if c.ref_update.tau is not None:
        problems.append(
            f"lora.r={c.lora.r} and ref_update.tau={c.ref_update.tau}: the LoRA reference is the base model with the "
            "adapters off, which TR-DPO cannot move; use one of them"
        )
    return problems


def add(lora, policy):
    """The policy with peft's LoRA adapters (lora.r set); only they train."""
    import peft  # optional: check_inputs refused lora.r without it, before any model loaded

    with warnings.catch_warnings():  # peft asks transformers a deprecated question on every run: not the user's to fix
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        policy = peft.get_peft_model(
            policy,
            peft.LoraConfig(
                r=lora.r,
                lora_alpha=lora.alpha,
                lora_dropout=lora.dropout,
                bias="none",
                target_modules=lora.target_modules,
                task_type="CAUSAL_LM",
            ),
        )
    utils.rank0_print(
        f"LoRA r={lora.r} alpha={lora.alpha} on {lora.target_modules}: "
        f"{sum(p.numel() for p in policy.parameters() if p.requires_grad)} trainable parameters of "
        f"{sum(p.numel() for p in policy.parameters())}"
    )
    return policy


def export(model: nn.Module, weights: dict, lora, adapter_dir: Path) -> tuple[nn.Module, dict]:
    """The adapter alone (peft's format) into adapter_dir; returns the base model and its weights with the adapters
    merged, W + (alpha / r) B A, for the HF export."""
    model.save_pretrained(adapter_dir, state_dict=weights, safe_serialization=True)
    merged = merged_lora_state(
        weights, lora.alpha / lora.r, fan_in_fan_out_layers(model), experts=expert_lora_layers(model)
    )
    return model.get_base_model(), merged


def merged_lora_state(
    state: dict[str, torch.Tensor],
    scaling: float,
    transposed: frozenset = frozenset(),
    adapter: str = "default",
    experts: dict | None = None,
) -> dict[str, torch.Tensor]:
    """A peft LoRA model's full state dict -> the base model's with each adapter merged, W + scaling * B @ A (scaling
    = lora.alpha / lora.r), keys without peft's prefixes. Layers in `transposed` store W as (in, out) (transformers'
    Conv1D in GPT-2, peft's fan_in_fan_out): their delta is (B @ A).T, as peft merges it. `experts` (expert_lora_layers:
    peft's LoRA on fused 3-D expert parameters, nested one wrapper per parameter) adds B_e @ A_e to each expert e's
    matrix, as peft's ParamWrapper.get_delta_weight. The live model is untouched."""
    merged, deltas = {}, {}
    for stem, (name, n, swapped) in (experts or {}).items():
        a, b = (state[f"{stem}.lora_{x}.{adapter}.weight"].double() for x in "AB")
        a, b = a.reshape(n, -1, a.shape[-1]), b.reshape(b.shape[0], -1, n)  # (experts, r, in), (out, r, experts)
        base = next(
            k for k in state if k.startswith(f"{stem}.base_layer.") and k.endswith(f".{name}") and ".lora_" not in k
        )
        deltas[base] = scaling * torch.einsum("ore,eri->e" + ("oi" if swapped else "io"), b, a)
    for key, value in state.items():
        if ".lora_" in key:
            continue
        if key in deltas:
            value = value + deltas[key].to(value.dtype)
        elif key.endswith(".base_layer.weight"):
            stem = key[: -len(".base_layer.weight")]
            delta = scaling * (
                state[f"{stem}.lora_B.{adapter}.weight"].double() @ state[f"{stem}.lora_A.{adapter}.weight"].double()
            )
            value = value + (delta.T if stem in transposed else delta).to(value.dtype)
        parts = key.removeprefix("base_model.model.").split(".")
        merged[".".join(part for part in parts if part != "base_layer")] = value  # nested wrappers: each level
    return merged


def expert_lora_layers(model: nn.Module) -> dict[str, tuple[str, int, bool]]:
    """State-dict stem of each peft LoRA layer on a fused expert parameter -> (its parameter's name, experts, whether
    it is stored (experts, out, in)); peft's all-linear adapts them in transformers' MoE models."""
    return {
        clean_name(name): (m.parameter_name, m.num_experts, m._did_swap_in_out_features)
        for name, m in model.named_modules()
        if getattr(m, "num_experts", 1) > 1 and hasattr(m, "parameter_name")
    }


def fan_in_fan_out_layers(model: nn.Module) -> frozenset:
    """State-dict stems of the LoRA layers whose base weight is stored (in, out) (peft sets fan_in_fan_out for
    Conv1D)."""
    return frozenset(
        clean_name(name) for name, module in model.named_modules() if getattr(module, "fan_in_fan_out", False)
    )
