"""`kvbridge bench distill` (`hf_kvbridge.tools.bench.distill`): a distillation step at real layer shapes. Its FLOP
model is checked against PyTorch's own count of a real step, its memory plan against the tensors a step holds and
allocates, and the command refuses what cannot run before building models."""

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from hf_kvbridge.fitting.calibration.differentiable import PreconditionedMap, source_rows
from hf_kvbridge.fitting.calibration.distill import map_state_bytes, window_losses
from hf_kvbridge.tools.bench import distill as bench
from hf_kvbridge.tools.bench import shapes
from kvbridge_cli import main

# hidden sizes large against the window, so the attention products (counted square by PyTorch, causal here) are
# under 1 % of a step; a vocabulary as wide as the hidden size, so the LM head counts
TINY_SHAPES = {"tiny-s": (128, 2, 2, 1, 64, 256, 512, True), "tiny-t": (192, 3, 3, 1, 64, 384, 512, False)}


@pytest.fixture
def tiny_shapes(monkeypatch):
    for name, shape in TINY_SHAPES.items():
        monkeypatch.setitem(shapes.CHECKPOINT_SHAPES, name, shape)


@pytest.mark.parametrize("head_mode", ["all_heads", "same_head"])
def test_the_flop_model_counts_a_real_step(tiny_shapes, head_mode):
    """`step_flops` against `FlopCounterMode` over one real window: the teacher, source, map and student forwards
    (`window_losses`) and the backward into the map's weights, each within 2 % (the frozen target's backward computes
    its inputs' gradients only, never its weights': a model that counted those would be 2× off)."""
    torch.manual_seed(0)
    source = shapes.random_model("tiny-s", torch.float32)
    target = shapes.random_model("tiny-t", torch.float32)
    bridge = shapes.random_mapper_bridge(source, target, top_k=2, head_mode=head_mode)
    for model in (source, target):
        model.requires_grad_(False)
    seq_len, continuation = 12, 4
    ids = torch.randint(0, 512, (1, seq_len))
    context = ids[:, : seq_len - continuation]
    maps = PreconditionedMap(bridge.mapper.float(), source_rows(bridge, bridge.mapper, context))
    for p in maps.deltas:
        p.requires_grad_(True)
    autocast = torch.autocast("cpu", enabled=False)
    with FlopCounterMode(display=False) as forward_count:
        kl = window_losses(bridge, maps, ids, continuation, autocast)[0]
    with FlopCounterMode(display=False) as backward_count:
        kl.backward()
    model = bench.step_flops(source.config, target.config, bridge.mapper.flops_per_token(), seq_len, continuation)
    forward = model["teacher"] + model["source"] + model["map"] + model["student"]
    assert forward_count.get_total_flops() == pytest.approx(forward, rel=0.02)
    assert backward_count.get_total_flops() == pytest.approx(model["backward"], rel=0.02)


def test_the_bench_measures_a_step_against_its_plan(tiny_shapes, tmp_path, capsys):
    """A measured run: every part of a step timed; the map's training state counted from the live tensors equals the
    plan's (less the gradient), and so does the best Δ in host memory; one window's forward and backward allocates,
    beside the gradient, no more than the plan's window and at least 1/2.5 of it (0.56 here, 0.8 at Qwen3-0.6B →
    1.7B); the projection multiplies the step out."""
    out = tmp_path / "distill.json"
    argv = ["bench", "distill", "--pair", "tiny-s:tiny-t", "--seq-len", "96", "--continuation-len", "32",
            "--top-k", "2", "--steps", "2", "--windows", "20", "--epochs", "1", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert all(result["seconds"][part] > 0 for part in bench.PARTS)
    memory = result["memory"]
    assert memory["map_state_held"] == memory["map_state_planned_without_gradient"]
    assert memory["host_best_held"] == memory["host_best_planned"] > 0
    window = memory["window_peak_measured"] - memory["gradient"]  # the gradient's bytes are Δ's
    assert memory["plan"]["window"] / 2.5 <= window <= memory["plan"]["window"]  # an upper bound, not a loose one
    projection, counts = result["projection"], (18, 2)  # 20 windows, 10 % held out
    assert (projection["train_windows"], projection["heldout_windows"]) == counts
    assert projection["step_windows"] == 2 * 1 * 18 and projection["evaluation_windows"] == 2 * (1 + 2 * 1 * 4)
    assert projection["distillation_seconds_uncached"] > projection["step_windows"] * projection["step_seconds"]
    # every window cached: the teacher's whole forward once a window, its LM head after that
    assert projection["teacher_cache_share"] == 1
    assert projection["distillation_seconds"] < projection["distillation_seconds_uncached"]
    printed = capsys.readouterr().out
    assert "one window's step, TFLOP" in printed and "ratio" in printed


def test_the_plan_on_paper_needs_no_models(tiny_shapes):
    """`--flop-model`: the mapper and models counted on the meta device; the map's training state is four float32
    copies of the map on the device, the best Δ one more in host memory (two with several pull strengths), and the
    models' bytes follow their dtype."""
    w = bench.DistillWorkload("tiny-s:tiny-t", seq_len=24, continuation_len=8, top_k=2, dtype="bfloat16")
    report = bench.flop_model_report(w)
    plan = report["memory"]
    assert plan["map_state"] == 4 * 4 * plan["map_parameters"] and plan["host_best"] == 2 * 4 * plan["map_parameters"]
    mapper, counts = bench._meta_parts(w)
    assert plan["map_state"] == map_state_bytes(mapper) and plan["models"] == 2 * sum(counts)
    built = [sum(p.numel() for p in shapes.random_model(n, torch.float32).parameters()) for n in ("tiny-s", "tiny-t")]
    assert plan["model_parameters"] == built


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--pair", "qwen3-0.6b:nope"], "unknown shape 'nope'"),
        (["--seq-len", "128", "--continuation-len", "128"], "must be below --seq-len"),
    ],
)
def test_bad_input_is_refused_before_any_model(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(bench, "run", lambda *a, **k: pytest.fail("a model was built"))
    assert main(["bench", "distill", *argv]) != 0
    assert message in capsys.readouterr().err
