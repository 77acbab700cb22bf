"""`recall bench` (placeholder until the harness lands)."""


def register(app) -> None:  # noqa: D103
    pass
