"""The megakernel half of mdsl, in four packages that data flows through one way: model graphs
(`modelgraph`: `@mdsl.model`, Hugging Face configs and checkpoints, the numpy reference forward), the task
graph (`taskgraph`: tiles and events, the fusion pass, numpy task bodies, the CPU simulator), the GPU
runtime (`runtime`: task tables, the generated CUDA, the host engine) and, beside them, tensor parallelism
(`parallel`). `generate_cli` is `mdsl generate`. This module hands on the model-graph and task-graph API."""
from mdsl.megakernel.modelgraph.architectures import llama3_decode, qwen3_decode, sampling_decode, step_function
from mdsl.megakernel.modelgraph.checkpoint import LoadedModel, load_model, load_weights
from mdsl.megakernel.modelgraph.layers import LAYER_OPS, StepContext, get_layer_op
from mdsl.megakernel.modelgraph.model import (LayerNode, ModelBuilder, ModelFunction, ModelGraph, model,
                                              parse_model_graph, print_model_graph)
from mdsl.megakernel.modelgraph.model_config import ModelConfig, RopeConfig, config_from_dict, load_config
from mdsl.megakernel.parallel.tensor_parallel import TensorParallelPlan, load_rank_weights, tensor_parallel
from mdsl.megakernel.taskgraph.layer_fusion import fuse
from mdsl.megakernel.taskgraph.partition import build_task_graph
from mdsl.megakernel.taskgraph.tasks import (Buffer, Event, PartitionConfig, Region, Task, TaskGraph, Wait,
                                             without_implied_waits)

__all__ = [
    "LoadedModel", "load_model", "load_weights", "llama3_decode", "qwen3_decode", "sampling_decode", "step_function",
    "ModelConfig", "RopeConfig", "config_from_dict", "load_config", "LAYER_OPS", "StepContext", "get_layer_op",
    "LayerNode", "ModelBuilder", "ModelFunction", "ModelGraph", "model", "build_task_graph", "Buffer",
    "Event", "PartitionConfig", "Region", "Task", "TaskGraph", "Wait", "fuse", "parse_model_graph",
    "print_model_graph", "without_implied_waits", "TensorParallelPlan", "load_rank_weights", "tensor_parallel",
]
