"""``python -m lowbit ARGS``: the same as the ``lowbit`` script."""
import sys

from .cli import main

sys.exit(main())
