"""The package's version (pyproject.toml says the same; a test holds them equal)."""

__version__ = "0.1.0"
