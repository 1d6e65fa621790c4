"""Moved public names keep their old import paths for one release (CHANGELOG.md): a moved module is the same module
object under its old name; a fit moved off a runtime module names its new home until the fitting side is imported."""

from __future__ import annotations

import subprocess
import sys

import pytest

import hf_kvbridge


@pytest.mark.parametrize("old", sorted(hf_kvbridge.MOVED_MODULES))
def test_an_old_module_path_is_the_moved_module_itself(old):
    import importlib

    with pytest.deprecated_call(match="moved to"):
        sys.modules.pop(old, None)
        module = importlib.import_module(old)
    assert module is importlib.import_module(hf_kvbridge.MOVED_MODULES[old])


def test_old_submodule_paths_and_private_names_still_import():
    from hf_kvbridge.calibration.refit import refit
    from hf_kvbridge.statistics.dense import KVStatistics

    from hf_kvbridge.fitting.calibration import refit as moved

    assert refit is moved.refit and KVStatistics.__module__ == "hf_kvbridge.fitting.statistics.dense"


def test_a_moved_fit_names_its_new_module_before_the_fitting_side_is_imported():
    code = (
        "import sys\n"
        "from hf_kvbridge.mappers import KVMapper\n"
        "try:\n"
        "    from hf_kvbridge.mappers.low_rank import fit_low_rank\n"
        "except ImportError as e:\n"
        "    print(type(e).__name__, e)\n"
        "print(hasattr(KVMapper, 'from_statistics'))\n"
        "import hf_kvbridge.fitting\n"
        "from hf_kvbridge.mappers.low_rank import fit_low_rank\n"
        "print(fit_low_rank.__module__, hasattr(KVMapper, 'from_statistics'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("MovedError hf_kvbridge.mappers.low_rank.fit_low_rank moved to ")
    assert "hf_kvbridge.fitting.mapper_fits.low_rank.fit_low_rank" in lines[0]
    assert lines[1:] == ["False", "hf_kvbridge.fitting.mapper_fits.low_rank True"]
