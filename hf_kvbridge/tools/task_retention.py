"""`kvbridge eval DIR --tasks ...`: source, target, bridge and the controls through lm-eval, and one retention table.

Each mode is one `lm_eval.simple_evaluate` run of [`KVBridgeLM`] on the same requests (the bridge is loaded once):
source, target, bridge, and by default also no context, zero cache and random cache (`hf_kvbridge.controls`).
Per task and metric the table gives each mode's value ± lm-eval's standard error, and

- retention = bridge / target (for lower-is-better metrics such as perplexity: target / bridge, so that in both
  cases 1 means "as good as the target" and less means worse);
- chance-normalised retention = (bridge − chance) / (target − chance), for multiple-choice accuracies only, where
  chance = the mean over the evaluated documents of 1 / (number of choices) (read from the task's own documents;
  for a group, the common chance of its subtasks if they share one). Generative and perplexity metrics have no chance
  level and leave it empty;
- context-benefit retention = (bridge − no context) / (target − no context), when `no_context` ran and the context
  helps the target on that metric (undefined otherwise);
- controls: the same retention of the zero- and random-cache controls (context-benefit when defined, else
  control / target as above). A row where a control comes within `CONTROL_MARGIN` (0.1) of the bridge's retention
  is flagged (`controls_flag` in the JSON rows, "⚠ control" in the table, a warning after it): there the bridge
  transfers little that a cache without information would not;
- gap recovered = (bridge − source) / (target − source) (for lower-is-better metrics (source − bridge) / (source −
  target): the same share, 1 = as good as the target, 0 = as good as the source alone), when source, target and
  bridge ran: paired over the documents (lm-eval's per-document scores; `hf_kvbridge.tools.evaluation.gap_recovered`,
  delta-method 95% CI), for metrics whose value is the mean of per-document scores (accuracies, exact match), and
  only where the target beats the source by a margin the documents resolve ("n/a" and the reason otherwise, e.g. an
  identity pair or a corpus-level metric such as perplexity). JSON rows: `gap_recovered`, `gap_recovered_ci`,
  `gap_recovered_reason`, `source_target_gap`, `source_target_gap_ci`.
"""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
import time
from typing import Any
from unittest import mock

from ..constants import CONTROL_MODES, EVAL_MODES
from ..controls import CONTROL_MARGIN, controls_flag
from .evaluation import GapRecovered, chance_normalised_retention, gap_recovered

logger = logging.getLogger(__name__)

CHANCE_METRICS = ("acc", "acc_norm")


def _leaf_tasks(task_dict: dict) -> dict[str, Any]:
    """`{task name: Task}` of a (possibly nested) lm-eval task dict."""
    from lm_eval.api.task import Task

    leaves = {}
    for key, value in task_dict.items():
        if isinstance(value, dict):
            leaves.update(_leaf_tasks(value))
        elif isinstance(value, Task):
            leaves[key if isinstance(key, str) else value.task_name] = value
    return leaves


def task_chance(task, limit: float | None) -> float | None:
    """Mean of 1 / (number of choices) over the documents lm-eval evaluates; `None` unless multiple-choice."""
    if getattr(task, "OUTPUT_TYPE", None) != "multiple_choice":
        return None
    docs = list(task.eval_docs)
    if limit is not None:
        docs = docs[: int(math.ceil(len(docs) * limit)) if limit < 1.0 else int(limit)]
    counts = [len(task.doc_to_choice(doc)) for doc in docs]
    return sum(1.0 / n for n in counts) / len(counts) if counts else None


def chance_levels(results: dict, task_dict: dict, limit: float | None) -> dict[str, float | None]:
    """Chance level of every task and group in `results` (groups: their subtasks' common chance, if any)."""
    chance = {name: task_chance(task, limit) for name, task in _leaf_tasks(task_dict).items()}
    for group, members in (results.get("group_subtasks") or {}).items():
        levels = {round(chance[m], 9) if chance.get(m) is not None else None for m in members}
        chance[group] = levels.pop() if len(levels) == 1 else None
    return chance


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def per_document_scores(results: dict) -> dict[str, dict[str, dict[Any, float]]]:
    """`{task: {"metric,filter": {doc_id: score}}}`: the numeric per-document scores of lm-eval's logged samples
    (`simple_evaluate(..., log_samples=True)`); metrics whose per-document value is not a number are left out."""
    scores: dict[str, dict[str, dict[Any, float]]] = {}
    for task, samples in (results.get("samples") or {}).items():
        for sample in samples:
            for metric in sample.get("metrics", ()):
                value = _number(sample.get(metric))
                if value is not None:
                    key = f"{metric},{sample.get('filter', 'none')}"
                    scores.setdefault(task, {}).setdefault(key, {})[sample["doc_id"]] = value
    return scores


def _leaves(task: str, groups: dict[str, list[str]]) -> list[str]:
    """The leaf tasks under `task` (itself when it is not a group)."""
    if task not in groups:
        return [task]
    return [leaf for member in groups[task] for leaf in _leaves(member, groups)]


GAP_MODES = ("source", "target", "bridge")


def _gap_columns(row: dict[str, Any], task: str, key: str, per_document: dict, groups: dict) -> None:
    """Adds the gap recovered (`GapRecovered.fields`) to a row, paired over the documents all three modes scored."""
    scores = {}
    for mode in GAP_MODES:
        by_task = per_document.get(mode) or {}
        scores[mode] = {
            (leaf, doc): value
            for leaf in _leaves(task, groups)
            for doc, value in by_task.get(leaf, {}).get(key, {}).items()
        }
    docs = sorted(set(scores["source"]) & set(scores["target"]) & set(scores["bridge"]), key=str)
    values = {mode: [scores[mode][doc] for doc in docs] for mode in GAP_MODES}
    reason = None
    if any(row.get(mode) is None for mode in GAP_MODES):
        reason = "the source, target or bridge has no value for this metric"
    elif not docs:
        reason = (
            "lm-eval logged no per-document scores of this metric (a corpus-level metric such as perplexity): no "
            "paired interval"
        )
    elif not all(math.isclose(sum(v) / len(v), row[mode], rel_tol=1e-6, abs_tol=1e-9) for mode, v in values.items()):
        reason = "the metric is not the mean of its per-document scores: no paired interval"
    if reason is not None:
        row.update(GapRecovered(None, None, None, False, reason).fields())
        return
    measured = gap_recovered(
        values["source"],
        values["bridge"],
        values["target"],
        higher_is_better=row["higher_is_better"],
        unit="documents",
    )
    row.update(measured.fields())


def retention_rows(
    by_mode: dict[str, dict], chance: dict[str, float | None], per_document: dict[str, dict] | None = None
) -> list[dict[str, Any]]:
    """One row per (task, metric, filter): each mode's value and stderr, retention, chance-normalised retention and,
    when source, target and bridge ran, the gap recovered.

    Args:
        by_mode (`dict[str, dict]`): lm-eval results (`simple_evaluate`'s return value) per mode.
        chance (`dict[str, float | None]`): chance level per task (see `chance_levels`).
        per_document (`dict[str, dict]`, *optional*): `per_document_scores` per mode, for the gap recovered's
            pairing; by default read from each mode's logged samples (`results["samples"]`), if any.
    """
    if per_document is None:
        per_document = {mode: per_document_scores(results) for mode, results in by_mode.items()}
    gap = all(mode in by_mode for mode in GAP_MODES)
    reference = by_mode.get("target") or next(iter(by_mode.values()))
    groups = reference.get("group_subtasks") or {}
    rows = []
    for task in sorted(reference["results"]):
        higher = reference.get("higher_is_better", {}).get(task, {})
        for key in sorted(reference["results"][task]):
            if "," not in key or "_stderr," in key:
                continue
            metric, filt = key.split(",", 1)
            row: dict[str, Any] = {"task": task, "metric": metric, "filter": filt}
            for mode, results in by_mode.items():
                values = results["results"].get(task, {})
                row[mode] = _number(values.get(key))
                row[f"{mode}_stderr"] = _number(values.get(f"{metric}_stderr,{filt}"))
            if all(row.get(mode) is None for mode in by_mode):
                continue
            target, bridge = row.get("target"), row.get("bridge")
            row["higher_is_better"] = higher.get(metric, True)
            row["retention"] = _ratio_retention(bridge, target, row["higher_is_better"])
            _control_columns(row, [m for m in CONTROL_MODES if m in by_mode])
            level = chance.get(task) if metric in CHANCE_METRICS else None
            row["chance"] = level
            # undefined (None) when the target is at or below chance: there is no ability above chance to retain
            row["chance_normalised_retention"] = chance_normalised_retention(bridge, target, level)
            if gap:
                _gap_columns(row, task, key, per_document, groups)
            rows.append(row)
    return rows


def _ratio_retention(value: float | None, target: float | None, higher_is_better: bool) -> float | None:
    """value / target (target / value when lower is better): 1 is as good as the target."""
    if value is None or target is None:
        return None
    num, den = (value, target) if higher_is_better else (target, value)
    return num / den if den else None


def _context_benefit(value: float | None, target: float | None, floor: float | None, higher: bool) -> float | None:
    """(value − no context) / (target − no context); `None` unless the context helps the target on the metric."""
    if value is None or target is None or floor is None:
        return None
    gain = (target - floor) if higher else (floor - target)
    return ((value - floor) if higher else (floor - value)) / gain if gain > 0 else None


def _control_columns(row: dict[str, Any], controls: list[str]) -> None:
    """Adds `context_benefit_retention`, the controls' retention (`control_retention`, on `controls_basis`) and
    `controls_flag` (a control within `CONTROL_MARGIN` of the bridge; `None` when undefined) to a table row."""
    higher, target, floor = row["higher_is_better"], row.get("target"), row.get("no_context")
    row["context_benefit_retention"] = _context_benefit(row.get("bridge"), target, floor, higher)
    if not controls:
        return
    if row["context_benefit_retention"] is not None:
        row["controls_basis"], bridge = "context_benefit", row["context_benefit_retention"]
        row["control_retention"] = {m: _context_benefit(row.get(m), target, floor, higher) for m in controls}
    else:
        row["controls_basis"], bridge = "ratio", row["retention"]
        row["control_retention"] = {m: _ratio_retention(row.get(m), target, higher) for m in controls}
    row["controls_flag"] = controls_flag(bridge, row["control_retention"])


def control_warnings(rows: list[dict[str, Any]]) -> list[str]:
    """One line per flagged row: which control comes within `CONTROL_MARGIN` of the bridge's retention."""
    lines = []
    for row in rows:
        if not row.get("controls_flag"):
            continue
        basis = row["controls_basis"]
        bridge = row["context_benefit_retention"] if basis == "context_benefit" else row["retention"]
        controls = ", ".join(f"{m} {v:.3f}" for m, v in row["control_retention"].items() if v is not None)
        lines.append(
            f"warning: {row['task']} {row['metric']}: the bridge's {basis.replace('_', '-')} retention {bridge:.3f} "
            f"is within {CONTROL_MARGIN} of a control's ({controls}); the mapped cache transfers little here"
        )
    return lines


def _fmt_gap(row: dict[str, Any]) -> str:
    if row.get("gap_recovered") is None:
        return "n/a"
    low, high = row["gap_recovered_ci"]
    return f"{row['gap_recovered']:.3f} [{low:.3f}, {high:.3f}]"


def _fmt(value: float | None, stderr: float | None = None) -> str:
    if value is None:
        return "—"
    text = f"{value:.4g}" if abs(value) >= 1000 else f"{value:.4f}"
    return f"{text} ± {stderr:.4f}" if stderr is not None else text


def format_table(rows: list[dict[str, Any]], modes: tuple[str, ...] = EVAL_MODES) -> str:
    """The rows as a Markdown table (printed by `kvbridge eval`, pasted into the model card)."""
    modes = tuple(m for m in modes if any(m in row for row in rows)) or modes
    header = ["task", "metric", *modes, "retention", "chance", "chance-norm. retention"]
    controls = any("controls_flag" in row for row in rows)
    benefit = any(row.get("context_benefit_retention") is not None for row in rows)
    gap = any("gap_recovered" in row for row in rows)
    header += ["context-benefit retention"] * benefit + ["gap recovered [95% CI]"] * gap + ["controls"] * controls
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        metric = row["metric"] + ("" if row["filter"] == "none" else f" ({row['filter']})")
        metric += "" if row.get("higher_is_better", True) else " ↓"
        cells = [row["task"], metric]
        cells += [_fmt(row.get(mode), row.get(f"{mode}_stderr")) for mode in modes]
        normalised = _fmt(row.get("chance_normalised_retention"))
        if row.get("chance") is not None and row.get("chance_normalised_retention") is None:
            normalised = "undefined (target ≤ chance)"
        cells += [_fmt(row.get("retention")), _fmt(row.get("chance")), normalised]
        if benefit:
            cells.append(_fmt(row.get("context_benefit_retention")))
        if gap:
            cells.append(_fmt_gap(row))
        if controls:
            flag = row.get("controls_flag")
            cells.append("—" if flag is None else f"⚠ control within {CONTROL_MARGIN}" if flag else "ok")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _quiet_git_commit_hash() -> str | None:
    """lm-eval's `get_git_commit_hash` without git's `fatal: not a git repository` on stderr outside a clone."""
    try:
        return subprocess.check_output(["git", "describe", "--always"], stderr=subprocess.DEVNULL).strip().decode()
    except (subprocess.CalledProcessError, FileNotFoundError):
        from lm_eval.loggers.utils import get_commit_from_path

        return get_commit_from_path(os.getcwd())


def _defined_in(manager, names) -> bool:
    """Whether every task or group in `names` (and every task its groups list) is in `manager`'s own index."""
    for name in names:
        entry = manager.task_index.get(name) if isinstance(name, str) else None
        if entry is None:
            return False
        if entry.kind.name == "GROUP":
            listed = entry.cfg.get("task", [])
            listed = [listed] if isinstance(listed, (str, dict)) else listed
            if not _defined_in(manager, [t.get("task") if isinstance(t, dict) else t for t in listed]):
                return False
    return True


def task_manager_for(tasks: list[str], include_path: str | None = None):
    """lm-eval's `TaskManager` for `tasks`: the include path's tasks alone when they name nothing else (indexing
    lm-eval's ~15,000 stock task files takes about 17 s on 2 cores, each time a manager is built), else the stock
    tasks too.

    Example:
        >>> from hf_kvbridge.tools.task_retention import task_manager_for
        >>> task_manager_for(["kvbridge_pocket_cloze"], "eval_tasks/pocket").all_tasks
        ['kvbridge_pocket', 'kvbridge_pocket_cloze', 'kvbridge_pocket_ppl']
    """
    from lm_eval.tasks import TaskManager

    if include_path:
        own = TaskManager(include_path=include_path, include_defaults=False)
        if _defined_in(own, tasks):
            return own
        return TaskManager(include_path=include_path)
    return TaskManager()


def evaluate_modes(
    bridge,
    tasks: list[str],
    *,
    modes: tuple[str, ...] = EVAL_MODES,
    include_path: str | None = None,
    limit: float | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 1,
    bootstrap_iters: int = 100000,
    rolling_stride: int | None = None,
) -> dict[str, Any]:
    """Runs lm-eval once per mode on a loaded bridge; returns `{"rows", "table", "chance", "results"}`.

    Each run logs its samples for the per-document pairing of the gap recovered (`per_document_scores`); the samples
    are dropped from `results` afterwards (they hold every document)."""
    import lm_eval
    from lm_eval.tasks import get_task_dict

    from ..integrations.lm_eval import KVBridgeLM

    task_manager = task_manager_for(tasks, include_path)
    by_mode, per_document = {}, {}
    extra = {"rolling_stride": rolling_stride} if rolling_stride else {}
    what = {
        "source": f"the source alone ({bridge.config.source_name_or_path})",
        "target": f"the target alone ({bridge.config.target_name_or_path})",
        "bridge": "the bridge (source prefill, mapped cache, target decodes)",
        "no_context": "the target without the context",
        "zero_cache": "control: the target decodes from an all-zero cache of the context",
        "random_cache": "control: the target decodes from a random cache with the mapped cache's norms",
    }
    for index, mode in enumerate(modes, 1):
        started = time.perf_counter()
        # lm-eval's own progress bars do not say which model runs: this line does
        print(f"[{index}/{len(modes)}] mode {mode}: {what.get(mode, mode)}", file=sys.stderr, flush=True)
        lm = KVBridgeLM(pretrained=bridge, mode=mode, batch_size=batch_size, **extra)
        with mock.patch("lm_eval.evaluator.get_git_commit_hash", _quiet_git_commit_hash):
            by_mode[mode] = lm_eval.simple_evaluate(
                model=lm,
                tasks=tasks,
                num_fewshot=num_fewshot,
                limit=limit,
                bootstrap_iters=bootstrap_iters,
                task_manager=task_manager,
                log_samples=True,
            )
        per_document[mode] = per_document_scores(by_mode[mode])
        by_mode[mode].pop("samples", None)
        logger.info("mode %s: %.1fs", mode, time.perf_counter() - started)
    reference = by_mode.get("target") or next(iter(by_mode.values()))
    chance = chance_levels(reference, get_task_dict(tasks, task_manager), limit)
    rows = retention_rows(by_mode, chance, per_document)
    return {
        "rows": rows,
        "table": format_table(rows, modes),
        "warnings": control_warnings(rows),
        "chance": chance,
        "results": by_mode,
    }
