"""The default Search-R1 task: prompt template, answer scoring, search clients and the multi-turn generate plugin."""
