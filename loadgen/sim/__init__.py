"""vLLM-compatible simulated engine: same HTTP API and /metrics names as vLLM, step times from a
calibrated batch-time model, so a whole fleet runs on a CPU machine."""
