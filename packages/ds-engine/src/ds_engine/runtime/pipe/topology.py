"""`deepspeed.runtime.pipe.topology`: ds-pipe's API (`ds_pipe` keeps its topology classes at the top level).

`_prime_factors` is DeepSpeed's helper of this module (how its `PipelineParallelGrid` splits a world with no
topology into pipeline and data dims); scripts and DeepSpeed's own tests import it from here.
"""

from __future__ import annotations

from ds_engine._reexport import optional_reexport

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.runtime.pipe.topology",
    "ds_pipe",
    extra="pipe",
    feature="ds_engine.runtime.pipe.topology (deepspeed.runtime.pipe.topology, pipeline parallelism)",
)


def _prime_factors(n: int) -> list[int]:
    """The prime factors of `n` in ascending order, with multiplicity (`[]` for 1).

    Raises:
        ValueError: `n` is not a positive integer.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ValueError(f"_prime_factors: n must be a positive integer, got {n!r}")
    factors: list[int] = []
    candidate = 2
    while candidate * candidate <= n:
        while n % candidate == 0:
            factors.append(candidate)
            n //= candidate
        candidate += 1
    if n > 1:
        factors.append(n)
    return factors
