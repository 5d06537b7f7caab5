"""The HTTP service over the archive: search, videos and the question-answering endpoint."""
