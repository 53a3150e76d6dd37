"""Attention kinds, one module each (base: the interface and the GQA family; mla), and
the table that answers kind_of(spec)."""
