"""Recovery of a sensitive dropped sync point by distillation (``ssmshard.spd_recovery.recover``)
on a trained small model, on a :class:`ssmshard.SimulatedMesh` (CPU, fp32).

Drops ``--drop`` at ``--tp``, trains the parameters ``--train`` names (default: the decoder layer
after the dropped sync point's layer, the block whose input the drop makes approximate) to match
the exact model's next-token distributions on the CALIBRATION split, and reports the held-out
perplexity of the unsharded model, exact TP, SPD before and SPD after recovery, with the
calibration KL before and after and the loss per step.

``--group-heads`` first applies head grouping (``ssmshard.head_grouping.group_heads``) to the
dropped sync point's block on the calibration split and reports the held-out perplexity of the
grouped model without SPD (unchanged: the permutation is exact) and with SPD; distillation, if
``--steps`` > 0, then starts from the grouped model. ``--steps 0`` skips distillation.
``--save-grouping FILE`` writes the chosen grouping as JSON (a list of ``HeadGrouping.as_dict()``).
``--grouping FILE`` reads such a file instead of choosing: the SPD plan carries the permutation
(``Plan(head_permutations=...)``, the model's weights untouched) and the held-out perplexity of exact
TP and of SPD under it is reported (``tp_grouped``, ``spd_grouped``); distillation, if asked for,
then runs on the model permuted in place (``recover`` trains the model's own weights).

    python benchmarks/spd_recovery.py --models-dir DIR --model mamba2 --tp 2 --drop layers.0.out_proj
    python benchmarks/spd_recovery.py --models-dir DIR --model llama --drop layers.0.o_proj --group-heads --steps 0
    python benchmarks/spd_recovery.py --models-dir DIR --model llama --tp 4 --drop layers.0.o_proj --group-heads \
        --steps 0 --save-grouping grouping.json
    python benchmarks/spd_recovery.py --models-dir DIR --model llama --tp 4 --drop layers.0.o_proj \
        --grouping grouping.json --steps 0
    python benchmarks/spd_recovery.py --smoke --out FILE   # a tiny random model: checks the script

Writes JSON to --out (default benchmarks/results/spd_accuracy/spd_recovery.json) and a PNG of the
loss per step beside it; ``--save-dir`` also writes the recovered checkpoint (``save_pretrained``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import os
import platform
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common  # noqa: E402
from spd_accuracy import load_case_inputs  # noqa: E402


def default_train(model, drop: str) -> list[str]:
    """The decoder layer after the dropped sync point's layer: it holds the block whose input the
    drop makes approximate where the sync point ends its layer (``out_proj``, ``down_proj``)."""
    parts = drop.split(".")
    if len(parts) != 3 or parts[0] != "layers" or parts[2] not in ("out_proj", "down_proj"):
        raise SystemExit(f"no default --train for {drop}: the block after it is in the same layer or is not a layer; "
                         "name the parameters to train with --train")
    layer = int(parts[1])
    prefixes = {n.rsplit(f".{layer + 1}.", 1)[0] for n, _ in model.named_parameters() if f"layers.{layer + 1}." in n}
    if len(prefixes) != 1:
        raise SystemExit(f"cannot tell the layer after {drop} (found {sorted(prefixes)}); pass --train")
    return [f"{prefixes.pop()}.{layer + 1}.*"]


def plot_losses(path: str, losses: list[float], title: str) -> None:
    plt = bench_common.pyplot(path)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 3.8))
    ax.plot(range(1, len(losses) + 1), losses, marker=".")
    ax.set_xlabel("step")
    ax.set_ylabel("batch KL(exact || SPD), nats per token")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models-dir", default=os.path.join(ROOT, "benchmarks", "results", "trained_models"))
    parser.add_argument("--model", default="mamba2")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--drop", nargs="+", default=["layers.0.out_proj"], help="sync points dropped")
    parser.add_argument("--train", nargs="+", default=None, help="parameter names or globs to train "
                        "(default, for an out_proj or down_proj: the decoder layer after its layer)")
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--calibration-windows", type=int, default=32)
    parser.add_argument("--heldout-windows", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=4, help="windows per training step")
    parser.add_argument("--eval-batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--group-heads", action="store_true", help="group the dropped block's heads first")
    parser.add_argument("--save-grouping", default=None, metavar="FILE",
                        help="with --group-heads: write the chosen grouping here (JSON)")
    parser.add_argument("--grouping", default=None, metavar="FILE",
                        help="a grouping --save-grouping wrote: carried by the SPD plan instead of choosing one")
    parser.add_argument("--grouping-windows", type=int, default=None,
                        help="calibration windows for head grouping (default: --calibration-windows)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0, help="smoke model's weights and tokens")
    parser.add_argument("--smoke", action="store_true", help="a tiny random mamba2 at tp 2: checks the script")
    parser.add_argument("--save-dir", default=None, help="also save the recovered checkpoint here")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "spd_accuracy",
                                                      "spd_recovery.json"))
    args = parser.parse_args()
    if args.grouping and args.group_heads:
        parser.error("--grouping reads a grouping, --group-heads chooses one: pass one of them")
    if args.save_grouping and not args.group_heads:
        parser.error("--save-grouping writes the grouping --group-heads chooses: add --group-heads")
    if args.smoke:
        args.model, args.tp = "mamba2", 2
        args.window, args.calibration_windows, args.heldout_windows, args.steps = 16, 4, 2, 3
        args.batch_size, args.eval_batch_size = 2, 2

    import torch
    import transformers

    import ssmshard
    from ssmshard import Plan, SimulatedMesh
    from ssmshard.eval import perplexity
    from ssmshard.spd_recovery import recover

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    model, streams = load_case_inputs(args.model, args)
    train = (args.train or default_train(model, args.drop[0])) if args.steps else []
    plan = Plan(tp=args.tp, drop_syncs=list(args.drop))
    program = ssmshard.capture(model, mode="forward")
    heldout = dict(window=args.window, batch_size=args.eval_batch_size, max_windows=args.heldout_windows)

    def heldout_perplexity(fn) -> float:
        return perplexity(fn, streams["heldout"], **heldout).perplexity

    rows = {"eager": heldout_perplexity(lambda ids: model(ids).logits),
            "tp": heldout_perplexity(SimulatedMesh(model, Plan(tp=args.tp), program=program)),
            "spd_before": heldout_perplexity(SimulatedMesh(model, plan, program=program))}
    print(f"held-out: eager {rows['eager']:.3f}, exact tp {rows['tp']:.3f}, spd before {rows['spd_before']:.3f}",
          flush=True)
    grouping = None
    if args.group_heads:
        from ssmshard.head_grouping import group_heads

        if len(args.drop) != 1:
            raise SystemExit("--group-heads groups the block of one dropped sync point: pass one --drop")
        grouped_at = time.perf_counter()
        grouping = group_heads(model, args.tp, args.drop[0], streams["calibration"], window=args.window,
                               batch_size=args.eval_batch_size,
                               max_windows=args.grouping_windows or args.calibration_windows)
        grouping_s = time.perf_counter() - grouped_at
        program = ssmshard.capture(model, mode="forward")
        rows["grouped_eager"] = heldout_perplexity(lambda ids: model(ids).logits)
        rows["spd_grouped"] = heldout_perplexity(SimulatedMesh(model, plan, program=program))
        held = grouping.assignment if len(grouping.head_permutation) <= 16 else "(in the JSON)"
        print(f"head grouping ({grouping.search}, {grouping.tokens} calibration tokens, {grouping_s:.1f} s): ranks hold "
              f"{grouping.unit}s {held}; calibration SPD error sum_i |P - P_i|^2 / |P|^2 "
              f"{grouping.error_before:.4f} -> {grouping.error_after:.4f}", flush=True)
        print(f"held-out: grouped eager {rows['grouped_eager']:.3f}, spd grouped {rows['spd_grouped']:.3f}", flush=True)
        if args.save_grouping:
            with open(args.save_grouping, "w") as f:
                json.dump([grouping.as_dict()], f, indent=1)
            print(f"wrote {args.save_grouping}")
    if args.grouping:
        from ssmshard.head_grouping import permute_heads

        with open(args.grouping) as f:
            saved = json.load(f)
        carried = dataclasses.replace(plan, head_permutations=saved)  # PlanError for a grouping of another tp
        rows["tp_grouped"] = heldout_perplexity(SimulatedMesh(model, Plan(tp=args.tp, head_permutations=saved),
                                                              program=program))
        rows["spd_grouped"] = heldout_perplexity(SimulatedMesh(model, carried, program=program))
        print(f"held-out with the plan carrying {args.grouping}: exact tp {rows['tp_grouped']:.3f}, spd grouped "
              f"{rows['spd_grouped']:.3f}", flush=True)
        grouping = saved
        if args.steps:  # recover trains the model's own weights: the grouping goes into them
            for point, permutation in carried.head_permutations.items():
                permute_heads(model, point, permutation)
    result, train_s = None, 0.0
    if args.steps:
        trained_at = time.perf_counter()
        result = recover(model, plan, streams["calibration"], train=train, window=args.window,
                         batch_size=args.batch_size, max_windows=args.calibration_windows, steps=args.steps,
                         lr=args.lr)
        train_s = time.perf_counter() - trained_at
        rows["spd_after"] = heldout_perplexity(SimulatedMesh(model, plan,
                                                             program=ssmshard.capture(model, mode="forward")))
        print(f"held-out: spd after {rows['spd_after']:.3f}; calibration KL {result.kl_before:.4f} -> "
              f"{result.kl_after:.4f} ({result.trained_numel} weights trained in {train_s:.0f} s)", flush=True)
    if args.save_dir:
        model.save_pretrained(args.save_dir)
        print(f"wrote {args.save_dir}")

    exact = rows["tp"]
    out = {"device": "CPU (SimulatedMesh, fp32)",
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "command": " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
           "machine": {"cpu_count": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                       "transformers": transformers.__version__},
           "args": vars(args), "model": args.model, "tp": args.tp, "drop_syncs": list(args.drop),
           "heldout": {"windows": args.heldout_windows, "window": args.window,
                       "perplexity": rows, "relative_change_vs_tp": {k: v / exact - 1 for k, v in rows.items()}},
           "head_grouping": grouping.as_dict() if hasattr(grouping, "as_dict") else grouping,
           "recovery": result.as_dict() if result else None, "train_s": train_s,
           "wall_s": time.perf_counter() - started}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")
    if result:
        plot_losses(os.path.splitext(args.out)[0] + ".png", result.losses,
                    f"{args.model} tp={args.tp}, {' '.join(args.drop)} dropped: training {' '.join(train)}")


if __name__ == "__main__":
    main()
