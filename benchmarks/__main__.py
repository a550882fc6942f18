"""``python -m benchmarks [SUITE] [--quick] [--out DIR]``: ``corun bench``."""

import sys

from benchmarks.suite import main

sys.exit(main())
