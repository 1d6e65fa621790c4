"""Fitting: calibration text → statistics → layer selection → solves → a bridge's weights. The runtime side
(`modeling`, `configuration`, `persistence`, `mappers`, `transfer`, the cache/RoPE/head helpers) imports none of it,
so loading a bridge, generating and serving never load fitting code; this side knows the runtime classes and
attaches the fits to them (`KVMapper.from_statistics`, see `mapper_fits`).

| module | holds |
|---|---|
| `calibration/` | `calibrate` and its passes: checks, data pass, dense and budgeted fits, residual maps |
| `statistics/` | streamed sufficient statistics (dense, selection, blocks, rows, weighted) |
| `mapper_fits/` | each mapper type's fit (ridge, low rank, attention-weighted, MLP) |
| `solve` | the centered ridge solve, the λ grid and per-map λ choice |
| `ridge_path` | the λ path of one eigendecomposition |
| `layer_selection` | which source layers each target layer reads (held-out R²) |
| `budget` | the memory plan of a calibration (dense or budgeted passes) |
| `data` | calibration text: datasets, pocket corpus, windows |
| `attention`, `content_rows` | the target's queries and a model's cache as content-space rows, for the fits |
"""

from . import mapper_fits as mapper_fits  # attaches the fits to the runtime mapper classes
