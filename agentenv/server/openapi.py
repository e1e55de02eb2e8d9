"""Write the control plane's OpenAPI document (the one served at /openapi.json) to a file:
`python -m agentenv.server.openapi [PATH]` (default docs/agentenv-openapi.json)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from agentenv.paths import PROJECT_ROOT
from agentenv.server.settings import ServerSettings

DEFAULT_PATH = PROJECT_ROOT / "docs" / "agentenv-openapi.json"


def document() -> dict:
    """The OpenAPI document the server serves, built without starting it or touching Docker."""
    from agentenv.server.app import create_api
    from agentenv.server.state import ServerState

    settings = ServerSettings.load()
    routes_only = ServerState(settings, Path("."), "", None, None)  # type: ignore[arg-type]
    return create_api(routes_only, reaper=False).openapi()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    path = Path(args[0]) if args else DEFAULT_PATH
    path.write_text(json.dumps(document(), indent=2, sort_keys=True) + "\n")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
