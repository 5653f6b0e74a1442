"""glm53.kernels: one module per op (torch reference, Triton kernel, dispatcher). Import the
modules themselves: the package re-exports nothing, so `from glm53.kernels import x` is always
the module x (a function of the same name bound here would shadow it)."""
