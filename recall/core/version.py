"""The version of recall (one place: the package, the tune cache and the batch manifest read it)."""
__version__ = "0.1.0"
