"""DeepSpeed: one module per modelled version (v0_19), its JSON config reader and
the shared-memory segments its CPU all-reduce leaves."""
