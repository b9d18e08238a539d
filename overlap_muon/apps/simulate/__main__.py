"""``python -m overlap_muon.apps.simulate``."""

import sys

from .cli import main

sys.exit(main())
