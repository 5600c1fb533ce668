"""hyspec: exact speculative decoding for hybrid linear-attention LLMs with their own MTP head."""

__version__ = "0.1.0"


def __getattr__(name):  # lazy, so `import hyspec` stays cheap
    if name == "Engine":
        from hyspec.engine import Engine

        return Engine
    raise AttributeError(name)
