"""AutoEP folded with AutoTP on 4 gloo ranks: tensor_parallel.autotp_size 2 x expert_parallel.autoep_size 2.

A tiny config-built Mixtral (4 experts, top-2; nothing downloaded) has its attention cut by AutoTP
(q/k/v by columns, o by rows, from `partition_config`) and its MoE blocks converted by AutoEP; the expert
groups are consecutive ranks {0,1}, {2,3} (the tensor-parallel groups), the dense data-parallel groups
{0,2}, {1,3}. The ranks of a tensor-parallel group feed the same batch, so the job sees two distinct batches.

- training: at ZeRO 0, 1 and 2 (fp32, Adam, with gradient clipping that acts), the losses, the whole
  weights (TP shards and experts gathered) after each step and the global gradient norms equal plain
  PyTorch's on one process, training the unconverted model on the mean loss of the two batches with
  `torch.optim.Adam` and `clip_grad_norm_` (1e-5);
- bf16 at ZeRO 1 (with `validate_folding_routing`, the lanes' routing checked on every forward): the same
  within bf16's tolerance;
- checkpoints: saved after two steps at ZeRO 2 and loaded by a fresh engine of the same topology, the third
  step gives bit-identical losses and weights; every file carries its `folding` record (family, partition
  group and count), and an unfolded run, or a folded file without its record, is refused;
- refusals: autoep_size 1 names the key before work starts;
- autoep_size 2 below autotp_size 4 (the expert groups split the tensor-parallel group, as DeepSpeed allows):
  the same equalities at ZeRO 0, 1 and 2 with every rank on one batch, and a ZeRO-2 checkpoint that resumes.

Needs ds-parallel and transformers; skipped without them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ds_comm.testing import run_ranks

pytest.importorskip("ds_parallel", reason="AutoEP needs ds-parallel: pip install 'ds-engine[parallel]'")
pytest.importorskip("transformers", reason="AutoEP converts Hugging Face models")

TP, EP, STEPS, LR, CLIP, TOL = 2, 2, 3, 1e-2, 0.3, 1e-5
FFN = 24
SPECS = [
    {"patterns": [r".*\.self_attn\.(q_proj|k_proj|v_proj)\.weight$"], "partition_type": "column"},
    {"patterns": [r".*\.self_attn\.o_proj\.weight$"], "partition_type": "row"},
]


def _mixtral(kv_heads: int = 2) -> Any:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=FFN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=32,
    )
    return MixtralForCausalLM(cfg).float()


def _batch(replica: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + replica)
    return torch.randint(0, 32, (2, 6), generator=g)


def _config(stage: int, *, ep: int = EP, tp: int = TP, bf16: bool = False) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": LR}},
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage},
        "expert_parallel": {"enabled": True, "autoep_size": ep, "preset_model": "mixtral"},
        "tensor_parallel": {"autotp_size": tp, "partition_config": {"use_default_specs": False, "layer_specs": SPECS}},
    }
    if bf16:
        config["bf16"] = {"enabled": True}
    return config


def _engine(config: dict[str, Any], kv_heads: int = 2) -> Any:
    import ds_engine as deepspeed
    from ds_parallel import groups

    groups.reset_mesh()
    engine, *_ = deepspeed.initialize(model=_mixtral(kv_heads), config=config)
    return engine


def _whole(engine: Any) -> dict[str, torch.Tensor]:
    """The model's whole weights in the unconverted model's names (TP shards and experts gathered)."""
    import ds_comm

    state = {k: v.detach().float().clone() for k, v in engine.module_state_dict().items()}
    out = {}
    for name, value in state.items():
        if ".experts.w" in name:
            continue
        out[name.replace(".mlp.router.gate.", ".mlp.gate.")] = value
    for name, p in engine.module.named_parameters():
        if ".experts.w" not in name:
            continue
        layer = engine.module.get_submodule(name.rsplit(".experts.", 1)[0])
        parts = [torch.empty_like(p.data) for _ in range(layer.ep_size)]
        ds_comm.all_gather(parts, p.data.contiguous(), group=layer.ep_group)
        out[name] = torch.cat(parts).float()
    for block in {n.rsplit(".experts.", 1)[0] for n in list(out) if ".experts.w" in n}:
        w1, w3, w2 = (out.pop(f"{block}.experts.{w}") for w in ("w1", "w3", "w2"))
        out[f"{block}.experts.gate_up_proj"] = torch.cat([w1, w3], dim=1)
        out[f"{block}.experts.down_proj"] = w2
    return out


def _reference(
    replicas: int = 2, kv_heads: int = 2
) -> tuple[list[list[float]], list[dict[str, torch.Tensor]], list[float]]:
    """Plain PyTorch on one process: the mean loss of the replicas' batches, Adam, clip_grad_norm_.

    Returns each step's per-replica losses, the weights after it and the gradient norm before clipping.
    """
    model = _mixtral(kv_heads)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    losses, weights, norms = [], [], []
    for step in range(STEPS):
        parts = [model(input_ids=_batch(r, step), labels=_batch(r, step)).loss for r in range(replicas)]
        loss = sum(parts) / replicas
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        assert norm > 2 * CLIP  # the clipping acts, so the engines' norms must be whole-model norms
        optimizer.step()
        optimizer.zero_grad()
        losses.append([float(p.detach()) for p in parts])
        weights.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        norms.append(float(norm))
    return losses, weights, norms


def _run(engine: Any, replica: int, steps: range) -> tuple[list[float], list[dict[str, torch.Tensor]], list[float]]:
    """Train `steps`; each step's loss, whole weights after it, and the global gradient norm it clipped by
    (Adam barely moves when a clip coefficient is wrong, so the norm is checked itself)."""
    losses, weights, norms = [], [], []
    for step in steps:
        ids = _batch(replica, step)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        weights.append(_whole(engine))
        norms.append(float(engine.get_global_grad_norm()))
    return losses, weights, norms


def _records(tag_dir: Path) -> dict[str, tuple[str, str, int]]:
    """file name -> (family, partition group, partition count) of its `folding` record."""
    out = {}
    for path in sorted(tag_dir.glob("*.pt")):
        record = torch.load(path, weights_only=False).get("folding")
        if record is not None:
            out[path.name] = (record["family"], record["zero_partition_group"], record["zero_partition_count"])
            if record["family"] == "dense":
                families = record["param_families"]
                assert families["model.layers.0.mlp.router.gate.weight"] == "router_gate_replicated"
                assert families["model.layers.0.self_attn.q_proj.weight"] == "dense"
    return out


def _load_refusal(config: dict[str, Any], root: str) -> str:
    engine = _engine(config)
    try:
        engine.load_checkpoint(root, tag="folded")
    except RuntimeError as err:
        return str(err)
    return "not refused"


def _refusal(config: dict[str, Any]) -> str:
    try:
        _engine(config)
    except ValueError as err:
        return str(err)
    return "not refused"


def _job(rank: int, world: int, root: str) -> dict[str, Any]:
    replica = rank // TP  # the two ranks of a tensor-parallel group feed the same batch
    out: dict[str, Any] = {"replica": replica, "rank": rank}
    for stage in (0, 1, 2):
        engine = _engine(_config(stage))
        layer = engine.module.model.layers[0].mlp
        out["layout"] = (layer.folding_group_handles.ep_ranks, layer.folding_group_handles.edp_ranks, layer.tp_size)
        out[stage] = _run(engine, replica, range(STEPS))
    engine = _engine(
        {
            **_config(1, bf16=True),
            "expert_parallel": {**_config(1)["expert_parallel"], "validate_folding_routing": True},
        }
    )
    out["bf16"] = _run(engine, replica, range(STEPS))
    engine = _engine(_config(2))
    _at_save = _run(engine, replica, range(2))[1][-1]
    engine.save_checkpoint(root, tag="folded")
    out["after_save"] = _run(engine, replica, range(2, 3))
    engine = _engine(_config(2))
    engine.load_checkpoint(root, tag="folded")
    out["after_load"] = _run(engine, replica, range(2, 3))
    out["records"] = _records(Path(root) / "folded")
    if rank == 0:  # the expert files rejoin into whole tensors (universal format): every expert written once
        from ds_engine.checkpoint.autoep_universal import consolidate_autoep_expert_files

        entries = torch.load(Path(root) / "folded" / "mp_rank_00_model_states.pt", weights_only=False)
        consolidate_autoep_expert_files(str(Path(root) / "folded"), root + "/universal", entries["ds_autoep_layers"])
        for block in ("model.layers.0.mlp", "model.layers.1.mlp"):
            w1, w3, w2 = (torch.load(f"{root}/universal/zero/{block}.experts.w{w}/fp32.pt")["param"] for w in "132")
            torch.testing.assert_close(torch.cat([w1, w3], dim=1), _at_save[f"{block}.experts.gate_up_proj"])
            torch.testing.assert_close(w2, _at_save[f"{block}.experts.down_proj"])
    out["refused_unfolded_load"] = _load_refusal(_config(2, ep=1, tp=1), root)
    import ds_comm

    ds_comm.barrier()
    if rank == 0:  # a folded checkpoint without its record is refused
        for path in (Path(root) / "folded").glob("mp_rank_*_model_states.pt"):
            state = torch.load(path, weights_only=False)
            del state["folding"]
            torch.save(state, path)
    ds_comm.barrier()
    out["refused_missing_record"] = _load_refusal(_config(2), root)
    out["refused_ep1"] = _refusal(_config(1, ep=1))
    return out


def _job_ep_below_tp(rank: int, world: int, root: str) -> dict[str, Any]:
    """autotp_size 4, autoep_size 2: one tensor-parallel group {0..3}, expert groups {0,1} and {2,3}, so the
    peers 0 and 2 (1 and 3) hold the same experts; one data-parallel replica (every rank feeds batch 0)."""
    out: dict[str, Any] = {}
    for stage in (0, 1, 2):
        engine = _engine(_config(stage, ep=2, tp=4), kv_heads=4)
        handles = engine.module.model.layers[0].mlp.folding_group_handles
        out["layout"] = (handles.ep_ranks, handles.edp_ranks)
        out[stage] = _run(engine, 0, range(STEPS))
    engine = _engine(_config(2, ep=2, tp=4), kv_heads=4)
    at_save = _run(engine, 0, range(2))[1][-1]
    engine.save_checkpoint(root, tag="ep_below_tp")
    if rank == 0:  # each expert is in two files (its replicas at two tensor-parallel ranks), rejoined as one
        from ds_engine.checkpoint.autoep_universal import consolidate_autoep_expert_files

        tag = Path(root) / "ep_below_tp"
        out["expert_files"] = sorted(p.name for p in tag.glob("layer_0_expert_*"))
        entries = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=False)
        consolidate_autoep_expert_files(str(tag), root + "/universal", entries["ds_autoep_layers"])
        w1, w3, w2 = (
            torch.load(f"{root}/universal/zero/model.layers.0.mlp.experts.w{w}/fp32.pt")["param"] for w in "132"
        )
        torch.testing.assert_close(torch.cat([w1, w3], dim=1), at_save["model.layers.0.mlp.experts.gate_up_proj"])
        torch.testing.assert_close(w2, at_save["model.layers.0.mlp.experts.down_proj"])
    out["after_save"] = _run(engine, 0, range(2, 3))
    engine = _engine(_config(2, ep=2, tp=4), kv_heads=4)
    engine.load_checkpoint(root, tag="ep_below_tp")
    out["after_load"] = _run(engine, 0, range(2, 3))
    engine = _engine(_config(0, ep=2, tp=4), kv_heads=4)  # stage 0: the optimizer state is in expert files too
    _run(engine, 0, range(2))
    engine.save_checkpoint(root, tag="ep_below_tp_stage0")
    out["stage0_after_save"] = _run(engine, 0, range(2, 3))
    engine = _engine(_config(0, ep=2, tp=4), kv_heads=4)
    engine.load_checkpoint(root, tag="ep_below_tp_stage0")
    out["stage0_after_load"] = _run(engine, 0, range(2, 3))
    return out


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name].float(), rtol=tol, atol=tol, msg=name)


def _check_stages(
    r: dict[str, Any], want: list[float], ref_weights: list[dict[str, torch.Tensor]], ref_norms: list[float]
) -> None:
    """Each ZeRO stage's losses, whole weights and gradient norms against plain PyTorch's (1e-5)."""
    for stage in (0, 1, 2):
        losses, weights, norms = r[stage]
        assert max(abs(a - b) for a, b in zip(losses, want, strict=True)) < TOL, (stage, losses, want)
        assert norms == pytest.approx(ref_norms, rel=TOL), (stage, norms, ref_norms)
        for got, ref in zip(weights, ref_weights, strict=True):
            _close(got, ref, TOL)


@pytest.mark.timeout(600)
def test_autoep_folded_with_autotp_trains_like_one_process_and_resumes(tmp_path: Path) -> None:
    results = run_ranks(4, _job, str(tmp_path), timeout_s=560)
    ref_losses, ref_weights, ref_norms = _reference()
    for r in results:
        first, lane = 2 * r["replica"], r["rank"] % 2
        assert r["layout"] == ((first, first + 1), (lane, lane + 2), 2)
        want = [parts[r["replica"]] for parts in ref_losses]
        _check_stages(r, want, ref_weights, ref_norms)
        losses, weights, _ = r["bf16"]
        assert max(abs(a - b) for a, b in zip(losses, want, strict=True)) < 5e-2, (losses, want)
        _close(weights[-1], ref_weights[-1], 5e-2)
        assert r["after_save"][0] == r["after_load"][0]
        _close(r["after_load"][1][0], r["after_save"][1][0], 0.0)
        records = r["records"]
        assert records["mp_rank_00_model_states.pt"] == ("dense", "dense_dp", 2)
        assert records["layer_0_expert_0_mp_rank_00_model_states.pt"] == ("routed_expert", "edp", 2)
        assert records["layer_1_expert_3_mp_rank_01_model_states.pt"] == ("routed_expert", "edp", 2)
        assert records["zero_pp_rank_1_mp_rank_01_optim_states.pt"] == ("zero_optimizer_state", "per_family", 2)
        assert "requires a folded runtime" in r["refused_unfolded_load"], r["refused_unfolded_load"]
        assert "Missing AutoEP+AutoTP folding metadata" in r["refused_missing_record"], r["refused_missing_record"]
        assert "expert_parallel.autoep_size" in r["refused_ep1"], r["refused_ep1"]


@pytest.mark.timeout(600)
def test_autoep_size_below_autotp_size_trains_like_one_process(tmp_path: Path) -> None:
    """DeepSpeed folds AutoEP into AutoTP also when the expert groups split a tensor-parallel group: each
    expert is then held by two peers of one tensor-parallel group (its expert-data-parallel replicas), run on
    disjoint halves of the lanes' assignments; at ZeRO 1/2 the peers hold other slices of it. The losses,
    whole weights and gradient norms equal plain PyTorch's at ZeRO 0, 1 and 2; ZeRO-2 and ZeRO-0 checkpoints
    resume bit for bit."""
    results = run_ranks(4, _job_ep_below_tp, str(tmp_path), timeout_s=560)
    ref_losses, ref_weights, ref_norms = _reference(replicas=1, kv_heads=4)
    want = [parts[0] for parts in ref_losses]
    for r in results:
        rank = results.index(r)
        assert r["layout"] == ((rank - rank % 2, rank - rank % 2 + 1), (rank % 2, rank % 2 + 2))
        _check_stages(r, want, ref_weights, ref_norms)
        for saved, loaded in (("after_save", "after_load"), ("stage0_after_save", "stage0_after_load")):
            assert r[saved][0] == r[loaded][0]
            _close(r[loaded][1][0], r[saved][1][0], 0.0)
    # experts 0 and 1 live on ranks 0 and 2 (tensor-parallel ranks 0 and 2), experts 2 and 3 on ranks 1 and 3
    assert results[0]["expert_files"] == [
        f"layer_0_expert_{e}_mp_rank_{mp:02d}_model_states.pt"
        for e, mp in ((0, 0), (0, 2), (1, 0), (1, 2), (2, 1), (2, 3), (3, 1), (3, 3))
    ]
