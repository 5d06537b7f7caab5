"""Frame curation: quality scores and keep/drop verdicts for sampled frames, and the training export."""
