"""The measuring instrument: named workloads, baselines (FAISS, torch), an exact oracle and reports."""
