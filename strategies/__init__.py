"""Server side of each method: one module per method, each with ``build_strategy(cfg, recorder)``."""
