"""A small OpenAI-compatible server for the served judge's tests: it serves one causal LM folder (the tiny judge)
with transformers on 127.0.0.1 only.

    GET  /v1/models              {"data": [{"id": <name>}]}
    POST /v1/chat/completions    messages -> the model's chat template (add_generation_prompt), greedy generate
    POST /v1/completions         prompt (text) -> tokens (add_special_tokens), greedy generate
    GET  /stats                  {"requests", "in_flight", "max_in_flight"} (what the tests count)

Greedy decoding (``temperature`` is read and must be 0), at most ``max_tokens`` new tokens, stopping at the
end-of-sequence token; ``logprobs`` / ``top_logprobs`` give the top tokens of each generated position (as
vLLM's server does: the chat API's ``logprobs.content``, the completions API's ``logprobs.top_logprobs``),
unless the server was started with ``logprobs=False`` (then it answers without them). ``delay`` seconds are
slept in each request before the model is run (the model runs one request at a time), so that concurrency
can be observed. ``fail`` answers every request with HTTP 503 while set.

In a test: ``server = OpenAIServer(folder).start()`` (a thread of the test's process), ``server.url``,
``server.stop()``; a process of its own: ``python tests/support/openai_server.py FOLDER --port P``, or
``spawn(FOLDER, port)``, which starts that process and returns it once it answers (``free_port()`` picks a
port).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

HOST = "127.0.0.1"  # never another address


class Model:
    """The served model: tokenizer, greedy generation, top log-probs."""

    def __init__(self, folder: str):
        torch.manual_seed(0)
        self.tok = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self.lock = threading.Lock()

    @torch.no_grad()
    def complete(self, ids: list[int], max_tokens: int, top: int | None) -> tuple[list[int], list[list]]:
        """Greedy continuation of ``ids`` (token ids) and, with ``top``, each new position's top (id, log-prob)."""
        x = torch.tensor([ids])
        if max_tokens == 1:  # one forward (a yes_prob request): what generate does for its first token
            with self.lock:
                lp = torch.log_softmax(self.model(input_ids=x).logits[0, -1].float(), -1)
            v, i = lp.topk(top or 1)
            return [int(lp.argmax())], ([[(int(a), float(b)) for a, b in zip(i, v)]] if top is not None else [])
        with self.lock:
            out = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                                      do_sample=False, output_scores=top is not None, return_dict_in_generate=True,
                                      pad_token_id=self.tok.pad_token_id, eos_token_id=self.tok.eos_token_id)
        new = out.sequences[0, len(ids):].tolist()
        tops = []
        if top is not None:
            for scores in out.scores[:len(new)]:
                lp = torch.log_softmax(scores[0].float(), -1)
                v, i = lp.topk(top)
                tops.append([(int(a), float(b)) for a, b in zip(i, v)])
        return new, tops


def _handler(server: "OpenAIServer"):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def reply(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path.endswith("/models"):
                return self.reply(200, {"object": "list", "data": [{"id": server.name, "object": "model"}]})
            if self.path == "/stats":
                return self.reply(200, server.stats())
            return self.reply(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self):
            server.enter()
            try:
                code, body = self.answer(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            finally:
                server.leave()  # before the reply: a client that has it may send its next request
            self.reply(code, body)

        def answer(self, body: dict) -> tuple[int, dict]:
            server.seen_auth.append(self.headers.get("Authorization"))
            if server.fail:
                return 503, {"error": {"message": "unavailable"}}
            if server.delay:
                time.sleep(server.delay)
            if body.get("model") != server.name:
                return 404, {"error": {"message": f"The model {body.get('model')!r} does not exist."}}
            if self.path.endswith("/chat/completions"):
                return 200, server.chat(body)
            if self.path.endswith("/completions"):
                return 200, server.completion(body)
            return 404, {"error": {"message": f"no route {self.path}"}}

    return Handler


class OpenAIServer:
    def __init__(self, folder: str, port: int = 0, name: str = "tiny-judge", delay: float = 0.0,
                 logprobs: bool = True):
        self.model = Model(folder)
        self.name, self.port, self.delay, self.logprobs = name, port, delay, logprobs
        self.fail = False
        self.requests = self.in_flight = self.max_in_flight = 0
        self.seen_auth: list = []
        self._count = threading.Lock()
        self.httpd: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}/v1"

    def start(self) -> "OpenAIServer":
        self.httpd = ThreadingHTTPServer((HOST, self.port), _handler(self))
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        """Stop serving and free the port (connections are refused until :meth:`start` again)."""
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
            self.httpd = None

    def enter(self) -> None:
        with self._count:
            self.requests += 1
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def leave(self) -> None:
        with self._count:
            self.in_flight -= 1

    def stats(self) -> dict:
        with self._count:
            return {"requests": self.requests, "in_flight": self.in_flight, "max_in_flight": self.max_in_flight}

    def run(self, ids: list[int], body: dict, top: int | None) -> tuple[list[int], list[list], str]:
        assert float(body.get("temperature", 1.0)) == 0.0, "the test server decodes greedily only"
        new, tops = self.model.complete(ids, int(body.get("max_tokens", 16)), top)
        finish = "stop" if new and new[-1] == self.model.tok.eos_token_id else "length"
        return new, tops, finish

    def chat(self, body: dict) -> dict:
        tok = self.model.tok
        text = tok.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        top = int(body.get("top_logprobs") or 0) if body.get("logprobs") and self.logprobs else None
        new, tops, finish = self.run(ids, body, top)
        logprobs = None
        if top is not None:
            logprobs = {"content": [{"token": tok.decode([t]), "logprob": dict(row)[t] if t in dict(row) else -99.0,
                                     "top_logprobs": [{"token": tok.decode([i]), "logprob": v} for i, v in row]}
                                    for t, row in zip(new, tops)]}
        return {"object": "chat.completion", "model": self.name,
                "choices": [{"index": 0, "finish_reason": finish, "logprobs": logprobs,
                             "message": {"role": "assistant", "content": tok.decode(new, skip_special_tokens=True)}}],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": len(new)}}

    def completion(self, body: dict) -> dict:
        tok = self.model.tok
        ids = tok(body["prompt"], add_special_tokens=True)["input_ids"]
        top = int(body["logprobs"]) if body.get("logprobs") and self.logprobs else None
        new, tops, finish = self.run(ids, body, top)
        logprobs = None
        if top is not None:
            logprobs = {"tokens": [tok.decode([t]) for t in new],
                        "top_logprobs": [{tok.decode([i]): v for i, v in row} for row in tops]}
        return {"object": "text_completion", "model": self.name,
                "choices": [{"index": 0, "finish_reason": finish, "logprobs": logprobs,
                             "text": tok.decode(new, skip_special_tokens=True)}],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": len(new)}}


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def spawn(folder: str, port: int, *, env: dict | None = None, wait_s: float = 120.0) -> subprocess.Popen:
    """This server in a process of its own serving ``folder`` on 127.0.0.1:``port`` (its output discarded),
    returned once ``GET /v1/models`` answers; RuntimeError if the process exits first or does not answer
    within ``wait_s``."""
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), folder, "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://{HOST}:{port}/v1/models", timeout=1).read()
            return proc
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"the test server for {folder} exited with {proc.returncode} before it "
                                   "answered") from None
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"the test server for {folder} did not answer on port {port} within {wait_s:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--name", default="tiny-judge")
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=1, help="torch's threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    server = OpenAIServer(args.folder, args.port, args.name, args.delay).start()
    print(f"serving {args.folder} as {args.name} at {server.url}", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
