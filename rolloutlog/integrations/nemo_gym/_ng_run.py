"""rolloutlog under stock ``ng_run``: a directory of server shims that ``ng_run`` picks first.

``ng_run`` looks for a server's code in ``<cwd>/<server type>/<impl>/`` before its install (when
that directory has a ``requirements.txt``), runs its entrypoint there as ``python <entrypoint>``
with the resolved config in ``NEMO_GYM_CONFIG_DICT``, and with ``skip_venv_if_present=true``
only activates ``<uv_venv_dir>/<server type>/<impl>/.venv`` instead of building one with uv.
``write_overlay`` writes, for every server of a config, such a directory whose entrypoint is a
shim calling ``serve()`` (the launcher's: the same server class, rolloutlog attached) and whose
``.venv`` links to this venv. Then, from that directory::

    ng_run "+config_paths=[my_env.yaml]" +skip_venv_if_present=true +uv_venv_dir=$PWD

starts the servers as ``ng_run`` does (its head server and its Ray cluster, which these servers
do not use), each one rolloutlog's participant.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rolloutlog.integrations.nemo_gym._config import server_dict, server_instances

__all__ = ["SHIM", "write_overlay"]

SHIM = '''"""rolloutlog's shim for ng_run: this server as NeMo Gym builds it, rolloutlog attached."""

from rolloutlog.integrations.nemo_gym import serve

if __name__ == "__main__":
    serve()
'''


def write_overlay(
    config: Mapping[str, Any], directory: Path, venv: Path | None = None
) -> list[Path]:
    """Write the shim directories of every server in ``config`` under ``directory``; their
    ``.venv`` links to ``venv`` (default: this interpreter's). Returns the directories."""
    venv = Path(sys.prefix) if venv is None else venv
    written: list[Path] = []
    for name, (server_type, impl) in server_instances(config).items():
        entrypoint = str(server_dict(config, name)["entrypoint"])
        target = directory / server_type / impl
        target.mkdir(parents=True, exist_ok=True)
        (target / entrypoint).write_text(SHIM)
        (target / "requirements.txt").write_text("# served by rolloutlog's shim; see app.py\n")
        link = target / ".venv"
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(venv, target_is_directory=True)
        written.append(target)
    return written
