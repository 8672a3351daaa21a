"""The entropy bonus (loss.entropy_coeff > 0, as verl's): loss - entropy_coeff * the policy's mean entropy, so the
entropy is differentiated: from the model's full logits at the scored positions, in row chunks
(fsdp.entropy_from_logits_with_chunking), recomputed in backward (fsdp.entropy_checkpointing), compiled
(fsdp.use_torch_compile; null: on CUDA).
Without the bonus the logged entropy is a detached statistic of the log-prob path. Imported only with the bonus.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from logps import Rows, entropy, label_logps, log_sum_sq, scored_logits


class Head:
    """forward_logps' `head` seam with the bonus: the plain log-probs (logps.label_logps) and, in the place of their
    detached entropy, a differentiable one (entropy_from_logits, as the fsdp.* options ask)."""

    def __init__(self, fsdp, device: torch.device):
        self.options = dict(
            chunking=fsdp.entropy_from_logits_with_chunking,
            checkpointing=fsdp.entropy_checkpointing,
            use_compile=device.type == "cuda" if fsdp.use_torch_compile is None else fsdp.use_torch_compile,
        )

    def __call__(self, model, call, rows: Rows, sum_sq: bool = False):
        if not torch.is_grad_enabled():  # evaluation: nothing to differentiate
            return label_logps(model, call, rows, sum_sq)
        logits, labels, scored = scored_logits(call, rows)
        logps = logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(-1)
        token_sq = log_sum_sq(logits).detach() if sum_sq else None
        return logps.gather(-1, labels[:, None])[:, 0], entropy_from_logits(logits, **self.options), token_sq, scored


class _CompileOnFirstCall:
    """torch.compile(fn), built on the first call (only runs that ask pay the compile); where compiling fails (no
    C++ compiler) it warns once and runs fn eagerly from then on."""

    def __init__(self, fn: Callable[[Tensor], Tensor]):
        self.fn = fn
        self.impl = None

    def __call__(self, x: Tensor) -> Tensor:
        if self.impl is None:
            try:
                self.impl = torch.compile(self.fn, dynamic=True)  # dynamic: the last chunk is shorter
                return self.impl(x)
            except Exception as err:  # noqa: BLE001 - any compile failure means "not available here"
                warnings.warn(
                    f"torch.compile is unavailable here ({type(err).__name__}: {err}); computing "
                    f"{self.fn.__name__} eagerly instead",
                    RuntimeWarning,
                    stacklevel=2,
                )
                self.impl = self.fn
        return self.impl(x)


_COMPILED_ENTROPY = _CompileOnFirstCall(entropy)


def entropy_from_logits(
    logits: Tensor,
    *,
    chunking: bool = False,
    checkpointing: bool = False,
    use_compile: bool = False,
    chunk_size: int = 1024,
) -> Tensor:
    """Entropy of softmax(logits) at every position, (..., V) -> (...,) in fp32. `chunking`: chunk_size rows at a
    time (one chunk's fp32 softmax at once); `checkpointing`: backward recomputes each chunk instead of keeping it
    (matters only when the entropy is differentiated); `use_compile`: the per-chunk function through torch.compile.
    Head calls it for the bonus (differentiable, also logged)."""
    fn = _COMPILED_ENTROPY if use_compile else entropy
    flat = logits.reshape(-1, logits.shape[-1])
    if flat.shape[0] == 0:
        return flat.new_zeros(logits.shape[:-1], dtype=torch.promote_types(logits.dtype, torch.float32))
    recompute = checkpointing and torch.is_grad_enabled() and logits.requires_grad
    size = chunk_size if chunking else flat.shape[0]
    pieces = [
        checkpoint(fn, flat[rows], use_reentrant=False) if recompute else fn(flat[rows])
        for rows in (slice(i, i + size) for i in range(0, flat.shape[0], size))
    ]
    return torch.cat(pieces).view(logits.shape[:-1])
