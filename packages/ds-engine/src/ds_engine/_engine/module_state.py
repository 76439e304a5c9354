"""The engine's module weights in and out: `module_state_dict()` and `load_module_state_dict(checkpoint, ...)`.

Both keep DeepSpeed 0.19.8's signatures, which scripts call and subclasses override: `load_module_state_dict`
takes the whole checkpoint dict (its `"module"` entry is the state dict), `fetch_z3_params` /
`z3_params_to_fetch` gather ZeRO-3 parameters (all partitioned ones / the listed ones) around the load, rank 0's
values winning, and `allowed_missing_keys` lets a strict load miss exactly those keys (any other missing or
unexpected key is an error naming them; a non-strict load stays non-strict). With tensor parallelism the
saved weights are whole and each rank keeps its shards; with random-LTD the saved names are mapped onto the
wrapped model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ds_engine._optional import require

if TYPE_CHECKING:
    from ds_engine.config import ZeroSettings

__all__ = ["EngineModuleState"]


class EngineModuleState:
    """Mixed into `DeepSpeedEngine`."""

    module: nn.Module
    _tp: Any
    _zero_settings: ZeroSettings
    if TYPE_CHECKING:  # the engine's (`EngineDataEfficiency`)

        def _with_random_ltd_names(self, state: dict[str, Any]) -> dict[str, Any]: ...

        def _without_random_ltd_names(self, state: dict[str, Any]) -> dict[str, Any]: ...

    def module_state_dict(
        self,
        destination: dict[str, Any] | None = None,
        prefix: str = "",
        keep_vars: bool = False,
        exclude_frozen_parameters: bool = False,
    ) -> dict[str, Any]:
        """The wrapped module's state_dict, optionally without frozen parameters.

        With tensor parallelism the weights are whole (gathered: a collective on the tensor-parallel
        group), so checkpoints load at any tensor-parallel size, or without it. With random-LTD the
        wrappers' `.random_ltd_layer` is left out of the names (as DeepSpeed saves them).
        """
        if self._tp is not None:
            full = self._tp_full_state_dict()
            state = type(full)((prefix + k, v) for k, v in full.items())
        else:
            state = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            frozen = {prefix + n for n, p in self.module.named_parameters() if not p.requires_grad}
            state = type(state)((k, v) for k, v in state.items() if k not in frozen)
        return self._without_random_ltd_names(state)

    def _tp_full_state_dict(self) -> dict[str, Any]:
        """Whole weights of a tensor-parallel model; at ZeRO stage 3 each rank first gathers its shards over
        the data-parallel ranks (its tensor-parallel part of the model, whole, for the duration)."""
        assert self._tp is not None
        if self._zero_settings.stage != 3:
            return self._tp.full_state_dict(self.module)
        ds_zero = require("ds_zero", extra="zero", feature="ZeRO stage 3 with tensor parallelism")
        with ds_zero.GatheredParameters(list(self.module.parameters()), modifier_rank=None):
            return {k: v.clone() for k, v in self._tp.full_state_dict(self.module).items()}

    def load_module_state_dict(
        self,
        checkpoint: Mapping[str, Any],
        strict: bool = True,
        custom_load_fn: Callable[..., Any] | None = None,
        fetch_z3_params: bool = False,
        z3_params_to_fetch: Iterable[torch.Tensor] | None = None,
        allowed_missing_keys: Iterable[str] | None = None,
    ) -> None:
        """Load `checkpoint["module"]` into the wrapped module (copied into the existing, already cast parameters).

        Args:
            checkpoint: a checkpoint dict, as `torch.load` of a model-states file gives it (DeepSpeed's argument).
            strict: as `nn.Module.load_state_dict`.
            custom_load_fn: called as `custom_load_fn(src=state_dict, dst=module)` instead of the load.
            fetch_z3_params: at ZeRO stage 3, gather every partitioned parameter for the load.
            z3_params_to_fetch: gather only these (wins over `fetch_z3_params`).
            allowed_missing_keys: under `strict`, module keys the checkpoint may lack.

        Raises:
            TypeError: `checkpoint` has no `"module"` dict (a bare state dict: pass `{"module": state_dict}`).
            RuntimeError: a strict load with `allowed_missing_keys` met other missing or unexpected keys.
        """
        state = checkpoint.get("module") if isinstance(checkpoint, Mapping) else None
        if not isinstance(state, Mapping):
            keys = sorted(checkpoint)[:5] if isinstance(checkpoint, Mapping) else type(checkpoint).__name__
            raise TypeError(
                "load_module_state_dict(checkpoint): expected a checkpoint dict whose 'module' entry is the module's "
                f"state dict, as DeepSpeed takes it (got {keys}); for a bare state dict pass {{'module': state_dict}}"
            )
        with self._gathered_for_load(fetch_z3_params, z3_params_to_fetch):
            if custom_load_fn is not None:
                custom_load_fn(src=state, dst=self.module)
                return
            state = self._with_random_ltd_names(dict(state))
            if allowed_missing_keys is not None and strict:
                result = self._load_weights(state, strict=False)
                missing = set(result.missing_keys) - set(allowed_missing_keys) if result is not None else set()
                unexpected = set(result.unexpected_keys) if result is not None else set()
                if missing or unexpected:
                    raise RuntimeError(
                        "load_module_state_dict: the checkpoint's module state does not match the model outside "
                        f"AutoEP expert parameters (allowed_missing_keys): missing {sorted(missing)}, unexpected "
                        f"{sorted(unexpected)}"
                    )
            else:
                self._load_weights(state, strict=strict)

    def _gathered_for_load(
        self, fetch_all: bool, listed: Iterable[torch.Tensor] | None
    ) -> contextlib.AbstractContextManager[Any]:
        """ZeRO-3 parameters gathered for the load (rank 0's values kept and re-partitioned after), or nothing."""
        if listed is not None:
            params = [p for p in listed if hasattr(p, "ds_id")]
        elif fetch_all:
            params = [p for p in self.module.parameters() if hasattr(p, "ds_id")]
        else:
            params = []
        if not params:
            return contextlib.nullcontext()
        ds_zero = require("ds_zero", extra="zero", feature="load_module_state_dict(fetch_z3_params=...)")
        return ds_zero.GatheredParameters(params, modifier_rank=0)

    def _load_weights(self, state: dict[str, Any], *, strict: bool) -> Any:
        """The load itself: `nn.Module.load_state_dict`'s result, or None where tensor parallelism cut the weights."""
        if self._tp is not None and self._zero_settings.stage == 3:  # every data-parallel rank loads the same shard
            ds_zero = require("ds_zero", extra="zero", feature="ZeRO stage 3 with tensor parallelism")
            with ds_zero.GatheredParameters(list(self.module.parameters()), modifier_rank=0):
                self._tp.load_full_state_dict(self.module, state, strict=strict)
            return None
        if self._tp is not None:
            self._tp.load_full_state_dict(self.module, state, strict=strict)
            return None
        return self.module.load_state_dict(state, strict=strict)
