"""The reference backend: a numpy interpreter for kernel, block and thread graphs."""
from mdsl.backend.reference.interpreter import run_block_graph, run_kernel_graph, run_thread_graph

__all__ = ["run_block_graph", "run_kernel_graph", "run_thread_graph"]
