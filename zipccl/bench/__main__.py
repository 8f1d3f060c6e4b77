"""``python -m zipccl.bench`` runs zipccl-perf."""

import sys

from .perf import main

sys.exit(main())
