"""Shadow traffic: which stable calls are mirrored to the canary and the mirror's upstream call
(mirror), and the comparison of the two answers, bounded and in the background (compare)."""
