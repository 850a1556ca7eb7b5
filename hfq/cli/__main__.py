"""`python -m hfq.cli ...` runs the `hfq` command."""
import sys

from . import main

sys.exit(main())
