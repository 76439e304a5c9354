"""`deepspeed.runtime.sequence_parallel`: `.ulysses_sp` (ALST) and `.parallel_state_sp`, from ds-parallel.

The submodules need the `parallel` extra (`pip install 'ds-engine[parallel]'`).
"""
