"""``pip install ARGS`` into this interpreter's environment, done by uv where uv can be had, else by pip.

Usage: PYTHON tools/install.py PIP-INSTALL-ARGS...  (the setup's installs: Makefile, tools/install_torch.sh)

Why uv: pip took about 50 s of a fresh ``make test`` on the 2-core machine (unpacking torch, libtpu and a hundred
other wheels, one at a time); uv 12 s on the idle machine. uv reads no pip configuration, so the options pip would install with
(its config files and PIP_* variables, merged by pip itself: indexes, find-links, constraints, certificate,
timeout) are passed on, and uv looks for the best version over every index, as pip does: both install from the
same places under the same constraints (their resolvers may settle on other versions within the same ranges). uv itself is installed with pip into the environment (one small wheel), once. Where it
cannot be installed, or its install fails, pip does the install, as before: the setup never depends on uv.
"""

import os
import subprocess
import sys
from pathlib import Path

UV = Path(sys.executable).parent / "uv"
UV_VERSION = "uv>=0.9,<1"


def pip(args: list[str]) -> int:
    return subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-compile", *args]).returncode


def pip_options():  # noqa: ANN201 -- pip's optparse Values
    """The options ``pip install`` would run with: its configuration files and PIP_* variables, merged by pip."""
    from pip._internal.commands import create_command

    return create_command("install").parse_args([])[0]


def _exists(location: str) -> bool:
    """A local index or find-links folder that is missing is skipped by pip (with a warning); uv would stop on it."""
    if "://" in location and not location.startswith("file://"):
        return True
    return Path(location.removeprefix("file://")).exists()


def uv_command(args: list[str]) -> tuple[list[str], dict[str, str]]:
    """The uv call installing ``args`` as pip would (pip's own options passed on), and its environment."""
    options = pip_options()
    command = [str(UV), "pip", "install", "--quiet", "--python", sys.executable, "--index-strategy",
               "unsafe-best-match"]  # pip's: the best version over every index
    command += ["--no-index"] if options.no_index else ["--index-url", options.index_url]
    command += [word for url in options.extra_index_urls if _exists(url) for word in ("--extra-index-url", url)]
    command += [word for link in options.find_links if _exists(link) for word in ("--find-links", link)]
    command += [word for path in options.constraints for word in ("--constraint", path)]
    env = dict(os.environ)
    if options.cert:
        env["SSL_CERT_FILE"] = options.cert
    env.setdefault("UV_HTTP_TIMEOUT", str(int(options.timeout)))
    return command + args, env


def main(args: list[str]) -> int:
    if not UV.exists() and pip([UV_VERSION]) != 0:
        print("tools/install.py: uv could not be installed; installing with pip", file=sys.stderr)
        return pip(args)
    try:
        command, env = uv_command(args)
    except Exception as error:  # pip's options unreadable (another pip): pip installs, with them
        print(f"tools/install.py: pip's options could not be read ({error}); installing with pip", file=sys.stderr)
        return pip(args)
    if subprocess.run(command, env=env).returncode == 0:
        return 0
    print("tools/install.py: uv's install failed (above); installing with pip", file=sys.stderr)
    return pip(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
