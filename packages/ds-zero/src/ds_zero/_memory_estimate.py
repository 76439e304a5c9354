"""DeepSpeed's ZeRO-2/ZeRO-3 model-states memory estimators: the same formulas, options and printed table.

[Note: the formulas] Bytes per parameter, with P total parameters, N = nodes x devices per node and
L the largest layer's parameters (one module's own, not its children's):

* ZeRO-2, no offload: device `2P + 18P/N` (16-bit params, plus a 1/N share of 16-bit and 32-bit
  gradients, the fp32 master and Adam's two moments: 2 + 4 + 4 + 8); host `4P x devices per node x buffer`
  (each local rank loads the fp32 model).
* ZeRO-2, offload_optimizer=cpu: device `2P`; host `P x max(4N, 16) x buffer`.
* ZeRO-3: device `4L` (the largest layer gathered) plus `2P/N` without param offload plus `18P/N` without
  optimizer offload; host `18P` (params and optimizer offloaded) or `16P` (optimizer only) per node, or,
  without `zero.Init`, at least `4P` per local rank; no offload: `4L` (zero_init) or `4P` per local rank.

`buffer` is `additional_buffer_factor` (1.5 by default) and applies to host memory only.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

__all__ = [
    "estimate_zero2_model_states_mem_needs",
    "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero2_model_states_mem_needs_all_live",
    "estimate_zero3_model_states_mem_needs",
    "estimate_zero3_model_states_mem_needs_all_cold",
    "estimate_zero3_model_states_mem_needs_all_live",
    "model_to_params",
]

_GIB = 2**30


def _check(total_params: int, num_gpus_per_node: int, num_nodes: int, additional_buffer_factor: float) -> None:
    for name, value in (("num_gpus_per_node", num_gpus_per_node), ("num_nodes", num_nodes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if total_params < 0:
        raise ValueError(f"total_params must be >= 0, got {total_params!r}")
    if additional_buffer_factor <= 0:
        raise ValueError(f"additional_buffer_factor must be > 0, got {additional_buffer_factor!r}")


def estimate_zero2_model_states_mem_needs(
    total_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int]:
    """`(host_bytes, device_bytes)` per process for ZeRO-2 model states (params, grads, optimizer states).

    Raises:
        ValueError: a count is not a positive integer, or the buffer factor is not positive.
    """
    _check(total_params, num_gpus_per_node, num_nodes, additional_buffer_factor)
    num_devices = num_nodes * num_gpus_per_node
    if cpu_offload:
        device_bytes = 2 * total_params
        host_bytes = total_params * max(4 * num_devices, 16) * additional_buffer_factor
    else:
        device_bytes = 2 * total_params + int(18 * total_params / num_devices)
        host_bytes = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(host_bytes), int(device_bytes)


def estimate_zero3_model_states_mem_needs(
    total_params: int,
    largest_layer_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    cpu_offload_params: bool = True,
    zero_init: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int, int]:
    """`(host_bytes, device_bytes, largest_layer_bytes)` per process for ZeRO-3 model states.

    Raises:
        ValueError: a count is not a positive integer, or the buffer factor is not positive.
    """
    _check(total_params, num_gpus_per_node, num_nodes, additional_buffer_factor)
    num_devices = num_nodes * num_gpus_per_node
    per_node = 1 / num_nodes
    largest_layer_bytes = 4 * largest_layer_params
    if cpu_offload:
        host_per_param = 18 if cpu_offload_params else 16
        device_bytes = largest_layer_bytes + (0 if cpu_offload_params else int(2 * total_params / num_devices))
        if zero_init:
            host_bytes = total_params * host_per_param * per_node * additional_buffer_factor
        else:
            host_bytes = total_params * max(4 * num_gpus_per_node, host_per_param * per_node) * additional_buffer_factor
    else:
        device_bytes = largest_layer_bytes + int(18 * total_params / num_devices)
        loaded = largest_layer_params if zero_init else total_params
        host_bytes = loaded * 4 * num_gpus_per_node * additional_buffer_factor
    return int(host_bytes), int(device_bytes), largest_layer_bytes


def model_to_params(model: nn.Module) -> tuple[int, int]:
    """`(total_params, largest_layer_params)`: shared parameters counted once; a layer is one module's own params."""
    total = sum({p.data_ptr(): _numel(p) for p in model.parameters()}.values())
    largest = max((sum(_numel(p) for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    return total, largest


def _numel(p: nn.Parameter) -> int:
    # A ZeRO-3 partitioned parameter keeps its full shape in ds_numel; its data is a placeholder.
    return int(getattr(p, "ds_numel", p.numel()))


@dataclass(frozen=True)
class _Row:
    host_bytes: int
    device_bytes: int
    options: str

    def line(self) -> str:
        return f" {self.host_bytes / _GIB:7.2f}GB | {self.device_bytes / _GIB:6.2f}GB | {self.options}"


def _header(total_params: int, num_gpus_per_node: int, num_nodes: int, largest_layer_params: int | None) -> str:
    nodes = "nodes" if num_nodes > 1 else "node"
    gpus = "GPUs" if num_gpus_per_node > 1 else "GPU"
    model = f"SW: Model with {int(total_params / 1e6)}M total params"
    if largest_layer_params is not None:
        model += f", {int(largest_layer_params / 1e6)}M largest layer params"
    return (
        "Estimated memory needed for params, optim states and gradients for a:\n"
        f"HW: Setup with {num_nodes} {nodes}, {num_gpus_per_node} {gpus} per node.\n"
        f"{model}.\n"
        "  per CPU  |  per GPU |   Options"
    )


def _device(on_cpu: bool) -> str:
    return "cpu " if on_cpu else "none"  # padded to the width of "none", so the columns line up


def estimate_zero2_model_states_mem_needs_all_cold(
    total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1, additional_buffer_factor: float = 1.5
) -> str:
    """Print (and return) the ZeRO-2 table for a model of `total_params` parameters, one row per option.

    Rows: `offload_optimizer=cpu`, then `offload_optimizer=none`. Columns: host bytes per process,
    device bytes per device, in GiB with two decimals (printed as "GB", as DeepSpeed does).
    """
    rows = [
        _Row(
            *estimate_zero2_model_states_mem_needs(
                total_params, num_gpus_per_node, num_nodes, offload, additional_buffer_factor
            ),
            f"offload_optimizer={_device(offload)}",
        )
        for offload in (True, False)
    ]
    text = "\n".join([_header(total_params, num_gpus_per_node, num_nodes, None), *(r.line() for r in rows)])
    print(text)
    return text


def estimate_zero2_model_states_mem_needs_all_live(
    model: nn.Module, num_gpus_per_node: int = 1, num_nodes: int = 1, additional_buffer_factor: float = 1.5
) -> str:
    """`estimate_zero2_model_states_mem_needs_all_cold` with the parameter count taken from `model`."""
    total, _largest = model_to_params(model)
    return estimate_zero2_model_states_mem_needs_all_cold(total, num_gpus_per_node, num_nodes, additional_buffer_factor)


def estimate_zero3_model_states_mem_needs_all_cold(
    total_params: int,
    largest_layer_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
) -> str:
    """Print (and return) the ZeRO-3 table: six rows over offload_param, offload_optimizer and zero_init.

    Param offload is listed only together with optimizer offload (ZeRO-Offload's combinations).
    """
    rows = []
    for offload_optimizer, offload_param in ((True, True), (True, False), (False, False)):
        for zero_init in (True, False):
            host, device, _ = estimate_zero3_model_states_mem_needs(
                total_params,
                largest_layer_params,
                num_gpus_per_node,
                num_nodes,
                offload_optimizer,
                offload_param,
                zero_init,
                additional_buffer_factor,
            )
            options = (
                f"offload_param={_device(offload_param)}, offload_optimizer={_device(offload_optimizer)}, "
                f"zero_init={int(zero_init)}"
            )
            rows.append(_Row(host, device, options))
    header = _header(total_params, num_gpus_per_node, num_nodes, largest_layer_params)
    text = "\n".join([header, *(r.line() for r in rows)])
    print(text)
    return text


def estimate_zero3_model_states_mem_needs_all_live(
    model: nn.Module, num_gpus_per_node: int = 1, num_nodes: int = 1, additional_buffer_factor: float = 1.5
) -> str:
    """`estimate_zero3_model_states_mem_needs_all_cold` with the counts taken from `model`."""
    total, largest = model_to_params(model)
    return estimate_zero3_model_states_mem_needs_all_cold(
        total, largest, num_gpus_per_node, num_nodes, additional_buffer_factor
    )
