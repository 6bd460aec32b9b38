"""Models: loading checkpoints safely, the per-architecture tables, the adapter and head inventory,
exact SSM patterns, and the one hook mechanism. Importing this package stays cheap (no torch)."""

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
"""Weight files that unpickle (and so can run code) when loaded: refused unless allowed."""
