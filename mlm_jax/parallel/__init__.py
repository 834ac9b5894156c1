"""Parallelism: the rules table, mesh and shardings, the explicit-collective kernels of context and expert
parallelism, and the pipeline (schedules, stages with the chunk runner, the executor)."""
