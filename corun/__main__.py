"""``python -m corun``: the ``corun`` command (what torchrun's ``-m corun`` runs per rank)."""

import sys

from corun.host.entry import main

sys.exit(main())
