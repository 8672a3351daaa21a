"""LoRA through peft (`lora.r`): the adapters, and what a checkpoint makes of them. The reference is the policy with its
adapters off (trainers.Reference), so the weights are held once. Imported only when lora.r or model.quantization is set.

QLoRA (`model.quantization`, Dettmers et al. 2023, arXiv:2305.14314): the frozen base is loaded through transformers'
BitsAndBytesConfig, each linear layer of the blocks quantized by bitsandbytes (nf4 or fp4 with double quantization of
the block constants, or int8); embeddings, LM head, norms, biases and a mixture's fused experts stay in the model's
dtype. The adapters train on it as on a full-precision base, and the reference is that quantized base with the
adapters off. 4-bit weights are stored in the model's dtype (bnb_4bit_quant_storage), the FSDP-QLoRA recipe: FSDP
shards them as any tensor of that dtype, and one process holds the same bytes.
"""

import copy
import warnings
from pathlib import Path

import torch
import torch.nn as nn

import utils
from config import ConfigError, dtype_of
from utils import clean_name

# bitsandbytes' constants saved beside each quantized weight (4-bit: block absmax, code book, double quantization's;
# int8: row scales): attributes, not parameters or buffers, so load_state_dict refuses them; a model has them already,
# from quantizing model.name_or_path's weights, and the same weights quantize to the same bytes
CONSTANTS = (".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map", ".SCB", ".weight_format")


def rules(c, world: int) -> list[str]:
    """The config's problems with LoRA and QLoRA (config_loader.validate calls this when lora.r or model.quantization
    is set)."""
    problems = quantization_rules(c) if c.model.quantization is not None else []
    if c.lora.r is None:
        return problems
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


def add(lora, policy, seed: int | None = None):
    """The policy with peft's LoRA adapters (lora.r set); only they train. `seed`: the adapters' random init drawn from
    it alone, the run's random stream untouched (a quantized base: every FSDP rank builds its own adapters, which
    must be equal)."""
    import peft  # optional: check_inputs refused lora.r without it, before any model loaded

    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with warnings.catch_warnings(), torch.random.fork_rng(devices, enabled=seed is not None):
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        if seed is not None:
            torch.manual_seed(seed)  # this CPU and every CUDA generator, restored on leaving fork_rng
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
    merged, W + (alpha / r) B A, for the HF export. A quantized base (QLoRA): a dense model of the base's class and
    dtype, and the weights dequantized, merged in float64, then cast to that dtype (dequantized_weights)."""
    model.save_pretrained(adapter_dir, state_dict=weights, safe_serialization=True)
    base = model.get_base_model()
    dense = {}
    if getattr(base, "is_quantized", False):
        weights, dense = dequantized_weights(model, weights)
    merged = merged_lora_state(
        weights, lora.alpha / lora.r, fan_in_fan_out_layers(model), experts=expert_lora_layers(model)
    )
    if not dense:
        return base, merged
    dtype = base.get_input_embeddings().weight.dtype  # the policy's dtype: embeddings are never quantized
    for key, conv1d in dense.items():  # transformers quantizes GPT-2's Conv1D as a linear layer of W.T: back to W
        merged[key] = (merged[key].T if conv1d else merged[key]).to(dtype).contiguous()
    config = copy.deepcopy(base.config)
    del config.quantization_config  # what from_pretrained would quantize again
    with torch.device("meta"):  # structure only: save_pretrained writes the merged weights given
        skeleton = type(base)._from_config(config, dtype=dtype)
    return skeleton, merged


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


# --- QLoRA: a quantized base (model.quantization) ---
def quantization_rules(c) -> list[str]:
    """What a quantized base cannot do, each with what works instead."""
    q = f"model.quantization={c.model.quantization}"
    problems = []
    if c.lora.r is None:
        problems.append(f"{q} needs lora.r: a quantized base is frozen, only adapters on it train (e.g. lora.r=16)")
    if c.model.archive:
        problems.append(
            f"{q} with model.archive={c.model.archive}: the base is quantized from model.name_or_path's weights, and "
            "a policy.pt holds full weights; point model.name_or_path at that run's step-N/hf/ export instead"
        )
    if c.trainer != "FSDPTrainer":
        return problems
    if c.model.quantization == "int8":
        problems.append(
            f"{q} under trainer=FSDPTrainer: FSDP cannot shard bitsandbytes' 8-bit weights (their row scales are no "
            "parameter of it); use model.quantization=nf4 or fp4, or trainer=BasicTrainer"
        )
    compute = (c.fsdp.mixed_precision_dtypes() or {}).get("param_dtype")
    if compute is not None and dtype_of(compute) != dtype_of(c.fsdp.model_dtype):
        problems.append(
            f"{q} with fsdp.mixed_precision param_dtype={compute} under FSDP: the packed 4-bit weights are stored as "
            f"fsdp.model_dtype={c.fsdp.model_dtype} values, which FSDP would cast as numbers; load the model in the "
            f"compute dtype instead (fsdp.model_dtype={compute}, fsdp.mixed_precision param_dtype as it or null)"
        )
    if c.fsdp.strategy == "fsdp" and dtype_of(c.fsdp.model_dtype) != torch.float32:
        problems.append(
            f"{q} with fsdp.strategy=fsdp and fsdp.model_dtype={c.fsdp.model_dtype}: FSDP1 flattens the base and "
            "peft's fp32 adapters into one parameter, which has one dtype; use fsdp.strategy=fsdp2"
        )
    return problems


def quantized_loading(c, device_map=None) -> dict:
    """from_pretrained's arguments for model.quantization: transformers' BitsAndBytesConfig, computing in the run's
    compute dtype (fsdp.mixed_precision's, else the model's), 4-bit weights stored in the model's dtype; on a GPU,
    `device_map`, else every weight on this process's device (bitsandbytes quantizes where the weights are)."""
    from transformers import BitsAndBytesConfig

    dtype = dtype_of(c.fsdp.model_dtype)
    compute = dtype_of((c.fsdp.mixed_precision_dtypes() or {}).get("param_dtype") or c.fsdp.model_dtype)
    if c.model.quantization == "int8":
        settings = BitsAndBytesConfig(load_in_8bit=True)
    else:
        settings = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=c.model.quantization,
            bnb_4bit_compute_dtype=compute,
            bnb_4bit_quant_storage=dtype,
            bnb_4bit_use_double_quant=True,  # QLoRA's: each block's fp32 absmax quantized to a byte too
        )
    if device_map is None and torch.cuda.is_available():
        device_map = {"": torch.cuda.current_device()}
    return {"quantization_config": settings, "device_map": device_map}


def record(c) -> dict:
    """The quantization settings and library versions, for run_manifest.json."""
    from importlib.metadata import version

    settings = quantized_loading(c)["quantization_config"].to_dict()  # dtypes as their names
    return {"settings": settings, "versions": {name: version(name) for name in ("bitsandbytes", "peft", "accelerate")}}


def prepare(model: nn.Module, c) -> nn.Module:
    """The quantized base made ready for adapters, without peft's prepare_model_for_kbit_training: that helper casts
    every weight bitsandbytes left alone (embeddings, LM head, norms) to fp32, doubling the largest part of a bf16
    model that quantization leaves, and for its reentrant gradient checkpointing makes the inputs require gradients.
    Here nothing is cast: the base is frozen (peft freezes it too), and activation_checkpointing=true recomputes blocks
    by NO_REENTRANT checkpointing, whose gradients reach the adapters without that hook. Raises ConfigError where
    bitsandbytes quantized no layer of the model (it replaces nn.Linear, and GPT-2's Conv1D)."""
    import bitsandbytes as bnb

    layers = [m for m in model.modules() if isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))]
    if not layers:
        raise ConfigError(
            [
                f"model.quantization={c.model.quantization}: bitsandbytes quantized no layer of "
                f"{type(model).__name__} ({c.model.name_or_path}): it replaces nn.Linear layers, and this model's "
                "blocks have none it can take; train it without model.quantization"
            ]
        )
    for layer in layers:  # on CPUs with AVX512-BF16 an eval-mode 4-bit forward repacks the weight in place, into a
        # layout no state dict, FSDP shard or export of this code reads
        layer.support_avx512bf16_for_cpu = False
    utils.rank0_print(
        f"model.quantization={c.model.quantization}: {len(layers)} linear layers quantized by bitsandbytes; "
        "embeddings, LM head and norms in the model's dtype"
    )
    return model.requires_grad_(False)


def loadable(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A quantized model's state dict without bitsandbytes' constants (CONSTANTS), as load_state_dict takes it."""
    return {k: v for k, v in state.items() if not k.endswith(CONSTANTS) and ".quant_state.bitsandbytes__" not in k}


def dequantized_weights(model: nn.Module, weights: dict) -> tuple[dict, dict[str, bool]]:
    """(`weights` with every quantized weight dequantized to float64 and the constants dropped, {each such weight's
    key in the merged state dict: whether its layer was GPT-2's Conv1D, stored transposed}). The constants come from
    the live layers, as FSDP2's full state dict has none: 4-bit, bitsandbytes' dequantize_4bit of the packed bytes
    (in whatever dtype they are stored); int8, W = weight * SCB / 127 per row."""
    import bitsandbytes as bnb
    from transformers.pytorch_utils import Conv1D

    out, dense = loadable(weights), {}
    for name, layer in model.named_modules():
        key = f"{clean_name(name)}.weight"
        if key not in out or not isinstance(layer, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)):
            continue
        if isinstance(layer, bnb.nn.Linear4bit):
            state = getattr(layer.weight, "quant_state", None) or layer.quant_state
            packed = out[key].to(state.absmax.device).view(torch.uint8)
            w = bnb.functional.dequantize_4bit(packed, state).double().cpu()
        else:
            scb = layer.weight.SCB if getattr(layer.weight, "SCB", None) is not None else layer.state.SCB
            w = out[key].double() * scb.double().cpu()[:, None] / 127
        out[key] = w
        merged_key = ".".join(p for p in key.removeprefix("base_model.model.").split(".") if p != "base_layer")
        dense[merged_key] = getattr(layer, "source_cls", None) is Conv1D
    return out, dense
