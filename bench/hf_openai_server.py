"""The peer of bench/serving_load.py: HF transformers' own generate loop behind a minimal
OpenAI /v1/completions (streamed), as a naive server would run it: one request at a time,
`model.generate` with a TextIteratorStreamer, the others queued.

    python bench/hf_openai_server.py --port 8001 [--model builtin://smollm2-135m-instruct]

It honours what the load client sends: prompt, max_tokens, ignore_eos (min_new_tokens =
max_new_tokens), temperature 0 (greedy). Not a product: a baseline for the same requests.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
import uuid
from pathlib import Path

import torch
import transformers
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from kaon_runtime.loader import resolve_model


def build_app(model_id: str) -> FastAPI:
    gguf = resolve_model(model_id)
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                              dtype=torch.float32).eval()
    app = FastAPI()
    one_at_a_time = asyncio.Lock()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        ids = tokenizer(body["prompt"], return_tensors="pt").input_ids
        max_tokens = int(body.get("max_tokens", 16))
        streamer = transformers.TextIteratorStreamer(tokenizer, skip_prompt=True)
        kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                      min_new_tokens=max_tokens if body.get("ignore_eos") else 0, do_sample=False,
                      streamer=streamer, pad_token_id=tokenizer.eos_token_id)
        request_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        async def events():
            async with one_at_a_time:
                thread = threading.Thread(target=_generate, args=(model, kwargs), daemon=True)
                thread.start()
                pieces = iter(streamer)
                while True:
                    piece = await asyncio.to_thread(next, pieces, None)
                    if piece is None:
                        break
                    if piece:
                        chunk = {"id": request_id, "object": "text_completion", "created": created,
                                 "model": model_id, "choices": [{"index": 0, "text": piece, "finish_reason": None}]}
                        yield f"data: {json.dumps(chunk)}\n\n"
                thread.join()
            yield "data: [DONE]\n\n"

        if not body.get("stream"):
            return JSONResponse({"error": {"message": "only stream: true", "type": "invalid_request_error"}}, 400)
        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def _generate(model, kwargs) -> None:
    with torch.inference_mode():
        model.generate(**kwargs)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="builtin://smollm2-135m-instruct")
    args = parser.parse_args()
    uvicorn.run(build_app(args.model), host="127.0.0.1", port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
