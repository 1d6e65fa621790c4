"""Running a transfer: which positions the target computes itself and which it gets mapped, and the steps that carry
a source's KV over into the target's cache.

| module | holds |
|---|---|
| `plan` | `TransferPlan`, `plan_transfer`: the positions of one transfer (sinks, mapped span, probe, recompute) |
| `prefill` | `transfer_prefill`: a plan run over a prompt (source prefill, map, recompute, gate) |
| `token_recompute` | selective recompute of mapped tokens and its policies |
| `layer_recompute` | the target's top layers run over the mapped span from a mapped residual |
| `session` | `HandoffSession`: one conversation, a cache per model, incremental switches |
"""
