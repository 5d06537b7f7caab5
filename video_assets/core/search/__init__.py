"""Search over the archive: the index (LanceDB), hybrid lexical + semantic retrieval, and its hits."""
