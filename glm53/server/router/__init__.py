"""The router program: the OpenAI-compatible HTTP API, instance pairing and health, metrics."""
