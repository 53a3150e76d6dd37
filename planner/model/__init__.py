"""The model: an architecture as a list of layer specs (read from a config or the catalogue),
its parameter counts and the activations autograd saves."""
