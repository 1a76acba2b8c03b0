"""slime.utils: the sample type, the HTTP helpers and the small helpers plugins use."""
