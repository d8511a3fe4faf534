#!/usr/bin/env python
"""EdgeCache's command-line utility: Django's commands for the control plane, and ``edge`` for a board.

``manage.py edge`` runs an edge board without the control plane's settings (no database,
no signing secret): it reads its configuration from the environment alone.
"""

import os
import sys


def main() -> None:
    if sys.argv[1:2] == ["edge"]:
        from inference.board.main import main as edge_main

        sys.exit(edge_main(sys.argv[2:]))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dashboard.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
