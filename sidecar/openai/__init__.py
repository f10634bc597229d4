"""The OpenAI-style API as the sidecar reads it: chat requests, server-sent events."""
