"""``python -m dynjax.report WORKDIR [--out DIR]``: see `dynjax.report.cli`."""

import sys

from dynjax.report.cli import main

sys.exit(main())
