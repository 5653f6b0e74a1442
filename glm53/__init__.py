"""glm53-serve: the import namespace root. Subpackages map onto the repository's top-level folders."""

__version__ = "0.1.0"
