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
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler, HTTPServer

from rlpulse.base.terminal import terminal_safe

MAX_BODY = 64 * 1024  # an alert is well under 2 KiB; anything larger is refused before it is read
TIMEOUT_S = 10.0  # a client that stalls mid-request is dropped
SEEN_IDS = 10_000  # ids remembered to drop re-posts; the oldest are forgotten past this
FIELDS = ("alert_id", "state", "rule", "key", "severity", "summary")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8088, help="port on 127.0.0.1 (0: any free one)")
    parser.add_argument("--password", help="require HTTP Basic auth with this password (any user name)")
    parser.add_argument("--exit-after", type=int, default=0, metavar="N", help="stop after N distinct alerts")
    args = parser.parse_args()
    seen: OrderedDict[str, None] = OrderedDict()  # ids already printed: a re-post is answered, not printed again
    printed = 0

    class Receiver(BaseHTTPRequestHandler):
        timeout = TIMEOUT_S

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            nonlocal printed
            # Anyone who can reach the port may send anything: authenticate before reading a byte of
            # the body, and bound its size. A 4xx other than 408/425/429 makes rlpulse give up at once.
            if args.password is not None and not self._authorized():
                return self._answer(401)
            try:
                length = int(self.headers.get("Content-Length", ""))
            except ValueError:
                return self._answer(411)
            if not 0 <= length <= MAX_BODY:
                return self._answer(413)
            try:
                alert = json.loads(self.rfile.read(length))
                values = [str(alert[f]) for f in FIELDS]
            except (ValueError, TypeError, KeyError):
                return self._answer(400)
            if values[0] not in seen:
                seen[values[0]] = None
                if len(seen) > SEEN_IDS:
                    seen.popitem(last=False)
                printed += 1
                # values come from a topic anyone may write to: control characters print as escapes
                alert_id, state, rule, key, severity, summary = (terminal_safe(v) for v in values)
                print(f"{state} {rule} {key} [{severity}] {summary} (id {alert_id})", flush=True)
            self._answer(204)  # any 2xx: delivered, rlpulse commits past it

        def _answer(self, status: int) -> None:
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _authorized(self) -> bool:
            scheme, _, encoded = self.headers.get("Authorization", "").partition(" ")
            try:
                password = base64.b64decode(encoded, validate=True).partition(b":")[2]
            except ValueError:
                return False
            return scheme == "Basic" and hmac.compare_digest(password, args.password.encode())

        def log_message(self, *_: object) -> None:  # quiet: one line per alert is enough
            pass

    server = HTTPServer(("127.0.0.1", args.port), Receiver)
    print(f"listening on http://127.0.0.1:{server.server_address[1]}/alerts", flush=True)
    try:
        while not args.exit_after or printed < args.exit_after:
            server.handle_request()  # one request at a time, as rlpulse posts them
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
