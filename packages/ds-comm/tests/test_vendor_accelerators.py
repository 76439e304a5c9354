"""DeepSpeed's per-device accelerator modules under ds_comm.accelerator: one `<NAME>_Accelerator` each,
every interface method implemented, the plugin imported only at construction, and DS_ACCELERATOR naming them."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from pathlib import Path

import pytest
import torch

from ds_comm import accelerator as acc
from ds_comm.accelerator._device_module import TorchDeviceAccelerator

MODULES = sorted(p.stem for p in Path(acc.__path__[0]).glob("*_accelerator.py"))
DEVICE_MODULES = [m for m in MODULES if m not in ("abstract_accelerator", "real_accelerator")]
# module -> (accelerator name, collective backend); xpu's backend depends on oneCCL's bindings
EXPECTED = {
    "cpu_accelerator": ("cpu", "gloo"),
    "cuda_accelerator": ("cuda", "nccl"),
    "hpu_accelerator": ("hpu", "hccl"),
    "klxpu_accelerator": ("klxpu", "nccl"),
    "mlu_accelerator": ("mlu", "cncl"),
    "mps_accelerator": ("mps", "gloo"),
    "npu_accelerator": ("npu", "hccl"),
    "sdaa_accelerator": ("sdaa", "tccl"),
    "supa_accelerator": ("supa", "bccl"),
    "xpu_accelerator": ("xpu", None),
}


def _accelerator_class(module_name: str) -> type[acc.Accelerator]:
    module = importlib.import_module(f"ds_comm.accelerator.{module_name}")
    names = [name for name in dir(module) if name.endswith("_Accelerator")]
    assert len(names) == 1, f"{module_name} defines {names}"
    return getattr(module, names[0])


def test_deepspeeds_device_modules_are_all_here() -> None:
    assert DEVICE_MODULES == sorted(EXPECTED)


@pytest.mark.parametrize("module_name", DEVICE_MODULES)
def test_each_module_has_one_concrete_accelerator(module_name: str) -> None:
    cls = _accelerator_class(module_name)
    assert issubclass(cls, acc.Accelerator) and not inspect.isabstract(cls)
    instance = object.__new__(cls)  # no device or plugin needed to look at the class
    name, backend = EXPECTED[module_name]
    assert instance.name == name
    if backend is not None and name not in ("cpu", "cuda", "klxpu"):
        assert instance.communication_backend_name() == backend


def test_klxpu_is_cuda_with_host_timers(monkeypatch: pytest.MonkeyPatch) -> None:
    cls = _accelerator_class("klxpu_accelerator")
    assert issubclass(cls, acc.CudaAccelerator)
    klxpu = cls()
    assert klxpu.communication_backend_name() == "nccl" and klxpu.is_triton_supported() is False
    monkeypatch.delenv("XPU_EVENT_KL3_ENABLE", raising=False)
    assert klxpu.use_host_timers() is True
    monkeypatch.setenv("XPU_EVENT_KL3_ENABLE", "1")
    assert klxpu.use_host_timers() is False


@pytest.mark.parametrize(
    ("module_name", "plugin"),
    [
        ("npu_accelerator", "torch_npu"),
        ("mlu_accelerator", "torch_mlu"),
        ("sdaa_accelerator", "torch_sdaa"),
        ("supa_accelerator", "torch_br"),
        ("hpu_accelerator", "habana_frameworks.torch"),
    ],
)
def test_a_missing_plugin_is_named_at_construction(module_name: str, plugin: str) -> None:
    if importlib.util.find_spec(plugin.split(".")[0]) is not None:
        pytest.skip(f"{plugin} is installed here")
    cls = _accelerator_class(module_name)
    with pytest.raises(ImportError, match=f"needs {plugin}: pip install"):
        cls()


def test_xpu_drives_torch_xpu() -> None:
    xpu = _accelerator_class("xpu_accelerator")()
    assert xpu.communication_backend_name() in ("xccl", "ccl")
    assert xpu.device_name() == "xpu" and xpu.device_name(2) == "xpu:2"
    assert xpu.device(1) == torch.device("xpu", 1)
    assert xpu.device_count() == torch.xpu.device_count()
    assert xpu.is_available() == torch.xpu.is_available()
    assert xpu.visible_devices_envs() == ["ZE_AFFINITY_MASK"]
    assert xpu.Stream is torch.xpu.Stream


def test_mps_is_one_device_without_fp64() -> None:
    mps = _accelerator_class("mps_accelerator")()
    assert mps.device_count() == 1 and mps.current_device() == 0 and mps.device(3) == torch.device("mps", 0)
    assert mps.is_fp64_supported() is False
    assert mps.is_bf16_supported() == (
        torch.backends.mps.is_available() and torch.backends.mps.is_macos_or_newer(14, 0)
    )


def test_a_torch_build_without_the_device_says_so() -> None:
    class Missing(TorchDeviceAccelerator):
        name = "no_such_device"

    missing = Missing()
    assert missing.is_available() is False
    with pytest.raises(RuntimeError, match="torch.no_such_device does not exist"):
        missing.device_count()


@pytest.mark.parametrize("name", ["xpu", "mps"])
def test_ds_accelerator_names_a_vendor_device(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DS_ACCELERATOR", name)
    acc.set_accelerator(None)
    try:
        if getattr(torch, name).is_available():
            assert acc.get_accelerator().name == name
        else:
            with pytest.raises(RuntimeError, match=f"DS_ACCELERATOR='{name}' was requested but no {name} device"):
                acc.get_accelerator()
    finally:
        acc.set_accelerator(None)


def test_supported_list_and_deepspeed_module_names() -> None:
    assert acc.SUPPORTED_ACCELERATOR_LIST == sorted(name for name, _ in EXPECTED.values())
    real = importlib.import_module("ds_comm.accelerator.real_accelerator")
    abstract = importlib.import_module("ds_comm.accelerator.abstract_accelerator")
    assert real.get_accelerator is acc.get_accelerator
    assert abstract.DeepSpeedAccelerator is acc.Accelerator
