"""The labelling page over HTTP (plain requests; test_label_browser.py drives it in Chromium): its
questions and pictures, the token, ``Origin`` and ``Host`` checks on the one write, answers refused with the
reason, and an answer handed to the daemon that holds the data directory."""

from __future__ import annotations

import re
import urllib.error
import urllib.parse
import urllib.request

from edgerev_daemon.learning import questions
from edgerev_daemon.learning.questions import Question
from edgerev_daemon.service.daemon import Daemon
from edgerev_daemon.service.labelling import format_label_page, label_keys
from edgerev_daemon.storage.store import Store
from tests.daemon.conftest import Clock
from tests.daemon.learning.test_questions import true_label
from tests.daemon.service.test_http import get


def token_of(body: str) -> str:
    tokens = set(re.findall(r'name="token" value="([^"]+)"', body))
    assert len(tokens) == 1
    return tokens.pop()


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None  # the 303 itself is what the test reads


def post(server, form: dict, headers: dict | None = None):
    """``(status, headers, body)`` of a POST /label of ``form``, redirects not followed."""
    data = urllib.parse.urlencode(form).encode()
    h = {"Content-Type": "application/x-www-form-urlencoded", **(headers or {})}
    req = urllib.request.Request(server.url + "label", data=data, method="POST", headers=h)
    try:
        with urllib.request.build_opener(_NoRedirect).open(req, timeout=10) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.headers, e.read()


def labelled(config) -> int:
    with Store(config.layout.database) as store:
        return store.count_samples(labeled=True)


def test_the_page_shows_each_question_with_its_picture_and_a_nonce_script(label_page):
    config, server, _ = label_page
    code, headers, body = get(server, "/label")
    text = body.decode()
    assert code == 200 and headers["Content-Type"] == "text/html; charset=utf-8"
    with Store(config.layout.database) as store:
        asked = questions.waiting(config.layout.root, store)
    assert asked and text.count('<form class="q"') == len(asked)
    nonce = re.search(r"script-src 'nonce-([^']+)'", headers["Content-Security-Policy"]).group(1)
    assert f'<script nonce="{nonce}">' in text and text.count("<script") == 1
    assert "default-src 'none'" in headers["Content-Security-Policy"]
    assert token_of(text) == server.token
    for q in asked:
        assert f'src="/blobs/{q.sample}.png"' in text
    code, headers, png = get(server, f"/blobs/{asked[0].sample}.png")
    assert code == 200 and headers["Content-Type"] == "image/png" and png.startswith(b"\x89PNG")
    assert get(server, "/blobs/" + "0" * 64 + ".png")[0] == 404
    assert get(server, "/blobs/../store.sqlite")[0] == 404
    # a second page load gets another nonce, the same token
    _, headers2, body2 = get(server, "/label")
    assert headers2["Content-Security-Policy"] != headers["Content-Security-Policy"]
    assert token_of(body2.decode()) == server.token


def test_a_write_needs_the_token_its_own_origin_and_a_loopback_host(label_page):
    config, server, truth = label_page
    with Store(config.layout.database) as store:
        sample = questions.waiting(config.layout.root, store)[0].sample
    before = labelled(config)
    assert post(server, {"sample": sample, "label": "class0"})[0] == 403
    assert post(server, {"sample": sample, "label": "class0", "token": "x" * 43})[0] == 403
    good = {"sample": sample, "label": "class0", "token": server.token}
    assert post(server, good, {"Origin": "http://evil.example"})[0] == 403
    assert post(server, good, {"Host": "evil.example"})[0] == 403
    assert labelled(config) == before
    code, headers, _ = post(server, good, {"Origin": server.url.rstrip("/")})
    assert code == 303 and headers["Location"] == "/label"
    assert labelled(config) == before + 1
    assert get(server, "/", method="PUT", data=b"")[0] == 405
    assert post(server, good)[0] == 303  # the same answer twice (a double click): nothing more to do
    code, _, body = post(server, {**good, "label": "class1"})
    assert code == 409 and "already labelled &#x27;class0&#x27;" in body.decode()


def test_an_answer_for_a_sample_gone_is_refused_with_the_reason(label_page):
    config, server, _ = label_page
    with Store(config.layout.database) as store:
        first, second = (q.sample for q in questions.waiting(config.layout.root, store)[:2])
        store.remove_samples([first], "max_samples")
    code, _, body = post(server, {"token": server.token, "sample": first, "label": "class1"})
    assert code == 409 and "removed by the retention policy (max_samples)" in body.decode()
    code, _, body = post(server, {"token": server.token, "sample": second, "label": "<b>cat</b>"})
    assert code == 409 and "&#x27;&lt;b&gt;cat&lt;/b&gt;&#x27; is no label the store knows" in body.decode()
    code, _, _ = post(server, {"token": server.token, "sample": second, "add": "1", "new_label": "cat"})
    assert code == 303
    with Store(config.layout.database) as store:
        assert store.get_sample(second).label == "cat"
    assert "labelled &#x27;cat&#x27;" in get(server, "/label")[2].decode()


def test_an_answer_goes_through_the_daemon_that_holds_the_data_directory(label_page):
    config, server, truth = label_page
    with Daemon(config, clock=Clock()) as d:
        sample = questions.waiting(config.layout.root, d.store)[0].sample
        label = true_label(d.store, truth, sample)
        code, _, _ = post(server, {"token": server.token, "sample": sample, "label": label})
        assert code == 303 and d.store.get_sample(sample).label is None  # handed over, not written beside it
        assert "handed to the running daemon" in get(server, "/label")[2].decode()
        assert d.cycle().answers == 1
        assert d.store.get_sample(sample).label == label


def test_a_key_answers_with_the_label_it_reads_as():
    digits = [str(d) for d in range(10)]
    assert label_keys(digits) == {d: d for d in digits}  # not 1 for '0', 2 for '1' ...
    assert label_keys(["cat", "3", "dog"]) == {"cat": "1", "3": "3", "dog": "2"}
    assert label_keys(["cat", "1", "dog"]) == {"cat": "2", "1": "1", "dog": "3"}
    assert label_keys(digits + ["cat"]) == {d: d for d in digits}  # no digit left: clicked, not keyed
    many = [f"c{i}" for i in range(12)]
    assert list(label_keys(many).values()) == list("1234567890")  # then 0; the eleventh has none
    assert label_keys(["05", "\u0665"]) == {"05": "1", "\u0665": "2"}  # not one ASCII digit: a label like others
    q = Question("ab" * 32, "5", 0.1, (("5", 0.5), ("4", 0.4)), "unlabeled/x.png")
    page = format_label_page([q], digits, "token", "nonce")
    assert '<button type="submit" name="label" value="5" data-key="5"><kbd>5</kbd> 5</button>' in page
    assert '<button type="submit" name="label" value="0" data-key="0"><kbd>0</kbd> 0</button>' in page
    assert "a label that\nis one digit is its own key" in page
