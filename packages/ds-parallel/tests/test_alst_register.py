"""`UlyssesSPAttentionHF.register_with_transformers` refuses what would run wrong, before building anything
(no process group is needed to get these errors): an unknown core attention, a loaded model whose attention
is not the core (its calls would not run sequence-parallel), a fixed length without `seq_length` or not a
multiple of the SP size (`max_length` is `seq_length`'s deprecated spelling), and head counts P cannot split;
the attention itself refuses a call without `position_ids` or, registered with a fixed length, of another length.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from ds_parallel.ulysses_sp import UlyssesSPAttentionHF  # noqa: E402


def config(heads: int = 4, kv_heads: int = 4) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
    )


def test_unknown_core_is_refused() -> None:
    with pytest.raises(ValueError, match=r"core_attn_implementation='sdpa2' is not one of \[.*'sdpa'"):
        UlyssesSPAttentionHF.register_with_transformers(config(), "sdpa2", 2)
    with pytest.raises(ValueError, match="core_attn_implementation='ulysses' is not one of"):
        UlyssesSPAttentionHF.register_with_transformers(config(), "ulysses", 2)


def test_loaded_model_with_another_attention_is_refused() -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config(), attn_implementation="eager", dtype=torch.float32)
    with pytest.raises(ValueError, match="core_attn_implementation='sdpa' but the model was loaded with .*'eager'"):
        UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2)


def test_fixed_length_needs_a_seq_length_p_divides(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ValueError, match="seq_length_is_variable=False needs seq_length"):
        UlyssesSPAttentionHF.register_with_transformers(config(), "sdpa", 2, seq_length_is_variable=False)
    with caplog.at_level(logging.WARNING), pytest.raises(ValueError, match="seq_length=15 is not a multiple of"):
        UlyssesSPAttentionHF.register_with_transformers(
            config(), "sdpa", 2, max_length=15, seq_length_is_variable=False
        )
    assert "max_length is deprecated" in caplog.text


def test_sp_size_one_does_nothing() -> None:
    assert UlyssesSPAttentionHF.register_with_transformers(config(), "sdpa2", 1) is None


@pytest.mark.parametrize(
    ("heads", "kv_heads", "match"),
    [(3, 3, "attn_head_count=3 is not a multiple"), (4, 3, "kv_head_count=3 neither divides")],
)
def test_head_counts_p_cannot_split_are_refused(heads: int, kv_heads: int, match: str) -> None:
    from unittest import mock

    import ds_comm

    with (
        mock.patch.object(ds_comm, "get_world_size", return_value=2),
        mock.patch.object(ds_comm, "get_rank", return_value=0),
        pytest.raises(ValueError, match=match),
    ):
        UlyssesSPAttentionHF(lambda *a, **k: None, 1, heads, 4, kv_heads, 1, None, seq_length_is_variable=True)


def two_rank_attention(**kwargs: Any) -> Any:
    """An SP=2 `UlyssesSPAttentionHF` built without a process group (its checks run before any exchange)."""
    from unittest import mock

    import ds_comm

    with (
        mock.patch.object(ds_comm, "get_world_size", return_value=2),
        mock.patch.object(ds_comm, "get_rank", return_value=0),
    ):
        return UlyssesSPAttentionHF(lambda *a, **k: None, 1, 4, 8, 4, 1, None, **kwargs)


def test_fixed_length_is_checked_on_every_call() -> None:
    attention = two_rank_attention(seq_length_is_variable=False, local_seq_length=8, global_seq_length=16)
    module = torch.nn.Module()  # training mode
    q = torch.zeros(1, 4, 6, 8)
    with pytest.raises(ValueError, match=r"expects 8 tokens per rank \(seq_length 16 / 2\), got 6"):
        attention(module, q, q, q, None, position_ids=torch.arange(6)[None])


def test_attention_calls_need_position_ids() -> None:
    attention = two_rank_attention(seq_length_is_variable=True)
    q = torch.zeros(1, 4, 8, 8)
    with pytest.raises(ValueError, match="the attention call has no position_ids"):
        attention(torch.nn.Module(), q, q, q, None)
