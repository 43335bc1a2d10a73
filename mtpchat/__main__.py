"""`python -m mtpchat` is the `mtpchat` command."""
import sys

from mtpchat.cli import main

sys.exit(main())
