"""A linear mapper whose weights stay on disk until a target layer is mapped (for multi-GB mappers).

An all-heads k = 8 mapper for a 64-layer target is several GB. `LazyKVMapper` keeps only the file offsets: when
`map_cache` reaches target layer t it loads that layer's weight and bias (`materialize`), maps, and drops them
(`release`), so the mapper's resident memory is one target layer's weights. The price is reading them from disk (the
OS page cache) on every mapping; load eagerly when memory allows.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from ..errors import MapperFileError
from .base import KVMapper


class LazyKVMapper(KVMapper):
    """`KVMapper` with per-layer weights read from a checkpoint's safetensors files on demand.

    Args:
        selected_layers, num_kv_heads, head_dim, head_mode: as for [`KVMapper`].
        files (`list[Path]`, keyword only): the checkpoint's mapper weight files (one, or the shards), verified.
        kv_mode, target_kv_heads, target_head_dim (*optional*): as for [`KVMapper`].

    Example:

    ```python
    >>> bridge = KVBridgeForCausalLM.from_pretrained("big-bridge", lazy_mapper=True)  # doctest: +SKIP
    >>> cache = bridge.prefill(input_ids)[0]  # each target layer's weights are loaded, used and dropped
    ```
    """

    groupable = False  # one target layer's weights in memory at a time
    max_chunk_bytes = None  # the whole sequence at once: each layer's weights are read once per mapping

    def __init__(self, *layout, files: list[Path], **options):
        with torch.device("meta"):  # shapes and dtype only: no memory
            super().__init__(*layout, **options)
        self._where: dict[str, Path] = {}
        for path in files:
            with safe_open(str(path), framework="pt") as handle:
                for key in handle.keys():
                    self._where[key] = path
        missing = [k for k in self.state_dict() if k not in self._where]
        if missing:
            raise MapperFileError(f"mapper weights in {files[0].parent} lack {missing[:4]}")
        if "key_norm_gain" in self._where:  # a few numbers a target layer: loaded now, never dropped
            with safe_open(str(self._where["key_norm_gain"]), framework="pt") as handle:
                self.set_key_norm(handle.get_tensor("key_norm_gain"))
        self._device, self._dtype = torch.device("cpu"), torch.float32
        self.loaded: set[int] = set()  # target layers whose weights are in memory now

    def _apply(self, fn, recurse=True):  # `.to(device, dtype)` records where weights go when they are loaded
        probe = fn(torch.empty(0, dtype=self._dtype, device=self._device))
        self._device, self._dtype = probe.device, probe.dtype
        return self

    def materialize(self, target_layer: int) -> None:
        layer = self.layers[target_layer]
        for name in ("weight", "bias"):
            key = f"layers.{target_layer}.{name}"
            with safe_open(str(self._where[key]), framework="pt") as handle:
                tensor = handle.get_tensor(key)
            param = getattr(layer, name)
            if tensor.shape != param.shape:
                raise MapperFileError(
                    f"{self._where[key]}: {key} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
                )
            setattr(layer, name, nn.Parameter(tensor.to(self._device, self._dtype), requires_grad=False))
        self.loaded.add(target_layer)

    def release(self, target_layer: int) -> None:
        layer = self.layers[target_layer]
        for name in ("weight", "bias"):
            shape = getattr(layer, name).shape
            setattr(
                layer, name, nn.Parameter(torch.empty(shape, dtype=self._dtype, device="meta"), requires_grad=False)
            )
        self.loaded.discard(target_layer)

    def stored_state_dict(self) -> dict[str, torch.Tensor]:
        """Every weight, read from the checkpoint files (its `state_dict()` holds meta tensors: shapes only), in
        the dtype this mapper maps in. What `save_pretrained` writes for a lazily loaded bridge."""
        state = {}
        for key in self.state_dict():
            if key == "key_norm_gain":  # held in memory (float32, as the gains are kept)
                state[key] = self.key_norm_gain.detach().clone()
                continue
            with safe_open(str(self._where[key]), framework="pt") as handle:
                state[key] = handle.get_tensor(key).to(dtype=self._dtype)
        return state

    def layout_dtype(self) -> torch.dtype:
        return self._dtype
