"""deploy/remote/host/dists.py: installed distributions read from metadata files, checked against
importlib.metadata, packaging and pip's own readers on real environments."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.utils import canonicalize_name

from deploy.remote.host import dists as D

SOURCE = Path(D.__file__).read_text()


def test_normalize_is_canonicalize_name():
    for name in ("Flashinfer_Python", "sglang-kernel", "zope.interface", "A__B--c..D", "torch"):
        assert D.normalize(name) == canonicalize_name(name)


def test_parse_metadata_reads_headers_only_and_unfolds():
    text = ("Metadata-Version: 2.1\r\nName: Foo_Bar\r\nVersion: 1.0+cu130\r\nRequires-Python: >=3.10\r\n"
            "Requires-Dist: torch==2.11.0\r\nRequires-Dist: very-long-name>=1;\r\n"
            "  python_version >= \"3.8\"\r\nProvides-Extra: cu13\r\n\r\n"
            "Requires-Dist: in-the-description-body\r\n")
    m = D.parse_metadata(text)
    assert m["name"] == "Foo_Bar" and m["version"] == "1.0+cu130" and m["requires_python"] == ">=3.10"
    assert m["requires_dist"][0] == "torch==2.11.0"
    assert m["requires_dist"][1].startswith("very-long-name>=1;") and "python_version" in m["requires_dist"][1]
    assert len(m["requires_dist"]) == 2 and m["provides_extra"] == ["cu13"]


def test_info_dir_name_like_pip():
    assert D.info_dir_name("Foo_Bar-1.0.dist-info") == ("Foo_Bar", "1.0")
    assert D.info_dir_name("torch-2.11.0+cu130.dist-info") == ("torch", "2.11.0+cu130")
    assert D.info_dir_name("foo-1.0-py3.11.egg-info") == ("foo", None)
    assert D.info_dir_name("foo.dist-info") == ("foo", None)
    assert D.info_dir_name("foo.py") is None and D.info_dir_name("foo.pth") is None


def test_egg_info_requires_matches_pip(tmp_path):
    """requires.txt sections become markers exactly as pip's own metadata backend converts them."""
    egg = tmp_path / "demo-1.0-py3.11.egg-info"
    egg.mkdir()
    (egg / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n")
    req_txt = ("numpy>=1\n# comment\n\n[:python_version < \"3.8\"]\nimportlib-metadata\n\n[Fast_Path]\ncython\n\n"
               "[gpu:sys_platform == \"linux\"]\ncupy>=12\n")
    (egg / "requires.txt").write_text(req_txt)
    code = ("import json,sys; from pip._internal.metadata import get_environment\n"
            "d = get_environment([sys.argv[1]]).get_distribution('demo')\n"
            "print(json.dumps(d.metadata.get_all('Requires-Dist')))")
    pips = json.loads(subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                                     check=True).stdout)
    assert D.egg_info_requires(req_txt) == pips
    (rec,), problems = D.find_distributions([str(tmp_path)])
    assert rec["kind"] == "egg-info" and rec["requires_dist"] == pips and not problems


def test_marker_environment_is_packagings():
    assert D.marker_environment() == {k: v for k, v in default_environment().items() if k in D.marker_environment()}
    assert set(D.marker_environment()) >= {"python_version", "sys_platform", "platform_machine", "platform_system"}


def test_collect_agrees_with_importlib_metadata_on_this_venv():
    """The collector, run as a program by this venv's interpreter, sees what importlib.metadata sees."""
    out = subprocess.run([sys.executable, "-c", SOURCE], capture_output=True, text=True, check=True, cwd="/")
    got = json.loads(out.stdout)
    mine = {canonicalize_name(d["name"]): d for d in got["distributions"]}
    seen = set()
    for dist in metadata.distributions():
        name = canonicalize_name(dist.metadata["Name"])
        if name in seen:
            continue
        seen.add(name)
        assert name in mine, name
        assert mine[name]["version"] == dist.version, name
        assert mine[name]["requires_dist"] == [r.strip() for r in (dist.requires or [])], name
        assert mine[name]["requires_python"] == dist.metadata.get("Requires-Python"), name
    assert len(mine) >= 50 and got["python"] == ".".join(map(str, sys.version_info[:3]))
    torch = mine["torch"]
    assert torch["wheel_tags"] and torch["path"].endswith(".dist-info")


def test_first_path_wins_and_bad_metadata_is_a_problem(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d, v in ((a, "2.0"), (b, "1.0")):
        di = d / f"pkg-{v}.dist-info"
        di.mkdir(parents=True)
        (di / "METADATA").write_text(f"Metadata-Version: 2.1\nName: pkg\nVersion: {v}\n")
    broken = b / "broken.dist-info"
    broken.mkdir()
    (broken / "METADATA").write_text("Metadata-Version: 2.1\n")
    (b / "gone-1.0.dist-info").mkdir()                   # no METADATA at all
    found, problems = D.find_distributions([str(a), str(b), str(tmp_path / "missing")])
    assert [(d["name"], d["version"]) for d in found] == [("pkg", "2.0")]
    assert sorted(os.path.basename(p["path"]) for p in problems) == ["broken.dist-info", "gone-1.0.dist-info"]


def test_hundreds_of_distributions_with_long_descriptions(tmp_path):
    """400 metadata directories whose descriptions are long: every header block is read whole."""
    body = "x" * 200_000
    for i in range(400):
        di = tmp_path / f"p{i}-1.0.dist-info"
        di.mkdir()
        (di / "METADATA").write_text(f"Metadata-Version: 2.1\nName: p{i}\nVersion: 1.0\nRequires-Dist: p{i + 1}\n\n{body}")
    found, _ = D.find_distributions([str(tmp_path)])
    assert len(found) == 400 and all(d["requires_dist"] for d in found)
