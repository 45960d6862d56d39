"""Hydra configs: one YAML per choice."""
