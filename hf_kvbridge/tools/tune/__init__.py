"""`kvbridge tune`: search a grid of bridge configurations from one statistics pass and pick one by quality and cost.

One calibration pass keeps its `(train, held-out)` statistics, and fits the residual maps of layer recompute for the
grid's `recompute_layers` values in the same pass (`CalibrationSettings.recompute_layers=[...]`); every
configuration of the grid is refitted from them (`fit_dense`, `mapper_fits.refit`; no further pass over the
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
`tools/evaluation.py`), next to its cost (`tools/bench/flop_model.cost`): the FLOPs per context token the transfer
spends beyond the source's prefill, as a share of the target's own prefill FLOPs per token.

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

The package: `grid` (`TuneGrid` and its defaults), `measure` (each configuration refitted and measured), `choice`
(`Point`, the Pareto front, `choose`, the Pareto table) and `search` (`run_tune`, the whole search). The cost model
is `tools/bench/flop_model.py`'s.
"""

from .choice import Point, choose, pareto_front
from .grid import TuneGrid
from .search import run_tune

__all__ = ["Point", "TuneGrid", "choose", "pareto_front", "run_tune"]
