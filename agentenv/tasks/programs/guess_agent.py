"""An agent loop that plays GuessNumber through an OpenAI-compatible chat API (python3's stdlib only:
``http.client``, lighter to import than ``urllib.request``, which a short program pays at every start).

Run inside the sandbox by the ``agent_guess_number`` task: ``$OPENAI_BASE_URL``, ``$OPENAI_API_KEY`` and
``$OPENAI_MODEL`` name the API, ``$AGENT_TASK`` holds the game's rules (``guess 0-5``). Each turn is one
chat completion; its reply is a guess (the first run of digits, or the ``number`` of a ``guess`` tool
call with ``--tools``), played with ``play.sh N``; the game's answer is the next message. It stops at
``correct`` or after ``--turns`` guesses. Any API error ends it with exit status 1.
"""

import argparse
import http.client
import json
import os
import re
import subprocess
import sys
from urllib.parse import urlsplit

NUMBER = re.compile(r"\d+")
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


def chat(messages: list, tools: bool) -> dict:
    """One chat completion: the reply's message."""
    body = {"model": os.environ["OPENAI_MODEL"], "messages": messages}
    if tools:
        body["tools"] = [GUESS_TOOL]
    url = urlsplit(os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions")
    connection = http.client.HTTPConnection(url.hostname, url.port or 80, timeout=120)
    try:
        connection.request("POST", url.path, body=json.dumps(body), headers={
            "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json",
        })
        reply = connection.getresponse()
        data = reply.read()
    finally:
        connection.close()
    if reply.status != 200:
        sys.exit(f"the API answered {reply.status}: {data[:500]!r}")
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
