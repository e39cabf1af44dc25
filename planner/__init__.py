"""The memory planner: device memory of a training step or an inference forward, estimated on any machine (fake
tensors) and measured beside it with CUDA, and the decisions taken from it. Built on the engine's step."""
