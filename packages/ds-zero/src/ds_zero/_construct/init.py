"""`ds_zero.Init`: partition modules as they are constructed, so a model larger than one rank can be built.

[Note: how construction is intercepted]
Inside the context, the `__init__` of every `nn.Module` subclass (existing ones, and ones defined inside
the context via `__init_subclass__`) is wrapped. When the *outermost* `__init__` of an instance returns
(the module is fully built, including its own `reset_parameters()`), every parameter of that module and
its children that is not partitioned yet takes data-parallel rank 0's values (a broadcast, as in DeepSpeed)
and is partitioned: this rank keeps its 1/N shard and the full storage is released. So at most one
module's full parameters exist at a time, plus the shards.
`nn.Module.apply` is overridden too (`override_module_apply`, default on): `fn` runs on each module with
that module's own parameters gathered, and rank 0's result is re-partitioned to every rank, so
`model.apply(init_weights)` inside `__init__` works and gives the same weights on every rank. A module
built on the meta device (`torch.nn.utils.skip_init`) is partitioned after its `to_empty()` instead. Everything
is restored on exit; importing ds_zero patches nothing.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

import ds_comm
from ds_zero._construct.init_base import InsertPostInitMethodToModuleSubClasses
from ds_zero._construct.launcher_world import single_rank_group_error
from ds_zero._construct.quantized_init import install_quantized_wrappers, quantize_module_weights
from ds_zero._nvme.param_swapper import ParamSwapper
from ds_zero._params.gathered_parameters import GatheredParameters
from ds_zero._params.partitioned_module import partition_module
from ds_zero._params.partitioned_param import ZeroParamStatus, is_zero_param, shard_numel
from ds_zero._params.secondary import write_secondary
from ds_zero._zero_config import as_zero_config

if TYPE_CHECKING:
    from ds_zero.config import QuantizedInitializationConfig

logger = logging.getLogger(__name__)

__all__ = ["Init", "partition_model"]

_lock = threading.RLock()
_active: list[Init] = []
_constructing: list[nn.Module] = []
_saved_apply: list[Any] = []


def _subclasses(cls: type) -> Iterator[type]:
    seen: set[type] = set()
    todo = [cls]
    while todo:
        c = todo.pop()
        if c in seen:
            continue
        seen.add(c)
        yield c
        todo.extend(c.__subclasses__())


def _wrap_init(cls: type) -> None:
    orig = cls.__dict__.get("__init__")
    if orig is None or getattr(orig, "_ds_orig_init", None) is not None:
        return

    @functools.wraps(orig)
    def init(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        _constructing.append(self)
        try:
            orig(self, *args, **kwargs)
        finally:
            _constructing.pop()
        if _active and all(m is not self for m in _constructing):
            if any(p.is_meta for p in self.parameters(recurse=True) if not is_zero_param(p)):
                _partition_after_to_empty(self, _active[-1])
            else:
                _active[-1]._post_init_partition(self)

    init._ds_orig_init = orig  # type: ignore[attr-defined]
    cls.__init__ = init  # type: ignore[misc]


def _partition_after_to_empty(module: nn.Module, ctx: Init) -> None:
    """A module built on the meta device (`torch.nn.utils.skip_init`: `cls(..., device="meta").to_empty(device=d)`)
    has no values to partition yet: partition it, as DeepSpeed does, right after its `to_empty()` gives it storage
    (uninitialised, as skip_init promises; rank 0's, like every partitioned value)."""
    to_empty = module.to_empty

    @functools.wraps(to_empty)
    def partition_after(*args: Any, **kwargs: Any) -> nn.Module:
        del module.to_empty  # the instance attribute: the class's method again
        out = to_empty(*args, **kwargs)
        ctx._post_init_partition(module)
        return out

    module.to_empty = partition_after  # type: ignore[method-assign]


def _unwrap_init(cls: type) -> None:
    current = cls.__dict__.get("__init__")
    orig = getattr(current, "_ds_orig_init", None)
    if orig is not None:
        cls.__init__ = orig  # type: ignore[misc]


def _init_subclass(cls: type, **kwargs: Any) -> None:
    super(nn.Module, cls).__init_subclass__(**kwargs)
    _wrap_init(cls)


def _gathered_apply(self: nn.Module, fn: Any) -> nn.Module:
    for child in self.children():
        child.apply(fn)
    own = [p for p in self._parameters.values() if is_zero_param(p)]
    if own:
        with GatheredParameters(own, modifier_rank=0):
            fn(self)
    else:
        fn(self)
    return self


def _patch(override_apply: bool) -> None:
    for cls in _subclasses(nn.Module):
        _wrap_init(cls)
    nn.Module.__init_subclass__ = classmethod(_init_subclass)  # type: ignore[assignment]
    _saved_apply.append(nn.Module.apply)
    if override_apply:
        nn.Module.apply = _gathered_apply  # type: ignore[method-assign]


def _unpatch() -> None:
    for cls in _subclasses(nn.Module):
        _unwrap_init(cls)
    if "__init_subclass__" in nn.Module.__dict__:
        del nn.Module.__init_subclass__
    nn.Module.apply = _saved_apply.pop()  # type: ignore[method-assign]


def _load_config(config_dict_or_path: Any) -> dict[str, Any]:
    if config_dict_or_path is None:
        return {}
    if isinstance(config_dict_or_path, Mapping):
        return dict(config_dict_or_path)
    if isinstance(config_dict_or_path, (str, os.PathLike)):
        path = Path(config_dict_or_path)
        if not path.is_file():
            raise ValueError(
                f"ds_zero.Init(config_dict_or_path={str(path)!r}): no such file; pass a ds_config dict "
                "or the path of a JSON config"
            )
        return json.loads(path.read_text())
    raise TypeError(f"config_dict_or_path must be a dict or a path, got {type(config_dict_or_path).__name__}")


def _without_auto(value: Any) -> Any:
    """`value` with every `"auto"` dict entry removed, recursively (those keys take their defaults).

    Hugging Face builds the model inside `Init` before it knows the values that depend on the model
    (`reduce_bucket_size`, `stage3_prefetch_bucket_size`... stay `"auto"` until the Trainer starts);
    DeepSpeed reads such a config with those keys at their defaults. Init uses none of them itself.
    """
    if isinstance(value, Mapping):
        return {k: _without_auto(v) for k, v in value.items() if not (isinstance(v, str) and v == "auto")}
    return value


def _enabled(section: Any) -> bool:
    return isinstance(section, Mapping) and bool(section.get("enabled", False))


def config_dtype(ds_config: Mapping[str, Any]) -> torch.dtype | None:
    """The dtype a ds_config's fp16/bf16 switches train in: bf16, fp16, or None (fp32: parameters keep theirs).

    The bf16 section is `"bf16"` or its legacy name `"bfloat16"` (DeepSpeed's config reader takes either), so
    a config written with either trains in bf16.

    Raises:
        ValueError: both switches are on (DeepSpeed refuses this too), or both section names are given (the
            engine's config refuses that as well; DeepSpeed would silently prefer `"bf16"`).
    """
    if ds_config.get("bf16") is not None and ds_config.get("bfloat16") is not None:
        raise ValueError("both 'bfloat16' (the legacy name) and 'bf16' are in the config; keep only 'bf16'")
    bf16_key = "bf16" if ds_config.get("bf16") is not None else "bfloat16"
    bf16, fp16 = _enabled(ds_config.get(bf16_key)), _enabled(ds_config.get("fp16"))
    if bf16 and fp16:
        raise ValueError(f"{bf16_key}.enabled and fp16.enabled are both true in the config; enable one of them")
    return torch.bfloat16 if bf16 else torch.float16 if fp16 else None


def _quantized_initialization(ds_config: Mapping[str, Any]) -> QuantizedInitializationConfig | None:
    """The config's `weight_quantization.quantized_initialization` (None when absent or off)."""
    section = ds_config.get("weight_quantization")
    if section is None:
        return None
    from ds_zero.config import WeightQuantizationConfig  # pydantic: loaded on first use

    return ds_comm.validate_section(
        WeightQuantizationConfig, section, path="weight_quantization"
    ).quantized_initialization


class Init(InsertPostInitMethodToModuleSubClasses):
    """Partition parameters across the data-parallel ranks as modules are constructed (stage 3).

    Use as a context manager around model construction, or call with `module=` to partition a model
    that is already built::

        with ds_zero.Init(config_dict_or_path=ds_config):
            model = MyModel()          # each rank holds 1/N of every parameter from here on
        ds_zero.Init(module=model2)    # the same, after the fact

    Inside, `p.shape`/`p.numel()` stay the full values, `p.ds_tensor` is this rank's shard; the
    parameters are gathered by the stage-3 hooks (`DeepSpeedZeroOptimizer_Stage3`, `DeepSpeedZeRoOffload`)
    or `GatheredParameters`. Every rank must construct the same modules in the same order.

    Args:
        module: an already built model to partition now (the context is then not needed).
        data_parallel_group: the group parameters are split across (None: the world).
        remote_device: where shards live: None/"none" (the compute device), "cpu" (parameter offload) or
            "nvme" (swap files under `zero_optimization.offload_param.nvme_path`, with that section's
            buffer_count/buffer_size/max_in_cpu and the config's `aio` section); None takes
            `zero_optimization.offload_param.device` from the config.
        pin_memory: page-lock CPU shards (None-config default: `offload_param.pin_memory`).
        config_dict_or_path: a ds_config dict or JSON path: `zero_optimization.offload_param` and
            `override_module_apply` are read, and the dtype defaults to bf16/fp16 when enabled there
            (`"bf16"`, or its legacy name `"bfloat16"`; see `config_dtype`).
            With `weight_quantization.quantized_initialization`, the weights of `nn.Linear` / `nn.Embedding`
            layers built inside the context are quantized as they are partitioned (not those of
            `module=`, as in DeepSpeed), and entering installs the dequantizing wrappers of
            `torch.nn.functional.linear` / `embedding` (see `ds_zero._construct.quantized_init`).
            Values still `"auto"` (as Hugging Face passes them before training starts) take their defaults.
        enabled: False makes `Init` a no-op.
        dtype: cast floating-point parameters to this dtype as they are partitioned.
        config: DeepSpeed's older name of `config_dict_or_path`.
        mem_efficient_linear: make `torch.nn.functional.linear` DeepSpeed's `zero3_linear_wrap` (same values
            and gradients) from the first `Init` entered or given a module on, for the rest of the process,
            as DeepSpeed does (see `InsertPostInitMethodToModuleSubClasses`); a config's
            `zero_optimization.memory_efficient_linear` overrides it.
        mpu: model parallelism is not supported; must be None.

    An enabled `Init` initialises the distributed backend (`ds_comm.init_distributed()`) when it is
    not initialised yet, as DeepSpeed's does.

    Raises:
        ValueError: `remote_device` is not None/"none"/"cpu"/"nvme", an unreadable config, an mpu, (nvme) a
            missing or unwritable `nvme_path`, or `quantized_initialization` without `memory_efficient_linear`.
        RuntimeError: (enabled, no `data_parallel_group`) the world has one rank while the launcher's
            `WORLD_SIZE` says more: a one-process group was set up before `Init`, which would keep the
            whole model on every rank (see `ds_zero._construct.launcher_world`).
    """

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: ProcessGroup | None = None,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: Mapping[str, Any] | str | os.PathLike[str] | None = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        *,
        config: Any = None,
        mem_efficient_linear: bool = True,
        mpu: Any = None,
    ) -> None:
        if mpu is not None:
            raise ValueError("ds_zero.Init(mpu=...): model parallelism is not supported by ds-zero; pass mpu=None")
        if enabled and not ds_comm.is_initialized():
            # DeepSpeed's contract: Init initialises the distributed backend when nothing has yet, from
            # whatever launched the process (a world of one when nothing did), so the ranks it
            # partitions across are the ones later collectives use.
            ds_comm.init_distributed()
        if enabled:
            mismatch = single_rank_group_error(ds_comm.get_world_size(data_parallel_group), data_parallel_group)
            if mismatch is not None:
                raise RuntimeError(mismatch)
        ds_config = _without_auto(_load_config(config_dict_or_path if config_dict_or_path is not None else config))
        zero = as_zero_config(ds_config.get("zero_optimization") or {})
        if remote_device is None:
            remote_device = zero.offload_param_device
            pin_memory = pin_memory or (remote_device == "cpu" and zero.offload_param_or_default.pin_memory)
        if remote_device not in ("none", "cpu", "nvme"):
            raise ValueError(
                f"ds_zero.Init(remote_device={remote_device!r}): use None/'none' (shards on the "
                "compute device), 'cpu' (parameter offload) or 'nvme' (swapped to "
                "zero_optimization.offload_param.nvme_path)"
            )
        self.param_swapper: ParamSwapper | None = None
        if remote_device == "nvme" and enabled:
            if zero.offload_param_or_default.nvme_path is None:
                raise ValueError(
                    "ds_zero.Init(remote_device='nvme') needs zero_optimization.offload_param.nvme_path "
                    "in config_dict_or_path (a directory on a fast local disk)"
                )
            self.param_swapper = ParamSwapper.from_config(
                zero.offload_param_or_default, rank=ds_comm.get_rank(), aio_config=ds_config.get("aio")
            )
        if dtype is None:
            dtype = config_dtype(ds_config)
        if config_dict_or_path is not None or config is not None:
            mem_efficient_linear = zero.memory_efficient_linear
        super().__init__(enabled=enabled, mem_efficient_linear=mem_efficient_linear)
        self.quantized_initialization = _quantized_initialization(ds_config)
        if self.quantized_initialization is not None and enabled and not mem_efficient_linear:
            raise ValueError(
                "weight_quantization.quantized_initialization needs zero_optimization.memory_efficient_linear "
                "(the wrappers that dequantize quantized weights in F.linear / F.embedding are installed with it)"
            )
        self.dp_group = data_parallel_group
        self.dtype = dtype
        self.pin_memory = pin_memory
        self.override_apply = zero.override_module_apply
        self.compute_device = ds_comm.get_accelerator().device()
        self.shard_device = torch.device("cpu") if remote_device in ("cpu", "nvme") else self.compute_device
        # DeepSpeed's names for the layout, read by `_partition_param_sec`
        self.remote_device = remote_device
        self.dp_world_size = ds_comm.get_world_size(data_parallel_group)
        self.num_ranks_in_param_group = zero.zero_hpz_partition_size
        self.rank_in_group = ds_comm.get_rank(data_parallel_group) % self.num_ranks_in_param_group
        self.quantized_nontrainable_weights = zero.zero_quantized_nontrainable_weights
        if module is not None and enabled:
            self._enable_mem_efficient_linear()
            self.partition(module)

    def partition(self, module: nn.Module) -> int:
        """Partition every not-yet-partitioned parameter of `module` (rank 0's values); returns how many."""
        self._take_rank0_values(module)
        return self._partition(module)

    def _take_rank0_values(self, module: nn.Module) -> None:
        """Give every not-yet-partitioned parameter of `module` the values of data-parallel rank 0.

        As DeepSpeed's `Init` does, so the model is rank 0's even where ranks initialise differently (other
        seeds, rank-dependent init); each rank then keeps its own slice of the same values. One broadcast
        per parameter, in place (no second copy of a large layer); on nccl through the compute device.
        Collective: every rank of the data-parallel group, in the same module order.
        """
        if self.dp_world_size == 1:
            return
        src = ds_comm.get_global_rank(self.dp_group, 0)
        nccl = torch.distributed.get_backend(self.dp_group) == "nccl"
        seen: set[int] = set()
        for m in module.modules():
            for p in m._parameters.values():
                if p is None or is_zero_param(p) or not p.numel() or id(p) in seen:
                    continue
                seen.add(id(p))
                data = p.data.to(self.compute_device) if nccl and p.device != self.compute_device else p.data
                ds_comm.broadcast(data, src, group=self.dp_group)
                if data is not p.data:
                    with torch.no_grad():
                        p.data.copy_(data)

    def _partition(self, module: nn.Module) -> int:
        before = {id(p) for p in module.parameters() if is_zero_param(p)}
        count = partition_module(
            module,
            group=self.dp_group,
            shard_device=self.shard_device,
            compute_device=self.compute_device,
            dtype=self.dtype,
            pin_memory=self.pin_memory,
        )
        if self.param_swapper is not None and count:
            self.param_swapper.adopt([p for p in module.parameters() if is_zero_param(p) and id(p) not in before])
        if count:
            logger.debug("ds_zero.Init: partitioned %d parameters of %s", count, type(module).__name__)
        return count

    def _post_init_partition(self, module: nn.Module) -> int:
        """Partition a module just built inside the context, quantizing its weights first when configured."""
        self._take_rank0_values(module)  # before quantizing: every rank quantizes the same values
        quantizer = self.quantized_initialization
        if quantizer is not None:
            quantize_module_weights(module, quantizer.quantizer(), skip=is_zero_param, dtype=self.dtype)
        return self._partition(module)

    def _aligned_size(self, param: nn.Parameter) -> int:
        """`param`'s padded flat size: its shard size times the data-parallel world size."""
        return shard_numel(param.ds_numel, self.dp_world_size) * self.dp_world_size

    def _partition_param_sec(
        self, param: nn.Parameter, buffer: torch.Tensor | None = None, has_been_updated: bool = False
    ) -> None:
        """DeepSpeed's hpZ step: write this rank's secondary slice of a gathered `param` (`ds_secondary_tensor`).

        The slice is `_aligned_size(param) // num_ranks_in_param_group` elements at `rank_in_group` times
        that in the flattened values, zero past `ds_numel` (`ds_zero._params.secondary.write_secondary`),
        on the CPU when shards are offloaded (`remote_device`), else beside the values. A parameter that is
        not gathered is left alone, and so is an existing slice unless `has_been_updated`. The stage-3
        coordinator fills slices itself after each primary gather; this is the same step on request.

        Raises:
            ValueError: `param`'s gather is still in flight, or quantized frozen weights are asked for
                (`quantized_nontrainable_weights`; ds does not quantize secondary slices).
        """
        if param.ds_status is ZeroParamStatus.INFLIGHT:
            raise ValueError(f"parameter {param.ds_id} is being gathered; wait for it before partitioning it")
        if param.ds_status is not ZeroParamStatus.AVAILABLE:
            return
        if param.ds_secondary_tensor is not None and not has_been_updated:
            return
        if self.quantized_nontrainable_weights and not param.requires_grad:
            raise ValueError("quantized secondary slices (zero_quantized_nontrainable_weights) are not supported")
        write_secondary(
            param,
            param.data,
            aligned_numel=self._aligned_size(param),
            group_size=self.num_ranks_in_param_group,
            rank_in_group=self.rank_in_group,
            device=torch.device("cpu") if self.remote_device in ("cpu", "nvme") else param.device,
            pin_memory=self.pin_memory,
        )

    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        with _lock:
            if not _active:  # the outermost context patches, as DeepSpeed's
                _patch(self.override_apply)
                self._enable_mem_efficient_linear()
                if self.mem_efficient_linear and self.quantized_initialization is not None:
                    install_quantized_wrappers()
            _active.append(self)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self.enabled:
            return
        with _lock:
            _active.remove(self)
            if not _active:
                _unpatch()


def partition_model(
    module: nn.Module,
    *,
    data_parallel_group: ProcessGroup | None = None,
    remote_device: str | None = None,
    pin_memory: bool = False,
    config_dict_or_path: Mapping[str, Any] | str | os.PathLike[str] | None = None,
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """Partition an already built model in place (what `Init(module=model)` does); returns it.

    Each rank keeps its 1/N shard of every parameter; the full values are released. Arguments as in `Init`.
    """
    Init(
        module=module,
        data_parallel_group=data_parallel_group,
        remote_device=remote_device,
        pin_memory=pin_memory,
        config_dict_or_path=config_dict_or_path,
        dtype=dtype,
    )
    return module
