"""Version of the `deepspeed` compatibility distribution (hatch reads it; the only line a release bumps).

`0.19.8` is the DeepSpeed API level the ds packages implement (config keys, engine methods, module
paths, checkpoint layout of DeepSpeed 0.19.8); `+ds<N>` is this distribution's own release count.
A PEP 440 local label, not `.post<N>`: requirements written against DeepSpeed compare the public part
only, so `deepspeed>=0.9.3` (transformers), Accelerate's `compare_versions("deepspeed", "<", "0.16.4")`
gates *and* an exact pin `deepspeed==0.19.8` in a user's requirements are all satisfied, and pip does not
replace this distribution with upstream DeepSpeed to meet such a pin (it would for `0.19.8.post1`).
"""

__version__ = "0.19.8+ds1"
