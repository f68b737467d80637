"""DeepInfer-server: an OpenAI-compatible front end (Rust, axum) for DeepSeek's DeepInfer engine."""

from deepinfer_server._native import Ring, RingClosed, RingError, serve

__version__ = "0.1.0"
__all__ = ["Ring", "RingClosed", "RingError", "__version__", "serve"]
