"""Pure policy code: no I/O, no clock reads. Time is passed in as ``now_ms`` arguments.

The same modules run inside the agent, the router, the simulated engine, the vLLM scheduler
plugin and the tests.
"""
