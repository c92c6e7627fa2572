"""`jaxserve chat`: a terminal chat client that streams from any OpenAI-compatible server.

It keeps the conversation (every user turn and every answer goes back in `messages`),
prints tokens as they arrive, and reads the stream with plain httpx so it has no
dependency beyond what the server already installs. `/reset` starts over, `/exit` or
end of input leaves.
"""

from __future__ import annotations

import json
import sys
from typing import Iterator, TextIO

import httpx


class ChatError(RuntimeError):
    """The server answered with an error (its message is shown to the user)."""


def stream_chat(client: httpx.Client, url: str, body: dict, headers: dict) -> Iterator[str]:
    """POST a streaming chat request; yield content deltas. Raises ChatError on an error answer."""
    with client.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, headers=headers) as r:
        if r.status_code != 200:
            r.read()
            try:
                message = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = r.text
            raise ChatError(f"HTTP {r.status_code}: {message}")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            chunk = json.loads(data)
            if "error" in chunk:
                raise ChatError(chunk["error"].get("message", "error"))
            for choice in chunk.get("choices", []):
                text = choice.get("delta", {}).get("content")
                if text:
                    yield text


def first_model(client: httpx.Client, url: str, headers: dict) -> str:
    r = client.get(f"{url}/v1/models", headers=headers)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def chat_loop(url: str, model: str | None, api_key: str | None, system: str | None, max_tokens: int,
              temperature: float, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout) -> int:
    url = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    interactive = stdin.isatty()
    with httpx.Client(timeout=httpx.Timeout(10.0, read=None)) as client:
        try:
            model = model or first_model(client, url, headers)
        except httpx.HTTPError as e:
            print(f"jaxserve chat: cannot reach {url}: {e}", file=sys.stderr)
            return 1
        start = [{"role": "system", "content": system}] if system else []
        messages = list(start)
        if interactive:
            print(f"chatting with {model} at {url}; /reset starts over, /exit or Ctrl-D leaves", file=stdout)
        while True:
            if interactive:
                stdout.write("> ")
                stdout.flush()
            line = stdin.readline()
            if not line or line.strip() == "/exit":
                return 0
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if line.strip() == "/reset":
                messages = list(start)
                continue
            messages.append({"role": "user", "content": line})
            body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature}
            answer = []
            try:
                for piece in stream_chat(client, url, body, headers):
                    answer.append(piece)
                    stdout.write(piece)
                    stdout.flush()
            except (ChatError, httpx.HTTPError) as e:
                messages.pop()
                print(f"\njaxserve chat: error: {e}", file=sys.stderr)
                continue
            stdout.write("\n")
            stdout.flush()
            messages.append({"role": "assistant", "content": "".join(answer)})
