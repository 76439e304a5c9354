"""AutoEP folded with AutoTP: the topology record each checkpoint file carries, and its check at load time.

A folded run's files are cut by three layouts at once (tensor-parallel lanes for the dense layers, expert
ranks for the routed experts, ZeRO partitions per family), so a file read by a run of another topology
would load the wrong slices without an error. Each file therefore carries, under DeepSpeed 0.19.8's key
`folding`, the topology it was written at and which family it holds (DeepSpeed's record, field for field):
the model-states file the dense family (`dense_dp` partitions), each expert file and the stage-0 expert
optimizer file the routed experts (`edp`), a ZeRO optimizer file every parameter's family
(`zero_optimizer_state`, partitioned `per_family`). Loading in a folded run needs the record and the same
topology; a folded record in an unfolded run is refused too.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ds_engine._checkpoint.constants import (
    FOLDING_DISPATCH_STRATEGY,
    FOLDING_EP_RANK,
    FOLDING_EP_SIZE,
    FOLDING_ETP_RANK,
    FOLDING_ETP_SIZE,
    FOLDING_FAMILY,
    FOLDING_METADATA_KEY,
    FOLDING_METADATA_VERSION,
    FOLDING_PARAM_FAMILIES,
    FOLDING_SHARED_EXPERT_PLACEMENT,
    FOLDING_TP_RANK,
    FOLDING_TP_SIZE,
    FOLDING_ZERO_PARTITION_COUNT,
    FOLDING_ZERO_PARTITION_GROUP,
    FOLDING_ZERO_PARTITION_RANK,
)

__all__ = [
    "check_folding_record",
    "make_folding_metadata",
    "non_expert_param_families",
    "param_family",
    "validate_folding_metadata",
]

#: How each lane's share of the routed assignments is chosen, and where shared experts live (DeepSpeed's words).
DISPATCH_STRATEGY = "route_full_partition_dispatch"
SHARED_EXPERT_PLACEMENT = "tp_sharded"


def make_folding_metadata(
    *,
    tp_size: int,
    tp_rank: int,
    ep_size: int,
    ep_rank: int,
    zero_partition_group: str,
    zero_partition_rank: int,
    zero_partition_count: int,
    family: str,
    param_families: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The `folding` record of one file (expert tensor parallelism is always 1 here)."""
    metadata: dict[str, Any] = {
        "version": FOLDING_METADATA_VERSION,
        FOLDING_TP_SIZE: tp_size,
        FOLDING_TP_RANK: tp_rank,
        FOLDING_EP_SIZE: ep_size,
        FOLDING_EP_RANK: ep_rank,
        FOLDING_ETP_SIZE: 1,
        FOLDING_ETP_RANK: 0,
        FOLDING_ZERO_PARTITION_GROUP: zero_partition_group,
        FOLDING_ZERO_PARTITION_RANK: zero_partition_rank,
        FOLDING_ZERO_PARTITION_COUNT: zero_partition_count,
        FOLDING_DISPATCH_STRATEGY: DISPATCH_STRATEGY,
        FOLDING_SHARED_EXPERT_PLACEMENT: SHARED_EXPERT_PLACEMENT,
        FOLDING_FAMILY: family,
    }
    if param_families is not None:
        metadata[FOLDING_PARAM_FAMILIES] = dict(param_families)
    return metadata


def validate_folding_metadata(
    metadata: Any,
    *,
    tp_size: int,
    ep_size: int,
    etp_size: int = 1,
    tp_rank: int | None = None,
    ep_rank: int | None = None,
    etp_rank: int | None = None,
    zero_partition_group: str | None = None,
    zero_partition_rank: int | None = None,
    zero_partition_count: int | None = None,
    family: str | None = None,
    param_families: Mapping[str, Any] | None = None,
    shared_expert_placement: str | None = None,
    dispatch_strategy: str | None = None,
) -> dict[str, Any]:
    """The `folding` record of a loaded file's dict, checked against this run (sizes always, the rest when given).

    Raises:
        RuntimeError: the record is missing, of another version, or a field differs (names it, both values).
    """
    if not isinstance(metadata, dict) or FOLDING_METADATA_KEY not in metadata:
        raise RuntimeError("Missing AutoEP+AutoTP folding metadata in folded checkpoint.")
    folding = metadata[FOLDING_METADATA_KEY]
    if folding.get("version") != FOLDING_METADATA_VERSION:
        raise RuntimeError(f"Unsupported folding metadata version: {folding.get('version')}")
    expected: dict[str, Any] = {FOLDING_TP_SIZE: tp_size, FOLDING_EP_SIZE: ep_size, FOLDING_ETP_SIZE: etp_size}
    optional = {
        FOLDING_TP_RANK: tp_rank,
        FOLDING_EP_RANK: ep_rank,
        FOLDING_ETP_RANK: etp_rank,
        FOLDING_ZERO_PARTITION_GROUP: zero_partition_group,
        FOLDING_ZERO_PARTITION_RANK: zero_partition_rank,
        FOLDING_ZERO_PARTITION_COUNT: zero_partition_count,
        FOLDING_FAMILY: family,
        FOLDING_PARAM_FAMILIES: None if param_families is None else dict(param_families),
        FOLDING_SHARED_EXPERT_PLACEMENT: shared_expert_placement,
        FOLDING_DISPATCH_STRATEGY: dispatch_strategy,
    }
    expected.update({key: value for key, value in optional.items() if value is not None})
    for key, value in expected.items():
        if folding.get(key) != value:
            raise RuntimeError(f"Folding metadata mismatch for {key}: saved={folding.get(key)} runtime={value}")
    return dict(folding)


def param_family(name: str) -> str:
    """A parameter's family by its name: `routed_expert`, `router_gate_replicated`, `shared_expert` or `dense`."""
    if ".experts." in name:
        return "routed_expert"
    if ".router." in name:
        return "router_gate_replicated"
    if ".shared_experts" in name:
        return "shared_expert"
    return "dense"


def non_expert_param_families(names: Iterable[str]) -> dict[str, str]:
    """`{name: family}` for a model-states file's entries (the routed experts live in their own files)."""
    return {name: param_family(name) for name in names}


def check_folding_record(state: Any, *, folded: Any, where: str, **expected: Any) -> None:
    """Check a loaded file's record against this run; `folded` is the run's `ParallelFoldingSpec` or None.

    Raises:
        RuntimeError: a folded record in an unfolded run; in a folded run, a missing or different record (the
            message names the file `where`).
    """
    has = isinstance(state, dict) and FOLDING_METADATA_KEY in state
    if folded is None:
        if has:
            raise RuntimeError(
                f"{where}: Folded AutoEP+AutoTP checkpoint requires a folded runtime with matching "
                "tensor_parallel.autotp_size and expert_parallel.autoep_size."
            )
        return
    try:
        validate_folding_metadata(
            state,
            tp_size=folded.tp_size,
            ep_size=folded.ep_size,
            etp_size=folded.etp_size,
            etp_rank=0,
            shared_expert_placement=SHARED_EXPERT_PLACEMENT,
            dispatch_strategy=DISPATCH_STRATEGY,
            **expected,
        )
    except RuntimeError as err:
        raise RuntimeError(f"{where}: {err}") from None
