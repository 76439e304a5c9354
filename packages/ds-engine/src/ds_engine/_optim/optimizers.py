"""Which optimizer a config (or a client) gets, decided once: names, parameter checks, the plan, the build.

[Note: Adam routing] As DeepSpeed 0.19.8's engine does for `adam`/`adamw` on a CPU host:
- `torch_adam: true` -> torch's Adam/AdamW with the given kwargs, also with optimizer offload (the
  offload swap in `swap_for_cpu_optimizer`, like DeepSpeed's `zero_force_ds_cpu_optimizer` check,
  applies to client optimizers only);
- else with optimizer offload -> `ds_ops.DeepSpeedCPUAdam` (`fp32_optimizer_states` default true);
- else CPU-resident parameters -> `ds_ops.FusedAdam`, which on CPU tensors runs the same CPU Adam
  kernel (moments in the dtype of the tensors it steps: the fp32 masters under ZeRO and under the
  bf16/fp16 wrapper, which every ds stage-0 bf16/fp16 run has);
- CUDA parameters without offload keep torch's AdamW/Adam with `fused=True` (DeepSpeed takes its
  CUDA FusedAdam there).
`fp32_optimizer_states` only means something to DeepSpeedCPUAdam; elsewhere it is dropped, as
DeepSpeed pops it (a warning says so). Keys the chosen class does not take are refused by name.
When FusedAdam's CPU op cannot be built here (no compiler), or the installed ds-ops lacks the
class, the run uses torch's Adam/AdamW with `foreach=True` instead (the plan's `fallback`; with
`bias_correction: false`, which torch cannot do, there is no fallback and the build error stands).
The torch paths use `weight_decay=0` unless the config sets it, as FusedAdam does (torch's AdamW
would silently use 0.01). A checkpoint saved by the DeepSpeedCPUAdam route that ds took here before
(per-parameter `step`, fp32 moments) resumes under FusedAdam: see `ds_ops.FusedAdam`'s note on its
step count.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer

import ds_ops
from ds_engine._optim.muon import check_muon_params, muon_param_groups
from ds_engine._optim.torch_optimizers import FusedLion, Lamb, Lion

logger = logging.getLogger(__name__)

__all__ = [
    "OptimizerPlan",
    "ParamError",
    "canonical_optimizer_name",
    "check_optimizer_params",
    "is_zero_tested_optimizer",
    "zero_supported_optimizer_classes",
    "normalize_param_groups",
    "plan_config_optimizer",
    "swap_for_cpu_optimizer",
]

DS_OPTIMIZERS = ("adagrad", "adam", "adamw", "lamb", "lion", "muon")
_UNSUPPORTED = {
    "muadam": "MuP optimizers are not implemented in ds (DeepSpeed needs the `mup` package for them)",
    "muadamw": "MuP optimizers are not implemented in ds (DeepSpeed needs the `mup` package for them)",
    "musgd": "MuP optimizers are not implemented in ds (DeepSpeed needs the `mup` package for them)",
    "onebitadam": '1-bit Adam was removed in DeepSpeed 0.19; use "Adam"',
    "onebitlamb": '1-bit LAMB was removed in DeepSpeed 0.19; use "Lamb"',
    "zerooneadam": '0/1 Adam was removed in DeepSpeed 0.19; use "Adam"',
}
_ZERO_TESTED = {"adam", "adamw", "adagrad", "lamb", "lion", "muon", "Adam", "AdamW", "Adagrad"}
_ADAM_EXTRA = {"torch_adam", "adam_w_mode", "fp32_optimizer_states", "bias_correction", "set_grad_none"}
_CPU_ADAM_KEYS = {"lr", "betas", "eps", "weight_decay", "amsgrad", "bias_correction", "fp32_optimizer_states"}
_FUSED_ADAM_KEYS = {"lr", "betas", "eps", "weight_decay", "amsgrad", "bias_correction", "set_grad_none"}
_DS_CPU_CLASSES = ("DeepSpeedCPUAdam", "DeepSpeedCPUAdagrad", "DeepSpeedCPULion")


class ParamError(ValueError):
    """A constructor argument in `optimizer.params` / `scheduler.params` is wrong; `key` names it."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def _torch_optim_names() -> list[str]:
    return sorted(
        n
        for n in dir(torch.optim)
        if isinstance(getattr(torch.optim, n), type)
        and issubclass(getattr(torch.optim, n), Optimizer)
        and n != "Optimizer"
    )


def canonical_optimizer_name(kind: str) -> str:
    """DeepSpeed's rule: a DeepSpeed optimizer name lower-cased, else a `torch.optim` class (case-sensitive).

    Raises:
        ValueError: an unsupported, removed or unknown name; unknown names get a suggestion.
    """
    lowered = kind.lower()
    if lowered in DS_OPTIMIZERS:
        return lowered
    if lowered in _UNSUPPORTED:
        raise ValueError(f"optimizer {kind!r} is not supported: {_UNSUPPORTED[lowered]}")
    names = _torch_optim_names()
    if kind in names:
        return kind
    matches = [n for n in names if n.lower() == lowered]
    if not matches:
        import difflib

        matches = difflib.get_close_matches(kind, [*DS_OPTIMIZERS, *names], n=1, cutoff=0.6)
    hint = f"; did you mean {matches[0]!r}?" if matches else ""
    raise ValueError(
        f"{kind!r} is not a known optimizer (DeepSpeed names: {', '.join(DS_OPTIMIZERS)}; "
        f"or a torch.optim class, case-sensitive){hint}"
    )


def _constructor(name: str) -> type[Optimizer]:
    return {
        "adam": torch.optim.AdamW,
        "adamw": torch.optim.AdamW,
        "adagrad": torch.optim.Adagrad,
        "lamb": Lamb,
        "lion": FusedLion,
    }.get(name) or getattr(torch.optim, name)


def check_optimizer_params(name: str, params: dict[str, Any]) -> None:
    """Refuse keyword arguments the chosen optimizer does not take, before anything is built.

    Raises:
        ValueError: naming the bad key (`max_grad_norm` gets DeepSpeed's advice).
    """
    if "max_grad_norm" in params:
        raise ParamError(
            "max_grad_norm",
            "'max_grad_norm' is not an optimizer parameter here; use the top-level \"gradient_clipping\" key instead",
        )
    if name == "muon":
        bad = check_muon_params(params)
        if bad is not None:
            raise ParamError(*bad)
        return
    signature = inspect.signature(_constructor(name).__init__)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()):
        return
    accepted = {p for p in signature.parameters if p not in ("self", "params")}
    if name in ("adam", "adamw"):
        accepted |= _ADAM_EXTRA
    for key in params:
        if key not in accepted:
            import difflib

            close = difflib.get_close_matches(key, sorted(accepted), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else f"; accepted: {', '.join(sorted(accepted))}"
            raise ParamError(key, f"{key!r} is not a parameter of optimizer {name!r}{hint}")


def zero_supported_optimizer_classes() -> tuple[type[Optimizer], ...]:
    """DeepSpeed's list of optimizer classes ZeRO is tested with, as ds builds them.

    The one list behind both checks: `deepspeed.runtime.zero.utils.ZERO_SUPPORTED_OPTIMIZERS` (DeepSpeed's
    exact-type test) and `is_zero_tested_optimizer` below (ds's isinstance test, which also accepts Lamb).
    `FusedLion` (a `Lion` with DeepSpeed's defaults) is what the `lion` config name builds.
    """
    return (
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.Adagrad,
        ds_ops.FusedAdam,
        ds_ops.DeepSpeedCPUAdam,
        ds_ops.DeepSpeedCPUAdagrad,
        ds_ops.DeepSpeedCPULion,
        ds_ops.MuonWithAuxAdam,
        Lion,
        FusedLion,
    )


def is_zero_tested_optimizer(optimizer: str | Optimizer) -> bool:
    """Whether ZeRO is known to work with this optimizer (else `zero_allow_untested_optimizer` is needed).

    Wider than DeepSpeed's exact-type check: subclasses count, and so does ds's Lamb, which ds's ZeRO tests
    cover (DeepSpeed asks for `zero_allow_untested_optimizer` with its FusedLamb).
    """
    if isinstance(optimizer, str):
        return optimizer in _ZERO_TESTED
    if isinstance(optimizer, (*zero_supported_optimizer_classes(), Lamb)):
        return True
    # Same-named classes from elsewhere: apex's FusedAdam (DeepSpeed accepts it when apex is installed).
    return type(optimizer).__name__ in (*_DS_CPU_CLASSES, "FusedAdam", "MuonWithAuxAdam")


@dataclasses.dataclass(frozen=True)
class OptimizerPlan:
    """The base optimizer initialize() will build: a class path, its kwargs, and why."""

    name: str
    """The config name (`adamw`, `SGD`) or `client`."""
    target: str
    """`torch.optim.AdamW`, `ds_ops.DeepSpeedCPUAdam`, `ds_engine.Lion`, ..."""
    kwargs: dict[str, Any]
    note: str = ""
    fallback: OptimizerPlan | None = None
    """Used when the target exists but cannot be built here (a ds-ops kernel that fails to load)."""

    def describe(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        text = f"{self.target}({args})"
        return f"{text}  [{self.note}]" if self.note else text

    def build(self, params: list[dict[str, Any]]) -> Optimizer:
        """Construct the optimizer over `params` (a list of param-group dicts)."""
        if self.name == "muon":
            kwargs = dict(self.kwargs)
            adam_w_mode = bool(kwargs.pop("adam_w_mode", True))
            return ds_ops.MuonWithAuxAdam(muon_param_groups(params, kwargs), adam_w_mode=adam_w_mode)
        module, _, cls_name = self.target.rpartition(".")
        owner = {"torch.optim": torch.optim, "ds_ops": ds_ops}.get(module)
        local = {"FusedLion": FusedLion, "Lion": Lion, "Lamb": Lamb}
        cls = getattr(owner, cls_name) if owner is not None else local[cls_name]
        if self.fallback is None:
            return cls(params, **self.kwargs)
        try:
            return cls(params, **self.kwargs)
        except (RuntimeError, ImportError, OSError) as err:
            logger.warning("%s could not be built here (%s); using %s", self.target, err, self.fallback.describe())
            return self.fallback.build(params)


def _has_ds_ops(name: str) -> bool:
    return hasattr(ds_ops, name)


def _drop_fp32_optimizer_states(kwargs: dict[str, Any], target: str) -> None:
    if "fp32_optimizer_states" in kwargs:
        kwargs.pop("fp32_optimizer_states")
        logger.warning(
            "optimizer.params.fp32_optimizer_states applies to ds_ops.DeepSpeedCPUAdam (optimizer offload) "
            "only; %s ignores it, as DeepSpeed does",
            target,
        )


def _plan_adam(
    name: str,
    params: dict[str, Any],
    *,
    device_type: str,
    offload: bool,
    bf16_optimizer_states: bool = False,
    zenflow: bool = False,
) -> OptimizerPlan:
    kwargs = dict(params)
    torch_adam = bool(kwargs.pop("torch_adam", False))
    adamw = name == "adamw" or bool(kwargs.pop("adam_w_mode", True))
    kwargs.pop("adam_w_mode", None)
    cls = "AdamW" if adamw else "Adam"
    if torch_adam:
        kwargs.pop("set_grad_none", None)
        _drop_fp32_optimizer_states(kwargs, f"torch.optim.{cls}")
        if "bias_correction" in kwargs:
            raise ValueError(
                f"optimizer.params.bias_correction does not apply with torch_adam=true "
                f"(torch.optim.{cls} has no such argument)"
            )
        note = "torch_adam=true" + (" (not swapped for DeepSpeedCPUAdam under offload)" if offload else "")
        return OptimizerPlan(name, f"torch.optim.{cls}", kwargs, note)
    if offload:
        if not _has_ds_ops("DeepSpeedCPUAdam"):
            raise ValueError(
                "zero_optimization.offload_optimizer needs ds_ops.DeepSpeedCPUAdam, which the installed "
                "ds-ops does not provide; upgrade ds-ops or remove the offload"
            )
        kwargs.pop("set_grad_none", None)
        _check_keys(kwargs, _CPU_ADAM_KEYS, "ds_ops.DeepSpeedCPUAdam")
        note = "CPU offload"
        if bf16_optimizer_states:
            # as DeepSpeed's engine does: the moments follow the bf16 masters whatever the params say
            if kwargs.get("fp32_optimizer_states"):
                logger.warning(
                    "bf16.bf16_optimizer_states=true overrides optimizer.params.fp32_optimizer_states=true: the CPU "
                    "Adam keeps its moments in bf16"
                )
            kwargs["fp32_optimizer_states"] = False
            note = "CPU offload, moments in bf16 (bf16.bf16_optimizer_states)"
        if zenflow:  # ZenFlow's CPU update counts bias correction by micro step (`step(step_id=...)`)
            return OptimizerPlan(name, "ds_ops.ZenFlowCPUAdam", dict(kwargs, adamw_mode=adamw), f"ZenFlow {note}")
        return OptimizerPlan(name, "ds_ops.DeepSpeedCPUAdam", dict(kwargs, adamw_mode=adamw), note)
    if device_type == "cpu" and _has_ds_ops("FusedAdam"):
        _drop_fp32_optimizer_states(kwargs, "ds_ops.FusedAdam")
        _check_keys(kwargs, _FUSED_ADAM_KEYS, "ds_ops.FusedAdam")
        if kwargs.get("amsgrad"):
            raise ValueError(
                "optimizer.params.amsgrad=true: ds_ops.FusedAdam (DeepSpeed's FusedAdam) has no AMSGrad; set "
                "torch_adam=true to use torch's Adam with it"
            )
        fallback = None
        if kwargs.get("bias_correction", True):
            rest = {k: v for k, v in kwargs.items() if k != "set_grad_none"}
            fallback = _torch_adam_plan(name, cls, rest, device_type, "fallback")
        return OptimizerPlan(
            name, "ds_ops.FusedAdam", dict(kwargs, adam_w_mode=adamw), "CPU-resident parameters", fallback
        )
    kwargs.pop("set_grad_none", None)
    _drop_fp32_optimizer_states(kwargs, f"torch.optim.{cls}")
    note = "ds_ops.FusedAdam not available" if device_type == "cpu" else ""
    return _torch_adam_plan(name, cls, kwargs, device_type, note)


def _check_keys(kwargs: dict[str, Any], accepted: set[str], target: str) -> None:
    extra = sorted(set(kwargs) - accepted)
    if extra:
        raise ValueError(
            f"optimizer.params {extra} are not arguments of {target}; set torch_adam=true to use torch's Adam with them"
        )


def _torch_adam_plan(name: str, cls: str, kwargs: dict[str, Any], device_type: str, note: str) -> OptimizerPlan:
    kwargs = dict(kwargs)
    if not kwargs.pop("bias_correction", True):
        raise ValueError(
            "optimizer.params.bias_correction=false needs ds_ops.FusedAdam or ds_ops.DeepSpeedCPUAdam "
            "(torch's Adam always corrects bias)"
        )
    kwargs.setdefault("weight_decay", 0.0)
    if "fused" not in kwargs and "foreach" not in kwargs:
        kwargs["fused" if device_type == "cuda" else "foreach"] = True
    return OptimizerPlan(name, f"torch.optim.{cls}", kwargs, note)


def plan_config_optimizer(
    name: str,
    params: dict[str, Any],
    *,
    device_type: str,
    offload: bool,
    force_ds_cpu_optimizer: bool = True,
    bf16_optimizer_states: bool = False,
    zenflow: bool = False,
) -> OptimizerPlan:
    """The base optimizer for `optimizer.type == name` (already canonical) on `device_type`.

    With offload and `bf16_optimizer_states` (`bf16.bf16_optimizer_states`), DeepSpeedCPUAdam keeps its moments in
    the bf16 masters' dtype (`fp32_optimizer_states=False`, overriding the params as DeepSpeed does).

    Raises:
        ValueError: an impossible combination (offload without a CPU kernel, CPU-only arguments on
            the torch path, a non-DeepSpeed optimizer with offload while `zero_force_ds_cpu_optimizer`).
    """
    if name in ("adam", "adamw"):
        return _plan_adam(
            name,
            params,
            device_type=device_type,
            offload=offload,
            bf16_optimizer_states=bf16_optimizer_states,
            zenflow=zenflow,
        )
    if name == "muon":
        # Plain torch on any device; with offload the ZeRO step runs it on the host partitions.
        if not _has_ds_ops("MuonWithAuxAdam"):
            raise ValueError(
                "optimizer 'muon' needs ds_ops.MuonWithAuxAdam, which the installed ds-ops lacks; upgrade ds-ops"
            )
        # With offload it steps the host partitions; as in DeepSpeed, zero_force_ds_cpu_optimizer only
        # checks client optimizers, so the config's Muon is not refused there.
        return OptimizerPlan(
            name, "ds_ops.MuonWithAuxAdam", dict(params), "Muon for use_muon matrices, Adam for the rest"
        )
    cpu_classes = {"adagrad": "DeepSpeedCPUAdagrad", "lion": "DeepSpeedCPULion"}
    if offload and name in cpu_classes:
        if not _has_ds_ops(cpu_classes[name]):
            raise ValueError(
                f"offloading optimizer {name!r} needs ds_ops.{cpu_classes[name]}, which the installed "
                "ds-ops does not provide"
            )
        return OptimizerPlan(name, f"ds_ops.{cpu_classes[name]}", dict(params), "CPU offload")
    if offload and force_ds_cpu_optimizer:
        raise ValueError(
            f"optimizer {name!r} has no DeepSpeed CPU implementation for offload_optimizer; use "
            "Adam/AdamW/Adagrad/Lion, or set zero_force_ds_cpu_optimizer=false to step it on CPU as is"
        )
    target = {"adagrad": "torch.optim.Adagrad", "lion": "ds_engine.FusedLion", "lamb": "ds_engine.Lamb"}.get(
        name, f"torch.optim.{name}"
    )
    return OptimizerPlan(name, target, dict(params))


def swap_for_cpu_optimizer(optimizer: Optimizer, *, force: bool) -> Optimizer:
    """With optimizer offload: a client torch Adam/AdamW becomes `ds_ops.DeepSpeedCPUAdam` (same settings).

    Raises:
        ValueError: a client optimizer with no CPU counterpart while `zero_force_ds_cpu_optimizer` is true.
    """
    if type(optimizer).__name__ in _DS_CPU_CLASSES:
        return optimizer
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) and _has_ds_ops("DeepSpeedCPUAdam"):
        d = optimizer.defaults
        kwargs = {
            "lr": d["lr"],
            "betas": d["betas"],
            "eps": d["eps"],
            "weight_decay": d["weight_decay"],
            "amsgrad": d.get("amsgrad", False),
            "adamw_mode": isinstance(optimizer, torch.optim.AdamW),
        }
        logger.info(
            "offload_optimizer: replacing the client %s with ds_ops.DeepSpeedCPUAdam(%s)",
            type(optimizer).__name__,
            kwargs,
        )
        groups = [dict(g) for g in optimizer.param_groups]
        return ds_ops.DeepSpeedCPUAdam(groups, **kwargs)
    if force:
        raise ValueError(
            f"offload_optimizer needs a DeepSpeed CPU optimizer, got a client {type(optimizer).__name__}; "
            "pass no optimizer (configure it in the config), use torch Adam/AdamW (swapped for "
            "DeepSpeedCPUAdam), or set zero_force_ds_cpu_optimizer=false"
        )
    return optimizer


def normalize_param_groups(parameters: Iterable[Any] | None, module: torch.nn.Module) -> list[dict[str, Any]]:
    """`model_parameters` as a list of param-group dicts: empty groups dropped, duplicates refused.

    Raises:
        ValueError: a parameter appears twice, or nothing trainable was given.
        TypeError: an entry is neither a tensor nor a dict with "params".
    """
    items = list(module.parameters() if parameters is None else parameters)
    groups: list[dict[str, Any]] = []
    loose: list[torch.Tensor] = []
    for item in items:
        if isinstance(item, dict):
            if "params" not in item:
                raise TypeError("a param group dict in model_parameters needs a 'params' key")
            params = item["params"]
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            if params:
                groups.append({**item, "params": params})
        elif isinstance(item, torch.Tensor):
            loose.append(item)
        else:
            raise TypeError(f"model_parameters entries must be tensors or param-group dicts, got {type(item).__name__}")
    if loose:
        groups.insert(0, {"params": loose})
    seen: set[int] = set()
    for group in groups:
        for p in group["params"]:
            if id(p) in seen:
                raise ValueError("a parameter appears in more than one entry of model_parameters")
            seen.add(id(p))
    return groups


def call_optimizer_factory(factory: Callable[..., Optimizer], groups: list[dict[str, Any]]) -> Optimizer:
    """A client `optimizer=` callable gets the param groups; it must return a torch optimizer."""
    optimizer = factory(groups)
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"the optimizer callable returned {type(optimizer).__name__}, not a torch.optim.Optimizer")
    return optimizer
