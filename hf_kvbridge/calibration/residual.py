"""The residual maps of layer recompute, fitted from the same passes as the K/V maps."""

from __future__ import annotations

import copy
import logging

import torch

from ..modeling import KVBridgeForCausalLM
from ..transfer.layer_recompute import (
    ResidualCollection,
    hidden_size,
    residual_statistics,
)

logger = logging.getLogger(__name__)


def residual_collection(
    kind, source, target, recompute_layers: list[int], device=None, dtype=torch.float32, sources=None
) -> ResidualCollection:
    """The residual statistics of layer recompute for `recompute_layers` to fill in a pass of `collect_statistics`
    (`kind`: `KVStatistics`, `SelectionStatistics`, or `BlockStatistics` of the `sources` kept), with the hidden
    states they read: every source hidden state, and the target's entering layer `L_t − n` for each `n`.

    Example:

    ```python
    >>> residual = residual_collection(KVStatistics, source, target, [1, 2])  # doctest: +SKIP
    >>> train, held = collect_statistics(source, target, windows, heldout=[0], residual=residual)  # doctest: +SKIP
    >>> mapper, summary = fit_residual_map(*residual.parts, [1, 2], 32, 48, top_k=2)  # doctest: +SKIP
    ```
    """
    source_states = source.config.get_text_config(decoder=True).num_hidden_layers + 1
    target_layers = target.config.get_text_config(decoder=True).num_hidden_layers
    shape = (hidden_size(source), hidden_size(target), source_states, len(recompute_layers))
    return ResidualCollection(
        list(range(source_states)),
        [target_layers - n for n in recompute_layers],
        [residual_statistics(kind, *shape, device=device, dtype=dtype, sources=sources) for _ in range(2)],
    )


def with_residual_map(bridge: KVBridgeForCausalLM, fitted: tuple) -> KVBridgeForCausalLM:
    """`bridge` with the residual map `fitted` (`fit_residual_map`'s `(mapper, summary)`), recorded in its config
    (`residual_map`)."""
    mapper, summary = fitted
    config = copy.deepcopy(bridge.config)
    config.residual_map = summary
    logger.info(
        "residual maps for recompute_layers %s: held-out R² %s", summary["recompute_layers"], summary["heldout_r2"]
    )
    return bridge.with_residual_mapper(mapper, config)
