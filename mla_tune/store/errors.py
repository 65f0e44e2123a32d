"""The store's error: a file that cannot be used as a results DB (the message says why)."""


class StoreError(Exception):
    """The file cannot be used as a results DB; the message says why. The file is left untouched."""
