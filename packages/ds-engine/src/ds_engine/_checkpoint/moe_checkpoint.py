"""MoE checkpoints in DeepSpeed's layout: one file per (layer, global expert), experts out of the model states.

    <tag>/layer_{L}_expert_{E}_mp_rank_00_model_states.pt   expert E of the L-th MoE layer (module order): its
                                                            parameters and buffers under the module path with
                                                            the GLOBAL expert index
    <tag>/mp_rank_00_model_states.pt                        the module without expert entries, plus
                                                            `num_experts` (a list, per MoE layer)
    <tag>/expp_rank_{R}_mp_rank_00_optim_states.pt          stage 0: expert-parallel rank R's optimizer
    <tag>/zero_pp_rank_{r}_mp_rank_00_optim_states.pt       ZeRO 1-3: as for dense models; expert
                                                            fragments are named globally

At ZeRO stage 3 (AutoEP only: DeepSpeed-MoE layers are refused there) no expert file is written, as in
DeepSpeed: the experts are in the ZeRO partitions alone, and load from there (`partitioned_expert_states`).

AutoEP layers keep their local experts stacked in `experts.w1/w2/w3` (`[num_local_experts, ...]`); their
expert file holds row i of each under `<layer>.experts.<w>.<E>` (DeepSpeed's AutoEP layout), and loading
stacks the rows of this rank's experts back, so those weights too load at any expert-parallel degree.

Each expert file is written by rank 0 of that expert's expert-data-parallel group. Loading reads, for each
local expert, the file of its global index, so weights load at any expert-parallel degree; ZeRO partitions
re-partition by their global names too, an AutoEP expert range across expert-parallel degrees as well
(`ds_zero._checkpoint.expert_ranges`), optimizer state included. A stage-0 optimizer state is positional (the
local experts' parameters), so it loads only at the expert-parallel degree it was saved with.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import ds_comm
from ds_engine._checkpoint.checkpoint import zero_file
from ds_engine._checkpoint.constants import (
    AUTOEP_EP_SIZE,
    AUTOEP_EXPERT_KEY_PREFIX,
    AUTOEP_LAYERS_KEY,
    AUTOEP_NUM_EXPERTS,
    AUTOEP_NUM_LOCAL_EXPERTS,
    AUTOEP_ZERO3_EXPERT_STATE_FORMAT_KEY,
    AUTOEP_ZERO3_EXPERT_STATE_FORMAT_VERSION,
    AUTOEP_ZERO3_EXPERT_STATE_FORMAT_VERSION_KEY,
    AUTOEP_ZERO3_PARTITIONED_EXPERT_STATE_FORMAT,
    EXPERT_PARAMETER_PATTERNS,
    FOLDING_METADATA_KEY,
    UNIVERSAL_CHECKPOINT_INFO,
    UNIVERSAL_CHECKPOINT_VERSION_KEY,
    UNIVERSAL_CHECKPOINT_VERSION_VALUE,
)
from ds_engine._checkpoint.offline.autoep_folding import (
    check_folding_record,
    make_folding_metadata,
    non_expert_param_families,
    param_family,
)
from ds_engine._optional import require
from ds_engine._step.moe import MoeLayer, MoeWiring, moe_layout

logger = logging.getLogger(__name__)

__all__ = [
    "check_folded_file",
    "check_folded_zero_file",
    "expert_file",
    "folding_record",
    "load_moe_state_dict",
    "merge_expert_states",
    "non_expert_state",
    "optimizer_file",
    "partitioned_expert_states",
    "read_stage0_optimizer",
    "write_expert_files",
    "zero_folding_record",
]


def expert_file(ckpt_dir: Path, layer_id: int, expert_id: int, mp_rank: int) -> Path:
    return ckpt_dir / f"layer_{layer_id}_expert_{expert_id}_mp_rank_{mp_rank:02d}_model_states.pt"


def optimizer_file(ckpt_dir: Path, ep_rank: int, mp_rank: int) -> Path:
    return ckpt_dir / f"expp_rank_{ep_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def non_expert_state(module_state: dict[str, Any], wiring: MoeWiring) -> dict[str, Any]:
    """The module state dict without expert entries (they go to the expert files)."""
    return {k: v for k, v in module_state.items() if k not in wiring.expert_names}


def write_expert_files(
    module: nn.Module,
    wiring: MoeWiring,
    ckpt_dir: Path,
    *,
    mp_rank: int,
    save: Callable[[Any, Path], None],
    state: dict[str, Any] | None = None,
) -> None:
    """This rank's expert files: every local expert of every layer where it writes them (`_writes_experts`).

    `save`: writes one file (`_checkpoint.decoupled.file_saver`). `state`: the expert tensors' values (default
    the module's state dict).
    """
    state = module.state_dict() if state is None else state
    for layer_id, layer in enumerate(wiring.layers):
        if not _writes_experts(wiring, layer):
            continue
        per_expert: dict[int, dict[str, torch.Tensor]] = {}
        for name in layer.fused_experts:
            for i in range(layer.num_local_experts):
                expert_id = layer.ep_rank * layer.num_local_experts + i
                per_expert.setdefault(expert_id, {})[f"{name}.{expert_id}"] = state[name][i].detach().clone()
        head = f"{layer.prefix}." if layer.prefix else ""
        for local_name, global_name in wiring.expert_names.items():
            if not local_name.startswith(head + "deepspeed_moe."):
                continue
            expert_id = _expert_index(global_name)
            per_expert.setdefault(expert_id, {})[global_name] = state[local_name].detach().clone()
        record = _expert_record(wiring, layer)
        for expert_id, tensors in sorted(per_expert.items()):
            tensors.update(record)
            save(tensors, expert_file(ckpt_dir, layer_id, expert_id, mp_rank))


def _writes_experts(wiring: MoeWiring, layer: MoeLayer) -> bool:
    """Whether this rank writes `layer`'s local experts: the first of their replicas under each file name.

    An expert file is named by the writer's model-parallel rank, and a rank loads the files of its own. Without
    folding that is expert-data-parallel rank 0. Folded with AutoTP, the replicas of an expert (its
    expert-data-parallel group) may sit at several tensor-parallel ranks (`autoep_size` below `autotp_size`):
    the first replica at each tensor-parallel rank writes, so every rank finds its experts under its own
    name, as DeepSpeed's folded checkpoints have them.
    """
    if wiring.folding is None:
        return layer.edp_rank == 0
    tp_size = wiring.folding.spec.tp_size
    rank = ds_comm.get_rank()
    return all(r % tp_size != rank % tp_size for r in wiring.folding.edp_ranks if r < rank)


def _tp_rank(wiring: MoeWiring) -> int:
    return int(wiring.folding.tp_ranks.index(ds_comm.get_rank()))


def _largest(wiring: MoeWiring) -> MoeLayer:
    return max(wiring.layers, key=lambda layer: int(layer.group_name.rsplit("_", 1)[1]))


def _expert_record(wiring: MoeWiring, layer: MoeLayer) -> dict[str, Any]:
    """The `folding` entry of a routed-expert file (partitioned over the expert-data-parallel group), or `{}`."""
    if wiring.folding is None:
        return {}
    spec = wiring.folding.spec
    return {
        FOLDING_METADATA_KEY: make_folding_metadata(
            tp_size=spec.tp_size,
            tp_rank=_tp_rank(wiring),
            ep_size=spec.ep_size,
            ep_rank=layer.ep_rank,
            zero_partition_group="edp",
            zero_partition_rank=layer.edp_rank,
            zero_partition_count=spec.edp_size,
            family="routed_expert",
        )
    }


def folding_record(
    wiring: MoeWiring | None, *, family: str, dp_rank: int, names: list[str] | None = None
) -> dict[str, Any]:
    """The `folding` entry of the model-states file (`family="dense"`, `names`: its entries) or of a ZeRO
    optimizer file (`"zero_optimizer_state"`, `names`: the parameters it partitions), or `{}` unfolded."""
    if wiring is None or wiring.folding is None:
        return {}
    spec, largest = wiring.folding.spec, _largest(wiring)
    if family == "dense":
        group, families = "dense_dp", non_expert_param_families(names or [])
    else:
        group, families = "per_family", {}
        for name in names or []:
            expert = param_family(name) == "routed_expert"
            families[name] = {
                "family": param_family(name),
                "zero_partition_group": "edp" if expert else "dense_dp",
                "zero_partition_rank": largest.edp_rank if expert else dp_rank,
                "zero_partition_count": spec.edp_size if expert else spec.dp_size,
            }
    return {
        FOLDING_METADATA_KEY: make_folding_metadata(
            tp_size=spec.tp_size,
            tp_rank=_tp_rank(wiring),
            ep_size=spec.ep_size,
            ep_rank=largest.ep_rank,
            zero_partition_group=group,
            zero_partition_rank=dp_rank,
            zero_partition_count=spec.dp_size,
            family=family,
            param_families=families,
        )
    }


def check_folded_file(state: Any, wiring: MoeWiring | None, path: Path, *, family: str) -> None:
    """A loaded file's `folding` entry against this run (`check_folding_record`); experts: `family="routed_expert"`.

    Raises:
        RuntimeError: a folded file in an unfolded run, or a missing or different record in a folded one.
    """
    folding = wiring.folding if wiring is not None else None
    if folding is None:
        check_folding_record(state, folded=None, where=str(path))
        return
    spec = folding.spec
    group, count = {"dense": ("dense_dp", spec.dp_size), "routed_expert": ("edp", spec.edp_size)}.get(
        family, ("per_family", spec.dp_size)
    )
    check_folding_record(
        state,
        folded=spec,
        where=str(path),
        family=family,
        zero_partition_group=group,
        zero_partition_count=count,
        tp_rank=_tp_rank(wiring),
    )


def zero_folding_record(wiring: MoeWiring | None, stepper: Any, module: nn.Module, dist: Any) -> dict[str, Any]:
    """A folded run's `folding` entry for this rank's ZeRO optimizer file (every parameter's family), or `{}`."""
    if wiring is None or wiring.folding is None or stepper is None:
        return {}
    ds_zero = require("ds_zero", extra="zero", feature="saving a ZeRO checkpoint")
    names = [name for group in ds_zero.zero_param_shapes(stepper.optimizer, module) for name in group]
    return folding_record(wiring, family="zero_optimizer_state", dp_rank=dist.dp_rank, names=names)


def check_folded_zero_file(ckpt_dir: Path, wiring: MoeWiring | None, *, dp_rank: int, mp_rank: int) -> None:
    """In a folded run, this rank's ZeRO optimizer file must carry this topology (`check_folded_file`)."""
    if wiring is None or wiring.folding is None:
        return
    own = zero_file(ckpt_dir, dp_rank, mp_rank)
    check_folded_file(ds_comm.load_checkpoint_file(own), wiring, own, family="zero_optimizer_state")


def _expert_index(global_name: str) -> int:
    marker = "deepspeed_experts."
    rest = global_name[global_name.index(marker) + len(marker) :]
    return int(rest.split(".", 1)[0])


def merge_expert_states(
    module_state: dict[str, Any], wiring: MoeWiring, ckpt_dir: Path, *, mp_rank: int
) -> dict[str, Any]:
    """`module_state` plus this rank's local experts, read from the files of their global indices.

    Raises:
        FileNotFoundError: an expert file is missing (names it and the layer's expert count).
        KeyError: an expert file lacks an entry this model has.
    """
    out = dict(module_state)
    for layer_id, layer in enumerate(wiring.layers):
        if layer.fused_experts:
            out.update(_stacked_experts(layer_id, layer, ckpt_dir, mp_rank=mp_rank, wiring=wiring))
    wanted: dict[tuple[int, int], list[tuple[str, str]]] = {}
    for layer_id, layer in enumerate(wiring.layers):
        head = f"{layer.prefix}." if layer.prefix else ""
        for local_name, global_name in wiring.expert_names.items():
            if local_name.startswith(head + "deepspeed_moe."):
                wanted.setdefault((layer_id, _expert_index(global_name)), []).append((local_name, global_name))
    for (layer_id, expert_id), names in sorted(wanted.items()):
        path = expert_file(ckpt_dir, layer_id, expert_id, mp_rank)
        if not path.is_file():
            raise FileNotFoundError(
                f"load_checkpoint: {path} is missing (MoE layer {layer_id} has "
                f"{wiring.layers[layer_id].num_experts} experts); was the checkpoint saved with MoE layers?"
            )
        saved = ds_comm.load_checkpoint_file(path)
        for local_name, global_name in names:
            if global_name not in saved:
                raise KeyError(f"{path} has no entry {global_name!r} (it has {sorted(saved)[:4]}...)")
            out[local_name] = saved[global_name]
    return out


def _stacked_experts(
    layer_id: int, layer: MoeLayer, ckpt_dir: Path, *, mp_rank: int, wiring: MoeWiring
) -> dict[str, torch.Tensor]:
    """An AutoEP layer's local expert tensors, stacked from the files of its global expert indices."""
    rows: dict[str, list[torch.Tensor]] = {name: [] for name in layer.fused_experts}
    for i in range(layer.num_local_experts):
        expert_id = layer.ep_rank * layer.num_local_experts + i
        path = expert_file(ckpt_dir, layer_id, expert_id, mp_rank)
        if not path.is_file():
            raise FileNotFoundError(
                f"load_checkpoint: {path} is missing (AutoEP layer {layer.prefix!r} has {layer.num_experts} "
                "experts); was the checkpoint saved from a model with the same MoE blocks?"
            )
        saved = ds_comm.load_checkpoint_file(path)
        check_folded_file(saved, wiring, path, family="routed_expert")
        for name in layer.fused_experts:
            key = f"{name}.{expert_id}"
            if key not in saved:
                raise KeyError(f"{path} has no entry {key!r} (it has {sorted(saved)[:4]}...)")
            rows[name].append(saved[key])
    return {name: torch.stack(tensors) for name, tensors in rows.items()}


def autoep_layers_entry(wiring: MoeWiring, zero_stage: int = 0, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """`{"ds_autoep_layers": [...], "universal_checkpoint_info": {...}}` for the model-states file (DeepSpeed's
    keys), or `{}` without AutoEP layers. The universal info (the one in `extra`, the other engine keys of the
    file, extended) names the expert tensors and layers, as DeepSpeed's engine records them for `ds_to_universal`.

    At ZeRO stage 3 each entry also carries DeepSpeed's stage-3 fields: the format marker
    (`checkpoint_format: "zero3_partitioned"`, which `zero_to_fp32` refuses) and where this rank's experts sit
    (expert-parallel rank, expert-data-parallel rank and size, global expert range).
    """
    autoep = [layer for layer in wiring.layers if layer.fused_experts]
    entries = []
    for index, layer in enumerate(autoep):
        entry: dict[str, Any] = {
            "moe_layer_id": index,  # DeepSpeed's two keys for the block (`name` is ds's older one, still read)
            "module_path": layer.prefix,
            "name": layer.prefix,
            AUTOEP_EXPERT_KEY_PREFIX: f"{layer.prefix}.experts" if layer.prefix else "experts",
            AUTOEP_NUM_EXPERTS: layer.num_experts,
            AUTOEP_NUM_LOCAL_EXPERTS: layer.num_local_experts,
            AUTOEP_EP_SIZE: layer.num_experts // layer.num_local_experts,
        }
        if zero_stage == 3:
            start = layer.ep_rank * layer.num_local_experts
            entry.update(
                {
                    AUTOEP_ZERO3_EXPERT_STATE_FORMAT_KEY: AUTOEP_ZERO3_PARTITIONED_EXPERT_STATE_FORMAT,
                    AUTOEP_ZERO3_EXPERT_STATE_FORMAT_VERSION_KEY: AUTOEP_ZERO3_EXPERT_STATE_FORMAT_VERSION,
                    "ep_group_name": layer.group_name,
                    "ep_rank": layer.ep_rank,
                    "expert_data_parallel_rank": layer.edp_rank,
                    "expert_data_parallel_world_size": ds_comm.get_world_size(wiring.edp_groups[layer.group_name]),
                    "global_expert_start": start,
                    "global_expert_end": start + layer.num_local_experts,
                }
            )
        entries.append(entry)
    if not entries:
        return {}
    info = dict((extra or {}).get(UNIVERSAL_CHECKPOINT_INFO) or {})
    info.setdefault(UNIVERSAL_CHECKPOINT_VERSION_KEY, UNIVERSAL_CHECKPOINT_VERSION_VALUE)
    info[EXPERT_PARAMETER_PATTERNS] = [r".*\.experts\.w[123]$"]
    info[AUTOEP_LAYERS_KEY] = entries
    return {AUTOEP_LAYERS_KEY: entries, UNIVERSAL_CHECKPOINT_INFO: info}


def read_stage0_optimizer(ckpt_dir: Path, wiring: MoeWiring, *, mp_rank: int) -> dict[str, Any]:
    """This rank's stage-0 optimizer state from its expert-parallel rank's file.

    Raises:
        ValueError: the file is missing or was saved at another expert-parallel degree (the state is
            positional); load with load_optimizer_states=False or resume under ZeRO 1/2 then.
    """
    ep_rank, ep_size = _largest_group_rank(wiring)
    path = optimizer_file(ckpt_dir, ep_rank, mp_rank)
    if not path.is_file():
        raise ValueError(
            f"load_checkpoint: {path} is missing; the checkpoint was saved at another expert-parallel "
            "degree or under ZeRO. A stage-0 optimizer state loads only at the degree it was saved with: "
            "pass load_optimizer_states=False (or use ZeRO stage 1/2, which re-partitions)"
        )
    saved = ds_comm.load_checkpoint_file(path)
    check_folded_file(saved, wiring, path, family="routed_expert")
    if int(saved.get("ep_size", ep_size)) != ep_size:
        raise ValueError(
            f"load_checkpoint: {path} holds the optimizer of expert-parallel size {saved['ep_size']}, this run "
            f"has {ep_size}; pass load_optimizer_states=False (or use ZeRO stage 1/2, which re-partitions)"
        )
    return saved["optimizer"]


def write_stage0_optimizer(
    state: dict[str, Any], wiring: MoeWiring, ckpt_dir: Path, *, mp_rank: int, save: Callable[[Any, Path], None]
) -> None:
    """Stage 0: the writer of the largest expert group's files (`_writes_experts`) writes its expert-parallel
    rank's file, under its own model-parallel rank."""
    ep_rank, ep_size = _largest_group_rank(wiring)
    largest = max(wiring.layers, key=lambda layer: int(layer.group_name.rsplit("_", 1)[1]))
    if not _writes_experts(wiring, largest):
        return
    save(
        {"optimizer": state, "ep_size": ep_size, **_expert_record(wiring, largest)},
        optimizer_file(ckpt_dir, ep_rank, mp_rank),
    )


def _largest_group_rank(wiring: MoeWiring) -> tuple[int, int]:
    largest = max(wiring.layers, key=lambda layer: int(layer.group_name.rsplit("_", 1)[1]))
    return largest.ep_rank, int(largest.group_name.rsplit("_", 1)[1])


def load_moe_state_dict(
    checkpoint_path: str | Path,
    tag: Any,
    state_dict: dict[str, Any],
    old_moe_load: bool = False,
    model: nn.Module | None = None,
    mpu: Any = None,
    num_experts: int | list[int] = 1,
    checkpoint_engine: Any = None,
    autoep_layers: Any = None,
    folding_spec: Any = None,
    checkpoint_mp_rank: int | None = None,
) -> None:
    """DeepSpeed's `DeepSpeedEngine.load_moe_state_dict`: add `model`'s local experts to `state_dict`, in place.

    For scripts that load a model-states file themselves (Megatron-style): the expert entries are read
    from `<checkpoint_path>/<tag>/layer_{L}_expert_{E}_...` files by global expert index and stored under
    this rank's local names, so `model.load_state_dict(state_dict)` works at any expert-parallel degree.
    `num_experts`, `checkpoint_engine` and `folding_spec` are accepted for DeepSpeed's signature; the counts
    and the folding come from the model's MoE layers and the files are read with ds's restricted unpickler.
    `autoep_layers` (a model-states file's `ds_autoep_layers`) is checked as DeepSpeed checks it;
    `checkpoint_mp_rank` (default: `mpu`'s model-parallel rank, or 0) picks the files' `mp_rank_XX`. A model
    without MoE layers loads nothing, as in DeepSpeed (with a warning).

    Raises:
        ValueError: no `model`, or `old_moe_load` (DeepSpeed's pre-0.5 layout).
        RuntimeError: `autoep_layers` is malformed (`check_autoep_layers`).
        FileNotFoundError: an expert file is missing (named).
    """
    if old_moe_load:
        raise ValueError("load_moe_state_dict(old_moe_load=True): DeepSpeed's pre-0.5 MoE layout is not supported")
    if model is None:
        raise ValueError("load_moe_state_dict needs model= (the module whose MoE layers name the local experts)")
    if autoep_layers is not None:
        check_autoep_layers(autoep_layers)
    layers, expert_names = moe_layout(model)
    if not layers:
        logger.warning("load_moe_state_dict: %s has no MoE layers; no expert entries loaded", type(model).__name__)
        return
    wiring = MoeWiring(ep_groups={}, edp_groups={}, edp_src={}, layers=layers, expert_names=expert_names)
    mp_rank = checkpoint_mp_rank if checkpoint_mp_rank is not None else expert_file_mp_rank(mpu)
    state_dict.update(merge_expert_states(state_dict, wiring, Path(checkpoint_path) / str(tag), mp_rank=mp_rank))


#: The fields every `ds_autoep_layers` entry has (DeepSpeed 0.19.8 refuses an entry without one).
AUTOEP_LAYER_FIELDS = (
    "moe_layer_id",
    "module_path",
    "num_experts",
    "num_local_experts",
    "ep_size",
    "expert_key_prefix",
)


def check_autoep_layers(entries: Any) -> None:
    """DeepSpeed's check of a model-states file's `ds_autoep_layers`: a list of dicts with `AUTOEP_LAYER_FIELDS`,
    no `moe_layer_id` or `expert_key_prefix` twice.

    Raises:
        RuntimeError: what is wrong ("malformed", "missing fields [...]", "duplicate ..."), as DeepSpeed says it.
    """
    if not isinstance(entries, list):
        raise RuntimeError(f"ds_autoep_layers metadata is malformed: expected list, got {type(entries).__name__}")
    seen: dict[str, set[Any]] = {"moe_layer_id": set(), "expert_key_prefix": set()}
    for entry in entries:
        if not isinstance(entry, dict):
            raise RuntimeError(f"ds_autoep_layers entry is malformed: expected dict, got {type(entry).__name__}")
        missing = sorted(set(AUTOEP_LAYER_FIELDS) - entry.keys())
        if missing:
            raise RuntimeError(f"ds_autoep_layers entry is invalid: missing fields {missing}")
        for key, values in seen.items():
            if entry[key] in values:
                raise RuntimeError(f"ds_autoep_layers metadata has duplicate {key}: {entry[key]}")
            values.add(entry[key])


def expert_file_mp_rank(mpu: Any) -> int:
    """The `mp_rank_XX` of the expert files this rank reads: its model-parallel rank in `mpu`, 0 without one."""
    return 0 if mpu is None else int(mpu.get_model_parallel_rank())


def partitioned_expert_states(
    module_state: dict[str, Any], wiring: MoeWiring, parts: list[dict[str, Any]]
) -> dict[str, Any]:
    """ZeRO-3: `module_state` plus this rank's AutoEP expert tensors, read from the save's ZeRO partitions.

    At stage 3 a save writes no expert files (as DeepSpeed's): each stacked expert tensor is in the partitions
    under its ZeRO name, `<module name>@experts{lo}:{hi}`. The range this rank holds now is read from the ranges
    the save holds, so the weights load at any expert-parallel degree (`ds_zero.fp32_param_values`).

    Raises:
        ValueError: the partitions do not hold this rank's expert range (names it).
    """
    ds_zero = require("ds_zero", extra="zero", feature="loading a ZeRO stage-3 checkpoint")
    names = {local: wiring.expert_names[local] for layer in wiring.layers for local in layer.fused_experts}
    values = ds_zero.fp32_param_values(parts, names.values())
    return {**module_state, **{local: values[zero_name] for local, zero_name in names.items()}}
