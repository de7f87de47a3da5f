"""`make setup`/`make train` set up Python only; the system tools (Prometheus, Chromium) are installed by the targets
that run them, with apt-get install --no-install-recommends, saying what else it upgrades. The recipe runs for real,
with a stand-in apt-get on PATH that records its calls (installing system packages is not a test's business)."""

import os
import subprocess
from pathlib import Path

from tests.conftest import REPO


def dry_run(*targets: str) -> str:
    return subprocess.run(["make", "-n", *targets], cwd=REPO, check=True, capture_output=True, text=True).stdout


def test_setup_and_train_touch_no_system_package_and_test_and_monitor_install_the_tools():
    assert "apt-get" not in dry_run("setup", "train")
    for target in ("test", "monitor"):
        recipe = dry_run(target)
        assert "apt-get install -y -qq --no-install-recommends" in recipe, recipe
        assert "upgrade" not in recipe.replace("--upgrade pip", "").replace("upgrades", ""), recipe


def test_missing_tools_are_installed_without_recommends_and_upgrades_are_announced(tmp_path):
    calls = tmp_path / "apt-calls"
    stub = tmp_path / "bin" / "apt-get"
    stub.parent.mkdir()
    # A simulated install that has to upgrade one installed package (an Inst line with the old version in brackets)
    stub.write_text(f'#!/bin/sh\necho "$*" >> {calls}\ncase "$*" in *-s*) '
                    'echo "Inst libfoo1 [1.0] (1.1 Debian:stable [amd64])"; echo "Inst tool-a (2.0 Debian:stable)";; '
                    'esac\n')
    stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{stub.parent}:{os.environ['PATH']}"}
    proc = subprocess.run(["make", "--no-print-directory", "system-tools", "SYSTEM_TOOLS=no-such-tool-a"], cwd=REPO,
                          env=env, check=False, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    if os.geteuid() == 0:
        assert calls.read_text().splitlines() == ["update -qq", "install -s --no-install-recommends no-such-tool-a",
                                                  "install -y -qq --no-install-recommends no-such-tool-a"]
        assert "apt-get install --no-install-recommends no-such-tool-a" in proc.stdout
        assert "apt-get also upgrades, as no-such-tool-a requires: libfoo1" in proc.stdout
    else:  # not root: nothing installed, a message says what to install
        assert not calls.exists()
        assert "sudo apt-get install --no-install-recommends no-such-tool-a" in proc.stderr
    # Tools already there: apt-get is not called at all.
    calls.unlink(missing_ok=True)
    subprocess.run(["make", "system-tools", "SYSTEM_TOOLS=sh"], cwd=REPO, env=env, check=True, capture_output=True)
    assert not Path(calls).exists()
