"""`recursive_getattr` / `recursive_setattr` (`deepspeed.utils.module_utils`, and the deprecated
`deepspeed.compression.helper`): a model's attributes by the dotted names `named_modules()` prints."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap

import pytest
import torch

from ds_engine.utils.module_utils import recursive_getattr, recursive_setattr


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = [torch.nn.ModuleDict({"fc1": torch.nn.Linear(4, 8), "fc2": torch.nn.Linear(8, 4)}) for _ in range(2)]
    return torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.ModuleList(blocks))


def test_getattr_reaches_every_named_module_and_parameter() -> None:
    model = _model()
    for name, module in model.named_modules():
        if name:
            assert recursive_getattr(model, name) is module
    for name, param in model.named_parameters():
        assert recursive_getattr(model, name) is param
    assert recursive_getattr(model, "1.0.fc1.in_features") == 4  # plain attributes too


class _Doubled(torch.nn.Module):
    def __init__(self, inner: torch.nn.Linear) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * self.inner(x)


def test_setattr_replaces_the_layer_as_a_registered_child() -> None:
    model = _model()
    tokens = torch.tensor([[1, 2, 3]])
    old = recursive_getattr(model, "1.0.fc2")
    before = model[1][0]["fc2"](model[1][0]["fc1"](model[0](tokens)))

    recursive_setattr(model, "1.0.fc2", _Doubled(old))

    replaced = recursive_getattr(model, "1.0.fc2")
    assert isinstance(replaced, _Doubled) and replaced.inner is old
    assert dict(model.named_modules())["1.0.fc2"] is replaced  # registered, not a plain attribute
    assert "1.0.fc2.inner.weight" in dict(model.named_parameters())
    after = model[1][0]["fc2"](model[1][0]["fc1"](model[0](tokens)))
    torch.testing.assert_close(after, 2 * before)


def test_setattr_a_parameter_registers_it() -> None:
    model = _model()
    new = torch.nn.Parameter(torch.zeros(4))
    recursive_setattr(model, "1.1.fc2.bias", new)
    assert dict(model.named_parameters())["1.1.fc2.bias"] is new


def test_missing_part_names_it_and_the_path() -> None:
    model = _model()
    with pytest.raises(AttributeError, match=r"'1\.0'.*'fc9'.*'1\.0\.fc9\.weight'"):
        recursive_getattr(model, "1.0.fc9.weight")
    with pytest.raises(AttributeError, match=r"'nope'"):
        recursive_setattr(model, "nope.fc1", torch.nn.Identity())


def test_utils_exports_the_same_functions() -> None:
    import ds_engine.utils as utils

    assert utils.recursive_getattr is recursive_getattr and utils.recursive_setattr is recursive_setattr
    assert utils.module_utils is importlib.import_module("ds_engine.utils.module_utils")


def test_compression_helper_is_deprecated_and_gives_the_same_functions() -> None:
    # A fresh interpreter: the warning is raised once, at the first import.
    code = textwrap.dedent(
        """
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            from ds_engine.compression.helper import recursive_getattr, recursive_setattr
        import ds_engine.utils.module_utils as mu
        assert recursive_getattr is mu.recursive_getattr and recursive_setattr is mu.recursive_setattr
        future = [w for w in caught if issubclass(w.category, FutureWarning)]
        assert len(future) == 1, [str(w.message) for w in caught]
        assert "deepspeed.utils.module_utils" in str(future[0].message)
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
