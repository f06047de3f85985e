"""The status page reads at a glance: served from a data directory the daemon made (conftest's ``served``, a
real job's v0001 in service) with hostile names dropped in its inbox, parsed with ``html.parser`` and
checked by structure: the model in service first, its plots inline and served, one line per promotion,
every name from the inbox shown as text, nothing from outside the device."""

from __future__ import annotations

import shutil
from html.parser import HTMLParser

import pytest

from edgerev_daemon import EventKind, Store
from edgerev_daemon.service.daemon import Daemon
from edgerev_daemon.service.events import fold
from edgerev_daemon.service.http import StatusServer
from edgerev_daemon.service.status import status
from tests.daemon.service.test_http import get, http_config, populate
from tests.daemon.service.test_service import make_config as service_config

from ..conftest import Clock, image_bytes, make_config

HOSTILE_FOLDER = "<script>alert(1)<"  # not a label: what lies in it is quarantined under its name
HOSTILE_FILE = "<img src=x onerror=alert(2)>.png"  # not an image: quarantined under its own name
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


class Element:
    def __init__(self, tag: str, attrs: dict[str, str | None]) -> None:
        self.tag, self.attrs, self.children = tag, attrs, []

    def all(self, tag: str | None = None) -> list[Element]:
        """Every element below this one (named ``tag``), in document order."""
        found = []
        for c in self.children:
            if isinstance(c, Element):
                found += ([c] if tag in (None, c.tag) else []) + c.all(tag)
        return found

    def by_id(self, id_: str) -> Element:
        found = [e for e in self.all("section") if e.attrs.get("id") == id_]
        assert len(found) == 1, f"{len(found)} sections #{id_}"
        return found[0]

    @property
    def text(self) -> str:
        return " ".join(" ".join(c.text if isinstance(c, Element) else c for c in self.children).split())


class Tree(HTMLParser):
    """The document as elements (``html.parser`` reports tags; this nests them and checks they close)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Element("#document", {})
        self.open = [self.root]

    def handle_starttag(self, tag, attrs):
        e = Element(tag, dict(attrs))
        self.open[-1].children.append(e)
        if tag not in VOID:
            self.open.append(e)

    def handle_endtag(self, tag):
        assert self.open[-1].tag == tag, f"</{tag}> closes <{self.open[-1].tag}>"
        self.open.pop()

    def handle_data(self, data):
        self.open[-1].children.append(data)


def parse(text: str) -> Element:
    tree = Tree()
    tree.feed(text)
    tree.close()
    assert tree.open == [tree.root], [e.tag for e in tree.open]
    return tree.root


def cells(table: Element) -> list[list[str]]:
    return [[td.text for td in tr.all("td")] for tr in table.all("tr") if tr.all("td")]


@pytest.fixture(scope="module")
def page_dir(served, tmp_path_factory):
    """A copy of ``served`` after one more cycle that met a folder and a file named like markup."""
    tmp = tmp_path_factory.mktemp("page")
    shutil.copytree(served, tmp / "data", symlinks=True)
    config, _ = service_config(tmp)
    (config.inbox_path / HOSTILE_FOLDER).mkdir(parents=True)
    (config.inbox_path / HOSTILE_FOLDER / "a.png").write_bytes(image_bytes(1, size=(16, 16)))
    (config.inbox_path / "class0" / HOSTILE_FILE).write_bytes(b"not an image")
    with Daemon(config, clock=Clock()) as d:
        report = d.cycle()
    assert report.job is None and len(report.ingest["quarantined"]) == 2, report.to_json()
    return http_config(config)


@pytest.fixture(scope="module")
def served_page(page_dir):
    with StatusServer(page_dir, poll_interval=0.02, clock=Clock()) as server:
        status_code, headers, body = get(server, "/")
        assert status_code == 200 and headers["Content-Type"] == "text/html; charset=utf-8"
        yield server, headers, body.decode(), parse(body.decode())


def test_the_model_in_service_and_its_accuracy_come_first(served_page, page_dir):
    _, _, _, doc = served_page
    s = status(page_dir)
    cur = s["current"]
    first = doc.all("section")[0]
    assert first.attrs["id"] == "in-service" and first.all("span")[0].text == "v0001"
    assert f"{100 * cur['heldout_accuracy']:.1f} %" in first.text
    assert f"{100 * cur['recent_heldout_accuracy']:.1f} %" in first.text
    per_class = [t for t in first.all("table") if t.attrs.get("class") == "classes"]
    assert len(per_class) == 1 and [row[0] for row in cells(per_class[0])] == list(cur["per_class"])
    assert len(first.all("meter")) == len(cur["per_class"])
    after = doc.by_id("next").text
    assert "next job" in after and "not yet" in after and "storage" in after and "labels held back" in after


def test_each_plot_is_an_image_the_server_serves(served_page):
    server, _, _, doc = served_page
    images = doc.by_id("in-service").all("img")
    assert [i.attrs["src"] for i in images] == ["/versions/v0001/curves.png", "/versions/v0001/classes.png"]
    assert doc.all("img") == images and all(i.attrs.get("alt") for i in images)
    for img in images:
        code, headers, body = get(server, img.attrs["src"])
        assert (code, headers["Content-Type"], body[:8]) == (200, "image/png", b"\x89PNG\r\n\x1a\n")


def test_one_line_per_promotion_though_the_store_keeps_two_rows(served_page, page_dir):
    _, _, _, doc = served_page
    lines = [row[2] for row in cells(doc.by_id("events").all("table")[0]) if "v0001" in row[2]]
    assert len(lines) == 1 and lines[0].startswith("v0001 promoted: first model"), lines
    assert "promoted: false" not in doc.text and "kept out" not in doc.text
    with Store(page_dir.layout.database) as store:  # the audit keeps the decision and its promotion
        rows = [e.message for e in store.events(kind=EventKind.VERSION) if e.message["version"] == "v0001"]
    assert [r["promoted"] for r in rows] == [False, True]
    versions = cells(doc.by_id("versions").all("table")[0])
    assert [(r[0], r[2]) for r in versions] == [("v0001", "in service")]
    job_lines = [row[2] for row in cells(doc.by_id("events").all("table")[0]) if row[2].startswith("job 1 ")]
    assert len(job_lines) == 1 and job_lines[0].startswith("job 1 done; why: 160 new samples"), job_lines


def test_names_from_the_inbox_show_as_text(served_page):
    _, _, text, doc = served_page
    assert doc.all("script") == [] and len(doc.all("img")) == 2
    assert "2 files in quarantine" in doc.by_id("attention").text
    events = doc.by_id("events").text
    assert f"quarantined {HOSTILE_FOLDER}/a.png: label '{HOSTILE_FOLDER}' is not a valid name" in events
    assert f"quarantined class0/{HOSTILE_FILE}: not a PNG or JPEG image" in events
    assert "<script" not in text and "<img src=x" not in text and "&lt;script&gt;alert(1)&lt;" in text


def test_nothing_comes_from_outside_the_device(served_page):
    _, headers, _, doc = served_page
    assert headers["Content-Security-Policy"] == "default-src 'none'; style-src 'unsafe-inline'; img-src 'self'"
    assert doc.all("script") == [] and doc.all("link") == [] and doc.all("iframe") == []
    urls = [v for e in doc.all("a") + doc.all("img") for k, v in e.attrs.items() if k in ("href", "src")]
    assert urls and all(u.startswith("/") and not u.startswith("//") for u in urls), urls
    assert not [k for e in doc.all() for k in e.attrs if k.startswith("on")]  # no event handler anywhere


def test_status_shows_the_latest_events_folded(tmp_path):
    config = make_config(tmp_path)
    populate(config)
    with Store(config.layout.database) as store:
        for i in range(30):
            store.add_event(EventKind.INFO, {"message": f"note {i}"})
        store.prune_events(keep=100, before=None)
        v3 = store.add_version(reason="better on the recent held-out samples", metrics={"promote": True})
        store.update_version(v3.id, promoted=True, reason=v3.reason)
    lines = status(config, events=5)["events"]
    assert [e["text"] for e in lines] == ["note 26", "note 27", "note 28", "note 29",
                                          "v0003 promoted: better on the recent held-out samples"]
    assert len(lines[-1]["ids"]) == 2 and lines[-1]["message"]["promoted"] is True


def row(id_: int, kind: str, message: dict, at: float = 0.0) -> dict:
    return {"id": id_, "at": at + id_, "kind": kind, "message": message, "repeats": 1, "last_at": None}


def test_fold_says_what_became_of_each_version():
    reason = "better on the recent held-out samples by 5.0 points"
    failed = "promotion failed, v0001 stays in service: [Errno 28] No space left on device"
    events = [row(1, "version", {"version": "v0002", "promoted": False, "reason": reason}),  # decided: promote
              row(2, "version", {"version": "v0002", "promoted": False, "reason": failed}),  # ... and it failed
              row(3, "version", {"version": "v0003", "promoted": False, "reason": "worse on the old classes"}),
              row(4, "version", {"version": "v0004", "promoted": False, "reason": reason}),  # export under way
              row(5, "version", {"version": "v0005", "promoted": False, "reason": "first"}),  # no decision recorded
              row(6, "rollback", {"from": "v0004", "to": "v0001"}),
              row(7, "quarantine", {"source": "a/b.png", "reason": "not an image", "moved_to": "q/b.png"}),
              row(8, "job", {"job": 3, "state": "queued", "reason": "120 new samples"}),
              row(9, "job", {"job": 3, "state": "running"}),
              row(10, "job", {"job": 3, "state": "failed", "error": "out of memory"}),
              row(11, "removed", {"why": "max_bytes", "samples": 4})]
    decisions = {"v0002": True, "v0003": False, "v0004": True, "v0005": None}
    lines = fold(events, decisions)
    assert [e["text"] for e in lines] == [
        f"v0002 not promoted: {failed}", "v0003 kept out: worse on the old classes",
        f"v0004 passed the gate, promotion not finished: {reason}", "v0005 not promoted: first",
        "rolled back from v0004 to v0001", "quarantined a/b.png: not an image; moved_to: q/b.png",
        "job 3 failed: out of memory; why: 120 new samples", "samples: 4; why: max_bytes"]
    assert [e["ids"] for e in lines] == [[1, 2], [3], [4], [5], [6], [7], [8, 9, 10], [11]]
    assert lines[0]["first_at"] == 1.0 and lines[0]["at"] == 2.0
    interrupted = fold([row(1, "job", {"job": 4, "state": "running"}), row(2, "job", {"job": 4, "state": "queued"})])
    assert interrupted[0]["text"] == "job 4 interrupted, queued to resume"
