"""Side by side: the gradient scale each ZeRO stage gives under sequence parallelism, ds vs DeepSpeed 0.19.8.

    python tools/sp_gradient_scale.py                                    # ds (this interpreter's `deepspeed`)
    DS_ACCELERATOR=cpu /work/dsref/bin/python tools/sp_gradient_scale.py  # DeepSpeed 0.19.8's venv

Two gloo ranks form one sequence-parallel group (SP 2, one data-parallel replica) through DeepSpeed's
`parallel_state_sp` mpu. Each rank holds two of one sample's four tokens; its loss is the mean over its own
tokens (`--loss local`) or ALST's aggregate (`--loss alst`: a differentiable all-gather of the per-rank losses
weighted by token counts). One SGD step with lr 1 makes the update the gradient the engine used, and it is
printed as a multiple of the gradient of the mean loss over all four tokens, one figure per weight.

What this showed (2026-12-05): DeepSpeed 0.19.8 gives 2.0 at ZeRO stages 0, 1 and 2 (it sums over the
sequence-parallel peers and averages over data-parallel replicas only) and 1.0 at stage 3 (it averages over
data x sequence ranks); ds gives 1.0 at every stage.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TOKENS = torch.arange(16, dtype=torch.float32).view(4, 4)  # one sample's four tokens, two per rank


def _rank(rank: int, world: int, port: int, stage: int, loss_kind: str, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_SIZE=str(world),
    )
    torch.set_num_threads(1)
    import deepspeed
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as sp_mpu

    deepspeed.init_distributed(dist_backend="gloo")
    sp_mpu.initialize_sequence_parallel(world)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1, bias=False)
    before = model.weight.detach().clone()
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 1.0}},
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config, mpu=sp_mpu)
    loss = engine(TOKENS[2 * rank : 2 * rank + 2]).pow(2).mean()
    if loss_kind == "alst":  # every rank's loss becomes the whole sequence's mean (two tokens per rank)
        losses = torch.distributed.nn.functional.all_gather(loss * 2, group=sp_mpu.get_sequence_parallel_group())
        loss = sum(losses) / 4
    engine.backward(loss)
    engine.step()
    update = (before - engine.module.weight.detach().cpu()).flatten().tolist()
    with open(f"{out}.{rank}", "w") as f:
        json.dump(update, f)
    dist.barrier()


def _mean_loss_gradient() -> list[float]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1, bias=False)
    model(TOKENS).pow(2).mean().backward()
    assert model.weight.grad is not None
    return model.weight.grad.flatten().tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", default="0,1,2,3")
    parser.add_argument("--loss", choices=["local", "alst"], default="alst")
    args = parser.parse_args()
    reference = _mean_loss_gradient()
    with tempfile.TemporaryDirectory() as tmp:
        for stage in (int(s) for s in args.stages.split(",")):
            out = os.path.join(tmp, f"stage{stage}")
            port = 29500 + (os.getpid() + stage) % 1000
            mp.spawn(_rank, args=(2, port, stage, args.loss, out), nprocs=2)
            for rank in range(2):
                with open(f"{out}.{rank}") as f:
                    update = json.load(f)
                ratios = [round(u / r, 4) for u, r in zip(update, reference, strict=True)]
                print(f"stage {stage}, loss {args.loss}, rank {rank}: update / mean-loss gradient = {ratios}")


if __name__ == "__main__":
    main()
