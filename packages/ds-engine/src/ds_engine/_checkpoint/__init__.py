"""Save and load: ds and DeepSpeed layouts, universal, TP/MoE state, the atomic directory swap."""
