"""Evaluation a researcher can publish: the Search-R1 table with intervals, paired comparisons, sized subsets."""
