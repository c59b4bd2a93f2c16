"""Client side of each method: one module per method, each with a ``HANDLERS`` dict."""
