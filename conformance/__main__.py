"""python -m conformance: the same as the mhc-ar-conformance command."""

import sys

from .cli import main

sys.exit(main())
