"""Calibration: text → token windows → source/target KV → statistics → layer selection → ridge fit → bridge.

| module | holds |
|---|---|
| `calibrate` | `calibrate`: the orchestration (load, check, plan, pass, fit, record) |
| `checks` | what is checked before any work: the shared tokenizer, the held-out split, the token count |
| `data_pass` | `collect_statistics`: both models over the windows, rows summed into statistics |
| `checkpoints` | resumable passes: statistics saved every few batches and read back |
| `dense_fit` | `fit_bridge`: selection, λ and the mapper from dense statistics; the bridge of a fitted mapper |
| `budgeted_fit` | `fit_bridge_in_passes`: a selection pass, then fit passes on a memory budget |
| `residual` | the residual maps of layer recompute, from the same passes |
| `refit` | `refit`: mappers beyond ridge, fitted from a ridge bridge |
"""
