"""The mugraph IR: dtypes, tensor types, the operator registry, graphs at three levels, validation."""
from mdsl.ir.dtypes import DTYPES, DType, bf16, f16, f32, i32
from mdsl.ir.graph import BlockGraph, BlockInput, BlockOutput, KernelGraph, Node, ThreadGraph, structural_key
from mdsl.ir.ops import BLOCK, KERNEL, OPS, THREAD, OpDef, get_op
from mdsl.ir.types import TensorType, Var
from mdsl.ir.validate import SMEM_LIMIT_BYTES, validate_block_graph, validate_kernel_graph

__all__ = [
    "DTYPES", "DType", "bf16", "f16", "f32", "i32", "BlockGraph", "BlockInput", "BlockOutput", "KernelGraph",
    "Node", "ThreadGraph", "structural_key", "BLOCK", "KERNEL", "OPS", "THREAD", "OpDef", "get_op",
    "TensorType", "Var", "SMEM_LIMIT_BYTES", "validate_block_graph", "validate_kernel_graph",
]
