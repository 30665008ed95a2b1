"""Tensor parallelism: the rank's view of its group, how weights are cut, and the worker processes."""
