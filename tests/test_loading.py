"""Model and data references: a local folder or file always wins, `pocket/<shipped name>` and `pocket` name what
the package ships, and any other `pocket/...` is a Hub id passed through unchanged."""

from pathlib import Path

import pytest
import torch

from hf_kvbridge import pocket
from hf_kvbridge.errors import InvalidInputError
from hf_kvbridge.fitting.data import resolve_data_reference
from hf_kvbridge.loading import load_model, model_reference, resolve_model_reference
from tests.conftest import qwen3


@pytest.mark.parametrize("name", pocket.POCKET_MODELS)
def test_shipped_pocket_names_resolve_to_the_shipped_models(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no local folder called pocket here
    assert Path(resolve_model_reference(f"pocket/{name}")) == pocket.model_path(name)


@pytest.mark.parametrize(
    "reference", ["pocket/some-model", "pocket/pocket-xl", "pocket/pocket-s/extra", "org/pocket-s"]
)
def test_other_pocket_references_pass_through_to_the_hub(reference, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_model_reference(reference) == reference


def test_a_local_folder_named_pocket_wins_over_the_shipped_model(tmp_path, monkeypatch):
    local = qwen3(layers=2)  # the shipped pocket-s has 3 layers
    local.save_pretrained(tmp_path / "pocket" / "pocket-s")
    monkeypatch.chdir(tmp_path)
    assert resolve_model_reference("pocket/pocket-s") == "pocket/pocket-s"
    model = load_model("pocket/pocket-s")
    assert model.config.num_hidden_layers == 2
    torch.testing.assert_close(model.lm_head.weight, local.lm_head.weight)
    # recorded as an absolute path, so the checkpoint does not load the shipped pocket-s from another folder
    assert model_reference(model) == str((tmp_path / "pocket" / "pocket-s").resolve())
    assert resolve_model_reference(str(tmp_path / "pocket" / "pocket-l")) == str(tmp_path / "pocket" / "pocket-l")


def test_a_shipped_model_is_recorded_as_its_pocket_name():
    model = pocket.load_model("pocket-s")
    assert model_reference(model) == "pocket/pocket-s"


def test_data_pocket_names_the_shipped_split_unless_a_local_pocket_exists(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert Path(resolve_data_reference("pocket")) == pocket.data_path("calibration")
    assert Path(resolve_data_reference("pocket", "heldout")) == pocket.data_path("heldout")
    assert resolve_data_reference("org/dataset:config") == "org/dataset:config"
    with pytest.raises(InvalidInputError, match="unknown split 'test'; available: calibration, heldout"):
        resolve_data_reference("pocket", "test")
    (tmp_path / "pocket").mkdir()  # a local folder of calibration text called pocket
    assert resolve_data_reference("pocket") == "pocket"
