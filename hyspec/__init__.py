"""hyspec: exact speculative decoding for hybrid linear-attention LLMs with their own MTP head.

    from hyspec import Engine, PrefixStore, SamplingParams, Session, SpecOptions
"""

__version__ = "0.1.0"

_LAZY = {  # name -> module: imported on first use, so `import hyspec` stays cheap
    "Engine": "hyspec.engine",
    "PrefixStore": "hyspec.prefix_store",
    "SamplingParams": "hyspec.sampling",
    "Session": "hyspec.session",
    "SpecOptions": "hyspec.speculative.loop",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hyspec' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
