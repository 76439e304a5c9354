"""`init_inference(model, tensor_parallel={"tp_size": N})`: logits and greedy `generate` tokens equal the
unsharded model's (fp32, 1e-5; tokens exactly), and whole-model checkpoint files load into the shards.

Needs ds-parallel and transformers (the `ds-engine[all]` session); skipped without them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ds_comm.testing import run_ranks

pytest.importorskip("ds_parallel", reason="AutoTP needs ds-parallel: pip install 'ds-engine[parallel]'")
pytest.importorskip("transformers")

from tiny_hf_models import batch, build  # noqa: E402


def _infer(rank: int, world: int, family: str, kv_heads: int, ckpt_dir: str | None) -> dict[str, Any]:
    import ds_engine as deepspeed
    from ds_parallel.tensor import LmHeadLinearAllreduce

    model = build(family, kv_heads=kv_heads)
    ids = batch(size=2, seq=8)
    with torch.no_grad():
        ref_logits = model(ids).logits
        ref_tokens = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    kwargs: dict[str, Any] = {}
    if ckpt_dir is not None:  # load the reference weights from files into a differently initialised model
        if rank == 0:
            torch.save({"module": model.state_dict()}, Path(ckpt_dir) / "part0.pt")
        torch.distributed.barrier()
        model = build(family, kv_heads=kv_heads, seed=7)
        kwargs = {"checkpoint": {"type": "ds_model", "checkpoints": ["part0.pt"], "version": 1.0}, "base_dir": ckpt_dir}
    engine = deepspeed.init_inference(
        model, tensor_parallel={"tp_size": world}, dtype=torch.float32, replace_with_kernel_inject=False, **kwargs
    )
    with torch.no_grad():
        logits = engine(ids).logits
    tokens = engine.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    return {
        "err": (logits - ref_logits).abs().max().item(),
        "same_tokens": torch.equal(tokens, ref_tokens),
        "new_tokens": tokens.shape[1] - ids.shape[1],
        "head_sharded": isinstance(engine.module.lm_head, LmHeadLinearAllreduce),
        "module_is_model": engine.module is model,
    }


@pytest.mark.parametrize(("family", "kv_heads"), [("llama", 4), ("qwen2", 2), ("opt", 4)])
def test_tp2_logits_and_greedy_tokens_equal_unsharded(family: str, kv_heads: int) -> None:
    for r in run_ranks(2, _infer, family, kv_heads, None, timeout_s=180):
        assert r["err"] < 1e-5, r
        assert r["same_tokens"] and r["new_tokens"] > 0, r
        assert r["head_sharded"] and r["module_is_model"]


def test_checkpoint_files_load_into_the_shards(tmp_path: Path) -> None:
    for r in run_ranks(2, _infer, "llama", 2, str(tmp_path), timeout_s=180):
        assert r["err"] < 1e-5, r
        assert r["same_tokens"], r


def _with_policy(rank: int, world: int) -> dict[str, Any]:
    from transformers.models.opt.modeling_opt import OPTDecoderLayer

    import ds_engine as deepspeed

    model = build("opt")
    ids = batch(size=2, seq=8)
    with torch.no_grad():
        ref = model(ids).logits
    policy = {OPTDecoderLayer: ("self_attn.out_proj", "fc2")}
    engine = deepspeed.init_inference(model, tp={"tp_size": world}, dtype=torch.float32, injection_policy=policy)
    with torch.no_grad():
        err = (engine(ids).logits - ref).abs().max().item()
    try:
        deepspeed.init_inference(
            build("opt"), tp={"tp_size": world}, dtype="fp32", injection_dict={OPTDecoderLayer: "fc9"}
        )
    except ValueError as bad:
        return {"err": err, "bad": str(bad)}
    return {"err": err, "bad": "no error"}


def test_user_injection_policy() -> None:
    for r in run_ranks(2, _with_policy, timeout_s=180):
        assert r["err"] < 1e-5, r
        assert "injection policy layer 'fc9' is not in the model" in r["bad"], r
