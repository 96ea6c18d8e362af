"""The megakernel half of mdsl: model graphs (`@mdsl.model`), Hugging Face checkpoints, the task graph
(tasks and events), its CPU simulator and the numpy reference forward. The GPU runtime lives in
`mdsl.megakernel.runtime`."""
from mdsl.megakernel.architectures import llama3_decode, qwen3_decode, sampling_decode, step_function
from mdsl.megakernel.checkpoint import LoadedModel, load_model, load_weights
from mdsl.megakernel.config import ModelConfig, RopeConfig, config_from_dict, load_config
from mdsl.megakernel.layers import LAYER_OPS, StepContext, extend_layer_op, get_layer_op
from mdsl.megakernel.fusion import fuse
from mdsl.megakernel.model import (LayerNode, ModelBuilder, ModelFunction, ModelGraph, model, parse_model_graph,
                                   print_model_graph)
from mdsl.megakernel.partition import build_task_graph
from mdsl.megakernel.taskgraph import Buffer, Event, PartitionConfig, Region, Task, TaskGraph, Wait, without_implied_waits
from mdsl.megakernel.tensor_parallel import TensorParallelPlan, load_rank_weights, tensor_parallel

__all__ = [
    "LoadedModel", "load_model", "load_weights", "llama3_decode", "qwen3_decode", "sampling_decode", "step_function", "ModelConfig", "RopeConfig",
    "config_from_dict", "load_config", "LAYER_OPS", "StepContext", "extend_layer_op", "get_layer_op", "LayerNode",
    "ModelBuilder", "ModelFunction", "ModelGraph", "model", "build_task_graph", "Buffer", "Event",
    "PartitionConfig", "Region", "Task", "TaskGraph", "Wait", "fuse", "parse_model_graph", "print_model_graph",
    "without_implied_waits", "TensorParallelPlan", "load_rank_weights", "tensor_parallel",
]
