"""The flops profiler: exact MACs of matrix ops, a small GPT against the 2*N*tokens and 6*N*tokens rules.

N is the number of parameters that take part in matrix multiplies (every Linear weight, the output
head included; not embeddings, biases or norms), tokens = batch x sequence length. A forward is
2*N*tokens flops plus attention's two batched matmuls (4 * batch * layers * T^2 * d); its MACs from
matrix ops are exactly half of that. The flops add elementwise work (activations, softmax, layer
norm, residual adds), so they are checked to 3% above the matrix count. A training step (forward +
backward, measured) is 6*N*tokens plus 3.5x the attention term (torch's attention-backward formula
is 2.5x the forward), checked to 3%.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from ds_engine_testkit import make_engine
from torch import nn
from torch.nn import functional as F

from ds_engine.profiling.flops_profiler import FlopsProfiler, get_model_profile, get_module_macs

B, T, D, HEADS, LAYERS, VOCAB = 2, 16, 32, 4, 2, 64


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.fc = nn.Linear(D, 4 * D)
        self.out = nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).view(x.shape[0], T, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(x.shape)
        x = x + self.proj(a)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.pos = nn.Parameter(torch.zeros(T, D))
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _matmul_params(model: nn.Module) -> int:
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT()


ATTN_FWD = 4 * B * LAYERS * T * T * D  # QK^T and AV, 2 flops per MAC


def test_linear_macs_are_exact() -> None:
    layer = nn.Linear(7, 5)
    flops, macs, params = get_model_profile(layer, input_shape=(3, 7), print_profile=False, as_string=False)
    assert (macs, flops, params) == (3 * 7 * 5, 2 * 3 * 7 * 5, 7 * 5 + 5)


def test_gpt_forward_against_2n_tokens() -> None:
    model = _gpt()
    idx = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(1))
    flops, macs, params = get_model_profile(model, args=[idx], print_profile=False, as_string=False)
    n, tokens = _matmul_params(model), B * T
    assert macs == n * tokens + ATTN_FWD // 2  # matrix ops only: exact
    expected = 2 * n * tokens + ATTN_FWD
    assert expected <= flops <= 1.03 * expected, (flops, expected)
    assert params == sum(p.numel() for p in model.parameters())


def test_per_module_numbers_and_printing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = _gpt()
    idx = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(1))
    prof = FlopsProfiler(model)
    prof.start_profile(ignore_list=[nn.LayerNorm])
    model(idx)
    block = model.blocks[0]
    assert get_module_macs(block.qkv) == B * T * D * 3 * D
    assert get_module_macs(block) == sum(get_module_macs(c) for c in block.children()) + 2 * B * T * T * D
    assert not hasattr(block.ln1, "__flops_handle__") and block.ln1.__flops__ == 0  # ignored: charged to Block
    prof.print_model_profile(profile_step=3, module_depth=1, top_modules=2, output_file=str(tmp_path / "p" / "f.txt"))
    text = (tmp_path / "p" / "f.txt").read_text()
    assert "Profile at step 3" in text and "fwd MACs per rank:" in text
    assert "(blocks): ModuleList(" in text and "(qkv)" not in text  # module_depth=1
    assert "depth 0:" in text
    prof.print_model_profile(detailed=False)
    assert "fwd flops per rank:" in capsys.readouterr().out
    prof.end_profile()
    assert not hasattr(block.qkv, "__flops__")
    before = model.blocks[0].qkv.weight.clone()
    model(idx)  # hooks and the dispatch mode are gone
    assert torch.equal(before, model.blocks[0].qkv.weight)


def test_get_model_profile_bad_input() -> None:
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        get_model_profile("model", input_shape=(1,))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="give input_shape, or args"):
        get_model_profile(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="mode must be 'forward' or 'generate'"):
        get_model_profile(nn.Linear(2, 2), input_shape=(1, 2), mode="backward")


class LMLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gpt = _gpt()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        logits = self.gpt(idx)
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), idx[:, 1:].reshape(-1))


def test_engine_profiles_a_training_step_against_6n_tokens(tmp_path: Path) -> None:
    out = tmp_path / "flops.txt"
    config = {
        "train_micro_batch_size_per_gpu": B,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "flops_profiler": {"enabled": True, "profile_step": 1, "output_file": str(out), "top_modules": 2},
    }
    model = LMLoss()
    engine = make_engine(model, config)
    prof = engine.flops_profiler
    data = torch.randint(0, VOCAB, (3, B, T), generator=torch.Generator().manual_seed(2))
    for step in range(3):
        engine.backward(engine(data[step]))
        engine.step()
        if step == 0:
            assert not out.exists()  # step 0 is the warm-up
    text = out.read_text()
    n, tokens = _matmul_params(model), B * T
    train = prof.flops + prof.backward_flops
    expected = 6 * n * tokens + 3.5 * ATTN_FWD
    assert expected <= train <= 1.03 * expected, (train, expected, train / (6 * n * tokens))
    assert math.isclose(prof.backward_flops / prof.flops, 2.0, rel_tol=0.1)
    for label in ("fwd flops per rank:", "bwd flops per rank (measured):", "step latency:", "batch size per rank:"):
        assert label in text
    assert not hasattr(model.gpt, "__flops__")  # profile ended after the step
