"""`init_inference()` built on ds-engine's inference engine."""
