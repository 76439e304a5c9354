"""Importing ds_engine has no side effects: no CUDA init, no optional or undeclared siblings loaded, and it
stays cheap: the engine, the config models and the ops load when a script first touches them."""

from __future__ import annotations

from ds_comm.testing import import_side_effects

ALLOWED = {"ds_engine", "ds_comm", "ds_ops"}
# What `import ds_engine` must not load (any of these alone costs tens of ms beyond torch, and a plain
# import stayed under 50 ms only while none of them loaded): the config models and pydantic, Hugging Face,
# the engine, checkpoint and step layers, and the siblings (served with the names that need them).
HEAVY = (
    "pydantic",
    "transformers",
    "ds_comm",
    "ds_ops",
    "ds_zero",
    "ds_pipe",
    "ds_parallel",
    "ds_engine.config",
    "ds_engine._engine",
    "ds_engine._checkpoint",
    "ds_engine._setup",
    "ds_engine._step",
    "ds_engine.runtime",
)
#: Modules `import ds_engine` may load beyond torch (now 2: the package and its `__about__`).
MODULE_BUDGET = 8


def _loaded(report: dict, prefixes: tuple[str, ...]) -> list[str]:
    return [m for m in report["new_modules"] if any(m == p or m.startswith(p + ".") for p in prefixes)]


def test_import_loads_only_declared_siblings_and_not_cuda() -> None:
    report = import_side_effects("ds_engine")
    assert not report["cuda_initialized"]
    assert set(report["ds_modules"]) <= ALLOWED, report["ds_modules"]
    # pydantic alone costs ~0.3 s to import (the whole import-time budget); config models load on first use.
    assert not report["pydantic_loaded"], "importing the package pulled in pydantic"
    # The import-cost guard, as a fact about what loaded (a timing would flake on a shared machine).
    assert not _loaded(report, HEAVY), f"`import ds_engine` loaded heavy modules: {_loaded(report, HEAVY)}"
    assert len(report["new_modules"]) <= MODULE_BUDGET, (
        f"`import ds_engine` loaded {len(report['new_modules'])} modules beyond torch (budget {MODULE_BUDGET}); "
        f"serve new public names lazily (`_LAZY_NAMES` in ds_engine/__init__.py): {report['new_modules']}"
    )


def test_lazy_public_names_resolve() -> None:
    """Every name in `__all__` resolves (through the lazy table) to the object its defining module holds."""
    import ds_engine
    from ds_engine._engine.engine import DeepSpeedEngine
    from ds_engine._setup.initialize import initialize

    for name in ds_engine.__all__:
        assert getattr(ds_engine, name) is not None, name
    assert ds_engine.initialize is initialize
    assert ds_engine.DeepSpeedEngine is DeepSpeedEngine
    assert ds_engine.__git_hash__ == ds_engine.git_hash
    assert set(ds_engine.__all__) <= set(dir(ds_engine))
