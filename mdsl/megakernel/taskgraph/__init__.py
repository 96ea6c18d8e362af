"""The task graph: tasks, buffers and events (tasks), a model graph cut into tiles (partition), the layer-op
fusion pass that runs before it (layer_fusion), what each task computes in numpy (numpy_bodies) and the CPU
simulator that runs a task graph under the runtime's event semantics (simulator)."""
