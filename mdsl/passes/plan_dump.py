"""Dumps of the plans that lowering passes compute beside the IR (schedule, layout, memory).

`mdsl.ir.dump.dump_ir` prints graphs; a plan is not one, so its text follows the same switch:
`MDSL_DUMP_IR=1` prints it to stderr under `// ----- <stage> plan -----`, `MDSL_DUMP_IR=<dir>`
appends it to `<dir>/plans.txt` (one file, in call order, next to the numbered IR files).
"""
from __future__ import annotations

import os
import sys


def dump_plan(stage: str, plan) -> None:
    target = os.environ.get("MDSL_DUMP_IR")
    if not target or target == "0":
        return
    text = f"// ----- {stage} plan -----\n{plan}\n"
    if target == "1":
        sys.stderr.write(text)
        return
    os.makedirs(target, exist_ok=True)
    with open(os.path.join(target, "plans.txt"), "a", encoding="utf-8") as f:
        f.write(text)
