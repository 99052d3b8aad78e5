"""``python -m cpsparse``: run the DSA ops once on random data and report."""

import sys

from cpsparse.demo import main

sys.exit(main())
