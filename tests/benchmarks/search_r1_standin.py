"""A stand-in for Search-R1's search_r1/search/retrieval_server.py with the names the side-by-side benchmark uses:
Config, get_retriever, a FastAPI `app` reading the module globals `config` and `retriever`, and the move of every
batch to CUDA their encoder makes. It searches with this project's own retriever, so its answers are ours."""

from pathlib import Path
from typing import List, Optional  # noqa: UP035 - the shape of their module

import torch
from fastapi import FastAPI
from pydantic import BaseModel


class Config:
    def __init__(self, **settings):
        self.__dict__.update(settings)


class StandInRetriever:
    def __init__(self, config):
        from local_dense_retriever.corpus import Corpus
        from local_dense_retriever.index import DenseRetriever, encoder_config_from_meta, read_meta

        encoder = encoder_config_from_meta(read_meta(Path(config.index_path)), model_path=config.retrieval_model_path)
        self.dense = DenseRetriever(config.index_path, encoder)
        self.corpus = Corpus(config.corpus_path)

    def batch_search(self, query_list, num, return_score):
        torch.zeros(1).cuda()  # as their encoder moves each batch
        rows, scores = self.dense.search(query_list, num)
        docs = [[self.corpus[int(r)] for r in row] for row in rows]
        return docs, scores.tolist()


def get_retriever(config):
    return StandInRetriever(config)


class QueryRequest(BaseModel):
    queries: List[str]  # noqa: UP006
    topk: Optional[int] = None  # noqa: UP045
    return_scores: bool = False


app = FastAPI()


@app.post("/retrieve")
def retrieve_endpoint(request: QueryRequest):
    results, scores = retriever.batch_search(request.queries, request.topk or config.retrieval_topk, True)  # noqa: F821
    if request.return_scores:
        pairs = zip(results, scores, strict=True)
        return {"result": [[{"document": d, "score": s} for d, s in zip(r, sc, strict=True)] for r, sc in pairs]}
    return {"result": results}
