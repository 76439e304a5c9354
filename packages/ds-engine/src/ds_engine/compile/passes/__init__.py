"""`deepspeed.compile.passes`, DeepSpeed's module path: its built-in passes' names, contracts and callables.

Each submodule re-exports what DeepSpeed 0.19.8's module of the same name makes public about its pass
(`NAME`, `CONTRACT`, the pass callable a schedule may list); the contract model is `contract`. What each
pass does in ds is described in `ds_engine._plan.compile_schedule`.
"""
