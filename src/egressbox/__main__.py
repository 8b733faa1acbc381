"""`python -m egressbox`."""

import sys

from egressbox.cli import main

sys.exit(main())
