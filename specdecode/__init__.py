"""specdecode: lossless speculative decoding for causal language models."""

from specdecode.errors import SpecDecodeError

__all__ = ["SpecDecodeError"]
__version__ = "0.1.0"
