"""The HTTP service over the archive: search (``app.create_app`` over a ``Searcher``), videos, the
question-answering endpoint (``ask.router``) and the web page in ``static/``."""
