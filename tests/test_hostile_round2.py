"""Hostile branches, round two (issue 20): what a branch, or the LLM that wrote it, can put in front
of the driver and the review page. Every string it writes is hostile. Real server process (`Server`
from test_web), real HTTP requests, real stage subprocesses, real files; no mocks.
"""

from __future__ import annotations

import http.client
import urllib.parse
from pathlib import Path

from summary_fixtures import BETTER, decided, implemented, measured, services
from test_web import Server


def post(server: Server, path: str, fields: dict[str, str], headers: dict[str, str]) -> tuple[int, str]:
    """One POST as a browser (or another site's page) would send it; redirects are not followed."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request("POST", path, body=urllib.parse.urlencode(fields),
                     headers={"Content-Type": "application/x-www-form-urlencoded", **headers})
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")
    finally:
        conn.close()


# ----------------------------------------------------------------------------- CSRF: Origin check

def test_a_post_from_another_origin_with_a_planted_csrf_cookie_is_refused(lab: Path) -> None:
    svc = services(lab, supervised=True)
    held = decided(svc, measured(svc, implemented(svc), BETTER))
    assert held.status == "held" and held.review == "pending"
    server = Server(lab).wait()
    try:
        planted = {"Cookie": "ar_csrf=planted-by-another-port"}  # cookies ignore ports: any local page can set one
        form = {"csrf": "planted-by-another-port", "action": "approve"}
        path = f"/hypotheses/{held.id}/review"
        for foreign in ({"Origin": "http://evil.example"}, {"Origin": "null"},
                        {"Origin": f"http://127.0.0.1:{server.port + 1}"},  # another port of the same host
                        {"Referer": "http://evil.example/page"}, {}):  # no Origin: the Referer decides; neither: no
            status, body = post(server, path, form, {**planted, **foreign})
            assert status == 403, (foreign, status)
            assert "Origin" in body and "Traceback" not in body, body
        assert svc.records.get(held.id).review == "pending" and not svc.records.comments(held.id)  # nothing recorded

        status, _ = post(server, path, form, {**planted, "Origin": server.url})  # the page's own form
        assert status == 303
        assert svc.records.get(held.id).review == "approved"
        assert [c.action for c in svc.records.comments(held.id)] == ["approve"]
        status, _ = post(server, path, {**form, "action": "comment", "comment": "via a same-origin Referer"},
                         {**planted, "Referer": f"{server.url}/hypotheses/{held.id}"})
        assert status == 303
    finally:
        server.stop()

