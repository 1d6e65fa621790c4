"""Mapped keys put back on the target's key-norm sphere (`CalibrationSettings.key_norm`, `hf_kvbridge.utils.key_norm`)
against the plain linear map, paired on the same held-out windows of the pocket family (issue #47).

    python -m studies.key_norm_study --pairs pocket-s:pocket-l,pocket-l:pocket-s --windows 303 --out key_norm.json

Each pair is calibrated once with `key_norm="off"` (the demo's calibration: 128 × 512 tokens of the calibration split,
top-k 6, λ auto, seed 0; `--mapper-type`, `--hidden-state-layers` as `calibrate` takes them); the same map is then
scored three ways on `kvbridge demo`'s windows (384 + 128 tokens of the held-out split; `--windows 303` is all of it):

- `plain`: the linear map as it is;
- `key_norm`: every mapped key head rescaled to `rms(k / g) = 1` (what `key_norm="auto"` does on these targets);
- `one_scale`: a control with the same mean length but no per-token rescaling (each layer's and head's keys
  multiplied by the one number that brings their mean `rms(k / g)` over the window's tokens to 1), which tells whether
  what helps is the keys' overall scale or each token's.

Reported: retention of each with its paired bootstrap 95% interval, the paired differences, the next-token KL of
each against the target, and the mapped keys' `rms(k / g)` per target layer (mean and 10th percentile) on the plain
map.
"""

from __future__ import annotations

import argparse
import copy

import torch

import hf_kvbridge
from hf_kvbridge import pocket
from hf_kvbridge.tools.evaluation import heldout_windows, window_nll
from hf_kvbridge.tools.fidelity import next_token_kl, paired_bootstrap, retention_of
from hf_kvbridge.utils.key_norm import key_norm_gains, with_key_norm
from hf_kvbridge.utils.rope import apply_rotary, inverse_cos_sin, rotary_cos_sin
from studies.head_local_study import measurement_arguments, pair_setup, run_pairs
from studies.recompute_study import hidden_state_layers


def key_rms(target, cache, gains: torch.Tensor) -> list[torch.Tensor]:
    """`rms(k / g)` of every key head and token of `cache` (the target's rotary embedding stripped): one
    `(B, H, T)` tensor per layer; 1 on the target's own keys (up to its norm's eps)."""
    out = []
    for layer, gain in zip(cache.layers, gains):
        keys = layer.keys
        positions = torch.arange(keys.shape[2], device=keys.device)[None].expand(keys.shape[0], -1)
        content = apply_rotary(keys.float(), *inverse_cos_sin(*rotary_cos_sin(target, positions)))
        out.append((content / gain.to(content.device)).square().mean(-1).sqrt())
    return out


def one_scale(target, cache, gains: torch.Tensor):
    """The control: each layer's and head's keys times the one number that brings their mean `rms(k / g)` over the
    tokens to 1 (in place; rotations commute with a scalar)."""
    for layer, rms in zip(cache.layers, key_rms(target, cache, gains)):
        layer.keys.mul_((1.0 / rms.mean(-1, keepdim=True))[..., None].to(layer.keys.dtype))  # (B, H, 1, 1)
    return cache


class OneScale:
    """`bridge` mapping with the `one_scale` control inside the block (its `map_cache` wrapped; restored on exit)."""

    def __init__(self, bridge, gains: torch.Tensor):
        self.bridge, self.gains = bridge, gains

    def __enter__(self):
        original = self.bridge.map_cache

        def map_cache(*args, **kwargs):
            return one_scale(self.bridge.target, original(*args, **kwargs), self.gains)

        self.bridge.map_cache = map_cache
        return self.bridge

    def __exit__(self, *exc):
        del self.bridge.map_cache  # the method again


def measure_pair(source: str, target: str, args) -> dict:
    tokenizer, models, texts, settings = pair_setup(source, target, args)
    plain = hf_kvbridge.calibrate(
        *models, texts, tokenizer=tokenizer, **settings, key_norm="off", mapper_type=args.mapper_type,
        hidden_state_layers=args.hidden_state_layers,
    )  # fmt: skip
    gains = key_norm_gains(models[1])
    normed = with_key_norm(plain.with_mapper(copy.deepcopy(plain.mapper), copy.deepcopy(plain.config)), gains)
    windows = heldout_windows(pocket.load_texts("heldout"), tokenizer, args.context + args.continuation, args.windows)
    nll = {mode: window_nll(plain, windows, args.context, mode) for mode in ("target", "no_context")}
    nll["plain"] = window_nll(plain, windows, args.context, "bridge")
    nll["key_norm"] = window_nll(normed, windows, args.context, "bridge")
    with OneScale(plain, gains) as control:
        nll["one_scale"] = window_nll(control, windows, args.context, "bridge")
    kl = {
        "plain": next_token_kl(plain, windows, args.context),
        "key_norm": next_token_kl(normed, windows, args.context),
    }
    with torch.no_grad():
        probe = windows[:8, : args.context]
        rms = key_rms(models[1], plain.prefill(probe)[0], gains)
    names = ("plain", "key_norm", "one_scale")
    return {
        "pair": f"{source} → {target}",
        "windows": int(len(windows)),
        "mapper_type": args.mapper_type,
        "hidden_state_layers": args.hidden_state_layers,
        "retention": {name: paired_bootstrap(nll, retention_of(name)) for name in names},
        "difference_vs_plain": {
            name: paired_bootstrap(nll, lambda s, n=name: retention_of(n)(s) - retention_of("plain")(s))
            for name in names[1:]
        },
        "kl": {name: paired_bootstrap(kl, lambda s, n=name: float(s[n].mean())) for name in kl},
        "plain_key_rms": [
            {"mean": round(float(r.mean()), 4), "p10": round(float(r.flatten().quantile(0.1)), 4)} for r in rms
        ],
        "per_window_nll": {mode: values.tolist() for mode, values in nll.items()},
    }


def _lines(r: dict):
    for name, diff in r["difference_vs_plain"].items():
        yield (
            f"{r['pair']}: plain {r['retention']['plain']['value']:.3f}, {name} {r['retention'][name]['value']:.3f}, "
            f"difference {diff['value']:+.3f} [{diff['low']:+.3f}, {diff['high']:+.3f}] on {r['windows']} windows"
        )
    kl = r["kl"]
    yield f"{r['pair']}: next-token KL plain {kl['plain']['value']:.4f}, key_norm {kl['key_norm']['value']:.4f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    measurement_arguments(parser, out="key_norm.json")
    parser.add_argument("--mapper-type", default="ridge", help="the closed form (calibrate's mapper_type)")
    parser.add_argument(
        "--hidden-state-layers", type=hidden_state_layers, help="the source's hidden states as extra features"
    )
    run_pairs(parser.parse_args(), measure_pair, _lines)


if __name__ == "__main__":
    main()
