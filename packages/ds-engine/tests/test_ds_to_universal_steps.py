"""DeepSpeed's `ds_to_universal` entry point and steps under ds: `main(namespace)` checks before converting
(unconvertible AutoTP parameters refused, missing info refused unless injected), each step replaceable on
the module; `merge_tp_slices` saves a fused projection's sections as DeepSpeed's `SubparamShape`."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("ds_zero", reason="the converter is ds-zero's")

from ds_engine.checkpoint import ds_to_universal  # noqa: E402
from ds_engine.checkpoint.universal_checkpoint import SubparamShape  # noqa: E402


def _args(src: Path, out: Path, **kw: object) -> SimpleNamespace:
    base = dict(input_folder=str(src), output_folder=str(out), num_extract_workers=1, num_merge_workers=1)
    base.update(keep_temp_folder=False, strict=True, inject_missing_state=False)
    base.update(kw)
    return SimpleNamespace(**base)


def test_unconvertible_autotp_parameters_are_refused_with_their_reason() -> None:
    ds_to_universal._validate_autotp_conversion_support({"universal_checkpoint_version": 0.4})
    with pytest.raises(ValueError, match=r"\^a\$: interleaved heads, \^b\$: packed"):
        ds_to_universal._validate_autotp_conversion_support(
            {"autotp_unsupported_parameter_patterns": {"^b$": "packed", "^a$": "interleaved heads"}}
        )


def test_main_checks_through_its_replaceable_steps(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    class Checkpoint:
        global_state: dict = {}

        def get_checkpoint_info(self, key: str) -> object:
            return self.global_state.get(key)

    seen = []
    monkeypatch.setattr(
        ds_to_universal, "_get_optim_files", lambda folder: seen.append(folder) or ["x_optim_states.pt"]
    )
    monkeypatch.setattr(ds_to_universal, "_get_zero_stage", lambda files: 2)
    monkeypatch.setattr(ds_to_universal, "DeepSpeedCheckpoint", lambda folder: Checkpoint())
    with pytest.raises(AssertionError, match="pass --inject_missing_state"):
        ds_to_universal.main(_args(tmp_path / "in", tmp_path / "out"))
    Checkpoint.global_state = {"universal_checkpoint_info": {"autotp_unsupported_parameter_patterns": {"^w$": "why"}}}
    with pytest.raises(ValueError, match=r"\^w\$: why"):
        ds_to_universal.main(_args(tmp_path / "in", tmp_path / "out", inject_missing_state=True))
    assert seen == [str(tmp_path / "in")] * 2


def test_a_missing_info_is_injected_as_the_version_only() -> None:
    class Checkpoint:
        def __init__(self, info: object) -> None:
            self.global_state = {"universal_checkpoint_info": info}

        def get_checkpoint_info(self, key: str) -> object:
            return self.global_state[key]

    bare, kept = Checkpoint(None), Checkpoint({"tp_replicated_parameter_patterns": []})
    ds_to_universal._inject_missing_state(bare)
    ds_to_universal._inject_missing_state(kept)
    assert bare.global_state["universal_checkpoint_info"] == {"universal_checkpoint_version": 0.4}
    assert kept.global_state["universal_checkpoint_info"] == {"tp_replicated_parameter_patterns": []}


def test_optimizer_file_listing_and_stage(tmp_path: Path) -> None:
    for name in ("zero_pp_rank_10_mp_rank_00", "zero_pp_rank_9_mp_rank_00", "bf16_zero_pp_rank_0_mp_rank_00"):
        torch.save({"optimizer_state_dict": {"zero_stage": 3}}, tmp_path / f"{name}_optim_states.pt")
    torch.save({"optimizer_state_dict": {}}, tmp_path / "expert_0_mp_rank_00_optim_states.pt")
    files = ds_to_universal._get_optim_files(tmp_path)
    names = [Path(f).name for f in files]
    assert names.index("zero_pp_rank_9_mp_rank_00_optim_states.pt") < names.index(
        "zero_pp_rank_10_mp_rank_00_optim_states.pt"
    )
    zero = ds_to_universal._filter_zero3_optim_files(files)
    assert len(zero) == 3 and ds_to_universal._get_zero_stage(zero) == 3
    assert ds_to_universal._get_zero_stage([str(tmp_path / "expert_0_mp_rank_00_optim_states.pt")]) == 1
    with pytest.raises(FileNotFoundError, match="not a ZeRO checkpoint"):
        ds_to_universal._get_optim_files(tmp_path / "nothing")


def test_merge_tp_slices_saves_deepspeeds_subparam_shape(tmp_path: Path) -> None:
    whole = torch.randn(6, 3)
    sections = whole.split([2, 2, 2])
    for rank in range(2):
        folder = tmp_path / "tmp" / "w" / str(rank)
        folder.mkdir(parents=True)
        shard = torch.cat([s[rank : rank + 1] for s in sections])
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            torch.save(shard.reshape(-1).clone(), folder / f"{state}.00")
    info = {"parameter_with_sub_params": [{"patterns": ["^w$"], "shape": [(2, 2, 2), 3], "partition_dim": 0}]}
    assert (
        ds_to_universal.merge_tp_slices(info, str(tmp_path / "zero"), str(tmp_path / "tmp"), 2, ("w", [(3, 3)] * 2))
        == set()
    )
    saved = torch.load(tmp_path / "zero" / "w" / "fp32.pt", weights_only=False)
    assert torch.equal(saved["param"], whole)
    assert saved["sub_param_shape"] == SubparamShape(patterns=["^w$"], shape=((2, 2, 2), 3), partition_dim=0)
