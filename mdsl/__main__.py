"""`python -m mdsl ...`: the same as the `mdsl` command."""
import sys

from mdsl.cli import main

sys.exit(main())
