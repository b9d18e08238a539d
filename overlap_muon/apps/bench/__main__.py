"""``python -m overlap_muon.apps.bench``: the same as the ``overlap-muon-bench`` console script."""

import sys

from overlap_muon.apps.bench import main

sys.exit(main())
