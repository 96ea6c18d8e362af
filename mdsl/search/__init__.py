"""Search: candidate mugraphs, pruning, the cost model, the result cache."""
