"""Importing ds_zero has no side effects: no CUDA init, no optional or undeclared siblings loaded, and it
stays cheap: the stages, the checkpoint tools and the config models load when first touched."""

from __future__ import annotations

from ds_comm.testing import import_side_effects

ALLOWED = {"ds_zero", "ds_comm", "ds_ops"}
# What `import ds_zero` must not load (any of these alone costs tens of ms beyond torch): pydantic and the
# config models, Hugging Face, the ops and comm packages, and ds-zero's own stage / checkpoint layers.
HEAVY = (
    "pydantic",
    "transformers",
    "ds_comm",
    "ds_ops",
    "ds_zero.config",
    "ds_zero._stage12",
    "ds_zero._stage3",
    "ds_zero._checkpoint",
    "ds_zero._construct",
    "ds_zero._memory_estimate",
)
#: Modules `import ds_zero` may load beyond torch (now 2: the package and its `__about__`).
MODULE_BUDGET = 8


def _loaded(report: dict, prefixes: tuple[str, ...]) -> list[str]:
    return [m for m in report["new_modules"] if any(m == p or m.startswith(p + ".") for p in prefixes)]


def test_import_loads_only_declared_siblings_and_not_cuda() -> None:
    report = import_side_effects("ds_zero")
    assert not report["cuda_initialized"]
    assert set(report["ds_modules"]) <= ALLOWED, report["ds_modules"]
    # pydantic alone costs ~0.3 s to import (the whole import-time budget); config models load on first use.
    assert not report["pydantic_loaded"], "importing the package pulled in pydantic"
    # The import-cost guard, as a fact about what loaded (a timing would flake on a shared machine).
    assert not _loaded(report, HEAVY), f"`import ds_zero` loaded heavy modules: {_loaded(report, HEAVY)}"
    assert len(report["new_modules"]) <= MODULE_BUDGET, (
        f"`import ds_zero` loaded {len(report['new_modules'])} modules beyond torch (budget {MODULE_BUDGET}); "
        f"serve new public names lazily (`_LAZY_NAMES` in ds_zero/__init__.py): {report['new_modules']}"
    )


def test_lazy_public_names_resolve() -> None:
    """Every name in `__all__` resolves (through the lazy table) to the object its defining module holds."""
    import ds_zero
    from ds_zero._params.param_dict import ZeroParamDict
    from ds_zero._stage3.optimizer import DeepSpeedZeroOptimizer_Stage3

    for name in ds_zero.__all__:
        assert getattr(ds_zero, name) is not None, name
    assert ds_zero.DeepSpeedZeroOptimizer_Stage3 is DeepSpeedZeroOptimizer_Stage3
    assert ds_zero.ZeROOrderedDict is ZeroParamDict
    assert set(ds_zero.__all__) <= set(dir(ds_zero))
