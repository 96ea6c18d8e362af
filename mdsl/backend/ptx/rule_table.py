"""The PTX backend's rule table: operator name -> its `PtxRule`, filled by `mdsl.backend.ptx.rules` (which
the package imports, so importing the backend is all it takes). The code that calls the rules (the
kernels, the block lowering, the element loops) reads them here."""
from __future__ import annotations

from mdsl.ir.rules import RuleTable
from mdsl.lowering.program import rule_methods


class PtxRule:
    """An operator's PTX rule, with the methods its operator's levels call for
    (`mdsl.lowering.program.rule_methods`):

    * `kernel(program, index, node)` writes the kernel of a kernel-level node (or records an alias);
    * `block(bk, node)` writes a block-level node's code on shared-memory tiles (bk: `block.BlockKernel`);
    * accumulators have `init(bk, node)`, `update(bk, node)` (once per loop iteration) and `finalize`
      (a method, or None when the running value is already the result); those the lowering may keep in
      a matmul's mma fragments have `fold_product(bk, node, mma, running, multiply)`;
    * `value(fn, node, args)` gives an element-wise op's f32 value from its operands' f32 values.
    """


PTX_RULES: RuleTable[PtxRule] = RuleTable("PTX backend", PtxRule, "mdsl.backend.ptx.rules (PTX_RULES)",
                                          needs=lambda op: True, provides=lambda op: rule_methods(op, "value"))
