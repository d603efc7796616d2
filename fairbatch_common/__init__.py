"""Code both processes need: the router (router/) and the replica agent (replica_agent/) import it.

Clock, asyncio helpers, the HTTP/1.1 upstream pool, both servers' edge (body guards, error
middleware), OpenAI request validation, errors and stream parsing, telemetry, logging and process
entry helpers, the shared Prometheus registry, the stall rule and the YAML config schema.
Layering (docs/architecture.md "Layout"; tests/unit/test_import_layers.py): this package imports
nothing from router/, replica_agent/ or loadgen/.
"""
