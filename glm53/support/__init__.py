"""Support code for tests, benchmarks and tools — not used by the server.

What `tests/`, `benchmarks/` and `tools/` share lives here, so that each of them imports only
`glm53.*` (and tests their own small helpers) instead of one another: launching a real
`glm53-serve up` deployment, free ports, reference (oracle) checkpoints and greedy outputs, the
PD harness, the chaos driver, the GLM-5 slice, the corpus and draft-training pieces, and the
benchmark helpers a test or tool reuses. Nothing under `glm53/server`, `glm53/models`,
`glm53/transport` or `glm53/kernels` imports this package (tests/test_import_graph.py).

Some modules need test-only dependencies (`transformers` in `oracle`): they import them inside
the functions that use them, so importing any module here needs only the server's dependencies.
"""
