"""`deepspeed.compile.passes.contract`, DeepSpeed's module path: ds's own module under it.

The code lives in `ds_engine._plan.pass_contracts` (`PassContract`, `PassContractError`, the process-wide
`_pass_contracts` registry, `register_pass_contract`, `get_pass_contract`, `validate_schedule`); both
names are one module object (`_reexport.alias_module`).
"""

from typing import TYPE_CHECKING

from ds_engine._reexport import alias_module

if TYPE_CHECKING:
    from ds_engine._plan.pass_contracts import *  # noqa: F403

alias_module(__name__, "ds_engine._plan.pass_contracts")
