"""verifypd: speculative-decoding LLM serving with separate prefill, draft and verify lanes.

Importing this package is cheap and torch-free; the engine's GPU part lives in
`verifypd.model` and is imported only by the lanes that need it.
"""

__version__ = "0.1.0"
