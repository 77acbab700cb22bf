"""Tools around the engine: ``recall doctor`` (is this machine's stack sound?) and ``recall tune`` (the best tiling
of a shape, cached)."""
