"""The ``plan`` command: a plan's tables and JSON, or with ``--check`` the predictions against real runs."""
from __future__ import annotations

import json

import torch

from ...errors import UserError
from .check import CHECK_CASES, check_predictions, check_table
from ...measure.memory_model import parse_bytes
from .planner import make_plan, plan_table

DEFAULT_MODEL = "mini"


def run_plan(args) -> None:
    """The ``plan`` command: print the tables, write the JSON with ``--json``; with ``--check``, the
    predictions of ``CHECK_CASES`` (those of ``--model`` where it is given) against real runs instead."""
    if args.check:
        if args.repeats < 1:
            raise UserError(f"--repeats must be at least 1, not {args.repeats}")
        cases = [case for case in CHECK_CASES if case[2] <= args.max_size and args.model in (None, case[0])]
        if args.model is not None and not any(case[0] == args.model for case in CHECK_CASES):
            raise UserError(f"--check --model {args.model!r}: the checked models are "
                            f"{', '.join(dict.fromkeys(case[0] for case in CHECK_CASES))}")
        if not cases:
            smallest = min(case[2] for case in CHECK_CASES if args.model in (None, case[0]))
            raise UserError(f"--max-size {args.max_size}: it leaves out every case; the smallest checked size is {smallest}")
        if args.workspace == "cuda" and not torch.cuda.is_available():
            raise UserError("--check --workspace cuda measures on a GPU, and torch sees none here; "
                            "leave --workspace out to check the CPU model on this CPU")
        rows = check_predictions(cases, args.repeats, args.dtype, args.workspace)
        print(check_table(rows))
        if args.json:
            args.json.write_text(json.dumps([r.to_dict() for r in rows], indent=2))
        return
    budget = parse_bytes(args.budget, "--budget")
    plan = make_plan(args.model or DEFAULT_MODEL, args.width, args.height, budget, dtype=args.dtype, workspace=args.workspace,
                     search=not args.no_search)
    print(plan_table(plan))
    if args.json:
        args.json.write_text(json.dumps(plan.to_dict(), indent=2))
        print(f"wrote {args.json}")
