"""The ext_proc protocol core: events, codec, the sans-IO processor (no gRPC, no asyncio)."""
