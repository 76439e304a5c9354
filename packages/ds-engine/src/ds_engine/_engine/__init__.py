"""DeepSpeedEngine and its faces: queries, DeepSpeed getters, offload_states, compile, consolidated weights."""
