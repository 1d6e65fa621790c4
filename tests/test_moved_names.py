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
    from hf_kvbridge.calibration.checks import split_heldout
    from hf_kvbridge.statistics.dense import KVStatistics

    from hf_kvbridge.fitting.calibration import checks as moved

    assert split_heldout is moved.split_heldout and KVStatistics.__module__ == "hf_kvbridge.fitting.statistics.dense"


def test_the_functions_that_build_a_bridge_moved_up_to_calibrate():
    """`refit` moved beside `fit_of` (`fitting.mapper_fits`), and the fits that build a bridge (`fit_bridge`,
    `assemble_bridge`, `fit_bridge_in_passes`) up to `fitting.calibration.calibrate`, so the fitting side below
    `calibrate` never imports the bridge class: their old paths still give them, with a warning or once `calibrate`
    is imported, and a fresh process is told the new module."""
    from hf_kvbridge.fitting import mapper_fits
    from hf_kvbridge.fitting.calibration import budgeted_fit, calibrate, dense_fit

    with pytest.deprecated_call(match="moved to hf_kvbridge.fitting.mapper_fits.refit"):
        from hf_kvbridge.fitting.calibration.refit import refit
    assert refit is mapper_fits.refit
    assert dense_fit.fit_bridge is calibrate.fit_bridge and dense_fit.assemble_bridge is calibrate.assemble_bridge
    assert budgeted_fit.fit_bridge_in_passes is calibrate.fit_bridge_in_passes
    code = (
        "try:\n"
        "    from hf_kvbridge.fitting.calibration.dense_fit import fit_bridge\n"
        "except ImportError as e:\n"
        "    print(type(e).__name__, e)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.startswith("MovedError") and "hf_kvbridge.fitting.calibration.calibrate" in result.stdout


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


def test_the_plans_that_are_not_the_transfer_plan_have_their_own_names():
    """One name per concept: `TransferPlan` is the only plan; the mapping engine's grouping of target layers is
    `mapping_steps` and a calibration's memory decision `StatisticsBudget` (`statistics_budget`). The old names
    still answer for one release, with a warning naming the new one."""
    from hf_kvbridge.fitting import budget
    from hf_kvbridge.mappers import engine, engine_steps

    for module, old, new in [
        (engine_steps, "mapping_plan", engine_steps.mapping_steps),
        (engine, "mapping_plan", engine_steps.mapping_steps),
        (budget, "CalibrationPlan", budget.StatisticsBudget),
        (budget, "plan_calibration", budget.statistics_budget),
    ]:
        with pytest.deprecated_call(match=f"is renamed {module.__name__}.{new.__name__}"):
            assert getattr(module, old) is new
    with pytest.raises(AttributeError):
        budget.no_such_name  # noqa: B018
