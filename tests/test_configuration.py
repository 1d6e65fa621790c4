"""`KVBridgeConfig` forward compatibility: keys from a newer version are dropped with a warning, not a crash."""

import json
import logging

import pytest

from hf_kvbridge import KVBridgeConfig
from hf_kvbridge.constants import FORMAT_VERSION


def test_unknown_keys_from_a_newer_version_are_dropped_with_a_warning(tmp_path, caplog):
    config = KVBridgeConfig(source_name_or_path="a", target_name_or_path="b", top_k=3, selected_layers=[[0]])
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    saved.update(future_knob=7, another_new_field={"x": 1})
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with caplog.at_level(logging.WARNING, logger="hf_kvbridge.configuration"):
        loaded = KVBridgeConfig.from_pretrained(tmp_path)
    assert not hasattr(loaded, "future_knob") and not hasattr(loaded, "another_new_field")
    assert "another_new_field" in caplog.text and "future_knob" in caplog.text
    assert (loaded.top_k, loaded.selected_layers, loaded.target_name_or_path) == (3, [[0]], "b")
    assert "future_knob" not in loaded.to_dict()


def test_a_newer_format_version_is_refused_with_what_to_do():
    with pytest.raises(ValueError, match="upgrade hf_kvbridge"):
        KVBridgeConfig(format_version=FORMAT_VERSION + 1)
