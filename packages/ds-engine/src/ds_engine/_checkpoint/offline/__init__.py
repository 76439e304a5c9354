"""Checkpoint readers and reshape maps that need no engine: DeepSpeed's checkpoint folders, universal steps."""
