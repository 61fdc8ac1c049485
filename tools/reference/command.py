"""``python -m sdopt train-reference``: train a reference model or the attribute classifier, and say
what was written (the weights, their sha256, the loss curve)."""
from __future__ import annotations

import argparse
import os
from dataclasses import replace
from pathlib import Path

from ...families import MODEL_NAMES, checkpoint_config

# What the command trains: the reference models, and the classifier that reads their images.
TRAINABLE = tuple(name for name in MODEL_NAMES if checkpoint_config(name).trained) + ("classifier",)


def add_train_reference(commands) -> None:
    """The ``train-reference`` subcommand, on the CLI's subparsers."""
    train = commands.add_parser("train-reference", help=(
        "train a reference model on the procedural scenes (CPU, about 30 minutes), or the attribute classifier "
        "that reads their images; writes the weights sdopt ships"))
    train.add_argument("model", choices=TRAINABLE)
    train.add_argument("--steps", type=int, help="optimizer steps (default: what the shipped weights were trained with)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--out", type=Path, help="the weights file (default: the shipped one, under tools/reference/weights)")
    train.add_argument("--plot", type=Path, help="the loss curve PNG (default: docs/train_<model>.png)")
    train.add_argument("--comfyui", type=Path, default=os.environ.get("COMFYUI_PATH"), help="default: $COMFYUI_PATH")
    train.set_defaults(handler=train_command)


def train_command(args: argparse.Namespace) -> None:
    if args.model == "classifier":
        from .classifier import WEIGHTS, train_classifier

        out = args.out or WEIGHTS
        result = train_classifier(out, **({"steps": args.steps} if args.steps else {}), seed=args.seed)
        clean = ", ".join(f"{name} {share:.1%}" for name, share in result["clean"].items())
        print(f"wrote {out} (sha256 {result['sha256']}) in {result['train_seconds']:.0f} s; held-out accuracy: {clean}")
        return
    from ..headless import boot
    from .train import TRAINING, describe, plot_losses, train_reference

    boot(args.comfyui)
    config = replace(TRAINING[args.model], **({"steps": args.steps} if args.steps else {}), seed=args.seed)
    result = train_reference(args.model, config, weights=args.out)
    plot = plot_losses(result, args.plot or Path("docs") / f"train_{args.model.replace('-', '_')}.png")
    print(describe(result))
    print(f"wrote {plot}: the loss curve")
