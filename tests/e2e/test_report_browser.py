"""End to end: `ccld report`'s page in a real browser (headless Chromium), as a user opens it.

The page is loaded from file:// with no network; Chromium's console is captured through
`--enable-logging=stderr`, where every console message of a page (script errors, blocked loads,
CSP violations) is a `...:CONSOLE...` line naming its source. A canary page with a deliberate
console error first proves the capture works on this Chromium, so a change in its log format
cannot make the real check pass silently. Chromium in a container also logs dbus/GPU noise on
stderr; only console lines are judged. Needs Debian's `chromium` (scripts/setup.sh installs it).
"""
import re
import shutil
import subprocess
from html.parser import HTMLParser

import numpy as np
import pytest

from ccld.export import report as rp
from ccld.export import report_plots as rpl

from test_report import HUNG_SEQ, SLOW_RANK, Page, cell_centre, decode_png, hang_store, rgb

pytestmark = pytest.mark.e2e

WINDOW = (1400, 2000)
BROWSER_TIMEOUT_S = 120   # a cold start on a loaded 2-core box takes a few seconds; this is far above
CONSOLE_RE = re.compile(r":CONSOLE[:(]")  # "INFO:CONSOLE:1]" today, "INFO:CONSOLE(1)]" in older builds


def chromium():
    return next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser")) if p), None)


@pytest.fixture
def browser():
    path = chromium()
    if path is None:
        pytest.skip("chromium is not installed (apt-get install chromium; scripts/setup.sh installs it)")
    return path


def open_page(browser, page, tmp_path, shot=None, window=WINDOW):
    """(DOM as Chromium serialises it after loading `page`, its console lines)."""
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           f"--user-data-dir={tmp_path / 'profile'}", "--no-first-run", "--no-default-browser-check",
           "--force-device-scale-factor=1", "--hide-scrollbars", f"--window-size={window[0]},{window[1]}",
           "--enable-logging=stderr", "--v=0", "--dump-dom"]
    if shot:
        cmd.append(f"--screenshot={shot}")
    p = subprocess.run(cmd + [page.as_uri()], capture_output=True, text=True, timeout=BROWSER_TIMEOUT_S)
    assert p.returncode == 0, f"chromium exited {p.returncode}: {p.stderr[-3000:]}"
    console = [line for line in p.stderr.splitlines() if CONSOLE_RE.search(line)]
    return p.stdout, console


class Imgs(HTMLParser):
    def __init__(self, text):
        super().__init__()
        self.imgs = {}
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "img" and a.get("id"):
            self.imgs[a["id"]] = a


def test_console_capture_works(browser, tmp_path):
    canary = tmp_path / "canary.html"
    canary.write_text("<!DOCTYPE html><html><body>canary<script>console.error('ccld-canary');"
                      "throw new Error('ccld-boom')</script></body></html>")
    _, console = open_page(browser, canary, tmp_path)
    assert any("ccld-canary" in c for c in console), console
    assert any("Uncaught" in c and "ccld-boom" in c for c in console), console


def test_report_renders_in_chromium_without_console_errors(browser, tmp_path):
    from PIL import Image  # matplotlib's own dependency
    store = hang_store(tmp_path / "store")
    page = tmp_path / "report.html"
    summary = rp.write_report(str(store), str(page))
    shot = tmp_path / "shot.png"
    dom, console = open_page(browser, page, tmp_path, shot=shot)

    # nothing on the page's console: no script error, no blocked (external) load, no CSP violation
    ours = [c for c in console if page.as_uri() in c or "Uncaught" in c or "ERROR:CONSOLE" in c]
    assert ours == [], "\n".join(ours)
    # the DOM Chromium built holds the plots as inline images, and the finding
    imgs = Imgs(dom).imgs
    assert {"heatmap", "durations"} <= set(imgs)
    assert all(a["src"].startswith("data:image/png;base64,") for a in imgs.values())
    assert "HANG not-entered [2] gloo:0 seq 57 allreduce" in dom

    img = Image.open(shot).convert("RGB")
    assert img.size == WINDOW
    px = np.asarray(img, dtype=np.uint32).reshape(-1, 3)
    packed = px[:, 0] << 16 | px[:, 1] << 8 | px[:, 2]
    colours, n = np.unique(packed, return_counts=True)
    assert 1 - n.max() / packed.size > 0.01, "screenshot is (nearly) one colour"
    counts = {int(c): int(k) for c, k in zip(colours, n)}

    def count(rgb_):
        return counts.get(rgb_[0] << 16 | rgb_[1] << 8 | rgb_[2], 0)

    # the heatmap was decoded and drawn 1:1: its hung cell and its straggler's row are on screen
    heat = summary["heatmap"]
    x0, y0, x1, y1 = heat["box"]
    cell_w, cell_h = (x1 - x0) / len(heat["seqs"]), (y1 - y0) / len(heat["ranks"])
    assert count(rgb(rpl.MISSING_COLOUR)) >= 0.8 * cell_w * cell_h, "hung rank's cell is not on screen"
    html_img = Page(page.read_text()).img("heatmap")
    hot = decode_png(html_img).getpixel(cell_centre(html_img, SLOW_RANK, HUNG_SEQ - 1))
    assert count(hot) >= 0.8 * (x1 - x0) * cell_h * (HUNG_SEQ - 1) / HUNG_SEQ, "straggler row not on screen"


def test_link_matrix_renders_in_chromium(browser, tmp_path):
    """A report with link data (a hang caused by link 1-2): both link heatmaps are decoded and drawn,
    with the named link's red boxes on screen, and the console stays clean."""
    from PIL import Image
    from test_export_links import hung_link_store
    from ccld.export import report_links as rl
    page = tmp_path / "report.html"
    rp.write_report(str(hung_link_store(tmp_path / "store")), str(page))
    shot = tmp_path / "shot.png"
    tall = tmp_path / "tall"
    tall.mkdir()
    dom, console = open_page(browser, page, tall, shot=shot, window=(WINDOW[0], 4000))
    ours = [c for c in console if page.as_uri() in c or "Uncaught" in c or "ERROR:CONSOLE" in c]
    assert ours == [], "\n".join(ours)
    imgs = Imgs(dom).imgs
    assert {"links", "links-retrans"} <= set(imgs) and imgs["links"]["data-marked"] == "1-2 2-1"
    px = np.asarray(Image.open(shot).convert("RGB"), dtype=np.uint32).reshape(-1, 3)
    red = rgb(rl.FINDING_COLOUR)
    boxed = int(np.sum((px[:, 0] == red[0]) & (px[:, 1] == red[1]) & (px[:, 2] == red[2])))
    drawn = 0  # red pixels of the boxes in the two images as written: all of them must be on screen
    for id_ in ("links", "links-retrans"):
        im = np.asarray(decode_png(imgs[id_]), dtype=np.uint32).reshape(-1, 3)
        drawn += int(np.sum((im[:, 0] == red[0]) & (im[:, 1] == red[1]) & (im[:, 2] == red[2])))
    box = [int(v) for v in imgs["links"]["data-box"].split(",")]
    assert drawn >= 2 * 2 * 4 * (box[2] - box[0]) / 4  # 2 images x 2 boxes x 4 sides of a cell, 1 px or more
    assert boxed >= drawn, f"{boxed} red px on screen, {drawn} in the images"
