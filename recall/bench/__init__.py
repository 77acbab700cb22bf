"""The measuring instrument: named workloads and a matrix of cells around them, contenders (this engine, FAISS,
cuVS, torch), an exact float64 oracle and reports.

Modules: ``workloads`` (named shapes, seeded data kinds), ``exclusions`` (per-user exclusions and what each contender
does with them), ``contenders``, ``oracle``, ``runner`` (the timing protocol), ``matrix`` (named grids of cells),
``layouts`` (Parquet layouts of the end-to-end rows), ``report``, ``ceilings``, ``env``, ``cli`` (``recall bench``).
The rest of ``recall`` is reached through its stable names only: ``recall.Engine``, ``recall.InputError``,
``recall.BackendUnavailable``, ``recall.backends.cuda_status`` and (end-to-end rows) ``runner._score_files``.
"""
