"""Tree fusion: prefix-merging several drafters' trees under one budget, ranked by a draft model."""
