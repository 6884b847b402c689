"""``python -m cgregistry``: the same command line as the ``cgregistry`` script."""

import sys

from cgregistry.cli.commands import main

sys.exit(main())
