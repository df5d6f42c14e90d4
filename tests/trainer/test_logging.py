"""The trainer's log (`trainer.train.setup_logging`, what every torchrun worker runs): its own INFO lines,
no INFO line per HTTP request to the gateway, and warnings still shown. Run in a fresh process, since the
set-up is process-wide."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json, logging, threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from trainer.client import GatewayClient
    from trainer.train import setup_logging

    class Gateway(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"version": 3, "model_path": None}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Gateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    setup_logging()
    with GatewayClient(f"http://127.0.0.1:{server.server_address[1]}", "key") as client:
        for _ in range(3):
            assert client.current_weights() == (3, None)
    logging.getLogger("trainer").info("own line")
    logging.getLogger("httpx").warning("a warning of httpx's")
    server.shutdown()
""")


def test_requests_to_the_gateway_log_no_info_lines() -> None:
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    lines = run.stderr.splitlines()
    assert [line for line in lines if " httpx INFO " in line or " httpcore" in line] == []
    assert any(line.endswith(" trainer INFO own line") for line in lines), run.stderr
    assert any(line.endswith(" httpx WARNING a warning of httpx's") for line in lines), run.stderr
