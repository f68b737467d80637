"""Fake deepinfer 0.1.0 for GPU-free tests (see ../README.md). Same module paths and names as the real package."""

__version__ = "0.1.0"
