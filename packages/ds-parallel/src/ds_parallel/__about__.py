"""Version of ds-parallel (hatch reads it; the only line a release bumps)."""

__version__ = "0.1.0"
