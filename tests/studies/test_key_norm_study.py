"""The key-norm study's measure and its control: `rms(k / g)` is 1 on a target's own keys, and the one-scale control
brings each head's mean to 1 while keeping each token's length relative to the others."""

import torch

from hf_kvbridge import pocket
from hf_kvbridge.utils.cache import output_cache
from hf_kvbridge.utils.key_norm import key_norm_gains
from studies.key_norm_study import key_rms, one_scale


def test_the_targets_own_keys_measure_one_and_the_control_keeps_their_spread():
    model = pocket.load_model("pocket-s")
    gains = key_norm_gains(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = output_cache(model(input_ids=ids, use_cache=True))
    for rms in key_rms(model, cache, gains):
        torch.testing.assert_close(rms, torch.ones_like(rms), atol=1e-3, rtol=0)
    for layer in cache.layers:  # keys of uneven lengths, as a linear map gives
        layer.keys.mul_(torch.linspace(0.5, 1.0, layer.keys.shape[2])[:, None])
    before = key_rms(model, cache, gains)
    after = key_rms(model, one_scale(model, cache, gains), gains)
    for old, new in zip(before, after):
        torch.testing.assert_close(new.mean(-1), torch.ones(new.shape[:-1]), atol=1e-4, rtol=0)
        torch.testing.assert_close(new / new.mean(-1, keepdim=True), old / old.mean(-1, keepdim=True))
        assert float(new.std()) > 0.1  # not put on the sphere
