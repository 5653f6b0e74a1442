"""glm53-serve: the import root. `server`, `models`, `kernels` and `transport` are its subpackages."""

__version__ = "0.1.0"
