"""Memory: the orchestrator that resolves a request and composes the phases, and what
the phases are made of (buffers, typed moments, a rank's activations)."""
