"""Tensor parallelism: the rank's view of its group and how weights are cut (the worker processes that run the
other ranks live with the engine that drives them: engine/workers.py)."""
