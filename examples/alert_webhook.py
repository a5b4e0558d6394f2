"""A webhook receiver for ``rlpulse alerts --webhook URL``: prints each alert it is sent.

Standard library only, on loopback. ``rlpulse alerts`` POSTs each alert as JSON: the Alert record's
fields (rule, state FIRING or RESOLVED, key, severity, summary, value, threshold, project, run_id,
attempt, time_ns, first_seen_ns, last_seen_ns) plus ``alert_id``, also sent as the
``Idempotency-Key`` header. It posts at least once (again after a restart, or a failed answer), so
a receiver drops an id it has seen. ``user:password@`` in the URL arrives as HTTP Basic auth.

    python examples/alert_webhook.py --port 8088 --password s3cret &
    rlpulse alerts --webhook http://rlpulse:s3cret@127.0.0.1:8088/alerts
"""

from __future__ import annotations

import argparse
import base64
import hmac
import json
from http.server import BaseHTTPRequestHandler, HTTPServer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8088, help="port on 127.0.0.1 (0: any free one)")
    parser.add_argument("--password", help="require HTTP Basic auth with this password (any user name)")
    parser.add_argument("--exit-after", type=int, default=0, metavar="N", help="stop after N distinct alerts")
    args = parser.parse_args()
    seen: set[str] = set()  # alert ids already printed: a re-post of one is answered, not printed again

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if args.password is not None and not self._authorized():
                self.send_response(401)  # a 4xx other than 408/425/429: rlpulse gives this alert up at once
            else:
                alert = json.loads(body)
                if alert["alert_id"] not in seen:
                    seen.add(alert["alert_id"])
                    print(f"{alert['state']} {alert['rule']} {alert['key']} [{alert['severity']}] {alert['summary']} "
                          f"(id {alert['alert_id']})", flush=True)
                self.send_response(204)  # any 2xx: delivered, rlpulse commits past it
            self.end_headers()

        def _authorized(self) -> bool:
            scheme, _, encoded = self.headers.get("Authorization", "").partition(" ")
            try:
                password = base64.b64decode(encoded).decode().partition(":")[2]
            except ValueError:
                return False
            return scheme == "Basic" and hmac.compare_digest(password, args.password)

        def log_message(self, *_: object) -> None:  # quiet: one line per alert is enough
            pass

    server = HTTPServer(("127.0.0.1", args.port), Receiver)
    print(f"listening on http://127.0.0.1:{server.server_address[1]}/alerts", flush=True)
    try:
        while not args.exit_after or len(seen) < args.exit_after:
            server.handle_request()  # one request at a time, as rlpulse posts them
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
