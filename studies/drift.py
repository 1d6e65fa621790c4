"""Drift over multi-turn handoffs: does quality decay as the two models keep handing the conversation over?

Offline harness: a conversation is a held-out document cut into `turns` segments. The two models take the segments
in turn (`alternate`); on every turn of the *evaluated* model, its predictions for the segment are compared with the
same conversation run entirely on that model (its own prefill of everything before): per-turn continuation NLL and
top-1 agreement. `small→large` evaluates the target (the source hands over to it every other turn), `large→small`
evaluates the source (through the reverse mapper).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from hf_kvbridge.errors import InvalidInputError
from hf_kvbridge.transfer.session import HandoffSession


@torch.no_grad()
def drift_conversation(bridge, segments: list[list[int]], evaluated: str = "target", remap: str = "incremental"):
    """Runs one alternating conversation and scores every turn of `evaluated` against its all-own reference.

    Args:
        segments (`list[list[int]]`): the turns' token ids (each at least 2 tokens).
        evaluated (`str`): `"target"` (small→large handoff) or `"source"` (large→small).

    Returns:
        `list[dict]`: per evaluated turn, `turn`, `nll_handoff`, `nll_reference`, `agreement` (top-1), `mapped_tokens`.
    """
    other = "source" if evaluated == "target" else "target"
    reference_model = bridge.target if evaluated == "target" else bridge.source
    all_ids = torch.tensor([[t for segment in segments for t in segment]], device=reference_model.device)
    reference_logits = reference_model(input_ids=all_ids).logits[0]  # (T, V)
    session = HandoffSession(bridge, remap=remap)
    rows, offset = [], 0
    for turn, segment in enumerate(segments):
        model = other if turn % 2 == 0 else evaluated  # the other model opens; the evaluated one takes over
        before = len(session.states[model].tokens)
        if model == evaluated and offset > 0:
            mapped = session.sync(model, session.tokens + segment, upto=offset)
            logits = session.feed(segment, model=model)  # (len, V): predictions of segment[1:] and beyond
            ref = reference_logits[offset : offset + len(segment)]
            targets = torch.tensor(segment[1:], device=logits.device)
            nll = nn.functional.cross_entropy(logits[:-1].float(), targets).item()
            nll_ref = nn.functional.cross_entropy(ref[:-1].float(), targets.to(ref.device)).item()
            agreement = (logits.argmax(-1) == ref.argmax(-1).to(logits.device)).float().mean().item()
            rows.append(
                {
                    "turn": turn,
                    "nll_handoff": nll,
                    "nll_reference": nll_ref,
                    "agreement": agreement,
                    "mapped_tokens": mapped,
                    "cached_before": before,
                }
            )
        else:
            session.feed(segment, model=model)
        offset += len(segment)
    return rows


def drift_summary(conversations: list[list[dict]]) -> dict:
    """Per-turn means over conversations, and the least-squares slope of the top-1 agreement (pp per turn) and of
    the NLL gap (handoff − reference, nats per turn)."""
    turns = sorted({row["turn"] for conv in conversations for row in conv})
    per_turn = []
    for turn in turns:
        rows = [row for conv in conversations for row in conv if row["turn"] == turn]
        per_turn.append(
            {
                "turn": turn,
                "agreement_pct": 100 * sum(r["agreement"] for r in rows) / len(rows),
                "nll_gap": sum(r["nll_handoff"] - r["nll_reference"] for r in rows) / len(rows),
                "conversations": len(rows),
            }
        )

    def slope(key: str) -> float:
        xs = torch.tensor([p["turn"] for p in per_turn], dtype=torch.float64)
        ys = torch.tensor([p[key] for p in per_turn], dtype=torch.float64)
        if len(xs) < 2:
            return float("nan")
        xs = xs - xs.mean()
        return float((xs * (ys - ys.mean())).sum() / (xs * xs).sum())

    return {
        "per_turn": per_turn,
        "agreement_pp_per_turn": slope("agreement_pct"),
        "nll_gap_per_turn": slope("nll_gap"),
    }


def document_segments(texts: list[str], tokenizer, turns: int, segment_len: int, max_conversations: int):
    """Conversations of `turns` segments of `segment_len` tokens, each from one held-out document."""
    conversations = []
    need = turns * segment_len
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        for start in range(0, len(ids) - need + 1, need):
            chunk = ids[start : start + need]
            conversations.append([chunk[i * segment_len : (i + 1) * segment_len] for i in range(turns)])
            if len(conversations) == max_conversations:
                return conversations
    if not conversations:
        raise InvalidInputError(f"no document holds {need} tokens")
    return conversations


def plot_drift(results: dict, path, title: str = "multi-turn drift") -> None:
    """Top-1 agreement per turn for each direction and remap mode (on a 0–100 % axis)."""
    from hf_kvbridge.tools.diagnostics import pyplot, wrapped_title

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.0), layout="constrained")
    wrapped_title(ax, title, width=70)
    ax.set_ylim(0, 100)
    for label, summary in results.items():
        turns = [p["turn"] for p in summary["per_turn"]]
        ax.plot(turns, [p["agreement_pct"] for p in summary["per_turn"]], marker="o", label=label)
    ax.set_xlabel("turn")
    ax.set_ylabel("top-1 agreement with own-prefill run (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_drift(args) -> int:
    """`python -m studies.drift`: a bidirectional bridge of the pocket family, alternating conversations on held-out
    text, per-turn drift for small→large and large→small, incremental vs full re-mapping; JSON and a plot."""
    import datetime
    import json
    from pathlib import Path

    from transformers import AutoTokenizer

    from hf_kvbridge import pocket
    from hf_kvbridge.fitting.calibration.calibrate import calibrate

    tokenizer = AutoTokenizer.from_pretrained(pocket.model_path(args.large))
    bridge = calibrate(
        pocket.load_model(args.small),
        pocket.load_model(args.large),
        pocket.load_texts("calibration"),
        tokenizer=tokenizer,
        num_sequences=args.num_sequences,
        seq_len=args.seq_len,
        top_k=args.top_k,
        bidirectional=True,
        seed=args.seed,
    )
    conversations = document_segments(
        pocket.load_texts("heldout"), tokenizer, args.turns, args.segment_len, args.conversations
    )
    results = {}
    for direction, evaluated in ((f"{args.small}→{args.large}", "target"), (f"{args.large}→{args.small}", "source")):
        for remap in ("incremental", "full"):
            runs = [drift_conversation(bridge, conv, evaluated=evaluated, remap=remap) for conv in conversations]
            results[f"{direction} ({remap})"] = drift_summary(runs)
    print(
        f"drift over {args.turns}-turn alternating conversations ({len(conversations)} held-out documents, "
        f"{args.segment_len} tokens a turn); the evaluated model takes every other turn:"
    )
    for label, summary in results.items():
        cells = " ".join(f"t{p['turn']}:{p['agreement_pct']:.1f}%/{p['nll_gap']:+.3f}" for p in summary["per_turn"])
        print(f"  {label}: top-1 agreement / NLL gap per turn  {cells}")
        slope, gap = summary["agreement_pp_per_turn"], summary["nll_gap_per_turn"]
        print(f"      slope {slope:+.2f} pp/turn, NLL gap {gap:+.4f} nats/turn")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) / f"drift-{args.small}-{args.large}-{stamp}"
    out.mkdir(parents=True)
    settings = {k: v for k, v in vars(args).items() if k != "func"}
    (out / "drift.json").write_text(json.dumps({"settings": settings, "results": results}, indent=2))
    plot_drift(
        results,
        out / "drift.png",
        f"{args.small} ↔ {args.large}: does the evaluated model still predict as on its own prefill, turn by turn?",
    )
    print(f"wrote {out}/drift.json, drift.png")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--small", default="pocket-s")
    parser.add_argument("--large", default="pocket-l")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--segment-len", type=int, default=48, help="tokens per turn")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--num-sequences", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="kvbridge-demo")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m studies.drift", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_drift(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
