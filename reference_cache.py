"""precompute_ref_log_probs: one pass of the reference over the pairs a run uses (train and eval), cached on disk under
a key of model, archive, dtype, quantization, tokenizer and data, then the reference's memory freed: training runs
one model, not two. Reference.logps reads the tables this fills. Imported only when the switch is on
(BasicTrainer.train, the self-check's `cache` probe, config_loader's rules).
"""

import gc
import hashlib
import math
import os
from pathlib import Path

import torch

import preference_datasets as data
import self_check
import utils
from logps import SequenceLogps, concatenated_inputs
from utils import all_gather_object, rank0_print


def rules(c, world: int) -> list[str]:
    """The precomputed reference table holds sums: refused for what reads each token's reference log-prob (LD-DPO,
    modifiers.logps_needed; config_loader.validate calls this when the switch is on)."""
    if c.loss.ld_alpha == 1:
        return []
    return [
        f"loss.ld_alpha={c.loss.ld_alpha} and precompute_ref_log_probs=true: LD-DPO weighs the reference's tokens "
        "too, and the precomputed table holds sums only; set one of them off"
    ]


def precompute(t) -> None:
    """precompute_ref_log_probs: one pass of the reference over the pairs this run uses (train and eval), cached on
    disk, then the model is freed: training runs one model, not two."""
    c, ref = t.config, t.reference
    if ref.model is None:  # nothing to precompute: reference_free, or a loss without a reference
        return
    used = data.iter_batch_indices(
        t.n_train_pairs,
        batch_size=c.batch_size,
        shuffle=True,
        seed=t.seed,
        n_epochs=c.n_epochs,
        n_examples=c.n_examples,
    )
    ref.tables = {
        "train": table(t, "train", sorted({i for batch in used for i in batch})),
        "test": table(t, "test", list(range(t.n_eval_pairs))),
    }
    freed = 0 if ref.lora else t.sharding.release(ref.model)  # under LoRA the model IS the policy: kept
    ref.model = None
    gc.collect()  # FSDP2's modules sit in reference cycles
    left = ""
    if t.device.type == "cuda":
        torch.cuda.empty_cache()  # the freed blocks back to the device
        left = f"; {torch.cuda.memory_allocated(t.device) / 2**20:.0f} MiB still allocated on {t.device}"
    rank0_print(f"reference log-probs ready; reference model freed ({freed / 2**20:.1f} MiB on rank 0{left})")


def table(t, split: str, wanted: list[int]) -> torch.Tensor:
    """(n_examples, 2) summed reference log-probs of chosen and rejected (NaN where never needed), cached under a
    key of model, archive, dtype, model.quantization, tokenizer and tokenized examples; a later run computes only what
    the cache lacks. Rank 0 reads the cache (local_dirs may be node-local); every rank takes its known."""
    c, ref = t.config, t.reference
    examples = t.splits[split]
    archive = Path(c.model.archive) if c.model.archive else None
    key = (
        c.model.name_or_path,
        c.model.reference_dtype or c.fsdp.model_dtype,
        ref.mixed and c.fsdp.mixed_precision,
        archive and (str(archive.resolve()), archive.stat().st_size, archive.stat().st_mtime_ns),
        sorted(examples.keys.items()),  # data, tokenizer
        len(examples),
    ) + ((c.model.quantization,) if c.model.quantization else ())  # a quantized base's log-probs are its own
    digest = hashlib.sha256(repr(key).encode()).hexdigest()[:16]
    path = utils.first_usable_dir(c.local_dirs) / "reference_logps" / f"{split}-{digest}.pt"
    known = None
    if t.rank == 0:
        known = torch.load(path, weights_only=True) if path.exists() else torch.full((len(examples), 2), math.nan)
    known = utils.broadcast_object(known)
    missing = [i for i in wanted if math.isnan(known[i, 0])]
    rank0_print(
        f"reference log-probs of {split}: {len(wanted) - len(missing)} cached in {path}, {len(missing)} to compute"
    )
    if missing:
        mine = rank_share(missing, t.dp_rank, t.dp_size)  # as many forwards on every rank (collectives under FSDP)
        size = max(1, c.eval_batch_size // t.dp_size)
        values = []
        for start in range(0, len(mine), size):
            rows = data.collate(examples.rows(mine[start : start + size]), t.tokenizer.pad_token_id)
            sums = ref.forward(concatenated_inputs(rows)).sums.float().cpu()
            # SFT: one sequence per example, its sum in both columns
            values.append(torch.stack([sums, sums], 1) if examples[0].rejected_ids is None else sums.view(2, -1).T)
        # on the training device: a collective backend may take only that device's tensors (NCCL: CUDA)
        where = t.sharding.gather(torch.tensor(mine, device=t.device)).cpu()
        known[where] = t.sharding.gather(torch.cat(values).to(t.device)).cpu()
        if t.rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(known, path.with_suffix(".tmp"))
            os.replace(path.with_suffix(".tmp"), path)
    return known


def rank_share(indices: list[int], rank: int, world_size: int) -> list[int]:
    """Every world_size-th index from `rank`, padded with indices[0] to ceil(len / world_size): all ranks run as many
    forwards (none empty while there are indices)."""
    mine = indices[rank::world_size]
    return mine + indices[:1] * (-(-len(indices) // world_size) - len(mine))


def probe(t, pairs: dict, inputs: dict, ours: SequenceLogps, dtype) -> list[dict]:
    """The self-check's `cache`: the cached table's log-probs, read as the loss reads them (Reference.logps), vs a live
    reference forward, in the reference's precision."""
    c, ref = t.config, t.reference
    live = ref.forward(inputs)
    # every rank asks for the same rows: the table's forwards are collectives
    wanted = sorted({i for part in all_gather_object(pairs["example_index"].tolist()) for i in part})
    ref.tables = {"train": table(t, "train", wanted)}
    cached = ref.logps(pairs, inputs, "train").sums.to(live.sums)
    ref.tables = {}  # unset: precompute fills the tables
    what = "precomputed reference log-probs vs a live reference forward"
    fix = "precompute_ref_log_probs=false (or delete the cached table)"
    dtype = self_check.compute_dtype(c, ref.mixed, c.model.reference_dtype or c.fsdp.model_dtype)
    return [self_check.compare(t, "cache", what, SequenceLogps(cached, live.counts), live, dtype, fix)]
