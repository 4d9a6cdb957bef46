"""`ccld report`: one self-contained HTML page; the finding, its evidence and the heatmap's pixels."""
import base64
import io
import json
import re
from html.parser import HTMLParser
from types import SimpleNamespace

import numpy as np
import pytest

from ccld.cli import main
from ccld.store import StoreWriter
from ccld.export import report as rp
from ccld.export import report_links as rl
from ccld.export import report_plots as rpl
from ccld.export import report_sections as rs

from ccld_synth import T0, SynthJob

pytestmark = pytest.mark.unit

HUNG_SEQ = 57   # rank 2 never enters it
SLOW_RANK = 1   # enters every collective 40 ms after the others
SLOW_S = 0.040


def hang_store(path):
    """A store of 4 ranks: rank 1 is 40 ms late every time; rank 2 never enters seq 57 (asleep)."""
    job = SynthJob()
    job.announce(T0)
    out = []
    t = T0 + 1
    for seq in range(1, HUNG_SEQ):
        t = job.collective(seq, t + 0.1, late={SLOW_RANK: SLOW_S}, dur=0.003 + 0.001 * (seq % 5))
        out += [(t + 0.01, f) for f in job.frames(t + 0.01)]
    onset = t + 0.1
    for r in (0, 1, 3):
        job.enter(r, HUNG_SEQ, onset + (SLOW_S if r == SLOW_RANK else 0.0))
    for i in range(1, 21):  # 10 s of frames, with /proc states, while ranks 0, 1, 3 wait
        now = onset + 0.5 * i
        job.state(2, now - 0.01, "S", "hrtimer_nanosleep", cpu_ns=5 * 10**8)
        out += [(now, f) for f in job.frames(now)]
    _write(path, out)
    return path


def healthy_store(path, n=23):
    job = SynthJob()
    job.announce(T0)
    t, out = T0 + 1, []
    for seq in range(1, n + 1):
        t = job.collective(seq, t + 0.1)
        out += [(t + 0.01, f) for f in job.frames(t + 0.01)]
    _write(path, out)
    return path


def _write(path, records):
    w = StoreWriter(str(path))
    for t, f in records:
        w.append(f, t)
    w.close()
    meta = json.loads((path / "store.json").read_text())
    meta["closed_at"] = records[-1][0] + 0.2 if records else None  # the recording lives at T0, not now
    (path / "store.json").write_text(json.dumps(meta))


class Page(HTMLParser):
    """Every tag's attributes, and the page's visible text."""

    def __init__(self, text):
        super().__init__()
        self.tags, self.text = [], []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)

    def img(self, id_):
        return next(a for t, a in self.tags if t == "img" and a.get("id") == id_)


def decode_png(img):
    from PIL import Image
    src = img["src"]
    assert src.startswith("data:image/png;base64,")
    return Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1]))).convert("RGB")


def rgb(hex_colour):
    return tuple(int(hex_colour[i:i + 2], 16) for i in (1, 3, 5))


def cell_centre(img, rank, seq):
    """Pixel (x, y) at the centre of the heatmap cell of (rank, seq), from the geometry the page states."""
    ranks = [int(x) for x in img["data-ranks"].split(",")]
    seqs = [int(x) for x in img["data-seqs"].split(",")]
    x0, y0, x1, y1 = (int(v) for v in img["data-box"].split(","))
    i, j = ranks.index(rank), seqs.index(seq)
    return (int(x0 + (j + 0.5) * (x1 - x0) / len(seqs)), int(y0 + (i + 0.5) * (y1 - y0) / len(ranks)))


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    d = tmp_path_factory.mktemp("report")
    store = hang_store(d / "store")
    msgs = []
    summary = rp.write_report(str(store), str(d / "out" / "report.html"), progress=msgs.append)
    text = (d / "out" / "report.html").read_text()
    return SimpleNamespace(dir=d, store=store, summary=summary, html=text, page=Page(text), progress=msgs)


def test_report_is_one_self_contained_file(made):
    s, text = made.summary, made.html
    assert s["path"] == str(made.dir / "out" / "report.html") and s["bytes"] == len(text.encode())
    # two findings: rank 2's hang, and rank 1 late at every collective (comp-slow)
    assert (s["ranks"], s["comms"], s["collectives"], s["findings"], s["active"]) == (4, 1, HUNG_SEQ, 2, 2)
    assert not (made.dir / "out" / "report.html.tmp").exists()
    for tag, attrs in made.page.tags:
        for name in ("src", "href", "srcset", "data", "action", "poster"):
            v = attrs.get(name)
            if v is not None:  # nothing the browser would fetch: inline data, in-page anchors, one plain link
                assert v.startswith(("data:", "#")) or (tag == "a" and v == rs.PERFETTO_UI), (tag, name, v)
    assert set(re.findall(r"https?://[^\s\"'<>)]+", text)) == {rs.PERFETTO_UI}
    assert "<script" not in text and "url(" not in text and "@import" not in text
    assert "default-src 'none'" in text  # and the CSP forbids fetching anything anyway
    assert made.progress[0].startswith("replaying") and made.progress[-1].startswith("wrote")


def test_report_shows_the_finding_with_its_evidence(made):
    text = " ".join(made.page.text)
    assert "HANG not-entered [2] gloo:0 seq 57 allreduce" in text
    assert "SLOW comp-slow [1] gloo:0 allreduce" in text
    kv = re.search(r"kind / class\s*hang / not-entered.*?culprit ranks\s*2\s*link\s*-\s*communicator\s*job/gloo:0\s*"
                   r"seq\s*57\s*op\s*allreduce\s*onset.*?time to detect\s*5\.\d\d s", text, re.S)
    assert kv, text
    assert re.search(r"waiting ranks\s*0, 1, 3", text)
    # what the culprit is doing: state, wchan, last collective
    assert re.search(r"2\s*S \(sleeping\)\s*hrtimer_nanosleep\s*seq 56 allreduce", text)
    assert "2 active findings" in text
    assert "no link data in this store (network probes not enabled)" in text
    assert "CPU runqueue wait" not in text  # no SchedStats in this store
    assert f"ccld export {made.store} --perfetto out.pftrace" in text and "ui.perfetto.dev" in text


def test_heatmap_png_has_the_drawn_size_and_the_missing_cell(made):
    img = made.page.img("heatmap")
    png = decode_png(img)
    heat = made.summary["heatmap"]
    assert png.size == (int(img["width"]), int(img["height"])) == (heat["width"], heat["height"])
    assert heat["ranks"] == [0, 1, 2, 3] and heat["seqs"] == list(range(1, HUNG_SEQ + 1))
    assert img["data-missing-colour"] == rpl.MISSING_COLOUR
    missing = rgb(rpl.MISSING_COLOUR)
    assert png.getpixel(cell_centre(img, 2, HUNG_SEQ)) == missing  # the hung rank's cell
    for r in (0, 1, 3):
        assert png.getpixel(cell_centre(img, r, HUNG_SEQ)) != missing
    assert png.getpixel(cell_centre(img, 2, HUNG_SEQ - 1)) != missing
    # the straggler's row is the hot one: darker (YlOrRd) than the first rank's, at every seq sampled
    for seq in (1, 20, HUNG_SEQ):
        slow, first = png.getpixel(cell_centre(img, SLOW_RANK, seq)), png.getpixel(cell_centre(img, 0, seq))
        assert sum(slow) < sum(first) - 100, (seq, slow, first)
    dur = decode_png(made.page.img("durations"))
    assert dur.size == (int(made.page.img("durations")["width"]), int(made.page.img("durations")["height"]))


def test_heatmap_is_bounded_to_the_newest_collectives(made, tmp_path):
    s = rp.write_report(str(made.store), str(tmp_path / "r.html"), last=10)
    assert s["heatmap"]["seqs"] == list(range(HUNG_SEQ - 9, HUNG_SEQ + 1))
    ranks = list(range(1000))
    lag = np.zeros((1000, 5))
    lag[7, 4] = np.nan      # a rank that never entered one
    lag[500, :] = 90.0      # a straggler
    rows = rpl._pick_rows(ranks, lag, keep=[999], most=3)
    assert rows == [7, 500, 999]


def test_healthy_and_empty_stores(tmp_path):
    s = rp.write_report(str(healthy_store(tmp_path / "h")), str(tmp_path / "h.html"))
    text = (tmp_path / "h.html").read_text()
    assert (s["findings"], s["collectives"]) == (0, 23) and "no findings" in text
    assert Page(text).img("heatmap") and s["heatmap"]["seqs"] == list(range(1, 24))
    (tmp_path / "e").mkdir()
    _write(tmp_path / "e", [])
    s = rp.write_report(str(tmp_path / "e"), str(tmp_path / "e.html"))
    assert s["heatmap"] is None and "No collectives in this store" in (tmp_path / "e.html").read_text()


def test_link_matrix_takes_the_shapes_a_timeline_may_hold():
    ranks, m = rp.link_matrix({(0, 1): 2.0, (1, 0): 3.0, (1, 2): 1.0})
    assert ranks == [0, 1, 2] and m[0, 1] == 2.0 and m[1, 0] == 3.0 and np.isnan(m[0, 0])
    ranks, m = rp.link_matrix({0: {1: 5}, 1: {0: 6}})
    assert ranks == [0, 1] and m[1, 0] == 6
    ranks, m = rp.link_matrix([[0, 1], [2, 0]])
    assert ranks == [0, 1] and m[1, 0] == 2
    assert rp.link_matrix(None) is None and rp.link_matrix({}) is None and rp.link_matrix([1, 2]) is None
    assert rp.link_matrix({"x": "y"}) is None
    html = rp._links_section(SimpleNamespace(links={(0, 1): 2.0, (1, 0): 3.0}, links_unit="ms"))
    png = decode_png(Page(html).img("links"))
    assert png.size[0] > 300 and "no link data" not in html


def test_report_verb(made, tmp_path, capsys):
    out = tmp_path / "cli.html"
    assert main(["report", str(made.store), "-o", str(out)]) == 0
    line = capsys.readouterr().out.strip()
    assert line == (f"ccld report: {out} ({out.stat().st_size // 1024} KiB): 4 ranks, 1 communicators, "
                    f"{HUNG_SEQ} collectives, 2 findings (2 active)")
    assert main(["report", str(made.store), "-o", str(out), "--comm", "nope"]) == 1
    assert "no communicator 'nope'" in capsys.readouterr().err


def test_big_job_is_drawn_within_bounds(tmp_path, monkeypatch):
    """More ranks, collectives and lines than the bounds: the newest/most telling are drawn, all fast."""
    monkeypatch.setattr(rpl, "MAX_HEATMAP_RANKS", 8)
    monkeypatch.setattr(rpl, "MAX_LINE_POINTS", 50)
    job = SynthJob(world=20, nodes=2)
    job.announce(T0)
    t, out = T0 + 1, []
    for seq in range(1, 241):
        t = job.collective(seq, t + 0.05, late={13: 0.03})
        if seq % 10 == 0:
            out += [(t + 0.01, f) for f in job.frames(t + 0.01)]
    for r in range(20):
        if r != 17:
            job.enter(r, 241, t + 0.1)
    for i in range(1, 14):
        out += [(t + 0.5 * i, f) for f in job.frames(t + 0.5 * i)]
    _write(tmp_path / "s", out)
    s = rp.write_report(str(tmp_path / "s"), str(tmp_path / "r.html"))
    assert s["findings"] == 2 and s["collectives"] == 241  # rank 17's hang, and rank 13 late (comp-slow)
    heat = s["heatmap"]
    assert heat["seqs"] == list(range(42, 242))       # the newest MAX_HEATMAP_COLLS
    assert len(heat["ranks"]) == 8 and {13, 17} <= set(heat["ranks"])  # the culprit and the straggler
    page = Page((tmp_path / "r.html").read_text())
    png = decode_png(page.img("heatmap"))
    assert png.getpixel(cell_centre(page.img("heatmap"), 17, 241)) == rgb(rpl.MISSING_COLOUR)
    assert "Lines for 12 of 20 ranks" in " ".join(page.text)


def test_link_section_draws_bytes_and_retransmissions_and_boxes_the_named_link(tmp_path):
    """A hang whose cause is link 1-2 (it keeps retransmitting): MiB and retransmission heatmaps per
    directed pair, the link's cells (both directions) boxed in red, its numbers in the table."""
    from test_export_links import hung_link_store
    s = rp.write_report(str(hung_link_store(tmp_path / "s")), str(tmp_path / "r.html"))
    text = (tmp_path / "r.html").read_text()
    page = Page(text)
    assert s["links"] is True and "no link data" not in text
    words = "".join(page.text)
    assert "Job job: 4 directed rank pairs over TCP" in words and "link 1 ↔ 2 named by HANG fault" in words
    assert re.search(r"1 -> 2\s*0\.0\s*10\s*0", words)  # the table: MiB sent, retransmissions, resets
    red = rgb(rl.FINDING_COLOUR)
    for id_, alt in (("links", "MiB sent"), ("links-retrans", "TCP retransmissions")):
        img = page.img(id_)
        png = decode_png(img)
        assert png.size == (int(img["width"]), int(img["height"])) and img["alt"].startswith(alt)
        assert img["data-ranks"] == "0,1,2,3" and img["data-marked"] == "1-2 2-1"
        x0, y0, x1, y1 = (int(v) for v in img["data-box"].split(","))
        cell = (x1 - x0) / 4

        def px(row, col, dx):  # on the left edge of a cell (dx=0) or in its middle (dx=0.5)
            return png.getpixel((int(x0 + (col + dx) * cell), int(y0 + (row + 0.5) * cell)))
        assert px(1, 2, 0) == red and px(2, 1, 0) == red          # the named link, both directions
        assert px(0, 1, 0) != red and px(2, 3, 0) != red          # the others are not boxed
        assert px(1, 0, 0.5) == rgb(rl.NO_DATA_COLOUR)  # rank 1 sent nothing to rank 0
    png = decode_png(page.img("links-retrans"))  # 10 retransmissions on 1->2: the darkest cell
    hot, cool = (png.getpixel((int(x0 + (c + 0.5) * cell), int(y0 + (r + 0.5) * cell))) for r, c in ((1, 2), (0, 1)))
    assert sum(hot) < sum(cool) - 300


def test_runqueue_wait_line_in_the_health_summary(tmp_path):
    from test_export_links import link_store
    rp.write_report(str(link_store(tmp_path / "s")), str(tmp_path / "r.html"))
    page = Page((tmp_path / "r.html").read_text())
    words = "".join(page.text)
    assert re.search(r"CPU runqueue wait \(runnable, waiting for a CPU\) per rank: most on rank 3 "
                     r"\(1\d\.\d% of the recording\), median 0\.0% over 4 ranks", words), words
    # rank 3 first (most waiting): 0.7 s in all, 20% between its last two reports
    assert re.search(r"3\s*node1\s*0\.70\s*1\d\.\d%\s*20\.0%", words)
    assert page.img("links") and page.img("links-retrans")
