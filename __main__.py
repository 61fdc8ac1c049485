"""Entry point for ``python -m sdopt``."""
import sys

from .tools.cli import main

sys.exit(main())
