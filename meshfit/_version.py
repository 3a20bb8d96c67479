"""The package version, in one place (read by `meshfit.__version__` and by saved archives)."""

__version__ = "0.1.0"
