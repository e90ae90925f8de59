"""``python -m jax_kvcached.cli``."""

import sys

from jax_kvcached.cli import main

sys.exit(main())
