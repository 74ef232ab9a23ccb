"""The KV cache: how keys and values are stored (types, codecs, q4 key tiles), which positions
are kept (a growing context, or a ring with sinks), and what it costs."""
