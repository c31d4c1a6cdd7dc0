"""`python -m jlora.bench.tpu`: `jlora bench tpu` (jlora.bench.tpu.cli)."""

import sys

from jlora.bench.tpu.cli import main

sys.exit(main())
