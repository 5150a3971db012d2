"""Benchmarks: figures, not assertions (``dsec bench ...``).

Submodules are imported on demand; importing this package pulls in nothing.
"""
