"""A reward service for the tests of faults that pass: POST /score -> {"score": 1.0} (or, with --status S, every
/score answered S), GET /health; on 127.0.0.1, the port given or a free one, "serving on URL" printed once bound. It
also answers POST /pause_generation and /continue_generation with {}: what a weight push in --async-mode fully asks of
the engines, for a rollout whose plugins use no engine.

    python tests/health/reward_service.py --port 0 [--status 503]
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    from slime_search.utils.net import listen_socket

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--status", type=int, default=200, help="the status every /score answers")
    args = parser.parse_args(argv)
    app = FastAPI()

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    @app.post("/score")
    def score(body: dict) -> JSONResponse:
        return JSONResponse({"score": 1.0} if args.status == 200 else {"error": "busy"}, status_code=args.status)

    @app.post("/pause_generation")
    @app.post("/continue_generation")
    def engine_pause(body: dict) -> dict:
        return {}

    sock = listen_socket("127.0.0.1", args.port)
    print(f"serving on http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
