"""`kvbridge tune`: search a grid of bridge configurations from one statistics pass and pick one by quality and cost.

One calibration pass keeps its `(train, held-out)` statistics, and fits the residual maps of layer recompute for the
grid's `recompute_layers` values in the same pass (`CalibrationSettings.recompute_layers=[...]`); every
configuration of the grid is refitted from them (`fit_bridge`, `calibration.refit`; no further pass over the
calibration data):

    (top_k × ridge λ × kv_mode × mapper (ridge, low rank r) × hidden_states + top_k × MLP h)
        × recompute_fraction × recompute_layers

`hidden_states=True` configurations read the source's hidden states beside its K/V (`hidden_state_layers`, ridge
and low rank, joint K/V only); the pass collects their statistics whenever the grid has them, and the K/V-only
configurations are fitted from the same statistics with those blocks left out (the map K/V-only statistics give).

The MLP mappers (`mlp_hidden`, one per hidden width and top-k, on the grid's first λ and kv mode, `mlp_loss`,
`mlp_epochs`) are the one kind that needs more than the statistics: each is trained from its ridge fit on the
calibration windows (`refit(..., "mlp", windows=...)`, re-running both models), once per configuration, and reused
for its recompute values and its check.

The residual maps are not part of the search: one per `n`, fitted once (held-out selection of the largest grid top-k
of the source's hidden states, auto λ) and shared by every K/V configuration. `recompute_layers = L_t` (the target
prefills the mapped span itself) needs no map, and with it token recompute has nothing left to recompute, so it is
measured at `recompute_fraction = 0` only.

Each configuration is measured on *tuning* windows cut from held-out text (context-benefit retention,
`tools/evaluation.py`), next to its cost (`cost`): the FLOPs per context token the transfer spends beyond the
source's prefill, as a share of the target's own prefill FLOPs per token. The FLOP model (matmul FLOPs, from the
configs and weight shapes alone):

- the target's prefill per token, `T = tools/bench.prefill_flops(target config, context) / context`: per layer
  2 × its attention and MLP weights, plus the attention products QKᵀ and AV (2 · 2 · q_dim per token and key, half
  the context on average by causality); no embeddings, no LM head. Every layer has the same shape, so a layer is
  `T / L_t`;
- token recompute (`recompute_fraction = f`): the target runs `f` of the context through all its layers, `f · T`
  (to first order: the recomputed tail attends to more than the average token);
- layer recompute (`recompute_layers = n`): the target runs its top `n` layers over the whole context, `n / L_t · T`;
  with token recompute too, the recomputed tokens pass through all layers again afterwards, so the two add:
  `(f + n / L_t) · T`;
- the mapper: 2 × the weights each token meets (`mapper.flops_per_token()`: the K/V maps of every target layer, as
  the bridge maps all of them even where the top layers overwrite them) plus, for `0 < n < L_t`, the residual map of
  that `n` (2 × its `k·D_s × D_t` weights; both in `map_flops_per_token`);
- `n = L_t` maps nothing and recomputes everything: cost exactly 1.

    cost = (mapper + residual map + (f + n / L_t) · T) / T

A cost of 0.1 means the transfer spends a tenth of what the target would spend prefilling the context itself; the
source's prefill is not counted (it has run anyway when its cache is handed over).

The choice (`choose`): with `min_retention`, the cheapest configuration whose tuning retention reaches it (within
`max_cost` when that is given too); with `max_cost` alone, the best retention within that cost. The chosen
configuration is refitted on all the statistics (train and held-out, as every fit here is), measured again on
*check* windows cut from other documents than the tuning windows, and saved as a normal bridge checkpoint (with the
residual maps when the grid has any, so `config.recompute_layers` can also be changed after loading) whose
`config.calibration["tuning"]` records the target, the chosen settings and both retentions.

Every configuration also gets its gap recovered (`tools/evaluation.gap_recovered`: the share of the source → target
NLL gap it closes, paired 95% CI over the windows, "n/a" where the target does not beat the source by a margin the
windows resolve), on the tuning windows and, for the Pareto front, on the check windows: the Pareto table has a column
for each. It is reported, not optimised: the objective (the front, `min_retention`, the choice) stays context-benefit
retention.

    kvbridge tune pocket/pocket-l pocket/pocket-s --data pocket --eval-data pocket --min-retention 0.9 --out tuned
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..calibration.calibrate import calibrate
from ..calibration.dense_fit import fit_bridge
from ..calibration.refit import refit
from ..data import iter_texts, token_windows
from ..errors import InvalidInputError, TuningError
from ..statistics.dense import KVStatistics
from .bench.mapper import prefill_flops
from .evaluation import GapRecovered, gap_recovered, heldout_windows, retention, window_nll

logger = logging.getLogger(__name__)

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
COST_UNIT = (
    "FLOPs per context token (K/V and residual maps + the target's recomputed tokens and layers) / the target's own "
    "prefill FLOPs per token"
)
# documents read from the evaluation text (alternately into tuning and check windows)
MAX_EVAL_DOCUMENTS = 2000


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
            source's hidden states (`hidden_state_layers`, `hf_kvbridge.source_features`; ridge and low rank, joint
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
        from ..mappers.mlp import LOSSES
        from ..source_features import check_hidden_state_layers_value

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

        if self.mlp_loss not in LOSSES:
            raise InvalidInputError(f"mlp_loss must be one of {LOSSES}, got {self.mlp_loss!r}")
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


@dataclass
class Point:
    """One measured configuration: its settings, tuning retention and cost (see the module docstring; the K/V
    mapper's and the residual map's FLOPs per token are kept apart), and its gap recovered (reported beside retention,
    never optimised; `None` when undefined)."""

    settings: dict
    retention: float
    cost: float
    mapper_flops_per_token: int
    mapper_parameters: int
    residual_flops_per_token: int = 0
    check_retention: float | None = None
    gap_recovered: float | None = None
    gap_recovered_ci: list[float] | None = None
    check_gap_recovered: float | None = None
    check_gap_recovered_ci: list[float] | None = None
    extra: dict = field(default_factory=dict)


# -- the choice ----------------------------------------------------------------------------------------------------
def _valid(point: Point) -> bool:
    return not math.isnan(point.retention)


def pareto_front(points: Sequence[Point]) -> list[Point]:
    """The points no other point beats on both retention and cost (higher retention, lower cost), cheapest first.

    Example:

    ```python
    >>> pts = [Point({"n": i}, r, c, 0, 0) for i, (r, c) in enumerate([(0.9, 0.2), (0.8, 0.3), (0.95, 0.4)])]
    >>> [p.settings["n"] for p in pareto_front(pts)]
    [0, 2]
    ```
    """
    front: list[Point] = []
    for point in sorted(filter(_valid, points), key=lambda p: (p.cost, -p.retention)):
        if not front or point.retention > front[-1].retention:
            front.append(point)
    return front


def _describe(point: Point) -> str:
    return f"retention {point.retention:.3f} at cost {point.cost:.3f} ({format_settings(point.settings)})"


def choose(points: Sequence[Point], *, min_retention: float | None = None, max_cost: float | None = None) -> Point:
    """The configuration to keep.

    - `min_retention`: the cheapest point whose retention reaches it (ties: the better retention), among those
      within `max_cost` when that is given too;
    - `max_cost` alone: the best retention within that cost (ties: the cheaper).

    Raises:
        `TuningError`: no point qualifies (the message names the best one there is), or neither bound is given.
    """
    if min_retention is None and max_cost is None:
        raise InvalidInputError("pass min_retention (a quality target) or max_cost (a cost budget), or both")
    valid = [p for p in points if _valid(p)]
    if not valid:
        raise TuningError(
            "no configuration has a defined retention (the target's own context does not lower its NLL on the "
            "tuning windows); use longer or more tuning windows"
        )
    affordable = [p for p in valid if max_cost is None or p.cost <= max_cost]
    if max_cost is not None and not affordable:
        cheapest = min(valid, key=lambda p: p.cost)
        raise TuningError(
            f"no configuration costs at most {max_cost:g} (the cheapest: {_describe(cheapest)}); raise --max-cost"
        )
    if min_retention is None:
        return max(affordable, key=lambda p: (p.retention, -p.cost))
    meeting = [p for p in affordable if p.retention >= min_retention]
    if not meeting:
        best = max(affordable, key=lambda p: (p.retention, -p.cost))
        within = f" within cost {max_cost:g}" if max_cost is not None else ""
        raise TuningError(
            f"no configuration reaches retention {min_retention:g}{within} on the tuning windows (the best: "
            f"{_describe(best)}); lower --min-retention, "
            + ("raise --max-cost, " if max_cost is not None else "")
            + "widen the grid (more top-k, recompute fractions) or calibrate on more data"
        )
    return min(meeting, key=lambda p: (p.cost, -p.retention))


# -- measuring -----------------------------------------------------------------------------------------------------
def _mapper_name(settings: dict) -> str:
    """The mapper of `settings` as the Pareto table names it: type, rank, and whether it reads hidden states."""
    name = settings["mapper_type"] + (f" r{settings['rank']}" if settings.get("rank") else "")
    return name + (" + hidden states" if settings.get("hidden_states") else "")


def format_settings(settings: dict) -> str:
    mapper = _mapper_name(settings)
    mapper += f" h{settings['hidden']} {settings['loss']}" if settings.get("hidden") else ""
    return (
        f"{mapper}, k={settings['top_k']}, λ={settings['ridge_lambda']}, {settings['kv_mode']}, "
        f"recompute {settings['recompute_fraction']:g}, top layers {settings.get('recompute_layers', 0)}"
    )


REFERENCE_MODES = ("target", "no_context", "source")


def reference_scores(bridge, windows: torch.Tensor, context: int) -> dict[str, torch.Tensor]:
    """Per-window NLL `(N,)` of the target with its own prefill and with no context (the two ends retention is
    measured between) and of the source alone (the other end of the gap recovered), as `tools/evaluation.window_nll`
    scores them."""
    return {mode: window_nll(bridge, windows, context, mode) for mode in REFERENCE_MODES}


def _means(scores: dict[str, torch.Tensor]) -> dict[str, float]:
    return {mode: float(values.mean()) for mode, values in scores.items()}


def reference_nll(bridge, windows: torch.Tensor, context: int) -> dict[str, float]:
    """Mean NLL of the target with its own prefill, with no context, and of the source (`reference_scores`)."""
    return _means(reference_scores(bridge, windows, context))


def measure_bridge(bridge, windows: torch.Tensor, context: int, reference: dict[str, torch.Tensor]):
    """`(retention, GapRecovered)` of `bridge` on `windows`, against the per-window `reference_scores`."""
    scores = window_nll(bridge, windows, context, "bridge")  # (N,)
    kept = retention({**_means(reference), "bridge": float(scores.mean())})
    return kept, gap_recovered(reference["source"], scores, reference["target"])


def source_target_gap(reference: dict[str, torch.Tensor]) -> dict:
    """The source → target gap of a window set (what the gap recovered is a share of) and whether it is resolved."""
    gap: GapRecovered = gap_recovered(reference["source"], reference["target"], reference["target"])
    ci = None if gap.gap_low is None else [gap.gap_low, gap.gap_high]
    return {"gap": gap.gap, "ci": ci, "defined": gap.defined, "reason": gap.reason, "windows": gap.windows}


def _gap_text(value: float | None, ci: list[float] | None) -> str:
    return "n/a" if value is None else f"{value:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]"


def fit_candidate(base, statistics, settings: dict, *, windows: torch.Tensor | None = None, trained=None):
    """The bridge of `settings` (mapper part, recompute fraction and recompute layers), refitted from `statistics`
    (train, held-out), with `base`'s residual maps (fitted once, in the calibration pass).

    The fits select layers and choose λ on the held-out statistics and solve on train + held-out (`fit_bridge`):
    every candidate, and so the chosen one, is fitted on all the statistics. An MLP (`mapper_type="mlp"`) is then
    trained from that ridge fit on `windows` (the calibration windows; seeded, so a refit is the same mapper); pass
    a dict as `trained` to keep each trained MLP bridge there and reuse it for the same mapper settings.
    """
    if settings["mapper_type"] == "mlp":
        key = json.dumps({k: v for k, v in settings.items() if not k.startswith("recompute_")}, sort_keys=True)
        if trained is not None and key in trained:
            bridge = trained[key]
        else:
            if windows is None:
                raise TuningError("an MLP configuration is trained on the calibration windows: pass windows=")
            ridge = fit_candidate(base, statistics, {**settings, "mapper_type": "ridge", "recompute_fraction": 0.0,
                                                     "recompute_layers": 0})  # fmt: skip
            bridge = refit(
                ridge, "mlp", windows=windows, hidden=settings["hidden"], loss=settings["loss"],
                epochs=settings["epochs"], seed=0,
            )  # fmt: skip
            if base.residual_mapper is not None:
                bridge = bridge.with_residual_mapper(base.residual_mapper, bridge.config)
            if trained is not None:
                trained[key] = bridge
        return with_recompute(bridge, settings.get("recompute_fraction", 0.0), settings.get("recompute_layers", 0))
    if settings.get("hidden_states") and base.source_features is None:
        raise TuningError("a hidden-state configuration needs statistics collected with hidden_state_layers")
    train, heldout = statistics
    bridge = fit_bridge(
        base.source,
        base.target,
        train,
        heldout,
        top_k=settings["top_k"],
        ridge_lambda=settings["ridge_lambda"],
        kv_mode=settings["kv_mode"],
        head_mode=base.config.head_mode,
        hold_back=base.config.hold_back,
        config_kwargs=_references(base.config),
        # the statistics' hidden-state blocks, read by the configurations that ask for them (the others are the
        # K/V-only maps those statistics also hold)
        features=base.source_features if settings.get("hidden_states") else None,
    )
    if base.residual_mapper is not None:  # the same residual maps for every candidate (`config.residual_map`)
        bridge = bridge.with_residual_mapper(base.residual_mapper, bridge.config)
    if settings["mapper_type"] == "low_rank":
        bridge = refit(bridge, "low_rank", rank=settings["rank"], statistics=statistics)
    return with_recompute(bridge, settings.get("recompute_fraction", 0.0), settings.get("recompute_layers", 0))


def with_recompute(bridge, fraction: float, layers: int = 0):
    """A copy of `bridge` (same mappers) that recomputes `fraction` of its mapped context (the default `tail`) and
    its target's top `layers` layers over all of it (a value its residual map was calibrated for, `0` or `L_t`)."""
    config = copy.deepcopy(bridge.config)
    config.recompute_fraction = float(fraction)
    config.recompute_layers = int(layers)
    return bridge.with_mapper(bridge.mapper, config)


def _references(config) -> dict:
    keys = (
        "source_name_or_path",
        "source_revision",
        "target_name_or_path",
        "target_revision",
        "calibration",
        "residual_map",
    )
    return {key: copy.deepcopy(getattr(config, key)) for key in keys}


def target_flops_per_token(target_config, context: int) -> float:
    """The target's prefill FLOPs per token over a `context`-token prefill (`tools/bench.prefill_flops`)."""
    return prefill_flops(target_config, context) / context


def _recomputed_layers(config) -> tuple[int, int]:
    """`(n, L_t)`: the layers `config` recomputes (capped at the target's) and the target's layer count."""
    target_layers = int(config.target_fingerprint["num_layers"])
    return min(int(config.recompute_layers or 0), target_layers), target_layers


def map_flops_per_token(bridge) -> tuple[int, int]:
    """`(K/V maps, residual map)`: matmul FLOPs per context token of the maps `bridge`'s transfer runs, 2 × the
    weights a token meets: every target layer's K/V map (`mapper.flops_per_token()`), and the residual map of
    `config.recompute_layers` when `0 < n < L_t`; `(0, 0)` for `n = L_t` (nothing is mapped)."""
    n, target_layers = _recomputed_layers(bridge.config)
    if n == target_layers:
        return 0, 0
    residual = bridge.residual_mapper
    if n == 0 or residual is None or n not in residual.recompute_layers:
        return bridge.mapper.flops_per_token(), 0
    return bridge.mapper.flops_per_token(), 2 * residual.layers[residual.recompute_layers.index(n)].weight.numel()


def cost(bridge, target_flops: float) -> float:
    """FLOPs per context token the transfer of `bridge` spends (maps, recomputed tokens and layers), as a share of
    the target's own prefill FLOPs per token `target_flops` (the FLOP model of the module docstring).

    Example:

    ```python
    >>> cost(bridge, target_flops_per_token(bridge.target.config, 192))  # doctest: +SKIP
    0.078
    ```
    """
    layers, target_layers = _recomputed_layers(bridge.config)
    if layers == target_layers:  # the target prefills the mapped span itself: nothing is mapped
        return 1.0
    recomputed = (float(bridge.config.recompute_fraction) + layers / target_layers) * target_flops
    return (sum(map_flops_per_token(bridge)) + recomputed) / target_flops


def measure_grid(
    base,
    statistics,
    windows: torch.Tensor,
    context: int,
    grid: TuneGrid,
    *,
    reference: dict[str, float] | None = None,
    progress: Callable[[str], Any] = print,
    calibration_windows: torch.Tensor | None = None,
    trained: dict | None = None,
) -> list[Point]:
    """Every configuration of `grid`, fitted from `statistics` and measured on `windows` (`context` tokens of each
    are the context, the rest the continuation scored); `reference` is `reference_scores` of those windows. MLP
    configurations are trained on `calibration_windows` (kept in `trained`, see `fit_candidate`)."""
    reference = reference or reference_scores(base, windows, context)
    target_flops = target_flops_per_token(base.target.config, context)
    source_layers = base.config.source_fingerprint["num_layers"]
    target_layers = base.config.target_fingerprint["num_layers"]
    points = []
    for fit in grid.fits(source_layers, _feature_blocks(base)):
        mapped = fit_candidate(base, statistics, fit, windows=calibration_windows, trained=trained)
        parameters = sum(p.numel() for p in mapped.mapper.parameters())
        for fraction, layers in grid.recompute(target_layers):
            settings = {**fit, "recompute_fraction": fraction, "recompute_layers": layers}
            bridge = with_recompute(mapped, fraction, layers)
            kept, gap = measure_bridge(bridge, windows, context, reference)
            kv_flops, residual_flops = map_flops_per_token(bridge)
            point = Point(
                settings=settings,
                retention=kept,
                cost=cost(bridge, target_flops),
                mapper_flops_per_token=kv_flops,
                mapper_parameters=parameters,
                residual_flops_per_token=residual_flops,
                gap_recovered=gap.value,
                gap_recovered_ci=gap.fields()["gap_recovered_ci"],
            )
            points.append(point)
            progress(
                f"  {format_settings(settings):70s} retention {point.retention:.3f}  cost {point.cost:.3f}  gap "
                f"recovered {_gap_text(point.gap_recovered, point.gap_recovered_ci)}"
            )
    return points


# -- the whole search ----------------------------------------------------------------------------------------------
def split_windows(
    texts: Sequence[str], tokenizer, length: int, tune_windows: int, check_windows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tuning windows from the even-numbered documents, check windows from the odd-numbered ones: the check windows
    share no document with the windows the configuration was chosen on."""
    if len(texts) < 2:
        raise InvalidInputError(
            f"the evaluation text has {len(texts)} document(s); tuning needs at least 2 (tune and check)"
        )
    return (
        heldout_windows(list(texts[0::2]), tokenizer, length, tune_windows),
        heldout_windows(list(texts[1::2]), tokenizer, length, check_windows),
    )


def _point_json(point: Point) -> dict:
    return {key: value for key, value in asdict(point).items() if key != "extra"} | point.extra


def format_table(result: dict) -> str:
    """The Pareto table (markdown): every configuration no other beats on both retention and cost, cheapest first,
    with its gap recovered [95% CI] beside (reported, not part of the front: "n/a" where undefined). "recompute" is the
    share of the context the target recomputes, "top layers" the layers it recomputes over all of it, "map FLOPs /
    token" the K/V mapper's plus the residual map's."""
    lines = [
        "| mapper | top-k | λ | kv mode | recompute | top layers | map FLOPs / token | cost | retention (tune) "
        "| retention (check) | gap recovered (tune) | gap recovered (check) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    chosen = result.get("choice")
    for point in result["pareto_front"]:
        s = point["settings"]
        mapper = _mapper_name(s)
        check = "–" if point.get("check_retention") is None else f"{point['check_retention']:.3f}"
        mark = " **chosen**" if chosen is not None and point["settings"] == chosen["settings"] else ""
        gap = _gap_text(point.get("gap_recovered"), point.get("gap_recovered_ci"))
        check_gap = (
            "–"
            if point.get("check_retention") is None
            else _gap_text(point.get("check_gap_recovered"), point.get("check_gap_recovered_ci"))
        )
        flops = point["mapper_flops_per_token"] + point.get("residual_flops_per_token", 0)
        lines.append(
            f"| {mapper}{mark} | {s['top_k']} | {s['ridge_lambda']} | {s['kv_mode']} | {s['recompute_fraction']:.0%} "
            f"| {s.get('recompute_layers', 0)} | {flops:,} | {point['cost']:.3f} | {point['retention']:.3f} | {check} "
            f"| {gap} | {check_gap} |"
        )
    return "\n".join(lines)


def run_tune(
    source,
    target,
    data,
    eval_data,
    *,
    min_retention: float | None = None,
    max_cost: float | None = None,
    grid: TuneGrid | None = None,
    num_sequences: int = 64,
    seq_len: int = 256,
    heldout_fraction: float = 0.1,
    batch_size: int = 8,
    seed: int = 0,
    tune_windows: int = 16,
    check_windows: int = 16,
    context: int = 192,
    continuation: int = 32,
    text_field: str = "text",
    tokenizer=None,
    out: str | Path | None = None,
    overwrite: bool = False,
    json_path: str | Path | None = None,
    progress: Callable[[str], Any] = print,
    **load_kwargs: Any,
) -> dict:
    """Calibrates once, measures every configuration of `grid`, picks one (`choose`) and saves it to `out`.

    Args:
        source, target ([`PreTrainedModel`] or `str`): as for `calibrate`.
        data: calibration data, as for `calibrate` (one pass; its statistics are kept and every fit reuses them).
        eval_data: held-out text (anything `hf_kvbridge.data.iter_texts` reads; never the calibration data): even
            documents give `tune_windows` tuning windows, odd ones `check_windows` check windows, each of `context`
            + `continuation` tokens.
        min_retention (`float`, *optional*): the quality target (context-benefit retention on the tuning windows).
        max_cost (`float`, *optional*): the cost budget (share of the target's prefill FLOPs; see the module doc).
        grid ([`TuneGrid`], *optional*): the configurations; defaults to `TuneGrid()`.
        out (`str` or `Path`, *optional*): save the chosen bridge there (`save_pretrained`).
        json_path (`str` or `Path`, *optional*): write the result there, also when no configuration qualifies.
        progress (`Callable`, *optional*, defaults to `print`): receives one line per measured configuration and the
            Pareto table.
        load_kwargs: `from_pretrained` keywords for models given by name (`dtype`, `device_map`).

    Returns:
        `dict` with `points` (every configuration: `settings` with its `recompute_fraction` and `recompute_layers`,
        `retention`, `cost`, `mapper_flops_per_token`, `residual_flops_per_token`, `mapper_parameters`,
        `gap_recovered`, `gap_recovered_ci`), `pareto_front` (with `check_retention`,
        `check_gap_recovered`, `check_gap_recovered_ci`), `choice`, the reference NLLs of both window sets (target,
        no context, source), `source_target_gap` of both (the gap and whether the windows resolve it, else the
        reason the gap recovered is n/a) and the settings; and `bridge`, the chosen bridge (not in the JSON).

    Raises:
        `TuningError`: no configuration meets `min_retention` / `max_cost` (after the JSON is written).

    Example:

    ```python
    >>> from hf_kvbridge import pocket
    >>> from hf_kvbridge.tools.tune import run_tune
    >>> result = run_tune("pocket/pocket-l", "pocket/pocket-s", pocket.load_texts("calibration"),
    ...                   pocket.load_texts("heldout"), min_retention=0.9, out="tuned")  # doctest: +SKIP
    >>> result["choice"]["settings"]  # doctest: +SKIP
    ```
    """
    if min_retention is None and max_cost is None:
        raise InvalidInputError("pass min_retention (a quality target) or max_cost (a cost budget), or both")
    grid = grid or TuneGrid()
    started = time.perf_counter()
    # the residual maps of the grid's layer-recompute values, fitted in the same calibration pass (`n = 0` and
    # `n = L_t` need none)
    target_layers = _num_layers(target)
    residual = [n for n in grid.layers(target_layers) if 0 < n < target_layers]
    base = calibrate(
        source,
        target,
        data,
        tokenizer=tokenizer,
        num_sequences=num_sequences,
        seq_len=seq_len,
        top_k=max(grid.top_k),
        heldout_fraction=heldout_fraction,
        batch_size=batch_size,
        seed=seed,
        text_field=text_field,
        keep_statistics=True,
        recompute_layers=residual or 0,
        # the hidden-state blocks of the grid's hidden-state maps, collected in the same pass
        hidden_state_layers=grid.hidden_state_layers if grid.uses_hidden_states else None,
        **load_kwargs,
    )
    statistics = base.calibration_statistics
    if statistics is None or not isinstance(statistics[0], KVStatistics):
        raise TuningError(
            "tuning refits every configuration from the dense calibration statistics, but this calibration needed "
            "budgeted passes; tune on fewer or smaller models, or on a machine with more memory"
        )
    if tokenizer is None:
        from transformers import AutoTokenizer

        from ..loading import resolve_model_reference

        tokenizer = AutoTokenizer.from_pretrained(resolve_model_reference(base.config.source_name_or_path))
    texts = list(itertools.islice(iter_texts(eval_data, text_field), MAX_EVAL_DOCUMENTS))
    tune_ids, check_ids = split_windows(texts, tokenizer, context + continuation, tune_windows, check_windows)
    source_layers = base.config.source_fingerprint["num_layers"]
    maps = f" (residual maps for top layers {residual})" if residual else ""
    size = grid.size(source_layers, target_layers, _feature_blocks(base))
    progress(
        f"calibrated {base.config.source_name_or_path} → {base.config.target_name_or_path}{maps} in "
        f"{time.perf_counter() - started:.0f}s; measuring {size} configurations on "
        f"{len(tune_ids)} tuning windows of {context} + {continuation} tokens"
    )
    trained: dict = {}  # the MLP bridges, trained once each: measured, then checked (and saved) as they are
    calibration_windows = None
    if grid.has_mlp(source_layers):
        calibration_windows = token_windows(data, tokenizer, num_sequences, seq_len, text_field=text_field)
    tune_reference = reference_scores(base, tune_ids, context)
    points = measure_grid(
        base, statistics, tune_ids, context, grid, reference=tune_reference, progress=progress,
        calibration_windows=calibration_windows, trained=trained,
    )  # fmt: skip
    front = pareto_front(points)
    result = {
        "source": base.config.source_name_or_path,
        "target": base.config.target_name_or_path,
        "min_retention": min_retention,
        "max_cost": max_cost,
        "cost_unit": COST_UNIT,
        "grid": {key: list(value) if isinstance(value, tuple) else value for key, value in asdict(grid).items()},
        "points": [_point_json(p) for p in points],
        "pareto_front": [_point_json(p) for p in front],
        "reference_nll": {"tune": _means(tune_reference)},
        "source_target_gap": {"tune": source_target_gap(tune_reference)},
        "settings": {
            "num_sequences": num_sequences,
            "seq_len": seq_len,
            "heldout_fraction": heldout_fraction,
            "seed": seed,
            "tune_windows": len(tune_ids),
            "check_windows": len(check_ids),
            "context": context,
            "continuation": continuation,
            "torch_threads": torch.get_num_threads(),
        },
        "choice": None,
    }
    try:
        choice = choose(points, min_retention=min_retention, max_cost=max_cost)
    except TuningError as err:
        result["error"] = str(err)
        _write_json(result, json_path)
        progress(format_table(result))
        raise
    # the front again on the check windows (how far each tuning figure carries); the choice is on the front (nothing
    # cheaper retains as much), and its refit, deterministic from the same statistics, is the bridge to save
    check_reference = reference_scores(base, check_ids, context)
    result["reference_nll"]["check"] = _means(check_reference)
    result["source_target_gap"]["check"] = source_target_gap(check_reference)
    bridge = None
    for point in front:
        fitted = _check(base, statistics, point, check_ids, context, check_reference, calibration_windows, trained)
        if point is choice:
            bridge = fitted
    if bridge is None:  # not on the front: cannot happen with `choose` as it is, but never save an unchecked choice
        bridge = _check(base, statistics, choice, check_ids, context, check_reference, calibration_windows, trained)
    result["pareto_front"] = [_point_json(p) for p in front]
    result["choice"] = _point_json(choice)
    result["seconds"] = round(time.perf_counter() - started, 1)
    bridge.config.calibration = dict(bridge.config.calibration or {})
    bridge.config.calibration["tuning"] = {
        "min_retention": min_retention,
        "max_cost": max_cost,
        "cost_unit": COST_UNIT,
        "chosen": choice.settings,
        "tuned_retention": round(choice.retention, 6),
        "cost": round(choice.cost, 6),
        "check_retention": round(choice.check_retention, 6),
        "tuned_gap_recovered": _round(choice.gap_recovered),
        "check_gap_recovered": _round(choice.check_gap_recovered),
        "tune_windows": len(tune_ids),
        "check_windows": len(check_ids),
        "context": context,
        "continuation": continuation,
        "configurations": len(points),
    }
    if out is not None:
        bridge.save_pretrained(out, overwrite=overwrite)
        result["out"] = str(out)
    _write_json(result, json_path)
    progress(format_table(result))
    result["bridge"] = bridge
    return result


def _feature_blocks(base) -> int | None:
    """The blocks a hidden-state map of `base`'s statistics chooses from (K/V layers + hidden-state blocks)."""
    return None if base.source_features is None else base.source_features.num_blocks


def _num_layers(model) -> int:
    """The decoder layers of `model` (a loaded model, or a reference `calibrate` loads: its config alone is read)."""
    if isinstance(model, str | Path):
        from transformers import AutoConfig

        from ..loading import resolve_model_reference

        config = AutoConfig.from_pretrained(resolve_model_reference(str(model)))
    else:
        config = model.config
    return int(config.get_text_config(decoder=True).num_hidden_layers)


def _check(base, statistics, point: Point, windows: torch.Tensor, context: int, reference: dict,
           calibration_windows=None, trained=None):  # fmt: skip
    """The bridge of `point`'s settings, refitted from `statistics` (an MLP: the one trained for the grid); records
    its retention and gap recovered on `windows` (`reference`: their `reference_scores`) on `point`."""
    bridge = fit_candidate(base, statistics, point.settings, windows=calibration_windows, trained=trained)
    point.check_retention, gap = measure_bridge(bridge, windows, context, reference)
    point.check_gap_recovered, point.check_gap_recovered_ci = gap.value, gap.fields()["gap_recovered_ci"]
    return bridge


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def _write_json(result: dict, path: str | Path | None) -> None:
    if path is not None:
        Path(path).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def run_tune_cli(args: argparse.Namespace) -> int:
    """`kvbridge tune`: the arguments are parsed and checked by the CLI (`kvbridge_cli/parser.py`)."""
    grid = TuneGrid(
        top_k=tuple(args.top_k),
        ridge_lambdas=tuple(args.ridge_lambdas),
        kv_modes=tuple(args.kv_modes),
        ranks=tuple(args.ranks),
        recompute_fractions=tuple(args.recompute_fractions),
        recompute_layers=tuple(args.recompute_layers),
        mlp_hidden=tuple(args.mlp_hidden),
        mlp_loss=args.mlp_loss,
        mlp_epochs=args.mlp_epochs,
        hidden_states=tuple(args.hidden_states),
        hidden_state_layers=args.hidden_state_layers,
    )
    load_kwargs = {"dtype": args.dtype} if args.dtype else {}
    result = run_tune(
        args.source,
        args.target,
        args.data,
        args.eval_data,
        min_retention=args.min_retention,
        max_cost=args.max_cost,
        grid=grid,
        num_sequences=args.num_sequences,
        seq_len=args.seq_len,
        heldout_fraction=args.heldout_fraction,
        seed=args.seed,
        tune_windows=args.tune_windows,
        check_windows=args.check_windows,
        context=args.context,
        continuation=args.continuation,
        text_field=args.text_field,
        out=args.out,
        overwrite=args.overwrite,
        json_path=args.json,
        **load_kwargs,
    )
    choice = result["choice"]
    print(
        f"chose {format_settings(choice['settings'])}: retention {choice['retention']:.3f} on the tuning windows, "
        f"{choice['check_retention']:.3f} on {result['settings']['check_windows']} check windows (gap recovered "
        f"{_gap_text(choice['check_gap_recovered'], choice['check_gap_recovered_ci'])}), cost "
        f"{choice['cost']:.3f}; saved to {args.out}" + (f", all points in {args.json}" if args.json else "")
    )
    return 0
