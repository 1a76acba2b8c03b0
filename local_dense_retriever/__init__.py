"""The local retriever: corpus store, encoders, faiss / BM25 indexes and the Search-R1 `/retrieve` server."""
