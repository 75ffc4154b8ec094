"""One exception type for everything a user can get wrong.

The CLI and the server turn a `SpecDecodeError` into one clear line (or an HTTP 4xx); anything else is a
bug and keeps its traceback.
"""


class SpecDecodeError(Exception):
    """A user-facing error: bad input, a missing package, a broken or mismatched checkpoint."""
