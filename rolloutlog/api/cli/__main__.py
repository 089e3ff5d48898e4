"""``python -m rolloutlog.api.cli``: the ``rolloutlog`` command."""

import sys

from rolloutlog.api.cli import main

sys.exit(main())
