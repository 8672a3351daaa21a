"""Row layouts other than one right-padded row per sequence, as forward_logps' `layout` seam (logps.padded_rows is the
plain one): padding_free packs a micro-batch's sequences into rows of at most max_length tokens; prefix_sharing makes
each pair ONE sequence, prompt + chosen + rejected, the prompt computed once; Ulysses (ulysses.py) gets whole rows whose
width its size divides, and each rank its slice of them. Attention stays within each sequence by a block-diagonal mask:
dense, shaped for each layer type, or on GPUs FlexAttention's block masks (no (T, T) tensor, fully masked blocks
skipped). The log-probs are those of the padded rows: every run with a layout checks so before its first step
(`Layout.probe`). Imported only when one of the three is on.
"""

from __future__ import annotations

import bisect
import functools
from typing import Callable, Optional

import torch
from torch import Tensor

import self_check
from logps import IGNORE_INDEX, Rows, aligned, padded_inputs


def rules(c, world: int) -> list[str]:
    """The config's problems with prefix sharing (config_loader.validate calls this when it is on)."""
    sp = c.fsdp.ulysses_sequence_parallel_size
    problems = []
    if not c.trains_on_pairs:
        problems.append(
            f"prefix_sharing=true: loss.name={c.loss.name!r} scores one completion per "
            "prompt, not a pair sharing it; set prefix_sharing=false"
        )
    if sp > 1:
        problems.append(f"prefix_sharing=true with fsdp.ulysses_sequence_parallel_size={sp}: not supported yet")
    return problems


class Layout:
    """Packed rows (`capacity`: their most tokens, else one sequence a row), a pair's prompt shared
    (`prefix_sharing`: inputs are chosen rows, then the rejected rows of the same pairs), and Ulysses' slices (`sp`: a
    ulysses.SequenceParallel, whose ranks pass the same inputs and each get this rank's slice of every row)."""

    def __init__(self, capacity: Optional[int], prefix_sharing: bool, sp):
        self.capacity = capacity
        self.prefix_sharing = prefix_sharing
        self.sp = sp

    def __call__(self, model, inputs: dict[str, Tensor]) -> Rows:
        """The rows, their attention mask for each layer type of the model (dense, or on GPUs block masks), targets
        aligned (logps.aligned), each token's column its position (rows hold several sequences); Ulysses' slice."""
        capacity, sp = self.capacity, self.sp
        multiple = sp.size if sp else 1
        sdpa = model.config._attn_implementation == "sdpa"
        on_gpu = inputs["input_ids"].device.type in FLEX_DEVICES
        flex = on_gpu and sdpa and getattr(model, "_supports_flex_attn", False)  # GPT-2's attention reads the ndim
        # Ulysses' padded rows longer than a sliding window need its band: on GPUs a BlockMask, the rows as packed
        band = sp and sliding_window(model.config, -(-inputs["input_ids"].size(1) // multiple) * multiple)
        if capacity or self.prefix_sharing or (band and flex):
            kwargs, labels, owner, extra = packed_inputs(
                inputs, capacity, multiple, self.prefix_sharing, model.config if flex else None
            )
        else:  # Ulysses over padded rows: explicit positions and a causal stand-in mask
            (kwargs, labels, owner), extra = padded_inputs(inputs, multiple), None
            kwargs = sp.whole_row_inputs(kwargs)
        if isinstance(kwargs["attention_mask"], Tensor):  # dense: the mask each layer type needs
            positions = kwargs["position_ids"] if self.prefix_sharing else None
            kwargs["attention_mask"] = packed_attention_mask(kwargs["attention_mask"], model.config, positions)
        rows = aligned(kwargs, labels, owner, kwargs["position_ids"], extra)
        if sp is None:
            return rows
        kwargs, targets, owner, column, *tokens = sp.local_slice(
            rows.kwargs, rows.targets, rows.owner, rows.column, *rows.tokens
        )
        return Rows(kwargs, targets, owner, column, tuple(tokens))

    def total(self, x: Tensor) -> Tensor:
        """A per-sequence sum over the rank's slice, summed over its Ulysses group (differentiable)."""
        return self.sp.sum_over_group(x) if self.sp else x

    def probe(self, t, pairs: dict, inputs: dict, ours, dtype) -> list[dict]:
        """The self-check's `layout`: the run's rows against plain padded rows (Ulysses paused), the same head."""
        keys = {
            "padding_free=false": self.capacity is not None,
            "prefix_sharing=false": self.prefix_sharing,
            "fsdp.ulysses_sequence_parallel_size=1": self.sp is not None,
        }
        fix = " and ".join(k for k, on in keys.items() if on)
        padded = self_check.policy_logps(t, inputs, head=t.head)
        what = "the run's rows vs plain padded rows"
        return [self_check.compare(t, "layout", what, ours, padded, dtype, fix, mean=True)]


def packed_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """Sequence indices per row of at most max(capacity, longest) tokens: best-fit decreasing (longest first, each
    into the row it fills best, else a new row); rows are kept sorted by room, so O(n log n)."""
    capacity = max(capacity, max(lengths))
    rows = []
    rooms = []  # sorted (room left, row)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        k = bisect.bisect_left(rooms, (lengths[i], -1))
        room, row = rooms.pop(k) if k < len(rooms) else (capacity, len(rows))
        if row == len(rows):
            rows.append([])
        rows[row].append(i)
        bisect.insort(rooms, (room - lengths[i], row))
    return rows


def packed_inputs(
    inputs: dict[str, Tensor], capacity: Optional[int], multiple: int = 1, shared_prefix: bool = False, flex_config=None
) -> tuple[dict, Tensor, Tensor, Optional[tuple]]:
    """The sequences in rows with explicit positions and a (R, 1, T, T) mask, only row ends padded (to the widest
    row, a multiple of `multiple`): `capacity` packs rows of at most that many tokens (packed_rows), positions
    restarting for each sequence and attention confined to it; None: one per row. Returns what padded_inputs
    returns, then the targets the rows cannot hold (None without `shared_prefix`). With `flex_config` (a model
    config) the mask is FlexAttention's block masks for that model instead (block_masks): no (T, T) tensor.

    `shared_prefix` (inputs: chosen rows, then the rejected rows of the same pairs): each pair is ONE sequence,
    prompt + chosen + rejected, so the prompt is computed once (Wang & Hegde 2024, arXiv:2410.20305). The rejected
    continues the prompt's positions and attends to the prompt and to itself, never to the chosen: every log-prob
    is that of the separate sequences. The prompt is the pair's common unscored prefix. The rejected's first
    token is predicted by the prompt's last position, whose own target is the chosen's first: those targets come
    apart, as (flat position in the rows, label, sequence index, column in its input row)."""
    ids, labels = inputs["input_ids"], inputs["labels"]
    (n, t), device = ids.shape, ids.device
    lengths = inputs["attention_mask"].sum(1).tolist()
    units = [[(i, 0, lengths[i])] for i in range(n)]  # a unit's (sequence, start, end) slices, in order
    prompts = []
    if shared_prefix:
        if n % 2:
            raise ValueError(f"shared_prefix needs chosen rows, then the rejected rows of the same pairs; got {n} rows")
        n //= 2
        differ = (ids[:n] != ids[n:]) | (labels[:n] != IGNORE_INDEX) | (labels[n:] != IGNORE_INDEX)
        first = torch.where(differ.any(1), differ.int().argmax(1), t).tolist()  # a pair's first differing column
        prompts = [min(p, lengths[i], lengths[n + i]) for i, p in enumerate(first)]
        units = [[(i, 0, lengths[i]), (n + i, p, lengths[n + i])] for i, p in enumerate(prompts)]
    sizes = [sum(e - s for _, s, e in unit) for unit in units]
    rows = packed_rows(sizes, capacity) if capacity else [[u] for u in range(len(units))]
    width = -(-max(sum(sizes[u] for u in row) for row in rows) // multiple) * multiple
    source = torch.full((len(rows), width), -1)  # each token's flat index into (n, t); -1: padding
    unit = torch.full_like(source, -1)
    branch = torch.zeros_like(source)
    extra = []
    for r, row in enumerate(rows):
        at = 0
        for u in row:
            first = at
            for k, (i, s, e) in enumerate(units[u]):
                source[r, at : at + e - s], unit[r, at : at + e - s] = torch.arange(i * t + s, i * t + e), u
                if shared_prefix:  # 0 prompt, 1 chosen, 2 rejected
                    branch[r, at + (prompts[u] if k == 0 else 0) : at + e - s] = 1 + k
                # (predicting position, the rejected's first token, its label, sequence, column)
                if k == 1 and 0 < s < e:
                    extra.append((r * width + first + s - 1, r * width + at, i * t + s, i, s))
                at += e - s
    source, unit, branch = source.to(device), unit.to(device), branch.to(device)
    pad = source < 0
    ids, row_labels = (
        x.flatten()[source.clamp(min=0)].masked_fill_(pad, fill) for x, fill in ((ids, 0), (labels, IGNORE_INDEX))
    )
    if extra:
        predictor, first_token, label, sequence, column = (torch.tensor(c, device=device) for c in zip(*extra))
        row_labels.view(-1)[first_token] = IGNORE_INDEX  # predicted by the prompt's last position, not the chosen's
        label = labels.flatten()[label]
        extra = tuple(x[label != IGNORE_INDEX] for x in (predictor, label, sequence, column))
    positions = (source % t).masked_fill_(pad, 0)
    owner = torch.where(pad, -1, source // t)
    row_labels.masked_fill_(positions == 0, IGNORE_INDEX)  # a sequence's first token: no output of its own predicts it
    if flex_config is not None:
        mask = block_masks(unit, branch, positions, flex_config)
    else:  # causal within each unit; padding (unit -1) attends to earlier padding, so no row is empty (NaN)
        mask = (unit[:, :, None] == unit[:, None, :]).tril_()
        if shared_prefix:  # block_masks' rule: keys of the prompt (branch 0) or of the query's own branch
            mask &= (branch[:, None, :] == 0) | (branch[:, None, :] == branch[:, :, None])
        mask = mask[:, None]
    return {"input_ids": ids, "attention_mask": mask, "position_ids": positions}, row_labels, owner, extra or None


# Devices whose packed or shared rows attend through FlexAttention: block masks from per-token vectors, fully masked
# blocks skipped, a fused kernel. CPU keeps the dense mask: FlexAttention has no backward on CPU (torch 2.13).
FLEX_DEVICES = ("cuda",)


@functools.cache
def _block_mask_builder(device_type: str):
    """create_block_mask, compiled on GPUs (eager, it materializes the (R, 1, T, T) mask it compresses)."""
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask) if device_type == "cuda" else create_block_mask


def sliding_window(config, length: int) -> Optional[int]:
    """The window of `config`'s sliding-window layers (Mistral, Gemma2/3, Qwen2 with use_sliding_window) where rows of
    `length` tokens are longer; None where no layer slides or the window holds whole rows (causal, as full layers)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    slides = layer_types is None or "sliding_attention" in layer_types
    return window if window and window < length and slides else None


def _per_layer_type(config, length: int, full, banded: Callable):
    """The mask each attention layer of `config` takes, over rows of `length` tokens: `full` for full attention,
    `banded(window)` for sliding-window layers whose window is shorter than the rows (else `full`: causal is the same);
    a dict by layer type for models with `layer_types`, else the one mask all their layers use."""
    window = sliding_window(config, length)
    masks = {"full_attention": full, "sliding_attention": banded(window) if window else full}
    return masks if getattr(config, "layer_types", None) is not None else masks["sliding_attention"]


def block_masks(unit: Tensor, branch: Tensor, positions: Tensor, config):
    """packed_inputs' mask as FlexAttention block masks, as packed_attention_mask shapes it for each layer type of
    `config` (the sliding window counted in positions); the model's sdpa attention takes them (use_flex_attention)."""
    use_flex_attention()
    (rows, t), build = unit.shape, _block_mask_builder(unit.device.type)

    def full(b, h, q, k):  # causal within a unit, keys of the prompt (branch 0) or of the query's own branch
        return (unit[b, q] == unit[b, k]) & (q >= k) & ((branch[b, k] == 0) | (branch[b, k] == branch[b, q]))

    def banded(window: int):
        def sliding(b, h, q, k):
            return full(b, h, q, k) & (positions[b, q] - positions[b, k] < window)

        return build(sliding, rows, None, t, t, device=unit.device)

    return _per_layer_type(config, t, build(full, rows, None, t, t, device=unit.device), banded)


@functools.cache
def use_flex_attention() -> None:
    """Once: transformers' sdpa attention function, wrapped so that a FlexAttention block mask goes to its
    flex_attention_forward instead. The model keeps its sdpa setting: checkpointed recomputation and generation
    dispatch on the mask they are given, as the first forward did."""
    from torch.nn.attention.flex_attention import BlockMask
    from transformers.integrations import flex_attention
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    @functools.wraps(sdpa)  # keeps ulysses.install's mark: it wraps the registry entry once
    def attention(module, query, key, value, attention_mask, **kwargs):
        # over Ulysses' wrapper (installed first) its block masks go to it: FlexAttention after its all-to-all
        if isinstance(attention_mask, BlockMask) and not getattr(sdpa, "ulysses", False):
            return flex_attention.flex_attention_forward(module, query, key, value, attention_mask, **kwargs)
        return sdpa(module, query, key, value, attention_mask, **kwargs)

    ALL_ATTENTION_FUNCTIONS["sdpa"] = attention


def packed_attention_mask(mask: Tensor, config, positions: Optional[Tensor] = None):
    """A 4-D boolean mask (R or 1, 1, T, T) as each attention layer of `config` needs it: a model given a 4-D mask
    uses it as is, so (1) a sliding window (Mistral, Gemma2/3, Qwen2 with use_sliding_window) must be in it, one
    mask per layer type for models with `layer_types`, counted in `positions` (R, T) where they are given (a shared
    prefix: the rejected is nearer the prompt than its column says), else in columns; (2) eager attention adds it
    to the scores: additive bf16 (0 or a large negative; half of fp32's bytes, the same range). A mask marked
    `causal_only` (SequenceParallel.whole_row_inputs: a stand-in of no memory) stays as it is for full attention."""
    causal_only = getattr(mask, "causal_only", False)
    eager = getattr(config, "_attn_implementation", None) == "eager"

    def additive(m: Tensor) -> Tensor:  # added to scores of any dtype, bf16's min still zeroes the softmax
        if not eager or getattr(m, "causal_only", False):
            return m
        low = torch.full(m.shape, torch.finfo(torch.bfloat16).min, dtype=torch.bfloat16, device=m.device)
        return low.masked_fill_(m, 0.0)

    def banded(window: int) -> Tensor:
        if positions is None:  # query i sees keys i-window+1..i: a band, built in bool (no int64 position differences)
            band = torch.ones(mask.shape[-2:], dtype=torch.bool, device=mask.device).triu_(-(window - 1))
        else:  # (R, 1, T) positions: query position - window < key position, compared straight to bool
            p = positions[:, None]
            band = p[..., None, :] > p[..., :, None] - window
        return additive(band.tril_()[None, None] if causal_only else mask & band)

    return _per_layer_type(config, mask.shape[-1], additive(mask), banded)
