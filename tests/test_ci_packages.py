"""`.ci/test-packages`, the best-effort apt step of `.ci/run`, on a PATH of fakes: each group of
packages is its own install (a distribution without `chromium` still gets HAProxy and node),
nothing present is asked for, and it exits 0 whatever apt, sudo or the registry do."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / ".ci" / "test-packages"
# apt-get records its arguments and fails on the packages in $REFUSE (or on `update` when asked).
FAKE_APT = """#!/bin/bash
echo "$*" >> "$APT_LOG"
[ "$1" = update ] && exit "${UPDATE_RC:-0}"
for p in "$@"; do case " $REFUSE " in *" $p "*) exit 100;; esac; done
exit 0
"""
FAKE_SUDO = '#!/bin/bash\n[ "$1" = -n ] && shift\nexec "$@"\n'
FAKE_ID = "#!/bin/bash\necho 1000\n"  # not root: the script goes through sudo -n


def run(tmp_path: Path, *, tools: tuple[str, ...] = (), apt: bool = True, sudo: bool = True, **env: str):
    """The script on a PATH holding only bash, env, timeout, the fakes and `tools` (empty stubs)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for real in ("bash", "env", "timeout"):
        (bin_dir / real).symlink_to(str(shutil.which(real)))
    fakes = {"id": FAKE_ID} | ({"apt-get": FAKE_APT} if apt else {}) | ({"sudo": FAKE_SUDO} if sudo else {})
    for name in tools:
        fakes[name] = "#!/bin/bash\n"
    for name, text in fakes.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "apt.log"
    # HAPROXY: the script also looks off the PATH (/usr/sbin); point it where nothing is
    env = {"PATH": str(bin_dir), "APT_LOG": str(log), "HAPROXY": str(tmp_path / "no-haproxy"), **env}
    done = subprocess.run(
        [str(bin_dir / "bash"), str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60
    )
    calls = log.read_text().splitlines() if log.exists() else []
    return done, calls


@pytest.mark.skipif(shutil.which("timeout") is None, reason="no coreutils timeout")
class TestCiPackages:
    def test_a_refused_package_does_not_stop_the_others(self, tmp_path: Path) -> None:
        done, calls = run(tmp_path, REFUSE="chromium")
        assert done.returncode == 0, done.stderr
        installs = [c for c in calls if c.startswith("install")]
        assert calls[0] == "update -qq"
        assert [c.split()[-1] for c in installs] == ["haproxy", "chromium-driver", "nodejs"], calls
        assert "chromium chromium-driver could not be installed" in done.stderr

    def test_nothing_present_is_asked_for(self, tmp_path: Path) -> None:
        done, calls = run(tmp_path, tools=("haproxy", "chromium-browser", "chromedriver", "node"))
        assert done.returncode == 0 and calls == [], (done.stderr, calls)

    def test_only_the_missing_group_is_installed(self, tmp_path: Path) -> None:
        done, calls = run(tmp_path, tools=("haproxy", "chromium", "node"))  # no driver
        assert done.returncode == 0
        assert calls == ["update -qq", "install -y -qq --no-install-recommends chromium chromium-driver"]

    def test_a_failed_update_installs_nothing_and_passes(self, tmp_path: Path) -> None:
        done, calls = run(tmp_path, UPDATE_RC="100")
        assert done.returncode == 0 and calls == ["update -qq"]
        assert "apt-get update failed" in done.stderr

    @pytest.mark.parametrize(("apt", "sudo"), [(False, True), (True, False)])
    def test_without_apt_or_sudo_it_passes(self, tmp_path: Path, apt: bool, sudo: bool) -> None:
        done, calls = run(tmp_path, apt=apt, sudo=sudo)
        assert done.returncode == 0 and calls == [], (done.stderr, calls)
