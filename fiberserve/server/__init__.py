"""The HTTP face of the engine: SGLang-native, shortfin-style and OpenAI-compatible APIs."""

from fiberserve.server.app import create_app, run_server

__all__ = ["create_app", "run_server"]
