"""Parallel dimensions: the degrees of a layout (dims) and what tensor, context, pipeline and
expert parallelism each do to one rank's model, activations and buffers."""
