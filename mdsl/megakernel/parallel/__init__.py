"""Tensor parallelism: a model graph split over the GPUs of one host (tensor_parallel), the communication
layer ops (collectives), the CPU simulator of the ranks (tp_simulator), and on the GPUs one process per rank
driven as a group (gpu_group) over NVSHMEM's host library (nvshmem)."""
