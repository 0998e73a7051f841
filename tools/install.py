"""``pip install ARGS`` into this interpreter's environment, done by uv where uv can be had, else by pip.

Usage: PYTHON tools/install.py PIP-INSTALL-ARGS...  (the setup's installs: Makefile, tools/install_torch.sh)

Why uv: pip took about 50 s of a fresh ``make test`` on the 2-core machine (unpacking torch, libtpu and a hundred
other wheels, one at a time); uv installs the same packages in about 6 s from its cache. uv reads no pip
configuration, so the options pip is configured with (its config files and PIP_* variables: indexes, find-links,
constraints, certificates) are passed on, and both resolve alike; uv's index strategy is set to pip's (the best
version over every index). uv itself is installed with pip into the environment (one small wheel), once. Where it
cannot be installed, or its install fails, pip does the install, as before: the setup never depends on uv.
"""

import os
import shlex
import subprocess
import sys
from pathlib import Path

# pip's option -> uv's, for the options that decide what is installed from where.
PASSED_ON = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
             "constraint": "--constraint", "no-index": "--no-index"}
UV = Path(sys.executable).parent / "uv"
UV_VERSION = "uv>=0.9,<1"


def pip(args: list[str]) -> int:
    return subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-compile", *args]).returncode


def pip_configuration() -> dict[str, str]:
    """pip's configured options (files and PIP_* variables; a variable wins, as in pip), by option name."""
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    options: dict[str, str] = {}
    for line in sorted(listed.stdout.splitlines(), key=lambda line: line.startswith(":env:")):
        key, _, value = line.partition("=")
        options[key.rpartition(".")[2]] = value.strip("'\"")
    return options


def uv_command(args: list[str]) -> tuple[list[str], dict[str, str]]:
    """The uv call installing ``args`` as pip would, and its environment."""
    command = [str(UV), "pip", "install", "--quiet", "--python", sys.executable, "--index-strategy",
               "unsafe-best-match"]
    env = dict(os.environ)
    for option, value in pip_configuration().items():
        if option in PASSED_ON:
            for word in shlex.split(value) if option != "no-index" else [""]:
                # pip skips a file:// index that does not exist (with a warning); uv would stop on it.
                if not word.startswith("file://") or Path(word.removeprefix("file://")).exists():
                    command += [PASSED_ON[option], word] if word else [PASSED_ON[option]]
        elif option == "cert":
            env.setdefault("SSL_CERT_FILE", value)
        elif option == "timeout" or option == "default-timeout":
            env.setdefault("UV_HTTP_TIMEOUT", value)
    return command + args, env


def main(args: list[str]) -> int:
    if not UV.exists() and pip([UV_VERSION]) != 0:
        print("tools/install.py: uv could not be installed; installing with pip", file=sys.stderr)
        return pip(args)
    command, env = uv_command(args)
    if subprocess.run(command, env=env).returncode == 0:
        return 0
    print("tools/install.py: uv's install failed (above); installing with pip", file=sys.stderr)
    return pip(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
