"""Errors of checkpoint conversion and loading: one line that names the problem."""


class ConversionError(Exception):
    """Raised for bad input to `jaxserve convert`; its message is shown to the user as is."""
