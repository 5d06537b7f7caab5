"""The search service: FastAPI over a ``Searcher`` (``app.create_app``), and the web page in ``static/``."""
