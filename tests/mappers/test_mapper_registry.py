"""The mapper registry (`hf_kvbridge.mappers.MAPPER_REGISTRY`): every type the settings offer, each type's module read
on first use, entries set by hand replacing the registered ones."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from hf_kvbridge.constants import MAPPER_TYPE_NAMES
from hf_kvbridge.errors import MapperError
from hf_kvbridge.mappers import MAPPER_REGISTRY, KVMapper, get_mapper_type


def test_the_registry_holds_the_types_the_settings_offer():
    assert list(MAPPER_REGISTRY) == list(MAPPER_TYPE_NAMES)
    for name in MAPPER_REGISTRY:
        entry = get_mapper_type(name)
        assert entry.name == name and issubclass(entry.mapper_class, KVMapper)
    known = "ridge, ridge_attention_weighted, mlp, low_rank"
    with pytest.raises(MapperError, match=f"unknown mapper_type 'nope'.*{known}"):
        get_mapper_type("nope")


def test_a_type_module_is_read_on_first_use():
    """Loading a bridge's persistence reads no mapper type's training code; reading an entry imports its module."""
    code = (
        "import sys\n"
        "import hf_kvbridge.persistence\n"
        "from hf_kvbridge.mappers import MAPPER_REGISTRY\n"
        "before = sorted(m for m in sys.modules if m.startswith('hf_kvbridge.mappers.'))\n"
        "MAPPER_REGISTRY['mlp']\n"
        "print(before, 'hf_kvbridge.mappers.mlp' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    before, loaded = out.stdout.rsplit(" ", 1)
    assert "mlp" not in before and "weighted" not in before and "low_rank" not in before
    assert loaded.strip() == "True"


def test_an_entry_set_by_hand_replaces_the_registered_one(monkeypatch):
    joint_only = dataclasses.replace(MAPPER_REGISTRY["low_rank"], kv_modes=("joint",))
    monkeypatch.setitem(MAPPER_REGISTRY, "low_rank", joint_only)
    assert get_mapper_type("low_rank").kv_modes == ("joint",)
    monkeypatch.undo()
    assert get_mapper_type("low_rank").kv_modes != ("joint",)
    mine = dataclasses.replace(MAPPER_REGISTRY["ridge"], name="mine")
    MAPPER_REGISTRY["mine"] = mine
    try:
        assert get_mapper_type("mine") is mine and "mine" in list(MAPPER_REGISTRY)
    finally:
        del MAPPER_REGISTRY["mine"]
    assert "mine" not in MAPPER_REGISTRY
