"""Calibration: text → token windows → source/target KV → statistics → layer selection → ridge fit → bridge.

| module | holds |
|---|---|
| `calibrate` | `calibrate` (load, check, plan, pass, fit, record); the only module that builds a bridge |
| `checks` | what is checked before any work: the shared tokenizer, the held-out split, the token count |
| `data_pass` | `collect_statistics`: both models over the windows, rows summed into statistics |
| `checkpoints` | resumable passes: statistics saved every few batches and read back |
| `dense_fit` | `fit_dense`: selection, λ and the mapper from dense statistics, as a `BridgeFit` (mapper, config, R²) |
| `budgeted_fit` | `fit_in_passes`: a selection pass, then fit passes on a memory budget (a `BridgeFit`) |
| `residual` | the residual maps of layer recompute, from the same passes |

`refit` (mappers beyond ridge, fitted from a ridge bridge) lives beside `fit_of` in `fitting.mapper_fits`; the old
path `fitting.calibration.refit` still gives it, with a deprecation warning.
"""
