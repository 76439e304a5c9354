"""Selecting resources: `--include/--exclude` specs, `--num_nodes/--num_gpus`, and the base64 world info.

A resource pool is `{host: slots}` (from the hostfile); the active resources are
`{host: [slot ids]}` in hostfile order. The world info handed to every node is the active
resources as base64url-encoded JSON, byte-identical to DeepSpeed's so either side can read it.
"""

from __future__ import annotations

import base64
import binascii
import json
import re

_NAME = re.compile(r"^[^\s:@,]+$")


class ResourceFilterError(ValueError):
    """A bad `--include/--exclude/--num_nodes/--num_gpus` request; the message names the flag and value."""


def parse_node_spec(spec: str, *, flag: str = "--include") -> dict[str, list[int]]:
    """Parse `NODE_SPEC[@NODE_SPEC ...]`, `NODE_SPEC = NAME[:SLOT[,SLOT ...]]`.

    A host given twice accumulates its slots, which come back sorted and de-duplicated; a host
    with no slot list maps to `[]`, meaning "all its slots".

    Example: `parse_node_spec("a:0,1@b@a:3") == {"a": [0, 1, 3], "b": []}`.

    Raises:
        ResourceFilterError: an empty node spec, a bad host name, or a slot that is not a
            non-negative integer (the message quotes `flag` and the offending piece).
    """
    result: dict[str, list[int]] = {}
    whole: set[str] = set()
    for node in spec.split("@"):
        name, sep, slot_text = node.partition(":")
        if not name or not _NAME.match(name):
            raise ResourceFilterError(
                f"{flag} {spec!r}: bad node spec {node!r}; "
                "expected NAME[:SLOT,...] joined by '@', e.g. 'worker-0:0,1@worker-1'"
            )
        slots = result.setdefault(name, [])
        if not sep:
            whole.add(name)
            continue
        for piece in slot_text.split(","):
            if not re.fullmatch(r"[0-9]+", piece.strip()):
                raise ResourceFilterError(
                    f"{flag} {spec!r}: slot {piece!r} of host {name!r} is not a "
                    "non-negative integer; expected e.g. 'worker-0:0,1'"
                )
            slots.append(int(piece))
    return {name: ([] if name in whole else sorted(set(slots))) for name, slots in result.items()}


def _check_known(pool: dict[str, list[int]], requested: dict[str, list[int]], flag: str, spec: str) -> None:
    for host, slots in requested.items():
        if host not in pool:
            known = ", ".join(pool)
            raise ResourceFilterError(f"{flag} {spec!r}: host {host!r} is not in the hostfile (hosts: {known})")
        for slot in slots:
            if slot not in pool[host]:
                have = pool[host]
                have_text = (
                    f"0-{len(have) - 1}" if have == list(range(len(have))) else ",".join(map(str, have))
                ) or "none"
                raise ResourceFilterError(f"{flag} {spec!r}: host {host!r} has no slot {slot} (slots: {have_text})")


def filter_resources(pool: dict[str, int], *, include: str = "", exclude: str = "") -> dict[str, list[int]]:
    """Apply `--include` or `--exclude` to a pool.

    Include starts from nothing and adds what the spec names (a bare host adds all its slots);
    exclude starts from everything and removes what the spec names (a bare host removes the
    host). Hosts left without slots are dropped. The result follows hostfile order, not spec order.

    Args:
        pool: `{host: slots}` from the hostfile (or the local host).
        include: an include spec, or "" for none.
        exclude: an exclude spec, or "" for none.

    Raises:
        ResourceFilterError: both specs given, an unknown host or slot, a bad spec, or nothing left.
    """
    active = select_slots({host: list(range(slots)) for host, slots in pool.items()}, include=include, exclude=exclude)
    if not active:
        raise ResourceFilterError(
            f"{'--include' if include else '--exclude'} {include or exclude!r} leaves no resources to launch on"
        )
    return active


def select_slots(slots_by_host: dict[str, list[int]], *, include: str = "", exclude: str = "") -> dict[str, list[int]]:
    """`filter_resources` on `{host: [slot ids]}`, where a selection that leaves nothing is `{}`, not an error.

    Raises:
        ResourceFilterError: both specs given, an unknown host or slot, or a bad spec.
    """
    if include and exclude:
        raise ResourceFilterError("--include and --exclude are mutually exclusive; pass only one of them")
    full = {host: list(slots) for host, slots in slots_by_host.items()}
    if not include and not exclude:
        return full
    flag, spec = ("--include", include) if include else ("--exclude", exclude)
    requested = parse_node_spec(spec, flag=flag)
    _check_known(full, requested, flag, spec)
    active: dict[str, list[int]] = {}
    for host, slots in full.items():
        if include:
            if host in requested:
                active[host] = requested[host] or slots
        else:
            removed = set(requested[host] or slots) if host in requested else set()
            active[host] = [s for s in slots if s not in removed]
    return {host: slots for host, slots in active.items() if slots}


def apply_num_nodes_and_gpus(
    active: dict[str, list[int]], *, num_nodes: int = -1, num_gpus: int = -1
) -> dict[str, list[int]]:
    """Keep the first `num_nodes` hosts, then slots `[0, num_gpus)` on each (-1: no limit).

    Raises:
        ResourceFilterError: a count of 0 or below -1, more nodes than available, or more slots
            than a host has.
    """
    for flag, value in (("--num_nodes", num_nodes), ("--num_gpus", num_gpus)):
        if value == 0 or value < -1:
            raise ResourceFilterError(f"{flag} {value}: must be a positive count (or omitted)")
    if num_nodes > len(active):
        raise ResourceFilterError(
            f"--num_nodes {num_nodes}: only {len(active)} host(s) available "
            f"({', '.join(active)}); add hosts to the hostfile or ask for fewer nodes"
        )
    hosts = list(active)[:num_nodes] if num_nodes > 0 else list(active)
    result: dict[str, list[int]] = {}
    for host in hosts:
        if num_gpus > 0:
            if num_gpus > len(active[host]):
                raise ResourceFilterError(
                    f"--num_gpus {num_gpus}: host {host!r} has only {len(active[host])} "
                    "slot(s) in the hostfile; ask for fewer or raise its slots="
                )
            result[host] = list(range(num_gpus))
        else:
            result[host] = list(active[host])
    return result


def encode_world_info(active: dict[str, list[int]]) -> str:
    """`{host: [slots]}` as base64url(JSON), the `--world_info` every node's launcher receives."""
    return base64.urlsafe_b64encode(json.dumps(active).encode("utf-8")).decode("ascii")


def decode_world_info(text: str) -> dict[str, list[int]]:
    """Inverse of `encode_world_info`, with its shape checked.

    Raises:
        ValueError: not base64url JSON of `{str: [int, ...]}`, or empty.
    """
    try:
        value = json.loads(base64.urlsafe_b64decode(text.encode("ascii")))
    except (binascii.Error, UnicodeError, ValueError):
        raise ValueError(
            f"--world_info {text!r} is not base64url-encoded JSON; it is written by the "
            "`deepspeed` runner, pass it through unchanged"
        ) from None
    ok = (
        isinstance(value, dict)
        and value
        and all(
            isinstance(h, str) and isinstance(s, list) and s and all(isinstance(i, int) and i >= 0 for i in s)
            for h, s in value.items()
        )
    )
    if not ok:
        raise ValueError(f"--world_info decodes to {value!r}; expected a non-empty {{host: [slot, ...]}} map")
    return value
