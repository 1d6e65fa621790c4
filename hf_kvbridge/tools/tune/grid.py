"""The configurations `kvbridge tune` searches (`TuneGrid`) and their defaults.

Standard library only at import: the command line's light entry reads the defaults from here without torch.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from ...constants import MLP_LOSSES
from ...errors import InvalidInputError

DEFAULT_TOP_K = (2, 4)
DEFAULT_LAMBDAS: tuple[float | str, ...] = ("auto", 1e-3, 1e-1)
DEFAULT_KV_MODES = ("joint", "separate")
DEFAULT_RANKS = (16, 32)
DEFAULT_FRACTIONS = (0.0, 0.05, 0.1)
DEFAULT_RECOMPUTE_LAYERS = (0, 1, 2)
DEFAULT_MLP_HIDDEN = (256,)
DEFAULT_MLP_LOSS = "attention"  # the mapper comparison's best form (docs/mappers_and_diagnostics.md)
DEFAULT_MLP_EPOCHS = 2
DEFAULT_HIDDEN_STATES = (False, True)  # K/V-only maps, and maps that also read the source's hidden states
DEFAULT_HIDDEN_STATE_LAYERS = "all"  # which hidden states the calibration pass collects for them

# the calibration pass and the windows of a search (`run_tune`'s defaults and `kvbridge tune`'s)
DEFAULT_NUM_SEQUENCES = 64
DEFAULT_SEQ_LEN = 256
DEFAULT_HELDOUT_FRACTION = 0.1
DEFAULT_SEED = 0
DEFAULT_TEXT_FIELD = "text"
DEFAULT_TUNE_WINDOWS = 16
DEFAULT_CHECK_WINDOWS = 16
DEFAULT_CONTEXT = 192
DEFAULT_CONTINUATION = 32


@dataclass
class TuneGrid:
    """The configurations `run_tune` searches.

    Args:
        top_k (`tuple[int]`): source layers per target layer (capped at the source's layers; duplicates dropped).
        ridge_lambdas (`tuple`): `"auto"` and/or fixed λ ≥ 0.
        kv_modes (`tuple[str]`): `"joint"` and/or `"separate"` (ridge and low-rank maps alike).
        ranks (`tuple[int]`): ranks of the low-rank mapper (empty: ridge only).
        recompute_fractions (`tuple[float]`): shares of the mapped context the target recomputes (`tail` policy).
        recompute_layers (`tuple[int]`): top target layers the target computes over the whole context (layer
            recompute; capped at the target's layers, duplicates dropped). Their residual maps are fitted in the
            calibration pass; `0` is the plain bridge, the target's layer count needs no map.
        mlp_hidden (`tuple[int]`): hidden widths of MLP mappers, each trained from the ridge fit of every top-k at
            the first λ and kv mode of the grid (empty: no MLP).
        mlp_loss (`str`): the MLP's training loss, `"attention"` or `"mse"`.
        mlp_epochs (`int`): the MLP's passes over the calibration windows.
        hidden_states (`tuple[bool]`): `False`: maps of the source's K/V only; `True`: maps that also read the
            source's hidden states (`hidden_state_layers`, `hf_kvbridge.utils.source_features`; ridge and low rank,
            joint
            K/V only). The calibration pass collects those hidden states' statistics whenever the grid has `True`,
            and the K/V-only fits leave them out, so both come from the same pass.
        hidden_state_layers (`"all"`, `int` or `list[int]`): the source's `output_hidden_states` entries the
            hidden-state maps read (`None`: no hidden-state maps).

    Example:

    ```python
    >>> grid = TuneGrid(top_k=(2,), ridge_lambdas=("auto",), kv_modes=("joint",), ranks=(), mlp_hidden=(),
    ...                 recompute_fractions=(0.0, 0.1), recompute_layers=(0, 1, 8), hidden_states=(False,))
    >>> grid.recompute(target_layers=8)  # n = L_t leaves nothing to recompute token by token
    [(0.0, 0), (0.0, 1), (0.1, 0), (0.1, 1), (0.0, 8)]
    >>> grid.size(source_layers=3, target_layers=8)
    5
    ```
    """

    top_k: tuple[int, ...] = DEFAULT_TOP_K
    ridge_lambdas: tuple[float | str, ...] = DEFAULT_LAMBDAS
    kv_modes: tuple[str, ...] = DEFAULT_KV_MODES
    ranks: tuple[int, ...] = DEFAULT_RANKS
    recompute_fractions: tuple[float, ...] = DEFAULT_FRACTIONS
    recompute_layers: tuple[int, ...] = DEFAULT_RECOMPUTE_LAYERS
    mlp_hidden: tuple[int, ...] = DEFAULT_MLP_HIDDEN
    mlp_loss: str = DEFAULT_MLP_LOSS
    mlp_epochs: int = DEFAULT_MLP_EPOCHS
    hidden_states: tuple[bool, ...] = DEFAULT_HIDDEN_STATES
    hidden_state_layers: str | int | list[int] | None = DEFAULT_HIDDEN_STATE_LAYERS

    def __post_init__(self):
        from ...utils.source_features import check_hidden_state_layers_value

        check_hidden_state_layers_value(self.hidden_state_layers)
        if not self.hidden_states or any(not isinstance(h, bool) for h in self.hidden_states):
            raise InvalidInputError(
                f"hidden_states must be a non-empty tuple of True/False, got {list(self.hidden_states)}"
            )
        if False not in self.hidden_states and not self.uses_hidden_states:
            raise InvalidInputError(
                "a grid of hidden-state maps only (hidden_states=(True,)) needs hidden_state_layers and the 'joint' "
                f"kv mode (a hidden state has no key/value halves), got hidden_state_layers="
                f"{self.hidden_state_layers!r}, kv_modes={list(self.kv_modes)}"
            )

        if self.mlp_loss not in MLP_LOSSES:
            raise InvalidInputError(f"mlp_loss must be one of {MLP_LOSSES}, got {self.mlp_loss!r}")
        if any(int(h) < 1 for h in self.mlp_hidden) or int(self.mlp_epochs) < 1:
            raise InvalidInputError(
                f"mlp_hidden widths and mlp_epochs must be ≥ 1, got {list(self.mlp_hidden)} and {self.mlp_epochs}"
            )

    @property
    def uses_hidden_states(self) -> bool:
        """Whether some fit reads the source's hidden states (so the calibration pass collects them)."""
        return True in self.hidden_states and self.hidden_state_layers is not None and "joint" in self.kv_modes

    def layers(self, target_layers: int) -> list[int]:
        """The `recompute_layers` values measured on a target of `target_layers` layers (capped, sorted, unique)."""
        return sorted({min(int(n), target_layers) for n in self.recompute_layers})

    def recompute(self, target_layers: int) -> list[tuple[float, int]]:
        """Every `(recompute_fraction, recompute_layers)` pair measured with each fit; `n = L_t` at fraction 0 only
        (the target prefills the span itself: no token is left to recompute)."""
        layers = self.layers(target_layers)
        pairs = [(float(f), n) for f, n in itertools.product(self.recompute_fractions, layers) if n < target_layers]
        return pairs + ([(0.0, target_layers)] if target_layers in layers else [])

    def fits(self, source_layers: int, feature_blocks: int | None = None) -> list[dict]:
        """Every mapper to fit, as `{"top_k", "ridge_lambda", "kv_mode", "mapper_type", "rank", "hidden_states"}`
        (MLPs also `"hidden"`, `"loss"`, `"epochs"`; no recompute). Top-k is capped at the source's layers, and for
        the hidden-state maps at the feature blocks they choose from (`feature_blocks`: K/V layers + hidden-state
        blocks; defaults to the source's layers)."""
        top_k = sorted({min(k, source_layers) for k in self.top_k})
        blocks = max(source_layers, feature_blocks or source_layers)
        states = [h for h in dict.fromkeys(self.hidden_states) if not h or self.uses_hidden_states]
        mappers = []
        ks = {False: top_k, True: sorted({min(k, blocks) for k in self.top_k})}
        configurations = [(h, k) for h in states for k in ks[h]]
        for (hs, k), lam, kv in itertools.product(configurations, self.ridge_lambdas, self.kv_modes):
            if hs and kv != "joint":  # a hidden state has no key/value halves
                continue
            common = {"top_k": k, "ridge_lambda": lam, "kv_mode": kv}
            mappers.append({**common, "mapper_type": "ridge", "rank": None, "hidden_states": hs})
            mappers += [{**common, "mapper_type": "low_rank", "rank": r, "hidden_states": hs} for r in self.ranks]
        if self.ridge_lambdas and self.kv_modes:
            lam, kv = self.ridge_lambdas[0], self.kv_modes[0]
            mlp = {"loss": self.mlp_loss, "epochs": int(self.mlp_epochs)}
            mappers += [
                {"top_k": k, "ridge_lambda": lam, "kv_mode": kv, "mapper_type": "mlp", "rank": None,
                 "hidden_states": False, "hidden": int(h), **mlp}
                for k in top_k
                for h in self.mlp_hidden
            ]  # fmt: skip
        return mappers

    def has_mlp(self, source_layers: int) -> bool:
        """Whether some fit of the grid trains an MLP (and so needs the calibration windows)."""
        return any(f["mapper_type"] == "mlp" for f in self.fits(source_layers))

    def size(self, source_layers: int, target_layers: int, feature_blocks: int | None = None) -> int:
        """How many configurations the grid measures."""
        return len(self.fits(source_layers, feature_blocks)) * len(self.recompute(target_layers))
