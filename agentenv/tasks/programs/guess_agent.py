"""An agent loop that plays GuessNumber through an OpenAI-compatible chat API, on python3's stdlib only.

Run inside the sandbox by the ``agent_guess_number`` task: ``$OPENAI_BASE_URL``, ``$OPENAI_API_KEY`` and
``$OPENAI_MODEL`` name the API, ``$AGENT_TASK`` the game's rules (``guess 0-5``). Each turn is one chat
completion; its reply is a guess (the first run of digits, or the ``number`` of a ``guess`` tool call with
``--tools``), played with ``play.sh N``; the game's answer is the next message. It stops at ``correct`` or
after ``--turns`` guesses; an API error ends it with exit status 1. It posts over a plain socket (`post`):
``http.client`` and ``urllib`` import ``ssl`` and ``email`` at each start (docs/tasks.md says what it costs).
"""

import argparse
import json
import os
import re
import socket
import subprocess
import sys

NUMBER = re.compile(r"\d+")
HTTP_URL = re.compile(r"http://([^/:]+)(?::(\d+))?(/.*)?")
GUESS_TOOL = {
    "type": "function",
    "function": {
        "name": "guess",
        "description": "Guess the hidden number.",
        "parameters": {
            "type": "object", "properties": {"number": {"type": "integer"}}, "required": ["number"],
        },
    },
}


def post(url: str, body: dict, key: str) -> tuple[int, bytes]:
    """(status, body) of one HTTP/1.0 POST of ``body`` as JSON to an ``http://`` ``url``."""
    match = HTTP_URL.fullmatch(url)
    if match is None:
        sys.exit(f"OPENAI_BASE_URL must be an http:// URL, got {url!r}")
    host, port, path = match.group(1), int(match.group(2) or 80), match.group(3) or "/"
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.0\r\nHost: {host}:{port}\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n")
    with socket.create_connection((host, port), timeout=120) as connection:
        connection.sendall(head.encode() + data)
        reply = b"".join(iter(lambda: connection.recv(65536), b""))  # HTTP/1.0: the server closes
    header, _, content = reply.partition(b"\r\n\r\n")
    words = header.split(b" ", 2)
    status = words[1] if header.startswith(b"HTTP/") and len(words) > 1 else b""
    if not status.isdigit():
        sys.exit(f"the API's answer is not HTTP: {reply[:200]!r}")
    return int(status), content


def chat(messages: list, tools: bool) -> dict:
    """One chat completion: the reply's message."""
    body = {"model": os.environ["OPENAI_MODEL"], "messages": messages}
    if tools:
        body["tools"] = [GUESS_TOOL]
    url = os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions"
    status, data = post(url, body, os.environ["OPENAI_API_KEY"])
    if status != 200:
        sys.exit(f"the API answered {status}: {data[:500]!r}")
    return json.loads(data)["choices"][0]["message"]


def guess_of(message: dict) -> tuple[str, dict | None]:
    """(the guess, the tool call it came from or None): a number as guess.sh reads it, or x (invalid)."""
    for call in message.get("tool_calls") or []:
        if call["function"]["name"] == "guess":
            number = json.loads(call["function"]["arguments"]).get("number")
            return (str(number) if isinstance(number, int) and number >= 0 else "x"), call
    match = NUMBER.search(message.get("content") or "")
    return (str(int(match.group(0)[:6])) if match else "x"), None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--tools", action="store_true", help="offer a guess tool")
    args = parser.parse_args()
    messages = [{"role": "user", "content": os.environ["AGENT_TASK"]}]
    for _ in range(args.turns):
        message = chat(messages, args.tools)
        guess, call = guess_of(message)
        answer = subprocess.run(["/workspace/play.sh", guess], capture_output=True, text=True, check=True)
        reply = answer.stdout.strip()
        print(f"{guess} -> {reply}", flush=True)
        assistant = {"role": "assistant", "content": message.get("content") or ""}
        if message.get("tool_calls"):
            assistant["tool_calls"] = message["tool_calls"]
        messages.append(assistant)
        if call is not None:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": reply})
        else:
            messages.append({"role": "user", "content": reply})
        if reply == "correct":
            break


if __name__ == "__main__":
    main()
