"""glm53.kernels: one module per op (torch reference, Triton kernel, dispatcher). Import the
modules themselves: the package re-exports nothing, so `from glm53.kernels import x` is always
the module x (a function of the same name bound here would shadow it).

Triton's FP fusion (a product and a sum contracted to one FMA) is pinned on unless the user set
`TRITON_DEFAULT_FP_FUSION`: the kernels were written, timed and bit-checked against their
references with it on, and Triton 3.10 turns its default off (3.9 warns that it will)."""

import os

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
