"""The residual map of layer recompute (`hf_kvbridge.transfer.layer_recompute`): a [`KVMapper`] from the source's
hidden states to the hidden state entering one of the target's top layers, one map per calibrated `n`.

A hidden state of width `D` is laid out as one "KV head" of head dim `D / 2` (its first half in the key slot, its
second half in the value slot; `layout.hidden_layout`), so the K/V statistics, selection and solve fit it
unchanged (`hf_kvbridge.fitting.calibration.residual`). The halves mean nothing here.
"""

from __future__ import annotations

import torch

from ..errors import ConfigurationError
from ..utils.layout import hidden_layout
from .base import KVMapper


class ResidualMapper(KVMapper):
    """The residual maps of layer recompute: for each calibrated `n` (`recompute_layers`), a ridge map from the hidden
    states of its selected source layers to the hidden state entering target layer `L_t − n`.

    A [`KVMapper`] whose "target layers" are the calibrated `n` values (in `recompute_layers` order) and whose
    "source layers" are the source's hidden states (`0 … L_s`), laid out as one KV head of `D / 2` (see the module
    docstring); its weights are one `(1, k·D_s, D_t)` matrix and a `(1, D_t)` bias per `n`.

    Args:
        selected_layers (`list[list[int]]`): per calibrated `n`, the source hidden states read, best first.
        source_hidden (`int`), target_hidden (`int`): the two hidden sizes.
        recompute_layers (`list[int]`): the calibrated `n` values, one per entry of `selected_layers`.

    Example:

    ```python
    >>> mapper = ResidualMapper([[3, 2]], source_hidden=8, target_hidden=12, recompute_layers=[2])
    >>> hidden = [torch.randn(1, 5, 8) for _ in range(4)]  # the source's hidden states, (B, T, D_s) each
    >>> mapper.map_hidden(hidden, 2).shape
    torch.Size([1, 5, 12])
    ```
    """

    def __init__(self, selected_layers, source_hidden: int, target_hidden: int, recompute_layers: list[int]):
        heads, dim = hidden_layout(source_hidden, "source")
        _, target_dim = hidden_layout(target_hidden, "target")
        super().__init__(
            selected_layers, heads, dim, "all_heads", "joint", target_kv_heads=1, target_head_dim=target_dim
        )
        if len(recompute_layers) != len(self.selected_layers):
            raise ConfigurationError(
                f"the residual map has {len(self.selected_layers)} maps for recompute_layers {recompute_layers}; give "
                "one list of source hidden states per value"
            )
        self.recompute_layers = [int(n) for n in recompute_layers]
        self.source_hidden, self.target_hidden = int(source_hidden), int(target_hidden)

    groupable = False  # one map per n, never several at once

    @classmethod
    def from_config(cls, config, layout=None) -> ResidualMapper:
        """An empty residual mapper shaped as `config.residual_map` records, to load weights into (`layout` is not
        needed: the record holds both hidden sizes)."""
        residual = config.residual_map
        return cls(
            residual["selected_layers"],
            residual["source_hidden_size"],
            residual["target_hidden_size"],
            residual["recompute_layers"],
        )

    @torch.no_grad()
    def map_hidden(self, hidden_states, recompute_layers: int) -> torch.Tensor:
        """The hidden state entering target layer `L_t − recompute_layers`, mapped from the source's.

        Args:
            hidden_states (`tuple[torch.Tensor]`): the source's `output_hidden_states`, `L_s + 1` tensors of
                `(B, T, D_s)` (only the selected ones are read).
            recompute_layers (`int`): a calibrated `n`.

        Returns:
            `torch.Tensor` of shape `(B, T, D_t)`, in the mapper's dtype, on its device.
        """
        t = self.recompute_layers.index(recompute_layers)
        weight = self.layers[t].weight
        batch, seq, _ = hidden_states[0].shape
        rows = [
            hidden_states[s].reshape(batch * seq, -1).to(weight.device, weight.dtype) for s in self.selected_layers[t]
        ]
        return self.map_layer(t, rows).view(batch, seq, self.target_hidden)  # (B·T, D_t) → (B, T, D_t)
