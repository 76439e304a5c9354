"""With `deepspeed` imported, files in DeepSpeed's checkpoint layout load with a plain `torch.load`.

ds writes DeepSpeed's layout with stand-ins pickled under DeepSpeed's class paths
(`ds_comm.checkpoint_files.deepspeed_pickle_names`); `torch.load(weights_only=False)` then imports those
paths, which the `deepspeed` distribution resolves to ds modules, so each must hold the class.
"""

from __future__ import annotations

from pathlib import Path

import torch

import deepspeed.utils.tensor_fragment as tensor_fragment
from ds_comm.checkpoint_files import DeepSpeedFragmentAddress, deepspeed_pickle_names


def test_a_pickled_fragment_address_loads_as_deepspeeds_class(tmp_path: Path) -> None:
    address = object.__new__(DeepSpeedFragmentAddress)
    address.__setstate__({"numel": 3, "start": 5})
    with deepspeed_pickle_names():
        torch.save({"param_slice_mappings": [{"w": address}]}, tmp_path / "optim_states.pt")

    loaded = torch.load(tmp_path / "optim_states.pt", weights_only=False)["param_slice_mappings"][0]["w"]

    assert loaded == tensor_fragment.fragment_address(numel=3, start=5)
    assert tensor_fragment.fragment_address is not DeepSpeedFragmentAddress  # the real class came back
