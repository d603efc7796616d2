"""Placement filters, one per module; each module names its class ``PLUGIN`` (router/placement/registry.py)."""
