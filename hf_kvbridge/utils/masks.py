"""A (left-)padded batch's positions and padding, from its attention mask, as `generate` computes them."""

from __future__ import annotations

import torch


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Per-row positions of a (left-)padded batch, as `generate` computes them: `cumsum(mask) - 1`, pads at 0."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 0)


def left_padding(attention_mask: torch.Tensor) -> torch.Tensor:
    """Per-row left padding of a `(batch, seq)` mask: `(batch,)`."""
    return (attention_mask.cumsum(-1) == 0).sum(-1)
