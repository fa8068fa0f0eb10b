"""``python -m lowbit.cli ARGS``: the same as the ``lowbit`` script."""
import sys

from . import main

sys.exit(main())
