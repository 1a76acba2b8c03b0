"""The one error every search backend raises: the search clients' and the web-search budget's."""


class SearchError(RuntimeError):
    """A search that failed for good (after retries)."""
