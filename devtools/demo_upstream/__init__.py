"""Demo upstream: a mock OpenAI-compatible LLM server for tests and benchmarks.

Run with ``python -m devtools.demo_upstream --port P --name NAME [options]``.
It paces tokens like a real model (time to first token, tokens per second),
queues requests beyond a fixed number of batch slots, injects failures on
demand, exports vLLM-named Prometheus metrics and has /admin endpoints so
tests can reconfigure it live and see what a gateway forwarded.
"""
