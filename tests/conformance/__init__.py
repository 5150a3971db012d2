"""Backend conformance suite: the same cases against every backend (see conftest.py and
docs/BACKENDS.md, "Conformance"). A package, so that its conftest does not shadow the
``conftest`` module of tests/ that other test folders import from."""
