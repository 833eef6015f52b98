"""Held-out perplexity of any ``ids -> logits`` function, over fixed windows of a token stream.

The function is all this module knows about the model, so one measurement serves the
unsharded Hugging Face model (``lambda ids: model(ids).logits``), a captured program
(``program``), a tensor-parallel module or a simulated sharded one: every candidate sees the
same windows in the same batches, and the per-window figures can be compared pairwise.

Windows: the stream (1-D token ids) is cut into ``len // window`` contiguous, non-overlapping
windows of ``window`` tokens; the tail shorter than a window is left out (``tokens_dropped``).
Each window is scored from an empty state: its tokens 1 .. window-1 are predicted from the
tokens before them inside the window (``window - 1`` predictions per window). Perplexity is
``exp(sum of negative log-likelihoods / predictions)``; sums are taken in float64.

Dimension letters: W windows, b windows of a batch, T window length, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch
import torch.nn.functional as F


@dataclasses.dataclass
class Perplexity:
    perplexity: float
    mean_nll: float  # nats per predicted token
    nll_sum: float
    predictions: int  # tokens scored: windows * (window - 1)
    windows: int
    window: int
    tokens_dropped: int  # tail of the stream shorter than a window
    window_nll: torch.Tensor  # (W,) float64: summed NLL of each window, for paired comparisons

    def as_dict(self) -> dict:
        """JSON-ready figures (the per-window sums are left out)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "window_nll"}


def windows(token_ids: torch.Tensor, window: int) -> torch.Tensor:
    """(W, T) view of the stream's full windows of ``window`` tokens, in stream order."""
    if token_ids.dim() != 1 or token_ids.dtype.is_floating_point or token_ids.dtype == torch.bool:
        raise ValueError(f"token_ids must be a 1-D integer tensor, got {token_ids.dtype} of shape "
                         f"{tuple(token_ids.shape)}")
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens (one context, one prediction), got {window}")
    count = token_ids.numel() // window
    if count == 0:
        raise ValueError(f"the stream has {token_ids.numel()} tokens, fewer than one window of {window}")
    return token_ids[: count * window].view(count, window)  # (W * T,) -> (W, T)


@torch.no_grad()
def perplexity(logits_fn: Callable[[torch.Tensor], torch.Tensor], token_ids: torch.Tensor, *, window: int = 512,
               batch_size: int = 16, device=None, max_windows: int | None = None) -> Perplexity:
    """Perplexity of ``logits_fn`` on ``token_ids`` (see the module docstring for the windows).

    ``logits_fn`` takes a (b, T) int64 tensor on ``device`` and returns (b, T, V) logits (any
    float dtype; scored in float32). ``device``: where the ids are sent (default: where
    ``token_ids`` lives). ``max_windows``: score only the first windows (a quick estimate).
    """
    all_windows = windows(token_ids, window)
    if max_windows is not None:
        all_windows = all_windows[:max_windows]
    device = token_ids.device if device is None else torch.device(device)
    sums = []
    for start in range(0, all_windows.shape[0], batch_size):
        ids = all_windows[start:start + batch_size].to(device=device, dtype=torch.long)  # (b, T)
        logits = logits_fn(ids)
        if not isinstance(logits, torch.Tensor):
            raise TypeError(f"logits_fn must return a tensor of logits, got {type(logits).__name__} "
                            "(for a Hugging Face model pass lambda ids: model(ids).logits)")
        if logits.dim() != 3 or logits.shape[:2] != ids.shape:
            raise ValueError(f"logits_fn returned shape {tuple(logits.shape)} for ids of shape {tuple(ids.shape)}; "
                             "expected (batch, window, vocabulary)")
        token_nll = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), ids[:, 1:],  # (b, V, T-1)
                                    reduction="none")  # (b, T-1)
        sums.append(token_nll.double().sum(dim=1).cpu())
    window_nll = torch.cat(sums)
    nll_sum = float(window_nll.sum())
    predictions = window_nll.numel() * (window - 1)
    mean = nll_sum / predictions
    return Perplexity(perplexity=math.exp(mean), mean_nll=mean, nll_sum=nll_sum, predictions=predictions,
                      windows=window_nll.numel(), window=window,
                      tokens_dropped=token_ids.numel() - windows(token_ids, window).numel(), window_nll=window_nll)
