"""Sandbox backends. Each is imported only when built (see ARCHITECTURE.md)."""
