"""The state around a graph: parameters, buffers, tensor attributes and optimizer state
followed by address and identity (``state``), and the optimizers and gradients a training
step bakes in (``training``).
"""
