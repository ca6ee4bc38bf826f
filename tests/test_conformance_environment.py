"""What a report says it ran on."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import mhc_ar
from conformance import environment
from conformance.environment import collect_environment

ROOT = Path(__file__).resolve().parent.parent


def test_package_version_matches_pyproject():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert mhc_ar.__version__ == declared


def test_environment_without_a_gpu():
    env = collect_environment("cpu")
    assert env["gpu"] is None
    assert env["versions"]["mhc_ar"] is not None and env["versions"]["torch"] is not None
    assert env["git_commit"] is None or re.fullmatch(r"[0-9a-f]{12}(\+modified)?", env["git_commit"])


def test_a_modified_tree_is_reported(tmp_path, monkeypatch):
    """A copy of the sources whose tracked files differ from HEAD reports commit+modified."""
    package = tmp_path / "conformance"
    package.mkdir()
    (tmp_path / "tracked.txt").write_text("a")
    git = ["git", "-C", str(tmp_path), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "tracked.txt"], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    monkeypatch.setattr(environment, "__file__", str(package / "environment.py"))
    clean = environment._git_commit()
    assert re.fullmatch(r"[0-9a-f]{12}", clean)
    (tmp_path / "tracked.txt").write_text("b")
    assert environment._git_commit() == clean + "+modified"
