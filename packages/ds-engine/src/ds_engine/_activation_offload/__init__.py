"""Activation offload for checkpointed layers: hidden states to host memory between forward and backward."""
