"""Small helpers used everywhere: rank-aware printing, block-class lookup, seeding, files and run directories, and the
few distributed helpers (sharding.py, fsdp.py and ulysses.py hold the rest)."""

import hashlib
import os
import random
import socket
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch
import torch.distributed as dist


def get_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", 0))


def rank0_print(*args, **kwargs) -> None:
    """print() on global rank 0 only, so that N ranks do not print every line N times."""
    if get_rank() == 0:
        print(*args, **kwargs, flush=True)


def formatted_dict(d: dict[str, Any]) -> dict[str, Any]:
    """Floats rounded to 5 significant digits, for printing metrics."""
    return {k: (float(f"{v:.5g}") if isinstance(v, float) else v) for k, v in d.items()}


# --- models ---
def get_block_class_from_model(model: torch.nn.Module, block_class_name: str) -> type:
    """The class of the first submodule named `block_class_name` (e.g. 'GPTNeoXLayer'); a ValueError listing the
    model's module classes when there is none, so a typo is obvious."""
    for module in model.modules():
        if type(module).__name__ == block_class_name:
            return type(module)
    names = sorted({type(m).__name__ for m in model.modules()})
    raise ValueError(
        f"no module of class '{block_class_name}' in {type(model).__name__}; its module classes are: {', '.join(names)}"
    )


def find_block_class_names(model: torch.nn.Module) -> list[str]:
    """Transformer block class names for FSDP wrapping: the model's `_no_split_modules` present in it."""
    present = {type(m).__name__ for m in model.modules()}
    return [n for n in (getattr(model, "_no_split_modules", None) or []) if n in present]


def disable_dropout(model: torch.nn.Module) -> None:
    """Every dropout probability (and a router's input noise) to 0: DPO's log-ratios must be deterministic functions
    of the weights."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):  # attention copies config.attention_dropout
            module.attention_dropout = 0.0
        if isinstance(getattr(module, "jitter_noise", None), float):  # Mixtral, PhiMoE, MiniMax: noise on router inputs
            module.jitter_noise = 0.0
    keys = ["attention_dropout", "hidden_dropout", "dropout", "router_jitter_noise"]
    for key in keys + ["resid_pdrop", "embd_pdrop", "attn_pdrop"]:  # and GPT-2's names
        if isinstance(getattr(model.config, key, None), float):
            setattr(model.config, key, 0.0)


def use_shape_free_attention(device: torch.device) -> None:
    """On CUDA, turn off cuDNN's SDPA backend (flash and memory-efficient attention remain): it builds a graph for
    every new input shape, and nearly every batch here has a new width (benchmarks/README.md: the GPU check)."""
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


def clean_name(name: str) -> str:
    """A parameter or module name without the wrappers' prefixes (activation checkpointing, FSDP1)."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_fsdp_wrapped_module.", "")


# name: (dense bf16 tensor peak TFLOP/s, fp32 peak TFLOP/s (no TF32), memory GiB); vendor datasheets
DEVICES = {
    "H200": (989.0, 67.0, 141),
    "H100": (989.0, 67.0, 80),
    "A100": (312.0, 19.5, 80),
    "A100-40GB": (312.0, 19.5, 40),
    "L40S": (362.0, 91.6, 48),
    "A10": (125.0, 31.2, 24),  # A10G too: the name is matched as a substring of the device's (trainers' MFU)
    "L4": (121.0, 30.3, 24),
}


# --- seeding and state ---
def seed_everything(seed: int, full_determinism: bool = False) -> None:
    """Seed python, numpy and torch (CPU and CUDA); with full_determinism also force deterministic kernels."""
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    if full_determinism:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before the first cuBLAS call
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def sampling_seed(seed: int, examples_seen: int, group: int) -> int:
    """The seed of one group's samples, mixed by numpy's SeedSequence (nearby inputs give unrelated streams)."""
    return int(np.random.SeedSequence([seed, examples_seen, group]).generate_state(1)[0])


def get_rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    return dict(state, cuda=torch.cuda.get_rng_state_all()) if torch.cuda.is_available() else state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --- files ---
def first_usable_dir(dirs: Iterable[str]) -> Path:
    """The first of `dirs` that exists or can be created (the original's get_local_dir)."""
    tried = []
    for d in dirs:
        try:
            Path(d).expanduser().mkdir(parents=True, exist_ok=True)
            return Path(d).expanduser()
        except OSError as e:
            tried.append(f"{d} ({e.strerror})")
    raise OSError(f"none of local_dirs is usable: {', '.join(tried)}")


def get_local_run_dir(exp_name: str, local_dirs: Iterable[str]) -> Path:
    """<first usable local dir>/runs/<exp_name>_<timestamp>, not made yet; microseconds: two runs never collide."""
    return first_usable_dir(local_dirs) / "runs" / f"{exp_name}_{datetime.now().strftime('%Y-%m-%d_%H-%M-%S_%f')}"


def hub_offline() -> bool:
    """Whether HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set to a true value, as the Hugging Face libraries read them."""
    values = (os.environ.get(v, "").lower() for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    return any(v in ("1", "true", "yes", "on") for v in values)


def file_sha256(path: Path) -> str:
    """The file's sha256 (hex), read as a stream: never held whole."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` so that a reader (or a crash) sees the old file or the new one, never half."""
    tmp = Path(path).with_name(f".{Path(path).name}.tmp.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (a rename is on disk only once its directory is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def get_open_port() -> int:
    """A free TCP port on this machine, for the single-node rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- distributed (the single-process path never calls these) ---
# How long the other ranks wait for rank 0's lone work (loading the weights; writing, fsyncing and hashing a
# checkpoint: ~140 GB at 7B with AdamW). Far above collective_timeout_secs on purpose: that one bounds waits for a dead
# peer inside training, this one disk I/O. A rank 0 that dies still ends the job at once (torchrun, mp.spawn).
RANK0_WORK_TIMEOUT = timedelta(hours=2)
_rank0_work_group = None  # a gloo group with RANK0_WORK_TIMEOUT, made by init_distributed


def process_group_backend(cuda: bool) -> str:
    """With GPUs "cpu:gloo,cuda:nccl" (as torchtitan): every collective takes its tensor's device's backend (NCCL
    takes CUDA tensors only; reference tables and CPU flags go through gloo). Without GPUs, gloo."""
    return "cpu:gloo,cuda:nccl" if cuda else "gloo"


def init_distributed(collective_timeout_secs: float, cuda: bool) -> None:
    """Join the default process group (env://); a hung collective (a dead peer) raises after the timeout."""
    global _rank0_work_group
    dist.init_process_group(process_group_backend(cuda), timeout=timedelta(seconds=collective_timeout_secs))
    _rank0_work_group = dist.new_group(backend="gloo", timeout=RANK0_WORK_TIMEOUT)


def destroy_distributed() -> None:
    global _rank0_work_group
    _rank0_work_group = None
    dist.destroy_process_group()


def wait_for_rank0() -> None:
    """A barrier in the gloo group with RANK0_WORK_TIMEOUT (the default group without init_distributed)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group=_rank0_work_group)


def all_gather_if_needed(values: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """`values` (the same shape on every rank) concatenated over the ranks along dim 0, on `values`' device."""
    if world_size == 1:
        return values
    gathered = [torch.empty_like(values) for _ in range(world_size)]
    dist.all_gather(gathered, values)
    return torch.cat(gathered, dim=0)


def all_ranks_true(flag: bool, device: torch.device) -> bool:
    """True on every rank when `flag` is True on every rank, else False on every rank: one decision for all."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    value = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def broadcast_object(obj: Any, slow: bool = False) -> Any:
    """Rank 0's `obj` on every rank (e.g. the run directory, whose name holds rank 0's timestamp); `slow`: waited
    for with RANK0_WORK_TIMEOUT (rank 0 hashing a checkpoint), not collective_timeout_secs."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_rank0_work_group if slow else None)
    return box[0]


def all_gather_object(obj: Any, slow: bool = False) -> list:
    """Every rank's `obj`, in rank order ([obj] in one process); `slow` as in broadcast_object."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=_rank0_work_group if slow else None)
    return out
