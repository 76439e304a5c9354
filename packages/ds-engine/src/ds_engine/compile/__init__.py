"""`deepspeed.compile`, DeepSpeed's module path: DeepCompile's pass names and contracts (`passes`).

ds's DeepCompile itself is `engine.compile()` with `compile.deepcompile: true` (ds-engine's
`_engine/compile.py` over ds-zero's `_compile`); this package holds only DeepSpeed's public pass
modules, so that schedules written against DeepSpeed (`engine.compile(schedule=[(0, [add_z3_gather_release])])`)
import and validate under ds. See COMPATIBILITY.md for DeepSpeed's other `deepspeed.compile` modules.
"""
