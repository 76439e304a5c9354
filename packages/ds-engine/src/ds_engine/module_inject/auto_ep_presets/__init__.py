"""`deepspeed.module_inject.auto_ep_presets`: DeepSpeed's package of AutoEP presets; `registry` holds them."""
