"""docs/check_site.py's judgements that need no browser: which file a link names, which
links and images are broken, what counts as scrolling sideways, the server's log of
failed answers. `make docs-check` runs the whole check in Chromium."""

from __future__ import annotations

import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs"))

from check_site import check_links, layout_problems, serve, site_file

ORIGIN = "http://127.0.0.1:8000"


@pytest.fixture
def site(tmp_path: Path) -> Path:
    (tmp_path / "masks").mkdir()
    (tmp_path / "masks" / "index.html").write_text("<h1 id='masks'>Masks</h1>")
    (tmp_path / "index.html").write_text("home")
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "causal.png").write_bytes(b"png")
    return tmp_path


def test_a_link_names_a_file_of_the_site_or_nothing(site: Path):
    assert site_file(site, ORIGIN, f"{ORIGIN}/") == site / "index.html"
    assert site_file(site, ORIGIN, f"{ORIGIN}/masks/") == site / "masks" / "index.html"
    assert site_file(site, ORIGIN, f"{ORIGIN}/masks") == site / "masks" / "index.html"
    assert site_file(site, ORIGIN, f"{ORIGIN}/images/causal.png") == site / "images/causal.png"
    assert site_file(site, ORIGIN, f"{ORIGIN}/nowhere/") is None
    assert site_file(site, ORIGIN, f"{ORIGIN}/../index.html") == site / "index.html"


def test_broken_links_anchors_and_images_are_found_outside_links_are_not(site: Path):
    scans = {
        f"{ORIGIN}/": {
            "links": [
                f"{ORIGIN}/masks/#masks",
                f"{ORIGIN}/masks/#gone",
                f"{ORIGIN}/nowhere/",
                "https://github.com/example",
                f"{ORIGIN}/images/causal.png",
            ],
            "images": [
                {"src": f"{ORIGIN}/images/causal.png", "broken": False},
                {"src": f"{ORIGIN}/images/missing.png", "broken": False},
                {"src": f"{ORIGIN}/images/causal.png", "broken": True},
            ],
            "ids": [],
        },
        f"{ORIGIN}/masks/": {"links": [], "images": [], "ids": ["masks"]},
    }
    found = check_links(site, ORIGIN, scans)
    assert found[f"{ORIGIN}/masks/"] == []
    assert found[f"{ORIGIN}/"] == [
        f"broken anchor: {ORIGIN}/masks/#gone",
        f"broken link: {ORIGIN}/nowhere/",
        f"broken image: {ORIGIN}/images/missing.png",
        f"image does not decode: {ORIGIN}/images/causal.png",
    ]


def test_a_code_block_or_the_page_scrolling_sideways_is_a_problem():
    wide = {"scroll": 800, "client": 733, "line": "out = ak.attention(q, k, v, mask)"}
    assert layout_problems({"wide": [], "page": [1280, 1280]}) == []
    assert layout_problems({"wide": [wide], "page": [1281, 1280]}) == [
        "code scrolls sideways (800 > 733 px): out = ak.attention(q, k, v, mask)"
    ]
    assert layout_problems({"wide": [], "page": [1400, 1280]}) == [
        "the page scrolls sideways (1400 > 1280 px)"
    ]


def test_the_server_serves_the_site_and_logs_each_failed_answer(site: Path):
    errors: list[str] = []
    with serve(site, errors) as origin:
        assert origin.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(f"{origin}/masks/") as answer:
            assert b"Masks" in answer.read()
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(f"{origin}/images/missing.png")
    assert errors == ["the server answered 404: /images/missing.png"]
