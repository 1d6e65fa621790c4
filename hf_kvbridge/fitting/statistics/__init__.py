"""Streamed sufficient statistics of source and target KV rows: one family, one package.

| module | holds |
|---|---|
| `base` | the layout base classes, centred and residual sums, the global feature index, map groups, Chan's merge |
| `dense` | `KVStatistics`: every source layer against every target layer |
| `selection` | `SelectionStatistics`: per head and K/V, enough for the single-layer held-out R² of every layer pair |
| `blocks` | `BlockStatistics`, `feature_groups`: the selected source layers of a group of target layers, on a budget |
| `rows` | `RowStatistics`: the rows themselves, for fits from fewer tokens than map inputs |
| `weighted` | `WeightedKVStatistics`: per-token weights (the attention-weighted ridge) |
"""
