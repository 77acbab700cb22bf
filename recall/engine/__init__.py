"""The engine: the public embedded API (``Engine``) and its query pipeline over the backend protocol."""
from .engine import Engine, PendingSearch, TopK

__all__ = ["Engine", "PendingSearch", "TopK"]
