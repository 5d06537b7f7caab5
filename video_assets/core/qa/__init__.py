"""Question answering over the archive (an agent over the ``Searcher`` operations) and video summaries."""
