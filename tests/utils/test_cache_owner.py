"""One module owns transformers cache layers' storage (`hf_kvbridge.utils.cache`): no other module of the package
assigns a layer's `keys`/`values` or writes into them, so a change in transformers' cache layers breaks one file."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from hf_kvbridge.utils.cache import append_layer, copy_batch_rows, crop_cache, crop_layer, replace_layer_kv

PACKAGE = Path(__file__).resolve().parents[2] / "hf_kvbridge"
OWNER = PACKAGE / "utils" / "cache.py"
STORAGE = {"keys", "values"}


def storage_writes(path: Path) -> list[str]:
    """`line: what` for every write of a `.keys`/`.values` attribute in `path`: an assignment to it or into it
    (`x.keys = ...`, `x.keys[i] = ...`, `x.keys, x.values = ...`), or `setattr(x, "keys", ...)` /
    `setattr(layer, name, ...)`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and sub.attr in STORAGE and isinstance(sub.ctx, ast.Store):
                    found.append(f"{node.lineno}: .{sub.attr} =")
                if isinstance(sub, ast.Subscript) and isinstance(sub.value, ast.Attribute):
                    if sub.value.attr in STORAGE and isinstance(sub.ctx, ast.Store):
                        found.append(f"{node.lineno}: .{sub.value.attr}[...] =")
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and len(node.args) == 3:
            owner, name = node.args[0], node.args[1]
            layer_by_name = isinstance(owner, ast.Name) and "layer" in owner.id and not isinstance(name, ast.Constant)
            if layer_by_name or (isinstance(name, ast.Constant) and name.value in STORAGE):
                found.append(f"{node.lineno}: setattr")
    return found


def test_only_the_owner_writes_cache_layer_storage():
    # mappers/lazy.py sets a layer map's parameters by name (not a cache); the vLLM worker is rewritten apart (#45)
    allowed = {OWNER, PACKAGE / "mappers" / "lazy.py"}
    writes = {
        str(p.relative_to(PACKAGE)): w
        for p in sorted(PACKAGE.rglob("*.py"))
        if p not in allowed and "vllm" not in p.parts and (w := storage_writes(p))
    }
    assert writes == {}


def test_the_writes_check_sees_each_kind_of_write(tmp_path):
    planted = tmp_path / "m.py"
    planted.write_text(
        "layer.keys, layer.values = a, b\nlayer.keys[index] = c\nsetattr(layer, name, d)\n"
        "setattr(cache_layer, 'values', e)\nx = layer.keys[:, :3]\nsetattr(mod, 'weight', f)\nsetattr(new, name, g)\n"
    )
    assert storage_writes(planted) == ["1: .keys =", "1: .values =", "2: .keys[...] =", "3: setattr", "4: setattr"]


def _cache(batch=2, seq=5, layers=2) -> DynamicCache:
    cache = DynamicCache()
    for i in range(layers):
        append_layer(cache, i, torch.randn(batch, 2, seq, 4), torch.randn(batch, 2, seq, 4))
    return cache


def test_crops_keep_the_first_tokens_through_the_cache_api():
    cache = _cache()
    keys = cache.layers[0].keys.clone()
    crop_layer(cache.layers[0], 3)
    assert torch.equal(cache.layers[0].keys, keys[:, :, :3]) and cache.layers[1].keys.shape[2] == 5
    cache = _cache()
    crop_cache(cache, 2)
    assert [layer.keys.shape[2] for layer in cache.layers] == [2, 2]
    crop_cache(cache, 4)  # nothing to remove
    assert cache.get_seq_length() == 2


@pytest.mark.parametrize("row", [0, 1])
def test_rows_and_layers_written_by_the_owner(row):
    cache, own = _cache(), _cache(batch=1)
    rows = torch.tensor([row == 0, row == 1])
    copy_batch_rows(cache, own, rows)
    assert torch.equal(cache.layers[1].values[row], own.layers[1].values[0])
    keys, values = torch.zeros(2, 2, 5, 4), torch.ones(2, 2, 5, 4)
    replace_layer_kv(cache.layers[0], keys, values)
    assert cache.layers[0].keys is keys and cache.layers[0].values is values
