"""The cluster: the GPU catalogue, node wiring (presets, parsed `nvidia-smi topo -m`)."""
