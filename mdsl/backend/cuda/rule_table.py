"""The CUDA backend's rule table: operator name -> its `CudaRule`, filled by `mdsl.backend.cuda.rules`
(which the package imports, so importing the backend is all it takes). The code that calls the rules
(the kernels, the block lowering, the element loops) reads them here."""
from __future__ import annotations

from mdsl.ir.rules import RuleTable
from mdsl.lowering.program import rule_methods


class CudaRule:
    """An operator's CUDA rule, with the methods its operator's levels call for
    (`mdsl.lowering.program.rule_methods`):

    * `kernel(program, index, node)` writes the `__global__` function of a kernel-level node (or records
      an alias for a view);
    * `block(b, node)` writes a block-level node's code on shared-memory tiles (b: `block.BlockKernel`);
    * accumulators have `init(b, node)`, `update(b, node)` (once per loop iteration) and `finalize`
      (a method, or None when the running value is already the result); those the lowering may keep in
      a matmul's mma fragments have `fold_product(b, node, shape, running, multiply)`;
    * `expr(node, args)` gives an element-wise op's value as a C expression of its operands' f32
      registers, for thread graphs (and every element-wise loop).
    """


CUDA_RULES: RuleTable[CudaRule] = RuleTable("CUDA backend", CudaRule, "mdsl.backend.cuda.rules (CUDA_RULES)",
                                            needs=lambda op: True, provides=lambda op: rule_methods(op, "expr"))
