# SPDX-License-Identifier: Apache-2.0
"""A loopback forwarding proxy that records the HTTP requests clients send.

    python scripts/record_client_requests.py --listen 31000 --upstream http://127.0.0.1:30000 \
        --out requests.jsonl

Point a client (SGLang's frontend, lm-eval, the openai SDK, sglang.bench_serving) at the
listen port: every request is forwarded to the server unchanged (streamed responses too)
and one JSON line per request is appended to `--out`: method, path, body (parsed JSON when
it is JSON), status. `tests/data/clients/` holds requests recorded this way from the real
clients, which the integration tests replay.
"""

from __future__ import annotations

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import requests

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


def make_handler(upstream: str, out_path: str, lock: threading.Lock):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def _forward(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            raw = self.rfile.read(length) if length else b""
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
            response = requests.request(
                self.command, upstream + self.path, data=raw, headers=headers, stream=True
            )
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = raw.decode(errors="replace")
            record = {"method": self.command, "path": self.path, "body": body}
            record["status"] = response.status_code
            with lock, open(out_path, "a") as f:
                f.write(json.dumps(record) + "\n")
            self.send_response(response.status_code)
            for key, value in response.headers.items():
                if key.lower() not in HOP_BY_HOP:
                    self.send_header(key, value)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for chunk in response.iter_content(chunk_size=None):
                if chunk:
                    self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                    self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")

        do_GET = do_POST = do_PUT = do_DELETE = _forward

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--listen", type=int, required=True, help="loopback port to listen on")
    parser.add_argument("--upstream", required=True, help="server URL, e.g. http://127.0.0.1:30000")
    parser.add_argument("--out", required=True, help="JSON-lines file to append requests to")
    args = parser.parse_args()
    handler = make_handler(args.upstream.rstrip("/"), args.out, threading.Lock())
    ThreadingHTTPServer(("127.0.0.1", args.listen), handler).serve_forever()


if __name__ == "__main__":
    main()
