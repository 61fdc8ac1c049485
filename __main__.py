"""Entry point for ``python -m sdopt``."""
import sys

from .cli import main

sys.exit(main())
