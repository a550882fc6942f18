"""``python -m corun.bench [SUITE] [--quick] [--out DIR]``: ``corun bench``."""

import sys

from corun.bench.suite import main

sys.exit(main())
