"""Tensor, sequence and expert parallelism wired onto the model."""
