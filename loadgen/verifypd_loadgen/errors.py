"""Errors a run stops on, raised by either backend (`session` for gRPC, `openai_backend` for HTTP)."""


class Unreachable(Exception):
    """The server could not be reached; str() is the one-line message for the user."""
