"""`--include/--exclude` grammar, `--num_nodes/--num_gpus`, and the world info encoding."""

from __future__ import annotations

import base64

import pytest

from ds_launcher import (
    ResourceFilterError,
    apply_num_nodes_and_gpus,
    decode_world_info,
    encode_world_info,
    filter_resources,
    parse_node_spec,
)

POOL = {"worker-0": 4, "worker-1": 4}
ALL = [0, 1, 2, 3]

GOOD = [
    ({}, {"worker-0": ALL, "worker-1": ALL}),
    ({"include": "worker-1:2@worker-0:1"}, {"worker-0": [1], "worker-1": [2]}),  # hostfile order, not spec order
    ({"include": "worker-0"}, {"worker-0": ALL}),
    ({"include": "worker-0:0,2@worker-0:1"}, {"worker-0": [0, 1, 2]}),
    ({"include": "worker-0:3,1,1"}, {"worker-0": [1, 3]}),
    ({"include": "worker-1@worker-0:2"}, {"worker-0": [2], "worker-1": ALL}),
    ({"exclude": "worker-1"}, {"worker-0": ALL}),
    ({"exclude": "worker-0:0@worker-1:1,2"}, {"worker-0": [1, 2, 3], "worker-1": [0, 3]}),
    ({"exclude": "worker-0:0,1,2,3"}, {"worker-1": ALL}),  # a host left with no slots is dropped
]

BAD = [
    (
        {"include": "worker-0", "exclude": "worker-1"},
        "--include and --exclude are mutually exclusive; pass only one of them",
    ),
    (
        {"include": "worker-9"},
        "--include 'worker-9': host 'worker-9' is not in the hostfile (hosts: worker-0, worker-1)",
    ),
    (
        {"exclude": "worker-9:0"},
        "--exclude 'worker-9:0': host 'worker-9' is not in the hostfile (hosts: worker-0, worker-1)",
    ),
    ({"include": "worker-0:7"}, "--include 'worker-0:7': host 'worker-0' has no slot 7 (slots: 0-3)"),
    ({"exclude": "worker-0:1,7"}, "--exclude 'worker-0:1,7': host 'worker-0' has no slot 7 (slots: 0-3)"),
    ({"exclude": "worker-0@worker-1"}, "--exclude 'worker-0@worker-1' leaves no resources to launch on"),
    (
        {"include": "worker-0:x"},
        "--include 'worker-0:x': slot 'x' of host 'worker-0' is not a non-negative integer; "
        "expected e.g. 'worker-0:0,1'",
    ),
    (
        {"include": "worker-0:"},
        "--include 'worker-0:': slot '' of host 'worker-0' is not a non-negative integer; expected e.g. 'worker-0:0,1'",
    ),
    (
        {"include": "worker-0:-1"},
        "--include 'worker-0:-1': slot '-1' of host 'worker-0' is not a non-negative "
        "integer; expected e.g. 'worker-0:0,1'",
    ),
    (
        {"include": "@worker-0"},
        "--include '@worker-0': bad node spec ''; expected NAME[:SLOT,...] joined by '@', e.g. 'worker-0:0,1@worker-1'",
    ),
    (
        {"exclude": ":0"},
        "--exclude ':0': bad node spec ':0'; expected NAME[:SLOT,...] joined by '@', e.g. 'worker-0:0,1@worker-1'",
    ),
]


@pytest.mark.parametrize(("flags", "active"), GOOD)
def test_filters(flags: dict[str, str], active: dict[str, list[int]]) -> None:
    result = filter_resources(POOL, **flags)
    assert result == active
    assert list(result) == list(active)


@pytest.mark.parametrize(("flags", "message"), BAD)
def test_bad_filters(flags: dict[str, str], message: str) -> None:
    with pytest.raises(ResourceFilterError) as info:
        filter_resources(POOL, **flags)
    assert str(info.value) == message


def test_node_spec_accumulates_and_sorts() -> None:
    assert parse_node_spec("a:0,1@b@a:3") == {"a": [0, 1, 3], "b": []}
    assert parse_node_spec("a:2@a") == {"a": []}  # a bare host means all of its slots


@pytest.mark.parametrize(
    ("num_nodes", "num_gpus", "active"),
    [
        (-1, -1, {"worker-0": ALL, "worker-1": ALL}),
        (1, -1, {"worker-0": ALL}),
        (-1, 2, {"worker-0": [0, 1], "worker-1": [0, 1]}),
        (1, 3, {"worker-0": [0, 1, 2]}),
    ],
)
def test_num_nodes_and_gpus(num_nodes: int, num_gpus: int, active: dict[str, list[int]]) -> None:
    full = filter_resources(POOL)
    assert apply_num_nodes_and_gpus(full, num_nodes=num_nodes, num_gpus=num_gpus) == active


@pytest.mark.parametrize(
    ("num_nodes", "num_gpus", "message"),
    [
        (
            3,
            -1,
            "--num_nodes 3: only 2 host(s) available (worker-0, worker-1); add hosts to the hostfile or ask for "
            "fewer nodes",
        ),
        (-1, 5, "--num_gpus 5: host 'worker-0' has only 4 slot(s) in the hostfile; ask for fewer or raise its slots="),
        (0, -1, "--num_nodes 0: must be a positive count (or omitted)"),
        (-1, -3, "--num_gpus -3: must be a positive count (or omitted)"),
    ],
)
def test_bad_num_nodes_and_gpus(num_nodes: int, num_gpus: int, message: str) -> None:
    with pytest.raises(ResourceFilterError) as info:
        apply_num_nodes_and_gpus(filter_resources(POOL), num_nodes=num_nodes, num_gpus=num_gpus)
    assert str(info.value) == message


def test_world_info_is_deepspeeds_encoding() -> None:
    assert encode_world_info({"localhost": [0, 1]}) == "eyJsb2NhbGhvc3QiOiBbMCwgMV19"  # DeepSpeed's bytes
    info = {"worker-1": [2, 3], "worker-0": [0]}
    decoded = decode_world_info(encode_world_info(info))
    assert decoded == info and list(decoded) == ["worker-1", "worker-0"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("%%%", "--world_info '%%%' is not base64url-encoded JSON"),
        (base64.urlsafe_b64encode(b"[1, 2]").decode(), "--world_info decodes to [1, 2]; expected a non-empty"),
        (base64.urlsafe_b64encode(b'{"a": []}').decode(), "--world_info decodes to {'a': []}; expected a non-empty"),
        (base64.urlsafe_b64encode(b'{"a": [-1]}').decode(), "--world_info decodes to {'a': [-1]}; expected"),
    ],
)
def test_bad_world_info(text: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        decode_world_info(text)
    assert str(info.value).startswith(message)
