"""Human review: the review queue ranked for a person, their decisions as labels, and labels into the golden set."""
