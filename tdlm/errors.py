"""User-facing errors.

Every error a user can cause by bad input (a wrong path, an unknown name, a mismatched adapter, a
tensor of the wrong rank) is raised as :class:`TDLMError` with one line that says what was expected.
Entry points print the message without a traceback.
"""

from __future__ import annotations


class TDLMError(ValueError):
    """Bad input: the message names the file / field / argument and the expected value."""
