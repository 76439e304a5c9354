"""`deepspeed.compression`: what remains of DeepSpeed's compression package at 0.19.8.

DeepSpeed 0.19.8 no longer has the compression library (quantization-aware training, pruning, layer
reduction); the package stays only so that `deepspeed.compression.helper`, which DeepSpeed-Chat and other
scripts import `recursive_getattr`/`recursive_setattr` from, still resolves. Those two live in
`deepspeed.utils.module_utils`.
"""

from __future__ import annotations
