"""The mapper comparison study at toy sizes on the smallest shipped pair."""

import json

from studies.mapper_study import main


def test_mapper_study_cli(tmp_path, capsys):
    """`studies.mapper_study` on the smallest shipped pair, at toy sizes: one row per mapper, JSON written."""
    out = tmp_path / "mappers.json"
    sizes = "--num-sequences 8 --seq-len 64 --nll-windows 2 --nll-context 48 --nll-continuation 16 --cloze-items 0"
    sizes += " --mlp-epochs 1 --mlp-steps-per-batch 1 --mlp-hidden 8 --timing-context 32 --timing-repeats 1"
    assert main(["--pair", "pocket-s:pocket-m", *sizes.split(), "--json", str(out)]) == 0
    table = capsys.readouterr().out
    result = json.loads(out.read_text())
    names = {"ridge", "ridge_same_head", "low_rank_32", "low_rank_8", "ridge_bf16", "mlp_mse", "mlp_attention"}
    assert set(result["mappers"]) == names | {"ridge_attention_weighted"}
    assert all(name in table for name in result["mappers"])
    rows = result["mappers"]
    assert rows["mlp_mse"]["parameters"] > rows["ridge"]["parameters"]
    # the cheaper forms cost fewer FLOPs; bf16 halves the bytes at the same FLOPs
    flops = {name: rows[name]["mapper_flops_per_token"] for name in names}
    assert flops["low_rank_8"] < flops["low_rank_32"] < flops["ridge"] and flops["ridge_same_head"] < flops["ridge"]
    assert flops["ridge_bf16"] == flops["ridge"] and rows["ridge_bf16"]["bytes"] * 2 == rows["ridge"]["bytes"]
    assert rows["ridge_bf16"]["mapper_dtype"] == "torch.bfloat16" and rows["ridge"]["mapper_dtype"] == "torch.float32"
    assert (
        rows["low_rank_8"]["heldout_r2_mean"]
        < rows["low_rank_32"]["heldout_r2_mean"]
        <= rows["ridge"]["heldout_r2_mean"] + 1e-6
    )
    assert rows["mlp_mse"]["heldout_r2"] is None
    assert abs(rows["ridge_bf16"]["heldout_r2_mean"] - rows["ridge"]["heldout_r2_mean"]) < 0.01
